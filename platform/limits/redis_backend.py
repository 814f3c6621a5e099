"""The Redis limit backend: the semantics of ``backend.py`` shared by every gateway.

Each call is one Lua script run (atomic on the server) over three keys of one tenant, all
with the same hash tag so they live on one Redis Cluster slot::

    {prefix}{<key>}:b   hash   r:l, r:t, t:l, t:t   bucket level and its time (ms)
    {prefix}{<key>}:l   zset   lease id → expiry (ms)
    {prefix}{<key>}:s   hash   lease id → sequences

Time is the Redis server's (``TIME``), so gateways with skewed clocks agree. Keys expire
once their leases have expired and their buckets would be full again.
"""

from __future__ import annotations

from typing import Any

from loramux.platform.limits.backend import Ask, Decision

LUA = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op = ARGV[1]

local function purge()
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
  for _, id in ipairs(expired) do redis.call('HDEL', KEYS[3], id) end
  if #expired > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end
end

local function level(name, cap)
  local v = redis.call('HMGET', KEYS[1], name .. ':l', name .. ':t')
  local lvl, at = tonumber(v[1]), tonumber(v[2])
  if not lvl or not at then return cap end
  return math.min(cap, lvl + math.max(0, now - at) * cap / 60000)
end

local function store(name, lvl, cap, until_ms)
  redis.call('HSET', KEYS[1], name .. ':l', string.format('%.6f', lvl), name .. ':t', now)
  return math.max(until_ms, now + (cap - lvl) * 60000 / cap + 1000)
end

local function keep_leases()
  local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
  if last[2] then
    local at = math.ceil(tonumber(last[2])) + 1000
    redis.call('PEXPIREAT', KEYS[2], at)
    redis.call('PEXPIREAT', KEYS[3], at)
  end
end

if op == 'acquire' then
  local lease, ttl = ARGV[2], tonumber(ARGV[3])
  local rpm, tpm, tokens = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
  local max_conc, max_seqs, seqs = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
  local busy = tonumber(ARGV[10])
  purge()
  local denied, retry = '', 0
  local function deny(name, wait)
    if denied == '' then denied = name end
    retry = math.max(retry, wait)
  end
  if max_conc > 0 and redis.call('ZCARD', KEYS[2]) + 1 > max_conc then
    deny('max_concurrent_requests', busy)
  end
  if max_seqs > 0 then
    local used = 0
    for _, v in ipairs(redis.call('HVALS', KEYS[3])) do used = used + tonumber(v) end
    if used + seqs > max_seqs then deny('max_queued_sequences', busy) end
  end
  local r, tk
  if rpm > 0 then
    r = level('r', rpm)
    if r < 1 then deny('requests_per_minute', (1 - r) * 60000 / rpm) end
  end
  if tpm > 0 then
    tk = level('t', tpm)
    local need = math.min(tokens, tpm)
    if tk < need then deny('tokens_per_minute', (need - tk) * 60000 / tpm) end
  end
  if denied ~= '' then return {0, denied, string.format('%.3f', retry)} end
  local until_ms = 0
  if rpm > 0 then until_ms = store('r', r - 1, rpm, until_ms) end
  if tpm > 0 then until_ms = store('t', tk - tokens, tpm, until_ms) end
  if until_ms > 0 then redis.call('PEXPIREAT', KEYS[1], math.ceil(until_ms)) end
  if max_conc > 0 or max_seqs > 0 then
    redis.call('ZADD', KEYS[2], now + ttl, lease)
    redis.call('HSET', KEYS[3], lease, seqs)
    keep_leases()
  end
  return {1, '', '0'}
elseif op == 'renew' then
  purge()
  if not redis.call('ZSCORE', KEYS[2], ARGV[2]) then return {0, '', '0'} end
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[2])
  keep_leases()
  return {1, '', '0'}
elseif op == 'release' then
  local correction, tpm = tonumber(ARGV[3]), tonumber(ARGV[4])
  purge()
  redis.call('ZREM', KEYS[2], ARGV[2])
  redis.call('HDEL', KEYS[3], ARGV[2])
  if tpm > 0 and correction ~= 0 then
    local lvl = math.min(tpm, level('t', tpm) - correction)
    redis.call('PEXPIREAT', KEYS[1], math.ceil(store('t', lvl, tpm, 0)))
  end
  return {1, '', '0'}
end
return redis.error_reply('unknown op ' .. tostring(op))
"""


def _n(value: int | None) -> int:
    return 0 if value is None else int(value)


class RedisBackend:
    """Limits in Redis through one Lua script. ``client`` is a ``redis.asyncio.Redis``;
    ``prefix`` namespaces the keys (tests use a unique one)."""

    dependency = "redis"

    def __init__(self, client: Any, prefix: str = "loramux:limits:") -> None:
        self.client = client
        self.prefix = prefix
        self._script = client.register_script(LUA)

    @classmethod
    def from_url(cls, url: str, prefix: str = "loramux:limits:", *,
                 timeouts: tuple[float, float] | None = None) -> RedisBackend:
        """A backend on its own connection pool for ``--redis-url``; ``timeouts`` are the
        (socket, connect) timeouts in seconds (a stalled Redis fails a call, not hangs it)."""
        import redis.asyncio

        socket, connect = timeouts or (None, None)
        return cls(redis.asyncio.Redis.from_url(url, socket_timeout=socket,
                                                socket_connect_timeout=connect), prefix)

    async def ping(self) -> None:
        """Raise unless Redis answers (readiness)."""
        await self.client.ping()

    def keys(self, key: str) -> list[str]:
        """The three Redis keys of one limiter key."""
        base = f"{self.prefix}{{{key}}}"
        return [f"{base}:b", f"{base}:l", f"{base}:s"]

    async def _run(self, key: str, *args: Any) -> tuple[bool, str, float]:
        allowed, limit, retry = await self._script(keys=self.keys(key), args=list(args))
        if isinstance(limit, bytes):
            limit, retry = limit.decode(), retry.decode()
        return bool(allowed), limit, float(retry)

    async def acquire(self, key: str, ask: Ask) -> Decision:
        allowed, limit, retry_ms = await self._run(
            key, "acquire", ask.lease, max(1, round(ask.lease_ttl_s * 1000)),
            _n(ask.requests_per_minute), _n(ask.tokens_per_minute), int(ask.tokens),
            _n(ask.max_concurrent_requests), _n(ask.max_queued_sequences), int(ask.sequences),
            round(ask.busy_retry_after_s * 1000),
        )  # fmt: skip
        return Decision(True) if allowed else Decision(False, limit, retry_ms / 1000)

    async def renew(self, key: str, lease: str, ttl_s: float) -> bool:
        allowed, _, _ = await self._run(key, "renew", lease, max(1, round(ttl_s * 1000)))
        return allowed

    async def release(
        self, key: str, lease: str, *, token_correction: int = 0,
        tokens_per_minute: int | None = None,
    ) -> None:
        await self._run(key, "release", lease, int(token_correction), _n(tokens_per_minute))

    async def aclose(self) -> None:
        await self.client.aclose()
