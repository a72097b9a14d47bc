"""docs/architecture.md, invariant 1: the scheduler and the simulator import no torch, so
they can be tested, and run, without it."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CODE = """
import importlib, pkgutil, sys
import gouache.sched, gouache.sim
for package in (gouache.sched, gouache.sim):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
for name in ("gouache.templates.load_plan", "gouache.bench.overhead", "gouache.bench.sim_to_real"):
    importlib.import_module(name)
print(sorted(m for m in sys.modules if m.startswith("gouache.")))
print("torch" in sys.modules)
"""


def test_sched_sim_and_their_benchmarks_import_no_torch():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout.splitlines()
    assert "'gouache.sim.command'" in out[0] and "'gouache.sched.policies.round_knapsack'" in out[0]
    assert out[1] == "False"
