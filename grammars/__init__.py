"""The .fopt grammar, shipped inside the package as forge_dsl.grammars."""
