"""The LM head and cross-entropy without logits (forge_dsl/training/head_loss.py) against transformers' own loss.

Every comparison is with transformers computing the loss the usual way (`lm_head(hidden)` then its
`loss_function`) on fresh random data; the fused update of the head is checked against torch.optim.AdamW in
float64. Vocabulary blocks are forced small (V = 300, blocks of 128: 128, 128, 44) so that ragged blocks run.
"""

import copy
import io
import pickle
import weakref

import pytest
import torch

import forge_dsl
from forge_dsl.training import head_loss, hf_head
from forge_dsl.training.head_loss import causal_lm_loss
from forge_dsl.training.row_updates import AutogradRows, ParamUpdateRows
from forge_dsl.testing import as_float64_state, dw_error_bound, weight_bound

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

V, D, B, S = 300, 64, 2, 12
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.bfloat16)
# |got − transformers| ≤ tol · max|transformers|: fp32 summation order; bf16: a logit's gradient may round to the
# other bf16 neighbour where fp32 softmax differs in its last bit
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}


def llama_config(**kw):
    base = dict(vocab_size=V, hidden_size=D, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, pad_token_id=None,
                bos_token_id=None, eos_token_id=None)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def tiny_llama(seed=0, **kw):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(**kw))


def random_labels(gen, shape=(B, S), vocab=V, ignored=0.25):
    labels = torch.randint(0, vocab, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < ignored] = -100
    return labels


