"""Reused warp-specialized launches (forge_dsl/kernels/reuse.py) on the CPU.

Gluon has no interpreter, so here Triton's `JITFunction.run` and the compiled kernel's launcher are
replaced by recorders: every test compares the arguments a reused launch hands the launcher with the
ones `JITFunction.run` binds for the same call on the checked path (every parameter in order,
constexprs included), for every spec and state layout. On the GPU the same path runs for real in
test_kernels.py's warp-specialized tests (steps 2 and 3 of each reuse step 1's launch) and in
test_reused_launch_writes_the_checked_bits.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import forge_dsl
from spec_lists import ELEMENT_WISE
from forge_dsl import kernels
from forge_dsl.kernels import gluon_lib, policy, reuse, steps

# The recorders stand in for Triton on CPU tensors, so these tests run where the interpreter does (CI);
# on a GPU machine test_kernels.py's warp-specialized and reused-launch tests run the same path for real.
pytestmark = pytest.mark.skipif(not policy.interpreting(), reason="recorder tests of the interpreter's tier: on a "
                                "GPU, tests/kernels/test_kernels.py runs reused launches for real")

N, K, T = 72, 136, 40
WS_CONFIG = kernels.TileConfig(32, 128, 128, num_warps=4, num_stages=2, tma=True, epilogue_split=4, mma_warps=4)
HYPERS = {"sgd_momentum": {"momentum": 0.9}, "lion": {"lr": 1e-3}}
LAYOUTS = ("fp32", "bf16", "int8")


def _value(v):
    """A launch argument as the launcher sees it: a tensor by its address, a descriptor by what it encodes."""
    if isinstance(v, torch.Tensor):
        return ("tensor", v.data_ptr())
    if isinstance(v, tuple) and v[:1] != ("descriptor",):  # STATES, SCALES, HOST
        return tuple(_value(item) for item in v)
    return v


class _Recorder:
    """Stands in for Triton: `run` records what JITFunction.run would bind, the launcher what it is given."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []

    def jit_run(self, fn, args, kwargs):
        grid = kwargs.pop("grid")
        # what Triton's binder does: the Python signature's binding, every parameter in order
        bound = inspect.signature(fn.fn).bind(*args, **kwargs).arguments.values()
        self.calls.append(("run", (grid[0],) + tuple(_value(v) for v in bound)))
        recorder = self

        class Compiled:
            function, packed_metadata = "function", "packed metadata"

            @staticmethod
            def run(g0, g1, g2, stream, function, packed_metadata, launch_metadata, enter, exit_, *launch_args):
                assert (g1, g2, function, packed_metadata, enter, exit_) == (1, 1, "function", "packed metadata",
                                                                              None, None)
                recorder.calls.append(("launcher", (g0,) + tuple(_value(v) for v in launch_args)))

        return Compiled()


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(reuse, "_SUPPORTED", True)
    monkeypatch.setattr(reuse, "_ENTRIES", {})
    monkeypatch.setattr(reuse, "current_stream", lambda device: 0)
    monkeypatch.setattr(steps, "check_warp_specialized", lambda *args: None)
    monkeypatch.setattr(steps, "hopper_with_gluon", lambda device: True)
    monkeypatch.setattr(policy, "hopper_with_gluon", lambda device: True)
    monkeypatch.setattr(gluon_lib, "sm_count", lambda device: 132)
    monkeypatch.setattr(gluon_lib, "descriptor",
                        lambda t, block: ("descriptor", t.data_ptr(), tuple(t.shape), t.stride(), tuple(block)))
    fused_ws = _fused_ws()
    monkeypatch.setattr(type(fused_ws), "run", lambda self, *args, grid, warmup, **kwargs: rec.jit_run(
        self, args, {**{k: v for k, v in kwargs.items() if k not in ("num_warps", "maxnreg")}, "grid": grid}))
    return rec


def _fused_ws():
    if gluon_lib.fused_ws is None:
        pytest.skip("this Triton has no Gluon")
    return gluon_lib.fused_ws


def _problem(w_dtype, layout, name, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen).to(w_dtype)
    state = forge_dsl.init_state(name, w, layout=layout, **_hypers(name))
    return w, state


