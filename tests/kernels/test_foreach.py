"""`foreach_step` (one launch for many small parameters) against one `step` launch per parameter.

The update is element-wise, so with nearest rounding the two must give the same bits in every
parameter and state, int8 block scales and scalar states included, over two steps from fresh
random data, in the Triton interpreter. On the GPU the two launches run differently specialized
compilations of the kernel (Triton specializes on sizes and alignments), which may contract a
different `a * b + c` into an FMA (docs/PERF.md v8c): there, values may differ by one unit in the
last place of their storage, plus a few fp32 units of the tensor's largest value (an FMA rounds
once where a multiply and an add round twice; where the sum cancels, that is large next to the
result), and int8 codes by one. With stochastic rounding each bf16 weight
lies within one bf16 step of the nearest-rounded one. `ForgeOptimizer(foreach=True)` must actually
share launches, and give what `foreach=False` gives.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spec_lists import ELEMENT_WISE
from forge_dsl import ForgeOptimizer, init_state
from forge_dsl.kernels import step, steps
from forge_dsl.kernels.foreach import foreach_step, shared_launch_key
from tiers import sweep

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPECS = ELEMENT_WISE
HYPERS = {"sgd_momentum": {"momentum": 0.9}, "lion": {"lr": 1e-3}}
# int8 state needs last dims that are multiples of 64 to share a launch; fp32 / bf16 take any
SHAPES = {"int8": [(64,), (2, 128), (192,), (3, 64)], "other": [(37,), (3, 5), (64,), (2, 130)]}


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit for bit in the interpreter; within one unit of storage on the GPU (see the module docstring)."""
    if DEVICE.type == "cpu" or not (a.is_floating_point() or a.dtype in (torch.int8, torch.uint8)):
        assert torch.equal(bits(a), bits(b)), what
        return
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.is_floating_point():
        big = torch.maximum(a.abs(), b.abs()).double()
        bound = torch.finfo(a.dtype).eps * big + 4 * torch.finfo(torch.float32).eps * big.max()
        gap = (a.double() - b.double()).abs()
        assert (gap <= bound).all(), f"{what}: {(gap > bound).sum()} elements apart by more than {bound.max():.3g}"
    else:
        assert ((a.int() - b.int()).abs() <= 1).all(), f"{what}: codes more than one apart"


def problem(name: str, layout: str, w_dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shapes = SHAPES["int8" if layout == "int8" else "other"]
    params = [(torch.randn(s, generator=gen) * 0.5).to(w_dtype).to(DEVICE) for s in shapes]
    grads = [[(torch.randn(s, generator=gen) * 0.1).to(w_dtype).to(DEVICE) for s in shapes] for _ in range(2)]
    hypers = {"lr": 1e-2, **HYPERS.get(name, {})}
    states = [init_state(name, p, layout=layout, **hypers) for p in params]
    return params, grads, states, hypers


def clone_states(states):
    return [{k: v.clone() for k, v in s.items()} for s in states]


# the quick tier: each spec once, the layouts and weight dtypes in turn
@pytest.mark.parametrize(*sweep(("name", SPECS), ("layout", ["fp32", "bf16", "int8"]),
                                ("w_dtype", [torch.float32, torch.bfloat16], ["w_fp32", "w_bf16"])))
def test_one_launch_gives_the_bits_of_one_launch_per_parameter(name, layout, w_dtype):
    params, grads, states, hypers = problem(name, layout, w_dtype, seed=len(name) * 31 + len(layout))
    keys = {shared_launch_key(name, p, g, s) for p, g, s in zip(params, grads[0], states)}
    assert len(keys) == 1 and None not in keys
    alone_p, alone_s = [p.clone() for p in params], clone_states(states)
    shared_p, shared_s = [p.clone() for p in params], clone_states(states)
    for t, g in enumerate(grads, start=1):
        for p, grad, s in zip(alone_p, g, alone_s):
            step(name, p, grad, s, step=t, seed=5, rounding="nearest", **hypers)
        foreach_step(name, shared_p, g, shared_s, step=t, seed=5, rounding="nearest", **hypers)
    for i, (a, b, p0) in enumerate(zip(alone_p, shared_p, params)):
        assert_same(a, b, f"param {i}")
        assert not torch.equal(a, p0)  # the weights moved
    for i, (a, b) in enumerate(zip(alone_s, shared_s)):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k], f"state {i} {k}")
    if w_dtype == torch.bfloat16:
        # a stochastic step lands on one of the two bf16 neighbours of the exact update
        p1, s1 = [p.clone() for p in params], clone_states(states)
        foreach_step(name, p1, grads[0], s1, step=1, seed=9, rounding="stochastic", **hypers)
        p1n, s1n = [p.clone() for p in params], clone_states(states)
        foreach_step(name, p1n, grads[0], s1n, step=1, seed=9, rounding="nearest", **hypers)
        for a, b in zip(p1, p1n):
            gap = (a.double() - b.double()).abs()
            ulp = torch.finfo(torch.bfloat16).eps * b.double().abs().clamp_min(1e-30)
            assert (gap <= ulp * 1.0001).all()


