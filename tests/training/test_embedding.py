"""The fused embedding (forge_dsl/training/embedding.py): its backward's row blocks against torch's own embedding
gradient, its steps through `ParamUpdateRows` against torch.optim (and tests/helpers/references.py's Lion) stepping a
copy from torch's gradient, rows without tokens included, the dense fallback, the bounded workspace and every
refusal. Tiles are forced small (`tile_rows`) so that several tiles and a ragged last one occur. The kernels'
tensors are on DEVICE (CUDA where there is one, else the interpreter's CPU); torch's references run on the CPU,
except where a test asks for torch's own bits, which it computes on the kernels' device."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from references import LionFormula
from torch.utils._python_dispatch import TorchDispatchMode

import forge_dsl
from forge_dsl.training import embedding as fe
from forge_dsl.training.row_updates import AutogradRows, ParamUpdateRows
from forge_dsl.testing import weight_bound
from tiers import sweep

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class RecordingRows:
    """A sink that keeps a copy of every block (and where its workspace lies) instead of updating anything."""

    def __init__(self) -> None:
        self.calls: list = []
        self.blocks: list = []
        self.pointers: list = []

    def begin(self) -> bool:
        self.calls.append("begin")
        return True

    def grad_rows(self, grad: torch.Tensor, r0: int) -> None:
        self.calls.append(r0)
        self.blocks.append(grad.clone())
        self.pointers.append(grad.data_ptr())

    def finish(self) -> None:
        self.calls.append("finish")

    def dense(self) -> torch.Tensor:
        return torch.cat(self.blocks)


class RefusingRows:
    """A sink that must not be reached."""

    def begin(self) -> bool:
        raise AssertionError("the sink was called")

    grad_rows = finish = begin


def _torch_grad(ids, weight, dy, **options) -> torch.Tensor:
    """torch's own dense embedding gradient of `weight` (float64 where `weight` is) for output gradient dy."""
    w = weight.detach().clone().requires_grad_()
    F.embedding(ids, w, **options).backward(dy)
    return w.grad


# ----------------------------------------------------------------------------
# The blocks
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("dim, dtype, ids_dtype, ids_shape, padding_idx, scale", [
    (136, torch.float32, torch.int64, (3, 5, 11), None, False),
    (64, torch.float32, torch.int32, (2, 40), -3, True),
    (136, torch.bfloat16, torch.int64, (90,), 7, False),
])
def test_blocks_are_torch_gradient_tile_by_tile(dim, dtype, ids_dtype, ids_shape, padding_idx, scale):
    V, tile = 200, 64
    g = torch.Generator().manual_seed(dim + len(ids_shape))
    weight = torch.randn(V, dim, generator=g).to(DEVICE, dtype).requires_grad_()
    ids = torch.randint(0, V - 60, ids_shape, generator=g).to(DEVICE, ids_dtype)  # rows >= 140 never used
    ids.view(-1)[::4] = 197  # one row of the ragged last tile, many times
    if padding_idx is not None:
        ids.view(-1)[1::5] = padding_idx % V
    dy = torch.randn(*ids_shape, dim, generator=g).to(DEVICE, dtype)
    sink = RecordingRows()
    out = fe.embedding(ids, weight, sink=sink, padding_idx=padding_idx, scale_grad_by_freq=scale, tile_rows=tile)
    assert torch.equal(out, F.embedding(ids, weight.detach()))
    out.backward(dy)

    assert weight.grad is None
    assert sink.calls == ["begin", 0, 64, 128, 192, "finish"]
    assert [tuple(b.shape) for b in sink.blocks] == [(64, dim)] * 3 + [(8, dim)]
    assert all(b.dtype == torch.float32 for b in sink.blocks)
    # exact fp32 sums: against float64 sums of the same values, within fp32 rounding
    ref = _torch_grad(ids.long().cpu(), weight.double().cpu(), dy.double().cpu(), padding_idx=padding_idx,
                      scale_grad_by_freq=scale)
    got = sink.dense().double().cpu()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    assert torch.equal(got[140:197], torch.zeros(57, dim, dtype=torch.float64))  # rows without tokens: zeros
    if padding_idx is not None:
        assert torch.equal(got[padding_idx % V], torch.zeros(dim, dtype=torch.float64))
        assert (ids == padding_idx % V).any()
    if dtype == torch.float32:
        return
    # deterministic: the same bits again
    again = RecordingRows()
    fe.embedding(ids, weight, sink=again, padding_idx=padding_idx, scale_grad_by_freq=scale,
                 tile_rows=tile).backward(dy)
    assert torch.equal(again.dense(), sink.dense())


