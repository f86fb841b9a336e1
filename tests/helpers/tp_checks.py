"""Checks of ForgeOptimizer under tensor parallelism, run by tests/training/test_tensor_parallel.py in 2 CPU processes
(gloo, the Triton interpreter). Each check takes (rank, world, tmp) and compares what each rank holds with one
process's run of the same model, computed on every rank beside its shard (no collectives in that one).

    python -m torch.distributed.run --nproc-per-node 2 tests/helpers/tp_checks.py NAME [NAME ...]   # by hand, too
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import forge_dsl
from forge_dsl import ForgeOptimizer
from forge_dsl.kernels.layouts import dequantize, layout_of
import rank_checks

SPECS = ("adamw", "nadam", "radam", "rmsprop", "adagrad", "sgd", "sgd_momentum", "lion")
LAYOUTS = ("fp32", "bf16", "int8", "int4")
SPEC_HYPERS = {"sgd_momentum": dict(momentum=0.9)}
REL = 1e-5  # the bound for fp32 against one process


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 where both are 0)."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale else diff


def local_rows(full_t: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """The part of one process's `full_t` that the DTensor `shard` holds on this rank."""
    return DTensor.from_local(full_t, shard.device_mesh, [Replicate()], run_check=False).redistribute(
        shard.device_mesh, shard.placements).to_local()


def assert_matches(model, ref, what: str, rel: float = REL) -> None:
    """Every parameter's local shard within `rel` (max-norm relative) of one process's same part."""
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        mine = p.to_local() if isinstance(p, DTensor) else p
        want = local_rows(theirs[name].detach(), p) if isinstance(p, DTensor) else theirs[name].detach()
        err = rel_err(mine.detach(), want)
        assert err <= rel, f"{what}: {name} differs from one process by {err:.3g} (max-norm relative, bound {rel})"


# ----------------------------------------------------------------------------
# An MLP, column- then row-parallel: every spec, layout and weight dtype
# ----------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, dim=128, hidden=256, bias=True):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def mlp_pair(mesh, dtype, seed=0):
    torch.manual_seed(seed)
    ref = MLP().to(dtype)
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model, ref


def mlp_batches(steps, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 8, 128, generator=g).to(dtype), torch.randn(2, 8, 128, generator=g).to(dtype))
            for _ in range(steps)]


def mlp_train(model, opt, batches):
    """Loss linear in the output, so its gradient is the target, bit for bit on every rank: each shard's dW
    is then the same product one process computes for those rows or columns."""
    for x, target in batches:
        y = model(x)
        (full(y).float() * target.float()).sum().backward()
        opt.step()
        opt.zero_grad()


def check_every_spec_and_layout(rank, world, tmp):
    mesh = init_device_mesh("cpu", (world,))
    failures = []
    for spec in SPECS:
        for dtype in (torch.float32, torch.bfloat16):
            for layout in LAYOUTS:
                what = f"{spec} {str(dtype)[6:]} weights, {layout} state"
                model, ref = mlp_pair(mesh, dtype)
                kw = dict(spec=spec, state_dtype=layout, lr=1e-2, rounding="nearest", seed=3, **SPEC_HYPERS.get(spec, {}))
                opt = ForgeOptimizer(model, **kw)
                ref_opt = ForgeOptimizer(ref, **kw)
                batches = mlp_batches(2, dtype)
                mlp_train(model, opt, batches)
                mlp_train(ref, ref_opt, batches)
                described = opt.describe()
                try:
                    assert "fused in backward (2): up.weight, down.weight" in described, described
                    assert_matches(model, ref, what)
                    for name, p in model.named_parameters():  # the states too, decoded
                        q = dict(ref.named_parameters())[name]
                        for key, t in opt.state[p].items():
                            if key.endswith(".scale") or t.dim() == 0:
                                continue
                            want = ref_opt.state[q][key]
                            mine = _decoded(t, opt.state[p].get(f"{key}.scale"), p.to_local().shape)
                            want = _decoded(want, ref_opt.state[q].get(f"{key}.scale"), q.shape)
                            err = rel_err(mine, local_rows(want, p))
                            assert err <= REL, f"{what}: state {key} of {name} differs by {err:.3g}"
                except AssertionError as e:
                    failures.append(str(e))
    assert not failures, "\n".join(failures)


