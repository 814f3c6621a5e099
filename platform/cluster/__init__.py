"""Past one machine: engine replicas behind stateless gateways, coordinated through Redis.

``routing`` (pure: which engine serves a request) and ``pool`` (the live-engine view with
heartbeat expiry) hold no I/O; the Redis-backed cluster state and the roles build on them.
"""
