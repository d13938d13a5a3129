"""A stand-in for a case module of :func:`tests._dist_util.launch_results` (``tests/test_launch_results.py``): each
rank "runs" the named cases in order; rank 0 writes ``{case: {"rank": 0}}`` to OUT after each. Case ``crash_once``
kills rank 0 with SIGSEGV the first time (a marker file beside OUT remembers it); ``crash_always`` every time.

    python -m tests._crash_once_cases OUT.json case ...
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def main(out: Path, names: list[str]) -> None:
    rank = int(os.environ["RANK"])
    marker = out.parent / "crashed-once"
    done = {}
    for name in names:
        if rank == 0 and (name == "crash_always" or (name == "crash_once" and not marker.exists())):
            marker.touch()
            os.kill(os.getpid(), signal.SIGSEGV)
        done[name] = {"rank": rank}
        if rank == 0:
            out.write_text(json.dumps(done))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
