"""loramux.adapters."""
