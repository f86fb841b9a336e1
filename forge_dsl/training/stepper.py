"""How a `ForgeOptimizer` steps one parameter: its state, its rounding seed, and the kernel calls.

    stepper = ParamStepper(spec, state, keywords, ...)    one per optimizer (it owns `progress`)
    stepper.linear(weight, x, dy)                         a fused Linear's update inside backward
    update = stepper.begin_rows(weight)                   a weight whose gradient comes in blocks of rows:
    stepper.finish_rows(weight, update)                   its update (`kernels.ParamUpdate`), then its counter
    stepper.from_grad(p, grad, group) / stepper.flat(...) an update from a gradient, in `step()`

Each parameter's state is made at its first update (`state_for`, from `api.init_state` in the layout asked
for), with a `step` counter that moves with every update and a stochastic-rounding `seed` of its own
(`param_seed`). The fused weights' handles (`weight.FusedWeight`) call the first three methods, and only
those; the optimizer calls the others.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping, Optional, Sequence, Union

import torch

from ..api import init_state
from ..kernels.foreach import _step_flat
from ..kernels.steps import ParamUpdate, linear_step, mix_seed
from ..kernels.steps import step as elementwise_step
from ..spec import ir
from . import checkpoint, tensor_parallel
from .weight import StepProgress

__all__ = ["ParamStepper", "INITIAL_KEY", "group_hypers", "initial_value_hypers"]

# The param-group key of the hyperparameter values that initial values read, taken when the group is added.
# A leading underscore: no spec keyword can be named so (checker.check_name).
INITIAL_KEY = "_forge_initial"


def group_hypers(group: Mapping[str, Any], keywords: frozenset) -> dict[str, Any]:
    """The spec's keywords (`keywords`) in a param group (schedulers add others, e.g. initial_lr)."""
    return {k: v for k, v in group.items() if k in keywords and v is not None}


def initial_value_hypers(spec: ir.Spec) -> list[str]:
    """The hyperparameters that the initial values of the spec's states and scalar states read."""
    names = []
    for s in list(spec.states) + list(spec.scalars):
        _, e = ir.initial_parts(s.init)
        if isinstance(e, ir.Name) and e.id in spec.hyper_names and e.id not in names:
            names.append(e.id)
    return names


