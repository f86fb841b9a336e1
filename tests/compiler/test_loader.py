"""Which generated module runs: forge-gen's output when current, else a verified cache entry.

Also: nothing of a spec's path reaches generated code, files are written atomically, the cache
folder's environment variables, and forge-gen's errors on bad input (one line, no traceback).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import forge_dsl
from forge_dsl.compiler import forge_gen as cli, codegen
from forge_dsl import kernels
from forge_dsl.spec.errors import SpecError
from forge_dsl.compiler import loader as compiled
from repo import ROOT


SPEC = """\
# A user's optimizer: heavy-ball momentum with decoupled weight decay.
optimizer {name} "{doc}"
hyper lr = 0.1 in [0, inf)
hyper weight_decay = 0 in [0, inf)
flag maximize = false
state velocity = 0
require lr < 10, "{require}"
update {{
    velocity = 0.5 * velocity + where(maximize, -grad, grad)
    param = param * (1 - lr * weight_decay) - lr * velocity
}}
"""


def write_spec(folder: Path, name: str = "heavy", doc: str = "heavy ball", require: str = "lr is too large") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.fopt"
    path.write_text(SPEC.format(name=name, doc=doc, require=require), encoding="utf-8")
    return path


def forget_loaded_modules():
    """What this process has looked up and executed (a new run of the program sees the files afresh)."""
    compiled._compiled.cache_clear()
    compiled._BY_SPEC_OBJECT.clear()
    compiled._LOADED.clear()


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_DSL_CACHE", str(tmp_path / "cache"))
    forget_loaded_modules()
    yield tmp_path / "cache"
    forget_loaded_modules()


def used(spec_file) -> Path:
    return Path(compiled.compiled_module(forge_dsl.load_spec(str(spec_file))).__file__)


def cache_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.py")) if cache.is_dir() else []


# ----------------------------------------------------------------------------
# 1. forge-gen's output is what runs
# ----------------------------------------------------------------------------


def test_forge_gen_output_beside_the_spec_is_used(tmp_path, private_cache):
    spec = write_spec(tmp_path / "mine")
    assert cli.main([str(spec.parent)]) == 0
    assert used(spec) == tmp_path / "mine" / "heavy.py"
    assert compiled.module_path(str(spec)) == tmp_path / "mine" / "heavy.py"
    assert cache_files(private_cache) == []


def test_forge_gen_output_beside_optimizers_is_used(tmp_path, private_cache):
    spec = write_spec(tmp_path / "optimizers")
    assert cli.main([str(spec.parent)]) == 0
    assert used(spec) == tmp_path / "generated" / "heavy.py"
    assert cache_files(private_cache) == []


def test_forge_gen_dash_o_output_is_used_and_runs(tmp_path, private_cache):
    """`forge-gen SPEC -o OUT/` records OUT/<name>.py; the same text loaded from elsewhere runs it too."""
    spec = write_spec(tmp_path / "specs")
    assert cli.main([str(spec), "-o", str(tmp_path / "out")]) == 0
    assert used(spec) == tmp_path / "out" / "heavy.py"
    elsewhere = tmp_path / "copy" / "heavy.fopt"
    elsewhere.parent.mkdir()
    shutil.copy(spec, elsewhere)
    forget_loaded_modules()
    assert used(elsewhere) == tmp_path / "out" / "heavy.py"
    assert cache_files(private_cache) == []

    # The module that is used works: one step in the interpreter against the float64 reference.
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(5, 70, generator=gen)
    g = torch.randn(5, 70, generator=gen)
    state = forge_dsl.init_state(str(spec), w, layout="fp32")
    ref_w = w.double()
    ref_state = forge_dsl.init_state(str(spec), ref_w)
    for step in (1, 2):
        kernels.step(str(spec), w, g, state, step=step, lr=0.05, weight_decay=0.1)
        forge_dsl.reference_step(str(spec), ref_w, g.double(), ref_state, step=step, lr=0.05, weight_decay=0.1)
    assert torch.allclose(w.double(), ref_w, rtol=1e-6, atol=1e-6)
    assert not torch.equal(w.double(), g.double())


def test_stale_module_is_passed_over_quietly(tmp_path, private_cache):
    spec = write_spec(tmp_path / "mine")
    assert cli.main([str(spec)]) == 0
    spec.write_text(spec.read_text().replace("0.5 * velocity", "0.25 * velocity"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = used(spec)
    assert path.parent == private_cache
    assert "0.25" in path.read_text()


def test_compiler_change_makes_generated_modules_stale(tmp_path, private_cache, monkeypatch):
    spec = write_spec(tmp_path / "mine")
    assert cli.main([str(spec)]) == 0
    assert used(spec) == tmp_path / "mine" / "heavy.py"
    forget_loaded_modules()
    sources = codegen._compiler_sources()
    monkeypatch.setattr(codegen, "_compiler_sources",
                        lambda: [(n, t + "\n# changed\n" if n.endswith("lowering.py") else t) for n, t in sources])
    codegen.compiler_hash.cache_clear()
    try:
        path = used(spec)
        assert path.parent == private_cache and codegen.compiler_hash() in path.name
        assert f'COMPILER_HASH = "{codegen.compiler_hash()}"' in path.read_text()
    finally:
        codegen.compiler_hash.cache_clear()


def test_compiler_hash_covers_the_pipelines_modules():
    """COMPILER_MODULES is every forge_dsl module that parse_spec, check_spec and render_module import."""
    package = ROOT / "forge_dsl"
    seen: set[str] = set()
    todo = ["spec/parser", "spec/checker", "compiler/codegen"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        here = name.split("/")[:-1]
        for node in ast.walk(ast.parse((package / f"{name}.py").read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = here[:len(here) - (node.level - 1)]
            elif (node.module or "").startswith("forge_dsl."):
                base = []
                node = ast.ImportFrom(module=node.module.split(".", 1)[1], names=node.names, level=0)
            else:
                continue
            parts = base + (node.module.split(".") if node.module else [])
            targets = ["/".join(parts)] if node.module else ["/".join(parts + [a.name]) for a in node.names]
            todo += [t for t in targets if (package / f"{t}.py").is_file()]
    assert sorted(seen) == sorted(codegen.COMPILER_MODULES)
    names = [n for n, _ in codegen._compiler_sources()]
    assert "grammars/fopt.lark" in names and "forge_dsl/compiler/templates/module.py.j2" in names


def test_header_names_the_command_that_regenerates_it(tmp_path):
    builtin = (ROOT / "generated" / "adamw.py").read_text().splitlines()
    assert builtin[1] == "# Do not edit: change the spec or the compiler and run `forge-gen optimizers/`."
    spec = write_spec(tmp_path / "mine")
    assert cli.main([str(spec)]) == 0
    head = (tmp_path / "mine" / "heavy.py").read_text().splitlines()
    assert head[0] == "# Generated by forge-gen from heavy.fopt with forge_dsl/compiler/templates/module.py.j2."
    assert head[1] == "# Do not edit: change the spec or the compiler and run `forge-gen heavy.fopt` in this folder."
    assert cli.main([str(spec), "-o", str(tmp_path / "out")]) == 0
    head = (tmp_path / "out" / "heavy.py").read_text().splitlines()
    assert head[1] == ("# Do not edit: change the spec or the compiler and run "
                       "`forge-gen <spec folder>/heavy.fopt -o <this folder>`.")


# ----------------------------------------------------------------------------
# 2. Nothing of the spec's path or text reaches generated code but names and numbers
# ----------------------------------------------------------------------------

# After the line break, Python; then '#' makes the rest of the header's line a comment.
EVIL_NL = "x\nimport os; os._exit(3)\n#"
EVIL_CR = "y\rimport builtins; builtins.FORGE_PATH_RAN = 1\r#"


def test_path_with_newline_never_reaches_generated_code(tmp_path):
    """A folder name that is Python after a newline: the kernels' module is imported in a fresh
    process (os._exit(3) would end it with status 3) and its text holds no part of the path."""
    spec = write_spec(tmp_path / EVIL_NL)
    script = (
        "import sys, forge_dsl\n"
        "from forge_dsl.kernels import compiled\n"
        "m = compiled.compiled_module(forge_dsl.load_spec(sys.argv[1]))\n"
        "print(m.__file__)\n"
    )
    env = {**os.environ, "FORGE_DSL_CACHE": str(tmp_path / "cache"), "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", script, str(spec)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    text = Path(result.stdout.strip()).read_text()
    assert "os._exit" not in text and str(tmp_path) not in text and tmp_path.name not in text

    assert cli.main([str(spec)]) == 0
    text = (spec.parent / "heavy.py").read_text()
    assert "os._exit" not in text and str(tmp_path) not in text


def test_path_with_carriage_return_never_reaches_generated_code(tmp_path):
    import builtins

    spec = write_spec(tmp_path / EVIL_CR / "a")
    path = used(spec)
    assert not hasattr(builtins, "FORGE_PATH_RAN")
    data = path.read_bytes()
    assert b"builtins" not in data and b"\r" not in data and str(tmp_path).encode() not in data


@pytest.mark.parametrize("doc", ['a"""; import os; os._exit(3); """', "tab\there\x00nul\x0cff\u2028ls\u202ebidi\\",
                                 "caf\u00e9 \u2014 ok"])
def test_description_is_rendered_safely(tmp_path, doc):
    """The description reaches the docstring only as printable characters without quotes or backslashes."""
    spec = forge_dsl.load_spec(str(write_spec(tmp_path, doc="plain")))
    text = codegen.render_module(dataclasses.replace(spec, doc=doc), "beside")
    tree = ast.parse(text)  # a NUL byte would make it a SyntaxError
    docstring = ast.get_docstring(tree, clean=False)
    shown = docstring.split(": the per-element update")[0]
    assert all(c.isprintable() and c not in "\"\\" for c in shown)
    assert shown == "".join(c if c.isprintable() and c not in "\"\\" else "?" for c in doc)
    imports = {(n.module if isinstance(n, ast.ImportFrom) else n.names[0].name)
               for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    assert imports <= {"triton", "triton.language", "forge_dsl.kernels.math_lib", "forge_dsl.kernels.gluon_lib",
                       "forge_dsl.spec.scalar_ops"}
    if doc.startswith("caf"):
        assert "caf\u00e9 \u2014 ok: the per-element update" in text


def test_require_message_is_not_rendered(tmp_path):
    spec = write_spec(tmp_path, require="lr must stay small; import os")
    text = codegen.render_module(forge_dsl.load_spec(str(spec)), "cache")
    assert "import os" not in text and "stay small" not in text


def test_same_text_from_another_path_shares_one_path_free_cache_entry(tmp_path, private_cache):
    dirty = write_spec(tmp_path / EVIL_CR)
    clean = write_spec(tmp_path / "clean")
    assert used(dirty) == used(clean)
    assert len(cache_files(private_cache)) == 1
    data = cache_files(private_cache)[0].read_bytes()
    assert b"\r" not in data and b"FORGE_PATH_RAN" not in data


# ----------------------------------------------------------------------------
# 3, 4. Verified files: damaged ones are never executed; writes are atomic
# ----------------------------------------------------------------------------

BOOM = '\nraise RuntimeError("a damaged module was executed")\n'


@pytest.mark.parametrize("damage", ["empty", "cut short", "edited"])
def test_damaged_cache_file_is_rebuilt_never_executed(tmp_path, private_cache, damage):
    spec = write_spec(tmp_path / "mine")
    path = used(spec)
    assert path.parent == private_cache
    good = path.read_bytes()
    path.write_bytes({"empty": b"", "cut short": good[: len(good) // 2], "edited": good + BOOM.encode()}[damage])
    forget_loaded_modules()
    module = compiled.compiled_module(forge_dsl.load_spec(str(spec)))
    assert Path(module.__file__) == path and path.read_bytes() == good
    assert callable(module.host_v0)


def test_damaged_generated_module_warns_and_falls_back(tmp_path, private_cache):
    spec = write_spec(tmp_path / "mine")
    assert cli.main([str(spec)]) == 0
    target = tmp_path / "mine" / "heavy.py"
    target.write_text(target.read_text() + BOOM)
    with pytest.warns(compiled.GeneratedModuleWarning) as record:
        path = used(spec)
    assert path.parent == private_cache
    message = str(record[0].message)
    assert str(target) in message and "sha256 does not match" in message and f"forge-gen {spec}" in message


def builtin_copy(tmp_path, monkeypatch, name: str) -> Path:
    """A package generated/ folder (freshly rendered, as `forge-gen optimizers/` writes it) that the
    loader takes for forge_dsl.generated.

    Run from a folder without optimizers/: a built-in's path reads `optimizers/<name>.fopt`, and
    from the repository's root that finds its generated/ beside it."""
    import forge_dsl.generated as package

    monkeypatch.chdir(tmp_path)

    folder = tmp_path / "package_generated"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / f"{name}.py").write_text(codegen.render_module(forge_dsl.load_spec(name), "optimizers"), encoding="utf-8")
    monkeypatch.setattr(package, "__path__", [str(folder)])
    monkeypatch.delitem(sys.modules, f"forge_dsl.generated.{name}", raising=False)
    return folder / f"{name}.py"


