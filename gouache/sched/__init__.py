"""The scheduler: pure Python, no torch (docs/architecture.md, invariant 1)."""
