"""`ForgeOptimizer.state_dict()` / `load_state_dict()`: metadata in every param group, every state checked
against it before anything changes, foreign dicts refused with what to do, and torch.distributed.checkpoint
keeping the metadata (get/set_optimizer_state_dict, flattened or not, and dcp.save / dcp.load).

Each refusal is checked to leave the optimizer exactly as it was (states, param groups, layout, seed), and
each accepted dict to continue training bit for bit where the original continues.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from forge_dsl import ForgeOptimizer
from forge_dsl.training import checkpoint

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KEY = checkpoint.META_KEY


def make_model(seed=0, dtype=torch.bfloat16):
    """Widths past one int8 block (64) and not multiples of it; a bias, a norm: int8 and fp32 states side by side."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Linear(96, 72, bias=False),
                         nn.Linear(72, 16)).to(DEVICE, dtype)


def batches(n, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(2, 3, 64, generator=gen).to(DEVICE, dtype) for _ in range(n)]


def train(model, opt, xs):
    for x in xs:
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def groups(model):
    """Two param groups: the matrices with weight decay, the rest without. In state-dict order: 0 '0.weight'
    [96, 64], 1 '2.weight' [72, 96], 2 '3.weight' [16, 72], 3 '0.bias', 4 '1.weight', 5 '1.bias' (all [96]),
    6 '3.bias' [16] (fp32 state under "int8": below one block)."""
    params = dict(model.named_parameters())
    return [{"params": [params[n] for n in ("0.weight", "2.weight", "3.weight")]},
            {"params": [params[n] for n in ("0.bias", "1.weight", "1.bias", "3.bias")], "weight_decay": 0.0}]


def trained(spec="adamw", state_dtype="int8", seed=5, steps=2, model=None, **kw):
    model = make_model() if model is None else model
    kw.setdefault("lr", 1e-3 if spec == "lion" else 1e-2)
    opt = ForgeOptimizer(model, spec, model_params=groups(model), state_dtype=state_dtype, seed=seed, **kw)
    train(model, opt, batches(steps))
    return model, opt


def snapshot(opt):
    """Everything load_state_dict may change: states (by parameter order), param groups, layout, rounding, seed."""
    params = [p for g in opt.param_groups for p in g["params"]]
    states = [{k: v.clone() for k, v in opt.state[p].items()} if p in opt.state else None for p in params]
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return states, groups, copy.deepcopy(opt.state_dtype), opt.rounding, opt.seed


def assert_unchanged(opt, before):
    states, groups, state_dtype, rounding, seed = snapshot(opt)
    assert (groups, state_dtype, rounding, seed) == before[1:]
    for a, b in zip(states, before[0]):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.keys() == b.keys()
            for k in a:
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def round_trip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    return torch.load(io.BytesIO(buf.getvalue()), map_location=DEVICE)


# ----------------------------------------------------------------------------
# The metadata
# ----------------------------------------------------------------------------


def test_every_param_group_carries_the_metadata():
    model = make_model()
    opt = ForgeOptimizer(model, "adamw", model_params=groups(model), state_dtype="int8", rounding="nearest", seed=11)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    for group in sd["param_groups"]:
        assert group[KEY] == {"format": 1, "spec": "adamw", "spec_hash": checkpoint.spec_digest(opt.spec),
                              "state_dtype": "int8", "rounding": "nearest", "seed": 11,
                              "without_state": [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2], [1, 3]]}
    sd["param_groups"][0][KEY]["seed"] = 12  # what the caller got is its own
    assert opt.state_dict()["param_groups"][0][KEY]["seed"] == 11


def test_spec_hash_ignores_comments_and_follows_the_math(tmp_path):
    from forge_dsl.api import builtin_path, load_spec

    text = builtin_path("adamw").read_text()
    commented = tmp_path / "a" / "adamw.fopt"
    commented.parent.mkdir()
    commented.write_text("# a comment\n" + text.replace("update {", "update {  # another"))
    changed = tmp_path / "b" / "adamw.fopt"
    changed.parent.mkdir()
    changed.write_text(text.replace("hyper eps = 1e-8", "hyper eps = 1e-6"))
    base = checkpoint.spec_digest(load_spec("adamw"))
    assert checkpoint.spec_digest(load_spec(str(commented))) == base
    assert checkpoint.spec_digest(load_spec(str(changed))) != base

    _, opt = trained()
    sd = opt.state_dict()
    model = make_model(1)
    ForgeOptimizer(model, str(commented), model_params=groups(model)).load_state_dict(round_trip(sd))
    other = ForgeOptimizer(model, str(changed), model_params=groups(model))
    before = snapshot(other)
    with pytest.raises(ValueError, match=r"another version of the spec 'adamw' \(spec hash .*delete 'spec_hash'"):
        other.load_state_dict(round_trip(sd))
    assert_unchanged(other, before)
    for group in sd["param_groups"]:  # the documented way to load it anyway
        del group[KEY]["spec_hash"]
    other.load_state_dict(round_trip(sd))