def hf_head_loss(weight, hidden, labels, **kw):
    """transformers' loss and gradients (loss, d hidden, dW, d logits): nn.functional.linear + ForCausalLMLoss."""
    w = weight.detach().clone().requires_grad_()
    h = hidden.detach().clone().requires_grad_()
    logits = torch.nn.functional.linear(h, w)
    logits.retain_grad()
    loss = ForCausalLMLoss(logits, labels, vocab_size=w.shape[0], **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad, logits.grad


def ours(weight, hidden, labels, sink=None, **kw):
    w = weight.detach().clone().requires_grad_()
    h = hidden.detach().clone().requires_grad_()
    loss = causal_lm_loss(h, w, labels, sink=sink, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def assert_close(got, ref, dtype, what):
    assert got is not None and got.dtype == ref.dtype and got.shape == ref.shape, what
    err = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    assert err <= TOL[dtype] * scale, f"{what}: off by {err:.3e} (max |ref| {scale:.3e})"


def problem(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(V, D, generator=gen) * 0.2).to(dtype)
    hidden = torch.randn(B, S, D, generator=gen).to(dtype)
    return gen, weight, hidden


LOSS_CASES = {  # (labels, keywords)
    "mean": lambda gen: (random_labels(gen), {}),
    "num_items_tensor": lambda gen: (random_labels(gen), {"num_items_in_batch": torch.tensor(37)}),
    "num_items_int": lambda gen: (random_labels(gen), {"num_items_in_batch": 29}),
    "shift_labels": lambda gen: (random_labels(gen), {"shift_labels": random_labels(gen)}),
    "ignore_index_0": lambda gen: (random_labels(gen).clamp_min(0), {"ignore_index": 0}),
}


@pytest.mark.parametrize("block_rows", [None, 128, 64])
@pytest.mark.parametrize("case", sorted(LOSS_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_loss_and_gradients_match_transformers(dtype, case, block_rows):
    gen, weight, hidden = problem(dtype, seed=hash((str(dtype), case, block_rows)) % 2**31)
    labels, kw = LOSS_CASES[case](gen)
    ref_loss, ref_dh, ref_dw, _ = hf_head_loss(weight, hidden, labels, **kw)
    for sink in (None, AutogradRows()):
        loss, dh, dw = ours(weight, hidden, labels, sink=sink, block_rows=block_rows, **kw)
        assert loss.dtype == torch.float32 and loss.shape == ()
        assert abs(loss.item() - ref_loss.item()) <= 2e-6 * abs(ref_loss.item()), (loss.item(), ref_loss.item())
        assert_close(dh, ref_dh, dtype, "d hidden")
        assert_close(dw, ref_dw, dtype, "dW")


def test_no_valid_token_gives_nan_as_transformers_does():
    gen, weight, hidden = problem(torch.float32, seed=3)
    labels = torch.full((B, S), -100)
    ref_loss = hf_head_loss(weight, hidden, labels)[0]
    loss, dh, dw = ours(weight, hidden, labels, block_rows=128)
    assert ref_loss.isnan() and loss.isnan()


def test_the_whole_model_matches_its_own_loss():
    """LlamaForCausalLM's loss and every parameter's gradient, installed against its own forward, bf16 and fp32."""
    for dtype in DTYPES:
        model = tiny_llama(seed=1).to(dtype)
        gen = torch.Generator().manual_seed(11)
        ids = torch.randint(0, V, (B, S), generator=gen)
        labels = random_labels(gen)
        ref = model(ids, labels=labels, num_items_in_batch=torch.tensor(20))
        ref.loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        handle = hf_head.install(model, block_rows=128)
        out = model(ids, labels=labels, num_items_in_batch=torch.tensor(20))
        assert out.logits is None
        assert abs(out.loss.item() - ref.loss.item()) <= 2e-6 * abs(ref.loss.item())
        out.loss.backward()
        for n, p in model.named_parameters():
            assert_close(p.grad, ref_grads[n], dtype, n)
        handle.remove()


@pytest.mark.parametrize("model_type", sorted(hf_head.SUPPORTED_MODEL_TYPES))
def test_each_supported_model_type_matches_its_own_loss(model_type):
    """Each listed model type's forward in the installed transformers is lm_head then the causal-LM loss."""
    cfg = transformers.AutoConfig.for_model(model_type, **_llama_keywords())
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert cfg.model_type == model_type
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (B, S), generator=gen)
    labels = random_labels(gen)
    ref = model(ids, labels=labels)
    ref.loss.backward()
    ref_dw = model.lm_head.weight.grad.clone()
    model.zero_grad()
    hf_head.install(model, block_rows=128)
    out = model(ids, labels=labels)
    out.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) <= 2e-6 * abs(ref.loss.item())
    assert_close(model.lm_head.weight.grad, ref_dw, torch.float32, "dW")


class RecordingSink:
    """A RowSink that records what it is handed, checks the protocol, and passes the blocks to `inner`."""

    def __init__(self, inner=None, fused=True):
        self.inner, self.fused = inner, fused
        self.calls, self.blocks = [], []

    def begin(self):
        self.calls.append("begin")
        return self.inner.begin() if self.inner is not None else self.fused

    def fused_rows(self, x, dy, r0):
        self.calls.append("rows")
        self.blocks.append((x, dy.clone(), r0))
        if self.inner is not None:
            self.inner.fused_rows(x, dy, r0)

    def grad_rows(self, grad, r0):
        raise AssertionError("the head hands fused_rows only")

    def finish(self):
        self.calls.append("finish")
        if self.inner is not None:
            self.inner.finish()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_sink_gets_every_row_once_with_autograds_logit_gradient(dtype):
    gen, weight, hidden = problem(dtype, seed=21)
    labels = random_labels(gen)
    _, ref_dh, ref_dw, ref_dlogits = hf_head_loss(weight, hidden, labels)
    sink = RecordingSink()
    loss, dh, dw = ours(weight, hidden, labels, sink=sink, block_rows=128)
    assert dw is None  # fused: autograd gets no dW
    assert sink.calls == ["begin", "rows", "rows", "rows", "finish"]
    assert [(r0, dy.shape[1]) for _, dy, r0 in sink.blocks] == [(0, 128), (128, 128), (256, 44)]
    dy = torch.cat([dy for _, dy, _ in sink.blocks], dim=1)
    assert dy.dtype == dtype
    assert_close(dy, ref_dlogits.reshape(B * S, V), dtype, "d logits")
    assert all(torch.equal(x, hidden.reshape(B * S, D)) for x, _, _ in sink.blocks)
    assert_close(dh, ref_dh, dtype, "d hidden")
    # begin() False: the dense dW to autograd, no blocks
    off = RecordingSink(fused=False)
    _, _, dw = ours(weight, hidden, labels, sink=off, block_rows=128)
    assert off.calls == ["begin"]
    assert_close(dw, ref_dw, dtype, "dW")


def torch_adamw_step(w, grad, state, step, hypers):
    """One float64 torch.optim.AdamW step of weight w from grad, starting from FORGE's state before the step."""
    p = w.detach().double().clone().requires_grad_()
    opt = torch.optim.AdamW([p], foreach=False, **hypers)
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": state["exp_avg"].clone(),
                    "exp_avg_sq": state["exp_avg_sq"].clone()}
    p.grad = grad
    opt.step()
    return p.detach()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_three_adamw_steps_in_backward_match_torch_adamw(dtype):
    """The head's weight after each of 3 steps through ParamUpdateRows against torch.optim.AdamW (float64, CPU) from
    transformers' gradient of the logits (CPU); d hidden from the old weights each step. The kernels' tensors are on
    DEVICE."""
    hypers = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    model = tiny_llama(seed=4).to(DEVICE, dtype)
    weight = model.lm_head.weight
    spec = forge_dsl.load_spec("adamw")
    state = forge_dsl.init_state(spec, weight.data, layout="fp32")
    inner = ParamUpdateRows("adamw", weight, state, seed=3, **hypers)
    gen = torch.Generator().manual_seed(8)
    for step in range(1, 4):
        hidden = torch.randn(B, S, D, generator=gen).to(dtype)
        labels = random_labels(gen)
        w_before = weight.detach().cpu().clone()
        _, ref_dh, _, ref_dlogits = hf_head_loss(w_before, hidden, labels)
        x = hidden.reshape(B * S, D).double()
        g = ref_dlogits.reshape(B * S, V).double().T @ x
        before = as_float64_state(state, spec)
        ref_w = torch_adamw_step(w_before, g, before, step, hypers)
        sink = RecordingSink(inner)
        h = hidden.to(DEVICE, copy=True).requires_grad_()
        causal_lm_loss(h, weight, labels.to(DEVICE), sink=sink, block_rows=128).backward()
        assert weight.grad is None and inner.steps == step
        assert_close(h.grad.cpu(), ref_dh, dtype, f"step {step}: d hidden")
        # the kernel's dW is an fp32 sum of its own dY (which may differ from transformers' in a bf16 last bit)
        dy = torch.cat([dy for _, dy, _ in sink.blocks], dim=1).cpu()
        delta = dw_error_bound(dy, hidden.reshape(B * S, D)) + (dy.double() - ref_dlogits.reshape(B * S, V).double()
                                                                ).abs().T @ x.abs()
        spread = torch.maximum((torch_adamw_step(w_before, g + delta, before, step, hypers) - ref_w).abs(),
                               (torch_adamw_step(w_before, g - delta, before, step, hypers) - ref_w).abs())
        assert not torch.equal(ref_w, w_before.double()), "the reference must move the weights"
        err = (weight.detach().cpu().double() - ref_w).abs()
        tol = weight_bound(ref_w, dtype) + spread
        assert (err <= tol).all(), f"step {step}: {(err > tol).sum().item()} weights beyond their bound"


def test_nothing_of_tokens_by_vocab_is_saved_for_backward():
    gen, weight, hidden = problem(torch.bfloat16, seed=9)
    labels = random_labels(gen)
    T = B * S

    def saved_shapes(fn):
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        w = weight.clone().requires_grad_()
        h = hidden.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(h, w)
        return shapes

    hf = saved_shapes(lambda h, w: ForCausalLMLoss(torch.nn.functional.linear(h, w), labels, vocab_size=V))
    assert any(s[-1] == V and s[0] * (s[1] if len(s) > 2 else 1) == T for s in hf if len(s) >= 2)  # the hook sees it
    got = saved_shapes(lambda h, w: causal_lm_loss(h, w, labels, block_rows=128))
    assert got and all(torch.Size(s).numel() <= T * D for s in got), got
    assert all(V not in s for s in got), got


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The most bytes of tensor storage created under this mode that were alive at once (CPU, a counting
    allocator by weak references: a storage counts from the op that made it to its last tensor's death)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _free(self, key):
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key not in self.live:
                    if key in inputs:  # a view of (or in place on) storage made before this mode: not new
                        continue
                    self.live[key] = [0, t.untyped_storage().nbytes()]
                    self.now += self.live[key][1]
                    self.peak = max(self.peak, self.now)
                self.live[key][0] += 1
                weakref.finalize(t, self._free, key)
        return out


def test_the_backward_holds_one_vocabulary_block_at_a_time():
    vocab, dim, rows = 2048, 16, 128
    gen = torch.Generator().manual_seed(12)
    weight = (torch.randn(vocab, dim, generator=gen) * 0.2).to(torch.bfloat16).requires_grad_()
    hidden = torch.randn(B, S, dim, generator=gen).to(torch.bfloat16).requires_grad_()
    labels = random_labels(gen, vocab=vocab)
    T = B * S
    block = T * rows * 4  # one block's fp32 logits
    sink = RecordingSink()
    sink.fused_rows = lambda x, dy, r0: None  # takes the blocks, keeps nothing

    def peak(fn):
        mode = LiveBytes()
        with mode:
            fn()
        return mode.peak

    loss = causal_lm_loss(hidden, weight, labels, sink=sink, block_rows=rows)
    # one block's fp32 logits beside their bf16 copy (or its bf16 dY), d hidden in fp32 and bf16, [T] vectors,
    # and on the CPU the block's weight rows in fp32 (no bf16 -> fp32 GEMM there)
    bound = block * 3 // 2 + T * dim * 6 + 64 * T + rows * dim * 4
    assert peak(loss.backward) <= bound
    ref = ForCausalLMLoss(torch.nn.functional.linear(hidden, weight), labels, vocab_size=vocab)
    assert peak(ref.backward) > 4 * bound  # transformers' backward holds [T, V] gradients
    assert peak(lambda: causal_lm_loss(hidden, weight, labels, block_rows=rows)) <= bound


def test_the_backward_uses_the_weights_of_the_forward():
    gen, weight, hidden = problem(torch.float32, seed=13)
    w = weight.clone().requires_grad_()
    loss = causal_lm_loss(hidden.requires_grad_(), w, random_labels(gen), block_rows=128)
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place between causal_lm_loss's forward and its backward"):
        loss.backward()


def test_compiled_loss_is_the_plain_path():
    gen, weight, hidden = problem(torch.float32, seed=14)
    labels = random_labels(gen)
    ref_loss, ref_dh, ref_dw, _ = hf_head_loss(weight, hidden, labels, num_items_in_batch=torch.tensor(17))
    fn = torch.compile(lambda h, w: causal_lm_loss(h, w, labels, sink=RecordingSink(),
                                                   num_items_in_batch=torch.tensor(17)), backend="aot_eager")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 2e-6 * abs(ref_loss.item())
    assert_close(h.grad, ref_dh, torch.float32, "d hidden")
    assert_close(w.grad, ref_dw, torch.float32, "dW")  # autograd's dW: the sink is not used under compile


def test_vocab_block_rows():
    assert head_loss.vocab_block_rows(2048, 128256) == 16384
    assert head_loss.vocab_block_rows(8192, 128256) == 4096
    assert head_loss.vocab_block_rows(24, 300) == 300  # the whole vocabulary: one block
    assert head_loss.vocab_block_rows(10**7, 128256) == 128  # never fewer than 128 rows
    for tokens in (1, 100, 2048, 5000, 70000):
        rows = head_loss.vocab_block_rows(tokens, 10**6)
        assert rows == 10**6 or rows % 128 == 0 and (rows == 128 or tokens * rows * 4 <= head_loss.LOGITS_BLOCK_BYTES)


# ----------------------------------------------------------------------------
# install / remove
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_install_trains_with_the_sink_and_leaves_generation_alone(tied):
    model = tiny_llama(seed=6, tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(1))
    greedy = model.generate(ids, max_new_tokens=5, do_sample=False)
    logits = model(ids).logits
    asked = []
    sink = RecordingSink()

    def sink_for(weight):
        asked.append(weight)
        return sink

    handle = hf_head.install(model, sink_for=sink_for, block_rows=128)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), greedy)
    assert torch.equal(model(ids).logits, logits)  # without labels: the model's own forward
    out = model(ids, labels=ids)
    assert out.logits is None and out.loss.shape == ()
    out.loss.backward()
    if tied:  # the tied weight gets both uses' gradients from autograd, the sink is never asked
        assert asked == [] and sink.calls == [] and model.lm_head.weight.grad is not None
    else:
        assert asked == [model.lm_head.weight] and sink.calls[0] == "begin" and sink.calls[-1] == "finish"
        assert model.lm_head.weight.grad is None
    # return_dict=False: the tuple of the model's own, without logits
    loss_tuple = model(ids, labels=ids, return_dict=False)
    assert isinstance(loss_tuple, tuple) and loss_tuple[0].shape == ()
    handle.remove()
    assert "forward" not in model.__dict__
    handle.remove()  # again: nothing
    assert model(ids, labels=ids).logits is not None