class ParamStepper:
    """The update of every parameter of one optimizer, and the `StepProgress` of its step.

    Attributes:
        spec: the loaded spec.
        state: the optimizer's `state` (torch's defaultdict: parameter -> its state dict), shared with it.
        keywords: the spec's keywords, what `group_hypers` reads from a param group.
        param_index: parameter -> its index in the optimizer's groups (what its seed is drawn from).
        group_of: parameter -> its param group.
        shard_of: a DTensor parameter -> the shard this rank holds (its rounding bits differ by shard).
        state_dtype, rounding, seed, linear_path: as `ForgeOptimizer` takes them (a loaded state dict sets the
            first three).
        progress: the step's state machine, shared with the fused weights.
    """

    def __init__(self, spec: ir.Spec, state: MutableMapping, keywords: frozenset, *,
                 state_dtype: Union[str, Mapping[str, str]], rounding: str, seed: int, linear_path: str) -> None:
        self.spec = spec
        self.state = state
        self.keywords = keywords
        self.param_index: dict[torch.nn.Parameter, int] = {}
        self.group_of: dict[torch.nn.Parameter, dict] = {}
        self.shard_of: dict[torch.nn.Parameter, Optional[int]] = {}
        self.state_dtype = state_dtype
        self.rounding = rounding
        self.seed = seed
        self.linear_path = linear_path
        self.progress = StepProgress()

    def add(self, p: torch.nn.Parameter, group: dict) -> None:
        """Take `p` of param group `group` (in the groups' order: its index draws its seed)."""
        self.param_index[p] = len(self.param_index)
        self.group_of[p] = group

    def group_hypers(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """The spec's keywords in a param group (`group_hypers`)."""
        return group_hypers(group, self.keywords)

    def checkpoint_metadata(self) -> dict:
        """What this optimizer's states are, as `state_dict()` records it in each param group."""
        return checkpoint.metadata(self.spec, self.state_dtype, self.rounding, self.seed)

    def param_seed(self, p: torch.Tensor) -> int:
        """The seed a new state of `p` gets: the optimizer's seed mixed with `p`'s index."""
        return (self.seed * 1_000_003 + self.param_index[p]) & 0x7FFFFFFF

    def rounding_seed(self, p: torch.Tensor, state: Mapping[str, Any]) -> int:
        """The stochastic-rounding seed of `p`'s update: its state's seed (the same on every rank), mixed with the
        shard a rank holds under tensor parallelism (shards draw independent bits, replicas the same)."""
        shard = self.shard_of.get(p)
        seed = int(state["seed"])
        return seed if shard is None else mix_seed(seed, shard + 1)

    def state_for(self, p: torch.Tensor, group: dict, hypers: Mapping[str, Any]) -> dict:
        """`p`'s state, made at its first update."""
        state = self.state[p]
        if not state:
            layout = self.state_dtype
            if tensor_parallel.is_dtensor(p):  # the local shard, in the layouts of the whole parameter
                layout = tensor_parallel.state_layouts(self.spec, p, self.state_dtype)
            state.update(init_state(self.spec, tensor_parallel.local(p), layout=layout,
                                    initial_hypers=group.get(INITIAL_KEY), **hypers))
            state["step"] = torch.tensor(0.0)
            # a group with state carries its checkpoint metadata from now on (forge_dsl/training/checkpoint.py: why)
            group.setdefault(checkpoint.META_KEY, self.checkpoint_metadata())
            state["seed"] = torch.tensor(self.param_seed(p), dtype=torch.int64)
        return state

    # -- inside backward: the fused weights' updates ---------------------------
    def linear(self, weight: torch.nn.Parameter, x: torch.Tensor, dy: torch.Tensor) -> None:
        """One fused layer's update inside backward, from x [..., K] and dy [..., N]; its step counter moves
        with it, so the optimizer's state is consistent whatever interrupts the backward after it."""
        group = self.group_of[weight]
        hypers = self.group_hypers(group)
        state = self.state_for(weight, group, hypers)
        self.progress.open_backward()
        linear_step(
            self.spec, x, dy, tensor_parallel.local(weight), state, path=self.linear_path,
            step=int(state["step"].item()) + 1, seed=self.rounding_seed(weight, state), rounding=self.rounding,
            tf32=torch.get_float32_matmul_precision() != "highest", **hypers,
        )
        state["step"] += 1

    def begin_rows(self, weight: torch.nn.Parameter) -> ParamUpdate:
        """One step of a fused weight whose gradient comes in blocks of rows (`FusedWeight.begin`)."""
        group = self.group_of[weight]
        hypers = self.group_hypers(group)
        state = self.state_for(weight, group, hypers)
        self.progress.open_backward()
        return ParamUpdate(self.spec, tensor_parallel.local(weight), state, step=int(state["step"].item()) + 1,
                           seed=self.rounding_seed(weight, state), rounding=self.rounding, **hypers)

    def finish_rows(self, weight: torch.nn.Parameter, update: ParamUpdate) -> None:
        """After the last block of `begin_rows`'s update: the scalar state and the step counter move."""
        update.commit()
        self.state[weight]["step"] += 1

    # -- in step(): updates from gradients -------------------------------------
    def from_grad(self, p: torch.nn.Parameter, grad: torch.Tensor, state: dict, hypers: Mapping[str, Any]) -> None:
        """`p`'s update from its local gradient `grad` (the element-wise kernel)."""
        elementwise_step(self.spec, tensor_parallel.local(p), grad, state, step=int(state["step"].item()) + 1,
                         seed=self.rounding_seed(p, state), rounding=self.rounding, **hypers)
        state["step"] += 1

    def flat(self, params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor], count: int,
             hypers: Mapping[str, Any]) -> None:
        """One launch for `params`, grouped by `kernels.foreach.shared_launch_key` (equal keys) and at step
        `count` + 1; their stochastic rounding draws from the first one's seed."""
        states = [self.state[p] for p in params]
        # grouped by shared_launch_key by the caller: foreach_step's checks would find them equal again
        _step_flat(self.spec, [tensor_parallel.local(p) for p in params], list(grads), states, step=count + 1,
                   seed=self.rounding_seed(params[0], states[0]), rounding=self.rounding, **hypers)
        for state in states:
            state["step"] += 1
