"""Built-in optimizer specs, shipped inside the package as forge_dsl.optimizers."""
