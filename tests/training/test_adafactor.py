"""The built-in `adafactor` (states per row and per column, a region between the phases: spec/phases.py) against
torch.optim.Adafactor: fused into backward and stepped from .grad, every keyword, matrices and vectors, an MLP and
a tiny Llama; its state dict; and what it refuses."""

from __future__ import annotations

import pytest
import torch

import forge_dsl
from forge_dsl import ForgeOptimizer
from forge_dsl.spec.keywords import resolve_hypers
from forge_dsl.spec.phases import plan
from training_models import (DEVICE, assert_params_close, llama_batches, llama_loss, make_llama, make_mlp,
                             mlp_batches, mlp_loss, rel_err, train, twin)

# every keyword off its default; eps1 given (torch's default None: the weight dtype's epsilon, the other case)
KEYWORDS = dict(lr=0.03, beta2_decay=-0.6, eps=(1e-5, 2e-3), d=1.5, weight_decay=0.02, maximize=True)


@pytest.mark.parametrize("kw", [{}, KEYWORDS], ids=["defaults", "every-keyword"])
@pytest.mark.parametrize("path", ["fused", "slab", "step"])
def test_adafactor_equals_torch_adafactor(path, kw):
    """Ten steps of an MLP with biases and a LayerNorm (vectors: the unfactored path, stepped from .grad) against
    torch.optim.Adafactor, fp32 throughout; the factored second moments against torch's row_var / col_var."""
    theirs = make_mlp()
    ours = twin(theirs, make_mlp)
    ref = torch.optim.Adafactor(theirs.parameters(), **kw)
    fuse = path != "step"
    opt = ForgeOptimizer(ours, "adafactor", fuse=fuse, linear_path=path if fuse else "auto", **kw)
    assert len(opt._handles) == (3 if fuse else 0)  # its three Linear weights
    batches = mlp_batches(10)
    train(theirs, ref, batches, mlp_loss)
    train(ours, opt, batches, mlp_loss)
    assert_params_close(ours, theirs)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        mine, torchs = opt.state[p], ref.state[q]
        assert set(mine) == {"row_var", "col_var", "step", "seed"}  # the transient is not state
        if p.dim() == 2:
            assert mine["row_var"].shape == (p.shape[0],) and mine["col_var"].shape == (p.shape[1],)
            assert rel_err(mine["row_var"], torchs["row_var"].reshape(-1)) <= 1e-5
            assert rel_err(mine["col_var"], torchs["col_var"].reshape(-1)) <= 1e-5
        else:  # a vector's second moment, whole
            assert rel_err(mine["row_var"], torchs["variance"]) <= 1e-5
        assert int(mine["step"]) == 10


def test_adafactor_default_eps1_is_the_weight_dtypes_epsilon():
    """eps=(None, ...): torch takes torch.finfo(p.dtype).eps. On bf16 weights that is 2**-7, which dominates a
    small second moment: the bf16 run against torch's on the same bf16 weights (fp32 state and arithmetic here,
    bf16 in torch), and against the reference step with eps1 = 2**-23 (fp32's), which it must not equal."""
    def make(seed=0):
        return make_mlp(seed, dtype=torch.bfloat16)

    theirs = make()
    ours = twin(theirs, make)
    start = {n: p.detach().clone() for n, p in ours.named_parameters()}
    ref = torch.optim.Adafactor(theirs.parameters(), lr=0.05)
    opt = ForgeOptimizer(ours, "adafactor", lr=0.05, rounding="nearest")
    batches = mlp_batches(4, dtype=torch.bfloat16)
    train(theirs, ref, batches, mlp_loss)
    train(ours, opt, batches, mlp_loss)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        moved, theirs_moved = p.detach().float() - start[name].float(), q.detach().float() - start[name].float()
        assert rel_err(moved, theirs_moved) <= 0.05, name  # bf16 weights rounded each step, both ways


