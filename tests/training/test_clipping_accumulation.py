"""Global-norm clipping (`ForgeOptimizer(max_grad_norm=c)` with `optimizer.backward(loss)`) and gradient
accumulation (`accumulation_steps=k`) against torch: `clip_grad_norm_` + torch.optim, `.grad` accumulated over
micro-batches, on fresh random data; and every refusal around them."""

from __future__ import annotations

import math

import pytest
import torch

from forge_dsl import ForgeOptimizer
from training_models import (HYPERS, SPECS, STEPS, TORCH_OPTIMIZER, SharedMLP, assert_fused_moved,
                             assert_params_close, llama_batches, llama_loss, make_llama, make_mlp, mlp_batches,
                             mlp_loss, snapshot, twin)

# max_norm that the MLP's and the tiny Llama's gradients exceed at every step (clipping triggers) / never reach
TRIGGERS, NEVER = 0.05, 1e3


def micro_batches(batches, k):
    return [batches[i:i + k] for i in range(0, len(batches), k)]


def run_torch(model, opt, steps, loss_fn, k, max_norm):
    """torch's recipe: backward k times (the loss divided by k), clip_grad_norm_, step. Returns each step's norm."""
    norms = []
    for micro in steps:
        for batch in micro:
            (loss_fn(model, batch) / k).backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        opt.step()
        opt.zero_grad()
    return norms


def run_forge(model, opt, steps, loss_fn, k):
    """The same recipe with FORGE: optimizer.backward(loss) for each micro-batch, then step."""
    norms = []
    for micro in steps:
        for batch in micro:
            opt.backward(loss_fn(model, batch) / k)
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad()
    return norms


def compare(spec, make, batches_of, loss_fn, k, max_norm, n_steps=3, tol=1e-5, forge_kwargs=None, **make_kwargs):
    """FORGE against torch on `n_steps` steps of k micro-batches; returns (FORGE's norms, torch's norms)."""
    ours = make(**make_kwargs)
    theirs = twin(ours, lambda seed: make(seed=seed, **make_kwargs))
    before = snapshot(ours)
    hypers = HYPERS[spec]
    opt = ForgeOptimizer(ours, spec, max_grad_norm=max_norm, accumulation_steps=k, **(forge_kwargs or {}), **hypers)
    ref = TORCH_OPTIMIZER[spec](theirs.parameters(), **hypers)
    steps = micro_batches(batches_of(n_steps * k), k)
    ref_norms = run_torch(theirs, ref, steps, loss_fn, k, max_norm)
    norms = run_forge(ours, opt, steps, loss_fn, k)
    assert_params_close(ours, theirs, tol)
    assert_fused_moved(opt, ours, before)
    if max_norm is not None:
        assert torch.stack(norms).tolist() == pytest.approx(torch.stack(ref_norms).tolist(), rel=1e-6)
    else:
        assert all(n is None for n in norms)
    return norms, ref_norms


# ----------------------------------------------------------------------------
# Clipping and accumulation against torch
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("max_norm", [TRIGGERS, NEVER, None], ids=["clips", "never-clips", "no-clipping"])
def test_mlp_against_torch(k, max_norm):
    if k == 1 and max_norm is None:
        pytest.skip("neither option: the plain fused update (tests/training/test_optimizer.py)")
    norms, _ = compare("adamw", make_mlp, mlp_batches, mlp_loss, k, max_norm)
    if max_norm == TRIGGERS:
        assert all(n > max_norm for n in norms)  # the coefficient is below 1 at every step
    elif max_norm == NEVER:
        assert all(n < max_norm for n in norms)


@pytest.mark.parametrize("k, max_norm", [(1, TRIGGERS), (2, None), (2, TRIGGERS)])
def test_llama_with_fused_embedding_and_head(k, max_norm):
    """Linear, Embedding and the LM head (its loss without logits) fused, each clipped / accumulated."""
    ours = make_llama()
    opt = ForgeOptimizer(ours, "adamw", lm_head_loss=True)
    fused = {h.name for h in opt._handles.values()}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= fused
    opt.detach()
    compare("adamw", make_llama, llama_batches, llama_loss, k, max_norm, forge_kwargs={"lm_head_loss": True})


@pytest.mark.parametrize("k, max_norm", [(1, TRIGGERS), (3, TRIGGERS), (3, None)])
def test_llama_with_checkpointing(k, max_norm):
    def make(seed=0):
        model = make_llama(seed)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    compare("adamw", make, llama_batches, llama_loss, k, max_norm)