def test_tokenless_batch_hands_every_row_as_zeros():
    weight = torch.randn(130, 64, device=DEVICE, requires_grad=True)
    sink = RecordingRows()
    fe.embedding(torch.zeros(0, 3, dtype=torch.long, device=DEVICE), weight, sink=sink, tile_rows=64).sum().backward()
    assert sink.calls == ["begin", 0, 64, 128, "finish"]
    assert torch.equal(sink.dense().cpu(), torch.zeros(130, 64))


# ----------------------------------------------------------------------------
# Steps against torch.optim
# ----------------------------------------------------------------------------

# spec -> (its hyperparameters, which the torch twin takes as they are; the twin)
STEPPERS = {
    "adamw": (dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1), torch.optim.AdamW),
    "sgd_momentum": (dict(lr=0.05, momentum=0.9, weight_decay=0.1), torch.optim.SGD),
    "lion": (dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1), LionFormula),
}
V_STEP, TILE_STEP, PADDING = 150, 32, 5  # tiles [0, 32) ... [128, 150)
ONCE = slice(32, 64)  # rows with tokens in the first step only: later steps move them on a zero gradient
NEVER = slice(96, 128)  # rows never used: a whole tile of zero gradient every step


def _step_ids(step: int, g: torch.Generator) -> torch.Tensor:
    """Fresh random ids [4, 30] with repeats, the padding row among them, none in NEVER, ONCE only at step 1."""
    pool = torch.cat([torch.arange(0, 32), torch.arange(64, 96), torch.arange(128, V_STEP)])
    if step == 1:
        pool = torch.cat([pool, torch.arange(ONCE.start, ONCE.stop)])
    ids = pool[torch.randint(0, len(pool), (4, 30), generator=g)]
    ids[:, ::7] = PADDING
    ids[0, :6] = 70  # a row used many times
    return ids


# the quick tier: each spec once, the dtypes in turn
@pytest.mark.parametrize(*sweep(("spec", sorted(STEPPERS)),
                                ("dtype, dim", [(torch.float32, 136), (torch.bfloat16, 64)],
                                 ["dtype0-136", "dtype1-64"])))
def test_steps_match_torch_optim(spec, dtype, dim):
    hypers, twin = STEPPERS[spec]
    g = torch.Generator().manual_seed(11)
    module = torch.nn.Embedding(V_STEP, dim, padding_idx=PADDING).to(DEVICE, dtype)
    with torch.no_grad():  # the padding row is created as zeros: make it one that weight decay moves
        module.weight.copy_(torch.randn(V_STEP, dim, generator=g))
    state = forge_dsl.init_state(spec, module.weight, layout="fp32", **hypers)
    sink = ParamUpdateRows(spec, module.weight, state, **hypers)
    if dtype == torch.float32:  # torch's fp32 step on a CPU copy, from torch's own gradient
        ref = torch.nn.Parameter(module.weight.detach().cpu().clone())
    else:  # bf16: each step in float64 from FORGE's previous weight (its rounding is stochastic)
        ref = torch.nn.Parameter(module.weight.detach().cpu().double())
    opt = twin([ref], **hypers)

    for step in range(1, 4):
        ids = _step_ids(step, g)
        dy = torch.randn(4, 30, dim, generator=g).to(dtype)
        before = module.weight.detach().cpu().clone()
        fe.embedding(ids.to(DEVICE), module.weight, sink=sink, padding_idx=module.padding_idx,
                     tile_rows=TILE_STEP).backward(dy.to(DEVICE))
        ref.grad = _torch_grad(ids, ref, dy.to(ref.dtype), padding_idx=PADDING)
        with torch.no_grad():
            if dtype == torch.bfloat16:
                ref.copy_(before.double())
            opt.step()
        got = module.weight.detach().cpu()
        assert module.weight.grad is None and sink.steps == step
        assert not (ids.view(-1)[:, None] == torch.arange(NEVER.start, NEVER.stop)).any()
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref.detach(), rtol=2e-5, atol=2e-6)
        else:
            err = (got.double() - ref.detach()).abs()
            assert (err <= weight_bound(ref.detach(), torch.bfloat16)).all(), f"step {step}: {err.max():.3g}"
        # rows without tokens moved, as torch moved them on a zero gradient
        tokenless = [NEVER, slice(PADDING, PADDING + 1)] + ([ONCE] if step > 1 else [])
        for rows in tokenless:
            assert not torch.equal(got[rows], before[rows]), f"step {step}: rows {rows} did not move"
            if dtype == torch.float32:
                torch.testing.assert_close(got[rows], ref.detach()[rows], rtol=2e-5, atol=2e-6)


