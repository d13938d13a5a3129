"""``python -m lightning_pipedap.consolidate DIR [OUT]``: write a sharded checkpoint (``sharded_checkpoint=True``) as
one file that ``strategy="ddp"`` and one process load (default ``DIR.consolidated``), as Lightning's
``consolidate_checkpoint`` does for FSDP. The command line of
:func:`lightning_pipedap.strategy.sharded_checkpoint.main`, in a module the package does not import (``python -m``
on an imported module warns that it may run twice)."""

from lightning_pipedap.strategy.sharded_checkpoint import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
