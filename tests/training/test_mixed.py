"""Param groups that name their own spec (training/mixed.py): Muon for the hidden matrices and AdamW for the rest
in one ForgeOptimizer, against torch.optim.Muon + torch.optim.AdamW; keywords, state dicts, hooks and refusals."""

from __future__ import annotations

import pytest
import torch

import forge_dsl
from forge_dsl import ForgeOptimizer
from forge_dsl.training.mixed import MixedSpecOptimizer
from training_models import llama_batches, llama_loss, make_llama, rel_err, twin

MUON = dict(lr=2e-3, weight_decay=0.05, momentum=0.9, ns_steps=4, eps=1e-6, ns_coefficients=(3.0, -4.0, 2.0))
ADAMW = dict(lr=1e-3, weight_decay=0.02, betas=(0.8, 0.95))
# Newton-Schulz runs in bfloat16 in both: ten steps' total update agrees to bfloat16's precision (test_phases.py)
UPDATE_TOL = 1e-2


def split(model):
    """(the decoder layers' matrices, every other parameter): Muon's share and AdamW's."""
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and "layers." in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "layers." in n)]
    return hidden, rest


def torch_pair(model):
    hidden, rest = split(model)
    return [torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, **ADAMW)]


def groups(model):
    hidden, rest = split(model)
    return [{"params": hidden}, {"params": rest, "spec": "adamw", **ADAMW}]


def train(model, opts, batches):
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (1 + step)) for o in opts]
    for ids in batches:
        for o in opts:
            o.zero_grad()
        llama_loss(model, ids).backward()
        for o in opts:
            o.step()
        for s in scheds:
            s.step()


def assert_updates_close(ours, theirs, start):
    theirs = dict(theirs.named_parameters())
    errors = {n: rel_err(p.detach() - start[n], theirs[n].detach() - start[n]) for n, p in ours.named_parameters()}
    assert all(e <= UPDATE_TOL for e in errors.values()), {n: f"{e:.2e}" for n, e in errors.items() if e > UPDATE_TOL}
    for n, p in ours.named_parameters():
        assert (p.detach() - start[n]).norm() > 1e-4 * start[n].norm(), f"{n} did not move"


@pytest.mark.parametrize("params_first", [False, True])
def test_muon_and_adamw_groups_equal_torch_muon_and_adamw(params_first):
    """One ForgeOptimizer, Muon (the optimizer's spec) on the hidden matrices fused into backward and AdamW (a group
    naming its spec) on the rest, with one LR schedule over both: ten steps equal to torch's two optimizers."""
    theirs = make_llama()
    ours = twin(theirs, make_llama)
    start = {n: p.detach().clone() for n, p in ours.named_parameters()}
    if params_first:
        forge_dsl.fuse(ours)
        opt = ForgeOptimizer(groups(ours), "muon", **MUON)
    else:
        opt = ForgeOptimizer(ours, "muon", model_params=groups(ours), **MUON)
    assert isinstance(opt, MixedSpecOptimizer) and isinstance(opt, torch.optim.Optimizer)
    assert all(isinstance(o, ForgeOptimizer) for o in opt.optimizers)
    assert [o.spec.name for o in opt.optimizers] == ["muon", "adamw"]
    assert [g["spec"] for g in opt.param_groups] == ["muon", "adamw"]
    hidden, rest = split(ours)
    assert set(opt._handles) >= set(hidden)  # every hidden matrix fused into backward
    train(theirs, torch_pair(theirs), llama_batches(10))
    train(ours, [opt], llama_batches(10))
    assert_updates_close(ours, theirs, start)
    assert opt.param_groups[0]["lr"] == pytest.approx(MUON["lr"] / 11)  # the schedule reached both groups
    assert opt.param_groups[1]["lr"] == pytest.approx(ADAMW["lr"] / 11)
    assert set(opt.state[hidden[0]]) == {"momentum_buffer", "step", "seed"}
    assert {"exp_avg", "exp_avg_sq"} <= set(opt.state[rest[0]])
    opt.detach()


