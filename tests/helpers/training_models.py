"""The models, batches, training loops and assertions the training tests share (once tests/test_optim.py's).

    model = make_llama(seed) / make_mlp(seed)     small models on DEVICE (CUDA where there is one)
    train(model, opt, batches, loss_fn)           the README's loop
    assert_params_close(ours, theirs)             every parameter within REL_TOL of torch's
"""

from __future__ import annotations


import pytest  # noqa: F401  (helpers raise pytest's skips)
import torch
from torch import nn

from spec_lists import ELEMENT_WISE
from forge_dsl import ForgeOptimizer
from references import LionFormula

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPECS = ELEMENT_WISE
REL_TOL = 1e-5
MOVED = 100 * REL_TOL  # every fused weight must move by at least this much (relative), so a no-op fails


# ----------------------------------------------------------------------------
# Torch counterparts and hyperparameters
# ----------------------------------------------------------------------------


TORCH_OPTIMIZER = {
    "adamw": torch.optim.AdamW,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
    "sgd_momentum": torch.optim.SGD,
    "lion": LionFormula,
}

# Every weight moves by 2-100 % of its norm in 4 steps (far beyond REL_TOL, small enough that the runs do not
# amplify fp32 rounding differences); weight decay on where the spec has it.
HYPERS = {
    "adamw": dict(lr=2e-3, weight_decay=0.1),
    "nadam": dict(lr=2e-3, weight_decay=0.01),
    "radam": dict(lr=1e-2, betas=(0.9, 0.9), weight_decay=0.01),
    "rmsprop": dict(lr=2e-4, weight_decay=0.01, momentum=0.5),
    "adagrad": dict(lr=5e-3, weight_decay=0.01),
    "sgd": dict(lr=2.0, weight_decay=0.01),
    "sgd_momentum": dict(lr=1.0, momentum=0.9, weight_decay=0.01),
    "lion": dict(lr=1e-3, weight_decay=0.1),
}


# RAdam's rectified update starts once rho_t > 5: at step 6 with beta2 = 0.9 (never before step 6 for any beta2).
STEPS = {"radam": 6}


# ----------------------------------------------------------------------------
# Models, batches, training loop, comparisons
# ----------------------------------------------------------------------------


def llama_config(**overrides):
    transformers = pytest.importorskip("transformers")
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
              attn_implementation="eager")
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def make_llama(seed=0, dtype=torch.float32, **overrides):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config(**overrides))
    return model.to(device=DEVICE, dtype=dtype).train()


class MLP(nn.Module):
    """Linear layers with and without bias (widths not multiples of 64), a LayerNorm, inputs [B, S, D]."""

    def __init__(self, d=64, h=96, out=40):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.mid = nn.Linear(h, h, bias=False)
        self.norm = nn.LayerNorm(h)
        self.down = nn.Linear(h, out)

    def forward(self, x):
        return self.down(self.norm(nn.functional.gelu(self.mid(torch.tanh(self.up(x))))))


class SharedMLP(nn.Module):
    """`shared` is called twice in every forward pass."""

    def __init__(self, d=64, h=80):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.shared = nn.Linear(h, h)
        self.out = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.out(self.shared(torch.tanh(self.shared(torch.tanh(self.inp(x))))))


def make_mlp(seed=0, dtype=torch.float32, cls=MLP):
    torch.manual_seed(seed)
    return cls().to(device=DEVICE, dtype=dtype)


def twin(model: nn.Module, make) -> nn.Module:
    """A second instance (other random init) loaded with `model`'s weights."""
    other = make(seed=1234)
    other.load_state_dict(model.state_dict())
    return other


def llama_batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=gen).to(DEVICE) for _ in range(n)]


def mlp_batches(n, seed=1, d=64, out=40, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 5, d, generator=gen).to(DEVICE, dtype),
             torch.randn(2, 5, out, generator=gen).to(DEVICE, dtype)) for _ in range(n)]


def llama_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def mlp_loss(model, batch):
    x, y = batch
    return (model(x).float() - y.float()).pow(2).mean()


def train(model, opt, batches, loss_fn, scheduler=None, between=None):
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        if between is not None:
            between(model)
        losses.append(loss.item())
    return losses


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_params_close(ours, theirs, tol=REL_TOL):
    theirs = dict(theirs.named_parameters())
    errors = {n: rel_err(p, theirs[n]) for n, p in ours.named_parameters()}
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= tol}
    assert not bad, f"relative error above {tol}: {bad}"


def assert_params_equal(ours, theirs):
    theirs = dict(theirs.named_parameters())
    bad = [n for n, p in ours.named_parameters() if not torch.equal(p, theirs[n])]
    assert not bad, f"not bit-identical: {bad}"


def fused_names(opt: ForgeOptimizer) -> list[str]:
    return [h.name for h in opt._handles.values() if not h.shared]


def assert_fused_moved(opt, model, before, at_least=MOVED):
    names = fused_names(opt)
    assert names, "no weight was fused"
    params = dict(model.named_parameters())
    moved = {n: rel_err(params[n], before[n]) for n in names}
    still = {n: f"{m:.1e}" for n, m in moved.items() if not m >= at_least}
    assert not still, f"fused weights that barely moved: {still}"


def describe_line(opt, text: str) -> str:
    lines = [line for line in opt.describe().splitlines() if text in line]
    assert lines, opt.describe()
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# 1. Every spec, on a tiny Llama and on an MLP, against torch.optim
# ----------------------------------------------------------------------------


MODELS = {
    "llama": (make_llama, llama_batches, llama_loss),
    "mlp": (make_mlp, mlp_batches, mlp_loss),
}