# ----------------------------------------------------------------------------
# Not fused this step, and not fused at all
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx, scale", [(None, False), (3, True)])
def test_autograd_rows_returns_torch_gradient(dtype, padding_idx, scale):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(90, 40, generator=g).to(DEVICE, dtype).requires_grad_()
    ids = torch.randint(0, 90, (5, 13), generator=g).to(DEVICE, torch.int32 if scale else torch.int64)
    ids[0] = 3
    dy = torch.randn(5, 13, 40, generator=g).to(DEVICE, dtype)
    fe.embedding(ids, weight, sink=AutogradRows(), padding_idx=padding_idx, scale_grad_by_freq=scale).backward(dy)
    expected = _torch_grad(ids, weight, dy, padding_idx=padding_idx, scale_grad_by_freq=scale)
    assert weight.grad.dtype == dtype and torch.equal(weight.grad, expected)


def test_plain_forward_without_gradients_frozen_or_compiled():
    module = torch.nn.Embedding(50, 16, max_norm=None)
    ids = torch.randint(0, 50, (3, 7))
    with torch.no_grad():
        assert torch.equal(fe.embedding_forward(module, ids, RefusingRows()), module(ids))
    module.weight.requires_grad_(False)
    out = fe.embedding_forward(module, ids, RefusingRows())
    assert torch.equal(out, module(ids)) and out.grad_fn is None
    module.weight.requires_grad_(True)
    # under torch.compile: F.embedding, so autograd gives the weight its dense gradient
    compiled = torch.compile(functools.partial(fe.embedding_forward, module, sink=RefusingRows()), backend="eager",
                             fullgraph=True)
    dy = torch.randn(3, 7, 16)
    compiled(ids).backward(dy)
    assert torch.equal(module.weight.grad, _torch_grad(ids, module.weight, dy))


# ----------------------------------------------------------------------------
# The workspace
# ----------------------------------------------------------------------------

