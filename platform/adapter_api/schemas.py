"""Request and response bodies of the tenant adapter API (``/v1/adapters``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loramux.adapters.kinds import KIND_PATTERN
from loramux.registry.chat import template_digest
from loramux.registry.models import MAX_DESCRIPTION_CHARS

AdapterKind = Annotated[str, Field(pattern=KIND_PATTERN, examples=["LoRA", "aLoRA", "LoRA+tokens"])]
"""What ``AdapterHandle.kind`` says (``adapters/kinds.py``): the kind, then its parts
(``+embedding``, LoRA on embed_tokens / lm_head; ``+tokens``, trainable tokens; ``+modules``,
``modules_to_save`` copies)."""

if TYPE_CHECKING:
    from loramux.registry.handles import AdapterHandle, Release


_TEMPLATE_DOC = ("The adapter's own Jinja chat template (for every version); on upload it "
                 "beats a shipped chat_template.jinja / tokenizer_config.json; null in PATCH: "
                 "the server's again.")
_TOOL_DOC = "Tool-call parser name for this adapter's requests; null: the server's."
_REASONING_DOC = "Reasoning parser name for this adapter's requests; null: the server's."


class S3Upload(BaseModel):
    """Register an adapter the server reads from object storage."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The adapter's name (what requests put in `model`).")
    source: str = Field(description="`s3://bucket/key` of an archive, or `s3://bucket/prefix/` "
                        "of a folder with adapter_config.json + adapter_model.safetensors.")
    preset: dict[str, Any] | None = Field(None, description="Default sampling parameters.")
    replace: bool = Field(False, description="Accepted for older clients: an upload to an "
                          "existing name always adds a version.")
    chat_template: str | None = Field(None, description=_TEMPLATE_DOC)
    tool_call_parser: str | None = Field(None, description=_TOOL_DOC)
    reasoning_parser: str | None = Field(None, description=_REASONING_DOC)


class AdapterPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    preset: dict[str, Any] | None = Field(None, description="Default sampling parameters; null clears.")
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS,
                                    description="Free text; null clears.")
    chat_template: str | None = Field(None, description=_TEMPLATE_DOC)
    tool_call_parser: str | None = Field(None, description=_TOOL_DOC)
    reasoning_parser: str | None = Field(None, description=_REASONING_DOC)


class ExportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    check: bool = Field(False, description="Compare the merged model's logits with base + adapter.")
    version: int | None = Field(None, ge=1, description="The version to merge; default the newest.")


class AdapterSummary(BaseModel):
    """An adapter in a listing: its fields without its chat template's text (a template
    may be tens of kilobytes; its digest and length say whether and which)."""

    id: str
    object: Literal["adapter"] = "adapter"
    name: str
    version: int
    base_model: str
    kind: AdapterKind = "LoRA"
    """Plain LoRA, DoRA (``use_dora``: a learned magnitude per output feature) or aLoRA
    (``alora_invocation_tokens``: activated from its invocation in the prompt on), with
    ``+embedding`` / ``+tokens`` after it for its vocabulary parts."""
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
    tool_call_parser: str | None = None
    """The adapter's tool-call parser; None: the server's ``--tool-call-parser``."""
    reasoning_parser: str | None = None
    """The adapter's reasoning parser; None: the server's ``--reasoning-parser``."""
    chat_template_sha256: str | None = None
    """sha256 of the adapter's own chat template (UTF-8); None: the server's template."""
    chat_template_chars: int | None = None
    """Its length in characters."""

    @classmethod
    def of(cls, handle: AdapterHandle) -> AdapterSummary:
        """From a registry ``AdapterHandle``."""
        template = handle.chat_template
        return cls(
            id=handle.name, name=handle.name, version=handle.version,
            base_model=handle.base_model, kind=handle.kind, rank=handle.rank, alpha=handle.alpha,
            target_modules=list(handle.target_modules), sha256=handle.sha256,
            size_bytes=handle.size_bytes, status=handle.status,
            default_preset=dict(handle.default_preset) if handle.default_preset else None,
            description=handle.description, created_at=handle.created_at.isoformat(),
            updated_at=handle.updated_at.isoformat(), tool_call_parser=handle.tool_call_parser,
            reasoning_parser=handle.reasoning_parser,
            chat_template_sha256=template_digest(template) if template else None,
            chat_template_chars=len(template) if template else None,
            **cls._extra(handle),
        )

    @classmethod
    def _extra(cls, handle: AdapterHandle) -> dict[str, Any]:
        return {}


