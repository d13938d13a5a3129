"""``python -m lightning_pipedap.simulate``: the what-if planner CLI (:mod:`lightning_pipedap.plan.cli`).

The command name users and scripts know; the CLI itself lives beside the planner it drives.
"""

import sys

from lightning_pipedap.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
