"""HTTP service settings: pydantic-settings with the ``LORAMUX_`` env prefix.

``loramux serve`` maps its flags (named like ``vllm serve``'s where the meaning is
the same) onto these fields; every field can also come from the environment, e.g.
``LORAMUX_MAX_LORAS=8`` or ``LORAMUX_DATABASE_URL=postgresql+psycopg://...``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_MODEL_ALIASES = ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")


class Settings(BaseSettings):
    """Everything ``loramux serve`` needs; engine options keep vLLM's names."""

    model_config = SettingsConfigDict(env_prefix="LORAMUX_", extra="ignore")

    # --- engine (names as in vLLM) -------------------------------------------------------
    model: str | None = None
    """Local Hugging Face folder of the base model; None = SmolLM2-135M-Instruct."""
    served_model_name: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Names the base model answers to in ``model``; empty = the folder's name
    (for the default model also ``HuggingFaceTB/SmolLM2-135M-Instruct``). The first is listed."""
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_waiting: int = 1024
    """Bound of the engine's waiting queue; past it requests get 429 with Retry-After."""
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    """CPU only: bytes for the KV cache (None = the engine's default)."""
    num_gpu_blocks_override: int | None = None
    enable_lora: bool = True
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_backend: str = "auto"
    lora_modules: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Static adapters every caller may use: ``name=path`` or ``{"name": .., "path": ..}``."""

    # --- HTTP --------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8000
    root_path: str = ""
    log_level: str = "info"
    log_format: str = "json"
    """json (one object per line, with request ids) | text."""
    max_request_bytes: int = 8 * 1024 * 1024
    """Largest JSON request body; larger ones get 413."""
    max_upload_bytes: int = 1024 * 1024 * 1024
    """Largest adapter upload (all files together); larger ones get 413."""
    max_prompts_per_request: int = 64
    retry_after_seconds: int = 1
    """The ``Retry-After`` of a 429 when the waiting queue is full."""
    allow_anonymous: bool = False
    """Requests without a valid key may use the base model and ``--lora-modules``
    (like ``vllm serve`` without ``--api-key``). Tenant adapters always need a key."""
    model_cache_ttl: float = 5.0
    """Seconds a resolved (tenant, model) pair is cached."""

    # --- registry / auth -----------------------------------------------------------------
    database_url: str | None = None
    """SQLAlchemy URL; None = SQLite in the data dir."""
    s3_bucket: str | None = None
    """Object store bucket; None = a folder in the data dir."""
    s3_endpoint_url: str | None = None
    s3_prefix: str = ""
    data_dir: Path | None = None
    """Where SQLite, the local object store and caches live; None = the registry's default."""
    admin_key: SecretStr | None = None
    """Bearer key of ``/admin``; None = generated on first start (printed once, stored hashed)."""
    demo: bool = True
    """On a registry without tenants: create a ``demo`` tenant with the shipped ``sql-lora``
    adapter and print its key once."""
    demo_adapter_dir: Path | None = None
    """The adapter registered for the demo tenant; None = ``examples/adapters/sql-lora``."""

    @field_validator("served_model_name", "lora_modules", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str):
            value = value.strip()
            if value.startswith("["):
                import json

                return json.loads(value)
            return [v for v in value.replace(",", " ").split() if v] if "{" not in value else [value]
        return value

    @field_validator("log_format")
    @classmethod
    def _log_format(cls, value: str) -> str:
        if value not in ("json", "text"):
            raise ValueError(f"log_format must be json or text, got {value!r}")
        return value