def _activations(step, tokens=T):
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(tokens, K, generator=gen).to(torch.bfloat16),
            torch.randn(tokens, N, generator=gen).to(torch.bfloat16))


def _hypers(name):
    return {"lr": 1e-2, **HYPERS.get(name, {})}


def _scalars(state):
    return {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 0}


def _same(a, b) -> bool:
    """Equal launch arguments, a NaN host value equal to a NaN (RAdam's unrectified steps export one): host values
    are new fp32-rounded floats on each path, so tuple equality, which matches NaN only by identity, does not do."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b

@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=["w_bf16", "w_fp32"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ELEMENT_WISE)
@pytest.mark.parametrize("entry", ["fused_linear_step", "linear_step"])
def test_reused_launch_passes_what_the_checked_path_binds(recorder, monkeypatch, name, layout, w_dtype, entry):
    """Steps 2–8 (fresh activations, another seed, the step's host scalars) reuse step 1's launch: the
    launcher gets exactly the arguments the checked path binds for that call, and the scalar state (NAdam's
    mu_product) ends where the checked path leaves it. Where the host scalars change kind (an int flag that
    Triton specializes on 1: SGD-momentum's first step, RAdam's rectification from step 6), the checked path
    runs once and its kernel is kept beside the first."""
    spec = forge_dsl.load_spec(name)
    call = getattr(kernels, entry)
    w, state = _problem(w_dtype, layout, name)
    seen = set()
    for step in range(1, 9):
        x, dy = _activations(step)
        exports = steps.ParamUpdate(spec, w, state, step=step, **_hypers(name)).exports
        new_kind = reuse.exports_signature(exports) not in seen
        seen.add(reuse.exports_signature(exports))
        before = _scalars(state)
        call(spec, x, dy, w, state, step=step, seed=step * 7, config=WS_CONFIG, **_hypers(name))
        reused = recorder.calls.pop()
        after = _scalars(state)
        state.update(before)
        monkeypatch.setattr(reuse, "_SUPPORTED", False)
        call(spec, x, dy, w, state, step=step, seed=step * 7, config=WS_CONFIG, **_hypers(name))
        monkeypatch.setattr(reuse, "_SUPPORTED", True)
        checked = recorder.calls.pop()
        assert checked[0] == "run"
        assert reused[0] == ("run" if new_kind else "launcher"), f"step {step}"
        assert _same(reused[1], checked[1]), f"step {step}: the reused launch's arguments differ from the checked path's"
        assert all(torch.equal(after[k], state[k]) for k in after), f"step {step}: scalar state differs"
    assert reuse.entries() == 1
    if name in ("radam", "sgd_momentum"):
        assert len(seen) == 2


def test_changed_metadata_takes_the_checked_path(recorder):
    """Anything the checks, the config or Triton's specialization read makes a new key: token count, the start
    address modulo 16, a state replaced by another layout, keywords (values and types), rounding, the config;
    the checked path then runs (and raises where it must)."""
    spec = forge_dsl.load_spec("adamw")
    w, state = _problem(torch.bfloat16, "bf16", "adamw")
    x, dy = _activations(1)

    def kinds(**changes):
        args = dict(x=x, dy=dy, state=state, step=2, lr=1e-2, rounding="stochastic", config=WS_CONFIG)
        args.update(changes)
        kernels.fused_linear_step(spec, args.pop("x"), args.pop("dy"), w, args.pop("state"), **args)
        return recorder.calls.pop()[0] if recorder.calls else None  # None: not the warp-specialized kernel

    assert kinds(step=1) == "run"
    assert kinds() == "launcher"
    assert kinds(x=_activations(2)[0], dy=_activations(2)[1]) == "launcher"
    x48, dy48 = _activations(3, tokens=48)
    assert kinds(x=x48, dy=dy48) == "run"
    flat = torch.empty(T * K + 1, dtype=torch.bfloat16)
    shifted = flat[1:].view(T, K).copy_(x)  # 2 bytes past a 16-byte boundary
    assert kinds(x=shifted) == "run"
    assert kinds(lr=2e-2) == "launcher"  # a schedule's next value: the same variant, reused
    assert kinds(maximize=True) == "run"  # another variant
    assert kinds(rounding="nearest") == "run"
    assert kinds(config=None) is None  # the CPU's default config: the Triton kernel, in the interpreter
    fp32_state = forge_dsl.init_state(spec, w, layout="fp32")
    assert kinds(state=fp32_state) == "run"
    int8_state = forge_dsl.init_state(spec, w, layout="int8")  # bf16 block scales
    assert kinds(state=int8_state) == "run"
    assert kinds(state=int8_state) == "launcher"
    fp32_scales = {k: (v.float() if k.endswith(".scale") else v) for k, v in int8_state.items()}  # an old checkpoint's
    assert kinds(state=fp32_scales) == "run"  # the scales' dtype is part of the key: a kernel of its own
    assert kinds(state=fp32_scales) == "launcher"
    with pytest.raises(ValueError, match="step must be a positive integer"):
        kinds(step=0)
    with pytest.raises(ValueError, match="rounding must be one of"):
        kinds(rounding="up")
    with pytest.raises(ValueError, match="rounding must be one of"):
        kinds(rounding=["nearest"])  # unhashable: no key, the checked path's error
    with pytest.raises(ValueError, match="lr"):
        kinds(lr=-1.0)  # refused on every call, reused or not
    del state["exp_avg"]
    with pytest.raises(ValueError, match="state has no 'exp_avg'"):
        kinds()


def test_prepared_launches_keep_no_tensor_alive(recorder):
    """An entry holds no weight, state or activation (nor a view or descriptor of one): a deleted model's
    memory is freed even while its launches stay prepared."""
    spec = forge_dsl.load_spec("adamw")
    for layout in LAYOUTS:
        w, state = _problem(torch.bfloat16, layout, "adamw")
        x, dy = _activations(1)
        for step in (1, 2):
            kernels.fused_linear_step(spec, x, dy, w, state, step=step, config=WS_CONFIG, lr=1e-2)
        assert recorder.calls[-1][0] == "launcher"
    held, seen = [], set()

    def walk(obj, depth=0):
        if id(obj) in seen or depth > 6:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor) or (isinstance(obj, tuple) and obj[:1] == ("descriptor",)):
            held.append(obj)
        elif isinstance(obj, (list, tuple, set)):
            for item in obj:
                walk(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item, depth + 1)
        elif isinstance(obj, reuse.PreparedLaunch):
            walk(vars(obj), depth + 1)

    walk(reuse._ENTRIES)
    assert reuse.entries() == len(LAYOUTS) and not held


def test_reuse_is_off_for_unverified_triton_and_with_launch_hooks(monkeypatch):
    """`enabled`: only Triton versions the GPU tests checked, and never while a profiler's launch hook is set."""
    import triton
    from triton import knobs

    monkeypatch.setattr(reuse, "_SUPPORTED", None)
    assert reuse.enabled() == triton.__version__.startswith(reuse.VERIFIED_TRITON)
    monkeypatch.setattr(reuse, "_SUPPORTED", True)
    assert reuse.enabled()
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # a chain of hooks (Triton ≥ 3.5)
        hook.add(print)
        try:
            assert not reuse.enabled()
        finally:
            hook.remove(print)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", print)
        assert not reuse.enabled()
    assert reuse.enabled()


def test_a_learning_rate_schedule_and_alternating_layers_reuse_their_launches(recorder, monkeypatch):
    """A learning rate that changes every step (a scheduler) and two layers of different state layouts
    under the same keywords, alternating: after each layer's first call every launch is reused, with the
    arguments the checked path binds (the new rate's host scalars among them), and one entry per layer."""
    spec = forge_dsl.load_spec("adamw")
    layers = [_problem(torch.bfloat16, "int8", "adamw", seed=1), _problem(torch.bfloat16, "bf16", "adamw", seed=2)]
    for step in range(1, 6):
        lr = 1e-2 * 0.5 ** step
        for w, state in layers:
            x, dy = _activations(step)
            kernels.linear_step(spec, x, dy, w, state, step=step, lr=lr, config=WS_CONFIG)
            reused = recorder.calls.pop()
            monkeypatch.setattr(reuse, "_SUPPORTED", False)
            kernels.linear_step(spec, x, dy, w, state, step=step, lr=lr, config=WS_CONFIG)
            monkeypatch.setattr(reuse, "_SUPPORTED", True)
            checked = recorder.calls.pop()
            assert reused == (("run" if step == 1 else "launcher"), checked[1]), f"step {step}"
    assert reuse.entries() == 2


def test_auto_path_away_from_the_fused_kernel_is_not_reused(recorder, monkeypatch):
    """A prepared launch serves `linear_step(path="auto")` only where auto picks the fused kernel for that
    metadata; where it picks the slab path, the slab path runs."""
    spec = forge_dsl.load_spec("adamw")
    w, state = _problem(torch.bfloat16, "bf16", "adamw")
    x, dy = _activations(1)
    kernels.linear_step(spec, x, dy, w, state, step=1, lr=1e-2, config=WS_CONFIG, path="fused")
    slabs = []
    monkeypatch.setattr(steps, "_auto_path", lambda *args: "slab")
    monkeypatch.setattr(steps, "slab_linear_step", lambda *args, **kwargs: slabs.append(kwargs["step"]))
    kernels.linear_step(spec, x, dy, w, state, step=2, lr=1e-2, config=WS_CONFIG)
    assert slabs == [2] and [kind for kind, _ in recorder.calls] == ["run"]
    kernels.linear_step(spec, x, dy, w, state, step=3, lr=1e-2, config=WS_CONFIG, path="fused")
    assert recorder.calls[-1][0] == "launcher"


def test_reuse_is_off_with_triton_debug_or_instrumentation(monkeypatch):
    """`JITFunction.run` compiles another kernel under Triton's debug mode or instrumentation: no reuse then."""
    from triton import knobs

    monkeypatch.setattr(reuse, "_SUPPORTED", True)
    assert reuse.enabled()
    monkeypatch.setattr(knobs.runtime, "debug", True)
    assert not reuse.enabled()
    monkeypatch.setattr(knobs.runtime, "debug", False)
    monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "consan")
    assert not reuse.enabled()