def test_tied_head_matches_its_own_loss():
    model = tiny_llama(seed=7, tie_word_embeddings=True)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    ref = model(ids, labels=ids)
    ref.loss.backward()
    ref_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    hf_head.install(model, sink_for=lambda w: RecordingSink(), block_rows=128)
    out = model(ids, labels=ids)
    out.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) <= 2e-6 * abs(ref.loss.item())
    assert_close(model.lm_head.weight.grad, ref_grad, torch.float32, "tied dW (embedding + head)")


def test_copies_of_an_installed_model_are_plain():
    model = tiny_llama(seed=8)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(3))
    handle = hf_head.install(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buf, weights_only=False)]
    for c in copies:
        assert not isinstance(c.__dict__.get("forward"), hf_head._HeadForward)
        out = c(ids, labels=ids)
        assert out.logits is not None  # its own forward: the logits are there
        ours_loss = model(ids, labels=ids).loss  # the installed original's
        assert abs(out.loss.item() - ours_loss.item()) <= 2e-6 * abs(ours_loss.item())
        h = hf_head.install(c)  # a copy can be installed, and removed, again
        assert c(ids, labels=ids).logits is None
        h.remove()
        assert c(ids, labels=ids).logits is not None
    handle.remove()


def _llama_keywords():
    return {k: v for k, v in llama_config().to_diff_dict().items() if k != "model_type"}