@pytest.mark.parametrize("k", [1, 2])
def test_tied_embeddings(k):
    """The tied embedding / head weight is not fused (two modules use it): clipped from its .grad, in the norm."""
    compare("adamw", make_llama, llama_batches, llama_loss, k, TRIGGERS, tie_word_embeddings=True)


@pytest.mark.parametrize("k", [1, 2])
def test_shared_layer(k):
    """A Linear called twice in one forward is stepped from .grad: in the norm, in the buffer's sum."""
    compare("adamw", lambda seed=0: make_mlp(seed, cls=SharedMLP), lambda n: mlp_batches(n, out=64), mlp_loss, k,
            TRIGGERS)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("k, max_norm", [(1, TRIGGERS), (2, TRIGGERS), (2, None)])
def test_every_spec(spec, k, max_norm):
    compare(spec, make_mlp, mlp_batches, mlp_loss, k, max_norm, n_steps=STEPS.get(spec, 3))


@pytest.mark.parametrize("layout", ["bf16", "int8", "int4"])
def test_every_state_layout_against_unfused(layout):
    """Quantized state has no torch counterpart: the fused, clipped and accumulated steps against the same
    optimizer with fuse=False (each parameter stepped from its .grad, clipped as clip_grad_norm_ clips)."""
    for k in (1, 2):
        ours = make_mlp()
        theirs = twin(ours, make_mlp)
        kwargs = dict(state_dtype=layout, rounding="nearest", max_grad_norm=TRIGGERS, accumulation_steps=k,
                      **HYPERS["adamw"])
        opt = ForgeOptimizer(ours, "adamw", **kwargs)
        ref = ForgeOptimizer(theirs, "adamw", fuse=False, **kwargs)
        steps = micro_batches(mlp_batches(3 * k), k)
        norms = run_forge(ours, opt, steps, mlp_loss, k)
        ref_norms = run_forge(theirs, ref, steps, mlp_loss, k)
        assert torch.stack(norms).tolist() == pytest.approx(torch.stack(ref_norms).tolist(), rel=1e-6)
        assert_params_close(ours, theirs, 1e-5)


# ----------------------------------------------------------------------------
# Non-finite norms: what clip_grad_norm_(error_if_nonfinite=False) gives
# ----------------------------------------------------------------------------


def _nonfinite_runs(poison):
    """One clipped step of FORGE and of torch where `poison(model)` makes the gradient non-finite."""
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    opt = ForgeOptimizer(ours, "adamw", max_grad_norm=1.0, **HYPERS["adamw"])
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    batch = mlp_batches(1)[0]
    hooks = [poison(m) for m in (ours, theirs)]
    ref_norm = run_torch(theirs, ref, [[batch]], mlp_loss, 1, 1.0)[0]
    norm = run_forge(ours, opt, [[batch]], mlp_loss, 1)[0]
    for h in hooks:
        h.remove()
    return ours, theirs, norm, ref_norm


def test_nan_norm_makes_every_update_nan_as_torch():
    """A NaN in the gradient: the norm is NaN, the coefficient NaN, every clipped gradient NaN: torch's AdamW then
    writes NaN into every parameter, and so does FORGE."""
    def poison(model):
        return model.mid.register_forward_hook(
            lambda m, i, out: out.index_fill(-1, torch.tensor([3], device=out.device), math.nan))

    ours, theirs, norm, ref_norm = _nonfinite_runs(poison)
    assert math.isnan(norm.item()) and math.isnan(ref_norm.item())
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p.isnan(), q.isnan()), name
        assert p.isnan().all(), name


def test_infinite_norm_as_torch():
    """An infinite gradient element: the norm is inf, the coefficient 0: inf * 0 = NaN where the gradient is
    infinite, 0 elsewhere (AdamW then only decays those weights, fused ones included), in torch and in FORGE."""
    def poison(model):
        return model.down.bias.register_hook(lambda g: g.index_fill(0, torch.tensor([5], device=g.device), math.inf))

    ours, theirs, norm, ref_norm = _nonfinite_runs(poison)
    assert norm.item() == math.inf and ref_norm.item() == math.inf
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p.isnan(), q.isnan()), name
        finite = ~q.isnan()
        torch.testing.assert_close(p[finite], q[finite], rtol=1e-6, atol=0)
    assert ours.down.bias.isnan().sum() == 1 and not ours.up.weight.isnan().any()


