"""Warp-specialized launches that reuse what the last call with the same argument metadata decided.

A training loop calls `fused_linear_step` for every layer on every step with arguments whose metadata
repeats: shapes, strides, dtypes, devices, 16-byte alignment, the state's tensors, the keywords. What
the host does with them (the checks, the variant, the tile config, and Triton's `JITFunction.run`: the
arguments' specialization, its cache key, the launch) took ~140 µs a call on the H200's host, longer
than the kernel on a 1024×4096 layer at 512 tokens (docs/PERF.md, v14). Here a call whose metadata
matches an earlier, fully checked call skips all of it: it computes the step's host scalars, makes the
two activation descriptors, and calls the compiled kernel's launcher with the earlier call's arguments
in the kernel's parameter order (what `JITFunction.run` passes it), the new tensors and scalars in place.

    key = call_key(spec, x, dy, weight, state, rounding, tf32, config, hypers)   # None: not reusable
    prepared = lookup(key, spec)                                                 # None: not prepared yet
    prepared.launch(x, dy, weight, state, step, seed)

The key holds everything the checks, `fused_config` and Triton's specialization read: each tensor's
shape, strides, dtype, device and start address modulo 16 (Triton specializes pointers on 16-byte
alignment; `seed` and `T` are not specialized, `N`, `K` and `n_blocks` are fixed by the shapes, the
host scalars are floats, which it never specializes), and the keywords as `_hypers_key` spells them.
An entry holds no tensor, so it keeps no weight, state or activation alive.

Only for Triton versions in `VERIFIED_TRITON`, where the GPU tests check that this path writes the
same bits as `JITFunction.run` (tests/test_gpu.py); elsewhere, or with Triton's launch hooks set (a
profiler), every call takes the checked path.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["VERIFIED_TRITON", "PreparedLaunch", "call_key", "clear", "enabled", "lookup", "lookup_state_keys",
           "remember", "set_enabled"]

VERIFIED_TRITON = ("3.6.",)  # the Triton versions whose launcher this path was checked against on the GPU
_MAX_ENTRIES = 4096  # a model's layers × a few token counts; the cache empties when full

_ENTRIES: dict[tuple, "PreparedLaunch"] = {}
_ENABLED: Optional[bool] = None  # decided on first use: see `enabled`


def enabled() -> bool:
    """Whether reused launches are on: a Triton version in `VERIFIED_TRITON` with no launch hooks (profilers)."""
    global _ENABLED
    if _ENABLED is None:
        import triton

        _ENABLED = triton.__version__.startswith(VERIFIED_TRITON)
    if not _ENABLED:
        return False
    from triton import knobs

    # Triton 3.6 keeps each hook as a chain of callables, empty unless a profiler added one; a launch through
    # `JITFunction.run` calls the chains, these launches pass none
    return all(hook is None or not getattr(hook, "calls", True)
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


def set_enabled(on: Optional[bool]) -> None:
    """Turn reused launches on or off for this process (benchmarks compare both; tests check both write the
    same bits); None: back to the default, on where `enabled` allows it."""
    global _ENABLED
    _ENABLED = None if on is None else bool(on)
    _ENTRIES.clear()


def clear() -> None:
    """Forget every prepared launch."""
    _ENTRIES.clear()


def _meta(t: torch.Tensor) -> tuple:
    """What the checks, the tile config and Triton's specialization read of a tensor argument."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def call_key(spec, x, dy, weight, state, key_names: tuple[str, ...], rounding: str, tf32: bool, config,
             hypers_key: Optional[tuple]) -> Optional[tuple]:
    """The metadata of one `fused_linear_step` call, or None where a call cannot be reused: keywords that are
    not plain numbers (`hypers_key` None), a state without one of `key_names` (the entries a prepared launch
    of the spec's variant reads, from `lookup_state_keys`), or arguments that are not tensors."""
    if hypers_key is None or not isinstance(x, torch.Tensor) or not isinstance(dy, torch.Tensor):
        return None
    try:
        states = tuple(_meta(state[name]) for name in key_names)
    except (KeyError, AttributeError, TypeError):
        return None
    return (id(spec), hypers_key, rounding, bool(tf32), config, _meta(x), _meta(dy), _meta(weight), states)


_STATE_KEYS: dict[tuple, tuple] = {}  # (id(spec), hypers_key) -> (spec, state keys the variant reads)


def lookup_state_keys(spec, hypers_key: Optional[tuple]) -> Optional[tuple[str, ...]]:
    """The state entries a prepared launch of (spec, keywords) reads, once one was remembered."""
    hit = _STATE_KEYS.get((id(spec), hypers_key))
    return hit[1] if hit is not None and hit[0] is spec else None


def lookup(key: Optional[tuple], spec) -> Optional["PreparedLaunch"]:
    """The launch prepared for `key`, if any (and if reused launches are on)."""
    if key is None or not _ENTRIES:
        return None
    hit = _ENTRIES.get(key)
    if hit is None or hit.spec is not spec or not enabled():
        return None
    return hit


