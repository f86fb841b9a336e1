"""Where the repository is, for tests that read its files (specs, docs, the README, bench scripts)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root: the folder of README.md, optimizers/ and tests/."""
