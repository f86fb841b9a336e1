"""The public API: load_spec, init_state, reference_step keywords and their validation."""

from __future__ import annotations

import pytest
import torch

import forge_dsl


def test_load_by_name_path_or_spec():
    spec = forge_dsl.load_spec("adamw")
    assert spec.name == "adamw"
    assert forge_dsl.load_spec(spec) is spec
    from forge_dsl.api import builtin_path

    assert forge_dsl.load_spec(str(builtin_path("adamw"))) == spec
    assert spec.hyper_names == ("lr", "beta1", "beta2", "eps", "weight_decay")
    assert spec.state_names == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert forge_dsl.builtin_names() == ["adafactor", "adagrad", "adamw", "lamb", "lion", "muon", "nadam", "radam", "rmsprop", "sgd", "sgd_momentum"]


def test_unknown_builtin_suggests():
    with pytest.raises(FileNotFoundError, match="did you mean 'adamw'"):
        forge_dsl.load_spec("adamww")


def test_init_state_follows_flags_and_initial_values():
    p = torch.randn(3, 4, dtype=torch.float64)
    assert set(forge_dsl.init_state("adamw", p)) == {"exp_avg", "exp_avg_sq"}
    assert set(forge_dsl.init_state("adamw", p, amsgrad=True)) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    st = forge_dsl.init_state("adagrad", p, initial_accumulator_value=0.25)
    assert st["sum"].dtype == torch.float64 and torch.all(st["sum"] == 0.25)
    st = forge_dsl.init_state("nadam", p)
    assert st["mu_product"].shape == () and float(st["mu_product"]) == 1.0
    assert set(forge_dsl.init_state("rmsprop", p, momentum=0.9, centered=True)) == {
        "square_avg", "grad_avg", "momentum_buffer"}


def test_init_state_layouts():
    p = torch.randn(8, 130)
    st = forge_dsl.init_state("adamw", p, layout="int8")
    assert st["exp_avg"].dtype == torch.int8 and st["exp_avg_sq"].dtype == torch.uint8  # nonneg → unsigned map
    assert st["exp_avg.scale"].shape == (8, 3)
    st = forge_dsl.init_state("adamw", p, layout={"exp_avg": "bf16"})
    assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.float32
    small = forge_dsl.init_state("adamw", torch.randn(5, 10), layout="int8")
    assert small["exp_avg"].dtype == torch.float32  # smaller than one 64-element block: stays fp32
    with pytest.raises(ValueError, match="unknown states"):
        forge_dsl.init_state("adamw", p, layout={"exp_avgg": "bf16"})
    with pytest.raises(ValueError, match="unknown state layout 'fp8'"):
        forge_dsl.init_state("adamw", p, layout="fp8")


def _step(name, **kw):
    p = torch.randn(2, 3, dtype=torch.float64)
    st = forge_dsl.init_state(name, p, **{k: v for k, v in kw.items()})
    forge_dsl.reference_step(name, p, torch.randn_like(p), st, step=1, **kw)


@pytest.mark.parametrize("name, kw, message", [
    ("adamw", {"lr": -1.0}, r"Invalid lr: -1.0; adamw expects a value in \[0, inf\)"),
    ("adamw", {"betas": (1.0, 0.999)}, r"Invalid betas\[0\] \(beta1\): 1.0; adamw expects a value in \[0, 1\)"),
    ("adamw", {"beta2": -0.1}, r"Invalid betas\[1\] \(beta2\): -0.1"),
    ("adamw", {"eps": float("nan")}, r"Invalid eps: nan"),
    ("rmsprop", {"alpha": -0.5}, r"Invalid alpha: -0.5"),
    ("adagrad", {"lr_decay": -1.0}, r"Invalid lr_decay: -1.0"),
    ("sgd_momentum", {"momentum": 0.0}, r"Invalid momentum: 0.0; sgd_momentum expects a value in \(0, inf\)"),
    ("sgd_momentum", {"momentum": 0.9, "nesterov": True, "dampening": 0.1},
     "Nesterov momentum requires a momentum and zero dampening"),
    ("adamw", {"amsgrad": 1}, "amsgrad must be True or False"),
    ("adamw", {"lr": "0.1"}, "lr must be a number"),
    ("adamw", {"betas": (0.9,)}, "betas must be a tuple of 2 numbers"),
])
def test_bad_hyperparameters_raise_value_error(name, kw, message):
    with pytest.raises(ValueError, match=message):
        _step(name, **kw)