def test_loaded_layout_seed_and_rounding_become_the_optimizers():
    """An int8 checkpoint loaded into an optimizer built for fp32 state: describe() says int8, and a parameter
    that gets its first state after loading gets int8 state too."""
    model, opt = trained(state_dtype="int8", rounding="nearest", seed=5)
    sd = opt.state_dict()
    fresh = make_model(1)
    opt2 = ForgeOptimizer(fresh, "adamw", model_params=groups(fresh), state_dtype="fp32", seed=123, lr=1e-2)
    before = opt2.describe()
    assert "state fp32" in before and "state held" not in before
    del sd["state"][5]  # the LayerNorm bias ([96]): it gets its first state after loading
    with pytest.warns(UserWarning, match=r"strict=False.*parameter '1.bias'.*fresh state"):
        opt2.load_state_dict(round_trip(sd), strict=False)
    assert (opt2.state_dtype, opt2.rounding, opt2.seed) == ("int8", "nearest", 5)
    text = opt2.describe()
    assert "ForgeOptimizer(adamw, state int8, rounding nearest)" in text
    fp32_weights = ForgeOptimizer(make_model(1, torch.float32), "adamw", rounding="nearest", lr=1e-2).describe()
    assert fp32_weights.splitlines()[0] == "ForgeOptimizer(adamw, state fp32, fp32 weights, written exactly)"
    # fp32 where a last dim is below one block (the [16] bias), int8 / uint8 elsewhere
    assert ("state held: exp_avg int8 (bf16 scales) ×5, fp32 ×1; exp_avg_sq uint8 (sqrt map, bf16 scales) ×5, "
            "fp32 ×1") in text
    train(fresh, opt2, batches(1))
    bias = dict(fresh.named_parameters())["1.bias"]
    assert opt2.state[bias]["exp_avg"].dtype == torch.int8
    assert opt2.state[bias]["exp_avg_sq"].dtype == torch.uint8


def test_a_checkpoint_with_fp32_scales_loads_and_continues_bit_identically():
    """A state dict whose block scales are float32 (every checkpoint from before bf16 scales; made here by
    re-storing trained int8 state with float32 scales) loads bit for bit, keeps its float32 scales as it steps, and
    the loaded optimizer writes what the one that saved it writes; describe() names the scales' dtype. A
    parameter that gets its first state after loading gets new (bf16) scales."""
    from forge_dsl.kernels import layouts as L

    model, opt = trained(state_dtype="int8", rounding="nearest", seed=5)
    for state in opt.state.values():
        for name in [k for k in state if f"{k}.scale" in state]:
            t, scale = state[name], state[f"{name}.scale"]
            layout = L.layout_of(t, scale=scale)
            state[name], state[f"{name}.scale"] = L.quantize(L.dequantize(t, scale, layout), layout,
                                                             scale_dtype=torch.float32)
    sd = opt.state_dict()
    del sd["state"][5]  # the LayerNorm bias ([96]): it gets its first state after loading
    fresh = make_model()
    fresh.load_state_dict(model.state_dict())
    opt2 = ForgeOptimizer(fresh, "adamw", model_params=groups(fresh), state_dtype="int8", rounding="nearest",
                          seed=5, lr=1e-2)
    with pytest.warns(UserWarning, match=r"strict=False.*parameter '1.bias'"):
        opt2.load_state_dict(round_trip(sd), strict=False)
    params, params2 = list(model.parameters()), list(fresh.parameters())
    bias = dict(model.named_parameters())["1.bias"]
    opt.state[bias].clear()  # the saving optimizer starts that parameter afresh too
    assert "exp_avg int8 (fp32 scales) ×5, fp32 ×1;" in opt2.describe(), opt2.describe()
    train(model, opt, batches(2))
    train(fresh, opt2, batches(2))
    for p, p2 in zip(params, params2):
        assert torch.equal(p, p2)
        for k, v in opt.state[p].items():
            v2 = opt2.state[p2][k]
            assert v.dtype == v2.dtype and torch.equal(v.view(torch.uint8) if v.dim() else v, v2.view(torch.uint8)
                                                       if v2.dim() else v2), k
            if k.endswith(".scale"):
                assert v.dtype == (torch.bfloat16 if p is bias else torch.float32), k
    text = opt2.describe()
    assert "exp_avg int8 (fp32 scales) ×5, fp32 ×1, int8 (bf16 scales) ×1;" in text, text