def _gemma2():
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**_llama_keywords()))


def _cohere():
    return transformers.CohereForCausalLM(transformers.CohereConfig(**_llama_keywords()))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=4))


def _with_bias():
    model = tiny_llama()
    model.lm_head = torch.nn.Linear(D, V, bias=True)
    return model


class _MyLinear(torch.nn.Linear):
    pass


def _subclass_head():
    model = tiny_llama()
    model.lm_head = _MyLinear(D, V, bias=False)
    return model


def _hooked_head():
    model = tiny_llama()
    model.lm_head.register_forward_hook(lambda m, i, o: o * 2)
    return model


def _vocab_mismatch():
    model = tiny_llama()
    model.lm_head = torch.nn.Linear(D, V + 1, bias=False)
    return model


def _instance_forward():
    model = tiny_llama()
    model.forward = lambda *a, **k: None
    return model


def _installed_twice():
    model = tiny_llama()
    hf_head.install(model)
    return model


def _no_lm_head():
    model = tiny_llama()
    model.lm_head = None
    return model


INSTALL_REFUSALS = {
    "gemma2_softcapping": (_gemma2, "soft-caps the logits.*final_logit_softcapping = 30.0"),
    "cohere_logit_scale": (_cohere, r"scales the logits.*config\.logit_scale = 0\.0625"),
    "model_type": (_gpt2, "GPT2LMHeadModel has model_type 'gpt2'; install supports"),
    "not_a_module": (lambda: "llama", "expected a Hugging Face causal LM .*got str"),
    "bias": (_with_bias, "model.lm_head has a bias"),
    "subclass": (_subclass_head, "model.lm_head is a _MyLinear, not a plain nn.Linear"),
    "hooks": (_hooked_head, "model.lm_head has forward hooks"),
    "vocab": (_vocab_mismatch, "model.lm_head has 301 outputs but config.vocab_size is 300"),
    "instance_forward": (_instance_forward, "forward was replaced on the instance"),
    "twice": (_installed_twice, "already installed on this model"),
    "no_lm_head": (_no_lm_head, "lacks model.model .* or model.lm_head"),
}


