"""Finding the generated module of a spec, compiling it into a cache when none is current.

`compiled_module(spec)` runs the first of these files that is current for the spec:

1. the package's own `forge_dsl/generated/<name>.py` (the built-ins, committed);
2. where `forge-gen` writes by default for the file the spec was loaded from (`default_out`):
   `generated/<name>.py` beside a folder named `optimizers/`, otherwise `<name>.py` in the spec's
   own folder;
3. the modules `forge-gen SPEC -o OUT/` wrote for this spec text, which it records in the cache
   folder's `modules.json` (spec hash -> paths, newest first);
4. the cache: `<cache>/<name>_<spec hash>_<compiler hash>.py`, compiled on first use.

The cache folder is `$FORGE_DSL_CACHE`, else `$XDG_CACHE_HOME/forge_dsl`, else
`~/.cache/forge_dsl` (`cache_dir`; an empty variable counts as unset).

A file is current when its header (`codegen.read_stamp`) carries the spec text's hash, the
compiler's hash (`codegen.compiler_hash`: grammar, compiler modules, templates) and the sha256 of
the rest of the file.  Only bytes that passed that check are executed (and handed to Triton as the
kernels' source).  A stale file is passed over quietly; a stamped file whose sha256 does not match
(cut short, edited by hand), or a package module without a stamp, is passed over with a
`GeneratedModuleWarning` that names it and the command that rewrites it; a damaged cache file is
rebuilt.  `module_path(spec)` says which file runs.
Every file is written atomically (`atomic_write`).
"""

from __future__ import annotations

import functools
import json
import linecache
import os
import secrets
import sys
import types
import warnings
from importlib import util as importlib_util
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional

from ..spec import ir
from ..spec.loading import SpecLike, load_spec
from .codegen import compiler_hash, read_stamp, render_module, spec_hash

__all__ = ["compiled_module", "compiled_variants", "module_path", "cache_dir", "default_out", "register",
           "atomic_write", "GeneratedModuleWarning", "Variant"]

REGISTRY = "modules.json"
_REGISTRY_LIMIT = 256  # spec hashes remembered; the oldest are dropped
_PATHS_PER_SPEC = 8


class Variant(NamedTuple):
    """One compiled variant of a spec, as a generated module's `VARIANTS` lists it (by flag combination)."""

    host: Callable  # host_v<i>(hypers, step, scalars) -> (the host scalars h, the new scalar state)
    # update_v<i>(b_param, b_grad, b_states, h, o_param, seed, W_BF16, STOCHASTIC), a triton.jit function: the
    # per-element program (o_param, seed and the constexprs give `stored(x)` the weight store's rounding)
    update: Any
    states: tuple[str, ...]  # the states update_v<i> reads and writes, in its order


class GeneratedModuleWarning(UserWarning):
    """A generated module was found damaged and is not used."""


def cache_dir() -> Path:
    """`$FORGE_DSL_CACHE`, else `$XDG_CACHE_HOME/forge_dsl` (an absolute one), else `~/.cache/forge_dsl`."""
    own = os.environ.get("FORGE_DSL_CACHE")
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "forge_dsl"
    return Path.home() / ".cache" / "forge_dsl"


def default_out(spec_file: Path) -> Path:
    """Where `forge-gen` writes a spec's module without `-o`, and where the loader looks first."""
    folder = Path(os.path.abspath(spec_file)).parent
    return folder.parent / "generated" if folder.name == "optimizers" else folder


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in its folder, fsync'ed, then renamed over it."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for any new file
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable where folders can be opened (POSIX)
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


def _ensure_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as err:
        raise type(err)(
            f"cannot write forge_dsl's cache folder '{folder}' ({err.strerror or err}); set FORGE_DSL_CACHE "
            "(or XDG_CACHE_HOME) to a writable folder"
        ) from err


# ----------------------------------------------------------------------------
# The registry of `forge-gen -o` outputs
# ----------------------------------------------------------------------------


