"""What a tenant may ask of the engine: the request caps and the tenant's quotas, applied
to every OpenAI request before it reaches the engine.

:class:`RequestGate` is built once per app (``state.py``). ``OpenAIServing`` calls
:meth:`~RequestGate.check_caps` once the request's ``SamplingParams`` are built (caps →
400 naming the field), :meth:`~RequestGate.render_template` for a caller's own chat
template (refused unless the operator trusts them; rendered in a killable worker
process), and enters :meth:`~RequestGate.hold_quota` around the request's whole life
(quotas → 429 with ``Retry-After``; the token bucket is corrected by what was really
used when the request ends). A tenant's quotas are cached for ``quota_ttl`` seconds; the
registry's ``quotas_changed`` event drops the cache.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from loramux.platform.bulkheads import Dependencies
from loramux.platform.identity import Caller
from loramux.platform.limits.request import RequestLimits, check_chat_template, check_request
from loramux.platform.limits.templates import TemplateRenderer, template_variables
from loramux.platform.limits.tenant import QuotaHold, RequestCost, TenantLimiter
from loramux.platform.settings import setting_default
from loramux.platform.ttl_cache import TTLCache
from loramux.registry.quotas import Quotas

if TYPE_CHECKING:
    from loramux.engine.sampling_params import SamplingParams
    from loramux.registry.service import RegistryService

ANONYMOUS = "anonymous"
"""The limiter key of callers without a tenant (``--allow-anonymous``)."""


class RequestGate:
    """Request caps, chat-template rendering and tenant quotas for one server."""

    def __init__(
        self,
        limiter: TenantLimiter,
        limits: RequestLimits,
        registry: RegistryService | None,
        default_quotas: Quotas,
        *,
        quota_ttl: float = setting_default("quota_cache_ttl"),
        renderer: TemplateRenderer | None = None,
        enforce_quotas: bool = True,
        deps: Dependencies | None = None,
    ) -> None:
        """``enforce_quotas`` False: tenants' quotas are applied elsewhere (a cluster
        engine behind gateways, which hold the fleet-wide limits), caps still apply here.
        ``deps``: quota reads run in the database bulkhead (stale-on-error)."""
        self.limiter = limiter
        self.enforce_quotas = enforce_quotas
        self.limits = limits
        self.registry = registry
        self.default_quotas = default_quotas
        self.quota_ttl = quota_ttl
        self.renderer = renderer or TemplateRenderer(limits)
        self.deps = deps or Dependencies()
        self._quotas: TTLCache[int, Quotas] = self.deps.stale_cache(quota_ttl)

    # --- quotas ----------------------------------------------------------------------
    async def quotas(self, caller: Caller) -> Quotas:
        """The caller's quotas in effect (cached for ``quota_ttl`` seconds)."""
        if not self.enforce_quotas:
            return Quotas()
        if caller.tenant is None or self.registry is None:
            return self.default_quotas
        tenant_id = caller.tenant.id
        return await self.deps.read_through(
            self._quotas, tenant_id, lambda: self.deps.db.call(self.registry.get_quotas, tenant_id))

    def forget_quotas(self) -> None:
        """Drop every cached quota (they were changed)."""
        self._quotas.clear()

    def on_registry_event(self, kind: str, handle: object) -> None:
        """Registry listener: a quota change takes effect at once."""
        if kind == "quotas_changed":
            self.forget_quotas()

    # --- the request -----------------------------------------------------------------
    def check_caps(self, params: SamplingParams) -> None:
        """The request's caps (RequestLimitError: HTTP 400 naming the field)."""
        check_request(params, self.limits)

    async def render_template(self, template: str | None, conversation: list[dict[str, Any]],
                              tokenizer: Any, add_generation_prompt: bool,
                              kwargs: dict[str, Any] | None) -> str:
        """A caller's own chat template rendered off the event loop under the time and
        size limits; refused (400) unless ``trust_request_chat_template``."""
        check_chat_template(template, self.limits)
        return await self.renderer.render(
            template, conversation, add_generation_prompt=add_generation_prompt,
            variables=template_variables(tokenizer, kwargs),
        )

    async def render_adapter_template(self, template: str, conversation: list[dict[str, Any]],
                                      tokenizer: Any, add_generation_prompt: bool,
                                      kwargs: dict[str, Any] | None) -> str:
        """An adapter's own chat template (tenant input: checked at upload) rendered off
        the event loop under the same time and size limits; a failure is a 400 on ``model``."""
        return await self.renderer.render(
            template, conversation, add_generation_prompt=add_generation_prompt,
            variables=template_variables(tokenizer, kwargs), param="model",
        )

    @contextlib.asynccontextmanager
    async def hold_quota(self, caller: Caller, prompt_lengths: list[int], params: SamplingParams,
                         max_model_len: int) -> AsyncIterator[QuotaHold]:
        """Hold the caller's quota for the request's life: 429 with ``Retry-After`` when a
        limit says no; 400 when the request alone is past a limit. The caller charges
        what it really used through ``QuotaHold.charge``."""
        cost = functools.reduce(operator.add, (
            RequestCost.estimate(length, params.max_tokens or max(0, max_model_len - length),
                                 params.n, params.best_of)
            for length in prompt_lengths))
        key = str(caller.tenant.id) if caller.tenant is not None else ANONYMOUS
        quotas = await self.quotas(caller)
        async with self.limiter.hold(key, quotas, cost) as hold:
            hold.objectives = (quotas.ttft_objective_ms, quotas.itl_objective_ms)
            yield hold

    async def aclose(self) -> None:
        """Stop the template workers and close the limiter's backend."""
        await self.renderer.aclose()
        await self.limiter.aclose()
