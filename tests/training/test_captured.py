"""The whole step in one CUDA graph (issue K item 4): `ForgeOptimizer(capturable=True)` and `CapturedStep`.

On any device: a capturable optimizer's eager steps (the fused launches reading the host table, staged once a step
for all layers) write the bits of a plain optimizer's, a learning-rate change between steps included; what
capturable=True cannot hold is refused when the optimizer is built; CapturedStep refuses bad arguments. On the GPU:
steps recorded and replayed by CapturedStep equal eager steps bit for bit, with nearest and stochastic rounding,
bf16 and int8 state, and a learning rate changed between replays.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from forge_dsl import CapturedStep, ForgeOptimizer
from forge_dsl.kernels import host_table
from forge_dsl.training import stepper as stepper_module
from training_models import DEVICE

gpu = pytest.mark.gpu
WIDTH = 64


class Net(nn.Module):
    """Two fused Linears (one with a bias) and a LayerNorm: parameters fused and stepped from .grad both."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def _net(seed=0):
    torch.manual_seed(seed)
    return Net().to(device=DEVICE, dtype=torch.bfloat16)


def _batches(n, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 16, WIDTH, generator=gen).to(DEVICE, torch.bfloat16),
             torch.randn(2, 16, WIDTH, generator=gen).to(DEVICE)) for _ in range(n)]


def _loss(model, x, probe):
    return (model(x).float() * probe).sum()


def _bits(t):
    return t.reshape(-1).view(torch.uint8) if t.dtype.is_floating_point else t


def _assert_same(model_a, opt_a, model_b, opt_b):
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(_bits(p.detach()), _bits(q.detach())), name
        a, b = opt_a.state[p], opt_b.state[q]
        assert a.keys() == b.keys(), name
        for k in a:
            assert torch.equal(_bits(a[k]), _bits(b[k])), f"{name}: {k}"


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_capturable_eager_steps_write_the_bits_of_plain_steps(rounding, state_dtype):
    plain, capt = _net(), _net()
    kw = dict(lr=1e-2, weight_decay=0.1, rounding=rounding, state_dtype=state_dtype)
    opt_plain, opt_capt = ForgeOptimizer(plain, "adamw", **kw), ForgeOptimizer(capt, "adamw", capturable=True, **kw)
    assert set(opt_capt._stepper.table_slots) == {capt.up.weight, capt.down.weight}
    for i, (x, probe) in enumerate(_batches(3)):
        for model, opt in ((plain, opt_plain), (capt, opt_capt)):
            opt.param_groups[0]["lr"] = 1e-2 / (i + 1)  # a schedule: read at each step's staging
            _loss(model, x, probe).backward()
            opt.step()
            opt.zero_grad()
    _assert_same(plain, opt_plain, capt, opt_capt)
    assert {int(s["step"]) for s in opt_capt.state.values()} == {3}


def test_the_host_table_is_staged_once_a_step_for_all_layers(monkeypatch):
    model = _net()
    opt = ForgeOptimizer(model, "adamw", lr=1e-2, capturable=True)
    uploads, staged = [], []
    upload, stage = host_table.HostTable.upload, host_table.HostTable.stage
    monkeypatch.setattr(host_table.HostTable, "upload", lambda self: (uploads.append(1), upload(self))[1])
    monkeypatch.setattr(host_table.HostTable, "stage", lambda self, *a: (staged.append(a[0]), stage(self, *a))[1])
    for x, probe in _batches(2):
        _loss(model, x, probe).backward()
        opt.step()
        opt.zero_grad()
    assert len(uploads) == 2 and sorted(staged) == [0, 0, 1, 1]


def test_an_embedding_is_stepped_from_its_gradient_under_capturable():
    model = nn.Sequential(nn.Embedding(32, WIDTH), nn.Linear(WIDTH, WIDTH)).to(DEVICE, torch.bfloat16)
    opt = ForgeOptimizer(model, "adamw", lr=1e-2, capturable=True)
    assert set(opt._handles) == {model[1].weight}
    assert "capturable=True" in opt.describe()
    before = model[0].weight.detach().clone()
    model(torch.arange(8, device=DEVICE)).float().square().sum().backward()
    assert model[0].weight.grad is not None  # from autograd, stepped in step()
    opt.step()
    assert not torch.equal(before, model[0].weight)


@pytest.mark.parametrize("options, match", [
    (dict(max_grad_norm=1.0), "max_grad_norm"),
    (dict(accumulation_steps=2), "accumulation_steps"),
    (dict(linear_path="slab"), "slab"),
])
def test_what_capturable_cannot_hold_is_refused_when_the_optimizer_is_built(options, match):
    model = _net()
    with pytest.raises(ValueError, match=f"capturable=True cannot hold here: .*{match}"):
        ForgeOptimizer(model, "adamw", capturable=True, **options)
    assert all(type(m).forward is m.forward.__func__ for m in model.modules() if hasattr(m.forward, "__func__"))


@pytest.mark.parametrize("spec, match", [("nadam", "scalar state"), ("lamb", "phases")])
def test_specs_capturable_cannot_hold_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        ForgeOptimizer(_net(), spec, capturable=True)


