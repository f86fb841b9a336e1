"""`ForgeOptimizer` as a torch optimizer on the user's own ground: torch.optim's constructor convention,
a model that is never changed behind the user's back, and steps that stay whole when backward fails.

Each comparison trains a copy of one model with torch.optim (or with the model-first constructor) on the same
batches; fp32 weights and state, so the runs agree to the relative error tests/training/test_optimizer.py uses.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle

import pytest
import torch
from torch import nn

import forge_dsl
from forge_dsl import ForgeOptimizer
from training_models import (DEVICE, HYPERS, MLP, assert_fused_moved, assert_params_close, make_llama, make_mlp,
                        mlp_batches, mlp_loss, snapshot, train, twin)


def _fused_names(opt) -> list[str]:
    return sorted(h.name for h in opt._handles.values())


# ----------------------------------------------------------------------------
# torch.optim's convention: params (or param groups) first
# ----------------------------------------------------------------------------


def test_params_first_after_fuse_matches_torch():
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    before = snapshot(ours)
    forge_dsl.fuse(ours)
    opt = ForgeOptimizer(ours.parameters(), "adamw", **HYPERS["adamw"])  # a generator, as torch takes it
    assert _fused_names(opt) == ["down.weight", "mid.weight", "up.weight"]
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    batches = mlp_batches(3)
    train(ours, opt, batches, mlp_loss)
    train(theirs, ref, batches, mlp_loss)
    assert_params_close(ours, theirs)
    assert_fused_moved(opt, ours, before)


def test_param_group_dicts_first_match_the_model_first_constructor():
    a = make_mlp()
    b = twin(a, make_mlp)

    def groups(m):
        return [{"params": [m.up.weight, m.mid.weight, m.down.weight], "weight_decay": 0.1},
                {"params": [m.up.bias, m.norm.weight, m.norm.bias, m.down.bias], "weight_decay": 0.0, "lr": 3e-3}]

    forge_dsl.fuse(a)
    opt_a = ForgeOptimizer(groups(a), spec="adamw", lr=1e-2)
    opt_b = ForgeOptimizer(b, "adamw", model_params=groups(b), lr=1e-2)
    assert _fused_names(opt_a) == _fused_names(opt_b) == ["down.weight", "mid.weight", "up.weight"]
    batches = mlp_batches(3)
    train(a, opt_a, batches, mlp_loss)
    train(b, opt_b, batches, mlp_loss)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name  # the same kernels on the same data: the same bits


def test_hf_trainer_builds_it_from_optimizer_cls_and_kwargs(tmp_path):
    """HF Trainer's `optimizer_cls_and_kwargs` calls `cls(grouped_params, **kwargs)`; after `fuse(model)` the
    Linear weights are fused and training matches torch's AdamW."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    ours = make_llama()
    theirs = twin(ours, make_llama)
    forge_dsl.fuse(ours)
    gen = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in (torch.randint(0, 128, (16,), generator=gen)
                                                                    for _ in range(8))]
    losses = {}
    for name, model, cls_kwargs in (
            ("forge", ours, (ForgeOptimizer, {"spec": "adamw", "lr": 2e-3})),
            ("torch", theirs, (torch.optim.AdamW, {"lr": 2e-3}))):
        args = TrainingArguments(output_dir=str(tmp_path / name), use_cpu=not torch.cuda.is_available(), report_to=[],
                                 save_strategy="no", max_steps=3, per_device_train_batch_size=2, logging_steps=1,
                                 disable_tqdm=True, seed=0, max_grad_norm=0, weight_decay=0.1,
                                 lr_scheduler_type="constant")
        trainer = Trainer(model=model, args=args, train_dataset=data, optimizer_cls_and_kwargs=cls_kwargs)
        trainer.train()
        losses[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if name == "forge":
            assert isinstance(trainer.optimizer.optimizer, ForgeOptimizer)
            fused = _fused_names(trainer.optimizer.optimizer)
            assert "model.layers.0.self_attn.q_proj.weight" in fused and "lm_head.weight" in fused, fused
    assert losses["forge"] == pytest.approx(losses["torch"], rel=1e-5)
    assert_params_close(ours, theirs)


def test_constructor_argument_errors():
    model = make_mlp()
    with pytest.raises(TypeError, match="needs a spec"):
        ForgeOptimizer(model.parameters())
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        ForgeOptimizer(model.up.weight, "adamw")
    with pytest.raises(TypeError, match="model_params= goes with a module"):
        ForgeOptimizer(list(model.parameters()), "adamw", model_params=list(model.parameters()))


def test_params_of_an_unmarked_model_warn_and_train_unfused():
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    with pytest.warns(UserWarning, match=r"forge_dsl\.fuse\(model\)"):
        opt = ForgeOptimizer(ours.parameters(), "adamw", **HYPERS["adamw"])
    assert not opt._handles
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    batches = mlp_batches(2)
    train(ours, opt, batches, mlp_loss)
    train(theirs, ref, batches, mlp_loss)
    assert_params_close(ours, theirs)


# ----------------------------------------------------------------------------
# The user's model is never changed behind their back
# ----------------------------------------------------------------------------


class Doubled(nn.Linear):
    """A subclass whose forward is not nn.Linear's."""

    def forward(self, x):
        return 2 * super().forward(x)


class WithOwnForwards(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain = nn.Linear(64, 64)
        self.doubled = Doubled(64, 64)
        self.qat = torch.ao.nn.qat.Linear(64, 64, qconfig=torch.ao.quantization.get_default_qat_qconfig())
        self.hooked = nn.Linear(64, 40)
        original = self.hooked.forward
        self.hooked.forward = lambda x: original(x) + 1.0  # what a hook library installs on the instance

    def forward(self, x):
        return self.hooked(torch.tanh(self.qat(torch.tanh(self.doubled(torch.tanh(self.plain(x)))))))


def _own_forwards(seed=0):
    torch.manual_seed(seed)
    return WithOwnForwards().to(DEVICE)


def test_only_modules_with_nn_linear_forward_are_fused_the_others_keep_theirs():
    """A Linear subclass with its own forward (a doubled output, QAT's fake quantization) and an instance-level
    forward are stepped from .grad, and behave as they do under torch.optim; `describe` says why."""
    ours = _own_forwards()
    theirs = _own_forwards()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 64, device=DEVICE)
    expected = theirs(x)
    opt = ForgeOptimizer(ours, "adamw", **HYPERS["adamw"])
    assert _fused_names(opt) == ["plain.weight"]
    text = opt.describe()
    assert "Doubled has its own forward" in text and "Linear has its own forward" in text  # qat.Linear
    assert "replaced on the instance" in text
    assert torch.equal(ours(x), expected)  # the same forward as before the optimizer
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = torch.randn(4, 64, generator=gen).to(DEVICE)
        for model, o in ((ours, opt), (theirs, ref)):
            model(batch).square().mean().backward()
            o.step()
            o.zero_grad()
    assert_params_close(ours, theirs)
    opt.detach()
    assert torch.equal(ours.hooked(x), ours.hooked.__dict__["forward"](x))  # the hook's forward is still there
    assert "forward" not in ours.plain.__dict__


def test_detach_and_the_optimizers_end_restore_the_model_exactly():
    model = make_mlp()
    assert not any("forward" in m.__dict__ for m in model.modules())
    opt = ForgeOptimizer(model, "adamw")
    assert "forward" in model.up.__dict__
    opt.detach()
    assert not any("forward" in m.__dict__ for m in model.modules())
    opt = ForgeOptimizer(model, "sgd", lr=0.1)
    del opt
    gc.collect()
    assert not any("forward" in m.__dict__ for m in model.modules())
    # and the model trains with torch.optim afterwards
    ref = torch.optim.SGD(model.parameters(), lr=0.1)
    model(mlp_batches(1)[0][0]).sum().backward()
    assert model.up.weight.grad is not None
    ref.step()


def test_a_dropped_optimizer_leaves_a_usable_model():
    """Without detach(), a forward after the optimizer is gone runs nn.Linear's own (and gives the module it back)."""
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw")
    finalizer = opt._finalizer
    finalizer.detach()  # as if the finalizer had not run yet (the optimizer kept alive elsewhere, then dropped)
    del opt
    gc.collect()
    x = mlp_batches(1)[0][0]
    model(x).sum().backward()
    assert model.up.weight.grad is not None
    assert "forward" not in model.up.__dict__


def test_copies_of_a_fused_model_are_plain_models():
    """deepcopy, pickle and torch.save of a model under a ForgeOptimizer give a model that trains with any
    optimizer (nn.Linear's own forward), and leave the original fused."""
    ours = make_mlp()
    opt = ForgeOptimizer(ours, "adamw")
    x, _ = mlp_batches(1)[0]
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(ours), pickle.loads(pickle.dumps(ours)), torch.load(buffer, weights_only=False)]
    for c in copies:
        assert torch.equal(c(x), ours(x))
        c(x).sum().backward()
        assert all(p.grad is not None for p in c.parameters())  # autograd's dW: not fused
    # a copy can be fused by an optimizer of its own, and matches one built on a fresh model
    fresh = twin(copies[0], make_mlp)
    opt_copy = ForgeOptimizer(copies[0], "adamw", **HYPERS["adamw"])
    opt_fresh = ForgeOptimizer(fresh, "adamw", **HYPERS["adamw"])
    assert _fused_names(opt_copy) == _fused_names(opt_fresh) == _fused_names(opt)
    for c in copies:
        c.zero_grad()
    batches = mlp_batches(2)
    train(copies[0], opt_copy, batches, mlp_loss)
    train(fresh, opt_fresh, batches, mlp_loss)
    for p, q in zip(copies[0].parameters(), fresh.parameters()):
        assert torch.equal(p, q)
    opt_copy.detach()
    assert _is_dormant(copies[0].up)  # given back what it had: the copy's plain forward


