"""The app type every loramux server runs: FastAPI with its shared state as typed
attributes (instead of Starlette's untyped ``app.state`` bag).

:func:`~loramux.platform.app.create_app` (all-in-one and ``--role engine``) and
:func:`~loramux.platform.cluster.gateway_app.create_gateway_app` (``--role gateway``) build
a :class:`LoramuxApp`; the routes reach it only through the dependencies in ``deps.py``
(``app_of(request)``), never by probing attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from fastapi import FastAPI, Request

if TYPE_CHECKING:
    from loramux.platform.admin.service import AdminService
    from loramux.platform.admin.session import Sessions
    from loramux.platform.auth import Authenticator
    from loramux.platform.cluster.gateway import Gateway
    from loramux.platform.drain import Drain
    from loramux.platform.settings import Settings
    from loramux.platform.state import AppState


class AdminState(Protocol):
    """What the admin routers read: the all-in-one server's :class:`AppState`, or a
    gateway's ``GatewayAdminState`` (the dashboard over every engine)."""

    settings: Settings
    auth: Authenticator
    admin: AdminService
    admin_sessions: Sessions


class LoramuxApp(FastAPI):
    """A loramux HTTP app and what its routes share."""

    def __init__(self, *, drain: Drain | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.services: AppState | None = None
        """Every service of the server, once built (:meth:`serve`): at once when the app
        was given an engine, else by the lifespan at startup. None at a gateway."""
        self.admin_state: AdminState | None = None
        """What the admin routers read (the services, or a gateway's admin state)."""
        self.drain = drain
        """In-flight requests and the SIGTERM drain (None: uvicorn's own shutdown wait)."""
        self.on_ready: Callable[[AppState], None] | None = None
        """Called once, off the event loop, when the lifespan has built the services
        (``loramux serve``'s first-start setup, the engine role's registration)."""
        self.gateway: Gateway | None = None
        """The gateway's services (``--role gateway``)."""

    def serve(self, state: AppState) -> None:
        """Make ``state`` what the routes run on (called once it is built)."""
        self.services = state
        self.admin_state = state


def app_of(request: Request) -> LoramuxApp:
    """The app a request reached (every route of the product is on a :class:`LoramuxApp`)."""
    app = request.app
    if not isinstance(app, LoramuxApp):
        raise TypeError(f"loramux routes need a LoramuxApp, not {type(app).__name__}")
    return app