def test_adafactor_on_a_tiny_llama():
    """The whole model in one Adafactor (embeddings stepped from .grad, the Linears and the head fused)."""
    theirs = make_llama()
    ours = twin(theirs, make_llama)
    ref = torch.optim.Adafactor(theirs.parameters(), lr=5e-3, weight_decay=0.01)
    opt = ForgeOptimizer(ours, "adafactor", lr=5e-3, weight_decay=0.01)
    assert opt._handles  # the Linears are fused
    for ids in llama_batches(6):
        for model, o in ((theirs, ref), (ours, opt)):
            o.zero_grad()
            llama_loss(model, ids).backward()
            o.step()
    assert_params_close(ours, theirs)


def test_adafactor_state_dict_round_trip_continues_the_train():
    """Five steps, the state dict into a fresh model and optimizer, five more: equal to ten in one run."""
    one = make_mlp()
    other = twin(one, make_mlp)
    batches = mlp_batches(10)
    opt_one = ForgeOptimizer(one, "adafactor", **KEYWORDS)
    train(one, opt_one, batches, mlp_loss)
    opt_a = ForgeOptimizer(other, "adafactor", **KEYWORDS)
    train(other, opt_a, batches[:5], mlp_loss)
    third = twin(other, make_mlp)
    opt_b = ForgeOptimizer(third, "adafactor", **KEYWORDS)
    opt_b.load_state_dict(opt_a.state_dict())
    train(third, opt_b, batches[5:], mlp_loss)
    assert_params_close(third, one, tol=1e-6)


def test_a_state_dict_with_a_row_state_of_another_size_is_refused():
    model = make_mlp()
    opt = ForgeOptimizer(model, "adafactor")
    train(model, opt, mlp_batches(1), mlp_loss)
    sd = opt.state_dict()
    first = next(iter(sd["state"]))
    sd["state"][first]["row_var"] = sd["state"][first]["row_var"][:-1].clone()
    fresh = ForgeOptimizer(twin(model, make_mlp), "adafactor")
    with pytest.raises(ValueError, match="row_var"):
        fresh.load_state_dict(sd)


def test_a_weight_of_more_than_two_dimensions_is_refused_before_anything_is_installed():
    """torch.optim.Adafactor factors the last two dimensions of a 3-D weight; `rows` / `cols` are size(0) and the
    product of the others: refused, not a different factorization."""
    conv = torch.nn.Conv1d(3, 4, 2).to(DEVICE)
    before = conv.weight.detach().clone()
    with pytest.raises(ValueError, match="adafactor.*weight.*3"):
        ForgeOptimizer(conv, "adafactor")
    assert torch.equal(conv.weight, before)


@pytest.mark.parametrize("layout", ["bf16", "int8"])
def test_a_layout_for_all_states_keeps_the_row_and_column_states_fp32(layout):
    model = make_mlp()
    opt = ForgeOptimizer(model, "adafactor", state_dtype=layout)
    train(model, opt, mlp_batches(2), mlp_loss)
    for p in model.parameters():
        assert opt.state[p]["row_var"].dtype == torch.float32
    with pytest.raises(ValueError, match="row_var.*fp32.*per row"):
        forge_dsl.init_state("adafactor", torch.zeros(4, 3), layout={"row_var": "bf16"})


def test_the_plan_keeps_one_transient_and_reads_back_two_norms():
    phases = plan(forge_dsl.load_spec("adafactor"))
    assert phases.transients == ("kept_grad",)
    assert phases.results == ("weight_norm", "update_norm")
    assert phases.post_grad == "u"
    text = phases.describe()
    assert "row_var[rows], col_var[cols]" in text and "rowmean" in text


@pytest.mark.parametrize("kw, match", [
    (dict(lr=-1.0), "lr"), (dict(beta2_decay=0.1), "beta2_decay"), (dict(eps=(-1e-3, 1e-3)), "eps1"),
    (dict(eps=(None, -1.0)), "eps2"), (dict(eps=(None, None)), "eps"), (dict(d=0.5), "d"),
    (dict(weight_decay=-0.1), "weight_decay")])