def test_describe_reports_the_layout_held():
    model = make_model(dtype=torch.float32)
    opt = ForgeOptimizer(model, "adamw", state_dtype="bf16")
    train(model, opt, batches(1, torch.float32))
    assert "  state held: bf16" in opt.describe()


def test_legacy_top_level_metadata_still_loads():
    model, opt = trained()
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        del group[KEY]
    sd["forge"] = {"spec": "adamw", "state_dtype": "int8", "rounding": "stochastic", "seed": 5}
    other = make_model(1)
    opt2 = ForgeOptimizer(other, "adamw", model_params=groups(other), lr=1e-2)
    opt2.load_state_dict(round_trip(sd))
    assert opt2.state_dtype == "int8"
    sd["state"][1]["exp_avg"] = sd["state"][1]["exp_avg"].float()  # checked against it like the new metadata
    with pytest.raises(ValueError, match="is torch.float32, but the layout it was saved with"):
        opt2.load_state_dict(sd)


# ----------------------------------------------------------------------------
# Dicts that do not match are refused, before anything changes
# ----------------------------------------------------------------------------


def _set(index, name, fn):
    def corrupt(sd):
        sd["state"][index][name] = fn(sd["state"][index][name])
    return corrupt


def _delete(index, name):
    def corrupt(sd):
        del sd["state"][index][name]
    return corrupt


def _meta(**changes):
    def corrupt(sd):
        for group in sd["param_groups"]:
            group[KEY].update(changes)
    return corrupt


def _group(**changes):
    def corrupt(sd):
        sd["param_groups"][0].update(changes)
    return corrupt


def _first_group_meta(**changes):
    def corrupt(sd):
        sd["param_groups"][0][KEY] = {**sd["param_groups"][0][KEY], **changes}
    return corrupt


def _state_entry(index, name, value):
    def corrupt(sd):
        sd["state"][index][name] = value
    return corrupt


