"""Uneven inputs seen at the start of a fit: the ranks agree on the number of optimizer steps the start-up budget is
a fraction of, and a rank count that differs is said before the first step (issue 27's fault matrix: uneven data)."""

from __future__ import annotations

from typing import Optional

import lightning_pipedap.engine.collectives as C
import lightning_pipedap.strategy.messages as M

__all__ = ["agreed_total_steps"]


def agreed_total_steps(local: Optional[float], sharded: bool = False) -> Optional[int]:
    """The fit's optimizer steps as every rank uses them: the fewest over the ranks (one ``all_gather_object``: call
    on every rank), or None when some rank does not know (``max_epochs=-1``). Each rank's own count comes from its
    dataloader (Lightning's ``estimated_stepping_batches``), so with uneven inputs the ranks would size the start-up
    budget differently, take different start-up decisions and mismatch their collectives; the agreed count keeps
    their decisions identical, and a warning names the counts (the fit fails, naming the rank, when the first rank
    runs out of batches, as DDP's does).

    Raises:
        ValueError: on every rank, when the counts differ and ``sharded`` (``shard_optimizer``): the rank that runs
            out first could not leave the fit alone, since the end of a sharded fit gathers gradients and optimizer
            state from every rank (it would wait ``wait_timeout_s`` for them).
    """
    own = int(local) if local is not None else None
    every = C.all_gather_object(own)
    if len(set(every)) > 1:
        counts = ", ".join(f"rank {r}: {'unknown' if n is None else n}" for r, n in enumerate(every))
        if sharded:
            raise ValueError(f"pipedap: the ranks expect different numbers of optimizer steps ({counts}): uneven "
                             "inputs, which shard_optimizer cannot finish (the end of a sharded fit gathers the "
                             "gradients and the optimizer state from every rank); give every rank the same number of "
                             "batches (DistributedSampler(drop_last=True), or equal-length dataloaders)")
        M.warn(f"pipedap: the ranks expect different numbers of optimizer steps ({counts}): uneven inputs. The fit "
               "stops with an error naming the rank when the first rank runs out of batches; give every rank the "
               "same number of batches (DistributedSampler(drop_last=True), or equal-length dataloaders)")
    if any(n is None for n in every):
        return None
    return min(every)