class _Shapes(TorchDispatchMode):
    """The shape of every tensor an aten op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _backward_shapes(sink, V, D, tile_rows):
    weight = torch.randn(V, D, device=DEVICE, requires_grad=True)
    ids = torch.randint(0, V, (2, 50), device=DEVICE)  # T = 100 tokens
    out = fe.embedding(ids, weight, sink=sink, padding_idx=1, tile_rows=tile_rows)
    dy = torch.randn_like(out)
    with _Shapes() as mode:
        out.backward(dy)
    return mode.shapes


def test_workspace_is_one_tile_reused():
    V, D = 300, 64
    sink = RecordingRows()
    shapes = _backward_shapes(sink, V, D, tile_rows=64)
    assert shapes, "the dispatch mode saw no op of the backward"
    big = [s for s in shapes if len(s) >= 2 and (s[0] >= V or torch.Size(s).numel() >= V * D // 2)]
    assert not big, f"backward made tensors of the weight's size: {big}"
    assert all(s[0] <= 100 for s in shapes if len(s) >= 2)  # the tokens' [T, D], the tile [64, D]
    assert [tuple(b.shape) for b in sink.blocks] == [(64, D)] * 4 + [(44, D)]
    assert len(set(sink.pointers)) == 1  # every tile in the same workspace
    # the detector sees the dense gradient where there is one
    assert (V, D) in _backward_shapes(AutogradRows(), V, D, tile_rows=64)


def test_tile_rows_fit_the_workspace():
    assert fe.WORKSPACE_BYTES == 64 << 20
    assert fe.tile_rows_for(4096) == 4096 and -(-128256 // fe.tile_rows_for(4096)) == 32  # Llama-3.1-8B: 32 tiles
    for dim in (1, 63, 136, 3000, 4096, 5120, 8192, 2**18):
        rows = fe.tile_rows_for(dim)
        assert rows % 64 == 0 and rows * dim * 4 <= fe.WORKSPACE_BYTES < (rows + 64) * dim * 4 or rows == 64, dim
    assert fe.tile_rows_for(2**20) == 64
    assert fe.tile_rows_for(136, workspace_bytes=64 * 136 * 4 + 5) == 64


# The compiler needs the real @triton.jit function: compile in a process without the interpreter.
SM90_SCRIPT = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from forge_dsl.training.embedding import _BLOCK_T, _MAX_BLOCK_D
from forge_dsl.kernels.embedding_kernels import rows_grad
from forge_dsl.bench.sm90 import _resources
aligned = ("GRAD", "ORDER", "OFFSETS", "BLOCK", "D", "stride_grad", "stride_block")  # as the JIT specializes D = 4096
attrs = {(rows_grad.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
out = []
for grad in ("bf16", "fp32"):
    for scale in (False, True):
        signature = {"GRAD": "*" + grad, "ORDER": "*i64", "OFFSETS": "*i64", "BLOCK": "*fp32", "r0": "i32", "D": "i32",
                     "stride_grad": "i32", "stride_block": "i32", "SCALE_BY_FREQ": "constexpr", "BLOCK_T": "constexpr",
                     "BLOCK_D": "constexpr"}
        constexprs = {"SCALE_BY_FREQ": scale, "BLOCK_T": _BLOCK_T, "BLOCK_D": _MAX_BLOCK_D}
        kernel = triton.compile(ASTSource(rows_grad, signature, constexprs, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        r = _resources(kernel, triton)
        out.append([grad, scale, r.registers, r.stack_bytes, r.memory_ops])
print(json.dumps(out))
"""


