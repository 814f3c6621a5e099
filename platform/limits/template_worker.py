"""The chat-template worker process: renders one job at a time from a pipe.

Runs in a process forked by the ``forkserver`` (never from the serving process itself,
whose threads could hold locks at fork time), with its address space capped at what it
has after imports plus ``extra_memory_bytes``. Rendering is transformers' own sandboxed
Jinja (``render_jinja_template``: ``ImmutableSandboxedEnvironment`` and the same
globals and filters as ``tokenizer.apply_chat_template``), so templates render exactly as
they would there. The parent kills the process at its time limit.

Protocol: receives ``(template, conversation, add_generation_prompt, variables,
max_chars)``; sends ``("ok", text)``, ``("too_long", n_chars)`` or ``("error", message)``.
"""

from __future__ import annotations

import os
import resource
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

MAX_ERROR_CHARS = 300


def _cap_memory(extra_bytes: int) -> None:
    if extra_bytes <= 0:
        return
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no procfs (macOS): the time limit still holds
        return
    limit = current + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _render(job: tuple[str, list[dict[str, Any]], bool, dict[str, Any], int]) -> tuple:
    template, conversation, add_generation_prompt, variables, max_chars = job
    try:
        rendered, _ = render_jinja_template(
            conversations=[conversation],
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except MemoryError:
        return ("error", "the chat template used more memory than this server allows")
    except Exception as e:  # a template error is the caller's: say which
        return ("error", f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS])
    text = rendered[0]
    if len(text) > max_chars:
        return ("too_long", len(text))
    return ("ok", text)


def serve(conn: Any, extra_memory_bytes: int) -> None:
    """The worker's main loop: one reply per job until the pipe closes."""
    _cap_memory(extra_memory_bytes)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_render(job))
