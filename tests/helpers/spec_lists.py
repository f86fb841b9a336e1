"""The built-in specs by how they run: element-wise (one kernel per update) or in phases (`spec.phases`: a tile
phase, a function of the whole weight, a post phase). Kernel-level tests take the first; the phases of the
others are tested in tests/training/test_phases.py."""

import forge_dsl
from forge_dsl.spec.phases import is_phased

ELEMENT_WISE = [name for name in forge_dsl.builtin_names() if not is_phased(forge_dsl.load_spec(name))]
PHASED = [name for name in forge_dsl.builtin_names() if name not in ELEMENT_WISE]