def _is_dormant(module) -> bool:
    from forge_dsl.training.weight import is_dormant_forward as _is_dormant_forward

    return _is_dormant_forward(module, module.__dict__.get("forward"))


# ----------------------------------------------------------------------------
# A step is whole: an exception inside backward
# ----------------------------------------------------------------------------


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises while `armed` is set."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        if _FailOnce.armed:
            raise RuntimeError("boom inside backward")
        return dy


class FailingMLP(MLP):
    def forward(self, x):
        h = torch.tanh(self.up(x))
        h = _FailOnce.apply(h)  # backward reaches mid and down first, then fails here, before up
        return self.down(self.norm(nn.functional.gelu(self.mid(h))))


def test_an_exception_inside_backward_leaves_a_whole_step():
    """down and mid are updated before the exception (their step counters move with the update), up is not.
    A retry is refused with what happened; step() closes the step without stepping anything from the
    incomplete gradients (it warns); then training goes on and matches torch.optim given the same updates."""
    torch.manual_seed(0)
    ours = FailingMLP().to(DEVICE)
    opt = ForgeOptimizer(ours, "adamw", **HYPERS["adamw"])
    batches = mlp_batches(3)
    x, target = batches[0]
    _FailOnce.armed = True
    try:
        with pytest.raises(RuntimeError, match="boom inside backward"):
            mlp_loss(ours, (x, target)).backward()
    finally:
        _FailOnce.armed = False
    steps = {n: int(opt.state[p]["step"]) if p in opt.state else 0 for n, p in ours.named_parameters()}
    assert steps["down.weight"] == steps["mid.weight"] == 1 and steps["up.weight"] == 0
    with pytest.raises(RuntimeError, match=r"interrupted.*2 of the 3 fused layers.*optimizer\.step\(\)"):
        ours(x)
    down_bias = ours.down.bias.detach().clone()
    assert ours.down.bias.grad is not None
    with pytest.warns(RuntimeWarning, match="closed the step"):
        opt.step()
    assert torch.equal(ours.down.bias, down_bias)  # not stepped from what the failed backward left
    opt.zero_grad()
    train(ours, opt, batches[1:], mlp_loss)  # goes on as usual
    steps = {n: int(opt.state[p]["step"]) for n, p in ours.named_parameters()}
    assert steps["down.weight"] == steps["mid.weight"] == 3 and steps["up.weight"] == 2
    assert steps["down.bias"] == 2


