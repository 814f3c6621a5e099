"""``NoLoRA``: the engine's adapter manager when LoRA is off (``enable_lora=False``).

It answers every call the engine, the scheduler and the platform make of a
:class:`~loramux.engine.lora.manager.LoRAManager` (``enabled`` False, nothing resident,
nothing to do per step), so no call site checks for a missing manager.
"""

from __future__ import annotations

from collections.abc import Callable

from loramux.engine.errors import LoRAError
from loramux.engine.lora.manager import AdapterListener, ResidencySnapshot
from loramux.engine.lora_request import LoRARequest


class NoLoRA:
    """The null adapter manager."""

    enabled = False
    max_loras = 0
    num_evictions = 0

    def __init__(self) -> None:
        self.slot_of: dict[str, int] = {}

    def register(self, request: LoRARequest) -> None:
        raise LoRAError("this engine was started without LoRA (enable_lora=False)")

    def drop(self, key: str) -> None:
        """Nothing to forget."""

    def poll(self, wait: float = 0.0) -> None:
        """No background loads."""

    def failed(self) -> dict[str, Exception]:
        return {}

    def mark_broken(self, key: str, error: Exception) -> None:
        """No adapter runs here: nothing to mark."""

    def prepare_step(self, token_lora_keys: list[str | None]) -> None:
        """No adapter in any step."""

    def finish_step(self) -> None:
        """Nothing step-scoped."""

    def active(self) -> bool:
        return False

    def snapshot(self) -> ResidencySnapshot:
        return ResidencySnapshot()

    def add_listener(self, listener: AdapterListener) -> Callable[[], None]:
        return lambda: None