def test_keyword_errors_are_type_errors():
    with pytest.raises(TypeError, match="unexpected keyword argument 'lrr'.*did you mean 'lr'"):
        _step("adamw", lrr=0.1)
    with pytest.raises(TypeError, match="missing required keyword argument 'momentum'"):
        _step("sgd_momentum")
    with pytest.raises(TypeError, match="both 'betas' and its member 'beta1'"):
        _step("adamw", betas=(0.9, 0.99), beta1=0.8)


def test_tuple_members_by_name_equal_the_tuple():
    p = torch.randn(4, 4, dtype=torch.float64)
    g = torch.randn_like(p)
    a, b = p.clone(), p.clone()
    sa, sb = forge_dsl.init_state("adamw", a), forge_dsl.init_state("adamw", b)
    forge_dsl.reference_step("adamw", a, g, sa, step=1, betas=(0.8, 0.95))
    forge_dsl.reference_step("adamw", b, g, sb, step=1, beta1=0.8, beta2=0.95)
    assert torch.equal(a, b)


def test_tensor_lr_is_accepted_like_torch():
    _step("adamw", lr=torch.tensor(0.01))


def test_reference_step_rejects_mismatched_state():
    p = torch.randn(2, 3, dtype=torch.float64)
    st = forge_dsl.init_state("adamw", p)
    with pytest.raises(ValueError, match="state has no 'max_exp_avg_sq'"):
        forge_dsl.reference_step("adamw", p, torch.randn_like(p), st, step=1, amsgrad=True)
    with pytest.raises(ValueError, match="step must be a positive integer"):
        forge_dsl.reference_step("adamw", p, torch.randn_like(p), st, step=0)
    with pytest.raises(ValueError, match="grad has shape"):
        forge_dsl.reference_step("adamw", p, torch.randn(3, 2, dtype=torch.float64), st, step=1)


def test_reference_step_float32_close_to_float64():
    p64 = torch.randn(16, 16, dtype=torch.float64)
    p32 = p64.float()
    s64, s32 = forge_dsl.init_state("radam", p64), forge_dsl.init_state("radam", p32)
    for step in range(1, 8):
        g = torch.randn_like(p64)
        forge_dsl.reference_step("radam", p64, g, s64, step=step, betas=(0.9, 0.9))
        forge_dsl.reference_step("radam", p32, g.float(), s32, step=step, betas=(0.9, 0.9))
    assert ((p32.double() - p64).norm() / p64.norm()).item() < 1e-6


def test_lowering_hoists_host_scalars_and_shares_subexpressions():
    from forge_dsl.compiler.lowering import lower

    spec = forge_dsl.load_spec("adamw")
    low = lower(spec, (("amsgrad", False), ("maximize", False)))
    host_ops = {i.op for i in low.host}
    assert "pow" in host_ops  # beta ** step: once per step, on the host
    assert all(i.op != "pow" for i in low.elem)
    # grad * grad appears once; bias corrections never reach the per-element program
    assert not any("bias_correction" in i.name for i in low.elem)
    elem_texts = [(i.op, i.args) for i in low.elem]
    assert len(elem_texts) == len(set(elem_texts))  # CSE: no instruction computed twice
    # dividing by a host scalar stays a division (a host reciprocal rounded to fp32 is not the same number):
    # sqrt(exp_avg_sq) / sqrt(bias_correction2), as torch.optim.AdamW computes it
    assert not any(i.op == "recip" for i in low.host + low.elem)
    assert [i.args[1] for i in low.elem if i.op == "div"][0] in low.exports


