"""``NoLoRA``: the engine's adapter manager when LoRA is off (``enable_lora=False``).

It answers every call of :class:`~loramux.engine.lora.interface.AdapterManager` (nothing
resident, nothing to do per step, every adapter refused or unknown), so no call site checks
for a missing manager or tests ``enabled`` to avoid a call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from loramux.engine.errors import LoRAError
from loramux.engine.lora.state import AdapterListener, ResidencySnapshot
from loramux.engine.lora_request import LoRARequest

_NO_SLOTS: Mapping[str, int] = MappingProxyType({})


class NoLoRA:
    """The null adapter manager."""

    enabled = False
    max_loras = 0
    num_evictions = 0
    hook = None

    @property
    def slot_of(self) -> Mapping[str, int]:
        return _NO_SLOTS

    def register(self, request: LoRARequest) -> None:
        raise LoRAError("this engine was started without LoRA (enable_lora=False)")

    def invocation_tokens(self, key: str) -> tuple[int, ...] | None:
        return None

    def drop(self, key: str) -> None:
        """Nothing to forget."""

    def failed(self) -> dict[str, Exception]:
        return {}

    def mark_broken(self, key: str, error: Exception) -> None:
        """No adapter runs here: nothing to mark."""

    def poll(self, wait: float = 0.0) -> None:
        """No background loads."""

    def acquire(self, key: str, in_use: set[str]) -> bool:
        return False

    def is_resident(self, key: str) -> bool:
        return False

    def prefetch(self, keys: list[str]) -> None:
        """Nothing to load."""

    def note_running(self, lora_keys: set[str]) -> None:
        """No slots to keep."""

    def prepare_step(self, row_lora_keys: Sequence[str | None], row_num_tokens: Sequence[int]) -> None:
        """No adapter in any step."""

    def finish_step(self) -> None:
        """Nothing step-scoped."""

    def evict(self, key: str) -> bool:
        raise self._unknown(key)

    def is_evict_pending(self, key: str) -> bool:
        return False

    def pin(self, key: str) -> None:
        raise self._unknown(key)

    def unpin(self, key: str) -> None:
        raise self._unknown(key)

    def warm(self, key: str) -> bool:
        raise self._unknown(key)

    def is_loading(self, key: str) -> bool:
        return False

    def snapshot(self) -> ResidencySnapshot:
        return ResidencySnapshot()

    def add_listener(self, listener: AdapterListener) -> Callable[[], None]:
        return lambda: None

    @staticmethod
    def _unknown(key: str) -> LoRAError:
        return LoRAError(f"adapter {key!r} is not known to this engine (started without LoRA)")
