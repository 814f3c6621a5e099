"""Request and response bodies of the tenant adapter API (``/v1/adapters``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loramux.registry.models import MAX_DESCRIPTION_CHARS

if TYPE_CHECKING:
    from loramux.registry.handles import AdapterHandle


class S3Upload(BaseModel):
    """Register an adapter the server reads from object storage."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The adapter's name (what requests put in `model`).")
    source: str = Field(description="`s3://bucket/key` of an archive, or `s3://bucket/prefix/` "
                        "of a folder with adapter_config.json + adapter_model.safetensors.")
    preset: dict[str, Any] | None = Field(None, description="Default sampling parameters.")
    replace: bool = False


class AdapterPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    preset: dict[str, Any] | None = Field(None, description="Default sampling parameters; null clears.")
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS,
                                    description="Free text; null clears.")


class ExportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    check: bool = Field(False, description="Compare the merged model's logits with base + adapter.")


class AdapterInfo(BaseModel):
    """The API's view of an adapter (no storage internals)."""

    id: str
    object: Literal["adapter"] = "adapter"
    name: str
    version: int
    base_model: str
    rank: int
    alpha: float
    target_modules: list[str]
    sha256: str
    size_bytes: int
    status: str
    default_preset: dict[str, Any] | None
    description: str | None
    created_at: str
    updated_at: str

    @classmethod
    def of(cls, handle: AdapterHandle) -> AdapterInfo:
        """From a registry ``AdapterHandle``."""
        return cls(
            id=handle.name, name=handle.name, version=handle.version,
            base_model=handle.base_model, rank=handle.rank, alpha=handle.alpha,
            target_modules=list(handle.target_modules), sha256=handle.sha256,
            size_bytes=handle.size_bytes, status=handle.status,
            default_preset=dict(handle.default_preset) if handle.default_preset else None,
            description=handle.description, created_at=handle.created_at.isoformat(),
            updated_at=handle.updated_at.isoformat(),
        )


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterInfo]


class AdapterDeleted(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    deleted: bool = True


class AdapterExport(BaseModel):
    """Where the merged model was written."""

    object: Literal["adapter.export"] = "adapter.export"
    id: str
    version: int
    base_model: str
    location: str
    """A URI a person can use: ``s3://bucket/...`` or ``file:///...``."""
    files: list[str]
