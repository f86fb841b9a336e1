"""Nothing silently wrong, round 3: what a torch user does to a model and its optimizer mid-run, done to a
`ForgeOptimizer`, ends as torch.optim's AdamW ends it, or is refused before any weight changes with what to do.

A replaced weight (`module.weight = nn.Parameter(...)`) trains as torch trains it; weights that share memory
are refused; a step whose hyperparameters or parameters went bad changes nothing; a parameter that changed
shape, a model moved to the meta device and `zero_grad()` between backward and `step()` say what happened;
torch.optim's hooks run as they run on torch's AdamW. Every comparison trains a copy of one model with
torch.optim.AdamW on the same random batches (fp32: within the relative error of test_optimizer.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from forge_dsl import ForgeOptimizer
from forge_dsl.training.consumed_grad import ConsumedGrad
from training_models import DEVICE, assert_params_close, describe_line, rel_err, train

HYPERS = dict(lr=2e-3, weight_decay=0.1)


def make_model(seed=0):
    """Four Linear layers, 64 -> 96 -> 96 -> 96 -> 32: layers 2 and 4 have weights of one shape [96, 96]."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(),
                         nn.Linear(96, 32)).to(DEVICE)


def batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 64, generator=gen).to(DEVICE), torch.randn(4, 32, generator=gen).to(DEVICE))
            for _ in range(n)]


def loss_of(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


def random_weight(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 0.1).to(DEVICE)


def values(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_unchanged(model, before):
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert not changed, f"weights changed: {changed}"


# ----------------------------------------------------------------------------
# A replaced weight
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("added", [True, False], ids=["add_param_group", "not-in-the-optimizer"])
def test_a_replaced_weight_trains_as_torch_trains_it(added):
    """`model[2].weight = nn.Parameter(new)`: with `add_param_group` the new weight is fused again and steps as
    torch steps it; without, it gets a `.grad` and is not stepped, as under torch. The old weight stays put."""
    ours = make_model()
    theirs = copy.deepcopy(ours)
    opt = ForgeOptimizer(ours, "adamw", **HYPERS)
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS)
    data = batches(4)
    train(ours, opt, data[:2], loss_of)
    train(theirs, ref, data[:2], loss_of)
    old = ours[2].weight
    old_value = old.detach().clone()
    new = random_weight((96, 96), seed=3)
    ours[2].weight = nn.Parameter(new.clone())
    theirs[2].weight = nn.Parameter(new.clone())
    if added:
        opt.add_param_group({"params": [ours[2].weight]})
        ref.add_param_group({"params": [theirs[2].weight]})
        assert "2.weight" in describe_line(opt, "fused in backward (4)")
    else:
        assert "2.weight" in describe_line(opt, "replaced")
        assert "2.weight" not in describe_line(opt, "fused in backward")
    loss_of(ours, data[2]).backward()
    loss_of(theirs, data[2]).backward()
    if added:
        assert isinstance(ours[2].weight.grad, ConsumedGrad)  # updated inside backward
    opt.step()
    ref.step()
    opt.zero_grad()
    ref.zero_grad()
    train(ours, opt, data[3:], loss_of)
    train(theirs, ref, data[3:], loss_of)
    assert_params_close(ours, theirs)
    assert torch.equal(old, old_value), "the replaced Parameter was updated"
    if added:
        assert rel_err(ours[2].weight, new) > 1e-3, "the new weight did not move"
    else:
        assert torch.equal(ours[2].weight, new)
        assert rel_err(ours[2].weight.grad, theirs[2].weight.grad) <= 1e-5


# ----------------------------------------------------------------------------
# Weights that share memory
# ----------------------------------------------------------------------------


def _alias(model, how):
    if how == "data":
        model[4].weight = nn.Parameter(model[2].weight.data)
    else:  # two overlapping views of one buffer: the second starts at the first's row 48
        buffer = random_weight((144, 96), seed=4)
        model[2].weight = nn.Parameter(buffer[:96])
        model[4].weight = nn.Parameter(buffer[48:])


@pytest.mark.parametrize("how", ["data", "overlapping-views"])
def test_weights_that_share_memory_are_refused_at_construction(how):
    model = make_model()
    _alias(model, how)
    with pytest.raises(ValueError, match=r"parameters '2.weight' and '4.weight' share memory.*one Parameter"):
        ForgeOptimizer(model, "adamw", **HYPERS)


@pytest.mark.parametrize("how", ["data", "overlapping-views"])
def test_a_param_group_sharing_memory_is_refused_before_anything_changes(how):
    model = make_model()
    _alias(model, how)
    params = [p for n, p in model.named_parameters() if n != "4.weight"]
    opt = ForgeOptimizer(model, "adamw", model_params=params, **HYPERS)
    groups = len(opt.param_groups)
    with pytest.raises(ValueError, match=r"share memory.*one Parameter"):
        opt.add_param_group({"params": [model[4].weight]})
    assert len(opt.param_groups) == groups and model[4].weight not in opt._param_index
    before = values(model)
    train(model, opt, batches(1), loss_of)  # the optimizer works on as it was
    assert not torch.equal(model[0].weight, before["0.weight"])


def test_adjacent_views_of_one_buffer_train_as_torch():
    """Two weights in one buffer that do not overlap are two weights: accepted, trained as torch trains them."""
    ours = make_model()
    buffer = random_weight((192, 96), seed=5)
    ours[2].weight = nn.Parameter(buffer[:96])
    ours[4].weight = nn.Parameter(buffer[96:])
    theirs = copy.deepcopy(ours)
    opt = ForgeOptimizer(ours, "adamw", **HYPERS)
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS)
    data = batches(3)
    train(ours, opt, data, loss_of)
    train(theirs, ref, data, loss_of)
    assert_params_close(ours, theirs)


