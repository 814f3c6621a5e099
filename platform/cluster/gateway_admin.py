"""The admin dashboard and JSON API served at a gateway, over every engine in the cluster.

The same routers as the all-in-one server (:mod:`loramux.platform.admin.routes` and
``pages``: admin key, session and CSRF rules unchanged) read ``app.state.loramux``; a
gateway sets it to a :class:`GatewayAdminState` whose admin service runs on a
:class:`~loramux.platform.cluster.fleet.ClusterFleet` and the gateway's registry."""

from __future__ import annotations

from dataclasses import dataclass, field

from loramux.platform.admin.activity import Activity
from loramux.platform.admin.service import AdminService
from loramux.platform.admin.session import Sessions
from loramux.platform.auth import Authenticator
from loramux.platform.cluster.fleet import ClusterFleet
from loramux.platform.cluster.gateway import Gateway
from loramux.platform.openai.resolver import ModelResolver
from loramux.platform.settings import Settings


@dataclass
class GatewayAdminState:
    """What the admin routers' dependencies read (``auth``, ``admin``, ``admin_sessions``,
    ``settings``) at a gateway."""

    settings: Settings
    auth: Authenticator
    admin: AdminService
    admin_sessions: Sessions = field(default_factory=Sessions)


def gateway_admin_state(gw: Gateway, settings: Settings) -> GatewayAdminState:
    """The dashboard's state at a gateway: every registered engine, the shared registry."""
    fleet = ClusterFleet(gw.cluster, origin=gw.gateway_id)
    base = settings.model or ""  # a gateway may run without --model (engines load it);
    # the resolver only lists static adapters here (none at a gateway)
    resolver = ModelResolver([base or "base"], registry=gw.registry,
                             ttl=settings.model_cache_ttl)
    admin = AdminService(fleet, gw.registry, resolver, Activity(), base_model=base,
                         dtype=settings.dtype, device=settings.device)
    return GatewayAdminState(settings, gw.auth, admin)