def test_keywords_torch_refuses_are_refused(kw, match):
    with pytest.raises((ValueError, TypeError)):  # torch: a TypeError for eps2 None
        torch.optim.Adafactor([torch.nn.Parameter(torch.zeros(2, 2))], **kw)
    with pytest.raises((ValueError, TypeError), match=match):
        ForgeOptimizer(make_mlp(), "adafactor", **kw)


def test_a_tuple_member_given_beside_an_optional_one_keeps_its_value():
    """eps=(eps1, eps2) with eps1 optional: a number given in the tuple is the value (not None, as the optional
    keyword's own default would have it), None stays None."""
    spec = forge_dsl.load_spec("adafactor")
    given = resolve_hypers(spec, {"eps": (1e-5, 2e-3)})
    assert given.hypers["eps1"] == 1e-5 and given.hypers["eps2"] == 2e-3 and given.flags["has_eps1"]
    default = resolve_hypers(spec, {"eps": (None, 2e-3)})
    assert default.hypers["eps1"] is None and not default.flags["has_eps1"]


OWN = """
optimizer rowwise
hyper lr = 1e-2 in [0, inf)
state r[rows] = 0
state c[cols] = 0
state m = 0

update {
    m = 0.9 * m + 0.1 * grad
    sq = grad * grad
    rm = rowmean(sq)
    cm = colmean(sq)
    r = 0.5 * r + 0.5 * rm
    c = 0.5 * c + 0.5 * cm
    scale = rsqrt(r * c + 1e-12)
    shrink = r / (r + c + 1)
    param = param - lr * (m * scale + 0.01 * shrink * param)
}
"""


def test_a_spec_of_ones_own_hands_the_post_phase_two_values_per_element(tmp_path):
    """The post phase reads two values per element the region computed: one is its grad, the other a transient
    the region writes; a state per element from the tile phase beside them. Fused into backward, four steps,
    against the formula written out in torch."""
    path = tmp_path / "rowwise.fopt"
    path.write_text(OWN)
    phases = plan(forge_dsl.load_spec(str(path)))
    assert phases.post_grad == "scale" and phases.region_kept == {"shrink": "kept_shrink"}
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 10, bias=False).to(DEVICE)
    w = layer.weight.detach().clone()
    opt = ForgeOptimizer(layer, str(path), lr=0.05)
    assert layer.weight in opt._handles
    m, r, c = torch.zeros_like(w), torch.zeros(10, 1, device=DEVICE), torch.zeros(1, 24, device=DEVICE)
    for _ in range(4):
        x = torch.randn(6, 24, device=DEVICE)
        opt.zero_grad()
        layer(x).square().sum().backward()
        opt.step()
        grad = 2 * (x @ w.T).T @ x
        m = 0.9 * m + 0.1 * grad
        r = 0.5 * r + 0.5 * (grad * grad).mean(dim=1, keepdim=True)
        c = 0.5 * c + 0.5 * (grad * grad).mean(dim=0, keepdim=True)
        w = w - 0.05 * (m * torch.rsqrt(r * c + 1e-12) + 0.01 * (r / (r + c + 1)) * w)
    assert rel_err(layer.weight, w) <= 1e-5
    assert rel_err(opt.state[layer.weight]["r"], r.reshape(-1)) <= 1e-5


def test_the_region_drops_each_temporary_after_its_last_read(monkeypatch):
    """The region's temporaries shaped like the weight (g, g², the factored estimate, v, u) do not all stay
    alive to its end: at most four at once, an expression's intermediates included (counted through weak
    references to each result of its element-wise arithmetic; keeping every temporary makes six)."""
    import weakref

    from forge_dsl import barriers

    shape = (48, 40)
    alive, most = [], [0]
    real = barriers.elementwise

    def counting(op, args):
        out = real(op, args)
        if tuple(out.shape) == shape:
            alive.append(weakref.ref(out))
        most[0] = max(most[0], sum(r() is not None for r in alive))
        return out

    monkeypatch.setattr(barriers, "elementwise", counting)
    param, grad = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    state = forge_dsl.init_state("adafactor", param)
    forge_dsl.reference_step("adafactor", param, grad, state, step=1, maximize=True)
    assert 0 < most[0] <= 4, most[0]
