"""The phases of one fit's run-time (:class:`Phase`); the transitions are the
:class:`~lightning_pipedap.strategy.controller.Controller`'s (see its module docstring for the diagram)."""

from __future__ import annotations

import enum

#: the fixed schedule installed when profiling cannot profile a step
FALLBACK_SCHEDULE = "dear"


class Phase(enum.Enum):
    """Where the run-time is: what the next step does."""

    TRACE = "trace"  #: sync steps of the warm-up schedule; the first one traces the forward
    PROFILE = "profile"  #: sync steps of the profiling schedule, per-layer times measured
    TRIAL = "trial"  #: steps of measured plan selection, candidates in interleaved rounds
    VERIFY = "verify"  #: steps of a plan from the plan cache, timed in windows against its recorded time
    RUN = "run"  #: steps of the installed schedule, drift checked

    @property
    def deferrable(self) -> bool:
        """Whether steps of this phase may defer updates (a final schedule is installed)."""
        return self in (Phase.TRIAL, Phase.VERIFY, Phase.RUN)
