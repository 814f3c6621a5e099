"""The Responses API routes: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request

from loramux.platform.deps import CallerDep, ResponsesDep
from loramux.platform.openai.protocol import ERROR_RESPONSES
from loramux.platform.openai.responses_api.protocol import (
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
)

router = APIRouter(prefix="/v1", tags=["openai"], responses=ERROR_RESPONSES)
ResponseId = Annotated[str, Path(max_length=80)]


@router.post("/responses", responses={200: {
    "model": ResponseObject,
    "description": "The Response object, or with `stream: true` server-sent events "
    "(`event: response.created` ... `response.completed`). Headers as chat completions', and "
    "`X-LoRAMux-Stored` (whether `store: true` stored it).",
    "content": {"text/event-stream": {}}}})
async def create_response(body: ResponsesRequest, caller: CallerDep, service: ResponsesDep,
                          request: Request):
    """A model response to ``input`` (continuing ``previous_response_id``), run as a chat
    completion of the base model or an adapter (``model``)."""
    return await service.create(body, caller, request)


@router.get("/responses/{response_id}", responses={200: {"model": ResponseObject}})
async def retrieve_response(response_id: ResponseId, caller: CallerDep, service: ResponsesDep):
    """One of the caller's stored responses."""
    return await service.retrieve(response_id, caller)


@router.delete("/responses/{response_id}", response_model=DeletedResponse)
async def delete_response(response_id: ResponseId, caller: CallerDep, service: ResponsesDep):
    """Delete one of the caller's stored responses."""
    return await service.delete(response_id, caller)