def _decoded(t, scale, shape):
    layout = layout_of(t, shape, scale=scale)
    if scale is None:
        return t.float()
    return dequantize(t.reshape(-1, t.shape[-1]), scale, layout).reshape(shape)


def check_stochastic_rounding(rank, world, tmp):
    """bf16 weights with stochastic rounding: each shard draws its own bits, so after a step a shard is one bf16
    rounding from one process's weights (the same update, rounded the other way where the bits differ), and the
    ranks' shards round differently."""
    mesh = init_device_mesh("cpu", (world,))
    model, ref = mlp_pair(mesh, torch.bfloat16)
    opt = ForgeOptimizer(model, "adamw", lr=1e-2, seed=3)
    ref_opt = ForgeOptimizer(ref, "adamw", lr=1e-2, seed=3)
    batches = mlp_batches(1, torch.bfloat16)
    mlp_train(model, opt, batches)
    mlp_train(ref, ref_opt, batches)
    theirs = dict(ref.named_parameters())
    differ = 0
    for name, p in model.named_parameters():
        mine = p.to_local().float()
        want = local_rows(theirs[name].detach(), p).float()
        ulp = 2.0 ** (torch.frexp(torch.maximum(mine.abs(), want.abs()))[1].float() - 8)  # one bf16 ulp
        assert ((mine - want).abs() <= ulp).all(), name
        differ += int((mine != want).sum())
    assert differ > 0  # the bits are not one process's
    # a replicated parameter stays one value on every rank: step() launches it apart from the shards beside it
    # (up.bias, sharded, and down.bias, replicated, share a launch key), with the replicas' common bits
    bias = model.down.bias.to_local().contiguous()
    replicas = [torch.empty_like(bias) for _ in range(world)]
    dist.all_gather(replicas, bias)
    assert torch.equal(replicas[0], replicas[1])
    # ranks draw different bits: the same update applied to the same values rounds differently somewhere
    probe = nn.Linear(128, 256, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        probe.weight.copy_(torch.full_like(probe.weight, 0.3))  # every rank's shard equal before the step
    probe = parallelize_module(probe, mesh, ColwiseParallel())
    probe_opt = ForgeOptimizer(probe, "sgd", lr=1e-3, seed=3)
    full(probe(torch.ones(4, 128, dtype=torch.bfloat16))).sum().backward()
    probe_opt.step()
    shards = [torch.empty_like(probe.weight.to_local()) for _ in range(world)]
    dist.all_gather(shards, probe.weight.to_local().contiguous())
    assert not torch.equal(shards[0], shards[1])


# ----------------------------------------------------------------------------
# A tiny Llama (torchtitan's model) with torchtitan's tensor-parallel plan
# ----------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, rope):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)  # local heads under tensor parallelism
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = _rotate(q, rope), _rotate(k, rope)
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def _rotate(x, rope):
    cos, sin = rope  # [S, head_dim / 2]
    a, b = x[..., ::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab=128, dim=128, layers=2, heads=4, kv_heads=2, hidden=256, seq=8):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, kv_heads, hidden) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), 10000.0 ** (-torch.arange(half) / half))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers.values():
            h = layer(h, (self.cos, self.sin))
        return self.output(self.norm(h))


def torchtitan_plan(model, mesh):
    """torchtitan's `apply_tp` for Llama (sequence parallel, no loss parallel)."""
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model


def llama_pair(mesh, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    ref = Llama().to(dtype)
    return torchtitan_plan(copy.deepcopy(ref), mesh), ref


def llama_batches(steps, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100, (2, 8), generator=g) for _ in range(steps)]  # rows 100..127 get no tokens