@pytest.mark.parametrize("case", sorted(INSTALL_REFUSALS))
def test_install_refusals(case):
    make, message = INSTALL_REFUSALS[case]
    model = make()
    before = model.__dict__.get("forward") if isinstance(model, torch.nn.Module) else None
    with pytest.raises(ValueError, match=message):
        hf_head.install(model)
    if isinstance(model, torch.nn.Module):
        assert model.__dict__.get("forward") is before


def test_install_argument_refusals():
    with pytest.raises(TypeError, match="sink_for must be a callable"):
        hf_head.install(tiny_llama(), sink_for=3)
    with pytest.raises(ValueError, match="block_rows must be a positive int"):
        hf_head.install(tiny_llama(), block_rows=0)


def test_refusals_at_forward():
    model = tiny_llama()
    ids = torch.randint(0, V, (B, S))
    hf_head.install(model)
    with pytest.raises(ValueError, match="logits_to_keep=1 with labels"):
        model(ids, labels=ids, logits_to_keep=1)
    model.loss_function = lambda **kw: None
    with pytest.raises(RuntimeError, match="not transformers' ForCausalLMLoss"):
        model(ids, labels=ids)
    del model._loss_function
    model.lm_head.register_forward_pre_hook(lambda m, i: None)
    with pytest.raises(RuntimeError, match="model.lm_head has forward hooks"):
        model(ids, labels=ids)