def test_truncated_builtin_module_warns_and_falls_back(tmp_path, private_cache, monkeypatch):
    """An interrupted write left generated/sgd.py cut short with its header intact."""
    target = builtin_copy(tmp_path, monkeypatch, "sgd")
    data = target.read_bytes()
    target.write_bytes(data[: len(data) * 2 // 3])
    with pytest.warns(compiled.GeneratedModuleWarning, match="forge-gen optimizers/") as record:
        module = compiled.compiled_module(forge_dsl.load_spec("sgd"))
    assert str(target) in str(record[0].message)
    assert Path(module.__file__).parent == private_cache
    assert hasattr(module, "VARIANTS")


def test_intact_builtin_module_is_used(tmp_path, private_cache, monkeypatch):
    target = builtin_copy(tmp_path, monkeypatch, "sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiled.module_path("sgd") == target
    assert cache_files(private_cache) == []


def test_forge_gen_write_is_atomic(tmp_path, monkeypatch):
    """Interrupted before the new text is safely on disk: the old file stays whole, no debris."""
    spec = write_spec(tmp_path / "mine")
    assert cli.main([str(spec)]) == 0
    target = tmp_path / "mine" / "heavy.py"
    before = target.read_bytes()
    spec.write_text(spec.read_text().replace("0.5 * velocity", "0.25 * velocity"))

    def power_cut(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", power_cut)
    with pytest.raises(KeyboardInterrupt):
        cli.main([str(spec)])
    assert target.read_bytes() == before
    assert sorted(p.name for p in target.parent.iterdir()) == ["heavy.fopt", "heavy.py"]


def test_check_reports_a_damaged_file(tmp_path, capsys):
    spec = write_spec(tmp_path / "optimizers")
    assert cli.main([str(spec.parent)]) == 0
    target = tmp_path / "generated" / "heavy.py"
    text = target.read_text()
    target.write_text(text.replace("0.5 *", "0.6 *"))
    capsys.readouterr()
    assert cli.main(["--check", str(spec.parent)]) == 1
    err = capsys.readouterr().err
    assert "damaged (sha256 does not match the header)" in err and "heavy.py" in err
    assert f"run `forge-gen {spec.parent}`" in err


def test_registry_survives_junk(tmp_path, private_cache):
    private_cache.mkdir()
    (private_cache / compiled.REGISTRY).write_text("{not json")
    spec = write_spec(tmp_path / "specs")
    assert used(spec).parent == private_cache  # junk is ignored
    forget_loaded_modules()
    assert cli.main([str(spec), "-o", str(tmp_path / "out")]) == 0
    assert used(spec) == tmp_path / "out" / "heavy.py"


# ----------------------------------------------------------------------------
# 5. The cache folder
# ----------------------------------------------------------------------------


def test_cache_dir_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_DSL_CACHE", "")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert compiled.cache_dir() == Path.home() / ".cache" / "forge_dsl"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert compiled.cache_dir() == Path.home() / ".cache" / "forge_dsl"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert compiled.cache_dir() == Path.home() / ".cache" / "forge_dsl"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compiled.cache_dir() == tmp_path / "xdg" / "forge_dsl"
    monkeypatch.setenv("FORGE_DSL_CACHE", str(tmp_path / "own"))
    assert compiled.cache_dir() == tmp_path / "own"


def test_empty_cache_variable_does_not_write_into_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_DSL_CACHE", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    spec = write_spec(tmp_path / "mine")
    assert used(spec).parent == tmp_path / "xdg" / "forge_dsl"
    assert list(work.iterdir()) == []


def test_unwritable_cache_folder_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("FORGE_DSL_CACHE", str(tmp_path / "a_file" / "cache"))
    spec = write_spec(tmp_path / "mine")
    with pytest.raises(OSError, match="cannot write forge_dsl's cache folder .*a_file.*set FORGE_DSL_CACHE"):
        used(spec)


# ----------------------------------------------------------------------------
# 6. Bad input
# ----------------------------------------------------------------------------


def test_non_utf8_spec_is_a_located_spec_error(tmp_path, capsys):
    spec = tmp_path / "heavy.fopt"
    spec.write_bytes(b"optimizer heavy\n# caf\xe9!\nupdate { param = param }\n")
    with pytest.raises(SpecError) as err:
        forge_dsl.load_spec(str(spec))
    text = str(err.value)
    assert f"{spec}:2:6: the file is not UTF-8: byte 0xe9 starts a character" in text
    assert text.splitlines()[2] == "         ^"
    assert cli.main([str(spec), "-o", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().err
    assert "Traceback" not in out and "2:6: the file is not UTF-8" in out


@pytest.mark.parametrize("bad", ["\xff at the start", "at the end \xc3"])
def test_non_utf8_messages(tmp_path, bad):
    spec = tmp_path / "x.fopt"
    spec.write_bytes(bad.encode("latin-1"))
    with pytest.raises(SpecError, match="cannot start a character" if bad[0] == "\xff" else "ends inside"):
        forge_dsl.load_spec(str(spec))


def bad_inputs(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("")
    spec = write_spec(tmp_path / "ok")
    return {
        "missing file": ([str(tmp_path / "nope.fopt")], "no such spec file or folder"),
        "folder without specs": ([str(tmp_path / "empty")], "no .fopt files in"),
        "output is a file": ([str(spec), "-o", str(tmp_path / "a_file")], "cannot write"),
    }


@pytest.mark.parametrize("case", ["missing file", "folder without specs", "output is a file"])
def test_forge_gen_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
    argv, message = bad_inputs(tmp_path)[case]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_forge_gen_unreadable_spec_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    spec = write_spec(tmp_path / "mine")
    real = Path.read_bytes

    def unreadable(self):
        if self.name == "heavy.fopt":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", unreadable)
    assert cli.main([str(spec)]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and "Permission denied" in err and len(err.strip().splitlines()) == 1


def test_forge_gen_console_script_prints_no_traceback(tmp_path):
    exe = shutil.which("forge-gen")
    if exe is None:
        pytest.skip("forge-gen is not on PATH (package not installed)")
    spec = tmp_path / "heavy.fopt"
    spec.write_bytes(b"optimizer heavy\n\xff\n")
    result = subprocess.run([exe, str(spec), "-o", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 1 and "Traceback" not in result.stderr and ":2:1:" in result.stderr