def llama_train(model, opt, batches):
    losses = []
    for ids in batches:
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def check_llama_torchtitan_plan(rank, world, tmp):
    """Three steps of the tiny Llama under torchtitan's plan against one process. SGD with momentum (linear in
    the gradient) keeps the weights within 1e-7 of one process's: the ranks' sums (ΔX all-reduced, the norms'
    gradients) differ from one process's only in fp32 rounding. AdamW with int8 state: the losses agree as
    closely (Adam's first steps move each weight by about ±lr whatever its gradient's size, so a weight whose
    gradient is near 0 may move either way in two runs: weights are compared by the SGD run)."""
    mesh = init_device_mesh("cpu", (world,))
    for spec, layout, hypers in (("sgd_momentum", "fp32", dict(momentum=0.9, weight_decay=0.1)),
                                 ("adamw", "int8", dict(weight_decay=0.1))):
        model, ref = llama_pair(mesh)
        opt = ForgeOptimizer(model, spec, state_dtype=layout, lr=1e-2, **hypers)
        ref_opt = ForgeOptimizer(ref, spec, state_dtype=layout, lr=1e-2, **hypers)
        batches = llama_batches(3)
        losses, ref_losses = llama_train(model, opt, batches), llama_train(ref, ref_opt, batches)
        assert all(abs(a - b) <= REL * abs(b) for a, b in zip(losses, ref_losses)), (spec, losses, ref_losses)
        described = opt.describe()
        # every Linear and the embedding fused on its shard; the norms stepped from their all-reduced gradients
        assert "fused in backward (16)" in described and "tok_embeddings.weight" in described, described
        assert "stepped from .grad in step() (5)" in described, described
        if spec == "sgd_momentum":
            assert_matches(model, ref, f"llama, {spec}")


def check_hf_llama_bench_plan(rank, world, tmp):
    """A Hugging Face LlamaForCausalLM under `forge-bench model --tp`'s plan (`bench.parallel.llama_tp_plan`), with
    transformers' loss and activation checkpointing, against one process: SGD with momentum, three steps."""
    import transformers

    from forge_dsl.bench.model import enable_checkpointing
    from forge_dsl.bench.parallel import llama_tp_plan

    mesh = init_device_mesh("cpu", (world,))
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).train()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, llama_tp_plan(model))
    for m in (model, ref):
        enable_checkpointing(m)
    hypers = dict(lr=1e-2, momentum=0.9, weight_decay=0.1)
    opt, ref_opt = ForgeOptimizer(model, "sgd_momentum", **hypers), ForgeOptimizer(ref, "sgd_momentum", **hypers)
    for ids in llama_batches(3):
        losses = []
        for m, o in ((model, opt), (ref, ref_opt)):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= REL * abs(losses[1]), losses
    assert "fused in backward (16)" in opt.describe(), opt.describe()  # 14 Linears, the embedding, the head
    assert_matches(model, ref, "HF Llama, the bench's plan")


# ----------------------------------------------------------------------------
# Checkpoints through torch.distributed.checkpoint
# ----------------------------------------------------------------------------


