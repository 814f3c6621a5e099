"""The registry's event bus: who hears of each committed change.

Every part of the registry that commits a change (tenants and keys, adapters, versions
and rollouts, the audit log's outside events) announces it here after the commit; the
platform subscribes (engines drop stale copies, caches forget, the cluster fans out).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from loramux.registry.handles import AdapterHandle, Listener

logger = logging.getLogger(__name__)


class EventBus:
    """Listeners of committed changes, called in subscription order on the committing
    thread; a listener that raises is logged and never undoes the change."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(kind, handle)`` after each committed change; returns the
        function that unsubscribes it."""
        self._listeners.append(listener)
        return lambda: self.unsubscribe(listener)

    def unsubscribe(self, listener: Listener) -> None:
        """Stop calling ``listener`` (no error when it was not subscribed)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def notify(self, kind: str, handle: AdapterHandle | None) -> None:
        """Tell every listener (called once the change is committed)."""
        for listener in list(self._listeners):
            try:
                listener(kind, handle)
            except Exception:  # a listener must not undo a committed change
                logger.exception("registry event listener failed for %s", kind)
