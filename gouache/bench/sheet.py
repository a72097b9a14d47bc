"""Contact sheets: images in rows and titled columns, a note under each row's first image."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

LINE = 12  # pixels per line of PIL's default font
CHARS = 6  # pixels per character of it


def contact_sheet(titles: list[str], rows: list[tuple[list[np.ndarray], str]], path: Path) -> None:
    """Write a PNG: one column per title, one row per (images, note); images of a row may differ
    in size, the note ("" for none) is wrapped under the row's first image."""
    cell_w = max(image.shape[1] for images, _ in rows for image in images) + 8
    width = max((cell_w - 8) // CHARS, 8)
    notes = [textwrap.wrap(note, width) for _, note in rows]
    tallest = max(image.shape[0] for images, _ in rows for image in images)
    cell_h = tallest + 8 + LINE * max(len(note) for note in notes)
    heads = [textwrap.wrap(title, width) for title in titles]
    header = 6 + LINE * max(len(head) for head in heads)
    sheet = Image.new("RGB", (len(titles) * cell_w, header + len(rows) * cell_h), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for col, head in enumerate(heads):
        for i, line in enumerate(head):
            draw.text((col * cell_w + 4, 4 + LINE * i), line, fill=(0, 0, 0))
    for row, ((images, _), note) in enumerate(zip(rows, notes)):
        top = header + row * cell_h + 4
        for col, image in enumerate(images):
            sheet.paste(Image.fromarray(image), (col * cell_w + 4, top))
        for i, line in enumerate(note):
            draw.text((4, top + images[0].shape[0] + 2 + LINE * i), line, fill=(0, 0, 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)


def difference(a: np.ndarray, b: np.ndarray, gain: int = 4) -> np.ndarray:
    """|a - b| x gain, uint8."""
    return np.clip(gain * np.abs(a.astype(np.int16) - b.astype(np.int16)), 0, 255).astype(np.uint8)
