"""The discrete-event simulator: the live scheduler and policies on a simulated clock (no torch)."""
