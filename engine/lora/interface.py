"""What the engine, the scheduler and the platform (through ``AsyncEngine``) call on an
engine's adapter manager: :class:`~loramux.engine.lora.manager.LoRAManager` with LoRA on,
:class:`~loramux.engine.lora.null.NoLoRA` with it off. Both answer every member, so no call
site tests ``enabled`` to avoid a call."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from loramux.engine.lora.state import AdapterListener, ResidencySnapshot
from loramux.engine.lora_request import LoRARequest

if TYPE_CHECKING:
    from loramux.engine.model.decoder import LoRAHook


class AdapterManager(Protocol):
    """The adapter manager's seam (every method runs on the engine thread)."""

    enabled: bool
    """False only for the null manager (the platform shows it)."""
    max_loras: int
    """Device slots: the most distinct adapters in one step."""
    hook: LoRAHook | None
    """What the model calls per LoRA layer (None: no LoRA layers run)."""

    @property
    def slot_of(self) -> Mapping[str, int]:
        """Adapter -> device slot of the resident adapters (the runner orders rows by it)."""

    def register(self, request: LoRARequest) -> None:
        """Know an adapter (its config checked); raises ``LoRAError`` when it cannot run."""

    def invocation_tokens(self, key: str) -> tuple[int, ...] | None:
        """A registered aLoRA's invocation token ids (None: a plain LoRA)."""

    def drop(self, key: str) -> None:
        """Forget an adapter (deleted or replaced)."""

    def failed(self) -> dict[str, Exception]:
        """Adapters that cannot serve any more (failed load, marked broken), with why."""

    def mark_broken(self, key: str, error: Exception) -> None:
        """The adapter produced non-finite numbers: evict it and refuse it until replaced."""

    def poll(self, wait: float = 0.0) -> None:
        """Apply finished background work; between steps."""

    def acquire(self, key: str, in_use: set[str]) -> bool:
        """True when ``key`` sits in a device slot; else start bringing it in."""

    def is_resident(self, key: str) -> bool:
        """True when ``key`` sits in a device slot."""

    def prefetch(self, keys: list[str]) -> None:
        """Start loading these adapters into the CPU tier in the background."""

    def note_running(self, lora_keys: set[str]) -> None:
        """The adapters of the running sequences now (their slots are never evicted)."""

    def prepare_step(self, row_lora_keys: Sequence[str | None], row_num_tokens: Sequence[int]) -> None:
        """Lay out a step's adapters, before its forward pass."""

    def finish_step(self) -> None:
        """After the step's forward pass (also a failed one)."""

    def evict(self, key: str) -> bool:
        """Free the adapter's slot (now or once idle); False when it had none."""

    def is_evict_pending(self, key: str) -> bool:
        """True when ``key`` leaves its slot once its running requests finish."""

    def pin(self, key: str) -> None:
        """Keep the adapter resident; loads it."""

    def unpin(self, key: str) -> None:
        """Let the adapter be evicted again."""

    def warm(self, key: str) -> bool:
        """Bring the adapter in; True once it sits in a device slot."""

    def is_loading(self, key: str) -> bool:
        """True while a background load of ``key`` runs."""

    def snapshot(self) -> ResidencySnapshot:
        """The residency as plain data."""

    def add_listener(self, listener: AdapterListener) -> Callable[[], None]:
        """Hear adapter events; returns the remover."""
