"""Warp-specialized launches that reuse what the last checked call with the same argument metadata decided.

A training loop calls `fused_linear_step` for every layer on every step with arguments whose metadata
repeats: shapes, strides, dtypes, devices, 16-byte alignment, the state's tensors, the spec's variant.
What the host does with them (the checks, the tile config, and Triton's `JITFunction.run`: the
arguments' specialization, its cache key, the launch) took ~120–190 µs a call on the H200's host,
longer than the kernel on a 1024×4096 layer at 512 tokens (docs/PERF.md, v14). Here a call whose
metadata matches an earlier, fully checked call's skips all of it: it computes the step's host scalars
(from this call's keywords, so a learning-rate schedule is followed), makes the two activation
descriptors, and calls the compiled kernel's launcher with the earlier call's arguments in the kernel's
parameter order (what `JITFunction.run` passes it), the new tensors and scalars in place:

    key = call_key(spec, combo, names, scalar_names, x, dy, weight, state, rounding, tf32, config)  # None: no
    entry = lookup(key, spec)                                                     # None: not prepared yet
    scalar_updates = entry.launch(x, dy, weight, state, hypers, step, mixed_seed)  # None: not launched

The key holds what the checks (`checks.check_state`: a state's dtype and shape against the spec's state, and
whether a float state has block scales beside it), `fused_config` and Triton's specialization read: the
variant (`combo`: the keywords' flags), each tensor's shape, strides, dtype, device and start address modulo 16 (Triton
specializes pointers on 16-byte alignment; `seed` and `T` are not specialized, `N`, `K` and `n_blocks`
are fixed by the shapes), rounding, tf32 and the config. The host scalars are computed per call; Triton
never specializes a float, and ints (RAdam's rectification flag) select one of an entry's compiled
kernels by their `exports_signature`. An entry holds no tensor, so it keeps no weight, state or activation
alive.

Only for Triton versions in `VERIFIED_TRITON`, where the GPU tests check that this path writes the same
bits as `JITFunction.run` (tests/kernels/test_kernels.py, `test_reused_launch_writes_the_checked_bits`); never
while a launch hook (a profiler), Triton's debug mode or its instrumentation is on, or a pre-run hook is
set on the kernel: then every call takes the checked path.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

import torch

from .layouts import holds_codes

__all__ = ["COUNTS", "VERIFIED_TRITON", "DirectLaunch", "NotReusable", "PreparedLaunch", "call_key", "counts",
           "current_stream", "enabled", "entries", "exports_signature", "lookup", "remember", "set_enabled",
           "supported"]

VERIFIED_TRITON = ("3.6.",)  # the Triton versions whose launcher this path was checked against on the GPU
_MAX_ENTRIES = 4096  # a model's layers × a few token counts; the cache empties when full

_ENTRIES: dict[tuple, "PreparedLaunch"] = {}
# how each fused layer update was launched since the process started, by `steps._linear`: "reused", "checked"
# (then remembered), or why not reusable ("reuse off", "not a Hopper GPU with Gluon", "below the warp-specialized
# size", "keywords refused", "no key"); and "slab" where the slab path ran. Read by `counts()`.
COUNTS: "collections.Counter[str]" = collections.Counter()
_SUPPORTED: Optional[bool] = None  # decided on first use (see `supported`), or by `set_enabled`


def supported() -> bool:
    """Whether this Triton's launches can be reused: a version in `VERIFIED_TRITON` (or `set_enabled`'s say)."""
    global _SUPPORTED
    if _SUPPORTED is None:
        import triton

        _SUPPORTED = triton.__version__.startswith(VERIFIED_TRITON)
    return _SUPPORTED


def enabled() -> bool:
    """Whether launches are reused now: `supported`, with no launch hook (a profiler), no debug mode and no
    instrumentation in Triton's knobs (`JITFunction.run` would honour each)."""
    if not supported():
        return False
    from triton import knobs

    runtime = knobs.runtime
    return (_no_hook(runtime.launch_enter_hook) and _no_hook(runtime.launch_exit_hook) and not runtime.debug
            and not knobs.compilation.instrumentation_mode)


def _no_hook(hook) -> bool:
    # Triton 3.6 keeps each hook as a chain of callables, empty unless a profiler added one; a launch through
    # `JITFunction.run` calls the chains, these launches pass none
    return hook is None or not getattr(hook, "calls", True)


def set_enabled(on: Optional[bool]) -> None:
    """Turn reused launches on or off for this process (benchmarks compare both; tests check both write the
    same bits); None: back to the default, on where the Triton version is verified. Forgets every entry."""
    global _SUPPORTED
    _SUPPORTED = None if on is None else bool(on)
    _ENTRIES.clear()


