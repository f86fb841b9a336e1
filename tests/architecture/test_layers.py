"""The package's shape (docs/ARCHITECTURE.md): layers that import only the layers above them, no import cycle,
a torch-free language and compiler, a small root, no oversized module, and the 0.1 module paths still importing.

The import graph is read from the source (ast): every `import` and `from ... import` of a forge_dsl module,
at module level or inside a function (a late import hides a cycle; it does not remove it).
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings

import pytest

from repo import ROOT

from forge_dsl.aliases import ALIASES

PACKAGE = ROOT / "forge_dsl"

# Each module's layer, by the longest prefix that names it; a module may import its own layer and the ones
# listed before it.
LAYERS = (
    ("forge_dsl.spec", 0),
    ("forge_dsl.interpreter", 0),
    ("forge_dsl.aliases", 0),  # imports its targets by name, at run time
    ("forge_dsl.compiler", 1),
    ("forge_dsl.eager", 2),
    ("forge_dsl.reference", 2),
    ("forge_dsl.barriers", 2),
    ("forge_dsl.kernels", 3),
    ("forge_dsl.api", 4),
    ("forge_dsl.training", 5),
    ("forge_dsl", 6),  # the public face
    ("forge_dsl.testing", 7),
    ("forge_dsl.bench", 7),
    ("forge_dsl.demo", 7),
)
TORCH_FREE = ("forge_dsl.spec", "forge_dsl.compiler", "forge_dsl.interpreter", "forge_dsl.aliases")


def _modules() -> dict[str, object]:
    """Every module of forge_dsl by dotted name, with its path."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def imports_of(name: str) -> tuple[set[str], set[str]]:
    """(the forge_dsl modules `name` imports, the top-level names of every other module it imports)."""
    tree = ast.parse(MODULES[name].read_text())
    ours: set[str] = set()
    others: set[str] = set()
    here = name.split(".") if _is_package(name) else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                (ours if alias.name.split(".")[0] == "forge_dsl" else others).add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "forge_dsl":
                others.add(target)
                continue
            submodules = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES}
            ours.update(submodules)
            if len(submodules) < len(node.names):  # names of the module itself, not only its submodules
                ours.add(target)
    ours = {m for m in ours if m in MODULES and m != name}
    return ours, {o.split(".")[0] for o in others}


GRAPH = {name: imports_of(name)[0] for name in MODULES}


def _layer(name: str) -> int:
    return max(((len(prefix), rank) for prefix, rank in LAYERS
                if name == prefix or name.startswith(prefix + ".")), default=(0, 99))[1]


def test_no_import_cycle():
    """Tarjan's strongly connected components of the import graph: each must be one module."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_graph_sees_late_imports():
    """A planted late import is an edge (the cycle test would miss a cycle hidden in a function otherwise)."""
    assert "forge_dsl.kernels.embedding_kernels" in GRAPH["forge_dsl.training.embedding"]


def test_layers_import_only_the_layers_above_them():
    wrong = [(name, target) for name, targets in GRAPH.items() for target in targets
             if _layer(target) > _layer(name) and not (name == "forge_dsl" and target.startswith("forge_dsl."))]
    # the public face imports whatever it re-exports, and the aliases import the new homes by name at run time
    assert not wrong, "imports against the layers (docs/ARCHITECTURE.md): " + ", ".join(f"{a} -> {b}" for a, b in wrong)


@pytest.mark.parametrize("layer", TORCH_FREE)
def test_the_language_and_the_compiler_import_no_torch(layer):
    """No module of the layer, nor any forge_dsl module it reaches, imports torch or triton (statically)."""
    reached = {name for name in MODULES if name == layer or name.startswith(layer + ".")}
    todo = list(reached)
    while todo:
        for target in GRAPH[todo.pop()]:
            if target not in reached and target != "forge_dsl":
                reached.add(target)
                todo.append(target)
    heavy = {name: sorted(imports_of(name)[1] & {"torch", "triton", "numpy"}) for name in reached}
    assert not {k: v for k, v in heavy.items() if v}
    assert all(name.startswith(TORCH_FREE) for name in reached), sorted(reached)


def test_forge_gen_runs_without_importing_torch():
    """At run time too: the compiler's command and loader, and the language, leave torch unimported."""
    code = ("import sys, forge_dsl.compiler.forge_gen, forge_dsl.compiler.loader, forge_dsl.spec.loading; "
            "forge_dsl.spec.loading.load_spec('adamw'); "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_root_holds_at_most_eight_modules():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 8, root


def test_no_module_is_over_700_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 700}
    assert not long, long


