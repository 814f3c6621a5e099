"""``loramux serve --role gateway|engine``: builds the app of one role from the settings.

``--role all`` (the default) never comes here: it is today's single process. Both cluster
roles need ``--redis-url`` and ``--cluster-secret`` and share the registry (PostgreSQL and
S3 in production; the same data dir on one machine).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from loramux.platform.errors import RoleConfigError
from loramux.platform.settings import Settings

if TYPE_CHECKING:
    from loramux.platform.server import LoramuxApp

AppFactory = Callable[[Settings], "LoramuxApp"]
"""The all-in-one app factory (``loramux.platform.app.create_app``)."""

logger = logging.getLogger(__name__)


def _require(settings: Settings) -> str:
    missing = [f for f in ("redis_url", "cluster_secret") if getattr(settings, f) is None]
    if missing:
        flags = ", ".join("--" + f.replace("_", "-") for f in missing)
        raise RoleConfigError(f"--role {settings.role} needs {flags} (or LORAMUX_* variables)")
    return settings.cluster_secret.get_secret_value()


def cluster_state(settings: Settings):
    import redis

    from loramux.platform.cluster.redis_state import ClusterState

    client = redis.Redis.from_url(settings.redis_url, socket_timeout=settings.redis_socket_timeout,
                                  socket_connect_timeout=settings.redis_connect_timeout,
                                  health_check_interval=10)
    return ClusterState(client, settings.redis_namespace, ttl=settings.heartbeat_ttl)


def node_id(settings: Settings) -> str:
    """``<hostname>:<port>``: unique per pod (Kubernetes) and per port (one machine)."""
    return f"{socket.gethostname()}:{settings.port}"


def build_engine_app(settings: Settings, create_app: AppFactory) -> LoramuxApp:
    """Today's app (``create_app(settings)``: the all-in-one factory, handed in by
    ``loramux serve``), behind the cluster secret, registered in Redis once its engine is up."""
    from loramux.platform.cluster.engine_role import attach_engine_role, secure_app

    secret = _require(settings)
    cluster = cluster_state(settings)
    url = settings.advertise_url or f"http://{settings.host}:{settings.port}"
    engine_id = node_id(settings)
    app = create_app(settings)
    prefixes = secure_app(app, secret)

    def on_ready(state) -> None:
        attach_engine_role(state, cluster, engine_id=engine_id, url=url,
                           interval=settings.heartbeat_interval, prefixes=prefixes)
        logger.info("engine %s registered at %s", engine_id, url)

    app.on_ready = on_ready
    return app


def build_gateway_app(settings: Settings) -> LoramuxApp:
    """A gateway: registry (keys, adapter names, quotas), Redis view, router, the tenant
    limiter over the same Redis, HTTP client."""
    import httpx

    from loramux.platform.auth import Authenticator
    from loramux.platform.builders import dependency_policy, error_context, open_registry
    from loramux.platform.bulkheads import Dependencies
    from loramux.platform.cluster.gateway import Gateway
    from loramux.platform.cluster.gateway_admin import gateway_admin_state
    from loramux.platform.cluster.gateway_app import create_gateway_app
    from loramux.platform.cluster.pool import EnginePool
    from loramux.platform.cluster.routing import AffinityRouter, RouterConfig
    from loramux.platform.cluster.view import GatewayView
    from loramux.platform.limits.redis_backend import RedisBackend
    from loramux.platform.limits.tenant import TenantLimiter

    secret = _require(settings)
    cluster = cluster_state(settings)
    registry = open_registry(settings)
    admin_key = settings.admin_key.get_secret_value() if settings.admin_key else None
    policy = dependency_policy(settings)
    deps = Dependencies(policy)
    view = GatewayView(cluster, pool=EnginePool(ttl=settings.heartbeat_ttl))
    router = AffinityRouter(RouterConfig(
        queue_threshold=settings.route_queue_threshold, load_factor=settings.route_load_factor,
        placement_ttl=max(2 * settings.heartbeat_interval, 1.0)))
    http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None),
                             limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
    gw = Gateway(registry=registry,
                 auth=Authenticator(registry, admin_key=admin_key,
                                    allow_anonymous=settings.allow_anonymous, deps=deps),
                 cluster=cluster, view=view, router=router, http=http, secret=secret,
                 gateway_id=node_id(settings), resolve_ttl=settings.model_cache_ttl,
                 quota_ttl=settings.quota_cache_ttl,
                 max_request_bytes=settings.max_request_bytes,
                 deps=deps,
                 limiter=TenantLimiter(RedisBackend.from_url(
                     settings.redis_url, prefix=f"{settings.redis_namespace}:limits:",
                     timeouts=(policy.redis_socket_timeout, policy.redis_connect_timeout))))
    ticker = view.start(settings.heartbeat_interval)
    events = cluster.subscribe(gw.on_event, name="gateway-events", on_resubscribe=gw.resync)
    # what the dashboard here changes (a rollback): effective here at once, fanned out
    from loramux.platform.cluster.engine_role import publish_registry_event

    registry.subscribe(gw.on_registry_event)
    registry.subscribe(lambda kind, handle: publish_registry_event(
        cluster, kind, handle, origin=gw.gateway_id))
    return create_gateway_app(gw, on_shutdown=(ticker.stop, events.close, deps.shutdown),
                              admin=gateway_admin_state(gw, settings),
                              errors=error_context(settings))


def build_role_app(settings: Settings, create_app: AppFactory) -> LoramuxApp:
    """The app ``loramux serve`` runs for ``settings.role`` (gateway or engine);
    ``create_app``: the all-in-one app factory an engine role wraps."""
    if settings.role == "engine":
        return build_engine_app(settings, create_app)
    if settings.role == "gateway":
        return build_gateway_app(settings)
    raise RoleConfigError(f"--role {settings.role} is served by the all-in-one app")
