"""`gouache.heap`: freed large blocks stay in the process (one fresh interpreter per case)."""

import os
import subprocess
import sys

import pytest

from gouache.heap import keep_freed_memory

PROBE = """
import torch
from gouache.heap import keep_freed_memory

def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

print(keep_freed_memory())
before = resident()
block = torch.ones(64 << 20, dtype=torch.uint8)
del block
print((resident() - before) >> 20)
"""


def probe(choice: str) -> tuple[str, int]:
    env = {**os.environ, "GOUACHE_MALLOC": choice}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True,
                         timeout=120)
    kept, held_mib = out.stdout.split()
    return kept, int(held_mib)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_block_stays_resident_unless_system_is_chosen():
    kept, held_mib = probe("keep")
    assert kept == "True" and held_mib >= 60
    kept, held_mib = probe("system")
    assert kept == "False" and held_mib < 8  # the C library handed the 64 MiB back on free


def test_an_unknown_choice_says_which_are_known(monkeypatch):
    monkeypatch.setenv("GOUACHE_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="'keep' .* or 'system'"):
        keep_freed_memory()