def test_lm_head_loss_goes_to_the_spec_that_holds_the_head():
    """lm_head_loss=True with Muon and AdamW groups: the loss without logits, the head updated by AdamW's
    optimizer a vocabulary block at a time in backward; ten steps equal to torch's two optimizers."""
    theirs = make_llama()
    ours = twin(theirs, make_llama)
    start = {n: p.detach().clone() for n, p in ours.named_parameters()}
    opt = ForgeOptimizer(ours, "muon", model_params=groups(ours), lm_head_loss=True, **MUON)
    assert [len(o._head_installs) for o in opt.optimizers] == [0, 1]
    assert ours(input_ids=llama_batches(1)[0], labels=llama_batches(1)[0]).logits is None  # no logits stored
    train(theirs, torch_pair(theirs), llama_batches(10))
    train(ours, [opt], llama_batches(10))
    assert_updates_close(ours, theirs, start)
    opt.detach()
    model = make_llama()
    hidden, rest = split(model)
    with pytest.raises(ValueError, match="no param group holds the model's LM head weight"):
        ForgeOptimizer(model, "muon", lm_head_loss=True, model_params=[
            {"params": hidden}, {"params": [p for p in rest if p is not model.lm_head.weight], "spec": "adamw"}])


def test_keywords_of_a_group_of_another_spec_are_its_own():
    """The optimizer's keywords are the defaults of its own spec's groups only: an AdamW group without lr takes
    AdamW's default, not Muon's lr."""
    model = make_llama()
    hidden, rest = split(model)
    opt = ForgeOptimizer(model, "muon", model_params=[{"params": hidden}, {"params": rest, "spec": "adamw"}],
                         lr=0.02, momentum=0.9)
    muon, adamw = opt.param_groups
    assert muon["lr"] == 0.02 and muon["momentum"] == 0.9
    assert adamw["lr"] == 1e-3 and "momentum" not in adamw and adamw["betas"] == (0.9, 0.999)
    assert opt.optimizers[1].seed == opt.optimizers[0].seed + 1  # the second spec draws its own rounding bits
    assert opt.describe().startswith("MixedSpecOptimizer (muon: groups 0; adamw: groups 1)\nForgeOptimizer(muon")
    opt.seed, opt.rounding = 10, "nearest"  # set on every spec's optimizer
    assert [o.seed for o in opt.optimizers] == [10, 11] and opt.seed == 10
    assert [o.rounding for o in opt.optimizers] == ["nearest"] * 2 and opt.rounding == "nearest"
    opt.optimizers[1].state_dtype = "bf16"  # where the specs differ, each one's by name
    assert opt.state_dtype == {"muon": "fp32", "adamw": "bf16"}
    opt.optimizers[0].state_dtype = {"momentum_buffer": "bf16"}  # a layout per state name
    assert opt.state_dtype == {"muon": {"momentum_buffer": "bf16"}, "adamw": "bf16"}
    opt.detach()


def test_state_dict_round_trip_continues_training_equally():
    """state_dict() numbers parameters in the groups' order (as torch's does) and load_state_dict() into a fresh
    mixed optimizer continues exactly as the original; a dict of which one spec's share does not fit is refused
    whole."""
    models = [make_llama(), make_llama()]
    opts = [ForgeOptimizer(m, "muon", model_params=groups(m), **MUON) for m in models]
    train(models[0], [opts[0]], llama_batches(2))
    sd = opts[0].state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [list(range(len(split(models[0])[0]))),
                                                         list(range(len(split(models[0])[0]),
                                                                    len(list(models[0].parameters()))))]
    assert [g["_forge"]["spec"] for g in sd["param_groups"]] == ["muon", "adamw"]
    models[1].load_state_dict(models[0].state_dict())
    with pytest.raises(ValueError, match="doesn't match the size"):  # the groups in another order
        opts[1].load_state_dict({**sd, "param_groups": sd["param_groups"][::-1]})
    # Muon's share fits, AdamW's was saved by another spec: refused before Muon's share loads
    muon_group, adamw_group = (dict(g) for g in sd["param_groups"])
    adamw_group["_forge"] = {**adamw_group["_forge"], "spec": "lion"}
    with pytest.raises(ValueError, match="state_dict is for optimizer 'lion', this one runs 'adamw'"):
        opts[1].load_state_dict({**sd, "param_groups": [muon_group, adamw_group]})
    assert len(opts[1].state) == 0 and opts[1].param_groups[0]["lr"] == MUON["lr"]
    seen = []
    opts[1].register_load_state_dict_pre_hook(lambda o, d: seen.append(sorted(d)))
    opts[1].register_load_state_dict_post_hook(lambda o: seen.append("loaded"))
    opts[0].register_state_dict_post_hook(lambda o, d: {**d, "note": 1})
    assert opts[0].state_dict()["note"] == 1  # torch's state_dict hooks run on the mixed optimizer's dict
    opts[1].load_state_dict(sd)
    assert seen[-2:] == [["param_groups", "state"], "loaded"]
    for model, opt in zip(models, opts):
        for ids in llama_batches(2, seed=7):
            opt.zero_grad()
            llama_loss(model, ids).backward()
            opt.step()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), name
    for opt in opts:
        opt.detach()


