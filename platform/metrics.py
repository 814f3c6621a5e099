"""Prometheus metrics, one ``CollectorRegistry`` per app (tests build many apps).

Per-adapter series carry an ``adapter`` label: the engine key of a tenant adapter
(``"<tenant id>/<name>@<digest>"``), the static adapter's key, or ``base``. Per-version
series (``loramux_adapter_version_*``) carry ``tenant`` (id), ``adapter`` (the name) and
``version``, so a canary compares with the live version (``histogram_quantile`` over
their TTFT / TPOT buckets). The usage writer's series are ``loramux_usage_records_*``.
Engine gauges (queue depth, KV cache usage, adapter residency) are refreshed from
the engine on every scrape.
"""

from __future__ import annotations

import threading
from collections import Counter as _Counter

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from loramux.engine.lora.manager import ResidencySnapshot
from loramux.platform.admin.activity import Activity
from loramux.platform.goodput_metrics import GoodputMetrics

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
_TIERS = ("gpu", "device", "cpu", "disk")


class Metrics:
    """All series of one server."""

    def __init__(self, goodput_ttft_s: float = 2.0, goodput_tpot_s: float = 0.25) -> None:
        """``goodput_*``: the per-request targets (Settings ``goodput_ttft_ms``/``_tpot_ms``)."""
        self.activity = Activity()
        """The rolling in-process window the dashboard reads (in flight, last minute)."""
        r = self.registry = CollectorRegistry()
        self._request_series(r)
        self.goodput = GoodputMetrics(r, goodput_ttft_s, goodput_tpot_s)
        self._latency_series(r)
        self._adapter_series(r)
        self._engine_series(r)
        self._spec_decode_series(r)
        self.rejected = Counter(
            "loramux_requests_rejected", "Requests refused before running.", ["reason"], registry=r
        )
        self._version_series(r)
        self._parser_series(r)
        self.usage = UsageSeries(r)
        """The usage writer's counters (``loramux_usage_records_*``)."""
        self._lock = threading.Lock()
        self._pending_evictions: _Counter[str] = _Counter()
        self._known_residency: set[tuple[str, str]] = set()

    # --- the series, by family (registered in this order) ---------------------------
    def _request_series(self, r: CollectorRegistry) -> None:
        """Requests, their tokens, time to first token and per output token."""
        self.requests = Counter(
            "loramux_requests", "Finished HTTP inference requests.",
            ["adapter", "endpoint", "status"], registry=r,
        )
        self.prompt_tokens = Counter(
            "loramux_prompt_tokens", "Prompt tokens processed.", ["adapter"], registry=r
        )
        self.generated_tokens = Counter(
            "loramux_generated_tokens", "Tokens generated.", ["adapter"], registry=r
        )
        self.ttft = Histogram(
            "loramux_time_to_first_token_seconds", "Time from arrival to the first token.",
            ["adapter"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "loramux_time_per_output_token_seconds", "Mean time between output tokens per request.",
            ["adapter"], buckets=_LATENCY_BUCKETS, registry=r,
        )

    def _latency_series(self, r: CollectorRegistry) -> None:
        """Gaps between a request's tokens, their target, end-to-end latency."""
        self.itl = Histogram(
            "loramux_inter_token_latency_seconds", "Gaps between a request's consecutive "
            "token-producing engine steps (what a streaming client sees between chunks).",
            ["adapter"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl_misses = Counter(
            "loramux_itl_misses", "Gaps between a request's tokens longer than the engine's "
            "inter-token latency target (--target-itl-ms, or the derived one); the share is "
            "this over loramux_inter_token_latency_seconds_count.", ["adapter"], registry=r,
        )
        self.itl_target = Gauge(
            "loramux_itl_target_seconds", "The engine's inter-token latency target as of the "
            "last finished request (0 until known).", registry=r,
        )
        self.e2e = Histogram(
            "loramux_e2e_request_latency_seconds", "Time from arrival to the last token.",
            ["adapter"], buckets=_LATENCY_BUCKETS, registry=r,
        )

    def _adapter_series(self, r: CollectorRegistry) -> None:
        """Where adapters sit, their loads and evictions."""
        self.residency = Gauge(
            "loramux_adapter_residency", "1 for the tier an adapter sits in (gpu|device|cpu|disk).",
            ["adapter", "tier"], registry=r,
        )
        self.adapter_pinned = Gauge(
            "loramux_adapter_pinned", "1 when the adapter is pinned.", ["adapter"], registry=r
        )
        self.load_seconds = Gauge(
            "loramux_adapter_load_seconds", "Seconds the adapter's last load from disk took.",
            ["adapter"], registry=r,
        )
        self.slot_seconds = Gauge(
            "loramux_adapter_slot_seconds", "Seconds the adapter's last CPU tier to device slot "
            "copy took.", ["adapter"], registry=r,
        )
        self.tier_loads = Gauge(
            "loramux_adapter_tier_loads", "Adapter loads since start by tier (store: fetched "
            "from the object store; disk: read into the CPU tier; cpu: copied into a slot).",
            ["tier"], registry=r,
        )
        self.tier_load_seconds = Gauge(
            "loramux_adapter_tier_load_seconds", "Seconds spent on adapter loads since start by "
            "tier.", ["tier"], registry=r,
        )
        self.evictions = Counter(
            "loramux_adapter_evictions", "Adapter slot evictions.", ["adapter"], registry=r
        )
        self.engine_evictions = Gauge(
            "loramux_engine_evictions", "Adapter slot evictions of the engine, all adapters.",
            registry=r,
        )

    def _engine_series(self, r: CollectorRegistry) -> None:
        """The engine's queues, KV cache, prefix cache, kernels and KV events."""
        self.waiting = Gauge(
            "loramux_num_requests_waiting", "Requests in the engine's waiting queue.", registry=r
        )
        self.running = Gauge(
            "loramux_num_requests_running", "Requests the engine is running.", registry=r
        )
        self.kv_usage = Gauge(
            "loramux_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", registry=r
        )
        self.preemptions = Gauge(
            "loramux_num_preemptions", "Preemptions since start.", registry=r
        )
        self.prefix_hit_rate = Gauge(
            "loramux_prefix_cache_hit_rate", "Fraction of prompt blocks served from the prefix cache.",
            registry=r,
        )
        self.cpu_kernels = Gauge(
            "loramux_cpu_kernels_available", "1 when the engine runs the compiled CPU kernels "
            "(torch.ops.loramux); 0 when they are missing (degraded: torch ops) or turned off.",
            registry=r,
        )
        self.kv_events_published = Gauge(
            "loramux_kv_events_published", "KV-event messages published over ZeroMQ since start "
            "(--kv-events-endpoint).", registry=r,
        )
        self.kv_events_dropped = Gauge(
            "loramux_kv_events_dropped", "KV events dropped since start because the publisher's "
            "queue was full (the engine step never waits).", registry=r,
        )

    def _spec_decode_series(self, r: CollectorRegistry) -> None:
        """Speculative decoding, per adapter (vLLM's spec_decode_* series)."""
        self.spec_drafts = Gauge(
            "loramux_spec_decode_num_drafts", "Speculative decoding: verify steps with drafted "
            "tokens since start, per adapter (vLLM's spec_decode_num_drafts).", ["adapter"],
            registry=r)
        self.spec_draft_tokens = Gauge(
            "loramux_spec_decode_num_draft_tokens", "Speculative decoding: tokens drafted since "
            "start, per adapter.", ["adapter"], registry=r)
        self.spec_accepted_tokens = Gauge(
            "loramux_spec_decode_num_accepted_tokens", "Speculative decoding: drafted tokens the "
            "model accepted since start, per adapter.", ["adapter"], registry=r)
        self.spec_accepted_per_pos = Gauge(
            "loramux_spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: verify "
            "steps whose draft at this position (0-based) was accepted, per adapter (vLLM's "
            "spec_decode_num_accepted_tokens_per_pos).", ["adapter", "position"], registry=r)
        self.spec_acceptance = Gauge(
            "loramux_spec_decode_acceptance_rate", "Speculative decoding: accepted / drafted "
            "tokens since start, per adapter.", ["adapter"], registry=r)

    def _version_series(self, r: CollectorRegistry) -> None:
        """Per tenant adapter version (a canary against the live version)."""
        version = ["tenant", "adapter", "version"]
        self.version_requests = Counter(
            "loramux_adapter_version_requests", "Finished requests per tenant adapter version.",
            [*version, "status"], registry=r)
        self.version_tokens = Counter(
            "loramux_adapter_version_tokens", "Tokens per tenant adapter version (kind: prompt, "
            "cached (prompt tokens from the prefix cache), completion).", [*version, "kind"],
            registry=r)
        self.version_ttft = Histogram(
            "loramux_adapter_version_time_to_first_token_seconds", "Time to first token per "
            "tenant adapter version.", version, buckets=_LATENCY_BUCKETS, registry=r)
        self.version_tpot = Histogram(
            "loramux_adapter_version_time_per_output_token_seconds", "Mean time per output token "
            "per tenant adapter version.", version, buckets=_LATENCY_BUCKETS, registry=r)

    def _parser_series(self, r: CollectorRegistry) -> None:
        """Tool calls and reasoning (chat requests the parsers read)."""
        self.tool_call_requests = Counter("loramux_tool_call_requests", "Chat requests "
                                          "answered with tool calls.", ["adapter"], registry=r)
        self.parser_failures = Counter("loramux_tool_parser_failures", "Answers that looked "
                                       "like a tool call but did not parse (served as content).",
                                       ["adapter", "parser"], registry=r)
        self.reasoning_tokens = Counter("loramux_reasoning_tokens", "Generated tokens inside "
                                        "a thought.", ["adapter"], registry=r)

    # --- recording --------------------------------------------------------------------
    def observe_parsing(self, adapter: str, parser: str | None, *, tools_called: bool,
                        parse_failed: bool, reasoning_tokens: int) -> None:
        """Once per finished chat request whose text went through the parsers."""
        self.tool_call_requests.labels(adapter).inc(int(tools_called))
        self.parser_failures.labels(adapter, parser or "json").inc(int(parse_failed))
        self.reasoning_tokens.labels(adapter).inc(reasoning_tokens)

    def observe_request(
        self,
        adapter: str,
        endpoint: str,
        status: str,
        *,
        prompt_tokens: int = 0,
        generated_tokens: int = 0,
        ttft: float | None = None,
        tpot: float | None = None,
        e2e: float | None = None,
        tenant: str = "",
    ) -> None:
        """Once per finished request (``tenant``: its id, empty for the server's own keys)."""
        self.requests.labels(adapter, endpoint, status).inc()
        if prompt_tokens:
            self.prompt_tokens.labels(adapter).inc(prompt_tokens)
        if generated_tokens:
            self.generated_tokens.labels(adapter).inc(generated_tokens)
        if ttft is not None:
            self.ttft.labels(adapter).observe(ttft)
        if tpot is not None:
            self.tpot.labels(adapter).observe(tpot)
        if e2e is not None:
            self.e2e.labels(adapter).observe(e2e)
        if ttft is not None and status == "ok":
            self.goodput.observe(tenant, adapter, ttft, tpot)

    def observe_itl(self, adapter: str, gaps: list[float], misses: int, target: float | None) -> None:
        """One finished request's gaps between tokens and how many missed the ITL target."""
        hist = self.itl.labels(adapter)
        for gap in gaps:
            hist.observe(gap)
        counter = self.itl_misses.labels(adapter)  # the series exists from the first request
        if misses:
            counter.inc(misses)
        if target is not None:
            self.itl_target.set(target)

    def observe_version(self, tenant_id: int, adapter: str, version: int, status: str, *,
                        prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                        ttft: float | None, tpot: float | None) -> None:
        """One finished request of a tenant adapter version (called with its usage record)."""
        labels = (str(tenant_id), adapter, str(version))
        self.version_requests.labels(*labels, status).inc()
        for kind, n in (("prompt", prompt_tokens), ("cached", cached_tokens),
                        ("completion", completion_tokens)):
            if n:
                self.version_tokens.labels(*labels, kind).inc(n)
        if ttft is not None:
            self.version_ttft.labels(*labels).observe(ttft)
        if tpot is not None:
            self.version_tpot.labels(*labels).observe(tpot)

    def goodput_share_value(self) -> float | None:
        """Share of checked requests that met both goodput objectives (None before any)."""
        return self.goodput.share_value()

    def goodput_report(self) -> dict[str, float | int | None]:
        """The objectives, the counts and the share, for the dashboard's overview."""
        return self.goodput.report()

    def on_adapter_event(self, event: str, adapter: str) -> None:
        """The engine's adapter listener (engine thread): counts evictions; safe from any
        thread."""
        if event != "evicted":
            return
        with self._lock:
            self._pending_evictions[adapter] += 1

    # --- scrape -------------------------------------------------------------------------
    def update_engine(self, stats, snapshot: ResidencySnapshot | None) -> None:
        """Refresh the engine gauges from one snapshot (called by ``GET /metrics``);
        ``snapshot`` None = the engine could not be asked."""
        residency = snapshot.rows if snapshot is not None else None
        total_evictions = snapshot.num_evictions if snapshot is not None else None
        if stats is not None:
            self.waiting.set(stats.num_waiting)
            self.running.set(stats.num_running)
            self.kv_usage.set(stats.kv_cache_usage)
            self.preemptions.set(stats.num_preemptions)
            self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
            self.cpu_kernels.set(1 if stats.cpu_kernels == "ok" else 0)
            for adapter, c in getattr(stats, "spec_decode", {}).items():
                self.spec_drafts.labels(adapter).set(c.num_drafts)
                self.spec_draft_tokens.labels(adapter).set(c.num_draft_tokens)
                self.spec_accepted_tokens.labels(adapter).set(c.num_accepted_tokens)
                self.spec_acceptance.labels(adapter).set(c.acceptance_rate)
                for pos, n in enumerate(c.accepted_per_pos):
                    self.spec_accepted_per_pos.labels(adapter, str(pos)).set(n)
        with self._lock:
            pending, self._pending_evictions = self._pending_evictions, _Counter()
        for adapter, n in pending.items():
            self.evictions.labels(adapter).inc(n)
        if total_evictions is not None:
            self.engine_evictions.set(total_evictions)
        for tier, row in (snapshot.load_stats if snapshot is not None else {}).items():
            self.tier_loads.labels(tier).set(row["loads"])
            self.tier_load_seconds.labels(tier).set(row["seconds"])
        if residency is None:
            return
        seen: set[tuple[str, str]] = set()
        for row in residency:
            name = row["name"]
            for tier in _TIERS:
                self.residency.labels(name, tier).set(1.0 if row["tier"] == tier else 0.0)
                seen.add((name, tier))
            self.adapter_pinned.labels(name).set(1.0 if row.get("pinned") else 0.0)
            if row.get("load_seconds") is not None:
                self.load_seconds.labels(name).set(row["load_seconds"])
            if row.get("slot_seconds") is not None:
                self.slot_seconds.labels(name).set(row["slot_seconds"])
        for name, tier in self._known_residency - seen:
            try:
                self.residency.remove(name, tier)
                if tier == _TIERS[0]:
                    self.adapter_pinned.remove(name)
                    self.load_seconds.remove(name)
                    self.slot_seconds.remove(name)
            except KeyError:
                pass
        self._known_residency = seen

    def render(self) -> bytes:
        return generate_latest(self.registry)


class UsageSeries:
    """The usage writer's series (``loramux.platform.usage.recorder.UsageCounters``)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self._written = Counter("loramux_usage_records_written", "Usage records written to "
                                "the database.", registry=r)
        self._spilled = Counter("loramux_usage_records_spilled", "Usage records written to the "
                                "local spill file while the database was down (replayed later).",
                                registry=r)
        self._dropped = Counter("loramux_usage_records_dropped", "Usage records lost (reason: "
                                "queue_full, spill_full, spill_failed, refused).", ["reason"],
                                registry=r)
        self._pending = Gauge("loramux_usage_records_pending", "Usage records not yet in the "
                              "database (where: queue, spill).", ["where"], registry=r)
        for reason in ("queue_full", "spill_full", "spill_failed", "refused"):
            self._dropped.labels(reason)

    def written(self, n: int) -> None:
        self._written.inc(n)

    def spilled(self, n: int) -> None:
        self._spilled.inc(n)

    def dropped(self, reason: str, n: int) -> None:
        self._dropped.labels(reason).inc(n)

    def pending(self, queued: int, spilled: int) -> None:
        self._pending.labels("queue").set(queued)
        self._pending.labels("spill").set(spilled)
