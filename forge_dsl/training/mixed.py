"""Param groups that name their own spec: Muon for the hidden matrices and AdamW for the rest, in one optimizer.

    opt = forge_dsl.ForgeOptimizer(model, "muon", lr=0.02, model_params=[
        {"params": hidden_matrices},
        {"params": everything_else, "spec": "adamw", "lr": 3e-4, "weight_decay": 0.1},
    ])

Muon's authors and torch.optim.Muon's documentation train a transformer's hidden matrices with Muon and every
other parameter (embeddings, head, norms) with AdamW. When a param group names a spec other than the
optimizer's, `ForgeOptimizer(...)` returns a `MixedSpecOptimizer`, a torch.optim.Optimizer over one
`ForgeOptimizer` per spec (`optimizers`; each fuses the Linear weights of its own groups into backward) whose
`param_groups` are theirs, the same dicts in the order given (so LR schedulers and
`opt.param_groups[i]["lr"] = ...` reach them). Each group keeps its spec's name under "spec".

Keywords, the decision this module makes: a group of the optimizer's own spec takes the keywords given to
`ForgeOptimizer` as its defaults, as torch's defaults; a group naming another spec takes that spec's defaults and
its own keys only (Muon's lr of 0.02 is not an AdamW lr). The options (`state_dtype`, `rounding`, `fuse`,
`linear_path`, `foreach`, `accumulation_steps`, `max_grad_norm`, ...) apply to every spec; the parameters of the
k-th spec (in order of first appearance) draw their rounding seeds from `seed + k`. `max_grad_norm=c` clips by
the global norm of every spec's gradients (`backward(loss)` runs both passes for all of them); with
`accumulation_steps` too, and `capturable`, are refused: the accumulated norm and one captured host table are per
optimizer so far. `lm_head_loss=True` goes to the optimizer of the spec whose groups hold the head.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

import torch

from ..kernels.steps import DEFAULT_SEED
from ..spec.loading import load_spec
from . import checkpoint, data_parallel, grad_passes

__all__ = ["MixedSpecOptimizer", "check_own_spec", "names_other_specs", "same_spec"]

_REFUSED = {  # option -> why it is refused with several specs, and what to do instead
    "capturable": "CapturedStep records one optimizer's host table: train with one spec to capture the step",
}


def same_spec(named: Any, spec) -> bool:
    """Whether a group's "spec" (a name, a path or a loaded spec) is `spec`, a loaded spec."""
    return named is spec or named == spec.name or load_spec(named) == spec


def names_other_specs(params: Any, spec: Any, model_params: Any) -> bool:
    """Whether the param groups given to `ForgeOptimizer` (a list or tuple of dicts: a generator cannot be read
    twice, and `ForgeOptimizer.add_param_group` refuses another spec in it) name a spec other than `spec`."""
    groups = model_params if isinstance(params, torch.nn.Module) else params
    if not isinstance(groups, (list, tuple)) or spec is None:
        return False
    try:
        own = load_spec(spec)
        return any(isinstance(g, dict) and "spec" in g and not same_spec(g["spec"], own) for g in groups)
    except Exception:  # a bad spec: ForgeOptimizer's own checks say what is wrong with it
        return False


def check_own_spec(group: dict, spec, index: int) -> None:
    """Refuse param group `index` of a one-spec optimizer (`spec`) where its "spec" names another one (its
    parameters would be stepped with the wrong update); else write the spec's name there."""
    named = group["spec"]
    if not same_spec(named, spec):
        shown = getattr(named, "name", named)
        raise ValueError(f"param group {index} names the spec {shown!r}, not this optimizer's {spec.name!r}: pass "
                         "every param group to ForgeOptimizer in a list (or tuple), from which it builds one "
                         "optimizer per spec (a generator is read once, by torch), or build a new optimizer with a "
                         "group of that spec")
    group["spec"] = spec.name


class _States(Mapping):
    """`optimizer.state` of a mixed optimizer: each parameter's state, held by the optimizer of its spec."""

    def __init__(self, owner: "MixedSpecOptimizer") -> None:
        self._owner = owner

    def __getitem__(self, p):
        inner = self._owner._inner_of.get(p)
        if inner is None:
            raise KeyError(p)
        return inner.state[p]

    def __iter__(self) -> Iterator:
        return (p for inner in self._owner.optimizers for p in inner.state)

    def __len__(self) -> int:
        return sum(len(inner.state) for inner in self._owner.optimizers)