class AdapterInfo(AdapterSummary):
    """The API's view of one adapter (no storage internals): the summary and the text of
    its chat template (GET ``/v1/adapters/{name}``, the upload's and PATCH's answers)."""

    chat_template: str | None = None
    """The adapter's own Jinja chat template; None: the server's."""

    @classmethod
    def _extra(cls, handle: AdapterHandle) -> dict[str, Any]:
        return {"chat_template": handle.chat_template}


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterSummary]
    """Each adapter without its template's text (``GET /v1/adapters/{name}`` has it)."""


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


class RolloutBody(BaseModel):
    """``PUT /v1/adapters/{name}/rollout``."""

    model_config = ConfigDict(extra="forbid")

    weights: dict[str, Any] = Field(description='Integer percent per version number, summing '
                                    'to 100: `{"3": 90, "4": 10}`.')
    sticky: str = Field("user", description="What keeps a caller on one version: `user` (the "
                        "request's `user` field; requests without one are drawn by weight), "
                        "`key` (the API key) or `none`.")


class RolloutInfo(BaseModel):
    """How requests for the plain name spread over the versions."""

    object: Literal["adapter.rollout"] = "adapter.rollout"
    adapter: str
    weights: dict[str, int]
    """Percent per version number (as a string)."""
    sticky: str
    follow_latest: bool
    """True: no explicit rollout; the newest version takes everything, uploads move there."""
    rollback_to: int | None
    """What ``POST /v1/adapters/{name}/rollback`` puts 100% on (None: nothing to roll back to)."""
    updated_at: str

    @classmethod
    def of(cls, release: Release) -> RolloutInfo:
        r = release.rollout
        return cls(adapter=release.name, weights={str(v): w for v, w in r.weights},
                   sticky=r.sticky, follow_latest=r.follow_latest, rollback_to=r.rollback_to,
                   updated_at=release.newest.updated_at.isoformat())


class Percentiles(BaseModel):
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class VersionNumbers(BaseModel):
    """A version's numbers over the last ``window_s`` seconds (every server's requests)."""

    window_s: int
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: Percentiles = Percentiles()
    tpot_ms: Percentiles = Percentiles()


class VersionInfo(BaseModel):
    """One immutable version; ``model: "<name>@<version>"`` pins it."""

    object: Literal["adapter.version"] = "adapter.version"
    id: str
    """``<name>@<version>``."""
    adapter: str
    version: int
    base_model: str
    kind: AdapterKind = "LoRA"
    rank: int
    alpha: float
    target_modules: list[str]
    sha256: str
    size_bytes: int
    created_at: str
    weight: int
    """Percent of the plain name's requests it takes now."""
    stats: VersionNumbers

    @classmethod
    def of(cls, handle: AdapterHandle, weight: int, stats: VersionNumbers) -> VersionInfo:
        return cls(id=f"{handle.name}@{handle.version}", adapter=handle.name,
                   version=handle.version, base_model=handle.base_model, kind=handle.kind,
                   rank=handle.rank,
                   alpha=handle.alpha, target_modules=list(handle.target_modules),
                   sha256=handle.sha256, size_bytes=handle.size_bytes,
                   created_at=handle.created_at.isoformat(), weight=weight, stats=stats)


class VersionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VersionInfo]
    """Oldest first."""
    rollout: RolloutInfo


class VersionDeleted(BaseModel):
    id: str
    object: Literal["adapter.version"] = "adapter.version"
    deleted: bool = True
