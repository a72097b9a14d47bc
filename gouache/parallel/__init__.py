"""A step on several devices: Ulysses sequence parallelism for DiTs (`ulysses`) and CFG halves
for UNets (`cfg`); the forward composer (`gouache.runner.forward`) installs them."""