def test_a_tied_parameter_is_stepped_once_as_torch():
    """One Parameter in two modules (the way to share a weight) is unfused and stepped from its summed .grad."""
    ours = make_model()
    ours[4].weight = ours[2].weight
    theirs = copy.deepcopy(ours)
    opt = ForgeOptimizer(ours, "adamw", **HYPERS)
    assert describe_line(opt, "shared with another module")
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS)
    data = batches(3)
    train(ours, opt, data, loss_of)
    train(theirs, ref, data, loss_of)
    assert_params_close(ours, theirs)


# ----------------------------------------------------------------------------
# A step that cannot be applied whole changes nothing
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("bad", [0, 1])
def test_a_nan_lr_in_one_group_is_refused_before_any_weight_changes(fuse, bad):
    """A scheduler bug makes one group's lr NaN: the step is refused, naming the group and the key, before any
    weight of any group changes, in backward (the fused weights) or in step() (the rest)."""
    model = make_model()
    params = dict(model.named_parameters())
    groups = [{"params": [params["0.weight"], params["0.bias"], params["2.weight"]]},
              {"params": [p for n, p in params.items() if n not in ("0.weight", "0.bias", "2.weight")]}]
    opt = ForgeOptimizer(model, "adamw", model_params=groups, fuse=fuse, **HYPERS)
    data = batches(3)
    train(model, opt, data[:1], loss_of)
    opt.param_groups[bad]["lr"] = float("nan")
    before = values(model)
    with pytest.raises(ValueError, match=rf"param group {bad}: Invalid lr: nan"):
        loss_of(model, data[1]).backward()
        opt.step()
    assert_unchanged(model, before)
    opt.param_groups[bad]["lr"] = HYPERS["lr"]  # fixed: the batch runs again and trains
    opt.zero_grad()
    train(model, opt, data[1:], loss_of)
    assert not torch.equal(model[0].weight, before["0.weight"])


