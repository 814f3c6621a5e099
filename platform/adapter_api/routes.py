"""Tenant adapter API: ``/v1/adapters`` (adapters, their versions, rollout and rollback)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from loramux.platform.adapter_api.schemas import (
    AdapterDeleted,
    AdapterExport,
    AdapterInfo,
    AdapterList,
    AdapterPatch,
    ExportRequest,
    RolloutBody,
    RolloutInfo,
    S3Upload,
    VersionDeleted,
    VersionInfo,
    VersionList,
)
from loramux.platform.deps import AdaptersDep, TenantDep
from loramux.platform.errors import PayloadTooLarge, UnsupportedMediaType
from loramux.platform.openai.protocol import ERROR_RESPONSES

router = APIRouter(prefix="/v1/adapters", tags=["adapters"], responses=ERROR_RESPONSES)

MAX_JSON_BYTES = 64 * 1024


_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["name", "file"],
                    "properties": {
                        "name": {"type": "string"},
                        "file": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                            "description": "adapter_config.json + adapter_model.safetensors, "
                            "or one .tar.gz / .zip archive",
                        },
                        "preset": {"type": "string", "description": "JSON object"},
                        "replace": {"type": "boolean", "description": "accepted for older "
                                    "clients: an upload to an existing name adds a version"},
                    },
                }
            },
            "application/json": {"schema": S3Upload.model_json_schema()},
        },
    }
}


async def _json_body(request: Request, model: type[BaseModel], required: bool = True):
    size = 0
    chunks = []
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_JSON_BYTES:
            raise PayloadTooLarge(f"the JSON body is larger than {MAX_JSON_BYTES} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip() and not required:
        return model()
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:  # answered like FastAPI's own body errors (the error table)
        raise RequestValidationError(e.errors(include_url=False)) from None


@router.post("", status_code=201, openapi_extra=_UPLOAD_BODY, response_model=AdapterInfo)
async def upload_adapter(request: Request, caller: TenantDep, service: AdaptersDep,
                         replace: bool = False):
    """Upload an adapter (multipart), or register one from an ``s3://`` URI (JSON). An
    existing name gets its next version (``replace`` changes nothing); an adapter that
    follows the latest version sends every request to it at once, one with an explicit
    rollout keeps it."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        return await service.upload_multipart(caller, request)
    if ctype == "application/json":
        body = await _json_body(request, S3Upload)
        return await service.upload_s3(caller, body)
    raise UnsupportedMediaType(
        "send multipart/form-data (files) or application/json ({name, source: s3://...})"
    )


@router.get("", response_model=AdapterList)
async def list_adapters(caller: TenantDep, service: AdaptersDep):
    return await service.list(caller)


@router.get("/{name}", response_model=AdapterInfo)
async def get_adapter(name: str, caller: TenantDep, service: AdaptersDep):
    return await service.get(caller, name)


@router.patch("/{name}", response_model=AdapterInfo)
async def patch_adapter(name: str, body: AdapterPatch, caller: TenantDep, service: AdaptersDep):
    """Change the default preset (``null`` clears it) or the description."""
    return await service.patch(caller, name, body)


@router.delete("/{name}", response_model=AdapterDeleted)
async def delete_adapter(name: str, caller: TenantDep, service: AdaptersDep):
    """Delete the adapter and every version; the engine drops them from its slots and memory."""
    return await service.delete(caller, name)


@router.get("/{name}/versions", response_model=VersionList)
async def list_versions(name: str, caller: TenantDep, service: AdaptersDep):
    """The retained versions (oldest first), each with its share of the rollout and its
    numbers over the last hour (requests, errors, tokens, TTFT / TPOT percentiles)."""
    return await service.releases.list_versions(caller, name)


@router.get("/{name}/versions/{version}", response_model=VersionInfo)
async def get_version(name: str, version: int, caller: TenantDep, service: AdaptersDep):
    return await service.releases.get_version(caller, name, version)


@router.delete("/{name}/versions/{version}", response_model=VersionDeleted)
async def delete_version(name: str, version: int, caller: TenantDep, service: AdaptersDep):
    """Remove one version and its weights; 409 while the rollout names it."""
    return await service.releases.delete_version(caller, name, version)


@router.get("/{name}/rollout", response_model=RolloutInfo)
async def get_rollout(name: str, caller: TenantDep, service: AdaptersDep):
    return await service.releases.rollout(caller, name)


@router.put("/{name}/rollout", response_model=RolloutInfo,
            openapi_extra={"requestBody": {"required": True, "content": {
                "application/json": {"schema": RolloutBody.model_json_schema()}}}})
async def put_rollout(name: str, request: Request, caller: TenantDep, service: AdaptersDep):
    """Send the plain name's requests to versions by integer percent (summing to 100),
    sticky per the request's ``user`` (or the API key, or none). New requests follow at
    once on every server; queued and running ones keep their version."""
    body = await _json_body(request, RolloutBody)
    return await service.releases.set_rollout(caller, name, body)


@router.delete("/{name}/rollout", response_model=RolloutInfo)
async def follow_latest(name: str, caller: TenantDep, service: AdaptersDep):
    """Drop the explicit rollout: the newest version takes every request, uploads move there."""
    return await service.releases.follow_latest(caller, name)


@router.post("/{name}/rollback", response_model=RolloutInfo)
async def rollback(name: str, caller: TenantDep, service: AdaptersDep):
    """Every request to the previous live version, in one step (409 when there is none)."""
    return await service.releases.rollback(caller, name)


@router.post("/{name}/export", response_model=AdapterExport, openapi_extra={"requestBody": {
    "required": False, "content": {"application/json": {"schema": ExportRequest.model_json_schema()}}}})
async def export_adapter(name: str, request: Request, caller: TenantDep, service: AdaptersDep):
    """Merge the adapter into the base model (``merge_and_unload``) and write the folder to
    the object store; the response's ``location`` says where."""
    body = await _json_body(request, ExportRequest, required=False)
    return await service.export(caller, name, body.check, body.version)
