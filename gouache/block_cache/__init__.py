"""Block-output reuse across steps (PatchedServe §5): what is cached and when a unit reuses it
(`store`), and the wrapper that runs each block on the units it computes (`blocks`)."""
