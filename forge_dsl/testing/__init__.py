"""Property tests of a spec's generated kernels against its float64 reference step: `forge-test` and its API.

    >>> from forge_dsl.testing import check_spec_kernels
    >>> report = check_spec_kernels("my_opt.fopt", quick=True)
    >>> report.ok, print(report.table()), report.reproducer

`bounds` holds the per-layout tolerances (also used by tests/kernels/test_kernels.py) and the update's,
`problems` the drawn hyperparameters, flag combinations and random layers, `cases` one check (`Case`,
`run_case`), `sweep` which cases a spec gets and the report, `cli` the console script.
"""

from .bounds import (
                     FP32_REL_TOL,
                     FP32_SLACK,
                     SR_SIGMAS,
                     UPDATE_FLOOR,
                     UPDATE_REL,
                     UPDATE_ULPS,
                     RoundingMean,
                     as_float64_state,
                     bf16_ulp,
                     block_scale,
                     bound,
                     dw_error_bound,
                     fp32_ulp,
                     layout_code,
                     rel_err,
                     sign_tie_allowance,
                     sr_mean_bound,
                     update_bound,
                     update_slack,
                     weight_bound,
)
from .cases import (
                     AGAINST_REL_TOL,
                     HALVES_CONFIG,
                     SPLIT_CONFIGS,
                     WS_CONFIG,
                     WS_EPILOGUES,
                     Case,
                     CaseResult,
                     load_against,
                     run_case,
)
from .cli import main
from .problems import K, N, T, covering_combos, default_device, draw_keywords, layout_for, make_problem
from .sweep import Report, check_reference, check_spec_kernels, format_table, reproducer

__all__ = ["FP32_REL_TOL", "FP32_SLACK", "UPDATE_ULPS", "UPDATE_REL", "UPDATE_FLOOR", "SR_SIGMAS", "AGAINST_REL_TOL",
           "N", "K", "T", "HALVES_CONFIG", "SPLIT_CONFIGS", "WS_CONFIG", "WS_EPILOGUES", "Case", "CaseResult", "Report",
           "RoundingMean", "as_float64_state", "bf16_ulp", "block_scale", "bound", "check_reference",
           "check_spec_kernels", "covering_combos", "default_device", "draw_keywords", "dw_error_bound",
           "format_table", "fp32_ulp", "layout_code", "layout_for", "load_against", "main", "make_problem", "rel_err",
           "reproducer", "run_case", "sign_tie_allowance", "sr_mean_bound", "update_bound", "update_slack",
           "weight_bound"]
