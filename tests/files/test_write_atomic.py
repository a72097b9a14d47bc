"""What gouache writes for a server to read is replaced whole: a writer killed at any moment
leaves the old file or the new one, and a failed write leaves no temporary file behind."""

import os
import signal
import subprocess
import sys
import time

import pytest

from gouache.files import write_atomic

WRITER = """
import sys
from gouache.files import write_atomic
print("writing", flush=True)
while True:
    write_atomic(sys.argv[1], bytes([int(sys.argv[2])]) * (64 << 20))
"""


@pytest.mark.slow
def test_a_writer_killed_mid_write_leaves_the_old_file_or_the_new_one_whole(tmp_path):
    path = tmp_path / "costmodel.json"
    old = b"\x01" * (64 << 20)
    path.write_bytes(old)
    for delay in (0.0, 0.05, 0.2, 0.5):
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "2"], stdout=subprocess.PIPE)
        assert child.stdout.readline() == b"writing\n"
        time.sleep(delay)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        data = path.read_bytes()
        assert data in (old, b"\x02" * (64 << 20)), (delay, len(data))


def test_a_write_that_fails_before_its_rename_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "predictor.json"
    write_atomic(path, "old\n")
    assert path.read_text() == "old\n"

    def no_space(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(OSError, match="No space"):
        write_atomic(path, "new\n")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["predictor.json"]
