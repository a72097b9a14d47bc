"""A step on several devices: Ulysses sequence parallelism for DiTs (`ulysses`) and CFG halves
for UNets (`cfg`); the forward's parallel layer (`layer`) installs them for a step."""
