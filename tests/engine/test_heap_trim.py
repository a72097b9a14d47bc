"""The heap trimmer's pacing, with a fake clock and a fake malloc_trim."""

import platform

import pytest

from gouache.engine.heap_trim import HeapTrimmer


def test_trims_at_most_once_per_interval():
    now, calls = [0.0], []
    trimmer = HeapTrimmer(every_s=10.0, trim=lambda pad: calls.append(pad) or 1, clock=lambda: now[0])
    for t in (0.0, 1.0, 9.9, 10.0, 10.5, 25.0):
        now[0] = t
        trimmer.maybe_trim()
    assert calls == [0, 0, 0] and trimmer.trims == 3  # at 0, 10 and 25 s


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_the_real_malloc_trim_is_found_and_called():
    trimmer = HeapTrimmer(every_s=0.0)
    trimmer.maybe_trim()
    assert trimmer.trims == 1