# ----------------------------------------------------------------------------
# clip_grad_norm_ after optimizer.backward: the norm, and no second clipping
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("foreach", [None, False])
def test_clip_grad_norm_reports_the_norm_and_scales_nothing(k, foreach):
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    opt = ForgeOptimizer(ours, "adamw", max_grad_norm=TRIGGERS, accumulation_steps=k, **HYPERS["adamw"])
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    for micro in micro_batches(mlp_batches(2 * k), k):
        for batch in micro:
            opt.backward(mlp_loss(ours, batch) / k)
            (mlp_loss(theirs, batch) / k).backward()
        plain = {n: p.grad.clone() for n, p in ours.named_parameters() if p not in opt._handles}
        norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), TRIGGERS, foreach=foreach)
        ref_norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), TRIGGERS, foreach=foreach)
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
        assert float(norm) > TRIGGERS and bool(norm > TRIGGERS)
        assert all(torch.equal(p.grad, plain[n]) for n, p in ours.named_parameters() if n in plain)
        opt.step()
        ref.step()
        assert opt.last_grad_norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
        opt.zero_grad()
        ref.zero_grad()
    assert_params_close(ours, theirs)


def test_describe_says_what_is_clipped_and_accumulated():
    opt = ForgeOptimizer(make_mlp(), "adamw", max_grad_norm=0.5, accumulation_steps=3, accumulation_dtype="bf16")
    text = opt.describe()
    assert "clipped by the global gradient norm to 0.5 (optimizer.backward(loss), the norm taken in step())" in text
    assert "gradients accumulated over 3 backwards (bf16 buffer per fused weight)" in text
    assert "two backward passes" in ForgeOptimizer(make_mlp(), "adamw", max_grad_norm=1.0).describe()


def test_clip_grad_norm_by_another_norm_type_is_refused():
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw", max_grad_norm=1.0)
    opt.backward(mlp_loss(model, mlp_batches(1)[0]))
    with pytest.raises(RuntimeError, match=r"known only by its 2-norm.*norm_type=2"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=math.inf)
    opt.step()


# ----------------------------------------------------------------------------
# The bf16 accumulation buffer
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("buffer, bound", [("fp32", 1e-6), ("bf16", 2 ** -8)])
def test_accumulation_buffer_error(buffer, bound):
    """The buffer after 4 micro-batches against the float64 sum of autograd's gradients of a bf16 model: the fp32
    buffer adds the bf16 gradients exactly as float32 does; the bf16 buffer rounds each sum to bf16, as torch's
    bf16 .grad accumulation does (relative error below 2^-8)."""
    k = 4
    model = make_mlp(dtype=torch.bfloat16)
    twin_model = twin(model, lambda seed: make_mlp(seed, dtype=torch.bfloat16))
    opt = ForgeOptimizer(model, "adamw", max_grad_norm=1.0, accumulation_steps=k, accumulation_dtype=buffer)
    batches = mlp_batches(k, dtype=torch.bfloat16)
    exact = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in twin_model.named_parameters()}
    for batch in batches:
        opt.backward(mlp_loss(model, batch))
        mlp_loss(twin_model, batch).backward()
        for n, p in twin_model.named_parameters():
            exact[n] += p.grad.double().cpu()
        twin_model.zero_grad()
    for handle in opt._handles.values():
        assert handle.buffer.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[buffer]
        ref = exact[handle.name]
        err = ((handle.buffer.double().cpu() - ref).norm() / ref.norm()).item()
        assert err <= bound, (handle.name, err)
    opt.step()


# ----------------------------------------------------------------------------
# Refusals, before any weight moves
# ----------------------------------------------------------------------------


def test_plain_backward_with_max_grad_norm_is_refused_before_any_update():
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw", max_grad_norm=1.0)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=r"max_grad_norm=1.*call optimizer\.backward\(loss\) instead of "
                                           r"loss\.backward\(\).*No weight was updated"):
        mlp_loss(model, mlp_batches(1)[0]).backward()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    opt.zero_grad()
    run_forge(model, opt, [[mlp_batches(1)[0]]], mlp_loss, 1)  # then training goes on


def test_second_clipped_backward_before_step_is_refused():
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw", max_grad_norm=1.0)
    batch = mlp_batches(1)[0]
    loss = mlp_loss(model, batch)
    opt.backward(loss)
    after_first = snapshot(model)
    with pytest.raises(RuntimeError, match=r"second time before optimizer\.step\(\).*accumulation_steps=k"):
        opt.backward(loss)
    with pytest.raises(RuntimeError, match=r"second gradient before optimizer\.step\(\).*accumulation_steps=k"):
        mlp_loss(model, batch)  # a second micro-batch's forward
    assert all(torch.equal(p, after_first[n]) for n, p in model.named_parameters())
    opt.step()


def test_forward_after_the_kth_backward_is_refused():
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw", accumulation_steps=2)
    batches = mlp_batches(3)
    for batch in batches[:2]:
        mlp_loss(model, batch).backward()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=r"accumulation_steps=2 micro-batches.*optimizer\.step\(\) after every 2"):
        mlp_loss(model, batches[2])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    opt.step()


