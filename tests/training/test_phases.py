"""Specs that run in phases (spec/phases.py): the built-in `muon` fused into backward against torch.optim.Muon,
a spec's own phases against the reference step, the plan forge-gen prints and writes, and every refusal."""

from __future__ import annotations

import pytest
import torch

import forge_dsl
from forge_dsl import ForgeOptimizer, kernels
from forge_dsl.compiler import forge_gen
from forge_dsl.spec.phases import plan
from references import LambFormula
from training_models import (DEVICE, assert_params_close, llama_batches, llama_loss, make_llama, make_mlp,
                             mlp_batches, mlp_loss, rel_err, twin)

MUON = dict(lr=0.02, weight_decay=0.05, momentum=0.9, ns_steps=4, eps=1e-6, ns_coefficients=(3.0, -4.0, 2.0))
# Newton-Schulz runs in bfloat16 (torch.optim.Muon's definition): an input one fp32 rounding apart (the kernels'
# fp32 arithmetic is not torch's, operation for operation) rounds some elements to the neighbouring bfloat16
# (2**-8 relative), and the iteration mixes them into every element. So ten steps' total update agrees to
# bfloat16's precision, not fp32's: UPDATE_TOL. A wrong formula is far outside it (Nesterov or not: ~1; the
# shape's lr factor sqrt(96 / 64): 0.22; no weight decay: 0.04; measured: 1.8e-3 to 5.6e-3).
UPDATE_TOL = 1e-2


def assert_updates_close(ours, theirs, start, tol=UPDATE_TOL):
    """Each parameter's total change over the run against torch's, relative; and it moved."""
    theirs = dict(theirs.named_parameters())
    errors = {n: rel_err(p.detach() - start[n], theirs[n].detach() - start[n]) for n, p in ours.named_parameters()}
    assert all(e <= tol for e in errors.values()), {n: f"{e:.2e}" for n, e in errors.items() if e > tol}
    for n, p in ours.named_parameters():
        assert (p.detach() - start[n]).norm() > 1e-3 * start[n].norm(), f"{n} did not move"


class Matrices(torch.nn.Module):
    """Linear layers without bias (Muon steps only matrices), tall and wide, widths not multiples of 64."""

    def __init__(self, d=64, h=96, out=40):
        super().__init__()
        self.up = torch.nn.Linear(d, h, bias=False)
        self.down = torch.nn.Linear(h, out, bias=False)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def make_matrices(seed=0):
    torch.manual_seed(seed)
    return Matrices().to(DEVICE)


def run(model, opt, batches, loss_fn):
    for batch in batches:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("path", ["fused", "slab", "step"])
def test_muon_in_backward_equals_torch_muon(nesterov, path):
    """Ten steps on fresh random data, every keyword set off its default: fused into backward ("fused" and
    "slab" paths) or stepped from .grad (fuse=False), against torch.optim.Muon."""
    theirs = make_matrices()
    ours = twin(theirs, make_matrices)
    start = {n: p.detach().clone() for n, p in ours.named_parameters()}
    ref = torch.optim.Muon(theirs.parameters(), nesterov=nesterov, **MUON)
    fuse = path != "step"
    opt = ForgeOptimizer(ours, "muon", nesterov=nesterov, fuse=fuse, linear_path=path if fuse else "auto", **MUON)
    batches = mlp_batches(10)
    run(theirs, ref, batches, mlp_loss)
    run(ours, opt, batches, mlp_loss)
    assert_updates_close(ours, theirs, start)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert rel_err(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"]) <= UPDATE_TOL
        assert set(opt.state[p]) == {"momentum_buffer", "step", "seed"}  # the transient is not state
        assert int(opt.state[p]["step"]) == 10


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_muon_adjust_lr_fn_in_backward_equals_torch_muon(adjust_lr_fn):
    """torch.optim.Muon's adjust_lr_fn, fused into backward: Moonshot's 0.2 * sqrt(max(rows, cols)) (1.96 for the
    96 x 64 layer, 1.55 for 40 x 96) is far outside UPDATE_TOL of the original sqrt(max(1, rows / cols))."""
    theirs = make_matrices()
    ours = twin(theirs, make_matrices)
    start = {n: p.detach().clone() for n, p in ours.named_parameters()}
    ref = torch.optim.Muon(theirs.parameters(), adjust_lr_fn=adjust_lr_fn, **MUON)
    opt = ForgeOptimizer(ours, "muon", adjust_lr_fn=adjust_lr_fn, **MUON)
    assert opt.param_groups[0]["adjust_lr_fn"] == adjust_lr_fn
    batches = mlp_batches(10)
    run(theirs, ref, batches, mlp_loss)
    run(ours, opt, batches, mlp_loss)
    assert_updates_close(ours, theirs, start)
    assert opt.state_dict()["param_groups"][0]["adjust_lr_fn"] == adjust_lr_fn


def test_muon_on_a_tiny_llama_beside_adamw():
    """The recipe of Muon's authors: Muon for the hidden matrices, AdamW for the rest (embeddings, head, norms),
    as two optimizers; FORGE's Muon fused into backward against torch.optim.Muon, ten steps."""
    theirs = make_llama()
    ours = twin(theirs, make_llama)
    start = {n: p.detach().clone() for n, p in ours.named_parameters()}

    def split(model):
        hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and "layers." in n]
        rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "layers." in n)]
        return hidden, rest

    kw = dict(MUON, lr=2e-3)
    hidden, rest = split(theirs)
    ref = [torch.optim.Muon(hidden, **kw), torch.optim.AdamW(rest, lr=1e-3)]
    hidden, rest = split(ours)
    muon = ForgeOptimizer(ours, "muon", model_params=hidden, **kw)
    adamw = torch.optim.AdamW(rest, lr=1e-3)
    assert len(muon._handles) == len(hidden)  # every hidden matrix fused
    for ids in llama_batches(10):
        for model, opts in ((theirs, ref), (ours, [muon, adamw])):
            for o in opts:
                o.zero_grad()
            llama_loss(model, ids).backward()
            for o in opts:
                o.step()
    assert_updates_close(ours, theirs, start)


