"""The base models' forward pass over a paged KV cache: one decoder (``decoder.py``) driven by each
family's spec (``models/``), chosen by ``registry.py``."""
