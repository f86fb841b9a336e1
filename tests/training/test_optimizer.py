"""`ForgeOptimizer` on whole models, against the same model trained with torch.optim.

Every comparison trains two copies of one model (same initial weights through
`load_state_dict`, same batches): one with `ForgeOptimizer` (linear weights
updated inside backward by the tile-fused kernel, the rest in `step()`), one
with the torch.optim counterpart.  With fp32 weights and state only the order
of fp32 sums differs, so every parameter must agree to a relative error
‖a − b‖ / ‖b‖ ≤ 1e-5 after a few steps, without re-synchronising; each
comparison also checks that the fused weights moved by far more than that, so
a skipped update cannot pass.

On a CPU-only machine the kernels run in the Triton interpreter (conftest.py),
so the models are tiny (hidden 64, at most 2 × 16 tokens).  The two tests
marked `gpu` need CUDA.
"""

from __future__ import annotations

import gc
import io
import math
import warnings

import pytest
import torch
from torch import nn

import forge_dsl
from references import ADAMAX
from tiers import sweep
from forge_dsl import ForgeOptimizer
from training_models import (DEVICE, HYPERS, MLP, MODELS, MOVED, SPECS, STEPS, SharedMLP, TORCH_OPTIMIZER,
                             assert_fused_moved,                              assert_params_close, assert_params_equal, describe_line, fused_names,
                             llama_batches, llama_loss, make_llama, make_mlp, mlp_batches, mlp_loss,
                             rel_err, snapshot, train, twin)


def test_every_builtin_has_a_counterpart():
    assert set(SPECS) == set(TORCH_OPTIMIZER) == set(HYPERS)




# The quick tier: every spec on the MLP, AdamW on the Llama too (a Llama run takes 2-3 s in the interpreter).
@pytest.mark.parametrize(*sweep(("name", SPECS), ("model_name", list(MODELS)),
                                quick=[f"{name}-mlp" for name in SPECS] + ["adamw-llama"]))
def test_matches_torch(name, model_name):
    make, batches_of, loss_fn = MODELS[model_name]
    kw = HYPERS[name]
    ours = make()
    theirs = twin(ours, make)
    before = snapshot(ours)
    opt = ForgeOptimizer(ours, name, **kw)
    ref = TORCH_OPTIMIZER[name](theirs.parameters(), **kw)
    steps = STEPS.get(name, 4)
    batches = batches_of(steps)
    losses = train(ours, opt, batches, loss_fn)
    ref_losses = train(theirs, ref, batches, loss_fn)
    assert_params_close(ours, theirs)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_fused_moved(opt, ours, before)
    # All nn.Linear and nn.Embedding weights were fused; the rest (norms, biases) stepped in step().
    fused_modules = [m for m in ours.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    assert len(fused_names(opt)) == len(fused_modules)
    # Step counters as torch counts them.
    for p in ours.parameters():
        assert int(opt.state[p]["step"]) == steps


# The tests below on both models keep the MLP in the quick tier: a Llama takes 1-3 s in the interpreter (AdamW's
# run against torch's in test_matches_torch is the quick tier's Llama).
MLP_QUICK = [pytest.param(name, marks=() if name == "mlp" else pytest.mark.slow) for name in MODELS]


@pytest.mark.parametrize("model_name", MLP_QUICK)
def test_slab_path_matches_torch(model_name):
    """linear_path="slab" (what "auto" takes for long bf16 batches on CUDA): cuBLAS dW per row slab + the step kernel."""
    make, batches_of, loss_fn = MODELS[model_name]
    ours = make()
    theirs = twin(ours, make)
    opt = ForgeOptimizer(ours, "adamw", linear_path="slab", **HYPERS["adamw"])
    ref = TORCH_OPTIMIZER["adamw"](theirs.parameters(), **HYPERS["adamw"])
    batches = batches_of(3)
    losses = train(ours, opt, batches, loss_fn)
    assert losses == pytest.approx(train(theirs, ref, batches, loss_fn), rel=1e-5)
    assert_params_close(ours, theirs)
    assert fused_names(opt)


def test_model_structure_unchanged():
    model = make_llama()
    keys = list(model.state_dict())
    modules = [(n, type(m)) for n, m in model.named_modules()]
    opt = ForgeOptimizer(model, "adamw")
    assert list(model.state_dict()) == keys
    assert [(n, type(m)) for n, m in model.named_modules()] == modules
    assert "fused in backward (16)" in opt.describe()  # 2 layers × 7 projections + lm_head + the embedding


def test_keyword_names_and_defaults_match_torch():
    model = make_mlp()
    for name, cls in TORCH_OPTIMIZER.items():
        extra = {"momentum": 0.9} if name == "sgd_momentum" else {}
        ours = ForgeOptimizer(model, name, fuse=False, **extra).param_groups[0]
        theirs = cls(model.parameters(), **extra).param_groups[0]
        for key in forge_dsl.load_spec(name).keyword_defaults():
            assert ours[key] == theirs[key], (name, key, ours[key], theirs[key])


def test_beta_members_by_name_become_torch_tuple():
    opt = ForgeOptimizer(make_mlp(), "adamw", beta2=0.95)
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)


