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

The key holds what the checks, `fused_config` and Triton's specialization read: the variant (`combo`:
the keywords' flags), each tensor's shape, strides, dtype, device and start address modulo 16 (Triton
specializes pointers on 16-byte alignment; `seed` and `T` are not specialized, `N`, `K` and `n_blocks`
are fixed by the shapes), rounding, tf32 and the config. The host scalars are computed per call; Triton
never specializes a float, and ints (RAdam's rectification flag) select one of an entry's compiled
kernels by their `exports_signature`. An entry holds no tensor, so it keeps no weight, state or activation
alive.

Only for Triton versions in `VERIFIED_TRITON`, where the GPU tests check that this path writes the same
bits as `JITFunction.run` (tests/test_kernels.py, `test_reused_launch_writes_the_checked_bits`); never
while a launch hook (a profiler), Triton's debug mode or its instrumentation is on, or a pre-run hook is
set on the kernel: then every call takes the checked path.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["VERIFIED_TRITON", "NotReusable", "PreparedLaunch", "call_key", "current_stream", "enabled",
           "entries", "exports_signature", "lookup", "remember", "set_enabled", "state_entries", "supported"]

VERIFIED_TRITON = ("3.6.",)  # the Triton versions whose launcher this path was checked against on the GPU
_MAX_ENTRIES = 4096  # a model's layers × a few token counts; the cache empties when full
_QUANTIZED_DTYPES = (torch.int8, torch.uint8)  # states stored as codes, with a `<name>.scale` tensor beside

_ENTRIES: dict[tuple, "PreparedLaunch"] = {}
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


def entries() -> int:
    """How many launches are prepared."""
    return len(_ENTRIES)


def _meta(t: torch.Tensor) -> tuple:
    """What the checks, the tile config and Triton's specialization read of a tensor argument."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def state_entries(names: tuple[str, ...], state) -> tuple[str, ...]:
    """The state entries a launch reads, in its argument order: each state's storage, then its scales
    (`<name>.scale` for int8 / uint8 codes, the storage itself otherwise, never read)."""
    return tuple(key for name in names
                 for key in (name, f"{name}.scale" if state[name].dtype in _QUANTIZED_DTYPES else name))


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
            if t.dtype in _QUANTIZED_DTYPES:
                states.append(_meta(state[f"{name}.scale"]))
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

    Built from the arguments `launch._launch_warp_specialized` passed `fused_ws[(programs,)](*args, **kwargs)`
    (X, DY, W, each state's storage and scales, the host scalars, seed, T, N, K, n_blocks, then the
    constexprs) and the compiled kernel that call returned. `launch` takes tensors of that call's metadata:
    x [..., K], dy [..., N] (bf16), weight [N, K] and the state entries `state_keys`. `kernels` maps the
    host scalars' `exports_signature` to the compiled kernel launched for it.
    """

    def __init__(self, spec, host: Callable, state_keys: tuple[str, ...], scalar_names: tuple[str, ...],
                 fused_ws, compiled, args: tuple, kwargs: dict, programs: int,
                 block_shapes: tuple[list[int], list[int]]) -> None:
        from . import gluon_lib  # triton is imported on first launch, not with the package

        self._gluon_lib = gluon_lib
        self.spec = spec
        self.host = host
        self.state_keys = state_keys
        self.scalar_names = scalar_names
        self.fused_ws = fused_ws
        self.auto_path: Optional[str] = None  # what `linear_step(path="auto")` picks for this metadata
        names = fused_ws.arg_names
        if len(args) + len(kwargs) != len(names) or any(name not in kwargs for name in names[len(args):]):
            raise NotReusable(f"{fused_ws}'s parameters {names} do not match the launch's arguments")
        self._first_export = 3 + len(state_keys)
        self._seed_slot = len(args) - 5  # ... seed, T, N, K, n_blocks
        self._N, self._K = args[-3], args[-2]
        # The launcher's arguments: every kernel parameter in order, constexprs included (as JITFunction.run).
        template = list(args) + [kwargs[name] for name in names[len(args):]]
        for i in range(self._first_export):  # tensors: replaced on every call; keep none alive here
            template[i] = None
        self._template = template
        self._grid = programs
        self._x_block, self._dy_block = block_shapes
        signature = exports_signature(args[self._first_export:self._seed_slot])
        if signature is None:
            raise NotReusable("host scalars of a type whose Triton specialization is not known here")
        result = getattr(compiled, "result", None)  # a compile still in flight
        compiled = result() if callable(result) else compiled
        self.kernels = {signature: (compiled.run, compiled.function, compiled.packed_metadata)}

    def launch(self, x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state, hypers: dict, step: int,
               seed: int) -> Optional[dict]:
        """One step of this layer: host scalars from `hypers` (the resolved keywords of this call) and the
        scalar state, the descriptors, the launch on the current stream (`seed`: `launch.mix_seed` of the
        call's seed and step). Returns the scalar state's new values for the caller to commit, or None
        (nothing launched) where this step's host scalars need a kernel not compiled for this entry yet,
        or where a pre-run hook was set on the kernel since."""
        exports, scalar_updates = self.host(hypers, step, {name: float(state[name]) for name in self.scalar_names})
        kernel = self.kernels.get(exports_signature(exports))
        if kernel is None or self.fused_ws.pre_run_hooks:
            return None
        launcher, function, packed_metadata = kernel
        args = self._template.copy()
        descriptor = self._gluon_lib.descriptor
        args[0] = descriptor(x if x.dim() == 2 else x.reshape(-1, self._K), self._x_block)
        args[1] = descriptor(dy if dy.dim() == 2 else dy.reshape(-1, self._N), self._dy_block)
        args[2] = weight  # the launcher reads data_ptr() alone: no int16 views needed
        for slot, key in enumerate(self.state_keys, start=3):
            args[slot] = state[key]
        if len(exports) != self._seed_slot - self._first_export:
            raise RuntimeError(f"{self.spec.name}'s host step returned {len(exports)} scalars, its kernel takes "
                               f"{self._seed_slot - self._first_export}")
        args[self._first_export:self._seed_slot] = exports
        args[self._seed_slot] = seed
        launcher(self._grid, 1, 1, current_stream(weight.device), function, packed_metadata, None, None, None, *args)
        return scalar_updates


def current_stream(device: torch.device) -> int:
    """The raw CUDA stream Triton launches on for `device` (what `JITFunction.run` asks its driver)."""
    from triton.runtime import driver

    return driver.active.get_current_stream(device.index)
