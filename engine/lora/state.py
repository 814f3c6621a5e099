"""Plain data the adapter manager shares: one adapter's state, the residency snapshot
the admin API shows, and the listener signature (its errors are in ``engine/errors.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loramux.engine.lora_request import LoRARequest


@dataclass
class AdapterState:
    """What the manager knows of one adapter."""

    request: LoRARequest
    rank: int
    kind: str = "LoRA"
    """``"LoRA"``, ``"DoRA"`` or ``"aLoRA"`` (``LoraSpec.kind``)."""
    invocation_tokens: tuple[int, ...] | None = None
    """An aLoRA's invocation token ids (``LoraSpec.alora_invocation_tokens``)."""
    load_seconds: float | None = None
    """Seconds of the last disk → CPU tier load."""
    slot_seconds: float | None = None
    """Seconds of the last CPU tier → device slot copy."""
    error: Exception | None = None


AdapterListener = Callable[[str, str], None]
"""``listener(event, key)``; event is ``loaded`` | ``evicted`` | ``dropped`` | ``broken``."""


@dataclass(frozen=True)
class ResidencySnapshot:
    """The adapters one engine knows, as of one moment (plain data, safe to share)."""

    rows: list[dict] = field(default_factory=list)
    """One per adapter, as :meth:`LoRAManager.residency`."""
    max_loras: int = 0
    """Device slots (derived from memory unless ``max_loras`` was set)."""
    num_evictions: int = 0
    lora_enabled: bool = False
    max_cpu_loras: int | None = None
    """Adapters the CPU tier holds."""
    load_stats: dict = field(default_factory=dict)
    """Loads per tier (``store`` | ``disk`` | ``cpu``): ``{"loads": n, "seconds": s}``."""

    def knows(self, key: str) -> bool:
        return any(r["name"] == key for r in self.rows)