# ----------------------------------------------------------------------------
# 2, 3. Weights that cannot be fused: tied embeddings, a layer called twice
# ----------------------------------------------------------------------------


def test_tied_embeddings_are_stepped_unfused():
    make = lambda seed=0: make_llama(seed, tie_word_embeddings=True)  # noqa: E731
    ours = make()
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    theirs = twin(ours, make)
    before = snapshot(ours)
    opt = ForgeOptimizer(ours, "adamw", **HYPERS["adamw"])
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    assert "lm_head" not in describe_line(opt, "fused in backward")
    assert "tied" in describe_line(opt, "lm_head.weight") and "unfused" in describe_line(opt, "lm_head.weight")
    batches = llama_batches(3)
    train(ours, opt, batches, llama_loss)
    train(theirs, ref, batches, llama_loss)
    assert_params_close(ours, theirs)
    assert_fused_moved(opt, ours, before)
    assert rel_err(ours.lm_head.weight, before["model.embed_tokens.weight"]) >= MOVED


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_layer_called_twice_is_stepped_unfused(name):
    make = lambda seed=0: make_mlp(seed, cls=SharedMLP)  # noqa: E731
    ours = make()
    theirs = twin(ours, make)
    before = snapshot(ours)
    opt = ForgeOptimizer(ours, name, **HYPERS[name])
    ref = TORCH_OPTIMIZER[name](theirs.parameters(), **HYPERS[name])
    batches = mlp_batches(3, out=64)
    train(ours, opt, batches, mlp_loss)
    train(theirs, ref, batches, mlp_loss)
    assert_params_close(ours, theirs)
    line = describe_line(opt, "shared.weight")
    assert "unfused" in line and "several times" in line
    assert "shared.weight" not in describe_line(opt, "fused in backward")
    assert sorted(fused_names(opt)) == ["inp.weight", "out.weight"]
    assert_fused_moved(opt, ours, before)
    assert rel_err(ours.shared.weight, before["shared.weight"]) >= MOVED


class DirectUse(nn.Module):
    """`a.weight` is used by its module and once more directly, which no ownership count can see."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 40)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(torch.tanh(nn.functional.linear(h, self.a.weight)))


def test_weight_also_used_outside_its_linear_is_refused():
    make = lambda seed=0: make_mlp(seed, cls=DirectUse)  # noqa: E731
    model = make()
    opt = ForgeOptimizer(model, "sgd", lr=1.0)
    # refused in backward, where the other use's gradient meets the consumed one (whichever comes first)
    with pytest.raises(RuntimeError, match=r"'a\.weight'.*use outside that module.*fuse=False"):
        mlp_loss(model, mlp_batches(1)[0]).backward()
    # fuse=False: every parameter stepped from its gradient by the element-wise kernel, as torch does.
    ours = make()
    theirs = twin(ours, make)
    opt = ForgeOptimizer(ours, "sgd", lr=1.0, fuse=False)
    ref = torch.optim.SGD(theirs.parameters(), lr=1.0)
    assert "fused in backward (0)" in opt.describe()
    batches = mlp_batches(3)
    train(ours, opt, batches, mlp_loss)
    train(theirs, ref, batches, mlp_loss)
    assert_params_close(ours, theirs)


# ----------------------------------------------------------------------------
# 4. Param groups and LR schedulers
# ----------------------------------------------------------------------------


def param_groups(model, decay=0.1, no_decay_lr=None):
    """Weight decay on matrices only (not on biases and norms), as training recipes do."""
    decay_params = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    no_decay = {"params": other, "weight_decay": 0.0}
    if no_decay_lr is not None:
        no_decay["lr"] = no_decay_lr
    return [{"params": decay_params, "weight_decay": decay}, no_decay]


@pytest.mark.parametrize("model_name", MLP_QUICK)
def test_param_groups_match_torch(model_name):
    make, batches_of, loss_fn = MODELS[model_name]
    ours = make()
    theirs = twin(ours, make)
    before = snapshot(ours)
    opt = ForgeOptimizer(ours, "adamw", model_params=param_groups(ours, 0.2, no_decay_lr=3e-3), lr=1e-2)
    ref = torch.optim.AdamW(param_groups(theirs, 0.2, no_decay_lr=3e-3), lr=1e-2)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]
    batches = batches_of(3)
    train(ours, opt, batches, loss_fn)
    train(theirs, ref, batches, loss_fn)
    assert_params_close(ours, theirs)
    assert_fused_moved(opt, ours, before)


def test_fused_weights_take_their_own_groups_hyperparameters():
    """Fused weights in three groups with different lr and weight decay, against torch with the same groups."""
    def groups(m):
        return [{"params": [m.up.weight], "lr": 3e-2, "weight_decay": 0.5},
                {"params": [m.mid.weight, m.down.weight], "betas": (0.8, 0.9)},
                {"params": [m.up.bias, m.down.bias, m.norm.weight, m.norm.bias], "weight_decay": 0.0}]

    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    opt = ForgeOptimizer(ours, "adamw", model_params=groups(ours), lr=1e-2, weight_decay=0.05)
    ref = torch.optim.AdamW(groups(theirs), lr=1e-2, weight_decay=0.05)
    batches = mlp_batches(3)
    train(ours, opt, batches, mlp_loss)
    train(theirs, ref, batches, mlp_loss)
    assert_params_close(ours, theirs)


SCHEDULERS = {
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3, eta_min=1e-4),
    "warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4),
}


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_lr_scheduler_matches_torch(name, sched):
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    opt = ForgeOptimizer(ours, name, model_params=param_groups(ours, 0.05), **HYPERS[name])
    ref = TORCH_OPTIMIZER[name](param_groups(theirs, 0.05), **HYPERS[name])
    s1, s2 = SCHEDULERS[sched](opt), SCHEDULERS[sched](ref)
    batches = mlp_batches(4)
    lrs = []
    train(ours, opt, batches, mlp_loss, scheduler=s1, between=lambda m: lrs.append(opt.param_groups[0]["lr"]))
    train(theirs, ref, batches, mlp_loss, scheduler=s2)
    assert len(set(lrs)) == 4  # the rate changed every step
    assert_params_close(ours, theirs)


def test_add_param_group_matches_torch():
    """A parameter added after construction (here a loss temperature) is stepped like torch steps it."""
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    temps = [nn.Parameter(torch.ones((), device=DEVICE)) for _ in range(2)]
    opt = ForgeOptimizer(ours, "adamw", **HYPERS["adamw"])
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    for o, t in ((opt, temps[0]), (ref, temps[1])):
        o.add_param_group({"params": [t], "lr": 0.1, "weight_decay": 0.0})
    for model, o, t in ((ours, opt, temps[0]), (theirs, ref, temps[1])):
        train(model, o, mlp_batches(3), lambda m, batch: mlp_loss(m, batch) * t)
    assert_params_close(ours, theirs)
    assert temps[0].item() == pytest.approx(temps[1].item(), rel=1e-6) and temps[0].item() != 1.0


def test_lr_is_read_at_backward_time():
    """Changing a group's lr between steps takes effect in the next backward (fused) and step()."""
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    opt = ForgeOptimizer(ours, "sgd", lr=1.0)
    ref = torch.optim.SGD(theirs.parameters(), lr=1.0)
    for i, batch in enumerate(mlp_batches(3)):
        for o in (opt, ref):
            o.param_groups[0]["lr"] = [1.0, 0.0, 3.0][i]
        train(ours, opt, [batch], mlp_loss)
        train(theirs, ref, [batch], mlp_loss)
    assert_params_close(ours, theirs)