def test_embedding_is_stepped_from_grad():
    """An nn.Embedding's update in backward comes a block of rows at a time; a spec in phases needs the whole
    weight, so it is stepped from .grad in step(), equal to torch.optim.Muon."""
    def make(seed=0):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.Linear(24, 30, bias=False)).to(DEVICE)

    theirs = make()
    ours = twin(theirs, make)
    start = {n: p.detach().clone() for n, p in ours.named_parameters()}
    ref = torch.optim.Muon(theirs.parameters(), **MUON)
    opt = ForgeOptimizer(ours, "muon", **MUON)
    assert list(opt._handles) == [ours[1].weight]
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 50, (4, 7), generator=gen).to(DEVICE) for _ in range(6)]
    run(theirs, ref, batches, lambda m, ids: m(ids).square().mean())
    run(ours, opt, batches, lambda m, ids: m(ids).square().mean())
    assert_updates_close(ours, theirs, start)


LAMB = dict(lr=5e-3, betas=(0.8, 0.99), eps=1e-5, weight_decay=0.05)
ADAFACTOR = dict(lr=0.03, beta2_decay=-0.6, weight_decay=0.02)


@pytest.mark.parametrize("path", ["fused", "slab", "step"])
def test_lamb_equals_the_papers_algorithm(path):
    """Ten steps of an MLP with biases and a LayerNorm (stepped from .grad, in phases too) against LAMB as the
    paper writes it (tests/helpers/references.py): fp32 throughout, so to fp32's precision."""
    theirs = make_mlp()
    ours = twin(theirs, make_mlp)
    ref = LambFormula(theirs.parameters(), **LAMB)
    fuse = path != "step"
    opt = ForgeOptimizer(ours, "lamb", fuse=fuse, linear_path=path if fuse else "auto", **LAMB)
    assert len(opt._handles) == (3 if fuse else 0)  # its three Linear weights
    batches = mlp_batches(10)
    run(theirs, ref, batches, mlp_loss)
    run(ours, opt, batches, mlp_loss)
    assert_params_close(ours, theirs)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert rel_err(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"]) <= 1e-5


def test_lamb_on_a_tiny_llama():
    """The whole model in one LAMB (embeddings stepped from .grad, the Linears and the head fused)."""
    theirs = make_llama()
    ours = twin(theirs, make_llama)
    ref = LambFormula(theirs.parameters(), **LAMB)
    opt = ForgeOptimizer(ours, "lamb", **LAMB)
    assert opt._handles  # the Linears are fused
    for ids in llama_batches(6):
        for model, o in ((theirs, ref), (ours, opt)):
            o.zero_grad()
            llama_loss(model, ids).backward()
            o.step()
    assert_params_close(ours, theirs)


OWN = """
optimizer own
hyper lr = 1e-3 in [0, inf)
hyper beta = 0.9 in [0, 1)
state buf = 0

update {
    buf = beta * buf + grad
    o = orthogonalize(buf, 3, 3.4445, -4.775, 2.0315, 1e-7)
    param = param - lr * (o + 0.1 * grad) * sqrt(cols / rows)
}
"""


def own_spec(tmp_path):
    path = tmp_path / "own.fopt"
    path.write_text(OWN)
    return str(path)


def test_a_spec_of_ones_own_plans_its_transients(tmp_path):
    """The barrier reads a state (no transient for it); the post phase reads grad, which the tile phase hands
    over; the shape reaches both phases as keywords of their own."""
    spec = forge_dsl.load_spec(own_spec(tmp_path))
    phases = plan(spec)
    (barrier,) = phases.barriers
    assert barrier.source == "buf" and phases.transients == ("kept_grad",)
    assert [s.name for s in phases.post.states] == ["kept_grad"]
    assert {h.name for h in phases.post.hypers} == {"lr", "n_rows", "n_cols"}
    text = plan(spec).describe()
    assert "2. region" in text and "o = orthogonalize(buf)" in text and "kept_grad" in text
    assert "4 bytes per weight element" in text


def test_a_spec_of_ones_own_equals_its_formula(tmp_path):
    """Fused into backward, against the formula written out in torch (Newton-Schulz as torch.optim.Muon's)."""
    path = own_spec(tmp_path)
    torch.manual_seed(0)
    layer = torch.nn.Linear(40, 24, bias=False).to(DEVICE)
    w0 = layer.weight.detach().clone()
    opt = ForgeOptimizer(layer, path, lr=0.05, beta=0.8)
    buf = torch.zeros_like(w0)
    w = w0.clone()
    from torch.optim._muon import _zeropower_via_newtonschulz
    for _ in range(4):
        x = torch.randn(6, 40, device=DEVICE)
        opt.zero_grad()
        layer(x).square().sum().backward()
        opt.step()
        grad = 2 * (x @ w.T).T @ x  # d/dW of sum((x Wᵀ)²)
        buf = 0.8 * buf + grad
        o = _zeropower_via_newtonschulz(buf, (3.4445, -4.775, 2.0315), 3, 1e-7).float()
        w = w - 0.05 * (o + 0.1 * grad) * (40 / 24) ** 0.5
    assert rel_err(layer.weight.detach() - w0, w - w0) <= UPDATE_TOL
    assert (w - w0).abs().max() > 1e-2


def test_int8_state_read_by_the_barrier_is_refused(tmp_path):
    layer = torch.nn.Linear(64, 64, bias=False).to(DEVICE)
    with pytest.raises(ValueError, match=r"reads state 'buf' whole.*state_dtype=\{'buf': 'fp32'\}"):
        ForgeOptimizer(layer, own_spec(tmp_path), state_dtype="int8")
    ForgeOptimizer(layer, own_spec(tmp_path), state_dtype={"buf": "bf16"})  # a layout of numbers: accepted


@pytest.mark.parametrize("options, match", [
    ({"max_grad_norm": 1.0}, "max_grad_norm= and accumulation_steps= are not supported"),
    ({"accumulation_steps": 2}, "max_grad_norm= and accumulation_steps= are not supported"),
])
def test_options_not_built_for_phases_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        ForgeOptimizer(make_matrices(), "muon", **options)


def test_a_vector_is_refused_before_anything_is_installed():
    """As torch.optim.Muon refuses it at construction: Muon steps only matrices."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8, bias=False)).to(DEVICE)
    forward = model[0].forward
    with pytest.raises(ValueError, match=r"steps only 2-D parameters.*'0.bias' has size \(8,\)"):
        ForgeOptimizer(model, "muon")
    assert model[0].forward == forward  # nothing installed


def test_the_kernels_refuse_a_spec_in_phases_by_name():
    w = torch.randn(8, 8, device=DEVICE)
    state = forge_dsl.init_state("muon", w, layout="fp32")
    with pytest.raises(ValueError, match=r"muon reads the whole weight.*plan\(spec\)\.tile and \.post"):
        kernels.step("muon", w, torch.randn_like(w), state, step=1)


def test_ns_steps_must_be_whole():
    w = torch.randn(8, 8, dtype=torch.float64)
    state = forge_dsl.init_state("muon", w)
    with pytest.raises(ValueError, match=r"ns_steps must be a whole number in \[0, 100\), got 2.5"):
        forge_dsl.reference_step("muon", w, torch.randn_like(w), state, step=1, ns_steps=2.5)


def test_forge_gen_writes_a_module_per_phase_and_explains(tmp_path, capsys):
    path = own_spec(tmp_path)
    assert forge_gen.main([path, "-o", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").glob("*.py")) == ["own_post.py", "own_tile.py"]
    assert forge_gen.main(["--check", path, "-o", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert forge_gen.main(["--explain", path, "optimizers/adamw.fopt"]) == 0
    out = capsys.readouterr().out
    assert "own: 2 phases" in out and "adamw: 1 phase, element-wise" in out
    assert not (tmp_path / "own_tile.py").exists()  # --explain writes nothing


def test_forge_test_sweeps_each_phase(capsys):
    """forge-test on a spec in phases: the kernels of each phase against that phase's reference, each case named
    "muon#tile" / "muon#post" (a failure's reproducer reruns it from that name)."""
    from forge_dsl.testing import cli
    assert cli.main(["muon", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "muon#tile" in out and "muon#post" in out and ", 0 failed" in out
    assert cli.main(["lamb", "--against", "torch.optim:AdamW", "--reference-only"]) == 2  # no torch twin to draw
    assert "--against" in capsys.readouterr().err


@pytest.mark.parametrize("name, kw", [("muon", MUON), ("lamb", LAMB), ("adafactor", ADAFACTOR)])
def test_compiled_steps_equal_eager_steps(name, kw):
    """Under torch.compile (aot_eager, fullgraph) the phases run inside the fused op's backward: the same bits as
    eager."""
    torch._dynamo.reset()
    eager = make_matrices()
    compiled = twin(eager, make_matrices)
    opt_eager = ForgeOptimizer(eager, name, **kw)
    opt_compiled = ForgeOptimizer(compiled, name, **kw)
    runner = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    batches = mlp_batches(3)
    run(eager, opt_eager, batches, mlp_loss)
    run(runner, opt_compiled, batches, mlp_loss)
    torch._dynamo.reset()
    for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(p, q), n
    assert {int(s["step"]) for s in opt_compiled.state.values()} == {3}


@pytest.mark.parametrize("name, kw", [("muon", MUON), ("lamb", LAMB), ("adafactor", ADAFACTOR)])
def test_state_dict_round_trip_continues_the_run(name, kw):
    """Three steps, save, load into a new optimizer on a copy, three more: the same weights as six steps in one
    run; the state dict holds the spec's states, never a transient."""
    batches = mlp_batches(6)
    straight = make_matrices()
    resumed = twin(straight, make_matrices)
    opt = ForgeOptimizer(straight, name, **kw)
    run(straight, opt, batches, mlp_loss)
    first = ForgeOptimizer(resumed, name, **kw)
    run(resumed, first, batches[:3], mlp_loss)
    saved = first.state_dict()
    assert all(not k.startswith("kept_") for entry in saved["state"].values() for k in entry)
    first.detach()
    second = ForgeOptimizer(resumed, name, **kw)
    second.load_state_dict(saved)
    run(resumed, second, batches[3:], mlp_loss)
    for (n, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("how", ["module", "fuse"])
def test_lm_head_loss_is_refused_before_anything_is_installed(how):
    """Asked for with the model (`lm_head_loss=True`) or by `forge_dsl.fuse(model, lm_head_loss=True)` before a
    params-first optimizer: refused when it is built (the head's update comes a block of rows at a time)."""
    model = make_llama()
    with pytest.raises(ValueError, match=r"lamb runs in phases.*lm_head_loss=True is not supported with it yet"):
        if how == "module":
            ForgeOptimizer(model, "lamb", lm_head_loss=True)
        else:
            ForgeOptimizer(forge_dsl.fuse(model, lm_head_loss=True).parameters(), "lamb")
    assert "forward" not in vars(model.model.layers[0].mlp.up_proj) and "forward" not in vars(model)


def test_transients_are_allocated_before_any_backward():
    """The transients of each fused weight's shape exist once the optimizer is built (as its state does), so that
    a compiled backward's CUDA graphs never allocate them from their pool; one set per shape, shared by layers."""
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32, bias=False) for _ in range(3)),
                                torch.nn.Linear(32, 48, bias=False)).to(DEVICE)
    opt = ForgeOptimizer(model, "muon")
    scratch = opt._stepper.phased._scratch
    assert sorted(shape for shape, _ in scratch) == [(32, 32), (48, 32)]
    assert all(set(t) == {"kept_u"} and t["kept_u"].dtype == torch.float32 for t in scratch.values())
    before = {key: t["kept_u"].data_ptr() for key, t in scratch.items()}
    run(model, opt, [(torch.randn(4, 32, device=DEVICE), None)], lambda m, b: m(b[0]).square().mean())
    assert {key: t["kept_u"].data_ptr() for key, t in scratch.items()} == before  # reused, not reallocated


def test_a_layer_called_twice_a_step_is_stepped_from_its_summed_gradient():
    """A Linear called twice in one forward is stepped in step() from its summed gradient, through the phases too:
    equal to the paper's LAMB."""
    from training_models import SharedMLP

    def make(seed=0):
        torch.manual_seed(seed)
        return SharedMLP().to(DEVICE)

    theirs = make()
    ours = twin(theirs, make)
    ref = LambFormula(theirs.parameters(), **LAMB)
    opt = ForgeOptimizer(ours, "lamb", **LAMB)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randn(2, 5, 64, generator=gen).to(DEVICE) for _ in range(4)]
    run(theirs, ref, batches, lambda m, x: m(x).square().mean())
    run(ours, opt, batches, lambda m, x: m(x).square().mean())
    assert_params_close(ours, theirs)
    assert int(opt.state[ours.shared.weight]["step"]) == 4
