"""Where a benchmark's results go: JSON, a markdown table headed by the command, and a plot."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def write_results(out: Path, result: dict, table: str, draw: Callable[[Path], None]) -> None:
    """`out` (JSON), its .md (the command, then `table`) and its .png (`draw(path)`); prints the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(table)
    out.with_suffix(".md").write_text(f"`{result['command'].strip()}`\n\n{table}\n")
    draw(out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