def test_a_runtime_flag_switching_between_steps_reuses_one_entry(recorder, monkeypatch):
    """adamw's maximize is a runtime flag (`variants.runtime_flags`): one compiled variant and one prepared
    entry serve both values. Its host value is an int that Triton specializes on 1, so the first step with
    each value takes the checked path (and its kernel is kept), every later one is reused with the
    arguments the checked path binds, h_maximize among them."""
    spec = forge_dsl.load_spec("adamw")
    w, state = _problem(torch.bfloat16, "bf16", "adamw", seed=3)
    for step, maximize in enumerate((False, True, False, True, True, False), 1):
        x, dy = _activations(step)
        kernels.linear_step(spec, x, dy, w, state, step=step, lr=1e-2, maximize=maximize, config=WS_CONFIG)
        reused = recorder.calls.pop()
        monkeypatch.setattr(reuse, "_SUPPORTED", False)
        kernels.linear_step(spec, x, dy, w, state, step=step, lr=1e-2, maximize=maximize, config=WS_CONFIG)
        monkeypatch.setattr(reuse, "_SUPPORTED", True)
        checked = recorder.calls.pop()
        assert reused == (("run" if step <= 2 else "launcher"), checked[1]), f"step {step}"
    assert reuse.entries() == 1


def test_a_state_the_checks_refuse_never_reuses_a_launch(recorder):
    """A prepared launch is reused only for state dicts its key says were checked: int8 codes cast to float32
    (their block scales still beside them) have the fp32 state's metadata, but the key tells them apart, and the
    checked path refuses them (tests/kernels/test_state_checks.py has every refusal)."""
    spec = forge_dsl.load_spec("adamw")
    w, state = _problem(torch.bfloat16, "fp32", "adamw")
    x, dy = _activations(1)
    kernels.fused_linear_step(spec, x, dy, w, state, step=1, lr=1e-2, config=WS_CONFIG)
    assert recorder.calls.pop()[0] == "run"
    kernels.fused_linear_step(spec, x, dy, w, state, step=2, lr=1e-2, config=WS_CONFIG)
    assert recorder.calls.pop()[0] == "launcher"
    codes = forge_dsl.init_state(spec, w, layout="int8")
    cast = {**state, "exp_avg": codes["exp_avg"].float(), "exp_avg.scale": codes["exp_avg.scale"]}
    with pytest.raises(ValueError, match="'exp_avg' is torch.float32, but 'exp_avg.scale' .* sits beside it"):
        kernels.fused_linear_step(spec, x, dy, w, cast, step=3, lr=1e-2, config=WS_CONFIG)
    assert not recorder.calls
    signed = {**codes, "exp_avg_sq": codes["exp_avg_sq"].view(torch.int8)}  # a nonneg state in int8 codes
    with pytest.raises(ValueError, match="'exp_avg_sq' holds int8 codes, but adamw's 'exp_avg_sq' is declared"):
        kernels.fused_linear_step(spec, x, dy, w, signed, step=3, lr=1e-2, config=WS_CONFIG)
    assert not recorder.calls