# The 0.1 module paths and their public names (their `__all__`, or the names they defined).
OLD_NAMES = {
    "forge_dsl.errors": ["Loc", "SpecError", "did_you_mean"],
    "forge_dsl.ir": ["ARITHMETIC_OPS", "Assign", "Attribute", "Binary", "BoolLit", "COMPARE_SYMBOLS", "COMPARISON_OPS",
                     "Call", "DerivedFlag", "Flag", "Given", "Hyper", "HyperGroup", "If", "Index", "Interval",
                     "LOGIC_OPS", "Method", "Name", "Num", "Require", "ScalarState", "Spec", "State", "UNBOUNDED",
                     "Unary", "format_number", "initial_parts"],
    "forge_dsl.parser": ["grammar_text", "parse_spec"],
    "forge_dsl.printer": ["print_expr", "print_spec"],
    "forge_dsl.scalar_ops": ["apply_scalar_op"],
    "forge_dsl.checker": ["BUILTIN_FUNCTIONS", "Combo", "Level", "Type", "check_spec", "combinations",
                          "describe_combo", "eval_static", "runtime_flags", "specialize", "variant_of", "variants"],
    "forge_dsl.config": ["StepConfig", "check_seed", "check_step", "eval_host_expr", "resolve_hypers"],
    "forge_dsl.lowering": ["ELEMENT_INPUTS", "HOST_INPUTS", "Instr", "Lowered", "Operand", "lower", "lower_all"],
    "forge_dsl.codegen": ["COMPILER_MODULES", "GENERATOR_VERSION", "OUTPUTS", "Stamp", "TEMPLATE_NAMES",
                          "compiler_hash", "read_stamp", "render_module", "spec_hash"],
    "forge_dsl.cli": ["generate", "main"],
    "forge_dsl.templates": [],
    "forge_dsl.kernels.compiled": ["GeneratedModuleWarning", "atomic_write", "cache_dir", "compiled_module",
                                   "default_out", "module_path", "register"],
    "forge_dsl.layouts": ["BLOCK", "FOUR_BIT_LAYOUTS", "INT4_MAP", "INT4_THRESHOLDS", "LAYOUT_NAMES",
                          "QUANTIZED_LAYOUTS", "R255", "SCALE_DTYPE", "SCALE_DTYPES", "StateLayout", "as_rows",
                          "bf16_from_bits", "bf16_round_nearest_bits", "bf16_round_up_bits", "check_scale_dtype",
                          "dequantize", "holds_codes", "is_quantized", "layout_of", "n_blocks", "quantize",
                          "resolve_layout", "storage_dtype", "storage_shape"],
    "forge_dsl.kernels.launch": ["ParamUpdate", "TileConfig", "fused_linear_step", "linear_step", "mix_seed",
                                 "slab_linear_step", "step"],
    "forge_dsl.kernels.launches": ["FOUR_BIT_LAYOUTS", "NIBBLE_WORDS_MAX_BYTES", "device_guard", "fused_constexprs",
                                   "launch_elementwise", "launch_fused", "launch_warp_specialized", "mix_seed",
                                   "nibble_words", "rounding_code", "triton_cdiv", "ws_constexprs"],
    "forge_dsl.kernels.prepared": ["NotReusable", "PreparedLaunch", "VERIFIED_TRITON", "call_key", "current_stream",
                                   "enabled", "entries", "exports_signature", "lookup", "remember", "set_enabled",
                                   "supported"],
    "forge_dsl.kernels.triton_lib": ["ROUND_NEAREST", "ROUND_STOCHASTIC", "ROUND_STOCHASTIC_PAIRS", "accumulate_dw",
                                     "accumulate_dw_halves", "bf16_bits_to_fp32", "block_scale_offsets",
                                     "decode_state", "decode_weight", "fp32_to_bf16_bits_rne",
                                     "fp32_to_bf16_bits_stochastic", "grouped_tile", "load_state", "load_state_raw",
                                     "load_tokens", "load_weight", "load_weight_raw", "math_atan", "math_atan2",
                                     "math_erf", "math_expm1", "math_log1p", "math_pow", "math_tanh", "random16",
                                     "random_bits", "split_columns", "store_state", "store_weight", "tile_at",
                                     "tile_offsets"],
    "forge_dsl.kernels.sm90": ["Resources", "compile_fused", "main"],
    "forge_dsl.optim": ["ForgeOptimizer", "fuse", "fusion_refusal"],
    "forge_dsl.fused_linear": ["fused_forward", "fusion_refusal"],
    "forge_dsl.fused_embedding": ["WORKSPACE_BYTES", "embedding", "embedding_forward", "fusion_refusal", "hand_rows",
                                  "tile_rows_for"],
    "forge_dsl.fused_head": ["LOGITS_BLOCK_BYTES", "SUPPORTED_MODEL_TYPES", "causal_lm_loss", "install",
                             "vocab_block_rows"],
    "forge_dsl.row_updates": ["AutogradRows", "ParamUpdateRows", "RowSink"],
    "forge_dsl.consumed_grad": ["CLIP_MESSAGE", "ConsumedGrad", "OUTSIDE_USE_MESSAGE", "Unknown",
                                "VALUE_CLIP_MESSAGE", "consumed_grad"],
    "forge_dsl.tensor_parallel": ["LinearSharding", "add_to_grad", "data_parallel_refusal", "embedding_sharding",
                                  "global_layouts", "global_state", "is_dtensor", "linear_sharding", "local",
                                  "local_grad", "local_state", "mesh_refusal", "quantized_sharding_refusal",
                                  "shard_index", "state_layouts", "wrap"],
    "forge_dsl.offload": ["Kept", "OffloadActivations", "PREFETCH_LOOKBACK"],
    "forge_dsl.checkpoint": ["FORMAT", "Loaded", "META_KEY", "check_state_dict", "held_layouts", "metadata",
                             "spec_digest"],
    # kept where they were
    "forge_dsl.api": ["SpecLike", "builtin_names", "builtin_path", "init_state", "load_spec", "state_layout"],
    "forge_dsl.reference": ["ParamCopy", "initial_value", "initial_values", "plain_state", "reference_step",
                            "run_host_program", "scalar_updates"],
    "forge_dsl.interpreter": ["use_interpreter"],
    "forge_dsl.kernels.checks": ["BLOCK", "ROUNDINGS", "SCALE_DTYPES", "StateArgs", "any_quantized", "bind_states",
                                 "check_config", "check_device", "check_linear", "check_rounding",
                                 "check_warp_specialized", "exact_states", "tma_compatible", "tma_readable",
                                 "weight_view"],
    "forge_dsl.kernels.policy": ["LINEAR_PATHS", "TileConfig", "auto_linear_path", "default_slab_bytes",
                                 "fused_config", "hopper_with_gluon", "interpreting", "slab_rows", "step_config",
                                 "stored_bytes"],
    "forge_dsl.kernels.foreach": ["FOREACH_MAX_ELEMENTS", "foreach_step", "shared_launch_key"],
}