class _Shared:
    """An attribute of every spec's optimizer, read and set as one: its value where they agree, else a dict by
    spec name; `offset` (the seed): the k-th spec's is the value plus k."""

    def __init__(self, name: str, offset: bool = False) -> None:
        self.name, self.offset = name, offset
        self.__doc__ = f"Every spec's `{name}`" + (" (the k-th spec's: this plus k)." if offset else ".")

    def __get__(self, opt, owner=None):
        if opt is None:
            return self
        values = [getattr(inner, self.name) - k if self.offset else getattr(inner, self.name)
                  for k, inner in enumerate(opt.optimizers)]
        if all(v == values[0] for v in values):
            return values[0]
        return {spec.name: getattr(inner, self.name) for spec, inner in zip(opt._specs, opt.optimizers)}

    def __set__(self, opt, value) -> None:
        for k, inner in enumerate(opt.optimizers):
            setattr(inner, self.name, value + k if self.offset else value)


class MixedSpecOptimizer(torch.optim.Optimizer):
    """One `ForgeOptimizer` per spec named by the param groups, as one torch optimizer (module docstring).
    `ForgeOptimizer(...)` builds it, passing itself as `forge_optimizer` (the class of the inner optimizers).

    Attributes:
        optimizers: the inner optimizers, one per spec, in order of first appearance.
        spec: the spec given to `ForgeOptimizer` (its groups' default).
    """

    def __init__(self, forge_optimizer: type, params, spec=None, *, model_params=None, seed: int = DEFAULT_SEED,
                 **options: Any) -> None:
        for name, why in _REFUSED.items():
            if options.get(name) not in (None, False):
                raise ValueError(f"{name}= with param groups of several specs is not supported yet: {why}")
        if options.get("max_grad_norm") is not None and options.get("accumulation_steps", 1) != 1:
            raise ValueError("max_grad_norm= with accumulation_steps= and param groups of several specs is not "
                             "supported yet: the norm of the accumulated gradients is taken in each spec's step(), "
                             "by its own parameters, which is not torch's clip_grad_norm_ over all of them. Train "
                             "with one spec, or without one of the two options")
        hypers = {k: options.pop(k) for k in list(options) if k not in _OPTIONS}
        model = params if isinstance(params, torch.nn.Module) else None
        groups = list(model_params if model is not None else params)
        self.spec = load_spec(spec)
        if hypers and all(isinstance(g, dict) and "spec" in g and not same_spec(g["spec"], self.spec) for g in groups):
            raise ValueError(f"no param group is stepped by {self.spec.name!r}, the optimizer's spec: every group names "
                             f"another, so its keywords ({', '.join(hypers)}) would apply to none. Give them in the "
                             "groups, or add a group without 'spec'")
        by_spec: dict[int, list] = {}  # index in self.optimizers' order -> its groups
        specs: list = []
        order: list[tuple[int, int]] = []  # each given group: (its spec's index, its index among that spec's)
        for group in groups:
            named = group.get("spec", self.spec) if isinstance(group, dict) else self.spec
            loaded = named if named is self.spec else load_spec(named)
            k = next((i for i, s in enumerate(specs) if s == loaded), None)
            if k is None:
                k = len(specs)
                specs.append(loaded)
            if isinstance(group, dict):
                group = {**group, "spec": loaded.name}
            by_spec.setdefault(k, []).append(group)
            order.append((k, len(by_spec[k]) - 1))
        lm_head_loss = options.pop("lm_head_loss", False)
        if not isinstance(lm_head_loss, bool):
            raise TypeError(f"lm_head_loss must be a bool, got {type(lm_head_loss).__name__}")
        head_spec = _head_spec(model, by_spec) if lm_head_loss else None
        self._build = dict(model=model, options=options, hypers=hypers, seed=seed, make=forge_optimizer)
        self.optimizers: list = [self._inner(k, s, by_spec[k], lm_head_loss=k == head_spec)
                                 for k, s in enumerate(specs)]
        self._specs = specs
        self._link()
        param_groups = [self.optimizers[k].param_groups[j] for k, j in order]
        torch.optim.Optimizer.__setstate__(self, {"defaults": dict(self.optimizers[0].defaults), "state": _States(self),
                                                  "param_groups": param_groups})
        self.capturable = False
        self.max_grad_norm = self.optimizers[0].max_grad_norm
        self.last_grad_norm: Optional[torch.Tensor] = None
        self.accumulation_steps = self.optimizers[0].accumulation_steps
        self.foreach = self.optimizers[0].foreach

    def _inner(self, k: int, spec, groups: list, lm_head_loss: bool = False):
        """The `ForgeOptimizer` of the k-th spec over `groups`: the optimizer's keywords only for its own spec;
        `lm_head_loss` for the spec whose groups hold the head."""
        build = self._build
        hypers = build["hypers"] if spec == self.spec else {}
        if build["model"] is not None:
            return build["make"](build["model"], spec, model_params=groups, seed=build["seed"] + k,
                                 lm_head_loss=lm_head_loss, **build["options"], **hypers)
        return build["make"](groups, spec, seed=build["seed"] + k, **build["options"], **hypers)

    def _link(self) -> None:
        """Each spec's first fused update of a step checks every spec's groups (`ParamStepper.siblings`)."""
        for inner in self.optimizers:
            inner._stepper.siblings = tuple(o._stepper for o in self.optimizers if o is not inner)

    # -- what the inner optimizers hold, as one -----------------------------
    @property
    def _inner_of(self) -> dict:
        return {p: inner for inner in self.optimizers for p in inner._param_index}

    @property
    def _param_index(self) -> dict:
        """Each parameter's index in the groups' order, as torch numbers them in a state dict."""
        params = [p for group in self.param_groups for p in group["params"]]
        return {p: i for i, p in enumerate(params)}

    @property
    def _handles(self) -> dict:
        return {p: h for inner in self.optimizers for p, h in inner._handles.items()}

    @property
    def _names(self) -> dict:
        return {p: n for inner in self.optimizers for p, n in inner._names.items()}

    state_dtype = _Shared("state_dtype")
    rounding = _Shared("rounding")
    linear_path = _Shared("linear_path")
    seed = _Shared("seed", offset=True)

    # -- torch.optim's methods ---------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """torch's `add_param_group`, to the optimizer of the group's spec ("spec", default the optimizer's); a
        spec no group had yet gets its own optimizer."""
        named = param_group.get("spec", self.spec)
        loaded = named if named is self.spec else load_spec(named)
        k = next((i for i, s in enumerate(self._specs) if s == loaded), None)
        group = {**param_group, "spec": loaded.name}
        if k is None:
            self.optimizers.append(self._inner(len(self._specs), loaded, [group]))
            self._specs.append(loaded)
            self._link()
        else:
            self.optimizers[k].add_param_group(group)
        self.param_groups.append(self.optimizers[k if k is not None else -1].param_groups[-1])

    @torch.no_grad()
    def step(self, closure=None):
        """Each spec's `step()`, after every spec's groups are checked (`ParamStepper.check_step`): a refused
        step changes no weight."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in self.optimizers:
            if not inner._stepper.progress.backward_open:  # else its step() closes the interrupted step
                inner._stepper.check_step()
        progresses = [inner._stepper.progress for inner in self.optimizers]
        if self.max_grad_norm is not None and all(p.clip is None and not p.backward_open for p in progresses):
            self._clip_by_global_norm(progresses)  # backward(loss) did not: a plain loss.backward(), nothing fused
        for inner in self.optimizers:
            _unhooked_step(inner)
        return loss

    def _clip_by_global_norm(self, progresses: list) -> None:
        """The clip coefficient of every spec's `.grad`s together, for each spec's `step()` to scale its own by:
        as `torch.nn.utils.clip_grad_norm_(all parameters, max_grad_norm)` (each spec's own norm would not be)."""
        grads = [p.grad for p in self._param_index if p.grad is not None and not data_parallel.is_placeholder(p.grad)]
        device = grads[0].device if grads else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float32, device=device)
        norm, coefficient = grad_passes.clip_coefficient(squares, grads, self.max_grad_norm)
        for progress in progresses:
            progress.clip = (norm, coefficient)
        self.last_grad_norm = norm
        for inner in self.optimizers:
            inner.last_grad_norm = norm

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`; with `max_grad_norm=c`, `ForgeOptimizer.backward`'s two passes for every spec at once,
        clipped by the global norm of all of their gradients (`grad_passes.clipped_backward`), exactly as
        `torch.nn.utils.clip_grad_norm_(all parameters, c)` before each spec's step."""
        if self.max_grad_norm is None:
            loss.backward()
            return
        self.last_grad_norm = grad_passes.clipped_backward(
            loss, [inner._stepper.progress for inner in self.optimizers], list(self._param_index), self.max_grad_norm)
        for inner in self.optimizers:
            inner.last_grad_norm = self.last_grad_norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        for inner in self.optimizers:
            inner.zero_grad(set_to_none)

    def detach(self) -> None:
        for inner in self.optimizers:
            inner.detach()

    def describe(self) -> str:
        """Which param groups each spec steps, then each spec's `ForgeOptimizer.describe()`."""
        where = {id(g): i for i, g in enumerate(self.param_groups)}
        shares = "; ".join(f"{s.name}: groups {', '.join(str(where[id(g)]) for g in o.param_groups)}"
                           for s, o in zip(self._specs, self.optimizers))
        return "\n".join([f"MixedSpecOptimizer ({shares})"] + [inner.describe() for inner in self.optimizers])

    def state_dict(self) -> dict:
        """torch's state dict, numbered in this optimizer's groups' order; each group carries its spec's
        `checkpoint.META_KEY` (what `load_state_dict` checks it against). torch's state_dict hooks registered on
        this optimizer run as torch runs them."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():  # torch's hooks, as torch runs them
            pre_hook(self)
        index = self._param_index
        out: dict = {"state": {}, "param_groups": [None] * len(self.param_groups)}
        where = {id(g): i for i, g in enumerate(self.param_groups)}
        for inner in self.optimizers:
            sd = inner.state_dict()
            local = list(inner._param_index)
            for i, values in sd["state"].items():
                out["state"][index[local[i]]] = values
            for group, saved in zip(inner.param_groups, sd["param_groups"]):
                saved["params"] = [index[p] for p in group["params"]]
                out["param_groups"][where[id(group)]] = saved
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            out = post_hook(self, out) or out
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load a `state_dict()` of a mixed optimizer with the same groups: each spec's share checked first
        (`checkpoint.check_state_dict`), then loaded, so that a dict that does not fit changes nothing."""
        state_dict = dict(state_dict)  # shallow copy, as torch's
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():  # torch's hooks, as torch runs them
            state_dict = pre_hook(self, state_dict) or state_dict
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has "
                             f"{len(self.param_groups)}")
        where = {id(g): i for i, g in enumerate(self.param_groups)}
        shares = []
        for inner in self.optimizers:
            groups, state, n = [], {}, 0
            for group in inner.param_groups:
                saved = dict(saved_groups[where[id(group)]])
                if len(saved["params"]) != len(group["params"]):
                    raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                                     "optimizer's group")
                for i in saved["params"]:
                    if i in state_dict["state"]:
                        state[n] = state_dict["state"][i]
                    n += 1
                saved["params"] = list(range(n - len(group["params"]), n))
                groups.append(saved)
            share = {"state": state, "param_groups": groups}
            checkpoint.check_state_dict(inner.spec, share, inner.param_groups, inner._keywords, inner._names,
                                        strict=strict)
            shares.append(share)
        for inner, share in zip(self.optimizers, shares):
            inner.load_state_dict(share, strict=strict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _head_spec(model: Optional[torch.nn.Module], by_spec: dict) -> int:
    """The index of the spec whose groups hold `model`'s LM head (`lm_head_loss=True` goes to its optimizer)."""
    if model is None:
        raise TypeError("lm_head_loss= goes with a module as the first argument; with parameters first, mark the "
                        "model with forge_dsl.fuse(model, lm_head_loss=True)")
    head = getattr(model, "get_output_embeddings", lambda: None)()
    weight = getattr(head, "weight", None)
    for k, groups in by_spec.items():
        if any(p is weight for g in groups for p in (g["params"] if isinstance(g, dict) else [g])):
            return k
    raise ValueError("lm_head_loss=True: no param group holds the model's LM head weight "
                     "(model.get_output_embeddings().weight); add it to the group of the spec that should step it")


# ForgeOptimizer's options (the keywords that are not the spec's), which every spec's optimizer takes
_OPTIONS = frozenset({"state_dtype", "rounding", "fuse", "linear_path", "foreach", "lm_head_loss", "max_grad_norm",
                      "accumulation_steps", "accumulation_dtype", "capturable"})


def _unhooked_step(inner) -> None:
    """`inner.step()` without torch's step hooks: the mixed optimizer's `step` runs them once, for all specs."""
    step = type(inner).step
    (step.__wrapped__ if getattr(step, "hooked", False) else step)(inner)