@pytest.mark.parametrize("shape", [(3, 130), (200,), (2, 3, 64), (), (0, 70), (5, 40)])
@pytest.mark.parametrize("layout", ["fp32", "bf16", "int8", {"sum": "int8"}])
def test_init_state_encodes_like_quantizing_the_full_state(shape, layout):
    """init_state encodes one row and repeats it (no float32 copy of a large state); the result is the
    full float32 state quantized, bit for bit. Adagrad's accumulator starts at a non-zero value."""
    from forge_dsl.kernels.layouts import quantize, resolve_layout

    spec = forge_dsl.load_spec("adagrad")
    param = torch.randn(shape)
    state = forge_dsl.init_state(spec, param, layout=layout, initial_accumulator_value=0.3)
    choice = layout if isinstance(layout, str) else layout["sum"]
    storage, scale = quantize(torch.full(shape, 0.3), resolve_layout(choice, True, shape))
    assert state["sum"].dtype == storage.dtype and state["sum"].shape == storage.shape
    assert torch.equal(state["sum"].view(-1).view(torch.uint8), storage.view(-1).view(torch.uint8))
    if scale is None:
        assert "sum.scale" not in state
    else:
        assert torch.equal(state["sum.scale"], scale)


# (an expression of grad and lr, the per-element program it lowers to): only identities exact in IEEE
# arithmetic (NaN, infinities and zeros' signs included) are folded.
FOLDS = [
    ("grad * 1", []), ("1 * grad", []), ("grad / 1", []), ("grad - 0", []), ("grad ** 1", []), ("-(-grad)", []),
    ("grad / 2", ["mul(grad, 0.5)"]), ("grad / -0.25", ["mul(grad, -4)"]),
    ("grad + 0", ["add(grad, 0)"]),           # -0.0 + 0 is +0.0
    ("0 + grad", ["add(0, grad)"]),
    ("0 - grad", ["sub(0, grad)"]),           # 0 - 0.0 is +0.0, -(0.0) is -0.0
    ("grad * 0", ["mul(grad, 0)"]),           # NaN, inf and -0.0 for NaN, inf and negative grad
    ("grad - grad", ["sub(grad, grad)"]),     # NaN for inf and NaN
    ("grad / grad", ["div(grad, grad)"]),     # NaN for 0, inf and NaN
    ("0 / grad", ["div(0, grad)"]),           # NaN for 0 and NaN, -0.0 for negative grad
    ("grad / 3", ["div(grad, 3)"]),           # 1/3 is not a float
    ("grad / lr", ["div(grad, lr)"]),         # a division by a host value stays one
]


@pytest.mark.parametrize("expr, program", FOLDS)
def test_lowering_folds_only_exact_identities(expr, program):
    from forge_dsl.compiler.lowering import lower
    from forge_dsl.spec.checker import check_spec
    from forge_dsl.spec.parser import parse_spec

    spec = check_spec(parse_spec(f"optimizer folds\nhyper lr = 1\nstate s = 0\nupdate {{\n    s = {expr}\n"
                                 "    param = param - lr * grad\n}\n"))
    low = lower(spec, ())
    out = dict(low.outputs)["s"]
    if not program:
        assert out.kind == "grad", low.describe()
        return
    lines = [line.strip() for line in low.describe().split("\n")]
    assert [line.split(" = ", 1)[1] for line in lines if line.startswith(f"{out.name} = ")] == program, low.describe()


def test_lowering_checks_a_spec_it_was_given_unchecked():
    """lower() and reference_step() on a spec from parse_spec raised KeyError: 'undefined_name'."""
    from forge_dsl.compiler.lowering import lower, lower_all
    from forge_dsl.spec.errors import SpecError
    from forge_dsl.spec.parser import parse_spec

    spec = parse_spec("optimizer u\nhyper lr = 1\nupdate {\n    param = param - lr * undefined_name\n}\n", "u.fopt")
    for call in (lambda: lower_all(spec), lambda: lower(spec, ()),
                 lambda: forge_dsl.reference_step(spec, torch.zeros(3), torch.zeros(3), {}, step=1)):
        with pytest.raises(SpecError, match=r"u.fopt:4:26: unknown name 'undefined_name'"):
            call()


def test_reference_step_names_a_missing_scalar_state():
    """A state dict without NAdam's `mu_product` raised KeyError: 'mu_product'; it is a ValueError naming it,
    as kernels.step's (init_state creates every state; a dict without it is not this spec's)."""
    p = torch.randn(3, 4, dtype=torch.float64)
    state = forge_dsl.init_state("nadam", p)
    del state["mu_product"]
    with pytest.raises(ValueError, match=r"state has no scalar state 'mu_product' \(needed by nadam\); create the "
                                         r"state with forge_dsl.init_state"):
        forge_dsl.reference_step("nadam", p, torch.randn_like(p), state, step=1)
    assert set(state) == {"exp_avg", "exp_avg_sq"}