def test_parameters_that_cannot_share_a_launch_are_refused():
    p = [torch.randn(64, device=DEVICE), torch.randn(100, device=DEVICE)]
    g = [torch.randn_like(t) for t in p]
    s = [init_state("adamw", t, layout="int8") for t in p]
    assert shared_launch_key("adamw", p[1], g[1], s[1]) is None  # ragged int8 block
    with pytest.raises(ValueError, match=r"params\[1\] cannot share a launch.*multiple of 64"):
        foreach_step("adamw", p, g, s, step=1, lr=1e-2)
    q = [torch.randn(64, device=DEVICE), torch.randn(64, device=DEVICE).to(torch.bfloat16)]
    with pytest.raises(ValueError, match=r"params\[1\] cannot share a launch.*same device, dtypes"):
        foreach_step("adamw", q, [torch.randn_like(t) for t in q], [init_state("adamw", t) for t in q],
                     step=1, lr=1e-2)
    # int8 state with bf16 block scales (new) and with float32 ones (an old checkpoint's): flattened together, the
    # scales would be concatenated across formats; they need launches of their own
    b = [torch.randn(64, device=DEVICE), torch.randn(128, device=DEVICE)]
    sb = [init_state("adamw", t, layout="int8") for t in b]
    sb[1] = {k: (v.float() if k.endswith(".scale") else v) for k, v in sb[1].items()}
    gb = [torch.randn_like(t) for t in b]
    assert shared_launch_key("adamw", b[0], gb[0], sb[0]) != shared_launch_key("adamw", b[1], gb[1], sb[1])
    with pytest.raises(ValueError, match=r"params\[1\] cannot share a launch.*same device, dtypes, state layouts"):
        foreach_step("adamw", b, gb, sb, step=1, lr=1e-2)
    with pytest.raises(ValueError, match="one grad and one state per param"):
        foreach_step("adamw", q, q[:1], [init_state("adamw", t) for t in q], step=1, lr=1e-2)


class Net(nn.Module):
    """Linear layers (fused) around norms and biases (left to step(), shared launches)."""

    def __init__(self, dtype):
        super().__init__()
        self.inp = nn.Linear(64, 128, dtype=dtype)
        self.norm1 = nn.LayerNorm(128, dtype=dtype)
        self.norm2 = nn.LayerNorm(128, dtype=dtype)
        self.odd = nn.Parameter(torch.ones(100, dtype=dtype))  # 100: its own launch with int8 state
        self.out = nn.Linear(128, 64, dtype=dtype)

    def forward(self, x):
        return self.out(self.norm2(torch.relu(self.norm1(self.inp(x)))) * self.odd[:1])


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_optimizer_shares_launches_and_keeps_the_bits(dtype, state_dtype, monkeypatch):
    torch.manual_seed(0)
    ref = Net(dtype).to(DEVICE)
    with torch.no_grad():
        for prm in ref.parameters():
            prm.add_(torch.randn_like(prm) * 0.1)  # norms away from their ones and zeros
    models = {flag: Net(dtype).to(DEVICE) for flag in (True, False)}
    launches = {}
    real = steps.launch_elementwise
    for flag, model in models.items():
        model.load_state_dict(ref.state_dict())
        opt = ForgeOptimizer(model, "adamw", lr=1e-2, weight_decay=0.1, state_dtype=state_dtype,
                             rounding="nearest", foreach=flag)
        calls = []
        monkeypatch.setattr(steps, "launch_elementwise", lambda *a, **k: (calls.append(1), real(*a, **k)))
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randn(2, 16, 64, generator=gen).to(DEVICE, dtype)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        launches[flag] = len(calls)
    # step() gets 7 parameters a step: two biases, the norms' weights and biases, odd; shared launches
    # take all of them at once (fp32 state), or all but odd (int8 state: 100 is not a multiple of 64)
    assert launches[False] == 2 * 7
    assert launches[True] == 2 * (1 if state_dtype == "fp32" else 2)
    for (n, a), b in zip(models[True].named_parameters(), models[False].parameters()):
        assert_same(a, b, n)
        assert not torch.equal(a, ref.get_parameter(n)), n
