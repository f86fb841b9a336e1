"""Where a backward that produces a weight's gradient in blocks of rows hands those blocks.

The fused LM head (`forge_dsl.training.hf_head`) forms the gradient of its logits one vocabulary block at a time,
the fused embedding (`forge_dsl.training.embedding`) the gradient of a tile of embedding rows at a time; neither
ever holds the whole dW [V, D]. Each hands its blocks to a `RowSink`:

    sink = ...                                  # one per weight and backward
    if sink.begin():                            # this step's update is fused: blocks go to the optimizer
        sink.fused_rows(x, dy_block, r0)        # rows [r0, r0 + R) from dW = dy_blockᵀ x: x [T, D], dy [T, R]
        sink.grad_rows(grad_block, r0)          # rows [r0, r0 + R) from their gradient grad_block [R, D]
        sink.finish()                           # after the last block: the step is complete for this weight
    else:                                       # not fused this step: the backward returns the dense dW
        ...                                     # to autograd (it adds up into .grad as for any parameter)

Every row of the weight is handed exactly once per fused step (rows without a gradient as zeros: they decay
and move as torch.optim moves them on a zero gradient).
"""

from __future__ import annotations

from typing import Any, MutableMapping, Optional, Protocol

import torch

from ..kernels.checks import DEFAULT_ROUNDING, DEFAULT_SEED
from ..spec.loading import SpecLike

__all__ = ["RowSink", "AutogradRows", "ParamUpdateRows"]


class RowSink(Protocol):
    def begin(self) -> bool: ...

    def fused_rows(self, x: torch.Tensor, dy: torch.Tensor, r0: int) -> None: ...

    def grad_rows(self, grad: torch.Tensor, r0: int) -> None: ...

    def finish(self) -> None: ...


class AutogradRows:
    """The sink of a weight that no FORGE optimizer updates: `begin` is False, the backward returns dW."""

    def begin(self) -> bool:
        return False

    def fused_rows(self, x: torch.Tensor, dy: torch.Tensor, r0: int) -> None:
        raise RuntimeError("AutogradRows takes no blocks: its backward returns the dense gradient")

    grad_rows = fused_rows

    def finish(self) -> None:
        raise RuntimeError("AutogradRows takes no blocks: its backward returns the dense gradient")


class ParamUpdateRows:
    """A sink that applies one step of `spec` to `weight` [V, D] and its `state` (`forge_dsl.init_state`), for
    code that drives the kernels itself (tests, benchmarks); `ForgeOptimizer` hands its own sink to fused
    modules. Each `begin` starts the next step (1, 2, ...)."""

    def __init__(self, spec: SpecLike, weight: torch.Tensor, state: MutableMapping[str, torch.Tensor], *,
                 seed: int = DEFAULT_SEED, rounding: str = DEFAULT_ROUNDING, **hypers: Any) -> None:
        self.spec, self.weight, self.state = spec, weight, state
        self.seed, self.rounding, self.hypers = seed, rounding, hypers
        self.steps = 0
        self._update: Optional[Any] = None

    def begin(self) -> bool:
        from ..kernels.steps import ParamUpdate

        if self._update is not None:
            raise RuntimeError("begin() again before finish(): the previous step's blocks are not complete")
        self._update = ParamUpdate(self.spec, self.weight.data, self.state, step=self.steps + 1, seed=self.seed,
                                   rounding=self.rounding, **self.hypers)
        return True

    def fused_rows(self, x: torch.Tensor, dy: torch.Tensor, r0: int) -> None:
        self._open().fused(x, dy, rows=r0)

    def grad_rows(self, grad: torch.Tensor, r0: int) -> None:
        self._open().from_grad(grad, rows=r0)

    def finish(self) -> None:
        self._open().commit()
        self._update = None
        self.steps += 1

    def _open(self):
        if self._update is None:
            raise RuntimeError("begin() first: no step is open")
        return self._update
