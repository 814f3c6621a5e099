"""Prompts of a request as token ids: completions' ``prompt`` (text, ids, or lists of
either) and chat ``messages`` rendered with the chat template. Long texts are
tokenized off the event loop."""

from __future__ import annotations

import json

from starlette.concurrency import run_in_threadpool

from loramux.engine.llm import render_chat
from loramux.platform.errors import BadRequest
from loramux.platform.openai.protocol import ChatCompletionRequest

LONG_PROMPT_CHARS = 4096
"""Texts longer than this are tokenized in a worker thread."""


class PromptBuilder:
    """Token ids for the prompts of one request."""

    def __init__(self, tokenizer, max_prompts: int) -> None:
        self.tokenizer = tokenizer
        self.max_prompts = max_prompts

    def using(self, tokenizer) -> PromptBuilder:
        """This builder with ``tokenizer`` (an adapter's own, when it adds tokens)."""
        return self if tokenizer is self.tokenizer else PromptBuilder(tokenizer, self.max_prompts)

    async def encode(self, text: str) -> list[int]:
        if len(text) > LONG_PROMPT_CHARS:
            return await run_in_threadpool(lambda: self.tokenizer(text).input_ids)
        return self.tokenizer(text).input_ids

    async def completion_prompts(self, prompt) -> list[dict]:
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        if not items:
            raise BadRequest("prompt must not be empty", param="prompt")
        if len(items) > self.max_prompts:
            raise BadRequest(
                f"prompt holds {len(items)} prompts; at most {self.max_prompts} per request",
                param="prompt",
            )
        out = []
        for item in items:
            if isinstance(item, str):
                out.append({"prompt": item, "prompt_token_ids": await self.encode(item)})
            else:
                out.append({"prompt_token_ids": list(item)})
        return out

    @staticmethod
    def conversation(req: ChatCompletionRequest) -> list[dict]:
        """The messages as the chat template sees them: text parts joined; an assistant
        turn's ``tool_calls`` with their ``arguments`` as objects (as Hugging Face tool
        templates expect them), a tool turn's ``tool_call_id``, a thought as
        ``reasoning_content``."""
        conversation = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise BadRequest(
                            f"messages[{i}].content: only text parts are supported, got "
                            f"{str(part.get('type'))[:40]!r}",
                            param=f"messages.{i}.content",
                        )
                    parts.append(part["text"])
                content = "".join(parts)
            message: dict = {"role": m.role, "content": content or ""}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_calls:
                message["tool_calls"] = [_template_call(call, i, j)
                                         for j, call in enumerate(m.tool_calls)]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            thought = m.reasoning if m.reasoning is not None else m.reasoning_content
            if thought is not None:
                message["reasoning_content"] = thought
            conversation.append(message)
        return conversation

    def chat_prompt(self, req: ChatCompletionRequest, tools: list[dict] | None = None) -> dict:
        """The messages rendered with the model's own chat template (``tools`` passed to
        it), as token ids."""
        try:
            ids = render_chat(
                self.tokenizer, self.conversation(req), bool(req.add_generation_prompt), None,
                req.chat_template_kwargs, tools=tools,
            )
        except BadRequest:
            raise
        except Exception as e:  # template errors (e.g. roles that must alternate)
            raise BadRequest(f"messages cannot be rendered with the chat template: {e}",
                             param="messages") from None
        return {"prompt_token_ids": ids}

    async def rendered_prompt(self, text: str) -> dict:
        """Token ids of a text a chat template rendered (its special tokens are in it)."""
        if len(text) > LONG_PROMPT_CHARS:
            ids = await run_in_threadpool(
                lambda: self.tokenizer(text, add_special_tokens=False).input_ids)
        else:
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return {"prompt_token_ids": ids}


def _template_call(call: dict, i: int, j: int) -> dict:
    """One assistant ``tool_calls`` entry with its JSON ``arguments`` parsed (vLLM does the
    same: templates render the arguments object)."""
    param = f"messages.{i}.tool_calls.{j}"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"{param}: a tool call needs function.name", param=param)
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments.strip():
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise BadRequest(f"{param}.function.arguments is not JSON", param=param) from None
    elif not isinstance(arguments, dict):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}
