"""Goodput on /metrics: the finished requests that met both objectives — a first token within
``goodput_ttft_ms`` and a mean time per output token within ``goodput_tpot_ms`` — per tenant and
adapter, which objective a request missed, and the share over all checked requests (the admin
overview's figure). The engine's step budget aims at the same two objectives per step
(``engine/goodput.py``); these series say how that went."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["GoodputMetrics"]


class GoodputMetrics:
    """The goodput series of one registry."""

    def __init__(self, r: CollectorRegistry, ttft_s: float, tpot_s: float) -> None:
        self.ttft_s, self.tpot_s = ttft_s, tpot_s
        self.requests = Counter(
            "loramux_goodput_requests", "Finished requests checked against the goodput "
            "objectives, by whether they met both (objective_met: true | false).",
            ["tenant", "adapter", "objective_met"], registry=r)
        self.misses = Counter(
            "loramux_goodput_misses", "Checked requests that missed an objective, by which "
            "(objective: ttft | tpot; a request can miss both).",
            ["tenant", "adapter", "objective"], registry=r)
        self.share = Gauge("loramux_goodput_share", "Share of checked requests that met both "
                           "goodput objectives.", registry=r)
        self._counts = [0, 0]  # met, checked
        self._by_tenant: dict[str, list[int]] = {}  # tenant id ("": the server's keys) -> met, checked

    def observe(self, tenant: str, adapter: str, ttft: float, tpot: float | None) -> None:
        """One finished request with a first token (``tpot`` None: a single token, the TTFT
        decides)."""
        missed = [name for name, bad in (("ttft", ttft > self.ttft_s),
                                         ("tpot", tpot is not None and tpot > self.tpot_s)) if bad]
        for name in missed:
            self.misses.labels(tenant, adapter, name).inc()
        self.requests.labels(tenant, adapter, "false" if missed else "true").inc()
        for counts in (self._counts, self._by_tenant.setdefault(tenant, [0, 0])):
            counts[1] += 1
            counts[0] += not missed
        self.share.set(self._counts[0] / self._counts[1])

    def share_value(self) -> float | None:
        """Share of checked requests that met both (None before any)."""
        met, checked = self._counts
        return met / checked if checked else None

    def report(self) -> dict:
        """The objectives, the counts and the share, and the counts per tenant id, for the
        dashboard's overview."""
        met, checked = self._counts
        return {"ttft_ms": 1000 * self.ttft_s, "tpot_ms": 1000 * self.tpot_s,
                "met": met, "checked": checked, "share": self.share_value(),
                "tenants": {t: {"met": m, "checked": c} for t, (m, c) in sorted(self._by_tenant.items())}}
