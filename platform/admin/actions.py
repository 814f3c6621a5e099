"""The operator's adapter actions, written once: the admin API's routes, the dashboard's
buttons, ``loramux admin`` and the cluster fan-out all read :data:`ACTIONS`."""

from __future__ import annotations

ACTIONS = ("evict", "pin", "unpin", "warm")
"""evict: free the adapter's device slot (deferred while requests use it); pin: keep it
resident; unpin: let it be evicted again; warm: load it into a device slot now."""