def _args(**kw):
    gen, weight, hidden = problem(torch.float32, seed=15)
    args = dict(hidden=hidden, weight=weight, labels=random_labels(gen))
    args.update(kw)
    return args


LOSS_REFUSALS = {
    "labels_float": (TypeError, "labels must hold int64 .* got torch.float32",
                     dict(labels=torch.zeros(B, S))),
    "labels_shape": (ValueError, r"labels has shape \(2, 11\) but hidden's tokens have shape \(2, 12\)",
                     dict(labels=torch.zeros(B, S - 1, dtype=torch.long))),
    "labels_none": (TypeError, "labels must be a tensor of token ids, got NoneType", dict(labels=None)),
    "shift_labels_shape": (ValueError, "shift_labels has shape",
                           dict(shift_labels=torch.zeros(B * S, dtype=torch.long))),
    "labels_out_of_range": (ValueError, r"labels hold 1 target ids outside \[0, 300\) .* e.g. 300",
                            dict(labels=torch.tensor([[0] * (S - 1) + [7], [0, 300] + [0] * (S - 2)]))),
    "negative_label": (ValueError, r"labels hold 1 target ids outside \[0, 300\) that are not ignore_index \(-100\)",
                       dict(labels=torch.tensor([[0, -5] + [0] * (S - 2), [0] * S]))),
    "dtype_mismatch": (TypeError, "hidden is torch.bfloat16 but weight is torch.float32",
                       dict(hidden=torch.randn(B, S, D, dtype=torch.bfloat16))),
    "hidden_int": (TypeError, "hidden must be a floating-point tensor",
                   dict(hidden=torch.zeros(B, S, D, dtype=torch.long))),
    "weight_shape": (ValueError, r"weight is \[300, 63\] but hidden's last dimension is 64",
                     dict(weight=torch.randn(V, D - 1))),
    "weight_1d": (ValueError, "weight must be the head's weight", dict(weight=torch.randn(V))),
    "sink": (TypeError, "sink must be a forge_dsl.training.row_updates.RowSink", dict(sink=object())),
    "ignore_index": (TypeError, "ignore_index must be an int", dict(ignore_index=-100.0)),
    "num_items_bool": (TypeError, "num_items_in_batch must be a number or a one-element tensor",
                       dict(num_items_in_batch=True)),
    "num_items_vector": (TypeError, "num_items_in_batch must be a number", dict(num_items_in_batch=torch.ones(2))),
    "block_rows": (ValueError, "block_rows must be a positive int or None, got 0", dict(block_rows=0)),
}


@pytest.mark.parametrize("case", sorted(LOSS_REFUSALS))
def test_loss_refusals(case):
    error, message, kw = LOSS_REFUSALS[case]
    args = _args(**kw)
    with pytest.raises(error, match=message):
        causal_lm_loss(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


def test_autocast_is_refused():
    args = _args()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="does not run under torch.autocast"):
            causal_lm_loss(args["hidden"], args["weight"], args["labels"])