def counts() -> dict[str, int]:
    """How the fused layer updates of this process were launched (`COUNTS`), a copy."""
    return dict(COUNTS)


def entries() -> int:
    """How many launches are prepared."""
    return len(_ENTRIES)


def _meta(t: torch.Tensor) -> tuple:
    """What the checks, the tile config and Triton's specialization read of a tensor argument."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def call_key(spec, combo: tuple, names: tuple[str, ...], scalar_names: tuple[str, ...], x, dy, weight, state,
             rounding, tf32, config) -> Optional[tuple]:
    """The metadata of one `fused_linear_step` call of `spec`'s variant `combo` (which reads the states `names`
    and the scalar states `scalar_names`), or None where the call cannot be reused: arguments that are not
    tensors, a state without an entry the variant reads. The checked path then runs, and raises what it
    must (`lookup` also sends unhashable arguments there)."""
    try:
        states = []
        for name in names:
            t = state[name]
            states.append(_meta(t))
            if holds_codes(t):
                states.append(_meta(state[f"{name}.scale"]))
            elif f"{name}.scale" in state:  # codes cast to float beside their scales: the checked path refuses them
                states.append(None)
        for name in scalar_names:
            states.append(_meta(state[name]))
        return (id(spec), combo, rounding, bool(tf32), config, _meta(x), _meta(dy), _meta(weight), tuple(states))
    except (KeyError, AttributeError, TypeError):
        return None


def lookup(key: Optional[tuple], spec) -> Optional["PreparedLaunch"]:
    """The launch prepared for `key`, if any (`call_key` is for callers that checked `enabled()`)."""
    if key is None or not _ENTRIES:
        return None
    try:
        hit = _ENTRIES.get(key)
    except TypeError:  # an unhashable argument (e.g. a list for `rounding`): the checked path says what is wrong
        return None
    return hit if hit is not None and hit.spec is spec else None


def remember(key: tuple, prepared: "PreparedLaunch") -> None:
    """Keep `prepared` for later calls with `key`; where one is kept already, add `prepared`'s compiled
    kernel to it (the same metadata, host scalars Triton specializes otherwise)."""
    kept = _ENTRIES.get(key)
    if kept is not None and kept.spec is prepared.spec:
        kept.kernels.update(prepared.kernels)
        return
    if len(_ENTRIES) >= _MAX_ENTRIES:
        _ENTRIES.clear()
    _ENTRIES[key] = prepared


def exports_signature(exports) -> Optional[tuple]:
    """What Triton's specialization reads of the host scalars: nothing of a float; of an int (RAdam's
    rectification flag), whether it is 1, whether a multiple of 16, and its type (i32, i64 or u64), as
    Triton 3.6 types and specializes ints. None for other types (not reused)."""
    out = []
    for value in exports:
        if type(value) is float:
            out.append(None)
        elif type(value) is int:
            if -2**31 <= value < 2**31:
                width = "i32"
            elif -2**63 <= value < 2**63:
                width = "i64"
            elif 0 <= value < 2**64:
                width = "u64"
            else:
                return None
            out.append((width, value == 1, value % 16 == 0))
        else:
            return None
    return tuple(out)


class NotReusable(Exception):
    """A checked launch that `PreparedLaunch` cannot repeat (its calls then stay checked)."""


class PreparedLaunch:
    """One checked warp-specialized launch, to be repeated with new activations, keywords, step and seed.

    Built from the arguments `kernel_calls.launch_warp_specialized` passed `gluon_lib.fused_ws[(programs,)](*args,
    **kwargs)` and the compiled kernel that call returned; each argument is found by its parameter's name.
    `launch` takes tensors of that call's metadata: x [..., K], dy [..., N] (bf16), weight [N, K] and the
    state entries the variant reads (`names`, with each int8 / uint8 state's `<name>.scale`). `kernels` maps
    the host scalars' `exports_signature` to the compiled kernel launched for it.
    """

    def __init__(self, spec, host: Callable, names: tuple[str, ...], state, scalar_names: tuple[str, ...],
                 fused_ws, compiled, args: tuple, kwargs: dict, programs: int,
                 block_shapes: tuple[list[int], list[int]]) -> None:
        from . import gluon_lib  # triton is imported on first launch, not with the package

        self._gluon_lib = gluon_lib
        self.spec = spec
        self.host = host
        self.state_keys = names
        # the SCALES argument: each state's block scales, or its storage (never read) where it has none
        self.scale_keys = tuple(f"{name}.scale" if holds_codes(state[name]) else name for name in names)
        self.scalar_names = scalar_names
        self.fused_ws = fused_ws
        self.auto_path: Optional[str] = None  # what `linear_step(path="auto")` picks for this metadata
        params = fused_ws.arg_names
        if len(args) + len(kwargs) != len(params) or any(name not in kwargs for name in params[len(args):]):
            raise NotReusable(f"{fused_ws}'s parameters {params} do not match the launch's arguments")
        # The launcher's arguments: every kernel parameter in order, constexprs included (as JITFunction.run).
        template = list(args) + [kwargs[name] for name in params[len(args):]]
        slot = {name: i for i, name in enumerate(params)}
        self._x, self._dy, self._w = slot["X"], slot["DY"], slot["W"]
        self._states, self._scales, self._host, self._seed = slot["STATES"], slot["SCALES"], slot["HOST"], slot["seed"]
        self._timeline = slot["TL"]  # never read without a recorded timeline: the weight's pointer
        self._N, self._K = template[slot["N"]], template[slot["K"]]
        if template[slot["TIMELINE"]]:
            raise NotReusable("a launch that records a timeline (`python -m forge_dsl.bench.ws_timeline`)")
        descriptors = {self._x: template[self._x], self._dy: template[self._dy]}  # the checked launch's
        for i in (self._x, self._dy, self._w, self._states, self._scales, self._timeline):  # replaced on every call
            template[i] = None
        self._template = template
        self._grid = programs
        self._x_block, self._dy_block = block_shapes
        self._host_count = len(template[self._host])
        signature = exports_signature(template[self._host])
        if signature is None:
            raise NotReusable("host scalars of a type whose Triton specialization is not known here")
        result = getattr(compiled, "result", None)  # a compile still in flight
        compiled = result() if callable(result) else compiled
        self.kernels = {signature: (compiled.run, compiled.function, compiled.packed_metadata)}
        self._signature_of: tuple = (None, None)  # (the last host scalars, their `exports_signature`)
        self._direct = DirectLaunch.of(compiled.run, descriptors)

    def launch(self, x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state, hypers: dict, step: int,
               seed: int) -> Optional[dict]:
        """One step of this layer: host scalars from `hypers` (the resolved keywords of this call) and the
        scalar state, the descriptors, the launch on the current stream (`seed`: `kernel_calls.mix_seed` of the
        call's seed and step). Returns the scalar state's new values for the caller to commit, or None
        (nothing launched) where this step's host scalars need a kernel not compiled for this entry yet,
        or where a pre-run hook was set on the kernel since."""
        exports, scalar_updates = self.host(hypers, step,
                                            {name: float(state[name]) for name in self.scalar_names} if
                                            self.scalar_names else {})
        last, signature = self._signature_of
        if exports is not last:  # layers sharing keywords and step share the host step's result itself
            signature = exports_signature(exports)
            self._signature_of = (exports, signature)
        kernel = self.kernels.get(signature)
        if kernel is None or self.fused_ws.pre_run_hooks:
            return None
        launcher, function, packed_metadata = kernel
        if len(exports) != self._host_count:
            raise RuntimeError(f"{self.spec.name}'s host step returned {len(exports)} scalars, its kernel takes "
                               f"{self._host_count}")
        args = self._template.copy()
        # the launcher reads data_ptr() alone: no int16 views needed
        args[self._w] = weight
        args[self._timeline] = weight
        args[self._states] = tuple(state[key] for key in self.state_keys)
        args[self._scales] = tuple(state[key] for key in self.scale_keys)
        args[self._host] = exports
        args[self._seed] = seed
        stream = current_stream(weight.device)
        # [T, K] and [T, N] as the checked launch read them: a view, or a contiguous copy of rows no view can
        # reach (`checks.check_linear`), alive until the launch has been issued on the stream
        x2 = x if x.dim() == 2 else x.reshape(-1, self._K)
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, self._N)
        if self._direct is not None and launcher is self._direct.run:
            self._direct.launch(self._grid, stream, function, packed_metadata, args, {self._x: x2, self._dy: dy2})
            return scalar_updates
        descriptor = self._gluon_lib.descriptor
        args[self._x] = descriptor(x2, self._x_block)
        args[self._dy] = descriptor(dy2, self._dy_block)
        launcher(self._grid, 1, 1, stream, function, packed_metadata, None, None, None, *args)
        return scalar_updates


class DirectLaunch:
    """Triton 3.6's launcher of one compiled warp-specialized kernel, called below its Python wrapper: each TMA
    descriptor argument expanded as the wrapper expands it (`make_tensordesc_arg`: the CUtensorMap, then the
    shape and strides), the CUtensorMap remembered per activation address.

    A descriptor's shape, strides, block and swizzle are fixed by an entry's key (the activations' shapes and
    strides), so its CUtensorMap is a function of the address alone: a remembered one is the one the wrapper
    would make now, whatever tensor holds that address (no tensor is kept). This takes the Gluon
    `TensorDescriptor` objects, their checks (the checked launch ran them on the same metadata) and the wrapper's
    walk over every argument off each launch: v30 in docs/PERF.md.
    """

    _MAPS_MAX = 16  # addresses remembered per descriptor argument (a training loop's activations take a few)
    _BASE_ARGS = 13  # the C launcher's arguments before the kernel's, as `launch` passes them (Triton 3.6's)

    def __init__(self, run, c_launch, make_arg, slots: dict) -> None:
        self.run = run  # the CudaLauncher this stands for (`PreparedLaunch` launches through this for it only)
        self._c_launch = c_launch
        self._make_arg = make_arg
        # kernel parameter index -> (its tensordesc metadata, shape, strides, padding, {address: expanded args})
        self._slots = slots
        self._order = sorted(slots)

    @classmethod
    def of(cls, run, descriptors: dict) -> Optional["DirectLaunch"]:
        """The direct launch of `run` (a compiled kernel's launcher), whose kernel parameters `descriptors` (index
        -> the checked launch's Gluon TensorDescriptor) are its only TMA descriptors; None where `run` is not
        Triton 3.6's `CudaLauncher` of that shape, needs scratch memory, or a descriptor is not 2-D."""
        import triton

        if not triton.__version__.startswith(VERIFIED_TRITON):  # the wrapper's internals as this reads them
            return None
        try:
            from triton.backends.nvidia import driver
        except ImportError:
            return None
        wrapper = getattr(run, "launch", None)
        if (type(run) is not getattr(driver, "CudaLauncher", None) or getattr(wrapper, "__name__", None) != "inner"
                or wrapper.__closure__ is None):
            return None
        cells = dict(zip(wrapper.__code__.co_freevars, (c.cell_contents for c in wrapper.__closure__)))
        indices, metas = cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
        if (set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"} or indices != set(descriptors)
                or not metas or len(metas) != len(indices) or run.global_scratch_size or run.profile_scratch_size
                or getattr(driver, "_BASE_ARGS_FORMAT_LEN", None) != cls._BASE_ARGS):
            return None
        slots = {}
        for meta, index in zip(metas, sorted(indices)):
            desc = descriptors[index]
            if meta is None or meta.get("fp4_padded") or len(desc.shape) != 2:
                return None
            slots[index] = (meta, tuple(desc.shape), tuple(desc.strides), desc.padding, {})
        return cls(run, cells["launcher"], driver.make_tensordesc_arg, slots)

    def launch(self, grid: int, stream: int, function, packed_metadata, args: list, activations: dict) -> None:
        """`run(grid, 1, 1, stream, function, packed_metadata, None, None, None, *args)` with each descriptor
        parameter's activation (`activations`: parameter index -> the 2-D tensor [T, C] whose TensorDescriptor the
        launch would pass: the entry's shape and strides) in place of that descriptor."""
        run = self.run
        final = [grid, 1, 1, stream, function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                 packed_metadata, None, None, None]
        start = 0
        for index in self._order:
            final.extend(args[start:index])
            final.extend(self._expanded(index, activations[index].data_ptr()))
            start = index + 1
        final.extend(args[start:])
        self._c_launch(*final)

    def _expanded(self, index: int, address: int) -> list:
        """The descriptor parameter `index`'s arguments for an activation at `address`: [CUtensorMap, *shape,
        *strides], made by Triton's own `make_tensordesc_arg` the first time."""
        meta, shape, strides, padding, maps = self._slots[index]
        hit = maps.get(address)
        if hit is None:
            if len(maps) >= self._MAPS_MAX:
                maps.clear()
            hit = maps[address] = self._make_arg(_AddressedDescriptor(_Address(address), shape, strides, padding),
                                                 meta)
        return hit


class _Address:
    """What `make_tensordesc_arg` reads of a descriptor's base tensor: its address."""

    __slots__ = ("address",)

    def __init__(self, address: int) -> None:
        self.address = address

    def data_ptr(self) -> int:
        return self.address


class _AddressedDescriptor:
    """What `make_tensordesc_arg` reads of a Gluon TensorDescriptor: base, shape, strides, padding."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base: _Address, shape: tuple, strides: tuple, padding: str) -> None:
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding


def current_stream(device: torch.device) -> int:
    """The raw CUDA stream Triton launches on for `device` (what `JITFunction.run` asks its driver)."""
    from triton.runtime import driver

    return driver.active.get_current_stream(device.index)
