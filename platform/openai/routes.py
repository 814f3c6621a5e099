"""OpenAI-compatible routes: completions, chat completions, models."""

from __future__ import annotations

from fastapi import APIRouter, Request

from loramux.platform.deps import CallerDep, OpenAIDep, StateDep
from loramux.platform.errors import ModelNotFound
from loramux.platform.openai.protocol import (
    ERROR_RESPONSES,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)

router = APIRouter(prefix="/v1", tags=["openai"], responses=ERROR_RESPONSES)

def _stream_doc(body: type) -> dict:
    return {
        200: {
            "model": body,
            "description": "A JSON body, or with `stream: true` server-sent events ending in "
            "`data: [DONE]`. Headers: `X-LoRAMux-Params` (parameters in effect), "
            "`X-LoRAMux-Preset` (fields taken from the adapter's preset), `X-LoRAMux-Warnings`, "
            "`X-LoRAMux-Timing` (ms per phase: queue, adapter_load, prefill, decode).",
            "content": {"text/event-stream": {}},
        }
    }


@router.post("/completions", responses=_stream_doc(CompletionResponse))
async def create_completion(body: CompletionRequest, caller: CallerDep, service: OpenAIDep,
                            request: Request):
    """Text completion of the base model or an adapter (``model``)."""
    return await service.completions(body, caller, request)


@router.post("/chat/completions", responses=_stream_doc(ChatCompletionResponse))
async def create_chat_completion(body: ChatCompletionRequest, caller: CallerDep,
                                 service: OpenAIDep, request: Request):
    """Chat completion: ``messages`` rendered with the model's chat template."""
    return await service.chat(body, caller, request)


@router.get("/models", response_model=ModelList)
async def list_models(caller: CallerDep, state: StateDep):
    """The base model and every adapter the caller may use."""
    return {"object": "list", "data": await state.resolver.list_models(caller)}


@router.get("/models/{model:path}", response_model=ModelCard)
async def retrieve_model(model: str, caller: CallerDep, state: StateDep):
    for card in await state.resolver.list_models(caller):
        if card["id"] == model:
            return card
    if model in state.resolver.base_names:
        return (await state.resolver.list_models(caller))[0] | {"id": model}
    raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
