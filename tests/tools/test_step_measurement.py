"""Issue K's measurement: `forge-bench model --rounds` (methods interleaved, ratios with their spread across rounds)
and the step anatomy (`python -m forge_dsl.bench.step_anatomy`): their arithmetic on made-up inputs, and the
anatomy run end to end on the CPU (the tiny model in the Triton interpreter)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from forge_dsl.bench import model, step_anatomy
from forge_dsl.bench.model_report import table

CPU = torch.autograd.DeviceType.CPU
CUDA = torch.autograd.DeviceType.CUDA


def test_rounds_rotate_the_methods_so_that_each_runs_first_in_turn():
    methods = ["torch-adamw", "forge-bf16", "forge-int8"]
    assert [model.rotated(methods, r)[0] for r in range(4)] == ["torch-adamw", "forge-bf16", "forge-int8",
                                                                "torch-adamw"]
    assert all(sorted(model.rotated(methods, r)) == sorted(methods) for r in range(3))


def _row(method, medians, steps=2, status="ok"):
    return [{"method": method, "status": status, "tokens": 512, "step_ms": m, "step_ms_all": [m] * steps,
             "peak_gib": 10.0 + i, "model": "m", "seq": 512, "checkpointing": False} for i, m in enumerate(medians)]


def test_a_row_is_the_median_of_its_rounds_and_its_ratio_the_median_of_per_round_ratios():
    torch_rows = model.combine_rounds(_row("torch-adamw", [100.0, 120.0, 110.0]))
    forge_rows = model.combine_rounds(_row("forge-bf16", [90.0, 96.0, 121.0]))
    assert torch_rows["step_ms"] == 110.0 and torch_rows["step_ms_rounds"] == [100.0, 120.0, 110.0]
    assert len(forge_rows["step_ms_all"]) == 6 and forge_rows["peak_gib_max"] == 12.0
    base, ours = model.with_ratios([torch_rows, forge_rows])
    assert base["ratio"] == 1.0 and (base["ratio_min"], base["ratio_max"]) == (1.0, 1.0)
    # per round: 0.9, 0.8, 1.1 -> median 0.9, spread 0.8 to 1.1 (not 96 / 110 of the medians)
    assert ours["ratio"] == pytest.approx(0.9) and ours["ratio_min"] == pytest.approx(0.8)
    assert ours["ratio_max"] == pytest.approx(1.1) and ours["ratio_to"] == "torch-adamw"
    assert "0.900 (0.800–1.100)" in table([{**ours, "compiled": False, "tp": 1}])


def test_a_round_that_failed_makes_the_row_a_failure_without_a_ratio():
    failed = model.combine_rounds(_row("forge-int8", [90.0]) + _row("forge-int8", [0.0], status="OOM"))
    assert failed["status"] == "OOM" and failed["rounds"] == 2
    base = model.combine_rounds(_row("torch-adamw", [100.0, 100.0]))
    assert "ratio" not in model.with_ratios([base, failed])[1]


def test_union_of_kernel_intervals_counts_overlaps_once():
    assert step_anatomy.union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert step_anatomy.union_us([]) == 0


@pytest.mark.parametrize("name, kind", [
    ("fused_ws", "FORGE fused, warp-specialized"), ("fused", "FORGE fused, Triton tiles"),
    ("rows_grad", "FORGE rows (embedding, head)"), ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_TNN", "matmul"),
    ("void multi_tensor_apply_kernel<FusedAdamMathFunctor>", "torch optimizer"),
    ("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
     "elementwise / other")])
def test_kernels_are_sorted_by_name_into_kinds(name, kind):
    assert step_anatomy.kernel_kind(name) == kind


def _event(name, start, end, device=CUDA, annotation=False):
    return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start, end=end))


def test_the_anatomy_splits_each_phase_into_kernels_and_idle_time_and_leaves_annotations_out():
    events = [
        _event("anatomy::forward", 0, 100, CPU), _event("anatomy::backward", 100, 300, CPU),
        _event("anatomy::optimizer", 300, 320, CPU),
        _event("anatomy::backward", 100, 300, annotation=True),  # the range's GPU-side copy: not a kernel
        _event("forge::linear_update", 150, 190, CPU), _event("forge::linear_update", 200, 230, annotation=True),
        _event("nvjet_gemm", 10, 60), _event("nvjet_gemm", 50, 70),  # overlapping: union 60
        _event("fused_ws", 160, 200), _event("fused_ws", 210, 240), _event("elementwise", 305, 310),
        _event("cudaDeviceSynchronize", 95, 100, CPU), _event("cudaDeviceSynchronize", 295, 300, CPU),
        _event("cudaDeviceSynchronize", 315, 320, CPU), _event("cudaStreamSynchronize", 120, 121, CPU),
    ]
    a = step_anatomy.analyse(events, "m", 1, 400.0, "cuda")
    assert a.phase_wall == {"forward": 0.1, "backward": 0.2, "optimizer": 0.02}
    assert a.busy[("forward", "matmul")] == pytest.approx(0.07)  # both kernels' own times
    assert a.idle["forward"] == pytest.approx(0.04)  # 100 - 60 of union
    assert a.busy[("backward", "FORGE fused, warp-specialized")] == pytest.approx(0.07)
    assert a.idle["backward"] == pytest.approx(0.13)
    assert a.busy[("optimizer", "elementwise / other")] == pytest.approx(0.005)
    assert a.syncs == 1 and a.kernels == 5 and a.forge_calls == 1 and a.forge_host_ms == pytest.approx(0.04)
    text = step_anatomy.anatomy_table([a, a])
    assert "GPU idle" in text and "FORGE fused, warp-specialized" in text


@pytest.mark.slow
def test_the_anatomy_runs_on_the_cpu(capsys):
    assert step_anatomy.main(["--device", "cpu", "--methods", "torch-adamw,forge-bf16", "--seq", "16",
                              "--warmup", "1", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "forge-bf16 − torch-adamw" in out and "FORGE host ms per step" in out
    # the interpreter has no reused launches: with Triton 3.6 reuse is on but the CPU is no Hopper GPU, with
    # other versions reuse is off
    updates = [line for line in out.splitlines() if "FORGE layer updates per step:" in line]
    assert updates and not any("per step: reused" in line for line in updates)
    assert any(why in line for line in updates for why in ("reuse off", "not a Hopper GPU with Gluon"))