def test_an_lr_written_during_backward_reaches_the_layers_updated_after_it():
    """A fused update reads its group's keywords when it runs (the dict `check_step` made serves while every value
    is the object it read): an lr written by a hook on the last layer, whose update comes first, reaches the
    fused layers updated after it and step()'s parameters, not the one before it."""
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    opt = ForgeOptimizer(ours, "sgd", lr=1.0)
    ref = torch.optim.SGD(theirs.parameters(), lr=1.0)
    ours.down.register_full_backward_hook(lambda *args: opt.param_groups[0].__setitem__("lr", 0.0))
    batch = mlp_batches(1)
    train(ours, opt, batch, mlp_loss)
    train(theirs, ref, batch, mlp_loss)
    for name, p in ours.named_parameters():
        if name == "down.weight":  # updated before the hook ran: lr 1
            assert torch.allclose(p, theirs.get_parameter(name), rtol=1e-5, atol=1e-7)
            assert not torch.equal(p, before[name])
        else:
            assert torch.equal(p, before[name]), name  # lr 0


def test_the_step_counter_follows_its_tensor_when_its_memory_changes():
    """`state["step"]` given new memory in place (`t.data = ...`, as code moving an optimizer's state does): the
    next fused update counts on from the tensor as it is now."""
    model = make_mlp()
    opt = ForgeOptimizer(model, "sgd", lr=0.1)
    train(model, opt, mlp_batches(2), mlp_loss)
    counter = opt.state[model.up.weight]["step"]
    counter.data = torch.tensor(7.0, dtype=counter.dtype)
    train(model, opt, mlp_batches(1), mlp_loss)
    assert opt.state[model.up.weight]["step"].item() == 8.0


class SometimesMLP(MLP):
    """`mid` is skipped when `skip_mid` is set: its step count falls behind the others', as in torch."""

    skip_mid = False

    def forward(self, x):
        h = torch.tanh(self.up(x))
        if not self.skip_mid:
            h = self.mid(h)
        return self.down(self.norm(nn.functional.gelu(h)))