def check_dcp_round_trip(rank, world, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    mesh = init_device_mesh("cpu", (world,))
    for layout in ("int8", "int4", {"exp_avg": "int4", "exp_avg_sq": "bf16"}):
        path = os.path.join(tmp, f"ckpt-{layout if isinstance(layout, str) else 'mixed'}")
        model, _ = mlp_pair(mesh, torch.bfloat16)
        opt = ForgeOptimizer(model, "adamw", state_dtype=layout, lr=1e-2, seed=7)
        batches = mlp_batches(3, torch.bfloat16)
        mlp_train(model, opt, batches[:2])
        saved = get_optimizer_state_dict(model, opt)
        exp_avg = saved["state"]["up.weight"]["exp_avg"]
        assert isinstance(exp_avg, DTensor) and exp_avg.placements == (Shard(0),), type(exp_avg)
        dcp.save({"model": model.state_dict(), "optim": saved}, checkpoint_id=path)

        fresh, _ = mlp_pair(mesh, torch.bfloat16, seed=5)
        opt2 = ForgeOptimizer(fresh, "adamw", state_dtype="fp32" if layout == "int8" else layout, lr=1e-2, seed=1)
        if layout == "int8":  # an fp32 optimizer refuses int codes (dcp.load cast them); rebuilt as the saver was
            target = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, opt2)}
            dcp.load(target, checkpoint_id=path)
            try:
                set_optimizer_state_dict(fresh, opt2, target["optim"])
                raise AssertionError("an fp32 optimizer took int codes")
            except ValueError as e:
                assert "Construct the optimizer with state_dtype=" in str(e), e
            fresh, _ = mlp_pair(mesh, torch.bfloat16, seed=5)
            opt2 = ForgeOptimizer(fresh, "adamw", state_dtype=layout, lr=1e-2, seed=1)
        target = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, opt2)}
        dcp.load(target, checkpoint_id=path)
        fresh.load_state_dict(target["model"])
        set_optimizer_state_dict(fresh, opt2, target["optim"])
        assert opt2.seed == 7 and opt2.state_dtype == layout
        for p, q in zip(model.parameters(), fresh.parameters()):
            for key, t in opt.state[p].items():
                assert torch.equal(t, opt2.state[q][key]), key
        mlp_train(model, opt, batches[2:])
        mlp_train(fresh, opt2, batches[2:])
        for p, q in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(p.to_local(), q.to_local())


def check_one_process_state_into_shards(rank, world, tmp):
    """A state dict saved by one process (plain tensors) loads into the sharded optimizer, each rank taking its
    part, and the run goes on as one process's does."""
    mesh = init_device_mesh("cpu", (world,))
    model, ref = mlp_pair(mesh, torch.float32)
    ref_opt = ForgeOptimizer(ref, "adamw", state_dtype="int8", lr=1e-2)
    batches = mlp_batches(3, torch.float32)
    mlp_train(ref, ref_opt, batches[:2])
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        with torch.no_grad():
            p.to_local().copy_(local_rows(q.detach(), p))
    opt = ForgeOptimizer(model, "adamw", state_dtype="int8", lr=1e-2)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    mlp_train(model, opt, batches[2:])
    mlp_train(ref, ref_opt, batches[2:])
    assert_matches(model, ref, "one process's state loaded into shards")


# ----------------------------------------------------------------------------
# What is refused, and what is not fused
# ----------------------------------------------------------------------------


def _raises(fn, *words):
    try:
        fn()
    except ValueError as e:
        for w in words:
            assert w in str(e), (w, str(e))
        return
    raise AssertionError(f"no ValueError mentioning {words}")


