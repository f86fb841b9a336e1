"""`forge-bench model`'s report: the Markdown table and the plot of its rows (also of older records, which
lack the pools added since)."""

from __future__ import annotations

from .common import Results, format_table

__all__ = ["PEAK_POOLS", "peak_pools", "plot", "table"]

# the pools at the peak, in the table's and the plot's order: (key of at_peak_gib, table header, plot legend)
PEAK_POOLS = (("weights", "weights", "weights"), ("optimizer_state", "opt state", "optimizer state"),
              ("gradients", "grads", "gradients"), ("logits", "logits", "logits and their gradient"),
              ("activations", "activations", "activations saved by the decoder"),
              ("workspace", "workspace", "workspace (the rest)"))


def peak_pools(row: dict) -> dict:
    """A row's memory pools at its peak, GiB, adding up to the peak: `at_peak_gib` where the row has it; older
    records (before the loss and activation pools) as they measured it: weights, optimizer state, gradients at
    the end of backward, and the rest as workspace."""
    at_peak = row.get("at_peak_gib")
    if at_peak is not None:
        pools = {key: at_peak.get(key) for key, _, _ in PEAK_POOLS}
        pools["workspace"] = (pools["workspace"] or 0) + (at_peak.get("leftover") or 0)
        return pools
    return {"weights": row.get("weights_gib"), "optimizer_state": row.get("optimizer_state_gib"),
            "gradients": row.get("gradients_gib"), "logits": None, "activations": None,
            "workspace": row.get("rest_gib")}


def table(rows: list[dict]) -> str:
    """One line a row: the peak, where in the step it is, its pools (adding up to it), and the sizes of the
    loss's own memory and the saved activations whether or not they are resident at the peak."""
    headers = ["model", "tokens", "ckpt", "compiled", "GPUs", "method", "loss", "status", "peak GiB", "peak in",
               "step ms", "× first (rounds' min–max)", "tokens/s", *(f"{header} GiB" for _, header, _ in PEAK_POOLS), "loss own GiB",
               "saved act GiB", "on host GiB"]
    body = []
    for r in rows:
        pools = peak_pools(r)
        gpus = r.get("tp", 1)  # sharded runs: the peak and pools are the GPU with the highest peak's
        body.append([r["model"], f"{r.get('batch', 1)}×{r['seq']}", _ckpt_label(r),
                     "yes" if r.get("compiled") else "no", gpus if gpus == 1 else f"{gpus} ({r.get('sharding')})",
                     r["method"],
                     r.get("loss", "transformers"),  # records from before v3 have no --loss
                     r["status"], r.get("peak_gib"), r.get("peak_phase"), r.get("step_ms"), _ratio_cell(r), r.get("tokens_per_s"),
                     *(pools[key] for key, _, _ in PEAK_POOLS), r.get("logits_gib"), r.get("activations_gib"),
                     r.get("offloaded_gib")])
    return format_table(headers, body)


def _ratio_cell(row: dict) -> str:
    """The step time's ratio to the first method of its configuration, with the spread over rounds."""
    if row.get("ratio") is None:
        return ""
    if row.get("rounds", 1) == 1:
        return f"{row['ratio']:.3f}"
    return f"{row['ratio']:.3f} ({row['ratio_min']:.3f}–{row['ratio_max']:.3f})"


def _ckpt_label(row: dict) -> str:
    """The table's checkpointing cell: on / off, and "+ offload" for a run with --offload on."""
    return ("on" if row["checkpointing"] else "off") + (" + offload" if row.get("offload") else "")


def plot(plt, results: Results):
    """One line per run: peak memory stacked by pool (left) and step time (right), horizontal bars. The
    figure, drawn with `plt` (matplotlib.pyplot) for `Results.plot`."""
    rows = results.rows
    fig, (mem, time_ax) = plt.subplots(1, 2, figsize=(13, 1.5 + 0.22 * len(rows)), sharey=True,
                                       width_ratios=(3, 2), layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for y, r in enumerate(rows):
        if r["status"] != "ok":
            mem.text(0, y, f" {r['status']}", va="center", fontsize=7, color="tab:red")
            continue
        left = 0.0
        pools = peak_pools(r)
        for (key, _, _), color in zip(PEAK_POOLS, colors):
            if pools[key] is not None:
                mem.barh(y, pools[key], left=left, color=color, height=0.7)
                left += pools[key]
        time_ax.barh(y, r["step_ms"], color="gray", height=0.7)
    if all(r.get("peak_gib") is None for r in rows):
        mem.text(0.5, 0.5, "memory is measured on CUDA only", transform=mem.transAxes, ha="center")
    labels = [f"{r['model']} 1×{r['seq']} ckpt {_ckpt_label(r)} · {r['method']} · "
              f"{r.get('loss', 'transformers')}" for r in rows]
    mem.set_yticks(range(len(rows)), labels, fontsize=7)
    mem.invert_yaxis()
    mem.set_xlabel("peak memory (GiB), by the pools resident at the peak")
    # under the panels: inside, the legend covers the bars of the last rows, which reach across the axes
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors[:len(PEAK_POOLS)]],
               labels=[p[2] for p in PEAK_POOLS], fontsize=7, loc="outside lower center", ncol=len(PEAK_POOLS))
    time_ax.set_xlabel("step time (ms)")
    for ax in (mem, time_ax):
        ax.grid(axis="x", alpha=0.3)
    loss = results.data["settings"].get("loss", "transformers")  # records from before v3 have no --loss
    fig.suptitle(f"training step, bf16 weights, batch 1, {loss} loss (FORGE rows: the row's loss) — "
                 f"{results.data['device']}", fontsize=9)
    return fig