def _read_registry(folder: Path) -> dict[str, list[str]]:
    try:
        data = json.loads((folder / REGISTRY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: [p for p in v if isinstance(p, str)] for k, v in data.items()
            if isinstance(k, str) and isinstance(v, list)}


def register(s_hash: str, module: Path) -> None:
    """Record that `module` was generated from the spec text whose `spec_hash` is `s_hash` (for `forge-gen -o`).

    Raises:
        OSError: the cache folder cannot be written (the message says which and what to do).
    """
    folder = cache_dir()
    _ensure_folder(folder)
    entries = _read_registry(folder)
    path = str(Path(os.path.abspath(module)))
    paths = [path] + [p for p in entries.pop(s_hash, []) if p != path]
    entries[s_hash] = paths[:_PATHS_PER_SPEC]
    entries = dict(list(entries.items())[-_REGISTRY_LIMIT:])
    atomic_write(folder / REGISTRY, (json.dumps(entries, indent=1, sort_keys=False) + "\n").encode())


# ----------------------------------------------------------------------------
# Finding and loading
# ----------------------------------------------------------------------------

# id(spec) -> (spec, module): the launchers ask once per layer per step, so the lookup must be
# cheaper than hashing the spec's text or its IR.
_BY_SPEC_OBJECT: dict[int, tuple[ir.Spec, types.ModuleType, Mapping[tuple, Variant]]] = {}
# (file, its sha256 line) -> module: one file is executed once per process.
_LOADED: dict[tuple[str, bytes], types.ModuleType] = {}


def compiled_module(spec: ir.Spec) -> types.ModuleType:
    """The generated module that runs `spec` (see the module docstring); `.__file__` is its path."""
    return _lookup(spec)[1]


def compiled_variants(spec: ir.Spec) -> Mapping[tuple, Variant]:
    """The compiled variants of `spec`'s module, by flag combination (`spec.variants.variants`)."""
    return _lookup(spec)[2]


def _lookup(spec: ir.Spec) -> tuple[ir.Spec, types.ModuleType, Mapping[tuple, Variant]]:
    hit = _BY_SPEC_OBJECT.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit
    module = _compiled(spec.name, spec_hash(spec.source), compiler_hash(), spec.path, str(cache_dir()), spec)
    hit = _BY_SPEC_OBJECT[id(spec)] = (spec, module, {combo: Variant(*v) for combo, v in module.VARIANTS.items()})
    return hit


def module_path(spec: SpecLike) -> Path:
    """The file of the generated module that runs `spec` (a built-in name, a `.fopt` path or a loaded spec)."""
    return Path(compiled_module(load_spec(spec)).__file__)


def _package_module(name: str) -> Optional[Path]:
    """forge_dsl/generated/<name>.py, found without running it."""
    try:
        found = importlib_util.find_spec(f"forge_dsl.generated.{name}")
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin else None


def _candidates(name: str, s_hash: str, spec_path: str, folder: Path) -> Iterator[tuple[Path, str, bool]]:
    """(file, what to run to rewrite it, whether it must be a generated module) in the order tried."""
    package = _package_module(name)
    if package is not None:
        yield package, "run `forge-gen optimizers/` in forge_dsl's source checkout", True
    if spec_path.endswith(".fopt"):
        in_optimizers = Path(os.path.abspath(spec_path)).parent.name == "optimizers"
        command = "forge-gen optimizers/" if in_optimizers else f"forge-gen {spec_path}"
        yield default_out(Path(spec_path)) / f"{name}.py", f"run `{command}`", False
    for path in _read_registry(folder).get(s_hash, []):
        yield Path(path), f"run `forge-gen {spec_path} -o {Path(path).parent}`", False


@functools.lru_cache(maxsize=64)
def _compiled(name: str, s_hash: str, c_hash: str, spec_path: str, folder: str, spec: ir.Spec) -> types.ModuleType:
    seen: set[str] = set()
    for path, fix, ours in _candidates(name, s_hash, spec_path, Path(folder)):
        key = os.path.realpath(path)
        if key in seen:
            continue
        seen.add(key)
        try:
            data = path.read_bytes()
        except OSError:
            continue
        stamp = read_stamp(data)
        if stamp is not None and not stamp.intact:
            why = "is damaged: its sha256 does not match its header (cut short or edited by hand)"
        elif stamp is None and ours:
            why = "has no forge-gen stamp (empty, cut short, or written by an older forge-gen)"
        else:
            why = None
        if why is not None:
            warnings.warn(f"{path} {why}, so it is not used: `{name}` is compiled into the cache instead; {fix} "
                          "to rewrite it", GeneratedModuleWarning, stacklevel=4)
            continue
        if stamp is not None and stamp.spec_hash == s_hash and stamp.compiler_hash == c_hash:
            return _execute(path, data, name)
    return _from_cache(spec, Path(folder), s_hash, c_hash)


def _from_cache(spec: ir.Spec, folder: Path, s_hash: str, c_hash: str) -> types.ModuleType:
    path = folder / f"{spec.name}_{s_hash}_{c_hash}.py"
    try:
        data = path.read_bytes()
    except OSError:
        data = None
    if data is not None:
        stamp = read_stamp(data)
        if stamp is not None and stamp.intact and (stamp.spec_hash, stamp.compiler_hash) == (s_hash, c_hash):
            return _execute(path, data, spec.name)
    data = render_module(spec, "cache").encode()
    _ensure_folder(folder)
    try:
        atomic_write(path, data)  # replaces a damaged file
    except OSError as err:
        raise type(err)(f"cannot write '{path}' in forge_dsl's cache ({err.strerror or err}); set "
                        "FORGE_DSL_CACHE (or XDG_CACHE_HOME) to a writable folder") from err
    return _execute(path, data, spec.name)


def _execute(path: Path, data: bytes, name: str) -> types.ModuleType:
    """Run verified bytes as a module whose source (for Triton and tracebacks) is those same bytes."""
    digest = data.split(b"\n", 4)[3]
    key = (os.path.realpath(path), digest)
    module = _LOADED.get(key)
    if module is not None:
        return module
    text = data.decode("utf-8")
    filename = str(path)
    # Triton reads a kernel's source through linecache when it decorates it: give it these bytes,
    # not whatever the file holds by then (mtime None: never re-read from disk).
    *body, last = text.split("\n")  # lines end at '\n' only, as the compiler counts them in this text
    lines = [line + "\n" for line in body] + ([last] if last else [])
    linecache.cache[filename] = (len(text), None, lines, filename)
    code = compile(text, filename, "exec", dont_inherit=True)
    module_name = f"forge_dsl_compiled_{name}_{digest[-16:].decode()}"
    module = types.ModuleType(module_name)
    module.__file__ = filename
    sys.modules[module_name] = module  # Triton finds the kernels' globals through their module
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[module_name]
        raise
    _LOADED[key] = module
    return module
