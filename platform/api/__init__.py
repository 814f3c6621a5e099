"""HTTP routes: thin handlers that call the services in ``loramux.platform``."""
