"""Profilers: measure the served model on this device and write the cost models the server and
the simulator read (step costs, edits by mask, LoRA sensitivity, parallel degrees)."""
