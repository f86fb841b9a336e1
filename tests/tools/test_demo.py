"""The demo (`python -m forge_dsl.demo`): what it counts as memory held, and a short run beside torch AdamW."""

from __future__ import annotations

import re

import pytest
import torch

import forge_dsl
from forge_dsl import demo

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_held_bytes_counts_storages_once_and_consumed_grads_not_at_all():
    a = torch.zeros(100)
    assert demo.held_bytes([a, a[:10], None]) == 400  # a view shares its storage
    model = torch.nn.Linear(64, 64, bias=True).to(DEVICE)
    opt = forge_dsl.ForgeOptimizer(model, "adamw", lr=1e-3)
    model(torch.randn(8, 64, device=DEVICE)).sum().backward()
    assert type(model.weight.grad).__name__ == "ConsumedGrad"
    assert demo.grad_bytes(model) == 64 * 4  # the bias's gradient only: the weight was updated in backward
    opt.step()
    # exp_avg and exp_avg_sq of both parameters in fp32, and each parameter's step (float64) and seed (int64)
    assert demo.state_bytes(opt) == 2 * (64 * 64 + 64) * 4 + 2 * (8 + 8)


@pytest.mark.slow
def test_a_short_run_prints_losses_memory_and_draws_both_curves(tmp_path, capsys):
    png = tmp_path / "loss.png"
    assert demo.main(["--steps", "3", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "final loss" in out and png.stat().st_size > 0
    grads = {label: float(mib) for label, mib in re.findall(r"^  (torch\.optim\.AdamW|FORGE adamw).*?([\d.]+) MiB",
                                                            out, re.M)}
    assert grads["FORGE adamw"] < grads["torch.optim.AdamW"] / 10, out
