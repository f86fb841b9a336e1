"""Checks of ForgeOptimizer under FSDP2 (`fully_shard`), run by tests/training/test_fsdp.py in 2 or 4 CPU processes
(gloo, the Triton interpreter). Each check takes (rank, world, tmp) and compares the whole parameters
(`full_tensor()`) with one process's run of the same model on the whole batch, computed on every rank (no
collectives in that one).

    python -m torch.distributed.run --nproc-per-node 2 tests/helpers/fsdp_checks.py NAME [NAME ...]   # by hand, too
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from forge_dsl import ForgeOptimizer
from forge_dsl.training.data_parallel import is_placeholder
import rank_checks

REL = 1e-5  # the bound against one process
HYPERS = dict(lr=2e-3, weight_decay=0.1)
TRIGGERS = 0.05  # a max_grad_norm this MLP's gradients exceed at every step


def make_pair(seed=0, dtype=torch.float32, hidden=128, out=64):
    """(an MLP with FSDP2 on each Linear and on the whole, the same MLP unsharded): 64 -> hidden -> out."""
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, out)).to(dtype)
    model = copy.deepcopy(ref)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    return model, ref


def batches(n, world, seed=1, dtype=torch.float32):
    """n global batches [world, 4, 64]: rank r trains on row r, one process on all of them."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(world, 4, 64, generator=gen).to(dtype) for _ in range(n)]


def loss_of(model, x):
    return model(x).float()[..., :64].pow(2).mean()


def run_pair(rank, model, opt, ref, ref_opt, steps, k, max_norm, use_backward=True):
    """`steps` steps of k micro-batches each on both; returns (FORGE's norms, the reference's norms)."""
    norms, ref_norms = [], []
    for i in range(0, len(steps), k):
        for xs in steps[i:i + k]:
            loss = loss_of(model, xs[rank]) / k
            opt.backward(loss) if use_backward else loss.backward()
            (loss_of(ref, xs.flatten(0, 1)) / k).backward()
        if max_norm is not None and isinstance(ref_opt, torch.optim.AdamW):
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
        opt.step()
        ref_opt.step()
        norms.append(opt.last_grad_norm)
        if not isinstance(ref_opt, torch.optim.AdamW):
            ref_norms.append(ref_opt.last_grad_norm)
        opt.zero_grad()
        ref_opt.zero_grad()
    return norms, ref_norms


def assert_matches(model, ref, what, rel=REL):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        mine = p.full_tensor() if isinstance(p, DTensor) else p
        err = ((mine.double() - q.double()).norm() / q.double().norm()).item()
        assert err <= rel, f"{what}: {name} differs from one process by {err:.3g} (bound {rel})"


def check_against_torch(rank, world, tmp):
    """FSDP2 + ForgeOptimizer against one process's torch AdamW (+ clip_grad_norm_, + .grad accumulation)."""
    for max_norm, k in ((None, 1), (TRIGGERS, 1), (None, 2), (TRIGGERS, 2), (None, 3)):
        model, ref = make_pair()
        opt = ForgeOptimizer(model, "adamw", max_grad_norm=max_norm, accumulation_steps=k, **HYPERS)
        ref_opt = torch.optim.AdamW(ref.parameters(), **HYPERS)
        norms, ref_norms = run_pair(rank, model, opt, ref, ref_opt, batches(3 * k, world), k, max_norm)
        what = f"max_grad_norm={max_norm}, accumulation_steps={k}"
        assert_matches(model, ref, what)
        for n, m in zip(norms, ref_norms):
            assert max_norm is not None and abs(n.item() - m.item()) <= 1e-6 * m.item() and m.item() > max_norm, what


def check_updated_in_backward(rank, world, tmp):
    """Each shard is updated inside backward, its gradient then dropped (a placeholder without memory); step()
    steps nothing more for it, and clip_grad_norm_ after that backward is refused."""
    model, ref = make_pair()
    opt = ForgeOptimizer(model, "adamw", **HYPERS)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    x = batches(1, world)[0][rank]
    loss_of(model, x).backward()
    for name, p in model.named_parameters():
        assert is_placeholder(p.grad), (name, type(p.grad))
        assert not torch.equal(p.full_tensor(), before[name]), f"{name} was not updated in backward"
        assert int(opt.state[p]["step"]) == 1
        assert opt._stepper.shard_of[p] == rank  # stochastic rounding drawn per shard
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        raise AssertionError("clip_grad_norm_ after the updates was not refused")
    except RuntimeError as e:
        assert "max_grad_norm=c" in str(e), e
    opt.step()
    assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters())
    assert "FSDP2 shards updated in backward, as its gradient lands (6)" in opt.describe(), opt.describe()
    assert "stepped from .grad in step() (0)" in opt.describe(), opt.describe()
    opt.zero_grad()


def check_second_backward_is_refused(rank, world, tmp):
    """A second backward before step() without accumulation_steps: refused before it updates any shard again."""
    model, _ = make_pair()
    opt = ForgeOptimizer(model, "adamw", **HYPERS)  # noqa: F841 (its hooks update the shards while it lives)
    xs = batches(2, world)
    loss_of(model, xs[0][rank]).backward()
    after = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    try:
        loss_of(model, xs[1][rank]).backward()
        raise AssertionError("a second backward before step() was not refused")
    except RuntimeError as e:
        assert "accumulation_steps=k" in str(e) and "fuse=False" in str(e), e
    for name, p in model.named_parameters():  # FSDP2 leaves the parameters unsharded after an exception in backward
        assert torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, after[name]), f"{name} moved again"


