"""`ForgeOptimizer` under `torch.compile`: the fused Linear is a pair of torch custom ops
(forge_dsl/training/linear.py), so a compiled model has no graph break from FORGE, `fullgraph=True` works, and
the numbers are eager's.

With backend="aot_eager" (the graphs compiled, the kernels eager's) a compiled step must equal the eager
step bit for bit; with inductor (its own kernels for everything but FORGE's) the compiled FORGE run must
match compiled torch.optim.AdamW as eager FORGE matches eager torch (tests/training/test_optimizer.py's tolerance).
"""

from __future__ import annotations

import pytest
import torch

from forge_dsl import ForgeOptimizer
from training_models import (DEVICE, HYPERS, MLP, assert_params_close, make_llama, make_mlp, mlp_batches, mlp_loss,
                        twin)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _llama_batches(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=gen).to(DEVICE) for _ in range(n)]


def _llama_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _train(model, opt, batches, loss_fn):
    for batch in batches:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("which", ["mlp", "llama"])
def test_no_graph_break_from_forge(which):
    """One graph, no break, for the model's forward and loss with its Linear layers fused."""
    model = make_mlp() if which == "mlp" else make_llama()
    opt = ForgeOptimizer(model, "adamw")
    assert opt._handles
    if which == "mlp":
        explained = torch._dynamo.explain(model)(mlp_batches(1)[0][0])
    else:
        ids = _llama_batches(1)[0]
        explained = torch._dynamo.explain(lambda: model(input_ids=ids, labels=ids).loss)()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("which", ["mlp", pytest.param("llama", marks=pytest.mark.slow)])  # the Llama's: about 5 s
def test_fullgraph_compiled_steps_equal_eager_steps(which):
    make, batches, loss_fn = ((make_mlp, mlp_batches(3), mlp_loss) if which == "mlp" else
                              (make_llama, _llama_batches(3), _llama_loss))
    eager = make()
    compiled = twin(eager, make)
    opt_eager = ForgeOptimizer(eager, "adamw", **HYPERS["adamw"])
    opt_compiled = ForgeOptimizer(compiled, "adamw", **HYPERS["adamw"])
    runner = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    _train(eager, opt_eager, batches, loss_fn)
    _train(runner, opt_compiled, batches, loss_fn)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(p, q), name
    assert {int(s["step"]) for s in opt_compiled.state.values()} == {3}
    assert len(opt_compiled._handles) == len(opt_eager._handles) > 0


def test_inductor_forge_matches_inductor_torch_adamw():
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    opt = ForgeOptimizer(ours, "adamw", **HYPERS["adamw"])
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    batches = mlp_batches(3)
    _train(torch.compile(ours, fullgraph=True), opt, batches, mlp_loss)
    _train(torch.compile(theirs, fullgraph=True), ref, batches, mlp_loss)
    assert_params_close(ours, theirs)


class Shared(MLP):
    """`mid` called twice per forward: stepped unfused (its dW summed into .grad), as in eager."""

    def forward(self, x):
        h = torch.tanh(self.up(x))
        return self.down(self.norm(self.mid(torch.tanh(self.mid(h)))))


def test_a_shared_layer_under_compile_is_stepped_from_its_summed_gradient():
    make = lambda seed=0: make_mlp(seed, cls=Shared)  # noqa: E731
    ours = make()
    theirs = twin(ours, make)
    opt = ForgeOptimizer(ours, "adamw", **HYPERS["adamw"])
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    batches = mlp_batches(3)
    _train(torch.compile(ours, backend="aot_eager", fullgraph=True), opt, batches, mlp_loss)
    _train(theirs, ref, batches, mlp_loss)
    assert_params_close(ours, theirs)
    assert "unfused, used several times in the last step (1): mid.weight" in opt.describe()


def test_refusals_hold_in_compiled_graphs():
    """Gradient accumulation (a forward with gradients after backward, before step) is refused in a compiled
    graph as in eager, before anything more changes; clipping too."""
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw")
    runner = torch.compile(model, backend="aot_eager", fullgraph=True)
    batches = mlp_batches(2)
    mlp_loss(runner, batches[0]).backward()
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        mlp_loss(runner, batches[1])
    with pytest.raises(RuntimeError, match="max_grad_norm=0"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    mlp_loss(runner, batches[1]).backward()  # the next step goes on
    opt.step()
    assert {int(s["step"]) for s in opt.state.values()} == {2}


def test_the_host_ops_are_never_captured_by_cuda_graphs():
    """mode="reduce-overhead" must not freeze the per-step host work (the step's scalars, the launch) into a
    CUDA graph: both ops carry the tag inductor keeps outside its graphs."""
    for op in (torch.ops.forge_dsl.linear.default, torch.ops.forge_dsl.linear_backward.default):
        assert torch.Tag.cudagraph_unsafe in op.tags
    # the backward op is effectful: inductor sees its `with_effects` wrapper, not the tag, and partitions on the
    # names it was given (without them mode="reduce-overhead" recorded the update: tests/training/test_cuda_graphs.py)
    from torch._inductor import config as inductor_config

    assert {"forge_dsl::linear", "forge_dsl::linear_backward"} <= set(inductor_config.custom_should_partition_ops)


@pytest.mark.parametrize("k, max_norm", [(1, 0.05), (2, 0.05), (2, None)], ids=["clip", "accumulate-clip", "accumulate"])
def test_clipping_and_accumulation_compiled(k, max_norm):
    """optimizer.backward's two passes and accumulation's backwards through a compiled model (aot_eager: the
    graphs compiled, the kernels eager's) against eager torch's clip_grad_norm_ and .grad accumulation."""
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    opt = ForgeOptimizer(ours, "adamw", max_grad_norm=max_norm, accumulation_steps=k, **HYPERS["adamw"])
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    batches = mlp_batches(2 * k)
    for i in range(0, len(batches), k):
        for x, y in batches[i:i + k]:
            opt.backward((compiled(x) - y).pow(2).mean() / k)
            ((theirs(x) - y).pow(2).mean() / k).backward()
        if max_norm is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
        opt.step()
        ref.step()
        if max_norm is not None:
            assert opt.last_grad_norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
        opt.zero_grad()
        ref.zero_grad()
    assert_params_close(ours, theirs)