def test_fewer_micro_batches_than_accumulation_steps_step_from_the_buffer():
    """step() after fewer than k backwards steps the fused weights from what their buffers hold, as torch steps
    the .grad accumulated so far."""
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    opt = ForgeOptimizer(ours, "adamw", accumulation_steps=4, **HYPERS["adamw"])
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    steps = micro_batches(mlp_batches(4), 2)
    run_forge(ours, opt, steps, mlp_loss, 2)
    run_torch(theirs, ref, steps, mlp_loss, 2, None)
    assert_params_close(ours, theirs)


def test_zero_grad_drops_the_accumulated_gradients():
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    opt = ForgeOptimizer(ours, "adamw", accumulation_steps=2, **HYPERS["adamw"])
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    batches = mlp_batches(3)
    for model, o in ((ours, opt), (theirs, ref)):
        mlp_loss(model, batches[0]).backward()
        o.zero_grad()  # the first micro-batch is dropped
    assert all(h.buffer is None for h in opt._handles.values())
    run_forge(ours, opt, [batches[1:]], mlp_loss, 2)
    run_torch(theirs, ref, [batches[1:]], mlp_loss, 2, None)
    assert_params_close(ours, theirs)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm must be positive and finite"),
    ({"max_grad_norm": math.inf}, ValueError, "max_grad_norm must be positive and finite"),
    ({"max_grad_norm": "1"}, TypeError, "max_grad_norm must be a number or None, got str"),
    ({"accumulation_steps": 0}, ValueError, "accumulation_steps must be at least 1, got 0"),
    ({"accumulation_steps": 2.0}, TypeError, "accumulation_steps must be an int, got float"),
    ({"accumulation_dtype": "fp16"}, ValueError, "accumulation_dtype must be one of 'fp32', 'bf16', got 'fp16'"),
])
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        ForgeOptimizer(make_mlp(), "adamw", **kwargs)


# ----------------------------------------------------------------------------
# Found in review: each a test that failed before its fix
# ----------------------------------------------------------------------------


def test_two_passes_give_every_leaf_its_gradient_once():
    """optimizer.backward's second pass adds nothing to a leaf the first pass gave a .grad: an input with
    requires_grad, and a parameter this optimizer does not hold."""
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    opt = ForgeOptimizer(ours, "adamw", model_params=[p for n, p in ours.named_parameters() if n != "down.bias"],
                         max_grad_norm=NEVER)
    x, y = mlp_batches(1)[0]
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    opt.backward(mlp_loss(ours, (x_ours, y)))
    mlp_loss(theirs, (x_theirs, y)).backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.down.bias.grad, theirs.down.bias.grad, rtol=1e-6, atol=0)
    opt.step()


@pytest.mark.parametrize("how", ["detach", "model.zero_grad", "zero_grad(set_to_none=False)"])
def test_accumulated_micro_batches_follow_torch(how):
    """Between two micro-batches: detach() hands the accumulated gradient to .grad (then stepped from it, as torch
    steps it); model.zero_grad() / zero_grad(set_to_none=False) drop it, as torch's zero_grad drops .grad."""
    ours = make_mlp()
    theirs = twin(ours, make_mlp)
    opt = ForgeOptimizer(ours, "adamw", accumulation_steps=2, **HYPERS["adamw"])
    ref = torch.optim.AdamW(theirs.parameters(), **HYPERS["adamw"])
    first, second = mlp_batches(2)
    for model in (ours, theirs):
        (mlp_loss(model, first) / 2).backward()
    if how == "detach":
        opt.detach()
    else:
        for model in (ours, theirs):
            model.zero_grad(set_to_none=how == "model.zero_grad")
        if how != "model.zero_grad":
            assert all(h.buffer is None for h in opt._handles.values())
    for model in (ours, theirs):
        (mlp_loss(model, second) / 2).backward()
    opt.step()
    ref.step()
    assert_params_close(ours, theirs)


def test_a_refused_backward_keeps_the_retry_fused():
    """After a plain loss.backward() refused for max_grad_norm, the batch's forward runs again: its layers count
    one use each, so they stay fused (not stepped from a dW in .grad as shared layers)."""
    model = make_mlp()
    opt = ForgeOptimizer(model, "adamw", max_grad_norm=1.0)
    batch = mlp_batches(1)[0]
    with pytest.raises(RuntimeError, match="optimizer.backward"):
        mlp_loss(model, batch).backward()
    opt.zero_grad()
    opt.backward(mlp_loss(model, batch))
    assert all(not h.shared and h.updated for h in opt._handles.values())
    opt.step()