CORRUPTIONS = {
    # int8 codes cast to float32 (what dcp.load into an fp32 optimizer's state does), scales kept or not
    "codes-cast-to-float32": (_set(1, "exp_avg", lambda t: t.float()),
                              r"'exp_avg' of parameter '2.weight' is torch.float32, but the layout it was saved with "
                              r"\(state_dtype 'int8'\) stores it as int8 codes with a float32 or bfloat16 "
                              r"'exp_avg.scale' of shape \(72, 2\).*Construct the optimizer with state_dtype='int8'"),
    "signed-codes-viewed-as-uint8": (_set(1, "exp_avg", lambda t: t.view(torch.uint8)),
                                     r"'exp_avg' of parameter '2.weight' is torch.uint8.*int8 codes"),
    "unsigned-codes-viewed-as-int8": (_set(1, "exp_avg_sq", lambda t: t.view(torch.int8)),
                                      r"'exp_avg_sq' of parameter '2.weight' is torch.int8.*uint8 codes \(the sqrt "
                                      r"map"),
    "bf16-for-fp32": (_set(6, "exp_avg", lambda t: t.to(torch.bfloat16)),
                      r"'exp_avg' of parameter '3.bias' is torch.bfloat16.*stores it as torch.float32"),
    "scale-dropped": (_delete(1, "exp_avg.scale"), r"int8 'exp_avg' of parameter '2.weight' has no 'exp_avg.scale'"),
    "scale-shape": (_set(1, "exp_avg.scale", lambda t: t[:, :1]),
                    r"'exp_avg.scale' of parameter '2.weight' is torch.bfloat16 of shape \(72, 1\); int8 "
                    r"'exp_avg' needs float32 or bfloat16 of shape \(72, 2\)"),
    "scale-dtype": (_set(1, "exp_avg.scale", lambda t: t.double()), r"'exp_avg.scale'.*is torch.float64"),
    "scale-on-fp32-state": (_state_entry(6, "exp_avg.scale", torch.ones(1, 1)),
                            r"entries \['exp_avg.scale'\] that adamw with state_dtype 'int8' does not keep"),
    "state-shape": (_set(1, "exp_avg", lambda t: t.t().contiguous()),
                    r"'exp_avg' of parameter '2.weight' has shape \(96, 72\), the parameter \(72, 96\)"),
    "state-missing": (_delete(1, "exp_avg_sq"), r"parameter '2.weight' has no 'exp_avg_sq'"),
    "state-not-a-tensor": (_set(1, "exp_avg", lambda t: t.tolist()), r"'exp_avg' of parameter '2.weight' is a list"),
    "no-step": (_delete(0, "step"), r"state of parameter '0.weight' has no 'step'"),
    "no-seed": (_delete(0, "seed"), r"state of parameter '0.weight' has no 'seed'"),
    "step-fraction": (_set(0, "step", lambda t: t + 0.5),
                      r"step of parameter '0.weight' is 2.5; a step count is a whole"),
    "step-nan": (_set(0, "step", lambda t: t * float("nan")), r"step of parameter '0.weight' is nan"),
    "step-negative": (_set(0, "step", lambda t: -t), r"step of parameter '0.weight' is -2.0"),
    "step-vector": (_set(0, "step", lambda t: t.repeat(2)), r"step of parameter '0.weight' is a torch.float64 tensor "
                                                             r"of shape \(2,\)"),
    "seed-fraction": (_set(0, "seed", lambda t: t.double() + 0.5), r"seed of parameter '0.weight' must be an integer"),
    "seed-string": (_state_entry(0, "seed", "x"), r"seed of parameter '0.weight' must be an integer, got str 'x'"),
    "unknown-entry": (_state_entry(0, "momentum_buffer", torch.zeros(96, 64)),
                      r"entries \['momentum_buffer'\] that adamw .* does not keep \(its states: exp_avg, exp_avg_sq, "
                      r"max_exp_avg_sq\)"),
    "unknown-parameter": (lambda sd: sd["state"].__setitem__(99, sd["state"][0]),
                          r"state for parameter 99, which none"),
    "other-spec": (_meta(spec="lion"), r"state_dict is for optimizer 'lion', this one runs 'adamw'"),
    "other-format": (_meta(format=2), r"format 2, this forge_dsl reads format 1"),
    "bad-layout-name": (_meta(state_dtype="int2"), r"state_dtype 'int2': unknown state layout 'int2'"),
    "layout-type": (_meta(state_dtype=8), r"state_dtype 8; expected a layout name"),
    "bad-rounding": (_meta(rounding="up"), r"rounding 'up'; expected one of"),
    "bad-seed": (_meta(seed=None), r"metadata seed must be an integer, got NoneType"),
    "groups-disagree": (_first_group_meta(seed=6), r"param groups disagree on their '_forge' entries"),
    "metadata-not-a-dict": (lambda sd: [g.__setitem__(KEY, "adamw") for g in sd["param_groups"]],
                            r"'_forge' entry is a str, not the dict"),
    "bad-hyperparameter": (_group(lr=-1.0), r"param group 0: Invalid lr: -1.0; adamw expects a value in \[0, inf\)"),
    "flag-needs-a-state": (_group(amsgrad=True), r"parameter '\d\.weight' has no 'max_exp_avg_sq'"),
    "group-sizes": (lambda sd: sd["param_groups"][0]["params"].pop(), r"different number of param groups"),
}


