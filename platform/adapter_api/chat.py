"""An adapter's chat settings checked before the registry stores them (upload and PATCH):
parser names against the parser registry and the served tokenizer, the template against
the server's limits and one sandboxed render of a tool-calling conversation.

The template is tenant input that runs: the check renders it the way a chat request
would (transformers' sandboxed Jinja in a :class:`TemplateRenderer` worker process killed
at ``chat_template_render_timeout_s``, output capped at ``max_rendered_prompt_chars``,
address space capped), with the probe conversation below and ``tools`` passed as the
template variable transformers passes. The checker has its own renderer (two workers,
started on first use), so an upload's template never queues in front of chat requests'
renders, and one tenant's checks run one at a time: a tenant sending many looping
templates at once queues behind itself, and another tenant's check waits for at most one
render per tenant ahead of it.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from starlette.concurrency import run_in_threadpool

from loramux.platform.errors import BadRequest, PayloadTooLarge, Unprocessable
from loramux.platform.limits.request import RequestLimitError, RequestLimits
from loramux.platform.limits.templates import TemplateRenderer, template_variables
from loramux.platform.openai.parsers import (
    ParserStartupError,
    ReasoningParserManager,
    ToolParserManager,
    validate_parser_tokenizer,
)

CHAT_FIELDS = ("chat_template", "tool_call_parser", "reasoning_parser")
"""The adapter's chat settings, as the upload form, PATCH and the responses name them."""

PROBE_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
PROBE_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]
"""A two-turn conversation with one tool call: what every adapter template must render."""


class ChatSettingsCheck:
    """Checks an adapter's chat template and parser names for the adapter API (one per
    app). ``tokenizer`` is the served one (its special tokens are template variables;
    parsers are constructed against it)."""

    def __init__(self, limits: RequestLimits, tokenizer: Any, *, model_name: str | None = None,
                 renderer: TemplateRenderer | None = None) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.renderer = renderer or TemplateRenderer(limits, workers=2)
        self._turns: weakref.WeakValueDictionary[Any, asyncio.Lock] = (
            weakref.WeakValueDictionary())

    async def check(self, settings: dict[str, Any], owner: Any = None) -> None:
        """Check the settings present in ``settings`` (None values clear and pass) for
        ``owner`` (the tenant: its renders run one at a time). Called by an upload and a
        PATCH before the registry stores anything; raises the API's 400 (parser), 413
        (template too long) or 422 (template does not render)."""
        tool = settings.get("tool_call_parser")
        reasoning = settings.get("reasoning_parser")
        self._known("tool_call_parser", tool, ToolParserManager.list_registered())
        self._known("reasoning_parser", reasoning, ReasoningParserManager.list_registered())
        if tool or reasoning:
            await run_in_threadpool(self._fits_tokenizer, tool, reasoning)
        if settings.get("chat_template") is not None:
            turn = self._turns.get(owner)
            if turn is None:
                turn = self._turns[owner] = asyncio.Lock()
            async with turn:
                await self.check_template(settings["chat_template"])

    @staticmethod
    def _known(field: str, name: Any, choices: list[str]) -> None:
        if name is None:
            return
        if not isinstance(name, str) or name not in choices:
            shown = name[:64] if isinstance(name, str) else type(name).__name__
            raise BadRequest(f"{field} {shown!r} is not a parser this server has; choose one "
                             f"of: {', '.join(choices)} (or null for the server's)",
                             param=field, code="invalid_parser")

    def _fits_tokenizer(self, tool: str | None, reasoning: str | None) -> None:
        for field, name in (("tool_call_parser", tool), ("reasoning_parser", reasoning)):
            if not name:
                continue
            kwargs = {field: name}
            try:
                validate_parser_tokenizer(self.tokenizer, model_name=self.model_name, **kwargs)
            except ParserStartupError as e:
                cause = e.__cause__ or e
                raise BadRequest(f"{field} {name!r} cannot work with this server's tokenizer "
                                 f"({self.model_name}): {cause}", param=field,
                                 code="parser_unsupported") from None

    async def check_template(self, template: Any) -> None:
        """The template's length, then one sandboxed render of :data:`PROBE_CONVERSATION`
        with :data:`PROBE_TOOLS` (time- and size-bounded)."""
        if not isinstance(template, str):
            raise BadRequest("chat_template must be a string (Jinja source)",
                             param="chat_template")
        limit = self.limits.max_chat_template_chars
        if len(template) > limit:
            raise PayloadTooLarge(
                f"chat_template has {len(template)} characters, more than this server allows "
                f"({limit}, max_chat_template_chars)", param="chat_template",
                code="chat_template_too_long")
        variables = {**template_variables(self.tokenizer), "tools": PROBE_TOOLS}
        try:
            await self.renderer.render(template, PROBE_CONVERSATION, add_generation_prompt=True,
                                       variables=variables)
        except RequestLimitError as e:
            raise Unprocessable(
                f"chat_template does not render a conversation with a tool call: {e}",
                param="chat_template", code="invalid_chat_template") from None

    def close(self) -> None:
        """Stop the checker's template worker (called when the app's state closes)."""
        self.renderer.close()


def check_offline(settings: dict[str, Any], limits: RequestLimits, tokenizer: Any,
                  model_name: str | None = None) -> None:
    """The same checks without a server (``loramux adapters upload``): a renderer of its
    own for this one call, stopped after."""

    async def run() -> None:
        check = ChatSettingsCheck(limits, tokenizer, model_name=model_name,
                                  renderer=TemplateRenderer(limits))
        try:
            await check.check(settings)
        finally:
            await check.renderer.aclose()

    asyncio.run(run())