def test_step_counter_seen_in_backward_is_torchs(monkeypatch):
    import forge_dsl.training.stepper as stepper_module

    seen = []
    original = stepper_module.linear_step

    def spy(spec, x, dy, weight, state, *, step, **kw):
        seen.append((weight.shape, step))
        return original(spec, x, dy, weight, state, step=step, **kw)

    monkeypatch.setattr(stepper_module, "linear_step", spy)
    make = lambda seed=0: make_mlp(seed, cls=SometimesMLP)  # noqa: E731
    ours = make()
    theirs = twin(ours, make)
    opt = ForgeOptimizer(ours, "adamw", **HYPERS["adamw"])
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    for i, batch in enumerate(mlp_batches(4)):
        ours.skip_mid = theirs.skip_mid = i == 1
        train(ours, opt, [batch], mlp_loss)
        train(theirs, ref, [batch], mlp_loss)
    assert [s for shape, s in seen if shape == (96, 96)] == [1, 2, 3]  # mid: skipped once
    assert [s for shape, s in seen if shape == (96, 64)] == [1, 2, 3, 4]  # up
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert int(opt.state[p]["step"]) == int(ref.state[q]["step"])
    assert_params_close(ours, theirs)


# ----------------------------------------------------------------------------
# 5. state_dict round trip in the middle of training
# ----------------------------------------------------------------------------


def save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load(data: bytes):
    return torch.load(io.BytesIO(data), map_location=DEVICE)


@pytest.mark.parametrize(
    "w_dtype, state_dtype, name",
    [(torch.float32, "fp32", "adamw"), (torch.bfloat16, "int8", "adamw"),
     pytest.param(torch.bfloat16, "int8", "nadam", marks=pytest.mark.slow)],  # the quick tier: int8 state once
    ids=["fp32", "bf16-int8-adamw", "bf16-int8-nadam"],
)
def test_state_dict_round_trip_is_bit_identical(w_dtype, state_dtype, name):
    make = lambda seed=0: make_mlp(seed, dtype=w_dtype)  # noqa: E731
    batches = mlp_batches(4, dtype=w_dtype)
    kw = dict(lr=1e-2, weight_decay=0.1)
    model = make()
    opt = ForgeOptimizer(model, name, model_params=param_groups(model, 0.1), state_dtype=state_dtype, seed=5, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    train(model, opt, batches[:2], mlp_loss, scheduler=sched)
    saved = save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    train(model, opt, batches[2:], mlp_loss, scheduler=sched)  # A

    # B: another init, another seed and state layout at construction: all of it must come from the checkpoint.
    fresh = make(seed=99)
    opt2 = ForgeOptimizer(fresh, name, model_params=param_groups(fresh, 0.1), state_dtype="fp32", seed=123, **kw)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1 / (s + 1))
    ckpt = load(saved)
    fresh.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    assert opt2.seed == 5
    train(fresh, opt2, batches[2:], mlp_loss, scheduler=sched2)

    assert_params_equal(fresh, model)
    for p, q in zip(model.parameters(), fresh.parameters()):
        sa, sb = opt.state[p], opt2.state[q]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].device == sb[key].device, key  # step, seed, scalars on the CPU; the rest beside p
            assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
    if state_dtype == "int8":
        assert opt.state[model.mid.weight]["exp_avg"].dtype == torch.int8
        assert opt.state[model.mid.weight]["exp_avg.scale"].shape == (96, 2)
    # With other rounding seeds in the same checkpoint the bf16 run differs: the seed is what makes B equal A.
    if w_dtype == torch.bfloat16:
        other = make(seed=99)
        opt3 = ForgeOptimizer(other, name, model_params=param_groups(other, 0.1), state_dtype=state_dtype, seed=6, **kw)
        other.load_state_dict(ckpt["model"])
        state = ckpt["opt"]
        for group in state["param_groups"]:
            group["_forge"]["seed"] = 6
        for s in state["state"].values():
            s["seed"] = s["seed"] + 1
        opt3.load_state_dict(state)
        sched3 = torch.optim.lr_scheduler.LambdaLR(opt3, lambda s: 1 / (s + 1))
        sched3.load_state_dict(ckpt["sched"])
        train(other, opt3, batches[2:], mlp_loss, scheduler=sched3)
        assert not torch.equal(other.mid.weight, model.mid.weight)


def test_load_state_dict_refuses_another_spec():
    model = make_mlp()
    sd = ForgeOptimizer(model, "adamw").state_dict()
    with pytest.raises(ValueError, match="'adamw'.*'lion'"):
        ForgeOptimizer(model, "lion").load_state_dict(sd)


# ----------------------------------------------------------------------------
# 6. Refusals, each saying what to do
# ----------------------------------------------------------------------------


def test_gradient_accumulation_is_refused():
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw")
    batch = mlp_batches(1)[0]
    mlp_loss(model, batch).backward()
    message = (r"second gradient before optimizer\.step\(\).*ForgeOptimizer\(\.\.\., accumulation_steps=k\).*"
               r"fuse=False.*call optimizer\.step\(\) after every backward")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=message):
        mlp_loss(model, batch).backward()
    # Refused in the second forward, before its backward could apply a second update.
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    opt.step()
    train(model, opt, [batch], mlp_loss)  # after step() training goes on


def test_second_backward_through_one_graph_is_refused():
    model = make_mlp()
    opt = ForgeOptimizer(model, "sgd")
    loss = mlp_loss(model, mlp_batches(1)[0])
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        loss.backward()
    opt.step()


