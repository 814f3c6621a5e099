"""The HTTP front end below the engine in the CPU scheduler's queue (Linux per-thread nice).

The engine steps on its own thread, and each step's kernels run as an OpenMP team of as many
threads as the engine has cores. The front end (the event loop and the worker threads it
starts: request parsing, streaming, the registry) shares those cores: at the same priority the
OS scheduler gives a core to the front end's Python mid-step, and the whole team waits at its
next barrier for the thread it preempted. ``front_end_nice`` levels below the engine, the front
end gets the time the team leaves. Measured in the live server (``bench/peer_serving.py``, fp32,
2-core AVX2 EPYC, alternated runs, ``bench/results/front_end_nice_avx2_s53.json``), 10 against
0: the base model's TPOT p50 -8 to -19 % (three pairs, 0.25 and 0.5 req/s), but 4 adapters'
+7 to +24 % (three pairs at 0.25 req/s; a guess, not profiled: a step's serial parts, the SGMV
kernel's among them, leave the team's other thread spinning, and a niced front end waits for it
before the streams' tokens go out). So it is off by default.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)


def lower_front_end(nice: int) -> int | None:
    """Raise the calling thread's niceness by ``nice`` (capped at 19): called on the event loop's
    thread once the engine's thread runs, so the threads the loop starts later inherit it and the
    engine's do not. Returns the thread's niceness after, or None where nothing changed (``nice``
    0, a platform without per-thread nice, or an OS that refused: logged)."""
    if nice == 0:
        return None
    if not sys.platform.startswith("linux"):  # elsewhere setpriority(PRIO_PROCESS) is the whole process
        logger.warning("front_end_nice %d not applied: per-thread priorities need Linux", nice)
        return None
    tid = threading.get_native_id()
    try:
        target = min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as err:
        logger.warning("front_end_nice %d not applied: %s", nice, err)
        return None
    return target