class _Descriptor:
    """What Triton's launcher wrapper and `DirectLaunch` read of a Gluon TensorDescriptor."""

    def __init__(self, t):
        self.base, self.shape, self.strides, self.padding = t, tuple(t.shape), tuple(t.stride()), "zero"


@pytest.mark.skipif(not __import__("triton").__version__.startswith(reuse.VERIFIED_TRITON),
                    reason="DirectLaunch reads the launcher wrapper of the Triton versions reuse is verified on")
def test_a_direct_launch_passes_the_c_launcher_what_the_wrapper_passes(monkeypatch):
    """`reuse.DirectLaunch` against Triton's own `CudaLauncher` (its wrapper `wrap_handle_tensordesc` around a
    recorder standing for the compiled C launcher; the CUtensorMap made by a recorder standing for
    `make_tensordesc_arg`): the same arguments in the same order, on every call; a map made once per activation
    address and again for a new one; launchers of another shape not taken."""
    from triton.backends.nvidia import driver

    made = []

    def make_tensordesc_arg(arg, meta):
        made.append(arg.base.data_ptr())
        return [("map", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), meta["swizzle"]),
                *arg.shape, *arg.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", make_tensordesc_arg)
    launched = []
    signature = {"A": "*bf16", "X": "tensordesc<bf16[32,64]>", "n": "i32", "DY": "tensordesc<bf16[32,128]>",
                 "S": "constexpr"}
    run = object.__new__(driver.CudaLauncher)
    run.launch = driver.wrap_handle_tensordesc(lambda *args: launched.append(args), signature,
                                               [{"swizzle": 128, "fp4_padded": False}, {"swizzle": 64,
                                                                                        "fp4_padded": False}])
    run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, False
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    gen = torch.Generator().manual_seed(0)
    sets = [(torch.randn(40, 64, generator=gen).bfloat16(), torch.randn(40, 128, generator=gen).bfloat16())
            for _ in range(2)]
    direct = reuse.DirectLaunch.of(run, {1: _Descriptor(sets[0][0]), 3: _Descriptor(sets[0][1])})
    assert direct is not None and direct.run is run
    a = torch.zeros(3)
    for step, (x, dy) in enumerate([sets[0], sets[1], sets[0], sets[1]]):
        run(132, 1, 1, 7, "function", "packed", None, None, None, a, _Descriptor(x), step, _Descriptor(dy), 64)
        made_by_wrapper = made[-2:]
        del made[-2:]
        direct.launch(132, 7, "function", "packed", [a, None, step, None, 64], {1: x, 3: dy})
        assert launched[-1] == launched[-2], f"step {step}"
        assert made_by_wrapper == [x.data_ptr(), dy.data_ptr()]
        assert made == ([x.data_ptr(), dy.data_ptr()] if step < 2 else []), "a map is made once per address"
        made.clear()
    run.global_scratch_size = 8  # the wrapper's caller allocates scratch: not taken
    assert reuse.DirectLaunch.of(run, {1: _Descriptor(x), 3: _Descriptor(dy)}) is None
    run.global_scratch_size = 0
    assert reuse.DirectLaunch.of(run, {1: _Descriptor(x)}) is None  # a descriptor parameter it does not know
    assert reuse.DirectLaunch.of(lambda *args: None, {1: _Descriptor(x), 3: _Descriptor(dy)}) is None


