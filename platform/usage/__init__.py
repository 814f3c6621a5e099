"""loramux.platform.usage: every finished request's usage record, written to SQL in
batches off the request path (spilling to a local file while the database is down), and
the usage API (``GET /v1/usage``, ``GET /admin/usage``)."""