@pytest.fixture(scope="module")
def saved():
    """State dicts of two steps of int8 and of fp32 state (serialized: each test loads its own copy)."""
    return {layout: round_trip(trained(state_dtype=layout)[1].state_dict()) for layout in ("int8", "fp32")}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_dict_that_does_not_match_is_refused_and_changes_nothing(name, saved):
    corrupt, message = CORRUPTIONS[name]
    sd = round_trip(saved["int8"])
    corrupt(sd)
    model = make_model(1)
    opt = ForgeOptimizer(model, "adamw", model_params=groups(model), seed=1)
    opt.load_state_dict(round_trip(saved["fp32"]))  # some state already: it must survive
    before = snapshot(opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    assert_unchanged(opt, before)


def test_a_scalar_state_is_checked():
    _, source = trained("nadam")
    sd = round_trip(source.state_dict())
    del sd["state"][0]["mu_product"]
    _, opt = trained("nadam", steps=1)
    before = snapshot(opt)
    with pytest.raises(ValueError, match="parameter '0.weight' has no scalar state 'mu_product'"):
        opt.load_state_dict(sd)
    assert_unchanged(opt, before)
    sd["state"][0]["mu_product"] = torch.ones(3)
    with pytest.raises(ValueError, match="scalar state 'mu_product' of parameter '0.weight' is a torch.float32 tensor "
                                         r"of shape \(3,\)"):
        opt.load_state_dict(sd)


def test_not_a_state_dict_is_a_type_error():
    _, opt = trained(steps=1)
    with pytest.raises(TypeError, match="expects a dict with 'state' and 'param_groups'.*got list"):
        opt.load_state_dict([1, 2])


def test_torch_adamw_state_dict_is_refused_with_what_to_do():
    model = make_model(dtype=torch.float32)
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(batches(1, torch.float32)[0]).pow(2).mean().backward()
    ref.step()
    other = make_model(1, torch.float32)
    opt = ForgeOptimizer(other, "adamw", model_params=groups(other), lr=1e-2)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"no FORGE metadata .*its states hold exp_avg, exp_avg_sq, step and no "
                                         r"rounding seed: it looks like a torch.optim optimizer's.*start this "
                                         r"optimizer from fresh state: load only the model's weights"):
        opt.load_state_dict(ref.state_dict())
    assert_unchanged(opt, before)


def test_dict_without_metadata_is_refused():
    _, source = trained()
    sd = source.state_dict()
    for group in sd["param_groups"]:
        del group[KEY]
    with pytest.raises(ValueError, match=r"no FORGE metadata \(the '_forge' entry"):
        trained(steps=0)[1].load_state_dict(sd)


# ----------------------------------------------------------------------------
# An entry lost after saving, a parameter never stepped
# ----------------------------------------------------------------------------


def test_a_lost_state_entry_is_refused_naming_the_parameter(saved):
    sd = round_trip(saved["int8"])
    del sd["state"][4]  # '1.weight', the LayerNorm weight: stepped by the optimizer that saved the dict
    model = make_model(1)
    opt = ForgeOptimizer(model, "adamw", model_params=groups(model), seed=1)
    opt.load_state_dict(round_trip(saved["fp32"]))  # some state already: it must survive
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"no state for parameter '1.weight', which the optimizer that saved it "
                                         r"had stepped.*load_state_dict\(state_dict, strict=False\)"):
        opt.load_state_dict(sd)
    assert_unchanged(opt, before)
    with pytest.warns(UserWarning, match=r"strict=False.*parameter '1.weight'.*fresh state"):
        opt.load_state_dict(sd, strict=False)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert not opt.state.get(params[4]) and all(opt.state[p] for i, p in enumerate(params) if i != 4)


def test_a_parameter_never_stepped_loads_without_state():
    """torch's state dicts have no entry for a parameter without state; neither do FORGE's, and its metadata
    says it was never stepped: the dict loads as it is, without a warning."""
    import warnings

    model = make_model()
    model[1].bias.requires_grad_(False)  # in its param group, but never gets a gradient
    _, opt = trained(model=model)
    sd = round_trip(opt.state_dict())
    assert 5 not in sd["state"]
    other = make_model(1)
    opt2 = ForgeOptimizer(other, "adamw", model_params=groups(other), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt2.load_state_dict(sd)
    assert not opt2.state.get(other[1].bias) and len(opt2.state) == 6


# ----------------------------------------------------------------------------
# The step counter: exact past 2**24, and torch's AdamW reads it
# ----------------------------------------------------------------------------


def test_the_step_counter_counts_exactly_past_2_to_the_24():
    """float32, torch.optim's step dtype, has no 2**24 + 1: a float32 counter stops there."""
    model = make_model(dtype=torch.float32)
    opt = ForgeOptimizer(model, "adamw", model_params=groups(model), lr=1e-2)
    train(model, opt, batches(1, torch.float32))
    sd = opt.state_dict()
    for state in sd["state"].values():
        state["step"] = torch.tensor(2 ** 24 + 1, dtype=torch.int64)
    opt.load_state_dict(sd)
    train(model, opt, batches(2, torch.float32))
    steps = [state["step"] for state in opt.state.values()]
    assert len(steps) == 7 and all(s.dtype == torch.float64 and int(s) == 2 ** 24 + 3 for s in steps), steps


def test_a_state_dict_round_trips_through_torch_adamw():
    """FORGE, then torch.optim.AdamW from FORGE's state dict, then FORGE from torch's: one AdamW run. torch keeps
    the float64 step as it is, and carries FORGE's metadata and seeds along."""
    from training_models import assert_params_close

    ours = make_model(dtype=torch.float32)
    theirs = copy.deepcopy(ours)
    data = batches(6, torch.float32)
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2), data)
    opt = ForgeOptimizer(ours, "adamw", lr=1e-2)
    train(ours, opt, data[:2])
    opt.detach()
    middle = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    middle.load_state_dict(opt.state_dict())
    train(ours, middle, data[2:4])
    assert all(state["step"].dtype == torch.float64 for state in middle.state.values())
    again = ForgeOptimizer(ours, "adamw", lr=1e-2)
    again.load_state_dict(middle.state_dict())
    train(ours, again, data[4:])
    assert all(int(state["step"]) == 6 for state in again.state.values())
    assert_params_close(ours, theirs)


