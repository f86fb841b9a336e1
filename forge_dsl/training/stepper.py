"""How a `ForgeOptimizer` steps one parameter: its state, its rounding seed, and the kernel calls.

    stepper = ParamStepper(spec, state, keywords, ...)    one per optimizer (it owns `progress`)
    stepper.linear(weight, x, dy)                         a fused Linear's update inside backward
    update = stepper.begin_rows(weight)                   a weight whose gradient comes in blocks of rows:
    stepper.finish_rows(weight, update)                   its update (`kernels.ParamUpdate`), then its counter
    stepper.from_grad(p, grad, group) / stepper.flat(...) an update from a gradient, in `step()`

Each parameter's state is made at its first update (`state_for`, from `api.init_state` in the layout asked
for), with a `step` counter that moves with every update (`checkpoint.STEP_DTYPE`) and a stochastic-rounding
`seed` of its own (`param_seed`). Before the first update of a step, `check_step` refuses a step that could not
be applied whole. The fused weights' handles (`weight.FusedWeight`) call the first three methods, and only
those; the optimizer calls the others.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping, Optional, Sequence, Union

import torch

from ..api import init_state
from ..kernels.foreach import _step_flat
from ..kernels.host_table import HostTable
from ..kernels.steps import ParamUpdate, launch_host_values, linear_step, mix_seed, resolved_hypers
from ..kernels.steps import step as elementwise_step
from ..spec import ir
from ..spec.keywords import resolve_hypers
from ..spec.phases import is_phased
from . import checkpoint, tensor_parallel
from .phased import PhasedUpdate
from .weight import StepProgress, meta_refusal

__all__ = ["ParamStepper", "INITIAL_KEY", "capture_refusal", "capturing", "group_hypers", "initial_value_hypers"]

# The param-group key of the hyperparameter values that initial values read, taken when the group is added.
# A leading underscore: no spec keyword can be named so (checker.check_name).
INITIAL_KEY = "_forge_initial"


def capturing(t: torch.Tensor) -> bool:
    """Whether work on `t`'s device is being recorded into a CUDA graph now (on the current stream)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def capture_refusal(label: str) -> str:
    """Why the update of the parameter `label` names is not recorded into a CUDA graph, and what to do instead."""
    return (f"{label}: FORGE's update is being captured into a CUDA graph (torch.cuda.graph, "
            "make_graphed_callables) outside forge_dsl.CapturedStep. Its host values (the step counter, the bias "
            "corrections, the learning rate, the stochastic-rounding seed) change every step, and only CapturedStep "
            "writes them for each replay: refused (nothing has run during the capture, so no weight changed). "
            "Build the optimizer with capturable=True and capture the step with forge_dsl.CapturedStep(optimizer, "
            "fn), or use torch.compile(model, mode=\"reduce-overhead\"), whose CUDA graphs leave FORGE's updates "
            "out and run them between graphs")


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
        param_groups: the optimizer's `param_groups` (the list itself, shared with it).
        keywords: the spec's keywords, what `group_hypers` reads from a param group.
        param_index: parameter -> its index in the optimizer's groups (what its seed is drawn from).
        group_of: parameter -> its param group.
        names: parameter -> its name in the model, where the optimizer knows it (for messages).
        state_shapes: parameter -> its shape when its state was made or loaded (`check_step` compares).
        shard_of: a DTensor parameter -> the shard this rank holds (its rounding bits differ by shard).
        state_dtype, rounding, seed, linear_path: as `ForgeOptimizer` takes them (a loaded state dict sets the
            first three).
        progress: the step's state machine, shared with the fused weights.
        siblings: the steppers of the other specs of one optimizer (`training.mixed`), whose groups the first
            fused update of a step checks too: one step, checked whole.
    """

    def __init__(self, spec: ir.Spec, state: MutableMapping, param_groups: list, keywords: frozenset, *,
                 state_dtype: Union[str, Mapping[str, str]], rounding: str, seed: int, linear_path: str) -> None:
        self.spec = spec
        self.state = state
        self.param_groups = param_groups
        self.keywords = keywords
        self.param_index: dict[torch.nn.Parameter, int] = {}
        self.group_of: dict[torch.nn.Parameter, dict] = {}
        self.names: Mapping[torch.nn.Parameter, str] = {}
        self.state_shapes: dict[torch.nn.Parameter, torch.Size] = {}
        self.shard_of: dict[torch.nn.Parameter, Optional[int]] = {}
        self.state_dtype = state_dtype
        self.rounding = rounding
        self.seed = seed
        self.linear_path = linear_path
        self.progress = StepProgress()
        self.siblings: tuple["ParamStepper", ...] = ()
        self.phased = PhasedUpdate(spec) if is_phased(spec) else None  # a spec that runs in phases (spec.phases)
        # capturable=True: the fused Linear weights' launches read their host values from this table, staged once
        # a step for all of them (`stage_host_values`); `CapturedStep` stages it before each replay
        self.host_table: Optional[HostTable] = None
        self.table_slots: dict[torch.nn.Parameter, int] = {}
        self.capture_allowed = False  # set by `CapturedStep` while it records the step
        # parameter -> (what it was made from, its state): `prepare_state`'s, until the first update takes it
        self._prepared: dict[torch.nn.Parameter, tuple[tuple, dict]] = {}
        # parameter -> (its state's step tensor, a view of it): see `counter`
        self._counters: dict[torch.nn.Parameter, tuple[torch.Tensor, Any]] = {}

    def add(self, p: torch.nn.Parameter, group: dict) -> None:
        """Take `p` of param group `group` (in the groups' order: its index draws its seed)."""
        self.param_index[p] = len(self.param_index)
        self.group_of[p] = group

    def group_hypers(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """The spec's keywords in a param group (`group_hypers`)."""
        return group_hypers(group, self.keywords)

    def label(self, p: torch.Tensor) -> str:
        """How a message names `p`: by its name in the model, else by its index and param group."""
        name = self.names.get(p)
        if name is not None:
            return f"parameter '{name}'"
        group = next(i for i, g in enumerate(self.param_groups) if g is self.group_of[p])
        return f"parameter {self.param_index[p]} (param group {group})"

    def check_step(self) -> None:
        """Refuse a step that could not be applied whole, before its first update changes any weight (called by
        the first fused update of a step, in backward, and by every `step()`): a param group whose
        hyperparameters are no longer valid (an LR schedule that wrote a NaN), a parameter on the meta device,
        or one whose shape changed since its state was made.

        Raises:
            ValueError: naming the param group and its keyword, or the parameter, and what to do.
        """
        for i, group in enumerate(self.param_groups):
            hypers = self.group_hypers(group)
            try:
                resolved_hypers(self.spec, hypers)  # remembered while the group's keywords stay the same
                continue
            except (TypeError, ValueError):
                pass
            try:  # refused: again, for the message that names the caller
                resolve_hypers(self.spec, hypers, caller="step")
            except (TypeError, ValueError) as err:
                raise ValueError(self._refusal(f"param group {i}: {err}", f"set a valid value in "
                                               f"optimizer.param_groups[{i}] (a learning-rate schedule's bug?)")
                                 ) from None
        for p in self.param_index:
            if p.is_meta:
                raise ValueError(meta_refusal(self.label(p)))
            shape = self.state_shapes.get(p)
            if shape is None or shape == p.shape:
                continue
            held = [s.name for s in self.spec.states if s.name in self.state.get(p, ())]
            if held:  # per-element states of the old shape (a spec without any keeps only step and seed)
                raise ValueError(self._refusal(
                    f"{self.label(p)} changed shape from {tuple(shape)} to {tuple(p.shape)} since its optimizer "
                    f"state was made: its state ({', '.join(held)}) no longer fits it",
                    "give it back its shape, or start it from fresh state (del optimizer.state[p], p the "
                    "parameter; or build a new optimizer)"))
        self.progress.step_checked = True

    def counter(self, p: torch.Tensor, state: Mapping[str, Any]):
        """`p`'s step counter, `state["step"]` (a 0-d `checkpoint.STEP_DTYPE` CPU tensor), as a 0-d numpy array
        sharing its memory: `int(c)` reads it and `c[()] = n` writes it in well under a µs, where the tensor's
        `.item()` and `+=` take a few µs each on every fused update. Made again where the tensor or its memory
        changed (a loaded state dict, `t.data = ...`, a copied optimizer); the tensor itself where numpy cannot
        view it."""
        t = state["step"]
        kept = self._counters.get(p)
        if kept is not None and kept[0] is t and (kept[1] is t or kept[1].ctypes.data == t.data_ptr()):
            return kept[1]
        view = t.numpy() if t.device.type == "cpu" and t.dim() == 0 and not t.requires_grad else t
        self._counters[p] = (t, view)
        return view

    def _refusal(self, what: str, fix: str) -> str:
        """A refusal of `check_step`: `what` is wrong, what the step left as it was, `fix` and how to go on."""
        updated, _ = self.progress.updated_count()
        if updated == 0:
            return f"{what}. No weight was updated in this step: {fix}, call optimizer.zero_grad() and run the " \
                   "batch again"
        return (f"{what}. The {updated} fused weights updated in the last backward keep their update and no other "
                f"parameter was stepped: {fix}, then call optimizer.step() again to step the others")

    def _refuse_capture(self, p: torch.Tensor) -> None:
        """Refuse an update recorded into a CUDA graph (`torch.cuda.graph`, `make_graphed_callables`): its host
        values would be this step's in every replay. Nothing runs during a capture, so no weight has changed.
        `CapturedStep`'s capture of a fused Linear weight whose launches read the host table is let through."""
        if capturing(p) and not (self.capture_allowed and p in self.table_slots):
            raise RuntimeError(capture_refusal(self.label(p)))

    def _check_first_update(self, p: torch.Tensor) -> None:
        """Before a fused update (of `p`): `check_step` where it is the step's first, and the host table's values
        for this step staged (not while `CapturedStep` records: it staged them, and stages each replay's); a
        refused step is closed (nothing of it was applied), so that the batch can run again."""
        if self.progress.step_checked:
            return
        try:
            for stepper in (self, *self.siblings):
                stepper.check_step()
        except ValueError:
            self.progress.end()
            raise
        if self.host_table is not None and not capturing(p):
            self.stage_host_values()

    def use_host_table(self, params: Sequence[torch.nn.Parameter]) -> None:
        """From now on the fused Linear weights `params` (all on one device) read their launches' host values
        from a host table (`capturable=True`)."""
        self.table_slots = {p: i for i, p in enumerate(params)}
        if params:
            self.host_table = HostTable(len(params), tensor_parallel.local(params[0]).device)

    def stage_host_values(self) -> None:
        """Every table slot's values for its next update (step counter + 1, its param group's keywords as they are
        now, its rounding key), copied to the device at once: the host step of all the fused layers of a step."""
        for p, slot in self.table_slots.items():
            group = self.group_of[p]
            hypers = self.group_hypers(group)
            state = self.state_for(p, group, hypers)
            step = int(state["step"].item()) + 1
            self.host_table.stage(slot, launch_host_values(self.spec, step, state, **hypers),
                                  mix_seed(self.rounding_seed(p, state), step))
        self.host_table.upload()

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

    def prepare_state(self, p: torch.nn.Parameter) -> None:
        """Allocate `p`'s state now, for its first update to take (`state_for`) where nothing it was made from has
        changed by then (layout, device, shape, dtype, the group's keywords): a fused weight's state is then never
        allocated inside backward, where `torch.compile(mode="reduce-overhead")` would allocate it from its CUDA
        graphs' memory pool. Not for a spec with a state that starts from the weight's values (they may still
        change before the first step) nor for a parameter that has state. A spec in phases gets the transients of
        `p`'s shape here too (`phased.PhasedUpdate.transients_for`), for the same reason."""
        if self.phased is not None:
            self.phased.transients_for(tensor_parallel.local(p))
        if self.state.get(p) or p in self._prepared or any(s.starts_from_param for s in self.spec.states):
            return
        group = self.group_of[p]
        hypers = self.group_hypers(group)
        made_from = self._made_from(p, hypers)
        if made_from is not None:
            self._prepared[p] = (made_from, self._new_state(p, group, hypers))

    def drop_prepared(self, params) -> None:
        """Forget the prepared state of `params` (a loaded state dict gave them theirs)."""
        for p in params:
            self._prepared.pop(p, None)

    def _made_from(self, p: torch.Tensor, hypers: Mapping[str, Any]) -> Optional[tuple]:
        """What a state made now for `p` depends on, or None where a keyword is a tensor (a tensor lr, which may
        change in place: no state is prepared)."""
        if any(isinstance(v, torch.Tensor) for v in hypers.values()):
            return None
        return (repr(self.state_dtype), str(p.device), tuple(p.shape), p.dtype, repr(sorted(hypers.items())))

    def _new_state(self, p: torch.Tensor, group: dict, hypers: Mapping[str, Any]) -> dict:
        """Fresh per-element and scalar states of `p` (`api.init_state`), in the layout asked for."""
        layout = self.state_dtype
        if tensor_parallel.is_dtensor(p):  # the local shard, in the layouts of the whole parameter
            layout = tensor_parallel.state_layouts(self.spec, p, self.state_dtype)
        return init_state(self.spec, tensor_parallel.local(p), layout=layout, initial_hypers=group.get(INITIAL_KEY),
                          **hypers)

    def state_for(self, p: torch.Tensor, group: dict, hypers: Mapping[str, Any]) -> dict:
        """`p`'s state, made at its first update (or taken from `prepare_state`'s)."""
        state = self.state[p]
        if not state:
            prepared = self._prepared.pop(p, None)
            if prepared is not None and prepared[0] == self._made_from(p, hypers):  # else dropped: made again
                state.update(prepared[1])
            else:
                state.update(self._new_state(p, group, hypers))
            state["step"] = torch.tensor(0.0, dtype=checkpoint.STEP_DTYPE)
            self.state_shapes[p] = p.shape
            # a group with state carries its checkpoint metadata from now on (forge_dsl/training/checkpoint.py: why)
            group.setdefault(checkpoint.META_KEY, self.checkpoint_metadata())
            state["seed"] = torch.tensor(self.param_seed(p), dtype=torch.int64)
        return state

    # -- inside backward: the fused weights' updates ---------------------------
    def linear(self, weight: torch.nn.Parameter, x: torch.Tensor, dy: torch.Tensor) -> None:
        """One fused layer's update inside backward, from x [..., K] and dy [..., N]; its step counter moves
        with it, so the optimizer's state is consistent whatever interrupts the backward after it."""
        self._refuse_capture(weight)
        self._check_first_update(weight)
        group = self.group_of[weight]
        hypers = self.group_hypers(group)
        state = self.state_for(weight, group, hypers)
        self.progress.open_backward()
        counter = self.counter(weight, state)
        step, seed = int(counter) + 1, self.rounding_seed(weight, state)
        spec, kernel_state, kernel_hypers, cfg = self._first_phase(weight, state, hypers)
        slot = self.table_slots.get(weight)
        linear_step(spec, x, dy, tensor_parallel.local(weight), kernel_state, path=self.linear_path, step=step,
                    seed=seed, rounding=self.rounding, tf32=torch.get_float32_matmul_precision() != "highest",
                    host_row=None if slot is None else self.host_table.row(slot), **kernel_hypers)
        self._later_phases(weight, kernel_state, cfg, step, seed)
        counter[()] = step  # the count + 1 (a whole number: a loaded state dict's is checked)

    def _first_phase(self, p: torch.Tensor, state: dict, hypers: Mapping[str, Any]) -> tuple:
        """(spec, state, keywords, resolved keywords or None) of the update's first kernel: the spec's own, or its
        tile phase's (with the spec's resolved keywords, which `_later_phases` reads)."""
        if self.phased is None:
            return self.spec, state, hypers, None
        cfg = resolved_hypers(self.spec, dict(hypers))
        return (self.phased.plan.tile, self.phased.tile_state(tensor_parallel.local(p), state),
                self.phased.tile_keywords(p, cfg), cfg)

    def _later_phases(self, p: torch.Tensor, kernel_state: dict, cfg, step: int, seed: int) -> None:
        """After the first kernel of a spec that runs in phases: its barriers and post phase (`cfg`: what
        `_first_phase` resolved)."""
        if self.phased is not None:
            self.phased.finish(tensor_parallel.local(p), kernel_state, cfg, step=step, seed=seed,
                               rounding=self.rounding)

    def begin_rows(self, weight: torch.nn.Parameter) -> ParamUpdate:
        """One step of a fused weight whose gradient comes in blocks of rows (`FusedWeight.begin`)."""
        self._refuse_capture(weight)
        self._check_first_update(weight)
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
        self._refuse_capture(p)
        step, seed = int(state["step"].item()) + 1, self.rounding_seed(p, state)
        spec, kernel_state, kernel_hypers, cfg = self._first_phase(p, state, hypers)
        elementwise_step(spec, tensor_parallel.local(p), grad, kernel_state, step=step, seed=seed,
                         rounding=self.rounding, **kernel_hypers)
        self._later_phases(p, kernel_state, cfg, step, seed)
        state["step"] += 1

    def flat(self, params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor], count: int,
             hypers: Mapping[str, Any]) -> None:
        """One launch for `params`, grouped by `kernels.foreach.shared_launch_key` (equal keys) and at step
        `count` + 1; their stochastic rounding draws from the first one's seed."""
        self._refuse_capture(params[0])
        states = [self.state[p] for p in params]
        # grouped by shared_launch_key by the caller: foreach_step's checks would find them equal again
        _step_flat(self.spec, [tensor_parallel.local(p) for p in params], list(grads), states, step=count + 1,
                   seed=self.rounding_seed(params[0], states[0]), rounding=self.rounding, **hypers)
        for state in states:
            state["step"] += 1
