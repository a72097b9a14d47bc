from __future__ import annotations

import base64
import io
import json
from typing import Any

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
