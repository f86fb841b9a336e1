"""Launch values read from device memory (`kernels.host_table`, the kernels' HOST_IN_TABLE): what a CUDA graph
replays. A launch that reads its host scalars and key from a staged table row writes the same bits as the launch
that is passed them, for every element-wise spec, on the fused kernel (Triton tiles in the interpreter; the
warp-specialized kernel too on a Hopper GPU) and the step kernel; a row staged for another step writes other bits
(the kernel reads the row, not its arguments)."""

from __future__ import annotations

import struct

import pytest
import torch

import forge_dsl
from spec_lists import ELEMENT_WISE
from forge_dsl.kernels import ParamUpdate, host_table, linear_step, policy
from forge_dsl.kernels.kernel_calls import mix_seed
from forge_dsl.kernels.steps import launch_host_values
from forge_dsl.testing import WS_CONFIG, default_device

DEVICE = default_device()
HYPERS = {"sgd_momentum": {"momentum": 0.9}, "lion": {"lr": 1e-3}}
N, K, T = 48, 136, 24
SEED = 11


def _hypers(name):
    return {"lr": 1e-2, **HYPERS.get(name, {})}


def _problem(name, layout, gen_seed=0):
    gen = torch.Generator().manual_seed(gen_seed)
    w = torch.randn(N, K, generator=gen).to(DEVICE, torch.bfloat16)
    state = forge_dsl.init_state(name, w, layout=layout, **_hypers(name))
    for t in state.values():  # fresh, nonzero state
        if t.is_floating_point() and t.dim() == 2:
            t.copy_(torch.rand(t.shape, generator=gen).to(t.dtype).to(DEVICE) * 1e-2)
    x = torch.randn(T, K, generator=gen).to(DEVICE, torch.bfloat16)
    dy = torch.randn(T, N, generator=gen).to(DEVICE, torch.bfloat16)
    return w, state, x, dy


def _copy(state):
    return {k: v.clone() for k, v in state.items()}


def _staged(name, state, step, table, slot=0):
    table.stage(slot, launch_host_values(name, step, state, **_hypers(name)), mix_seed(SEED, step))
    table.upload()
    return table.row(slot)


def _run(name, path, w, state, x, dy, step, row=None, config=None):
    if path == "fused":
        linear_step(name, x, dy, w, state, step=step, seed=SEED, path="fused", host_row=row, config=config,
                    **_hypers(name))
    else:
        grad = (dy.float().T @ x.float()).to(torch.bfloat16)
        ParamUpdate(name, w, state, step=step, seed=SEED, host_row=row, **_hypers(name)).from_grad(grad)


def _bits(t):
    return t.reshape(-1).view(torch.uint8) if t.dtype.is_floating_point else t


def _same(a, b):
    return all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


@pytest.mark.parametrize("path", ["fused", "step"])
@pytest.mark.parametrize("layout", ["bf16", "int8"])
@pytest.mark.parametrize("name", ELEMENT_WISE)
def test_a_table_row_writes_the_bits_of_the_values_passed(name, layout, path):
    w, state, x, dy = _problem(name, layout)
    w2, state2 = w.clone(), _copy(state)
    table = host_table.HostTable(3, DEVICE)
    for step in (1, 2, 3):
        _run(name, path, w, state, x, dy, step)
        _run(name, path, w2, state2, x, dy, step, row=_staged(name, state2, step, table, slot=step % 3))
        assert torch.equal(w.view(torch.int16), w2.view(torch.int16)), f"step {step}"
        assert _same(state, state2), f"step {step}"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bf16", "int8"])
@pytest.mark.parametrize("name", ["adamw", "lion", "radam"])
def test_the_warp_specialized_kernel_reads_the_table_row(name, layout):
    if not policy.hopper_with_gluon(torch.device(DEVICE)):
        pytest.skip("the warp-specialized kernel runs only compiled on a Hopper GPU")
    w, state, x, dy = _problem(name, layout)
    w2, state2 = w.clone(), _copy(state)
    table = host_table.HostTable(1, DEVICE)
    for step in (1, 2):
        _run(name, "fused", w, state, x, dy, step, config=WS_CONFIG)
        _run(name, "fused", w2, state2, x, dy, step, row=_staged(name, state2, step, table), config=WS_CONFIG)
        assert torch.equal(w.view(torch.int16), w2.view(torch.int16)), f"step {step}"
        assert _same(state, state2), f"step {step}"


def test_the_kernel_reads_the_row_not_its_arguments():
    """A row staged with step 5's values makes a call of step 1 write step 5's bits."""
    w, state, x, dy = _problem("adamw", "fp32")
    w2, state2 = w.clone(), _copy(state)
    _run("adamw", "fused", w, state, x, dy, 5)
    table = host_table.HostTable(1, DEVICE)
    _run("adamw", "fused", w2, state2, x, dy, 1, row=_staged("adamw", state2, 5, table))
    assert torch.equal(w.view(torch.int16), w2.view(torch.int16))
    assert _same(state, state2)


def test_encode_row_holds_fp32_bits_then_the_key():
    row = host_table.encode_row((0.5, 1, -2.0), 12345)
    assert len(row) == host_table.ROW_WORDS
    assert row[:4] == [struct.unpack("<i", struct.pack("<f", v))[0] for v in (0.5, 1.0, -2.0)] + [12345]
    assert row[4:] == [0] * (host_table.ROW_WORDS - 4)
    with pytest.raises(ValueError, match="exact fp32"):
        host_table.encode_row((2**24 + 1,), 0)
    with pytest.raises(ValueError, match="rounding key"):
        host_table.encode_row((), 2**31)
    with pytest.raises(ValueError, match="holds 31 host scalars"):
        host_table.encode_row((0.0,) * 32, 0)


def test_a_table_row_refuses_the_slab_path_and_row_blocks():
    w, state, x, dy = _problem("adamw", "fp32")
    row = host_table.HostTable(1, DEVICE).row(0)
    with pytest.raises(ValueError, match="slab path"):
        linear_step("adamw", x, dy, w, state, step=1, path="slab", host_row=row, lr=1e-2)
    update = ParamUpdate("adamw", w, state, step=1, host_row=row, lr=1e-2)
    with pytest.raises(ValueError, match="row blocks"):
        update.from_grad(torch.zeros(8, K, dtype=w.dtype, device=DEVICE), rows=0)