def test_clip_grad_norm_on_fused_weights_is_refused():
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw")
    mlp_loss(model, mlp_batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_.*loss\.backward\(\) already applied this step's update.*"
                                           r"ForgeOptimizer\(\.\.\., max_grad_norm=c\).*optimizer\.backward\(loss\).*"
                                           r"fuse=False.*max_grad_norm=0"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="max_grad_norm=0"):
        torch.nn.utils.clip_grad.clip_grad_norm_(model.up.weight, max_norm=1.0)
    # Parameters stepped from .grad can still be clipped, and a norm that clips nothing is unknown (NaN).
    norm = torch.nn.utils.clip_grad_norm_([model.up.bias, model.norm.weight], 1.0)
    assert torch.isfinite(norm)
    grads = [p.grad.clone() for p in model.parameters() if p not in opt._handles]
    assert math.isnan(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
    assert all(torch.equal(p.grad, g) for p, g in zip([p for p in model.parameters() if p not in opt._handles], grads))
    opt.step()


def test_clipping_is_refused_however_it_is_reached():
    """No torch function is replaced (the refusal comes from the fused weights' `.grad`, a `ConsumedGrad`), so it
    holds for a reference taken before forge_dsl was imported and for a hand-written clipping loop; what only
    reads (a grad-norm log) gets NaN."""
    import os
    import subprocess
    import sys

    from forge_dsl.training.consumed_grad import ConsumedGrad

    script = (
        "import torch\n"
        "from torch.nn.utils import clip_grad_norm_  # before forge_dsl is imported\n"
        "import forge_dsl\n"
        "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(device)\n"
        "opt = forge_dsl.ForgeOptimizer(model, 'sgd', lr=0.1)\n"
        "model(torch.randn(4, 64, device=device)).square().sum().backward()\n"
        "try:\n"
        "    clip_grad_norm_(model.parameters(), 1.0)\n"
        "except RuntimeError as e:\n"
        "    print('refused' if 'max_grad_norm=0' in str(e) else e)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"} if DEVICE.type == "cpu" else dict(os.environ)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1:] == ["refused"], out.stdout + out.stderr[-2000:]
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw")
    mlp_loss(model, mlp_batches(1)[0]).backward()
    assert isinstance(model.up.weight.grad, ConsumedGrad)
    with pytest.raises(RuntimeError, match="invalid python storage"):  # it holds no memory
        model.up.weight.grad.untyped_storage().data_ptr()
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    assert math.isnan(total.item())
    with pytest.raises(RuntimeError, match="max_grad_norm=0"):
        (1.0 / (total + 1e-6)).clamp(max=1.0)
    with pytest.raises(RuntimeError, match="a decision on a value computed from the gradient of 'up.weight'"):
        if total > 1.0:
            pass
    opt.step()
    opt.zero_grad()
    assert model.up.weight.grad is None


def test_two_step_and_value_clipping_on_fused_weights_are_refused():
    """torch >= 2.6's get_total_norm + clip_grads_with_norm_ would scale only the gradients that exist,
    and clip_grad_value_ would skip the fused weights: both silently wrong, so both refuse."""
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw")
    mlp_loss(model, mlp_batches(1)[0]).backward()
    others = [p for p in model.parameters() if p.grad is not None and p not in opt._handles]
    grads = [p.grad.clone() for p in others]
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        total = torch.nn.utils.get_total_norm([p.grad for p in others])
        with pytest.raises(RuntimeError, match="cannot scale the gradient .*total norm never saw it.*max_grad_norm=0"):
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, total)
        with pytest.raises(RuntimeError, match="total norm never saw it"):  # a norm of the other gradients alone
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 10 * total.item(), total)
        torch.nn.utils.clip_grads_with_norm_(others, total / 2, total)  # unfused parameters: clipped as usual
        for p, g in zip(others, grads):
            torch.testing.assert_close(p.grad, g / 2, rtol=1e-5, atol=0)
    with pytest.raises(RuntimeError, match=r"clip_grad_value_ .*clamp\(grad, -clip, clip\)"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
    bound = others[0].grad.abs().max().item() / 2
    torch.nn.utils.clip_grad_value_(others[:1], bound)
    assert others[0].grad.abs().max().item() == pytest.approx(bound)
    opt.step()


def test_clip_guard_leaves_other_models_alone():
    ForgeOptimizer(make_mlp(), "adamw")
    model = make_mlp()
    mlp_loss(model, mlp_batches(1)[0]).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert total > 1e-3
    clipped = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
    assert clipped.item() == pytest.approx(1e-3, rel=1e-4)


def test_model_on_the_wrong_device_is_refused(monkeypatch):
    model = MLP()  # on the CPU
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"on cpu.*run on CUDA \(model\.cuda\(\)\)"):
        ForgeOptimizer(model, "adamw")


def test_float16_model_is_refused():
    with pytest.raises(ValueError, match=r"torch\.float16.*model\.float\(\) or model\.bfloat16\(\)"):
        ForgeOptimizer(make_mlp(dtype=torch.float16), "adamw")


def test_autocast_is_refused():
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw")  # noqa: F841 (the fused layers hold it weakly)
    x, y = mlp_batches(1)[0]
    with pytest.raises(RuntimeError, match=r"'up\.weight'.*torch\.autocast.*model\.bfloat16\(\)"):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            mlp_loss(model, (x, y))
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16  # evaluation under autocast is fine


