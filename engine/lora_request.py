"""LoRARequest: names the adapter a request runs with (vLLM-compatible)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request.

    ``lora_name`` identifies the adapter in the engine (slots, tiers, metrics);
    ``lora_path`` is a local PEFT folder, or None when the engine's adapter
    source resolves the name.
    """

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")

    @property
    def key(self) -> str:
        return self.lora_name

    @property
    def prefix_cache_id(self) -> str:
        """The adapter's identity in prefix-cache keys: name (the platform puts tenant and
        version in it), id and path, so a name re-pointed at other weights never reuses KV."""
        return f"{self.lora_name}\x00{self.lora_int_id}\x00{self.lora_path or ''}"
