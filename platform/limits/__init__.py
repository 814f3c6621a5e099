"""loramux.platform.limits – what one tenant may cost the others.

- :mod:`~loramux.platform.limits.tenant` ``TenantLimiter.hold`` (a request's
  ``QuotaHold`` on its tenant's quotas), ``RequestCost``, ``RateLimited``, ``RequestTooLarge``
- :mod:`~loramux.platform.limits.backend` the backend interface; :mod:`.memory`
  ``InProcessBackend``; :mod:`.redis_backend` ``RedisBackend`` (one Lua script)
- :mod:`~loramux.platform.limits.request` ``RequestLimits``, ``check_request``,
  ``check_chat_template``
- :mod:`~loramux.platform.limits.templates` ``TemplateRenderer``: chat templates in
  killable worker processes

Nothing here imports torch: the template worker processes import this package.
"""