def test_bad_keywords_are_refused_like_torch():
    model = make_mlp()
    with pytest.raises(TypeError, match="did you mean 'lr'"):
        ForgeOptimizer(model, "adamw", lrr=1e-3)
    with pytest.raises(ValueError, match=r"Invalid betas\[1\] \(beta2\): 1.0"):
        ForgeOptimizer(model, "adamw", betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Invalid lr"):
        ForgeOptimizer(model, "adamw", model_params=[{"params": model.parameters(), "lr": -1.0}])
    with pytest.raises(TypeError, match="missing required keyword argument 'momentum'"):
        ForgeOptimizer(model, "sgd_momentum")
    with pytest.raises(ValueError, match="linear_path must be one of auto, fused, slab, got 'cublas'"):
        ForgeOptimizer(model, "adamw", linear_path="cublas")


# ----------------------------------------------------------------------------
# 7. Activation checkpointing, evaluation under no_grad
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reentrant, dtype, state_dtype",
    [(False, torch.float32, "fp32"),
     # slow: 3-6 s each (reentrant checkpointing on the MLP: test_torch_checkpoint_gives_the_same_parameters)
     pytest.param(True, torch.float32, "fp32", marks=pytest.mark.slow),
     pytest.param(False, torch.bfloat16, "int8", marks=pytest.mark.slow)],
    ids=["hf-default", "reentrant", "bf16-int8"])
def test_hf_activation_checkpointing_gives_the_same_parameters(reentrant, dtype, state_dtype):
    make = lambda seed=0: make_llama(seed, dtype=dtype)  # noqa: E731
    plain = make()
    ckpt = twin(plain, make)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
        kwargs = {"use_reentrant": True} if reentrant else None
        ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        assert ckpt.is_gradient_checkpointing
    opt1 = ForgeOptimizer(plain, "adamw", state_dtype=state_dtype, **HYPERS["adamw"])
    opt2 = ForgeOptimizer(ckpt, "adamw", state_dtype=state_dtype, **HYPERS["adamw"])
    batches = llama_batches(3)
    l1 = train(plain, opt1, batches, llama_loss)
    l2 = train(ckpt, opt2, batches, llama_loss)
    assert l1 == pytest.approx(l2, rel=1e-6)
    if dtype == torch.float32:
        assert_params_close(ckpt, plain)
    elif DEVICE.type == "cpu":  # the recomputed activations are the same bits, and so are the rounding draws
        assert_params_equal(ckpt, plain)
    else:  # cuBLAS may pick another reduction order for the recomputation: a bf16 ulp here and there
        assert_params_close(ckpt, plain, tol=1e-2)
    assert sorted(fused_names(opt1)) == sorted(fused_names(opt2))  # nothing mistaken for a shared layer


class CheckpointedMLP(MLP):
    reentrant = False

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(
            lambda t: self.norm(nn.functional.gelu(self.mid(torch.tanh(self.up(t))))), x,
            use_reentrant=self.reentrant)
        return self.down(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_torch_checkpoint_gives_the_same_parameters(reentrant):
    plain = make_mlp()
    ckpt = twin(plain, lambda seed=0: make_mlp(seed, cls=CheckpointedMLP))
    ckpt.reentrant = reentrant
    opt1 = ForgeOptimizer(plain, "adamw", **HYPERS["adamw"])
    opt2 = ForgeOptimizer(ckpt, "adamw", **HYPERS["adamw"])
    batches = [(x.requires_grad_(reentrant), y) for x, y in mlp_batches(3)]
    train(plain, opt1, batches, mlp_loss)
    train(ckpt, opt2, batches, mlp_loss)
    assert_params_close(ckpt, plain)
    assert len(fused_names(opt2)) == 3


@pytest.mark.parametrize("model_name", MLP_QUICK)
def test_no_grad_evaluation_between_steps_changes_nothing(model_name):
    make, batches_of, loss_fn = MODELS[model_name]
    a = make()
    b = twin(a, make)
    opt_a = ForgeOptimizer(a, "adamw", **HYPERS["adamw"])
    opt_b = ForgeOptimizer(b, "adamw", **HYPERS["adamw"])
    batches = batches_of(3)
    held_out = batches_of(1, seed=7)[0]
    evals = []

    def evaluate(model):
        model.eval()
        with torch.no_grad():
            evals.append(loss_fn(model, held_out).item())
        model.train()

    train(a, opt_a, batches, loss_fn, between=evaluate)
    train(b, opt_b, batches, loss_fn)
    assert_params_equal(a, b)
    assert len(evals) == 3 and all(math.isfinite(e) for e in evals)
    assert sorted(fused_names(opt_a)) == sorted(fused_names(opt_b))


# ----------------------------------------------------------------------------
# 8. bf16 model, int8 state
# ----------------------------------------------------------------------------


def test_bf16_llama_int8_state_trains():
    model = make_llama(dtype=torch.bfloat16)
    before = snapshot(model)
    opt = ForgeOptimizer(model, "adamw", lr=1e-2, state_dtype="int8")
    ids = llama_batches(1)[0]
    losses = train(model, opt, [ids] * 3, llama_loss)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert_fused_moved(opt, model, before, at_least=1e-3)
    w = model.model.layers[0].mlp.up_proj.weight
    assert w.dtype == torch.bfloat16 and opt.state[w]["exp_avg"].dtype == torch.int8


# ----------------------------------------------------------------------------
# 9. Hugging Face Trainer
# ----------------------------------------------------------------------------


def trainer_setup(tmp_path, n: int, **args):
    """(n random token sequences as Trainer's dataset, TrainingArguments of 3 logged steps with `args`)."""
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    gen = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 128, (n, 16), generator=gen)]
    return data, TrainingArguments(
        output_dir=str(tmp_path), use_cpu=not torch.cuda.is_available(), report_to=[], save_strategy="no",
        max_steps=3, per_device_train_batch_size=2, logging_steps=1, disable_tqdm=True, seed=0, **args)