# ----------------------------------------------------------------------------
# torch.distributed.checkpoint keeps the metadata
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def assert_states_equal(opt_a, opt_b):
    params_a = [p for g in opt_a.param_groups for p in g["params"]]
    params_b = [p for g in opt_b.param_groups for p in g["params"]]
    for pa, pb in zip(params_a, params_b):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].cpu(), sb[k].cpu()), k


@pytest.mark.parametrize("flatten", [False, pytest.param(True, marks=pytest.mark.slow)],  # quick: the default
                         ids=["nested", "flattened"])
def test_dcp_state_dict_round_trip_keeps_the_metadata(process_group, tmp_path, flatten):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model, opt = trained(state_dtype="int8", seed=5)
    saved = get_optimizer_state_dict(model, opt, options=options)
    dcp.save({"optim": saved}, checkpoint_id=str(tmp_path))

    fresh = make_model(1)
    fresh.load_state_dict(model.state_dict())
    opt2 = ForgeOptimizer(fresh, "adamw", model_params=groups(fresh), state_dtype="int8", seed=9, lr=1e-2)
    target = {"optim": get_optimizer_state_dict(fresh, opt2, options=options)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(fresh, opt2, target["optim"], options=options)
    assert opt2.seed == 5
    assert_states_equal(opt, opt2)
    # straight into an optimizer that never made a state dict: set_optimizer_state_dict's first step makes its
    # state, and with it the param-group entry that a flattened dict's metadata is read back into
    third = make_model(2)
    opt3 = ForgeOptimizer(third, "adamw", model_params=groups(third), state_dtype="int8", seed=9, lr=1e-2)
    set_optimizer_state_dict(third, opt3, round_trip(saved), options=options)
    assert opt3.seed == 5
    assert_states_equal(opt, opt3)
    xs = batches(3)[1:]
    train(model, opt, xs)
    train(fresh, opt2, xs)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def _dcp_save_and_load_into(tmp_path, source_opt, source_model, target_opt, target_model):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    dcp.save({"optim": get_optimizer_state_dict(source_model, source_opt)}, checkpoint_id=str(tmp_path))
    target = {"optim": get_optimizer_state_dict(target_model, target_opt)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(target_model, target_opt, target["optim"])


def test_dcp_adamw_checkpoint_is_refused_by_lion(process_group, tmp_path):
    """Refused in set_optimizer_state_dict. dcp.load has written AdamW's exp_avg into Lion's own state tensors
    by then (it loads into the tensors get_optimizer_state_dict returned): only the rest is left as it was."""
    model, opt = trained("adamw")
    other, lion = trained("lion", steps=1, model=make_model(1))
    before = snapshot(lion)
    with pytest.raises(ValueError, match="state_dict is for optimizer 'adamw', this one runs 'lion'"):
        _dcp_save_and_load_into(tmp_path, opt, model, lion, other)
    assert snapshot(lion)[1:] == before[1:]


def test_dcp_int8_checkpoint_into_fp32_state_is_refused(process_group, tmp_path):
    """dcp.load reads the int8 codes into the fp32 tensors of the state dict it is handed."""
    model, opt = trained(state_dtype="int8")
    other = make_model(1)
    fp32 = ForgeOptimizer(other, "adamw", model_params=groups(other), state_dtype="fp32", lr=1e-2)
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter '0.weight' is torch.float32, but the layout it was "
                                         r"saved with \(state_dtype 'int8'\).*dcp.load read it into this optimizer's "
                                         r"own state.*Construct the optimizer with state_dtype='int8'"):
        _dcp_save_and_load_into(tmp_path, opt, model, fp32, other)
