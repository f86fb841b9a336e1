"""Jinja templates of the generated modules (rendered by forge_dsl/compiler/codegen.py)."""
