"""Llama-family model implementation over a paged KV cache."""