def test_a_refused_clipping_leaves_the_step_counters_consistent():
    """Clipping is refused after backward (it cannot be exact), when the fused weights have moved: their step
    counters have moved with them, so the optimizer's state says what happened."""
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw")
    x, target = mlp_batches(1)[0]
    mlp_loss(model, (x, target)).backward()
    with pytest.raises(RuntimeError, match="clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert all(int(opt.state[p]["step"]) == 1 for p in opt._handles)
    opt.step()
    assert all(int(s["step"]) == 1 for s in opt.state.values())


# ----------------------------------------------------------------------------
# Constructor arguments and odd layers
# ----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_a_layer_without_outputs_trains_beside_the_others():
    torch.manual_seed(0)
    empty, layer = nn.Linear(64, 0).to(DEVICE), nn.Linear(64, 8).to(DEVICE)
    opt = ForgeOptimizer(nn.ModuleList([empty, layer]), "adamw", lr=1e-2)
    weight = layer.weight.detach().clone()
    x = torch.randn(2, 64, device=DEVICE)
    (layer(x).pow(2).mean() + empty(x).sum()).backward()
    opt.step()
    assert not torch.equal(layer.weight, weight) and empty.weight.shape == (0, 64)


def test_seed_and_meta_parameters_are_refused_with_their_names():
    with pytest.raises(TypeError, match="seed must be an integer, got str 'x'"):
        ForgeOptimizer(make_mlp(), "adamw", seed="x")
    with pytest.raises(ValueError, match="seed"):
        ForgeOptimizer(make_mlp(), "adamw", seed=1.5)
    with pytest.raises(ValueError, match="meta device.*materialize"):
        ForgeOptimizer(nn.Linear(4, 4, device="meta"), "adamw")


class HeadReadDirectly(MLP):
    """The last layer's weight read by F.linear, never through its module's forward: what Liger-Kernel's fused
    linear cross-entropy does with lm_head."""

    def forward(self, x):
        h = self.norm(nn.functional.gelu(self.mid(torch.tanh(self.up(x)))))
        return nn.functional.linear(h, self.down.weight, self.down.bias)


def test_describe_tells_a_weight_read_outside_its_module_from_a_fused_one():
    make = lambda seed=0: make_mlp(seed, cls=HeadReadDirectly)  # noqa: E731
    ours = make()
    theirs = twin(ours, make)
    opt = ForgeOptimizer(ours, "adamw", **HYPERS["adamw"])
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    batches = mlp_batches(2)
    train(ours, opt, batches, mlp_loss)
    train(theirs, ref, batches, mlp_loss)
    assert_params_close(ours, theirs)
    text = opt.describe()
    assert "fused in backward (2): up.weight, mid.weight" in text
    assert "read outside its module's forward" in text and "down.weight" in text.split("read outside")[1]
