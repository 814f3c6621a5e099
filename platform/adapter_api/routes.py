"""Tenant adapter API: ``/v1/adapters``."""

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
    S3Upload,
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
                        "replace": {"type": "boolean"},
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
    """Upload an adapter (multipart), or register one from an ``s3://`` URI (JSON)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        return await service.upload_multipart(caller, request, replace)
    if ctype == "application/json":
        body = await _json_body(request, S3Upload)
        return await service.upload_s3(caller, body, replace)
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
    """Delete the adapter; the engine drops it from its slots and memory."""
    return await service.delete(caller, name)


@router.post("/{name}/export", response_model=AdapterExport, openapi_extra={"requestBody": {
    "required": False, "content": {"application/json": {"schema": ExportRequest.model_json_schema()}}}})
async def export_adapter(name: str, request: Request, caller: TenantDep, service: AdaptersDep):
    """Merge the adapter into the base model (``merge_and_unload``) and write the folder to
    the object store; the response's ``location`` says where."""
    body = await _json_body(request, ExportRequest, required=False)
    return await service.export(caller, name, body.check)
