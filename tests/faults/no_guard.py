"""tests/faults/train.py run from a script without ``if __name__ == "__main__":`` (the body runs at import)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # noqa: E402

with open(os.path.join(train.OUT, f"body_ran.{train.RANK}.{os.getpid()}"), "w") as f:
    f.write("1")
train.main()