def remember(key: Optional[tuple], hypers_key: tuple, prepared: "PreparedLaunch") -> None:
    """Keep `prepared` for later calls with `key` (a no-op where reused launches are off); where one is kept
    already, add `prepared`'s compiled kernel to it (the same metadata, host scalars of another kind)."""
    if key is None or not enabled():
        return
    kept = _ENTRIES.get(key)
    if kept is not None and kept.spec is prepared.spec:
        kept.kernels.update(prepared.kernels)
        return
    if len(_ENTRIES) >= _MAX_ENTRIES:
        _ENTRIES.clear()
    _STATE_KEYS[(id(prepared.spec), hypers_key)] = (prepared.spec, prepared.key_names)
    _ENTRIES[key] = prepared


def exports_signature(exports) -> Optional[tuple]:
    """What Triton's specialization can read of the host scalars: nothing of a float; of an int (RAdam's
    rectification flag), whether it is 1, a multiple of 16, and its width. None for other types."""
    out = []
    for value in exports:
        if type(value) is float:
            out.append(None)
        elif type(value) is int:
            out.append((value == 1, value % 16 == 0, -2**31 <= value < 2**31, 0 <= value < 2**64))
        else:
            return None
    return tuple(out)


class PreparedLaunch:
    """One checked warp-specialized launch, to be repeated with new activations, step and seed.

    Built from the arguments `launch._launch_warp_specialized` passed `fused_ws[(programs,)](*args, **kwargs)`
    and the compiled kernel that call returned. `launch` takes tensors of the same metadata as that call's:
    x [..., K], dy [..., N] (bf16), weight [N, K] and the state entries `state_keys`; `kernels` maps the
    host scalars' `exports_signature` to the compiled kernel launched for it.
    """

    def __init__(self, spec, host: Callable, hypers: dict, scalar_names: tuple[str, ...],
                 state_keys: tuple[str, ...], state_slots: tuple[int, ...], compiled, fused_ws, args: tuple,
                 kwargs: dict, programs: int, block_shapes: tuple[list[int], list[int]], first_export: int,
                 n_exports: int) -> None:
        self.spec = spec
        self.host = host
        self.hypers = hypers
        self.scalar_names = scalar_names
        self.state_keys = state_keys
        # what `call_key` reads of the state: each launched tensor once, and the scalar states
        self.key_names = tuple(dict.fromkeys(state_keys + scalar_names))
        self.auto_path: Optional[str] = None  # what `linear_step(path="auto")` picks for this metadata
        names = fused_ws.arg_names
        if len(args) + len(kwargs) != len(names) or any(name not in kwargs for name in names[len(args):]):
            raise TypeError(f"{fused_ws.fn.__name__}'s parameters {names} do not match the launch's arguments")
        # The launcher's arguments: every kernel parameter in order, constexprs included (as JITFunction.run).
        bound = list(args) + [kwargs[name] for name in names[len(args):]]
        for i in (0, 1, 2, *state_slots):  # tensors: replaced on every call; keep none alive here
            bound[i] = None
        self._template = bound
        self._state_slots = state_slots
        self._first_export = first_export
        self._seed_slot = first_export + n_exports
        self._N, self._K = args[self._seed_slot + 2], args[self._seed_slot + 3]  # after the seed: T, N, K
        self._grid = programs
        self._x_block, self._dy_block = block_shapes
        signature = exports_signature(args[first_export:self._seed_slot])
        if signature is None:
            raise TypeError("host scalars of a type Triton's specialization is not known for")
        run = getattr(compiled, "result", None)  # a compile still in flight
        compiled = run() if callable(run) else compiled
        self.kernels = {signature: (compiled.run, compiled.function, compiled.packed_metadata)}

    def launch(self, x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state, step: int,
               seed: int) -> Optional[dict]:
        """One step of this layer (`seed`: `launch.mix_seed` of the call's seed and step): host scalars,
        descriptors, the launch. Returns the scalar state's new values for the caller to commit, or None
        (nothing launched) where this step's host scalars need a kernel not compiled for this entry yet."""
        from . import gluon_lib

        scalars = {name: float(state[name]) for name in self.scalar_names}
        exports, scalar_updates = self.host(self.hypers, step, scalars)
        kernel = self.kernels.get(exports_signature(exports))
        if kernel is None:
            return None
        launcher, function, packed_metadata = kernel
        args = self._template.copy()
        args[0] = gluon_lib.descriptor(x.reshape(-1, self._K), self._x_block)
        args[1] = gluon_lib.descriptor(dy.reshape(-1, self._N), self._dy_block)
        args[2] = weight  # the launcher reads data_ptr() alone: no int16 views needed
        for slot, key in zip(self._state_slots, self.state_keys):
            args[slot] = state[key]
        args[self._first_export:self._seed_slot] = exports
        args[self._seed_slot] = seed
        launcher(self._grid, 1, 1, current_stream(weight.device), function, packed_metadata, None, None, None, *args)
        return scalar_updates


def current_stream(device: torch.device) -> int:
    """The raw CUDA stream Triton launches on for `device` (what `JITFunction.run` asks its driver)."""
    from triton.runtime import driver

    return driver.active.get_current_stream(device.index)


def entries() -> int:
    """How many launches are prepared (for tests)."""
    return len(_ENTRIES)
