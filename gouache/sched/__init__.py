"""The scheduler: pure Python, no torch (DESIGN.md invariant 1)."""