def test_step_hooks_run_once_and_add_param_group_routes_by_spec():
    model = make_llama()
    hidden, rest = split(model)
    opt = ForgeOptimizer(model, "muon", model_params=[{"params": hidden[1:]}, {"params": rest, "spec": "adamw"}])
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    opt.add_param_group({"params": [hidden[0]]})  # Muon's, the optimizer's spec
    assert [g["spec"] for g in opt.param_groups] == ["muon", "adamw", "muon"]
    assert hidden[0] in opt.optimizers[0]._param_index
    llama_loss(model, llama_batches(1)[0]).backward()
    opt.step()
    assert calls == ["pre", "post"]
    opt.detach()


@pytest.mark.parametrize("where", ["backward", "step"])
def test_a_step_refused_by_one_spec_changes_no_weight_of_any(where):
    """An LR schedule that wrote NaN into one spec's group: the step is refused before any weight moves, though
    the other spec's update comes first: in backward, AdamW's fused head before Muon's matrices (NaN in Muon's
    group); in step() (fuse=False), Muon's before AdamW's (NaN in AdamW's group)."""
    model = make_llama()
    opt = ForgeOptimizer(model, "muon", model_params=groups(model), fuse=where == "backward", **MUON)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    if where == "backward":
        opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="lr"):
        llama_loss(model, llama_batches(1)[0]).backward()
        opt.param_groups[1]["lr"] = float("nan")
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), weights[n]), n
    opt.detach()


@pytest.mark.parametrize("option", [dict(max_grad_norm=1.0, accumulation_steps=2), dict(capturable=True)])
def test_options_of_one_optimizer_are_refused_before_anything_changes(option):
    model = make_llama()
    forwards = {n: m.forward for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=f"{next(iter(option))}= .*param groups of several specs"):
        ForgeOptimizer(model, "muon", model_params=groups(model), **option)
    assert all(m.forward == forwards[n] for n, m in model.named_modules())  # nothing installed


def test_keywords_for_a_spec_no_group_uses_are_refused():
    """ForgeOptimizer(model, "muon", lr=...) whose every group names another spec: the keywords would step nothing."""
    model = make_llama()
    with pytest.raises(ValueError, match="no param group is stepped by 'muon'.*lr"):
        ForgeOptimizer(model, "muon", lr=0.02, model_params=[{"params": list(model.parameters()), "spec": "adamw"}])


def test_another_spec_where_it_cannot_be_honoured_is_refused():
    """A group naming another spec in a generator (read once, by torch) or added to a one-spec optimizer would be
    stepped with the wrong spec: refused, naming what to do."""
    model = make_llama()
    hidden, rest = split(model)
    with pytest.raises(ValueError, match="names the spec 'adamw'.*a list"):
        ForgeOptimizer(model, "muon", model_params=(g for g in groups(model)))
    opt = ForgeOptimizer(model, "muon", model_params=hidden)
    with pytest.raises(ValueError, match="names the spec 'adamw'"):
        opt.add_param_group({"params": rest, "spec": "adamw"})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": rest[:1], "spec": "muon"})  # its own spec: accepted
    opt.detach()


