"""FORGE and CUDA graphs (issue K item 4).

* `torch.compile(model, mode="reduce-overhead")`: inductor's CUDA graphs leave FORGE's ops out (they run host code
  every step) and run them between graphs; the fused weights' state is allocated when the optimizer is built
  (`ParamStepper.prepare_state`), never from the graphs' memory pool (it was, lazily, in the first compiled
  backward, and the first replay failed). On the GPU, steps so trained equal eager steps bit for bit, with nearest
  and with stochastic rounding.
* A capture of an update itself (`torch.cuda.graph`, `make_graphed_callables`) is refused before anything runs:
  every replay would repeat the captured step's host values (step counter, bias corrections, seed).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from forge_dsl import ForgeOptimizer
from forge_dsl.training import stepper as stepper_module
from training_models import DEVICE, make_mlp, mlp_batches, mlp_loss

gpu = pytest.mark.gpu


class Stack(nn.Module):
    """bf16 Linear layers with ReLU between, inputs [B, S, 128]: the compiled forward and backward compute
    exactly what eager does (cuBLAS products, ReLU), so any difference is FORGE's."""

    def __init__(self, width=128, depth=3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=i % 2 == 0) for i in range(depth))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


def _stack(seed=0):
    torch.manual_seed(seed)
    return Stack().to(device=DEVICE, dtype=torch.bfloat16)


def _batches(n, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 32, 128, generator=gen).to(DEVICE, torch.bfloat16),
             torch.randn(4, 32, 128, generator=gen).to(DEVICE)) for _ in range(n)]


def _loss(model, batch):
    """A loss whose gradient at the output is exactly the probe (rounded to bf16): no reduction order in it."""
    x, probe = batch
    return (model(x).float() * probe).sum()


def _states(opt):
    return [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]


@gpu
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_reduce_overhead_steps_equal_eager_steps(rounding, state_dtype):
    torch._dynamo.reset()
    eager, graphed = _stack(), _stack()
    graphed.load_state_dict(eager.state_dict())
    kw = dict(lr=1e-3, weight_decay=0.1, rounding=rounding, state_dtype=state_dtype)
    opt_eager, opt_graphed = ForgeOptimizer(eager, "adamw", **kw), ForgeOptimizer(graphed, "adamw", **kw)
    runner = torch.compile(graphed, mode="reduce-overhead")
    for batch in _batches(6):  # warm-up, recording, then replays
        for model, opt in ((eager, opt_eager), (runner, opt_graphed)):
            _loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(p, q), name
    for a, b in zip(_states(opt_eager), _states(opt_graphed)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {int(s["step"]) for s in opt_graphed.state.values()} == {6}
    torch._dynamo.reset()


@gpu
def test_capturing_an_update_into_a_cuda_graph_is_refused_before_any_weight_changes():
    model = _stack()
    opt = ForgeOptimizer(model, "adamw", lr=1e-3)
    (batch,) = _batches(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's recipe for capture asks
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    weights = [p.detach().clone() for p in model.parameters()]
    states = _states(opt)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="captured into a CUDA graph"):
        with torch.cuda.graph(graph):
            _loss(model, batch).backward()
    torch.cuda.synchronize()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    for a, b in zip(states, _states(opt)):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_update_being_captured_is_refused_with_what_to_do(monkeypatch):
    """The refusal's path on any device: `capturing` says yes, the first fused update raises before it runs."""
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw")
    weights = [p.detach().clone() for p in model.parameters()]
    monkeypatch.setattr(stepper_module, "capturing", lambda t: True)
    with pytest.raises(RuntimeError, match=r"reduce-overhead") as err:
        mlp_loss(model, mlp_batches(1)[0]).backward()
    assert "parameter 'mid.weight'" in str(err.value) or "parameter '" in str(err.value)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(int(s["step"]) == 0 for s in opt.state.values() if "step" in s)


def test_fused_weights_state_is_allocated_at_construction_and_taken_by_the_first_update():
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw", state_dtype="bf16")
    prepared = dict(opt._stepper._prepared)
    assert set(prepared) == set(opt._handles) and len(prepared) > 0
    assert not opt.state  # torch's convention: no state before the first step
    addresses = {p: {k: t.data_ptr() for k, t in made.items()} for p, (_, made) in prepared.items()}
    mlp_loss(model, mlp_batches(1)[0]).backward()
    opt.step()
    for p, ptrs in addresses.items():
        assert {k: opt.state[p][k].data_ptr() for k in ptrs} == ptrs
    assert not opt._stepper._prepared


def test_a_prepared_state_is_made_again_where_its_layout_or_keywords_changed_before_the_first_step():
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw", state_dtype="fp32")
    opt.state_dtype = "bf16"
    opt.param_groups[0]["amsgrad"] = True
    mlp_loss(model, mlp_batches(1)[0]).backward()
    opt.step()
    for p in opt._handles:
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        assert "max_exp_avg_sq" in opt.state[p]
    # the same run without the changes before the first step: the prepared state is what the update made
    fresh = make_mlp()
    opt_fresh = ForgeOptimizer(fresh, "adamw", state_dtype="bf16", amsgrad=True)
    mlp_loss(fresh, mlp_batches(1)[0]).backward()
    opt_fresh.step()
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name


def test_no_state_is_prepared_for_a_spec_whose_state_starts_from_the_weight(tmp_path):
    path = tmp_path / "anchor.fopt"
    path.write_text("optimizer anchor\nhyper lr = 1e-2 in [0, inf)\nstate z = param\nupdate {\n"
                    "    z = z - lr * grad\n    param = 0.5 * param + 0.5 * z\n}\n")
    model = make_mlp()
    opt = ForgeOptimizer(model, str(path))
    assert opt._handles and not opt._stepper._prepared


def test_a_loaded_state_dict_drops_the_prepared_state():
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw")
    mlp_loss(model, mlp_batches(1)[0]).backward()
    opt.step()
    sd = opt.state_dict()
    other = ForgeOptimizer(make_mlp(), "adamw")
    assert other._stepper._prepared
    other.load_state_dict(sd)
    assert not other._stepper._prepared
