"""Rotary embedding tables, as transformers computes them for every ``rope_type``.

A :class:`RotaryTable` holds ``cos``/``sin`` rows [P, rotary_dim] (already times the rope
type's attention scaling) for every position the model serves; a layer rotates the first
``rotary_dim`` dimensions of each head (rotate-half layout), the rest pass through
(``partial_rotary_factor``). A model may have several tables: Gemma 3's sliding and global
layers each have their own base (``rope_parameters[layer_type]``).

LongRoPE (``longrope``, Phi-3's ``su``) has two sets of factors: transformers uses the long
ones for a forward call whose longest sequence exceeds ``original_max_position_embeddings``
and the short ones otherwise. Per sequence that is: token ``p`` of a sequence whose prompt
has ``P`` tokens uses the long factors when ``max(P, p + 1) > original`` — what transformers'
``generate`` computes for it (prefill: the prompt's length; each decode: its own position),
the same for chunked prefill and after preemption. The table stacks the short rows, then the
long ones, and :meth:`RotaryTable.index` picks a row per token. Because a sequence's keys
then depend on whether its prompt is long, :meth:`RotaryTable.prefix_cache_salt` keeps the
two kinds of sequence apart in the prefix cache.

One difference remains: when a short prompt's output grows past ``original``, Phi-3's
``generate`` throws its cache away and recomputes every earlier key with the long factors;
here the cached keys stay as computed (short), and only the tokens from ``original`` on use
the long factors (as transformers' forward over that cache computes them). vLLM instead
uses the long factors for every token whenever ``max_model_len`` exceeds ``original``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RotaryTable:
    """The rotary rows of one kind of layer, in the model dtype on its device."""

    cos: torch.Tensor  # [P, rotary_dim] (long rope: [2P, rotary_dim], short rows first)
    sin: torch.Tensor
    rotary_dim: int
    positions: int  # P
    long_after: int | None = None
    """LongRoPE: ``original_max_position_embeddings`` (rows ``P ..`` are the long ones)."""

    def index(self, positions: torch.Tensor, prompt_lens: torch.Tensor | None) -> torch.Tensor:
        """The table row of each token ([T] int64): its position, or for LongRoPE the long
        row when ``max(prompt_len, position + 1) > original``."""
        if self.long_after is None:
            return positions
        if prompt_lens is None:
            prompt_lens = positions + 1
        long = torch.maximum(prompt_lens, positions + 1) > self.long_after
        return positions + long.to(positions.dtype) * self.positions

    def prefix_cache_salt(self, num_prompt_tokens: int) -> str | None:
        """A prefix-cache identity for sequences whose keys differ from other sequences' at
        the same positions (LongRoPE with a prompt past ``original``), else None."""
        if self.long_after is not None and num_prompt_tokens > self.long_after:
            return "longrope:long"
        return None


def _rope_parameters(config, layer_type: str | None) -> dict:
    params = config.rope_parameters or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    return dict(params)


def _inv_freq(config, layer_type: str | None, *, long: bool) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim / 2] fp32, attention_scaling)`` of one layer type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        base = params["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r} is not supported by transformers here")
    kwargs = {"layer_type": layer_type} if layer_type is not None and layer_type in (
        config.rope_parameters or {}) else {}
    if long:
        kwargs["seq_len"] = params["original_max_position_embeddings"] + 1
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
    return inv.float(), float(scaling)


def _rows(inv_freq: torch.Tensor, scaling: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def rotary_table(
    config, layer_type: str | None, positions: int, dtype: torch.dtype, device: torch.device
) -> RotaryTable:
    """The table of one layer type (None: the model's only one) for positions ``0 .. positions - 1``."""
    params = _rope_parameters(config, layer_type)
    inv, scaling = _inv_freq(config, layer_type, long=False)
    cos, sin = _rows(inv, scaling, positions)
    long_after = None
    if params.get("rope_type") == "longrope":
        original = int(params["original_max_position_embeddings"])
        if positions > original:  # below it the long rows are never used
            long_after = original
            inv_long, scaling_long = _inv_freq(config, layer_type, long=True)
            cos_long, sin_long = _rows(inv_long, scaling_long, positions)
            cos, sin = torch.cat([cos, cos_long]), torch.cat([sin, sin_long])
    return RotaryTable(
        cos.to(dtype).to(device), sin.to(dtype).to(device), int(inv.numel() * 2), positions, long_after
    )
