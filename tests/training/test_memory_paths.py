"""ForgeOptimizer's memory paths on a tiny Hugging Face Llama: the embedding updated tile by tile in backward
(no dense gradient), and the loss without logits (`lm_head_loss=True`: the LM head updated a vocabulary block
at a time), each against torch.optim stepping a twin from autograd's gradients."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import forge_dsl
from forge_dsl import ForgeOptimizer
from forge_dsl.training.consumed_grad import ConsumedGrad
from training_models import (assert_params_close, fused_names, llama_batches, llama_loss, make_llama, snapshot, train,
                        twin)

HYPERS = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def _torch_twin(model, **overrides):
    ref = twin(model, lambda seed: make_llama(seed, **overrides))
    return ref, torch.optim.AdamW(ref.parameters(), **HYPERS)


# the quick tier: the loss without logits (a plain fused head is in test_optimizer's Llama runs)
@pytest.mark.parametrize("head_loss", [pytest.param(False, marks=pytest.mark.slow), True])
def test_embedding_and_head_paths_train_like_torch(head_loss):
    """Four AdamW steps: every weight as torch.optim.AdamW moves it from autograd's gradients (the embedding's
    rows without tokens included: the batches use 30 of its 128 ids), with the loss equal to transformers'."""
    ours = make_llama()
    ref, ref_opt = _torch_twin(ours)
    before = snapshot(ours)
    opt = ForgeOptimizer(ours, "adamw", lm_head_loss=head_loss, **HYPERS)
    batches = [ids % 30 for ids in llama_batches(4)]
    losses = train(ours, opt, batches, llama_loss)
    ref_losses = train(ref, ref_opt, batches, llama_loss)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    # the loss without logits sums its log-sum-exp block by block: fp32 rounding apart from F.cross_entropy's,
    # which Adam's normalization magnifies where gradients are small (early q/k projections: ~4e-5 after 4 steps)
    assert_params_close(ours, ref, tol=2e-4 if head_loss else 1e-5)
    embedding = ours.model.embed_tokens.weight
    assert "model.embed_tokens.weight" in fused_names(opt) and "lm_head.weight" in fused_names(opt)
    assert not torch.equal(embedding[30:], before["model.embed_tokens.weight"][30:])  # decayed without tokens
    for p in ours.parameters():
        assert int(opt.state[p]["step"]) == 4
    out = ours(input_ids=batches[0], labels=batches[0])
    assert (out.logits is None) == head_loss
    out.loss.backward()  # the fused weights' .grad: placeholders, no dense gradient
    assert isinstance(embedding.grad, ConsumedGrad) and isinstance(ours.lm_head.weight.grad, ConsumedGrad)
    assert ("loss without logits" in opt.describe()) == head_loss


def test_an_evaluation_loss_without_gradients_leaves_the_next_step_fused():
    """A no-grad forward with labels (an evaluation loop's loss) is no use of the head in this step: the next
    training step's head update stays fused (its .grad the placeholder, not a dense dW)."""
    model = make_llama()
    opt = ForgeOptimizer(model, "adamw", lm_head_loss=True, **HYPERS)
    ids = llama_batches(1)[0]
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
    model(input_ids=ids, labels=ids).loss.backward()
    assert isinstance(model.lm_head.weight.grad, ConsumedGrad)
    assert "lm_head.weight" in fused_names(opt)
    opt.step()


def test_head_loss_from_fuse_with_parameters_first_and_detach_restores_the_model():
    model = make_llama()
    assert forge_dsl.fuse(model, lm_head_loss=True) is model
    assert "forward" not in model.__dict__  # fuse changes nothing
    opt = ForgeOptimizer(model.parameters(), "adamw", **HYPERS)
    ids = llama_batches(1)[0]
    assert model(input_ids=ids, labels=ids).logits is None
    assert model(input_ids=ids).logits.shape == (*ids.shape, 128)  # without labels: the model's own forward
    copied = copy.deepcopy(model)
    assert "forward" not in copied.__dict__ or copied(input_ids=ids, labels=ids).logits is not None
    assert pickle.loads(pickle.dumps(model))(input_ids=ids, labels=ids).logits is not None
    opt.detach()
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__
    assert "forward" not in model.model.embed_tokens.__dict__
    assert model(input_ids=ids, labels=ids).logits is not None