def check_leftover_micro_batches_and_in_place_zeroing(rank, world, tmp):
    """A step after fewer than k micro-batches (an epoch's remainder), then zero_grad(set_to_none=False): the next
    steps count their micro-batches from 0 and equal torch's."""
    model, ref = make_pair()
    opt = ForgeOptimizer(model, "adamw", accumulation_steps=2, **HYPERS)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPERS)
    xs = batches(5, world)
    for group in (xs[:1], xs[1:3], xs[3:5]):
        for x in group:
            loss_of(model, x[rank]).backward()
            loss_of(ref, x.flatten(0, 1)).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=False)
        ref_opt.zero_grad(set_to_none=False)
    assert_matches(model, ref, "an epoch's remainder, then zero_grad(set_to_none=False)")


def check_state_layouts(rank, world, tmp):
    """bf16 / int8 / int4 state on each shard against one process's same optimizer (fuse=False, from .grad); every
    shard whole blocks of 64 of the quantized state (a 1-D shard that splits one is refused when the optimizer is
    built)."""
    for layout in ("bf16", "int8", "int4"):
        for max_norm, k in ((None, 1), (TRIGGERS, 2)):
            model, ref = make_pair(hidden=64 * 2 * world, out=64 * world)
            kwargs = dict(state_dtype=layout, rounding="nearest", max_grad_norm=max_norm, accumulation_steps=k,
                          **HYPERS)
            opt = ForgeOptimizer(model, "adamw", **kwargs)
            ref_opt = ForgeOptimizer(ref, "adamw", fuse=False, **kwargs)
            run_pair(rank, model, opt, ref, ref_opt, batches(2 * k, world), k, max_norm)
            assert_matches(model, ref, f"{layout} state, max_grad_norm={max_norm}, accumulation_steps={k}")


def check_quantized_state_that_a_shard_would_split_is_refused(rank, world, tmp):
    """int8 state of a bias FSDP2 cuts into 48-column shards (96 on 2 ranks): a block of 64 split, refused when the
    optimizer is built, naming the FSDP2 mesh's size and the fp32 / bf16 alternative; bf16 state accepted."""
    model, _ = make_pair(hidden=48 * world)
    try:
        ForgeOptimizer(model, "adamw", state_dtype="int8")
        raise AssertionError("int8 state split by an FSDP2 shard was not refused")
    except ValueError as e:
        assert "splits a block" in str(e) and "FSDP2 mesh's size" in str(e) and "'bf16'" in str(e), e
    ForgeOptimizer(model, "adamw", state_dtype="bf16")


def check_dcp_round_trip(rank, world, tmp):
    """state_dict() holds DTensor states (torch's exp_avg, exp_avg_sq where whole); torch.distributed.checkpoint
    saves them sharded and a new optimizer loaded from it continues as the saving one does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model, ref = make_pair()
    opt = ForgeOptimizer(model, "adamw", seed=7, **HYPERS)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPERS)
    xs = batches(3, world)
    run_pair(rank, model, opt, ref, ref_opt, xs[:2], 1, None)
    saved = get_optimizer_state_dict(model, opt)
    ref_state = {n: ref_opt.state[p] for n, p in ref.named_parameters()}
    for name, state in saved["state"].items():
        assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].placements == (Shard(0),), name
        for key in ("exp_avg", "exp_avg_sq"):
            got, want = state[key].full_tensor(), ref_state[name][key]
            assert ((got - want).norm() / want.norm()).item() <= REL, (name, key)
    path = os.path.join(tmp, "fsdp-ckpt")
    dcp.save({"model": model.state_dict(), "optim": saved}, checkpoint_id=path)
    fresh, _ = make_pair(seed=5)
    opt2 = ForgeOptimizer(fresh, "adamw", seed=1, **HYPERS)
    target = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, opt2)}
    dcp.load(target, checkpoint_id=path)
    fresh.load_state_dict(target["model"])
    set_optimizer_state_dict(fresh, opt2, target["optim"])
    assert opt2.seed == 7
    for m, o in ((model, opt), (fresh, opt2)):
        loss_of(m, xs[2][rank]).backward()
        o.step()
        o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name


def check_two_dimensional_mesh_is_refused(rank, world, tmp):
    """HSDP (FSDP2 on a 2-D mesh): refused when the optimizer is built, naming fuse=False."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    fully_shard(model, mesh=mesh)
    try:
        ForgeOptimizer(model, "adamw")
        raise AssertionError("FSDP2 on a 2-D mesh was not refused")
    except ValueError as e:
        assert "2-dimensional mesh" in str(e) and "fuse=False" in str(e), e


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}


def run(rank: int, world: int, names: list, init: str, tmp: str, errors) -> None:
    """One rank: the process group, then each check (`rank_checks.run_on_rank`)."""
    rank_checks.run_on_rank(CHECKS, rank, world, names, init, tmp, errors)


if __name__ == "__main__":  # under torchrun
    rank_checks.main(CHECKS)
