"""The ``X-LoRAMux-Timing`` response header: where a request's time went, per phase.

Server-Timing syntax, milliseconds, one entry per phase of the engine request
(``RequestMetrics.timing``), the slowest of the request's prompts for each::

    X-LoRAMux-Timing: queue;dur=12.5, adapter_load;dur=0.0, prefill;dur=40.1, decode;dur=120.3

``queue``: arrival in the engine to its first scheduled step, of which ``adapter_load`` is the
part its adapter was not in a device slot yet (loads from disk or the CPU tier); ``prefill``:
first scheduled step to first token (prompt chunks, and the steps between them); ``decode``:
first token to the last. A streamed response sends its headers with the first token, so it
carries ``queue``, ``adapter_load`` and ``prefill`` only.
"""

from __future__ import annotations

from collections.abc import Iterable

from loramux.platform.openai.streaming import Track

TIMING_HEADER = "X-LoRAMux-Timing"
PHASES = ("queue", "adapter_load", "prefill", "decode")


def timing_header(tracks: Iterable[Track], phases: tuple[str, ...] = PHASES) -> str | None:
    """The header's value for these engine requests (None when none has a first token)."""
    worst: dict[str, float] = {}
    for track in tracks:
        timing = track.engine.timing() if track.engine is not None else None
        if timing is None:
            continue
        for phase in phases:
            worst[phase] = max(worst.get(phase, 0.0), timing[phase])
    if not worst:
        return None
    return ", ".join(f"{p};dur={1000 * worst[p]:.1f}" for p in phases if p in worst)