def test_clipping_after_a_plain_backward_takes_the_global_norm():
    """fuse=False, max_grad_norm=c and a plain loss.backward() (nothing fused: no two passes): step() clips every
    spec's .grad by the norm of all of them, as clip_grad_norm_(all parameters, c), not each by its own."""
    sgd = dict(lr=0.05, momentum=0.9)
    theirs = make_llama()
    ours = twin(theirs, make_llama)
    hidden, rest = split(theirs)
    ref = [torch.optim.SGD(hidden, **sgd), torch.optim.AdamW(rest, **ADAMW)]
    hidden, rest = split(ours)
    opt = ForgeOptimizer(ours, "sgd_momentum", max_grad_norm=0.05, fuse=False, **sgd,
                         model_params=[{"params": hidden}, {"params": rest, "spec": "adamw", **ADAMW}])
    for ids in llama_batches(3):
        for o in ref:
            o.zero_grad()
        llama_loss(theirs, ids).backward()
        norm = torch.nn.utils.clip_grad_norm_(list(theirs.parameters()), 0.05)
        for o in ref:
            o.step()
        opt.zero_grad()
        llama_loss(ours, ids).backward()
        opt.step()
        assert norm > 0.05 and rel_err(opt.last_grad_norm, norm) < 1e-4
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert rel_err(p.detach(), q.detach()) < 1e-5, name


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
def test_clipping_by_the_global_norm_of_every_spec(max_norm):
    """max_grad_norm=c with SGD-momentum and AdamW groups (Muon, in phases, refuses clipping): one global norm over
    both specs' gradients (the fused ones measured in backward's first pass), as
    torch.nn.utils.clip_grad_norm_(all parameters, c) before torch's two steps; ten steps where it clips (0.05)
    and where it does not (1e3)."""
    sgd = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    theirs = make_llama()
    ours = twin(theirs, make_llama)
    start = {n: p.detach().clone() for n, p in ours.named_parameters()}
    hidden, rest = split(theirs)
    ref = [torch.optim.SGD(hidden, **sgd), torch.optim.AdamW(rest, **ADAMW)]
    hidden, rest = split(ours)
    opt = ForgeOptimizer(ours, "sgd_momentum", max_grad_norm=max_norm, **sgd,
                         model_params=[{"params": hidden}, {"params": rest, "spec": "adamw", **ADAMW}])
    assert set(opt._handles) >= set(hidden)
    norms = []
    for ids in llama_batches(10):
        for o in ref:
            o.zero_grad()
        llama_loss(theirs, ids).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(list(theirs.parameters()), max_norm))
        for o in ref:
            o.step()
        opt.zero_grad()
        opt.backward(llama_loss(ours, ids))
        assert rel_err(opt.last_grad_norm, norms[-1]) < 1e-4
        assert opt.optimizers[1].last_grad_norm is opt.last_grad_norm
        opt.step()
    assert (min(norms) > max_norm) == (max_norm < 1)  # clipped at every step, or never
    theirs = dict(theirs.named_parameters())
    for n, p in ours.named_parameters():
        assert rel_err(p.detach() - start[n], theirs[n].detach() - start[n]) < 1e-4, n
    opt.detach()


def test_distributed_checkpoint_state_dict_round_trip():
    """torch.distributed.checkpoint's get/set_optimizer_state_dict (keys by parameter name) carry both specs'
    states of a mixed optimizer."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    models = [make_llama(), make_llama(seed=3)]
    opts = [ForgeOptimizer(m, "muon", model_params=groups(m), **MUON) for m in models]
    train(models[0], [opts[0]], llama_batches(1))
    saved = get_optimizer_state_dict(models[0], opts[0])
    assert "model.layers.0.mlp.up_proj.weight" in saved["state"] and "lm_head.weight" in saved["state"]
    set_optimizer_state_dict(models[1], opts[1], saved)
    ours, theirs = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for i, values in ours.items():
        for key, value in values.items():
            assert torch.equal(value, theirs[i][key]), (i, key)
    for opt in opts:
        opt.detach()


@pytest.mark.slow  # about 20 s in the interpreter
def test_fullgraph_compiled_steps_equal_eager_steps():
    """A mixed optimizer (SGD-momentum on the decoder's matrices, AdamW on the rest) under
    torch.compile(fullgraph=True): the same bits as eager steps, every fused layer of both specs in the graph."""
    sgd = dict(lr=0.05, momentum=0.9)

    def build(model):
        hidden, rest = split(model)
        return ForgeOptimizer(model, "sgd_momentum", **sgd,
                              model_params=[{"params": hidden}, {"params": rest, "spec": "adamw", **ADAMW}])

    eager = make_llama()
    compiled = twin(eager, make_llama)
    opts = [build(eager), build(compiled)]
    runner = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    for model, opt in ((eager, opts[0]), (runner, opts[1])):
        for ids in llama_batches(3):
            opt.zero_grad()
            llama_loss(model, ids).backward()
            opt.step()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(p, q), name
    assert len(opts[1]._handles) == len(opts[0]._handles) > len(split(eager)[0])  # both specs' layers fused
    for opt in opts:
        opt.detach()
