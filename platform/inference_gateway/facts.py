"""From one engine's :class:`~loramux.engine.outputs.LoadReport` to the
:class:`~.exposition.ProtocolFacts` a scraper may read.

The tenancy rule lives here: the engine knows adapters by key (``"<tenant id>/<name>@<
digest>"``); a scraper learns only the names requests send in ``model``
(:func:`public_name`, the key's :class:`~loramux.platform.identity.EngineKey` name), each
once however many tenants
use it (routing accuracy only: the engine's caches stay keyed by tenant and content).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loramux.engine.outputs import LoadReport
from loramux.platform.identity import EngineKey
from loramux.platform.inference_gateway.exposition import ProtocolFacts, ResidentAdapter


def public_name(key: str) -> str:
    """The name requests send in ``model`` for the engine key ``key``: all that routers
    outside the tenant boundary see of an adapter (a key that is not an engine key, from
    an engine used without the resolver, is its own name)."""
    try:
        return EngineKey.parse(key).name
    except ValueError:
        return key


DEVICE_TIERS = ("gpu", "device")
"""The residency tiers that mean "in a device slot" (``device`` on a CPU engine)."""


def resident_adapters(rows: list[dict]) -> tuple[tuple[ResidentAdapter, ...], int, int]:
    """(one :class:`ResidentAdapter` per name at its best level, adapters in slots, in
    the CPU tier only) from residency rows; disk-only and broken adapters are not loaded."""
    best: dict[str, ResidentAdapter] = {}
    gpu = cpu = 0
    for row in rows:
        if row.get("error"):
            continue
        if row["tier"] in DEVICE_TIERS:
            level, gpu = "gpu", gpu + 1
        elif row["tier"] == "cpu":
            level, cpu = "cpu", cpu + 1
        else:
            continue
        name = public_name(row["name"])
        seen = best.get(name)
        if seen is None or (seen.level == "cpu" and level == "gpu"):
            best[name] = ResidentAdapter(name, level, bool(row.get("pinned")))
        elif seen.level == level and row.get("pinned") and not seen.pinned:
            best[name] = ResidentAdapter(name, level, True)
    return tuple(sorted(best.values(), key=lambda a: a.name)), gpu, cpu


def spec_totals(counts: dict, k: int) -> tuple[int, int, int, tuple[int, ...]]:
    """(drafts, drafted tokens, accepted tokens, accepted per position [k]) over all adapters
    of ``EngineStats.spec_decode`` (adapter key -> ``SpecCounts``): one engine's counters, as
    vLLM counts them (no per-adapter series leave the tenant boundary here)."""
    per_pos = [0] * k
    drafts = drafted = accepted = 0
    for c in counts.values():
        drafts += c.num_drafts
        drafted += c.num_draft_tokens
        accepted += c.num_accepted_tokens
        for pos, n in enumerate(c.accepted_per_pos[:k]):
            per_pos[pos] += n
    return drafts, drafted, accepted, tuple(per_pos)


@dataclass
class FactsBuilder:
    """Report -> facts with the server's fixed fields; the residency part is reused while
    the report carries the same residency snapshot (the engine refreshes it every 20 ms)."""

    model_name: str
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    lora_enabled: bool
    num_speculative_tokens: int = 0
    """``--speculative-config``'s tokens per draft; 0 = speculative decoding is off."""
    _residency: object = field(default=None, repr=False)
    _resident: tuple = field(default=((), 0, 0), repr=False)

    def __call__(self, report: LoadReport) -> ProtocolFacts:
        """What the protocol series say about ``report`` (names only)."""
        if report.residency is not self._residency:
            self._residency = report.residency
            self._resident = resident_adapters(report.residency.rows)
        resident, gpu, cpu = self._resident
        stats = report.stats
        spec = spec_totals(stats.spec_decode, self.num_speculative_tokens)
        return ProtocolFacts(
            model_name=self.model_name, taken_at=report.taken_at,
            num_running=stats.num_running, num_waiting=stats.num_waiting,
            kv_cache_usage=min(1.0, max(0.0, stats.kv_cache_usage)),
            block_size=report.block_size, num_gpu_blocks=report.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization,
            lora_enabled=self.lora_enabled, max_lora=report.residency.max_loras,
            running_adapters=tuple(sorted({public_name(k) for k in report.running_adapters})),
            waiting_adapters=tuple(sorted({public_name(k) for k in report.waiting_adapters})),
            resident=resident, num_gpu_loaded=gpu, num_cpu_loaded=cpu,
            num_speculative_tokens=self.num_speculative_tokens, spec_num_drafts=spec[0],
            spec_num_draft_tokens=spec[1], spec_num_accepted_tokens=spec[2],
            spec_accepted_per_pos=spec[3],
        )
