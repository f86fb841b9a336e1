"""`ForgeOptimizer`: a torch.optim.Optimizer that updates linear weights inside backward.

    opt = forge_dsl.ForgeOptimizer(model, "adamw", lr=3e-4, betas=(0.9, 0.95),
                                   weight_decay=0.1, state_dtype="int8")
    loss.backward()   # every eligible nn.Linear weight is updated here, tile by tile
    opt.step()        # the remaining parameters, from their .grad, same spec
    opt.zero_grad()

torch.optim's convention works too, for code that builds optimizers as `cls(params, **kwargs)`
(Hugging Face `optimizer_cls_and_kwargs`, Lightning, config files): mark the model once with
`forge_dsl.fuse(model)`, then pass its parameters or param groups:

    forge_dsl.fuse(model)
    opt = forge_dsl.ForgeOptimizer(model.parameters(), "adamw", lr=3e-4)

How it works: each eligible `nn.Linear` (one whose forward is nn.Linear's own:
`installer.fusion_refusal` says why another is not) gets an instance-level `forward`
(`installer.attach`) that runs `linear.fused_forward` while its optimizer lives.  Its backward computes
ΔX = ΔY·W with the old weight, then calls the tile-fused kernel, which
accumulates each tile of dW = ΔYᵀX in registers and applies the spec's update
there: the weight never gets a `.grad`.  Module names and `state_dict` keys do
not change; `detach()` (or the optimizer's end) gives each module back exactly
the forward it had, and a copy of the model (`copy.deepcopy`, pickle,
`torch.save`) is a plain model.

A step is whole as the user sees it: each fused weight's `step` counter moves
when its update is applied.  If an exception interrupts backward, the layers it
updated keep their update; a retry is refused until `step()`, which closes the
step without stepping the parameters whose gradients that backward left
incomplete (it warns), after which training goes on.

Exactness rules (each refused loudly when it cannot hold):
  * a weight used by several modules (tied embeddings) is never fused; a
    Linear called several times in one forward pass (a shared layer) returns
    its dW to autograd for that step and is stepped unfused, exactly; two
    parameters that share memory (`nn.Parameter(w.data)`, overlapping views)
    are refused at construction and by `add_param_group`;
  * a module whose weight was replaced (`module.weight = nn.Parameter(new)`)
    runs its own forward: the new weight gets a `.grad` as under torch, and
    `add_param_group` of it fuses it in its module again;
  * a step is checked whole before its first update (`ParamStepper.check_step`:
    every group's hyperparameters, parameters that changed shape or went to
    the meta device): a refused step changes no weight;
  * gradient accumulation is opt-in (`accumulation_steps=k`: each backward adds
    the fused weights' dW into a float32 buffer, the k-th applies the update);
    without it, a forward with gradients through a fused weight after its update
    and before `step()` (or a second backward through it) is refused, because
    this step's update already happened;
  * a fused weight that also gets a gradient from a use outside its Linear
    (`F.linear(x, module.weight)`) raises, in backward or in `step()`;
  * after its update a fused weight's `.grad` is a `consumed_grad.ConsumedGrad`,
    which holds no memory and makes every reader say why it cannot be exact:
    global-norm clipping needs every gradient before any update, so after a
    plain `loss.backward()` `clip_grad_norm_` and `clip_grads_with_norm_` raise,
    however they were imported (with `max_norm=inf`, which only measures,
    `clip_grad_norm_` returns NaN and scales nothing); exact clipping is opt-in:
    `max_grad_norm=c` with `optimizer.backward(loss)` (two backward passes,
    `grad_passes`; Hugging Face Trainer: `forge_dsl.ForgeTrainer`), after which
    `clip_grad_norm_` returns the norm and scales nothing; `clip_grad_value_`
    raises (clamp in the spec instead);
  * `torch.autocast` over a fused layer raises: train a bf16 model instead;
  * a model sharded with tensor parallelism (DTensor weights) is fused shard by shard where each rank's dW is
    complete, and the rest is stepped from reduced gradients (`forge_dsl.training.tensor_parallel`);
  * a model sharded with FSDP2 (`fully_shard`) has each shard updated in backward as its reduced gradient
    lands (`forge_dsl.training.data_parallel`); DDP, FSDP1 and FSDP2 on a 2-D mesh are refused at construction.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

from ..kernels.checks import DEFAULT_ROUNDING, DEFAULT_SEED, check_rounding
from ..kernels.foreach import FOREACH_MAX_ELEMENTS, shared_launch_key
from ..kernels.policy import LINEAR_PATHS, interpreting
from ..spec.keywords import check_seed, resolve_hypers
from ..spec.loading import SpecLike, load_spec
from . import captured, checkpoint, data_parallel, grad_passes, hf_head, installer, mixed, phased, tensor_parallel
from .consumed_grad import OUTSIDE_USE_MESSAGE, ConsumedGrad
from .installer import fuse
from .stepper import INITIAL_KEY, ParamStepper, group_hypers, initial_value_hypers

__all__ = ["ForgeOptimizer", "fuse"]


def _is_placeholder(grad: torch.Tensor) -> bool:
    """A fused weight's `ConsumedGrad` / `ReportingGrad`, or an FSDP2 shard's placeholder: nothing to step."""
    return isinstance(grad, ConsumedGrad) or data_parallel.is_placeholder(grad)


class _Stepped:
    """An attribute of the optimizer kept by its stepper (`stepper.ParamStepper`), which every update reads."""

    def __init__(self, name: str, doc: str, check: Optional[Callable[[Any], Any]] = None) -> None:
        self.name, self.__doc__, self.check = name, doc, check

    def __get__(self, opt, owner=None):
        return self if opt is None else getattr(opt._stepper, self.name)

    def __set__(self, opt, value) -> None:
        setattr(opt._stepper, self.name, value if self.check is None else self.check(value))


class ForgeOptimizer(torch.optim.Optimizer):
    """An optimizer written as a `.fopt` spec, fused into the backward of linear layers.

    Args:
        params: the nn.Module to train (its eligible nn.Linear weights are updated in backward), or, as
            every torch optimizer takes them, parameters or param-group dicts of a model marked with
            `forge_dsl.fuse(model)` (the eligible Linear weights among them are fused; without `fuse`, every
            parameter is stepped from `.grad` in `step()`, with a warning).
        spec: a built-in name ("adamw", "lion", ...) or a path to any `.fopt` (compiled on first use).
        model_params: with a module as `params`, optional parameters or param groups of it (e.g. no weight
            decay on norms and biases); default: all of its parameters that require grad.
        state_dtype: optimizer state layout: "fp32", "bf16", "int8" or "int4" (block-64 quantized), or a
            dict per state name; default "fp32".
        rounding: bf16 weight write-back, "stochastic" (default) or "nearest".
        seed: stochastic-rounding seed (each parameter draws its own stream from it).
            For float32 weights, the fused dW product follows torch's own float32 matmul setting:
            exact fp32 under `torch.set_float32_matmul_precision("highest")` (the default), TF32
            tensor cores under "high" or "medium", like every other matmul of the model.
        fuse: False steps every parameter from its gradient (no fusion; for comparisons).
        linear_path: "auto" (default), "fused" or "slab": how a fused layer's update runs
            (`forge_dsl.kernels.linear_step`): "auto" takes what `kernels.policy.auto_linear_path` decides
            for the layer's shape, token count, state layout and GPU; "fused" the tile-fused kernel (fp32
            dW in registers) everywhere; "slab" cuBLAS dW in L2-sized row slabs, rounded to bf16 as
            autograd's dW is, each consumed at once by the element-wise kernel.
        lm_head_loss: with a module as `params`, a Hugging Face causal LM: its loss computed without logits and
            its LM head updated a vocabulary block at a time in backward (see `fuse`); default False.
        max_grad_norm: clip by the global gradient norm, exactly as `torch.nn.utils.clip_grad_norm_(params, c)`
            before each step; call `backward(loss)` in place of `loss.backward()` (see there). Default None.
        accumulation_steps: gradient accumulation over k backwards before each `step()` (torch's loop): the
            fused weights' gradients summed in a buffer per weight, the k-th backward applies the update.
        accumulation_dtype: that buffer's dtype, "fp32" (default: torch's fp32 accumulation) or "bf16".
        capturable: True lets `forge_dsl.CapturedStep` record the whole step into a CUDA graph (torch's
            `capturable=`; what it refuses and why: `training.captured`). Default False.
        foreach: True (default) steps the parameters left to `step()` that have up to 2**20
            elements and share dtypes and state layouts (norm weights, biases) in one launch
            (`forge_dsl.kernels.foreach`), as torch.optim's `foreach` does: each launch costs host
            time. The update of each element is the same; their stochastic rounding draws
            from the first one's seed. False: one launch per parameter.
        **hypers: the spec's keywords with torch's names and defaults (`lr`, `betas=(...)`, ...).

    Raises:
        ValueError: bad hyperparameters (like torch.optim), `max_grad_norm` or `accumulation_steps` out of range
            (or with tensor parallelism), or a model whose parameters the kernels cannot run on (dtype or device).
    """

    def __new__(cls, params=None, spec=None, *args, **options):
        """A `mixed.MixedSpecOptimizer` (one ForgeOptimizer per spec) where a param group names a spec other than
        `spec`; else a ForgeOptimizer."""
        if cls is ForgeOptimizer and mixed.names_other_specs(params, spec, options.get("model_params")):
            return mixed.MixedSpecOptimizer(ForgeOptimizer, params, spec, *args, **options)
        return super().__new__(cls)

    def __init__(
        self,
        params: Union[torch.nn.Module, Iterable],
        spec: Optional[SpecLike] = None,
        *,
        model_params: Optional[Iterable] = None,
        state_dtype: Union[str, Mapping[str, str]] = "fp32",
        rounding: str = DEFAULT_ROUNDING,
        seed: int = DEFAULT_SEED,
        fuse: bool = True,
        linear_path: str = "auto",
        foreach: bool = True,
        lm_head_loss: bool = False,
        max_grad_norm: Optional[float] = None,
        accumulation_steps: int = 1,
        accumulation_dtype: str = "fp32",
        capturable: bool = False,
        **hypers: Any,
    ) -> None:
        if spec is None:
            raise TypeError("ForgeOptimizer needs a spec: a built-in name ('adamw', 'lion', ...) or a .fopt path, "
                            "e.g. ForgeOptimizer(model.parameters(), 'adamw', lr=1e-3)")
        if not isinstance(lm_head_loss, bool):
            raise TypeError(f"lm_head_loss must be a bool, got {type(lm_head_loss).__name__}")
        if not isinstance(capturable, bool):
            raise TypeError(f"capturable must be a bool, got {type(capturable).__name__}")
        self.capturable = capturable
        if isinstance(params, torch.nn.Module):
            model = params
            if lm_head_loss and fuse:
                hf_head.check_installable(model)
            sharded_dp = fuse and data_parallel.fully_sharded(model)
            if sharded_dp:  # FSDP2: each shard updated in backward as its gradient lands, nothing fused
                refusal = data_parallel.fsdp2_refusal(model)
                if refusal is not None:
                    raise ValueError(refusal)
            candidates = installer.candidates(model) if fuse and not sharded_dp else {}
            if sharded_dp:
                candidates = {id(p): installer.Candidate(p, None, name, None) for name, p in model.named_parameters()}
            params = model_params if model_params is not None else [
                p for p in model.parameters() if p.requires_grad]
        else:
            if model_params is not None:
                raise TypeError("model_params= goes with a module as the first argument; pass the parameters or "
                                "param groups first instead")
            if lm_head_loss:
                raise TypeError("lm_head_loss= goes with a module as the first argument; with parameters first, "
                                "mark the model with forge_dsl.fuse(model, lm_head_loss=True)")
            if isinstance(params, torch.Tensor):
                raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                                f"but got {torch.typename(params)}")
            model = None
            candidates = {}
            sharded_dp = False
        if linear_path not in LINEAR_PATHS:
            raise ValueError(f"linear_path must be one of {', '.join(LINEAR_PATHS)}, got {linear_path!r}")
        self.foreach = bool(foreach)
        self.max_grad_norm = grad_passes.check_max_grad_norm(max_grad_norm)
        self.accumulation_steps, buffer_dtype = grad_passes.check_accumulation(accumulation_steps, accumulation_dtype)
        self.accumulation_dtype = accumulation_dtype
        self.last_grad_norm: Optional[torch.Tensor] = None
        check_rounding(rounding)
        self.spec = load_spec(spec)
        resolve_hypers(self.spec, hypers, caller="ForgeOptimizer")  # unknown keywords, ranges: raise now
        defaults = dict(self.spec.keyword_defaults())
        self._keywords = frozenset(defaults)  # what group_hypers reads from a param group, on every update
        hypers = dict(hypers)
        for g in self.spec.groups:  # members given by name (beta1=...) become torch's tuple (betas=...)
            if any(m in hypers for m in g.members):
                values = list(hypers.get(g.name, defaults[g.name]))
                for i, m in enumerate(g.members):
                    if m in hypers:
                        values[i] = hypers.pop(m)
                hypers[g.name] = tuple(values)
        defaults.update(hypers)
        super().__init__(params, defaults)
        for group in self.param_groups:
            resolve_hypers(self.spec, group_hypers(group, self._keywords), caller="ForgeOptimizer")  # validate early
        self._stepper = ParamStepper(self.spec, self.state, self.param_groups, self._keywords, state_dtype=state_dtype,
                                     rounding=rounding, seed=check_seed(seed), linear_path=linear_path)
        progress = self._stepper.progress
        progress.max_grad_norm = self.max_grad_norm
        progress.accumulation_steps, progress.accumulation_dtype = self.accumulation_steps, buffer_dtype
        for group in self.param_groups:
            for p in group["params"]:
                self._stepper.add(p, group)
        self._head_installs: list = []  # hf_head.install's handles, one per causal LM (lm_head_loss)
        self._unfused_reason: dict[torch.nn.Parameter, str] = {}
        if model is None:  # parameters first: what `fuse(model)` recorded for them
            candidates = {id(p): c for p in self._param_index if (c := installer.marked(p)) is not None}
            if fuse and not any(c.module_ref is not None for c in candidates.values()):
                warnings.warn("ForgeOptimizer got parameters of no model marked with forge_dsl.fuse(model): every "
                              "parameter is stepped from .grad in step() (exact, but without the fused update's "
                              "memory saving). Call forge_dsl.fuse(model) before building the optimizer, or pass "
                              "the model itself.", stacklevel=2)
        self._names = {p: candidates[id(p)].name for p in self._param_index if id(p) in candidates}
        self._stepper.names = self._names
        for p in self._param_index:
            self._check_param(p)
        self._check_own_memory(list(self._param_index))
        if self._stepper.phased is not None:  # refused before anything is installed; Embeddings from .grad
            candidates = phased.check_and_unfuse_rows(self.spec, list(self._param_index), self._names, candidates,
                                                      state_dtype=state_dtype, max_grad_norm=self.max_grad_norm,
                                                      accumulation_steps=self.accumulation_steps,
                                                      lm_head_loss=lm_head_loss or any(
                                                          installer.head_loss_model(p) is not None
                                                          for p in self._param_index), sharded_dp=sharded_dp)
        sharded = next((p for p in self._param_index if tensor_parallel.is_dtensor(p)), None)
        if capturable:  # refused before anything is installed; Embeddings from .grad
            candidates = captured.check_and_unfuse_rows(
                self.spec, candidates, max_grad_norm=self.max_grad_norm, accumulation_steps=self.accumulation_steps,
                lm_head_loss=lm_head_loss or any(installer.head_loss_model(p) is not None for p in self._param_index),
                sharded=sharded is not None or sharded_dp, linear_path=linear_path)
        if (sharded is not None and not sharded_dp and
                (self.max_grad_norm is not None or self.accumulation_steps > 1)):
            raise ValueError(
                f"max_grad_norm= and accumulation_steps= are not supported with tensor parallelism yet ("
                f"'{self._names.get(sharded, 'a parameter')}' is a DTensor): the norm of sharded gradients needs an "
                "all-reduce across the mesh that FORGE does not do. Construct the optimizer with fuse=False (without "
                "these options) and use "
                "torch.nn.utils.clip_grad_norm_ and .grad accumulation, or train without them")
        self._shard_updates = None
        if sharded_dp:
            self._shard_updates = data_parallel.ShardUpdates(
                self._stepper, [p for p in self._param_index if tensor_parallel.is_dtensor(p)])
            self._finalizer = weakref.finalize(self, self._shard_updates.remove)
        elif fuse:
            heads = [model] if lm_head_loss else []
            if model is None:
                heads = [m for p in self._param_index if (m := installer.head_loss_model(p)) is not None]
            forwards, self._head_installs = installer.attach(self._stepper, self._param_index, candidates, heads,
                                                             self._unfused_reason)
            # the optimizer's end gives every module back its forward (detach() does it at once)
            self._finalizer = weakref.finalize(self, installer.restore_all, [f.restore for f in forwards] +
                                               [install.remove for install in self._head_installs])
            for p in self._handles:  # before any backward: a compiled backward's CUDA graphs never allocate it
                self._stepper.prepare_state(p)
            if capturable:
                self._stepper.use_host_table(list(self._handles))

    # -- what the stepper holds, as torch.optim's users read it ---------------
    state_dtype = _Stepped("state_dtype", "The state layout new states get (a loaded state dict sets it to the one "
                                          "it was saved with).")
    rounding = _Stepped("rounding", 'How bf16 weights are written: "stochastic" or "nearest".')
    seed = _Stepped("seed", "The stochastic-rounding seed new states draw theirs from.", check=check_seed)
    linear_path = _Stepped("linear_path", 'How a fused layer\'s update runs: "auto", "fused" or "slab" '
                                          '(`kernels.linear_step`).')

    @property
    def _param_index(self) -> dict:
        """Each parameter's index in the groups' order (what its seed is drawn from)."""
        return self._stepper.param_index

    @property
    def _handles(self) -> dict:
        """Each fused weight's handle (`weight.FusedWeight`), by parameter."""
        return self._stepper.progress.weights

    # -- construction ------------------------------------------------------
    def _check_param(self, p: torch.Tensor) -> None:
        """Refuse a parameter the kernels cannot update (dtype, device, layout), or whose int8 / int4 state a
        tensor-parallel shard would cut (`tensor_parallel.quantized_sharding_refusal`): before any update."""
        if p.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"parameter of dtype {p.dtype}: FORGE kernels update float32 or bfloat16 weights; "
                "convert the model with model.float() or model.bfloat16()"
            )
        if p.is_meta:
            raise ValueError("parameter on the meta device has no data for FORGE to update: materialize the model "
                             "first (model.to_empty(device=...) and initialize it, or load its weights)")
        if p.device.type != "cuda" and not interpreting():
            raise ValueError(
                f"parameter on {p.device}: FORGE kernels run on CUDA (model.cuda()), or on the CPU only in "
                "the Triton interpreter (TRITON_INTERPRET=1 set before importing triton, for tests)"
            )
        if not tensor_parallel.local(p).is_contiguous():
            raise ValueError("FORGE updates parameters in place and needs them contiguous")
        if tensor_parallel.is_dtensor(p):
            layouts = tensor_parallel.global_layouts(self.spec, p, self.state_dtype).values()
            refusal = tensor_parallel.quantized_sharding_refusal(p, layouts, self._names.get(p, "a parameter"))
            if refusal is not None:
                raise ValueError(refusal)
            self._stepper.shard_of[p] = tensor_parallel.shard_index(p)

    def _check_own_memory(self, params: list) -> None:
        """Refuse two of `params` whose memory overlaps (one buffer under two Parameters: `nn.Parameter(w.data)`,
        views of one tensor): each update is applied in place, so one would change the other's weight behind
        it (a fused layer's update inside backward, before another layer's backward reads the memory)."""
        pair = installer.overlapping_pair(params)
        if pair is None:
            return
        a, b = (f"'{self._names[p]}'" if p in self._names else f"#{i} (in the groups' order)" for i, p in pair)
        raise ValueError(
            f"parameters {a} and {b} share memory (one is nn.Parameter(w.data) of the other, or they are views of "
            "one tensor): FORGE updates each in place, one inside backward before the other's backward reads it, "
            "so neither would get torch's update. A weight that two modules use must be one Parameter: tie them "
            "(second_module.weight = first_module.weight, as tied embeddings are), which FORGE steps once from the "
            "summed gradient, exactly; or give each its own memory (nn.Parameter(w.detach().clone()))"
        )

    def detach(self) -> None:
        """Give every fused Linear back the forward it had (the model then trains with any optimizer); the
        parameters left are stepped from `.grad` in `step()`."""
        for handle in self._stepper.progress.accumulated():  # the micro-batches so far become .grad, as torch's
            weight = handle.weight_ref()
            grad = handle.buffer.to(weight.dtype)
            if weight.grad is not None and not _is_placeholder(weight.grad):
                grad += weight.grad
            weight.grad = grad if weight.grad is not None else None  # None: zero_grad() dropped them
            handle.drop_buffer()
        installer.detach(self._stepper, self._head_installs)
        if self._shard_updates is not None:  # FSDP2: no more updates in backward, every shard stepped in step()
            self._shard_updates.remove()

    def add_param_group(self, param_group: dict) -> None:
        """torch's `add_param_group`, checked whole before the optimizer changes (a group refused is not added).
        A parameter that replaced the weight of one fused module (`module.weight = nn.Parameter(new)`) is fused
        in its module in place of the old one (`installer.fuse_replacement`); the others are stepped from
        `.grad` in `step()`."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            if "spec" in group:
                mixed.check_own_spec(group, self.spec, len(self.param_groups) - 1)
            cfg = resolve_hypers(self.spec, group_hypers(group, self._keywords), caller="ForgeOptimizer")
            if hasattr(self, "_stepper"):  # else called by torch.optim.Optimizer.__init__: checked there
                for p in group["params"]:
                    self._check_param(p)
                self._check_own_memory([*self._param_index, *group["params"]])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        # Initial values that read hyperparameters (`scalar base_lr = lr`) take them as they are now, before
        # any LR schedule changes the group: torch optimizers that keep a base value read it at construction.
        group.setdefault(INITIAL_KEY, {name: cfg.hypers[name] for name in initial_value_hypers(self.spec)})
        if not hasattr(self, "_stepper"):
            return
        for p in group["params"]:
            self._stepper.add(p, group)
            replaced = installer.fuse_replacement(self._stepper, p)
            if replaced is not None:
                self._names[p] = replaced.name
                self._unfused_reason[replaced.weight_ref()] = "replaced in its module by a Parameter added later"
                self._stepper.drop_prepared([replaced.weight_ref()])
                self._stepper.prepare_state(p)

    # -- the update --------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Step every parameter that has a `.grad` (the fused weights were stepped in backward), after checking
        that the whole step can be applied (`ParamStepper.check_step`).

        torch.optim's step hooks (`register_step_pre_hook`, `register_step_post_hook`, and the global
        `torch.optim.optimizer.register_optimizer_step_pre_hook` / `_post_hook`) run around this call, as
        torch runs them: a pre-hook runs after the fused weights' updates of this step (in backward), before
        the other parameters' updates."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        progress = self._stepper.progress
        if progress.backward_open:  # the last backward was interrupted: close the step, step nothing from .grad
            updated, fused = progress.close_interrupted()
            warnings.warn(f"the last backward was interrupted after FORGE had updated {updated} of the {fused} "
                          "fused layers (they keep this step's update): step() closed the step without stepping "
                          "the parameters updated from .grad, whose gradients that backward left incomplete (nor "
                          "the accumulated gradients, which it dropped). Call optimizer.zero_grad() and run the "
                          "batch again.", RuntimeWarning, stacklevel=2)
            progress.drop_accumulated()
            self._end_step()
            return loss
        self._stepper.check_step()
        for handle in progress.accumulated():  # micro-batches of a shared layer, which autograd summed into .grad
            weight = handle.weight_ref()
            if weight.grad is not None and not _is_placeholder(weight.grad):
                handle.buffer += weight.grad
                weight.grad = None
        if self.max_grad_norm is not None:
            self._clip_grads()
        for group in self.param_groups:
            hypers = self._stepper.group_hypers(group)
            shared: dict[tuple, list[torch.nn.Parameter]] = {}  # (step, shared_launch_key, shard) -> params
            grads: dict[torch.nn.Parameter, torch.Tensor] = {}  # the local gradient of each, reduced where Partial
            for p in group["params"]:
                handle = progress.weights.get(p)
                if handle is not None and handle.buffer is not None:  # accumulated, not applied in backward
                    if p.grad is not None:  # else model.zero_grad() dropped the micro-batches: nothing to step
                        self._stepper.from_grad(p, handle.buffer, self._stepper.state_for(p, group, hypers), hypers)
                        p.grad = handle.consumed_grad()
                    handle.drop_buffer()
                    continue
                if handle is not None and handle.updated:
                    if p.grad is not None and not _is_placeholder(p.grad):
                        raise RuntimeError(f"'{handle.name}': " + OUTSIDE_USE_MESSAGE)
                    continue  # its step counter moved with its update (a zero_grad() since cleared its .grad)
                if p.grad is None or _is_placeholder(p.grad):
                    continue
                if handle is not None:  # fused, but not through its module's forward this step
                    handle.bypassed = not handle.shared and handle.plain_reason is None
                if p.grad.is_sparse:
                    raise ValueError("sparse gradients are not supported (nn.Embedding(sparse=True))")
                state = self._stepper.state_for(p, group, hypers)
                param, grad = tensor_parallel.local(p), tensor_parallel.local_grad(p)
                key = None
                if self.foreach and param.numel() <= FOREACH_MAX_ELEMENTS and self._stepper.phased is None:
                    key = shared_launch_key(self.spec, param, grad, state)
                if key is not None:  # shards of one rank draw their own bits, replicas the same: kept apart
                    shared.setdefault((int(state["step"]), key, self._stepper.shard_of.get(p)), []).append(p)
                    grads[p] = grad
                    continue
                self._stepper.from_grad(p, grad, state, hypers)
            for (count, _, _), params in shared.items():
                self._stepper.flat(params, [grads[p] for p in params], count, hypers)
        self._end_step()
        return loss

    def _end_step(self) -> None:
        self._stepper.progress.end()
        if self._shard_updates is not None:
            self._shard_updates.end_step()

    def _clip_grads(self) -> None:
        """Scale the gradients `step()` steps by this step's clip coefficient: the one `backward(loss)` computed,
        or, where no backward computed one (gradient accumulation; no fused weight), the coefficient of every
        gradient's norm now (accumulation buffers and `.grad`s), as `clip_grad_norm_(params, max_grad_norm)`
        computes it. Sets `last_grad_norm`."""
        progress = self._stepper.progress
        grads = [p.grad for p in self._param_index if p.grad is not None and not _is_placeholder(p.grad)]
        if progress.clip is not None:
            norm, coefficient = progress.clip
        else:
            buffers = [h.buffer for h in progress.accumulated()]
            device = (buffers or grads)[0].device if buffers or grads else torch.device("cpu")
            squares = torch.zeros((), dtype=torch.float32, device=device)
            norm, coefficient = grad_passes.clip_coefficient(squares, [*buffers, *grads], self.max_grad_norm)
            for buffer in buffers:
                buffer.mul_(coefficient.to(buffer.device))
        for g in grads:
            tensor_parallel.local(g).mul_(coefficient.to(g.device))
        self.last_grad_norm = norm

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` for an optimizer constructed with `max_grad_norm=c`: backward twice, exactly as
        `loss.backward()`, `torch.nn.utils.clip_grad_norm_(params, c)` and `step()` would update (module docstring).

        First pass (`retain_graph=True`): each fused weight's squared gradient norm, summed on the device, and the
        other parameters' `.grad`s; nothing is updated. The total norm (`last_grad_norm`, a 0-d float32 device
        tensor) and the coefficient min(1, c / (norm + 1e-6)) follow without a host sync. Second pass: each fused
        weight's update from its gradient times the coefficient (dW formed a slab of rows at a time, as
        autograd rounds it); the other parameters keep the first pass's `.grad`, which `step()` scales by the
        coefficient before stepping them, and so does every other leaf the graph reaches (an input with
        requires_grad): each gets its gradient once. Hooks on modules and tensors run in both passes. A non-finite norm is not an error (`clip_grad_norm_`'s
        `error_if_nonfinite=False`): a NaN norm makes every update NaN, as torch's clipping does.

        Without `max_grad_norm`, or with `accumulation_steps` > 1 (the norm of the accumulated gradient is taken
        in `step()`), it is `loss.backward()`."""
        if self.max_grad_norm is None or self.accumulation_steps > 1 or not self._handles:
            loss.backward()
            return
        self.last_grad_norm = grad_passes.clipped_backward(loss, [self._stepper.progress], list(self._param_index),
                                                           self.max_grad_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's `zero_grad`. Between a backward and `step()` it warns: the fused weights were updated inside
        that backward, which no zero_grad undoes; the other gradients are cleared, so `step()` steps none of
        them, as torch's `step()` after `zero_grad()` steps nothing. Accumulated gradients (`accumulation_steps`)
        are dropped, as torch's accumulated `.grad`s are."""
        updated, _ = self._stepper.progress.updated_count()
        self._stepper.progress.drop_accumulated()
        if self._shard_updates is not None:
            self._shard_updates.drop_accumulated()
            for p in self._param_index:  # a shard's placeholder goes whatever set_to_none says (FSDP2 adds to it)
                if data_parallel.is_placeholder(p.grad):
                    p.grad = None
        super().zero_grad(set_to_none)
        if updated:
            warnings.warn(
                f"zero_grad() after backward and before step(): the {updated} fused weights were already updated "
                "inside that backward (an update zero_grad() cannot undo); the other gradients are cleared, so "
                "step() steps none of them. To skip a batch, decide before loss.backward(); otherwise call "
                "zero_grad() after step() or before backward.", RuntimeWarning, stacklevel=2)

    # -- reporting and checkpoints -----------------------------------------
    def describe(self) -> str:
        """Which weights are updated inside backward, and why the others are not; the state layout asked for
        (`state_dtype`, the saved one after `load_state_dict`) and the layouts the states hold."""
        if any(p.dtype == torch.bfloat16 for p in self._param_index):
            weights = f"rounding {self.rounding}"
        else:  # the rounding applies to bf16 weights only
            weights = "fp32 weights, written exactly"
        lines = [f"ForgeOptimizer({self.spec.name}, state {self.state_dtype}, {weights})"]
        held = checkpoint.held_layouts(self.spec, self.state.values())
        if held is not None:
            lines.append(f"  state held: {held}")
        handles = [h for h in self._handles.values() if not h.replaced]
        replaced = [h.name for h in self._handles.values() if h.replaced]
        fused = [h.name for h in handles if not h.shared and not h.bypassed and h.plain_reason is None]
        shared = [h.name for h in handles if h.shared]
        plain = [h for h in handles if h.plain_reason is not None and not h.shared]
        bypassed = [h.name for h in handles if h.bypassed]
        lines.append(f"  fused in backward ({len(fused)}): " + (", ".join(fused) or "none"))
        for install in self._head_installs:
            lines.append(f"  loss without logits (forge_dsl.training.hf_head): {install.describe()}")
        if shared:
            lines.append(f"  unfused, used several times in the last step ({len(shared)}): " + ", ".join(shared))
        if bypassed:
            lines.append(f"  unfused, its weight read outside its module's forward in the last step (e.g. by a fused "
                         f"linear cross-entropy), stepped from .grad ({len(bypassed)}): " + ", ".join(bypassed))
        for h in plain:
            lines.append(f"  unfused in the last step, {h.plain_reason}: {h.name}")
        if replaced:
            lines.append(f"  unfused, its module's weight was replaced (module.weight = nn.Parameter(...)): the new "
                         f"one trains from .grad, stepped where this optimizer holds it (add_param_group fuses it "
                         f"again) ({len(replaced)}): " + ", ".join(replaced))
        for p, why in self._unfused_reason.items():
            lines.append(f"  unfused, {why}: {self._names.get(p, '?')}")
        if self.max_grad_norm is not None:
            lines.append(f"  clipped by the global gradient norm to {self.max_grad_norm:g} (optimizer.backward(loss)"
                         + (", the norm taken in step())" if self.accumulation_steps > 1 else ": two backward passes)"))
        if self.accumulation_steps > 1:
            lines.append(f"  gradients accumulated over {self.accumulation_steps} backwards "
                         f"({self.accumulation_dtype} buffer per fused weight)")
        shards = [] if self._shard_updates is None else [
            self._names.get(p, "?") for p in self._param_index if tensor_parallel.is_dtensor(p)]
        if shards:
            when = "in step(), clipped" if self.max_grad_norm is not None else "in backward, as its gradient lands"
            lines.append(f"  FSDP2 shards updated {when} ({len(shards)}): " + ", ".join(shards))
        rest = [self._names.get(p, "?") for p in self._param_index if p not in self._handles and p not in
                self._unfused_reason and self._names.get(p, "?") not in shards]
        lines.append(f"  stepped from .grad in step() ({len(rest)}): " + (", ".join(rest) or "none"))
        return "\n".join(lines)

    def state_dict(self) -> dict:
        """torch's state dict; each param group carries `checkpoint.META_KEY`: the spec, its hash, the state
        layout, rounding and seed, and which parameters have no state, which `load_state_dict` checks the states
        against (forge_dsl/training/checkpoint.py says why it sits in the groups: torch.distributed.checkpoint
        keeps them). torch's state_dict hooks run as torch runs them; the post-hooks see the finished dict."""
        for group in self.param_groups:
            group[checkpoint.META_KEY] = self._stepper.checkpoint_metadata()
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = type(post_hooks)()  # run below, on the finished dict
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        without_state = checkpoint.without_state(self.param_groups, self.state)
        for group in sd["param_groups"]:  # not the live groups' dicts: a caller may edit what it got
            group[checkpoint.META_KEY] = {**self._stepper.checkpoint_metadata(), "without_state": without_state}
        for index, p in enumerate(self._param_index):  # torch numbers parameters in the groups' order
            if tensor_parallel.is_dtensor(p) and index in sd["state"]:  # sharded state: DTensors of p's mesh
                layouts = tensor_parallel.global_layouts(self.spec, p, self.state_dtype)
                sd["state"][index] = tensor_parallel.global_state(p, self.state[p], layouts)
        for hook in post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load a `state_dict()` after checking all of it (`checkpoint.check_state_dict`: spec, layouts, dtypes,
        shapes, step, seed, no entry lost): a dict that does not match raises ValueError saying why and what to
        do, and leaves the optimizer as it was. States keep their saved layouts (int8 codes, fp32 scales) and move
        to their parameter's device; step, seed and scalar states stay on the CPU, where `init_state` makes them.
        The saved state layout, rounding and seed become this optimizer's (for parameters without state yet).

        A parameter the saving optimizer had stepped but whose entry is missing from "state" (deleted after
        saving) is refused; `strict=False` warns instead and starts it from fresh state. One it never stepped
        has no entry, as in torch's state dicts, and loads without state (checkpoint.py's docstring says how
        they are told apart). torch's load_state_dict hooks run as torch runs them: a pre-hook gets a shallow
        copy of `state_dict` and may return the dict to load; the post-hooks run after loading."""
        if isinstance(state_dict, Mapping):
            state_dict = dict(state_dict)  # shallow copy, as torch's
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        loaded = checkpoint.check_state_dict(self.spec, state_dict, self.param_groups, self._keywords, self._names,
                                             strict=strict)
        if loaded.lost:
            warnings.warn(f"load_state_dict(strict=False): state_dict has no state for {', '.join(loaded.lost)}, "
                          "which the optimizer that saved it had stepped; they start from fresh state (step 0)",
                          UserWarning, stacklevel=2)
        for p, values in loaded.states.items():
            if tensor_parallel.is_dtensor(p):  # this rank's shard of each state, whatever the saved placements
                for key, t in values.items():
                    values[key] = tensor_parallel.local_state(p, key, t)
        self.state.clear()
        self.state.update(loaded.states)
        self._stepper.drop_prepared(loaded.states)
        self._stepper.state_shapes.clear()
        self._stepper.state_shapes.update((p, p.shape) for p in loaded.states)
        for group, values in zip(self.param_groups, loaded.groups):
            group.update(values)
        meta = loaded.meta
        self.state_dtype = meta["state_dtype"]
        self.rounding = meta["rounding"]
        self.seed = meta["seed"]
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
