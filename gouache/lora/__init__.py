"""LoRA adapters (KATZ): the files (`files`), their host-memory store (`store`), how a forward
applies them (`apply`: merged, or per row), and a runner's adapters at each step (`runtime`:
bounded asynchronous loading, merged / segmented / split)."""
