from __future__ import annotations

import base64
import contextlib
import io
import json
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
from PIL import Image


def parse_sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each Server-Sent Event in a response body."""
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields["event"], json.loads(fields["data"])))
    return events


def open_image(data: bytes | str) -> Image.Image:
    """A PIL image from encoded bytes or their base64."""
    raw = base64.b64decode(data) if isinstance(data, str) else data
    image = Image.open(io.BytesIO(raw))
    image.load()
    return image


@contextlib.contextmanager
def running_server(*flags: str):
    """`gouache serve FLAGS` on a free port; yields its URL once /health says ok."""
    with running_server_process(*flags) as (url, _):
        yield url


@contextlib.contextmanager
def running_server_process(*flags: str):
    """`gouache serve FLAGS` on a free port; yields (its URL, its process) once /health says ok.
    Its log goes to a file (a pipe nobody reads would fill and stop the server) and is shown if
    it dies."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "gouache.cli", "serve", *flags, "--port", str(port)]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise AssertionError(f"`gouache serve` exited with {proc.returncode}:\n{log.read()}")
            assert time.monotonic() < deadline, "server did not become healthy"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        try:
            yield url, proc
        finally:
            proc.terminate()
            proc.wait(timeout=30)