def run_trainer(tmp_path, model, optimizer, **args):
    from transformers import Trainer

    data, training_args = trainer_setup(tmp_path, 8, **args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / 4)
    trainer = Trainer(model=model, args=training_args, train_dataset=data, optimizers=(optimizer, scheduler))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_hf_trainer_default_clipping_fails_loudly(tmp_path):
    """A plain Trainer's clip_grad_norm_ after a plain backward: refused, naming ForgeTrainer and max_grad_norm=0."""
    model = make_llama()
    opt = ForgeOptimizer(model, "adamw")
    with pytest.raises(RuntimeError, match=r"forge_dsl\.ForgeTrainer.*TrainingArguments\(max_grad_norm=0\)"):
        run_trainer(tmp_path, model, opt)  # max_grad_norm defaults to 1.0


def run_forge_trainer(tmp_path, model, trainer_cls, **args):
    """3 steps of `trainer_cls` (Trainer or forge_dsl.ForgeTrainer) with Trainer's own optimizer and schedule;
    returns (losses, logged grad norms)."""
    data, training_args = trainer_setup(tmp_path, 12, optim="adamw_torch", learning_rate=2e-3, weight_decay=0.1,
                                        **args)
    trainer = trainer_cls(model=model, args=training_args, train_dataset=data)
    trainer.train()
    history = trainer.state.log_history
    return [h["loss"] for h in history if "loss" in h], [h["grad_norm"] for h in history if "grad_norm" in h]


@pytest.mark.parametrize("args", [{}, {"gradient_accumulation_steps": 2},
                                  {"gradient_accumulation_steps": 3, "max_grad_norm": 0.0}],
                         ids=["default-clipping", "accumulation-and-clipping", "accumulation"])
def test_forge_trainer_matches_torch(tmp_path, args):
    """forge_dsl.ForgeTrainer against transformers.Trainer with torch AdamW under the same arguments, Trainer's
    default max_grad_norm=1.0 (which clips at every step here) and gradient accumulation included."""
    from transformers import Trainer

    ours = make_llama()
    theirs = twin(ours, make_llama)
    before = snapshot(ours)
    losses, norms = run_forge_trainer(tmp_path / "forge", ours, forge_dsl.ForgeTrainer, **args)
    ref_losses, ref_norms = run_forge_trainer(tmp_path / "torch", theirs, Trainer, **args)
    assert len(losses) == 3 and losses == pytest.approx(ref_losses, rel=1e-5)
    if args.get("max_grad_norm", 1.0) > 0:
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert all(n > 1.0 for n in ref_norms)  # the clipping triggers
    assert_params_close(ours, theirs)
    moved = {n: rel_err(p, before[n]) for n, p in ours.named_parameters()}
    assert min(moved.values()) > 1e-4


def test_forge_trainer_refuses_a_mismatched_optimizer(tmp_path):
    model = make_llama()
    opt = ForgeOptimizer(model, "adamw")  # no max_grad_norm, while TrainingArguments clip at 1.0
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=not torch.cuda.is_available(), report_to=[],
                             max_steps=1, per_device_train_batch_size=2)
    data = [{"input_ids": torch.arange(16), "labels": torch.arange(16)}] * 2
    trainer = forge_dsl.ForgeTrainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"max_grad_norm=None.*max_grad_norm=1\.0.*let ForgeTrainer build it"):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    "args, message",
    [({"gradient_accumulation_steps": 2}, r"gradient accumulation.*accumulation_steps=k.*fuse=False"),
     ({"bf16": True}, r"does not support torch\.autocast.*model\.bfloat16\(\).*bf16=False")],
    ids=["accumulation", "autocast"])
def test_hf_trainer_refusals(tmp_path, args, message):
    model = make_llama()
    opt = ForgeOptimizer(model, "adamw")
    with pytest.raises(RuntimeError, match=message):
        run_trainer(tmp_path, model, opt, max_grad_norm=0, **args)


def test_hf_trainer_without_clipping_matches_torch(tmp_path):
    ours = make_llama()
    theirs = twin(ours, make_llama)
    before = snapshot(ours)
    opt = ForgeOptimizer(ours, "adamw", **HYPERS["adamw"])
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    losses = run_trainer(tmp_path / "forge", ours, opt, max_grad_norm=0)
    ref_losses = run_trainer(tmp_path / "torch", theirs, ref, max_grad_norm=0)
    assert len(losses) == 3
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_params_close(ours, theirs)
    assert_fused_moved(opt, ours, before)