@pytest.mark.slow  # compiles for sm_90 (tests/kernels/test_sm90.py's tier)
def test_rows_grad_compiles_for_sm90():
    """The interpreter runs code the GPU compiler rejects: compile the kernel for the H100/H200 with Triton's
    bundled ptxas; no spills, and 16-byte loads of ΔY where its rows are aligned."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton has no bundled NVIDIA tools")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SM90_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for grad, scale, registers, stack, ops in json.loads(done.stdout.strip().splitlines()[-1]):
        assert stack == 0 and registers <= 128, (grad, scale, registers, stack)
        assert ops.get("ld.global.v4.b32", 0) > 0, (grad, scale, ops)


# ----------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------

def test_refusals_of_embedding():
    weight = torch.randn(20, 8, device=DEVICE, requires_grad=True)
    kept = weight.detach().clone()
    ids = torch.tensor([[0, 1, 2]], device=DEVICE)
    sink = RecordingRows()
    with pytest.raises(ValueError, match=r"max_norm=1\.0 cannot be fused: max_norm renormalizes the rows it reads"):
        fe.embedding(ids, weight, sink=sink, max_norm=1.0)
    assert torch.equal(weight.detach(), kept)  # refused before F.embedding could renormalize in place
    with pytest.raises(ValueError, match=r"sparse=True cannot be fused: sparse=True makes a sparse gradient"):
        fe.embedding(ids, weight, sink=sink, sparse=True)
    for bad in (20, -21, 1.0, True):
        with pytest.raises(ValueError, match=r"padding_idx must be None or an int in \[-20, 20\).*got " + repr(bad)):
            fe.embedding(ids, weight, sink=sink, padding_idx=bad)
    for bad in (0, -64, 1.5, True):
        with pytest.raises(ValueError, match=r"tile_rows must be a positive int, got " + repr(bad)):
            fe.embedding(ids, weight, sink=sink, tile_rows=bad)
    with pytest.raises(TypeError, match=r"ids must be an int64 or int32 tensor, got torch.float32"):
        fe.embedding(ids.float(), weight, sink=sink)
    with pytest.raises(TypeError, match=r"ids must be an int64 or int32 tensor, got list"):
        fe.embedding([0, 1], weight, sink=sink)
    with pytest.raises(ValueError, match=r"weight must be a 2-D float32 or bfloat16 tensor \[V, D\] \(what FORGE "
                                         r"updates\), got torch.float32 of shape \(20, 8, 1\)"):
        fe.embedding(ids, weight[..., None], sink=sink)
    with pytest.raises(ValueError, match=r"bfloat16 tensor \[V, D\] \(what FORGE updates\), got torch.float16 of "
                                         r"shape \(20, 8\)"):
        fe.embedding(ids, weight.detach().half().requires_grad_(), sink=sink)
    with pytest.raises(TypeError, match=r"sink must be a forge_dsl.training.row_updates.RowSink \(begin, grad_rows, finish\); "
                                        r"object has no begin\(\)"):
        fe.embedding(ids, weight, sink=object())
    assert sink.calls == []


def test_fusion_refusal():
    class Scaled(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2

    class Tagged(torch.nn.Embedding):  # no forward of its own
        pass

    plain = torch.nn.Embedding(10, 4)
    assert fe.fusion_refusal(plain) is None
    assert fe.fusion_refusal(torch.nn.Embedding(10, 4, padding_idx=0, scale_grad_by_freq=True)) is None
    assert fe.fusion_refusal(Tagged(10, 4)) is None
    assert fe.fusion_refusal(torch.nn.Linear(4, 4)) == "not an nn.Embedding"
    assert fe.fusion_refusal(Scaled(10, 4)) == "test_fusion_refusal.<locals>.Scaled has its own forward, which " \
                                                "FORGE does not replace"
    assert fe.fusion_refusal(torch.nn.Embedding(10, 4, max_norm=1.0)) == fe._MAX_NORM
    assert fe.fusion_refusal(torch.nn.Embedding(10, 4, sparse=True)) == fe._SPARSE
    assert fe._MAX_NORM.startswith("max_norm renormalizes the rows it reads in place in the forward")
    assert fe._SPARSE.startswith("sparse=True makes a sparse gradient for a sparse optimizer")

    hooked = torch.nn.Embedding(10, 4)
    hooked.forward = lambda ids: torch.nn.Embedding.forward(hooked, ids)
    replaced = ("its forward was replaced on the instance (e.g. by a hook library), which FORGE does not replace")
    assert fe.fusion_refusal(hooked) == replaced
    other = torch.nn.Embedding(10, 4)
    for forward, refusal in [
        (functools.partial(fe.embedding_forward, hooked, sink=RecordingRows()), replaced),  # another module's
        (functools.partial(fe.embedding_forward, other, RecordingRows()), replaced),  # the sink in ids' place
        (functools.partial(fe.embedding_forward, other, sink=RecordingRows(), tile_rows=64), replaced),
        (functools.partial(torch.nn.Embedding.forward, hooked), replaced),
        (functools.partial(torch.nn.Embedding.forward, other, ids=None), replaced),
    ]:
        other.forward = forward
        assert fe.fusion_refusal(other) == refusal
    hooked.forward = functools.partial(fe.embedding_forward, hooked, sink=RecordingRows())  # FORGE's own
    assert fe.fusion_refusal(hooked) is None
    hooked.forward = functools.partial(torch.nn.Embedding.forward, hooked)  # a copy of a fused module's
    assert fe.fusion_refusal(hooked) is None
