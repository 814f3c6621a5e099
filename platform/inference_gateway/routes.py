"""vLLM's ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (mounted
only with ``--allow-runtime-lora-updating``; vLLM answers 404 without
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` too). JSON bodies only; 200 with vLLM's plain-text
body, errors in the OpenAI shape (400 missing field / not JSON / duplicate name, 404
unknown adapter or path). A tenant key is required: the adapter is the caller's."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from loramux.platform.deps import StateDep, TenantDep
from loramux.platform.errors import BadRequest, PayloadTooLarge, ServiceUnavailable
from loramux.platform.inference_gateway.runtime_lora import RuntimeLoRA
from loramux.platform.openai.protocol import ERROR_RESPONSES

router = APIRouter(tags=["vLLM runtime LoRA"], responses=ERROR_RESPONSES)

MAX_BODY_BYTES = 16 * 1024

_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["lora_name", "lora_path"],
    "properties": {"lora_name": {"type": "string"}, "lora_path": {"type": "string"},
                   "load_inplace": {"type": "boolean", "default": False}}}}}}}
_UNLOAD_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["lora_name"],
    "properties": {"lora_name": {"type": "string"}, "lora_int_id": {"type": "integer"}}}}}}}


async def get_runtime_lora(state: StateDep) -> RuntimeLoRA:
    service = state.runtime_lora
    if service is None:
        raise ServiceUnavailable("this server has no adapter registry", code="no_registry")
    return service


RuntimeLoRADep = Annotated[RuntimeLoRA, Depends(get_runtime_lora)]


async def json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object: 400 for another content type, bad JSON or not an object
    (vLLM's ``validate_json_request`` and its request models)."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype != "application/json":
        raise BadRequest("Unsupported Media Type: Only 'application/json' is allowed",
                         param="content-type", code="invalid_content_type")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise PayloadTooLarge(f"the JSON body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except ValueError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_json")
    return body


def _string(body: dict, field: str) -> str | None:
    value = body.get(field)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{field} must be a string", param=field, code="invalid_parameter")
    return value or None


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, openapi_extra=_BODY)
async def load_lora_adapter(request: Request, caller: TenantDep, service: RuntimeLoRADep):
    """Load the adapter at ``lora_path`` as ``lora_name`` for the caller's tenant."""
    body = await json_object(request)
    name, path = _string(body, "lora_name"), _string(body, "lora_path")
    if name is None or path is None:
        raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.",
                         param="lora_name" if name is None else "lora_path",
                         code="missing_parameter")
    inplace = body.get("load_inplace", False)
    if not isinstance(inplace, bool):
        raise BadRequest("load_inplace must be a boolean", param="load_inplace",
                         code="invalid_parameter")
    return PlainTextResponse(await service.load(caller, name, path, replace=inplace))


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
             openapi_extra=_UNLOAD_BODY)
async def unload_lora_adapter(request: Request, caller: TenantDep, service: RuntimeLoRADep):
    """Unload (delete) the caller's adapter ``lora_name``."""
    body = await json_object(request)
    name = _string(body, "lora_name")
    if name is None:
        raise BadRequest("either 'lora_name' and 'lora_int_id' needs to be provided.",
                         param="lora_name", code="missing_parameter")
    return PlainTextResponse(await service.unload(caller, name))