@pytest.mark.skipif(not __import__("triton").__version__.startswith(reuse.VERIFIED_TRITON),
                    reason="DirectLaunch reads the launcher wrapper of the Triton versions reuse is verified on")
@pytest.mark.parametrize("activations", ["viewable", "not-viewable"])
def test_reused_launches_below_the_wrapper_read_what_the_wrapper_reads(recorder, monkeypatch, activations):
    """Reused launches of `fused_linear_step` through `DirectLaunch` against the same launches through Triton 3.6's
    `CudaLauncher` and its wrapper (DirectLaunch off), the C launcher a recorder: the same arguments, each
    CUtensorMap (a recorder standing for `make_tensordesc_arg`) over memory of the same bytes. "not-viewable": x
    [B, T, K] a slice whose rows cannot be viewed as [B·T, K], so the checked launch's descriptor reads a
    contiguous copy; a map of x's own storage would read other rows (silently wrong updates)."""
    import ctypes
    import hashlib

    from triton.backends.nvidia import driver

    def make_tensordesc_arg(arg, meta):  # a CUtensorMap encodes an address, not the bytes there
        return [("map", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), meta["swizzle"]),
                *arg.shape, *arg.strides]

    def read(v):  # at the launch, what a map's kernel would read: the bytes at its address
        if isinstance(v, tuple) and v[:1] == ("map",):
            _, address, (rows, cols), (row_stride, _), swizzle = v
            data = ctypes.string_at(address, 2 * ((rows - 1) * row_stride + cols))
            return ("map", hashlib.sha256(data).hexdigest(), (rows, cols), row_stride, swizzle)
        return _value(v)

    monkeypatch.setattr(driver, "make_tensordesc_arg", make_tensordesc_arg)
    fused_ws = _fused_ws()
    signature = {name: ("tensordesc<bf16>" if name in ("X", "DY") else "*bf16") for name in fused_ws.arg_names}
    launched = []
    run = object.__new__(driver.CudaLauncher)
    run.launch = driver.wrap_handle_tensordesc(lambda *args: launched.append(tuple(read(a) for a in args)),
                                               signature, [{"swizzle": 128}, {"swizzle": 64}])
    run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, False
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1

    class Compiled:
        function, packed_metadata = "function", "packed metadata"

    Compiled.run = run
    monkeypatch.setattr(type(fused_ws), "run", lambda self, *args, grid, warmup, **kwargs: Compiled())
    monkeypatch.setattr(gluon_lib, "descriptor", lambda t, block: _Descriptor(t))
    spec = forge_dsl.load_spec("adamw")
    w, state = _problem(torch.bfloat16, "bf16", "adamw")
    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(4):
        h = torch.randn(2, 2 * (T // 2), K, generator=gen).bfloat16()
        x = h[:, : T // 2] if activations == "not-viewable" else h[:, : T // 2].contiguous()
        batches.append((x, torch.randn(2, T // 2, N, generator=gen).bfloat16()))
    assert (batches[0][0].reshape(-1, K).data_ptr() == batches[0][0].data_ptr()) == (activations == "viewable")

    def launches(direct: bool) -> list:
        reuse.set_enabled(True)  # no entries: the first call is checked again
        if not direct:
            monkeypatch.setattr(reuse.DirectLaunch, "of", classmethod(lambda cls, *args: None))
        launched.clear()
        for step, (x, dy) in enumerate(batches, 1):  # nothing runs a kernel: w and state stay as they are
            kernels.fused_linear_step(spec, x, dy, w, state, step=step, lr=1e-2, config=WS_CONFIG)
        return list(launched)

    below, through = launches(direct=True), launches(direct=False)
    assert len(below) == len(through) == 3  # steps 2-4 reused; the checked step 1 is the recorder's `run`
    assert below == through