def test_capturable_must_be_a_bool():
    with pytest.raises(TypeError, match="capturable must be a bool"):
        ForgeOptimizer(_net(), "adamw", capturable=1)


def test_captured_step_refuses_bad_arguments():
    model = _net()
    plain = ForgeOptimizer(model, "adamw")
    with pytest.raises(TypeError, match="optimizer must be a forge_dsl.ForgeOptimizer"):
        CapturedStep(torch.optim.SGD(model.parameters(), lr=1.0), lambda: None)
    with pytest.raises(ValueError, match="capturable=True"):
        CapturedStep(plain, lambda: None)
    plain.detach()
    opt = ForgeOptimizer(model, "adamw", capturable=True)
    with pytest.raises(TypeError, match="fn must be callable"):
        CapturedStep(opt, None)
    with pytest.raises(TypeError, match="warmup_steps must be an int"):
        CapturedStep(opt, lambda: None, warmup_steps=1.0)
    with pytest.raises(ValueError, match="warmup_steps must be at least 1"):
        CapturedStep(opt, lambda: None, warmup_steps=0)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="CUDA device"):
            CapturedStep(opt, lambda: None)


def test_a_capture_outside_captured_step_is_refused(monkeypatch):
    """A capturable optimizer's update recorded by the user's own torch.cuda.graph would replay the values staged
    once: refused before anything runs, naming CapturedStep."""
    model = _net()
    opt = ForgeOptimizer(model, "adamw", capturable=True)
    monkeypatch.setattr(stepper_module, "capturing", lambda t: True)
    weights = [p.detach().clone() for p in model.parameters()]
    (x, probe), = _batches(1)
    with pytest.raises(RuntimeError, match="CapturedStep"):
        _loss(model, x, probe).backward()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


@gpu
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_captured_steps_equal_eager_steps(rounding, state_dtype):
    eager, graphed = _net(), _net()
    kw = dict(lr=1e-2, weight_decay=0.1, rounding=rounding, state_dtype=state_dtype)
    opt_eager, opt_graphed = ForgeOptimizer(eager, "adamw", **kw), ForgeOptimizer(graphed, "adamw", capturable=True,
                                                                                 **kw)
    batches = _batches(6)
    x, probe = (t.clone() for t in batches[0])

    def forward_backward():
        loss = _loss(graphed, x, probe)
        loss.backward()
        return loss

    step = CapturedStep(opt_graphed, forward_backward, warmup_steps=1)
    for i, (bx, bprobe) in enumerate(batches):  # a warm-up step, the recorded one, then 4 replays
        lr = 1e-2 / (i + 1)
        opt_eager.param_groups[0]["lr"] = opt_graphed.param_groups[0]["lr"] = lr
        expected = _loss(eager, bx, bprobe)
        expected.backward()
        opt_eager.step()
        opt_eager.zero_grad()
        x.copy_(bx)
        probe.copy_(bprobe)
        loss = step()
        torch.cuda.synchronize()
        assert torch.equal(loss, expected), f"step {i + 1}"
        _assert_same(eager, opt_eager, graphed, opt_graphed)
    assert step.graph is not None and step.calls == 6
    assert {int(s["step"]) for s in opt_graphed.state.values()} == {6}


def _captured(seed=0, **kw):
    model = _net(seed)
    opt = ForgeOptimizer(model, "adamw", lr=1e-2, capturable=True, **kw)
    x, probe = (t.clone() for t in _batches(1)[0])
    fail = [False]

    def forward_backward():
        loss = _loss(model, x, probe)
        loss.backward()
        if fail[0]:
            raise RuntimeError("the step's own error")
        return loss

    return model, opt, CapturedStep(opt, forward_backward, warmup_steps=1), fail


@gpu
def test_a_recording_that_fails_leaves_the_step_counters_and_weights_as_they_were():
    model, opt, step, fail = _captured()
    step()  # the warm-up
    torch.cuda.synchronize()
    weights = [p.detach().clone() for p in model.parameters()]
    counters = {p: int(s["step"]) for p, s in opt.state.items()}
    fail[0] = True
    with pytest.raises(RuntimeError, match="the step's own error"):
        step()
    torch.cuda.synchronize()
    assert step.graph is None
    assert {p: int(s["step"]) for p, s in opt.state.items()} == counters
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    fail[0] = False
    step()  # records now, and steps every parameter once
    assert {int(s["step"]) for s in opt.state.values()} == {2}


@gpu
def test_a_replay_the_graph_no_longer_fits_is_refused_before_anything_runs():
    model, opt, step, _ = _captured()
    step()
    step()  # recorded
    torch.cuda.synchronize()
    weights = [p.detach().clone() for p in model.parameters()]
    opt.rounding = "nearest"  # the recorded kernels round stochastically
    with pytest.raises(ValueError, match="build a new CapturedStep"):
        step()
    torch.cuda.synchronize()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert {int(s["step"]) for s in opt.state.values()} == {2}
