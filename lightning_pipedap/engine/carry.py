"""Values added once to a parameter's next gradient in its bucket, before communication.

For error-feedback residuals of parameters that are now sent dense (a re-plan, or warm-up steps,
stopped compressing them): the residual is what earlier compressions of this rank left out, so it
must reach the other ranks exactly once (error feedback: Seide et al. 2014; Karimireddy et al. 2019).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["GradientCarry"]


class GradientCarry:
    """Per parameter index, a flat fp32 value waiting to be added to its next gradient.

    Args:
        numel: parameter index -> its number of elements (the valid indices).
        device: where the values are kept (the buckets' device).
    """

    def __init__(self, numel: dict[int, int], device: torch.device) -> None:
        self.numel, self.device = numel, device
        self._values: dict[int, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self._values)

    def add(self, values: dict[int, torch.Tensor]) -> None:
        """Keep ``values[i]`` (any shape and float dtype, ``numel[i]`` elements) for parameter ``i``; values for
        the same parameter accumulate.

        Raises:
            ValueError: for an index out of range or a tensor with the wrong number of elements.
        """
        for i, v in values.items():
            if not (isinstance(i, int) and i in self.numel):
                raise ValueError(f"pipedap: GradientCarry.add: parameter index {i!r} out of range; valid: "
                                 f"0..{len(self.numel) - 1}")
            n = self.numel[i]
            if v.numel() != n:
                raise ValueError(f"pipedap: GradientCarry.add: parameter {i} has {n} elements, the value has "
                                 f"{v.numel()}")
            flat = v.detach().reshape(-1).to(device=self.device, dtype=torch.float32, copy=True)
            old = self._values.get(i)
            self._values[i] = flat if old is None else old.add_(flat)

    def pop(self, i: int) -> Optional[torch.Tensor]:
        """Parameter ``i``'s value (flat fp32), removed; None when nothing waits for it."""
        return self._values.pop(i, None) if self._values else None

    def take(self, clear: bool = True) -> dict[int, torch.Tensor]:
        """Every waiting value: removed (``clear``), or copies kept (``clear=False``, for checkpoints)."""
        if clear:
            out, self._values = self._values, {}
            return out
        return {i: v.clone() for i, v in self._values.items()}