# A moved path imports in a fresh process (about a second each): the quick tier keeps one moved whole, one split
# in several and one of the training layer, beside the paths kept where they were (imported in this process).
QUICK_OLD_PATHS = {"forge_dsl.codegen", "forge_dsl.kernels.triton_lib", "forge_dsl.optim"}


@pytest.mark.parametrize("old", [pytest.param(old, marks=() if old in QUICK_OLD_PATHS or old not in ALIASES else
                                              pytest.mark.slow) for old in sorted(OLD_NAMES)])
def test_every_old_module_path_imports_with_its_names(old):
    """In a fresh process (the aliases warn on first import): `import old` and `from old import name` for each
    of its 0.1 names; a moved module's path is the new module itself."""
    from forge_dsl import aliases

    code = (f"import importlib, warnings\nwarnings.simplefilter('error', DeprecationWarning)\n"
            f"import forge_dsl\ntry:\n    importlib.import_module({old!r})\n    raise SystemExit('no warning')\n"
            f"except DeprecationWarning as w:\n    print('warned:', w)\n"
            f"warnings.simplefilter('ignore')\nmodule = importlib.import_module({old!r})\n"
            f"missing = [n for n in {OLD_NAMES[old]!r} if not hasattr(module, n)]\n"
            f"assert not missing, missing\n")
    if old in aliases.ALIASES:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.startswith("warned:") and aliases.ALIASES[old][0] in out.stdout
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # not moved: no warning
            module = importlib.import_module(old)
        assert not [n for n in OLD_NAMES[old] if not hasattr(module, n)]


def test_a_module_moved_whole_is_the_new_module():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import forge_dsl.codegen as old
        import forge_dsl.kernels.launch as old_launch
    import forge_dsl
    from forge_dsl.compiler import codegen
    from forge_dsl.kernels import steps

    assert old is codegen and old_launch is steps and old.__spec__.name == "forge_dsl.compiler.codegen"
    assert forge_dsl.codegen is codegen and forge_dsl.kernels.launch is steps  # as attributes too


def test_every_alias_names_modules_that_exist():
    from forge_dsl import aliases

    for old, homes in aliases.ALIASES.items():
        assert old not in MODULES, f"{old} is both an alias and a module"
        for home in homes:
            assert home in MODULES, (old, home)
    for (old, name), (home, new) in aliases.RENAMED.items():
        assert hasattr(importlib.import_module(home), new), (old, name)