def test_head_loss_on_a_tied_model_steps_the_shared_weight_from_its_dense_gradient():
    """A head tied to the embedding needs both uses' gradients before its update: neither is fused, the loss still
    keeps no logits, and the shared weight moves as torch moves it."""
    ours = make_llama(tie_word_embeddings=True)
    ref, ref_opt = _torch_twin(ours, tie_word_embeddings=True)
    opt = ForgeOptimizer(ours, "adamw", lm_head_loss=True, **HYPERS)
    batches = llama_batches(3)
    assert train(ours, opt, batches, llama_loss) == pytest.approx(train(ref, ref_opt, batches, llama_loss), rel=1e-5)
    assert_params_close(ours, ref, tol=2e-4)  # the block-wise loss's fp32 rounding (see the test above)
    assert "lm_head.weight" not in fused_names(opt) and "model.embed_tokens.weight" not in fused_names(opt)
    assert "shared with another module" in opt.describe()
    assert ours(input_ids=batches[0], labels=batches[0]).logits is None


def test_head_loss_refusals_come_before_anything_changes():
    model = make_llama()
    with pytest.raises(TypeError, match=r"lm_head_loss= goes with a module.*fuse\(model, lm_head_loss=True\)"):
        ForgeOptimizer(model.parameters(), "adamw", lm_head_loss=True)
    with pytest.raises(TypeError, match="lm_head_loss must be a bool, got str"):
        ForgeOptimizer(model, "adamw", lm_head_loss="yes")
    with pytest.raises(TypeError, match="lm_head_loss must be a bool, got int"):
        forge_dsl.fuse(model, lm_head_loss=1)
    mlp = nn.Sequential(nn.Linear(8, 8))
    for make in (lambda: forge_dsl.fuse(mlp, lm_head_loss=True),
                 lambda: ForgeOptimizer(mlp, "adamw", lm_head_loss=True)):
        with pytest.raises(ValueError, match="forge_dsl.training.hf_head.install"):
            make()
        assert "forward" not in mlp[0].__dict__
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__


def test_a_backward_interrupted_between_vocabulary_blocks_is_closed_by_step(monkeypatch):
    """An exception after the head's first vocabulary block: a retry is refused with the interrupted-step message
    (no block is updated twice), step() closes the step (the head's counter moves once) and training goes on."""
    from forge_dsl.training.linear import FusedWeight as _FusedHandle

    model = make_llama()
    opt = ForgeOptimizer(model, "adamw", lm_head_loss=True, **HYPERS)
    opt._head_installs[0]._forward.block_rows = 64  # two blocks of the 128-token vocabulary
    real = _FusedHandle.fused_rows
    calls = []

    def failing(self, x, dy, r0):
        calls.append(r0)
        if r0 > 0:
            raise RuntimeError("out of memory (simulated)")
        real(self, x, dy, r0)

    monkeypatch.setattr(_FusedHandle, "fused_rows", failing)
    ids = llama_batches(1)[0]
    head = model.lm_head.weight
    before = head.detach().clone()
    with pytest.raises(RuntimeError, match="simulated"):
        model(input_ids=ids, labels=ids).loss.backward()
    assert calls == [0, 64]
    assert not torch.equal(head[:64], before[:64]) and torch.equal(head[64:], before[64:])
    monkeypatch.setattr(_FusedHandle, "fused_rows", real)
    with pytest.raises(RuntimeError, match="'lm_head.weight' was already updated in this step: the last backward was "
                                           "interrupted"):
        model(input_ids=ids, labels=ids).loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("interrupted" in str(w.message) for w in caught)
    assert int(opt.state[head]["step"]) == 1
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert int(opt.state[head]["step"]) == 2
