"""What every `forge-bench` subcommand shares: timing, results files, tables, progress, GPU memory.

Results go to `<out>/<subcommand>-<date>.{json,png}` (`<subcommand>-quick-<date>`
for `--quick` runs, so a smoke run never overwrites a full one).  The JSON
records the device, the torch and triton versions, the date, the git commit
and the exact command line beside the rows, and is rewritten after every row,
so a run that is cut short still leaves what it measured.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

class UsageError(Exception):
    """A bad filter or option value: reported as a one-line error, not a traceback."""


GIB = 2**30


# ---------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], None], device: torch.device, *, warmup_ms: float = 10, rep_ms: float = 50,
              cpu_reps: int = 3) -> float:
    """Median wall time of `fn()` in ms: `triton.testing.do_bench` on CUDA, `time.perf_counter` on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()  # compile / first-use costs stay out of the timing
    times = []
    for _ in range(cpu_reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_ms(fn: Callable[[], None], device: torch.device, *, calls: int = 20, replays: int = 10) -> float:
    """Median GPU time per call of `fn()` in ms, from a CUDA graph of `calls` calls replayed `replays` times.

    No host time is in it (launch costs, Python), unlike `median_ms`: what the kernels cost, as a
    training step captured in a graph would pay. `fn` is called once before capture (compiles, lazy
    state) and once on a side stream, as CUDA graph capture wants.
    """
    fn()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> Optional[int]:
    """Peak allocated bytes since the last reset, or None off CUDA (not measured there)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def allocated_bytes(device: torch.device) -> Optional[int]:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def free_memory(device: torch.device) -> None:
    """Collect garbage and give cached blocks back, so the next run starts from an empty allocator."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gib(n_bytes: Optional[float]) -> Optional[float]:
    return None if n_bytes is None else n_bytes / GIB


# ---------------------------------------------------------------------------
# Output: progress bar, table, results files
# ---------------------------------------------------------------------------


class Progress:
    """Progress of `total` items on stderr: a tqdm bar on a terminal; elsewhere (a log file, a pipe) plain
    lines `12/40 label 1m05s`, at most one every `interval` seconds, with no carriage return or ANSI code."""

    def __init__(self, total: int, stream=None, interval: float = 5.0) -> None:
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.interval = interval
        self.done = 0
        self.started = time.perf_counter()
        self.written = -math.inf
        self.bar = None
        if _is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, file=self.stream, dynamic_ncols=True, leave=True)

    def show(self, label: str) -> None:
        """Show the item now running (does not advance)."""
        if self.bar is not None:
            self.bar.set_postfix_str(label)
            return
        now = time.perf_counter()
        if now - self.written < self.interval and self.done < self.total:
            return
        self.written = now
        elapsed = int(now - self.started)
        self.stream.write(f"{self.done}/{self.total} {label} {elapsed // 60}m{elapsed % 60:02d}s\n")
        self.stream.flush()

    def advance(self, label: str = "") -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        self.show(label)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: floats to `digits` decimals, None as '—'."""
    if value is None:
        return "—"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}f}" if value == 0 or 10**-digits <= abs(value) < 1e5 else f"{value:.{digits}g}"
    return str(value)


def markdown_cell(text: str) -> str:
    """`text` as one Markdown table cell: `|` escaped (it would end the cell), line breaks as spaces."""
    return " ".join(text.replace("\\", "\\\\").replace("|", "\\|").splitlines())


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (right-aligned columns), ready for docs/PERF.md; every header and cell escaped."""
    headers = [markdown_cell(h) for h in headers]
    cells = [[markdown_cell(fmt(v)) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.rjust(w) for h, w in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join(lines)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, Triton interpreter)"


def git_commit(package_dir: Optional[Path] = None) -> Optional[str]:
    """HEAD of the project's checkout this package runs from, '+dirty' if it has uncommitted changes; None
    when the package is not imported from a git checkout of its own source (an installed wheel, a venv inside
    some other repository).

    `package_dir` (default: the imported `forge_dsl` package) must sit at the top of a git work tree that
    tracks its `__init__.py`.
    """
    package_dir = Path(package_dir or Path(__file__).resolve().parents[1]).resolve()
    root = package_dir.parent

    def git(*args: str) -> Optional[subprocess.CompletedProcess]:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None

    top = git("rev-parse", "--show-toplevel")
    if top is None or top.returncode or Path(top.stdout.strip()).resolve() != root:
        return None
    tracked = git("ls-files", "--error-unmatch", "--", f"{package_dir.name}/__init__.py")
    head = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain")
    if any(r is None or r.returncode for r in (tracked, head, dirty)):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


class Results:
    """The JSON (and PNG) of one run, under `<out>/<subcommand>[-quick]-<date>`."""

    def __init__(self, subcommand: str, argv: Sequence[str], out_dir: str, quick: bool, device: torch.device,
                 settings: dict) -> None:
        import triton

        now = _dt.datetime.now().astimezone()
        stem = f"{subcommand}{'-quick' if quick else ''}-{now.date().isoformat()}"
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.json_path = out / f"{stem}.json"
        self.png_path: Optional[Path] = out / f"{stem}.png"
        self.data = {
            "subcommand": subcommand,
            "command": shlex.join(["forge-bench", *argv]),
            "date": now.isoformat(timespec="seconds"),
            "device": device_name(device),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda if device.type == "cuda" else None,
            "python": platform.python_version(),
            "git_commit": git_commit(),
            "settings": settings,
            "rows": [],
        }

    @property
    def rows(self) -> list[dict]:
        return self.data["rows"]

    def add(self, row: dict) -> None:
        """Append a row and rewrite the JSON (a run cut short keeps what it measured)."""
        self.rows.append(row)
        self.save()

    def save(self) -> None:
        """Rewrite the JSON atomically (a run killed mid-write leaves the previous version)."""
        tmp = self.json_path.with_name(self.json_path.name + ".tmp")
        tmp.write_text(json.dumps(_finite(self.data), indent=1, allow_nan=False) + "\n")
        tmp.replace(self.json_path)

    def plot(self, draw: Callable[[Any, "Results"], Any]) -> bool:
        """Write the figure `draw(pyplot, self)` returns to `png_path`; without matplotlib write none, set
        `png_path` to None and return False (the plot is optional, the JSON and the table are not)."""
        try:
            plt = pyplot()
        except ImportError:
            self.png_path = None
            return False
        fig = draw(plt, self)
        try:
            tmp = self.png_path.with_name(self.png_path.name + ".tmp")
            fig.savefig(tmp, dpi=120, format="png")
            tmp.replace(self.png_path)
        finally:
            plt.close(fig)
        return True


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinite float replaced by None (strict JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def pyplot():
    """matplotlib.pyplot with the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
