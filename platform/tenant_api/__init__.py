"""The tenant API: ``GET /v1/quotas`` (a tenant sees its own quotas and usage)."""
