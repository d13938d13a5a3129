"""Thread priority: let communication threads get the cores first on a CPU-bound host.

On a CPU training host every core runs compute, and the communication worker, gloo's I/O threads and the
kernel's TCP work compete with it. On a slow link communication is the critical path, so stretching it
to give compute a few more cycles makes the iteration longer. On GPUs the same idea is a high-priority
communication stream; on CPUs it is the scheduler's nice value. Linux lets a thread raise its own nice
value (lower its priority) without privileges, so pipedap lowers the *training* thread's priority after
the communication threads have been created (threads inherit the nice value of the thread that creates
them, so the engine's worker and gloo's threads keep the default).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, Optional

MAX_NICE = 19


def lower_current_thread_priority(increment: int) -> Optional[Callable[[], bool]]:
    """Add ``increment`` (1..19) to the calling thread's nice value (Linux ``setpriority`` on its thread id).

    Returns:
        ``None`` when nothing was changed (``increment == 0``, not Linux), else a function that tries to
        restore the previous value and returns whether it could: going back to a lower nice value needs
        ``CAP_SYS_NICE`` or a ``RLIMIT_NICE`` that allows it, so an unprivileged thread keeps the new one.

    Raises:
        ValueError: ``increment`` not an integer in 0..19 (names the value).
    """
    if not isinstance(increment, int) or isinstance(increment, bool) or not 0 <= increment <= MAX_NICE:
        raise ValueError(f"thread priority increment must be an integer in 0..{MAX_NICE}, got {increment!r}")
    if increment == 0 or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, before + increment))

    def restore() -> bool:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, before)
            return True
        except PermissionError:
            return False

    return restore
