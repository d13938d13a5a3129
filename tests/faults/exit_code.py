"""Run a command and write its exit status to a file: the fault matrix's view of a rank under torchrun.

Usage: python exit_code.py RC_FILE CMD [ARGS...]; ``{rank}`` in RC_FILE is replaced by ``$RANK``. torchrun
reports the exit codes of the ranks it stops only as its own failure, so the test starts each rank through
this wrapper (``torchrun --no-python``): the command runs in its own session (a signal to the job's process
group reaches the wrapper only), SIGTERM and SIGINT sent to the wrapper are forwarded to it, and its status is
written as Python's ``returncode`` (``143`` for a rank that exits with 143, ``-15`` for one killed by SIGTERM,
``-6`` for an abort). The wrapper exits with the command's status.
"""

import os
import signal
import subprocess
import sys

if __name__ == "__main__":
    rc_file, cmd = sys.argv[1].format(rank=os.environ.get("RANK", "0")), sys.argv[2:]
    proc = subprocess.Popen(cmd, start_new_session=True)

    def forward(signum, frame):
        proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rc = proc.wait()
    with open(rc_file, "w") as f:
        f.write(str(rc))
    if rc < 0:
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    sys.exit(rc)