def check_refusals(rank, world, tmp):
    mesh = init_device_mesh("cpu", (world,))
    # a last-dim shard that splits an int8 block: refused at construction, before anything changes
    torch.manual_seed(0)
    model = parallelize_module(MLP(dim=96, hidden=192, bias=False), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    before = model.down.weight.to_local().clone()
    _raises(lambda: ForgeOptimizer(model, "adamw", state_dtype="int8"), "'down.weight'", "splits a block of 64",
            "state_dtype 'bf16' or 'fp32'")
    assert "forward" not in model.down.__dict__ and torch.equal(model.down.weight.to_local(), before)
    ForgeOptimizer(model, "adamw", state_dtype="bf16").detach()  # fine with unquantized state
    # a mesh with a data-parallel dimension
    mesh2 = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    m2 = MLP()
    m2.up.weight = nn.Parameter(DTensor.from_local(m2.up.weight.detach(), mesh2, [Replicate(), Shard(0)],
                                                   run_check=False))
    _raises(lambda: ForgeOptimizer(m2, "adamw"), "'up.weight'", "2-dimensional device mesh", "fuse=False")
    # DistributedDataParallel and FSDP
    ddp = nn.parallel.DistributedDataParallel(MLP())
    _raises(lambda: ForgeOptimizer(ddp, "adamw"), "DistributedDataParallel", "fuse=False")
    from torch.distributed.fsdp import fully_shard

    sharded = MLP()
    fully_shard(sharded.up, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    # FSDP2 passed as the model: each shard updated in backward (tests/helpers/fsdp_checks.py); parameters first
    # (forge_dsl.fuse), refused with what to do
    opt = ForgeOptimizer(sharded, "adamw")
    assert "FSDP2 shards updated in backward" in opt.describe(), opt.describe()
    opt.detach()
    _raises(lambda: forge_dsl.fuse(sharded), "FSDP", "partial gradient", "ForgeOptimizer(model, ...)", "fuse=False")


def check_fsdp_unfused_steps_exactly(rank, world, tmp):
    """fuse=False under FSDP2: every parameter stepped in step() from its reduce-scattered gradient shard, as one
    process steps it from the whole gradient (each rank feeds the half of the batch it owns)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = ForgeOptimizer(model, "adamw", fuse=False, state_dtype="int8", lr=1e-2)
    ref_opt = ForgeOptimizer(ref, "adamw", fuse=False, state_dtype="int8", lr=1e-2)
    for x, target in mlp_batches(2, torch.float32):
        n = x.shape[1] // world
        (model(x[:, rank * n:(rank + 1) * n]) * target[:, rank * n:(rank + 1) * n]).sum().mul(world).backward()
        (ref(x) * target).sum().backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    # FSDP averages the ranks' gradients (hence the loss times world); int8 codes may flip at a threshold
    assert_matches(model, ref, "FSDP with fuse=False", 1e-3)


def check_sequence_sharded_input_is_stepped_unfused(rank, world, tmp):
    """A Linear with a replicated weight fed sequence-sharded activations: each rank's dW is a partial sum, so it
    runs DTensor's linear and is stepped from its all-reduced gradient; describe() says why."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(128, 128, bias=False))
    model = copy.deepcopy(ref)
    model[0].weight = nn.Parameter(DTensor.from_local(model[0].weight.detach(), mesh, [Replicate()],
                                                      run_check=False))
    opt = ForgeOptimizer(model, "adamw", lr=1e-2)
    ref_opt = ForgeOptimizer(ref, "adamw", lr=1e-2)
    for x, target in mlp_batches(2, torch.float32):
        x, target = x.flatten(0, 1), target.flatten(0, 1)  # [tokens, features]: torch 2.10's DTensor linear
        xs = DTensor.from_local(x.chunk(world)[rank].contiguous(), mesh, [Shard(0)], run_check=False)  # cannot
        (full(model(xs)) * target).sum().backward()  # flatten a 3-D input sharded on its sequence dim
        (ref(x) * target).sum().backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert "partial sum" in opt.describe() and "fused in backward (0)" in opt.describe(), opt.describe()
    assert_matches(model, ref, "sequence-sharded input")


class Shared(nn.Module):
    """An embedding and a Linear called twice in one forward: stepped unfused, from their summed .grad."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 128)
        self.up = nn.Linear(128, 256)
        self.down = nn.Linear(256, 128)

    def forward(self, ids):
        a, b = self.emb(ids), self.emb((ids * 7) % 128)
        return self.down(torch.relu(self.up(a)) + torch.relu(self.up(b)))


def check_layers_called_twice_step_unfused(rank, world, tmp):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = Shared()
    model = parallelize_module(copy.deepcopy(ref), mesh, {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = ForgeOptimizer(model, "adamw", lr=1e-2)
    ref_opt = ForgeOptimizer(ref, "adamw", lr=1e-2)
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        ids, target = torch.randint(0, 128, (2, 8), generator=g), torch.randn(2, 8, 128, generator=g)
        (full(model(ids)) * target).sum().backward()
        (ref(ids) * target).sum().backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    described = opt.describe()
    assert "used several times in the last step (2): emb.weight, up.weight" in described, described
    assert "fused in backward (1): down.weight" in described, described
    assert_matches(model, ref, "layers called twice")


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}


def run(rank: int, world: int, names: list, init: str, tmp: str, errors) -> None:
    """One rank: the process group, then each check (`rank_checks.run_on_rank`)."""
    rank_checks.run_on_rank(CHECKS, rank, world, names, init, tmp, errors)


if __name__ == "__main__":  # under torchrun
    rank_checks.main(CHECKS)
