"""The README's "Your own optimizer" commands, run as written in a fresh folder: write the spec,
forge-gen, forge-test, and the module forge-gen wrote is the one that runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from repo import ROOT



def test_your_own_optimizer_commands_work_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Your own optimizer"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               FORGE_DSL_CACHE=str(tmp_path / "cache"))
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
