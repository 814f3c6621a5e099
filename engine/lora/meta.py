"""Per-step LoRA batch layout: which tokens use which adapter slot, grouped into segments."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["LoRABatchMeta"]

# Cost of one extra chunk in the torch backend, in padded-row equivalents (the chunk's
# adapter weights are gathered and multiplied once per chunk). Used to pick chunk_len.
_CHUNK_COST_ROWS = 4


def _pick_chunk_len(seg_lens: np.ndarray) -> int:
    """Chunk length that minimises padded rows + per-chunk cost over the segments."""
    if seg_lens.size == 0:
        return 1
    max_len = int(seg_lens.max())
    candidates = {max_len}
    c = 1
    while c < max_len:
        candidates.add(c)
        c *= 2
    best, best_cost = max_len, None
    for c in sorted(candidates, reverse=True):
        chunks = int(((seg_lens + c - 1) // c).sum())
        cost = chunks * c + _CHUNK_COST_ROWS * chunks
        if best_cost is None or cost < best_cost:
            best, best_cost = c, cost
    return best


@dataclass(eq=False)
class LoRABatchMeta:
    """Per-step LoRA batch layout, built once per engine step and read by every LoRA layer.

    Tokens with an adapter are stable-sorted by slot (``sorted_token_idx``); each distinct
    slot with rank > 0 forms one segment of that order. Slot ``-1`` means no adapter.

    The ``chunk_*`` fields are the torch backend's padded layout: every segment is cut into
    chunks of ``chunk_len`` sorted positions (the last one padded), so one ``bmm`` over
    ``[num_chunks, chunk_len, K]`` covers all adapters with no Python loop per layer.
    """

    token_slots: torch.Tensor  # [T] int64, slot per token, -1 = no adapter
    sorted_token_idx: torch.Tensor  # [T_lora] int64, tokens with slot >= 0, stable-sorted by slot
    seg_starts: torch.Tensor  # [S] int64 offsets into sorted_token_idx
    seg_lens: torch.Tensor  # [S] int64
    seg_slots: torch.Tensor  # [S] int64
    slot_ranks: torch.Tensor  # [num_slots] int64, 0 = empty slot
    num_tokens: int  # T
    max_seg_len: int
    num_lora_tokens: int  # T_lora
    # torch backend layout (see class docstring)
    chunk_len: int  # C
    chunk_slots: torch.Tensor  # [NC] int64
    chunk_pos: torch.Tensor  # [NC * C] int64 sorted position per padded row (pads: chunk's first)
    chunk_tokens: torch.Tensor  # [NC * C] int64 token per padded row (pads: chunk's first token)
    chunk_mask: torch.Tensor | None  # [NC * C, 1] fp32, 0 on pad rows; None when nothing is padded
    chunk_keep: torch.Tensor | None  # [T_act] int64 padded rows that are real; None when no pads
    active_pos: torch.Tensor | None  # [T_act] int64 sorted positions in segments; None = all
    identity_layout: bool  # padded rows == sorted rows (no pads, no rank-0 rows)
    identity_tokens: bool  # additionally sorted_token_idx == arange(T_lora): LoRA tokens lead the batch
    chunk_slot_start: int | None  # chunk_slots == arange(start, start + NC): weights as a view
    _has_lora: bool = False
    runs: tuple[tuple[int, int, int], ...] = ()
    """(first token, end token, slot) of each run of consecutive batch tokens sharing one
    slot with rank > 0, in batch order (host ints: the CPU path slices x and y by them)."""
    run_table: torch.Tensor | None = None
    """``runs`` as a host int64 ``[num_runs, 3]`` tensor (the CPU SGMV kernel's input)."""
    cpu_split: tuple | None = None
    """The CPU path's split of ``runs`` (kernel table, GEMM runs, slot ranks), made by
    ``cpu_sgmv.split_runs`` at the step's first LoRA layer and read by the others."""

    @classmethod
    def build(
        cls,
        token_slots: Sequence[int] | np.ndarray | torch.Tensor,
        slot_ranks: torch.Tensor,
        device: torch.device | str = "cpu",
    ) -> LoRABatchMeta:
        """Build the layout for one engine step (called once per step, by ``LoRAStepBatch.prepare``).

        ``token_slots``: slot per token in batch order (-1 = none); ``slot_ranks``: rank
        loaded in each slot (0 = empty). Segments of rank-0 slots are dropped; their tokens
        stay in ``sorted_token_idx`` and get no LoRA update.
        """
        slots = _host_slots(token_slots)
        ranks_t = torch.as_tensor(slot_ranks).detach().to("cpu", torch.int64).reshape(-1)
        ranks = ranks_t.numpy()
        num_slots = ranks.shape[0]
        if slots.size and (slots.max() >= num_slots or slots.min() < -1):
            raise ValueError(
                f"token slots must be -1 or in [0, {num_slots}); got range "
                f"[{int(slots.min())}, {int(slots.max())}]"
            )
        sorted_idx, seg_starts, seg_lens, seg_slots = _segments(slots, ranks)
        t_lora = int(sorted_idx.shape[0])
        covered = int(seg_lens.sum()) == t_lora
        c = _chunk_layout(sorted_idx, seg_starts, seg_lens, seg_slots)
        identity_layout = not c.padded and covered
        identity_tokens = identity_layout and bool((sorted_idx == np.arange(t_lora)).all())
        slot_start = None
        if c.slots.size and (c.slots == c.slots[0] + np.arange(c.slots.size)).all():
            slot_start = int(c.slots[0])
        active = c.pos[c.valid] if not covered else None
        runs = _runs(slots, ranks)

        pack = [slots, sorted_idx, seg_starts, seg_lens, seg_slots, c.slots, c.pos, c.tokens]
        if c.padded:
            pack += [c.valid.astype(np.int64), np.nonzero(c.valid)[0]]
        if active is not None:
            pack.append(active)
        parts = _to_device([np.asarray(p, dtype=np.int64) for p in pack], device)
        mask = keep_t = active_t = None
        if c.padded:
            mask = parts[8].to(torch.float32).unsqueeze(1)
            keep_t = parts[9]
        if active is not None:
            active_t = parts[-1]
        return cls(
            token_slots=parts[0],
            sorted_token_idx=parts[1],
            seg_starts=parts[2],
            seg_lens=parts[3],
            seg_slots=parts[4],
            slot_ranks=ranks_t.to(device),
            num_tokens=int(slots.shape[0]),
            max_seg_len=int(seg_lens.max()) if seg_lens.size else 0,
            num_lora_tokens=t_lora,
            chunk_len=c.chunk_len,
            chunk_slots=parts[5],
            chunk_pos=parts[6],
            chunk_tokens=parts[7],
            chunk_mask=mask,
            chunk_keep=keep_t,
            active_pos=active_t,
            identity_layout=identity_layout,
            identity_tokens=identity_tokens,
            chunk_slot_start=slot_start,
            _has_lora=bool(seg_slots.size),
            runs=runs,
            run_table=torch.tensor(runs, dtype=torch.int64).reshape(-1, 3),
        )

    @property
    def has_lora(self) -> bool:
        """True when some token uses a slot with rank > 0 (otherwise LoRA layers skip)."""
        return self._has_lora

    @property
    def num_segments(self) -> int:
        """S, the number of segments (distinct slots with rank > 0 in the batch)."""
        return int(self.seg_slots.shape[0])

    @property
    def num_chunks(self) -> int:
        """NC, the number of padded chunks in the torch backend's layout."""
        return int(self.chunk_slots.shape[0])


def _host_slots(token_slots: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """``token_slots`` as a flat host int64 array."""
    if isinstance(token_slots, torch.Tensor):
        return token_slots.detach().to("cpu", torch.int64).numpy().reshape(-1)
    if isinstance(token_slots, np.ndarray):
        return token_slots.astype(np.int64, copy=False).reshape(-1)
    return np.asarray(list(token_slots), dtype=np.int64).reshape(-1)


def _segments(slots: np.ndarray, ranks: np.ndarray) -> tuple[np.ndarray, ...]:
    """The LoRA tokens stable-sorted by slot (``sorted_idx``) and the segments of that
    order with rank > 0: (sorted_idx, seg_starts, seg_lens, seg_slots)."""
    lora_tokens = np.nonzero(slots >= 0)[0]
    order = np.argsort(slots[lora_tokens], kind="stable")
    sorted_idx = lora_tokens[order]
    uniq, starts, lens = np.unique(slots[sorted_idx], return_index=True, return_counts=True)
    keep = ranks[uniq] > 0 if uniq.size else np.zeros(0, dtype=bool)
    return sorted_idx, starts[keep], lens[keep], uniq[keep]


@dataclass
class _ChunkLayout:
    """The torch backend's padded chunks (host arrays; see :class:`LoRABatchMeta`)."""

    chunk_len: int  # C
    slots: np.ndarray  # [NC]
    pos: np.ndarray  # [NC * C] sorted position per padded row (pads: the chunk's first)
    tokens: np.ndarray  # [NC * C] token per padded row
    valid: np.ndarray  # [NC * C] bool, False on pad rows

    @property
    def padded(self) -> bool:
        return not bool(self.valid.all())


def _chunk_layout(sorted_idx: np.ndarray, seg_starts: np.ndarray, seg_lens: np.ndarray,
                  seg_slots: np.ndarray) -> _ChunkLayout:
    """Cut every segment into chunks of one length (:func:`_pick_chunk_len`), the last one
    padded with the chunk's first position."""
    C = _pick_chunk_len(seg_lens)
    n_chunks = (seg_lens + C - 1) // C  # [S]
    chunk_slots = np.repeat(seg_slots, n_chunks)
    chunk_seg = np.repeat(np.arange(seg_slots.shape[0]), n_chunks)
    first_chunk = np.cumsum(n_chunks) - n_chunks
    chunk_j = np.arange(chunk_slots.shape[0]) - np.repeat(first_chunk, n_chunks)
    chunk_start = seg_starts[chunk_seg] + C * chunk_j  # [NC]
    seg_end = (seg_starts + seg_lens)[chunk_seg]  # [NC]
    pos = chunk_start[:, None] + np.arange(C)[None, :]  # [NC, C]
    valid = pos < seg_end[:, None]
    pos = np.where(valid, pos, chunk_start[:, None]).reshape(-1)
    tokens = sorted_idx[pos] if pos.size else np.zeros(0, dtype=np.int64)
    return _ChunkLayout(C, chunk_slots, pos, tokens, valid.reshape(-1))


def _runs(slots: np.ndarray, ranks: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """Maximal runs of equal slot (with rank > 0) over the batch order."""
    if slots.size == 0:
        return ()
    edges = np.flatnonzero(np.diff(slots)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [slots.size]])
    run_slots = slots[starts]
    keep = run_slots >= 0
    keep[keep] = ranks[run_slots[keep]] > 0
    return tuple(
        (int(a), int(b), int(c)) for a, b, c in zip(starts[keep], ends[keep], run_slots[keep], strict=True)
    )


def _to_device(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """Move int64 arrays to ``device`` with one host-to-device copy; returns views."""
    sizes = [int(a.shape[0]) for a in arrays]
    flat = torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros(0, np.int64))
    flat = flat.to(device)
    return list(torch.split(flat, sizes))