class Gain(nn.Module):
    """y = x * gain, gain [96] (any shape that broadcasts)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.gain


def test_a_parameter_that_changed_shape_is_named_before_any_weight_changes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), Gain(96), nn.Tanh(), nn.Linear(96, 32)).to(DEVICE)
    opt = ForgeOptimizer(model, "adamw", **HYPERS)
    data = batches(2)
    train(model, opt, data[:1], loss_of)
    model[1].gain.data = torch.full((1,), 0.5, device=DEVICE)  # still broadcasts: the forward runs
    before = values(model)
    with pytest.raises(ValueError, match=r"parameter '1.gain' changed shape from \(96,\) to \(1,\) since its "
                                         r"optimizer state was made.*del optimizer.state\[p\]"):
        loss_of(model, data[1]).backward()
    assert_unchanged(model, before)


def test_a_model_moved_to_the_meta_device_is_named():
    model = make_model()
    opt = ForgeOptimizer(model, "adamw", **HYPERS)
    data = batches(2)
    train(model, opt, data[:1], loss_of)
    model.to("meta")
    x = data[1][0].to("meta")
    with pytest.raises(RuntimeError, match=r"'0.weight' is on the meta device.*to_empty"):
        model(x)
    with torch.no_grad():  # without gradients nothing is updated: shapes propagate as torch's own
        assert model(x).shape == (4, 32)


def test_zero_grad_between_backward_and_step_warns_and_steps_as_torch():
    """torch's `zero_grad()` before `step()` makes that step do nothing; FORGE's fused weights were already
    updated in backward: zero_grad says so, and step() steps nothing else, as torch's."""
    model = make_model()
    opt = ForgeOptimizer(model, "adamw", **HYPERS)
    data = batches(3)
    train(model, opt, data[:1], loss_of)
    loss_of(model, data[1]).backward()
    with pytest.warns(RuntimeWarning, match=r"zero_grad\(\) after backward and before step\(\).*4 fused weights "
                                            r"were already updated"):
        opt.zero_grad()
    biases = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("bias")}
    opt.step()
    for n, p in model.named_parameters():
        if n.endswith("bias"):
            assert torch.equal(p, biases[n]), n
    train(model, opt, data[2:], loss_of)  # the step was closed: training goes on
    assert all(int(s["step"]) == 3 for p, s in opt.state.items() if p.dim() == 2)


# ----------------------------------------------------------------------------
# torch.optim's hooks
# ----------------------------------------------------------------------------


def _register_hooks(opt, calls: list):
    """The same hooks on either optimizer; each records what it saw in `calls`."""

    def load_pre(o, sd):
        calls.append(("load_pre", sorted(sd)))
        sd = dict(sd)
        sd["param_groups"] = [dict(g, lr=0.5) for g in sd["param_groups"]]  # a new dict: the one loaded
        return sd

    def load_post(o):
        calls.append(("load_post", o.param_groups[0]["lr"]))

    def state_pre(o):
        calls.append(("state_pre",))

    def state_post(o, sd):
        calls.append(("state_post", len(sd["state"])))
        return {**sd, "extra": 1}

    return [opt.register_load_state_dict_pre_hook(load_pre), opt.register_load_state_dict_post_hook(load_post),
            opt.register_state_dict_pre_hook(state_pre), opt.register_state_dict_post_hook(state_post),
            opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("step_pre", o.param_groups[0]["lr"]))),
            opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("step_post",)))]


def test_hooks_run_as_on_torch_adamw():
    """Each of torch.optim's hooks, registered the same way on both, is called at the same points with the
    same effect: a load_state_dict pre-hook's dict is the one loaded, a state_dict post-hook's is returned; step
    hooks run around step() (the fused weights were updated in backward before the pre-hook)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    ours = make_model()
    theirs = copy.deepcopy(ours)
    data = batches(2)
    runs = {}
    for name, model, opt in (("forge", ours, ForgeOptimizer(ours, "adamw", **HYPERS)),
                             ("torch", theirs, torch.optim.AdamW(theirs.parameters(), **HYPERS))):
        calls = runs[name] = []
        handles = _register_hooks(opt, calls)
        handles.append(register_optimizer_step_pre_hook(lambda o, a, k, calls=calls: calls.append(("global_pre",))))
        handles.append(register_optimizer_step_post_hook(lambda o, a, k, calls=calls: calls.append(("global_post",))))
        try:
            train(model, opt, data[:1], loss_of)
            sd = opt.state_dict()
            assert sd["extra"] == 1
            del sd["extra"]
            opt.load_state_dict(sd)
            assert opt.param_groups[0]["lr"] == 0.5
            train(model, opt, data[1:], loss_of)
        finally:
            for handle in handles:
                handle.remove()
    assert runs["forge"] == runs["torch"]
    assert_params_close(ours, theirs)