# ----------------------------------------------------------------------------
# 10. A spec from a file
# ----------------------------------------------------------------------------




def test_user_spec_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_DSL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "adamax.fopt"
    path.write_text(ADAMAX)
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    before = snapshot(ours)
    opt = ForgeOptimizer(ours, path, lr=1e-2, weight_decay=0.01)  # a pathlib.Path, or a str
    ref = torch.optim.Adamax(theirs.parameters(), lr=1e-2, weight_decay=0.01)
    batches = mlp_batches(3)
    train(ours, opt, batches, mlp_loss)
    train(theirs, ref, batches, mlp_loss)
    assert_params_close(ours, theirs)
    assert_fused_moved(opt, ours, before)
    assert "ForgeOptimizer(adamax" in opt.describe()


# ----------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_bf16_llama_int8_state_close_to_torch_adamw():
    ours = make_llama(dtype=torch.bfloat16)
    theirs = twin(ours, lambda seed=0: make_llama(seed, dtype=torch.bfloat16))
    opt = ForgeOptimizer(ours, "adamw", lr=1e-3, state_dtype="int8")
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    ids = llama_batches(1)[0]
    batches = [ids] * 3 + [ids]
    losses = train(ours, opt, batches[:3], llama_loss)
    ref_losses = train(theirs, ref, batches[:3], llama_loss)
    with torch.no_grad():
        losses.append(llama_loss(ours, ids).item())
        ref_losses.append(llama_loss(theirs, ids).item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 0.05, (losses, ref_losses)


class Stack(nn.Module):
    def __init__(self, n_layers, width):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(n_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def one_step_peak(model, x, c, opt=None) -> int:
    """Peak bytes allocated during one forward + backward + step, above what was allocated before it.

    Without `opt`, backward computes only dX (`torch.autograd.grad` on the input): the same forward graph and
    saved activations, no weight gradient, no update: what the activations alone cost.
    """
    def step():
        loss = (model(x) * c).sum()  # a loss whose backward allocates only dY
        if opt is None:
            torch.autograd.grad(loss, [x])
        else:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up: optimizer state, kernels, cuBLAS workspace
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


@pytest.mark.gpu
def test_gpu_peak_memory_has_no_gradient_pool():
    """One step of 4 bf16 Linear(4096, 4096) layers on 512 tokens: FORGE never holds a weight gradient.

    torch.optim.AdamW(fused=True) holds all four gradients (128 MiB) at the seam between backward and step;
    FORGE's peak is that of the activations.  So FORGE's peak is lower by the gradients' size less the
    activations that set its own peak (a few MiB here): "lower by the whole gradient pool" cannot hold
    exactly, since torch's peak comes after the activations are freed and FORGE's while they are alive.
    """
    n_layers, width, tokens = 4, 4096, 512
    slack = 8 * 2**20
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    grad_bytes = n_layers * width * width * 2
    peaks = {}
    for which in ("activations", "torch", "forge"):
        torch.manual_seed(0)
        model = Stack(n_layers, width).to("cuda", torch.bfloat16)
        x_in = x
        if which == "activations":
            opt = None
            x_in = x.clone().requires_grad_(True)
        elif which == "torch":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # bf16 params: bf16 state
        else:
            opt = ForgeOptimizer(model, "adamw", lr=1e-4, state_dtype="bf16")
            assert len(opt._handles) == n_layers
        peaks[which] = one_step_peak(model, x_in, c, opt)
        del model, opt, x_in
        gc.collect()
        torch.cuda.empty_cache()
    assert peaks["torch"] >= grad_bytes, peaks  # every gradient alive at once
    assert peaks["forge"] <= peaks["activations"] + slack, peaks  # no gradient memory at all
    assert peaks["torch"] - peaks["forge"] >= grad_bytes - peaks["activations"] - slack, peaks


def test_stray_forward_unfuses_only_that_step():
    """A forward with grad enabled and no backward makes the next step unfused (exact), not every later one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(DEVICE)
    opt = forge_dsl.ForgeOptimizer(model, "adamw", lr=1e-2)
    x = torch.randn(8, 16, device=DEVICE)
    model(x)  # stray: grad enabled, never backpropagated
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    assert "used several times in the last step (2)" in opt.describe()
    model(x).square().mean().backward()
    opt.step()
    assert "fused in backward (2)" in opt.describe()


def test_multihead_attention_out_proj_is_not_fused_and_detach_restores():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.MultiheadAttention(8, 2)).to(DEVICE)
    opt = forge_dsl.ForgeOptimizer(model, "adamw")
    assert "read directly by nn.MultiheadAttention: 1.out_proj.weight" in opt.describe()
    with pytest.raises(ValueError, match="already fused by another ForgeOptimizer"):
        forge_dsl.ForgeOptimizer(model, "sgd")
    opt.detach()
    assert "forward" not in vars(model[0])
    forge_dsl.ForgeOptimizer(model, "sgd")
