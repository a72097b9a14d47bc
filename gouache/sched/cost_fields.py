"""The numbers a cost-model file may hold, each checked as `from_json` reads it, so that a damaged
or hand-edited file is refused at start naming the entry (`table[3].seconds must be ...`)
instead of failing a request, or planning with NaN, once the server runs.

The ranges are what the planners serve. A step takes 1e-6 s to 1e6 s: a round of at most
`config.MAX_ROUND_S` then runs at most 3.6e9 steps of it (`rounds.steps_in_round` floors τ / T,
which a 5e-324 s step would make inf, an OverflowError), and sums of steps and deadlines stay
finite. Sizes stay within what a server could be asked to make, counts within what a profile
could have measured.
"""

from __future__ import annotations

import sys
from typing import Any

MIN_STEP_S, MAX_STEP_S = 1e-6, 1e6  # a forward's seconds: below any device's, past any request's deadline
MAX_SIDE = 1 << 16  # pixels of an image's height or width
MAX_FRAMES = 1 << 16  # frames of a clip
MAX_COUNT = 1 << 20  # images in a batch, tokens, hidden size, measurements of one batch
MAX_ROWS = 100_000  # entries of a table
MAX_SAMPLES = 10_000  # an SVR's training samples: loading refits on them (quadratic in their number)
MAX_DEGREE = 1 << 12  # devices one step runs on
_LARGEST = sys.float_info.max


def number(value: Any, where: str, low: float, high: float, what: str = "a number") -> float:
    """`value` as a float, if a JSON number (not true/false) in [low, high]; NaN and the
    infinities are in no range, and the comparison is exact for an integer no float holds."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"{where} must be {what} in [{low:g}, {high:g}]; got {shown(value)}")
    return float(value)


def finite(value: Any, where: str) -> float:
    """`value` as a float, if a finite JSON number (a coefficient, which may be negative)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not -_LARGEST <= value <= _LARGEST:
        raise ValueError(f"{where} must be a finite number; got {shown(value)}")
    return float(value)


def seconds(value: Any, where: str, low: float = MIN_STEP_S) -> float:
    """A time in seconds, `low` to MAX_STEP_S (low 0: a stage that may take no time)."""
    return number(value, where, low, MAX_STEP_S, "a number of seconds")


def integer(value: Any, where: str, low: int = 1, high: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{where} must be an integer in [{low}, {high}]; got {shown(value)}")
    return value


def side(value: Any, where: str) -> int:
    """An image's height or width in pixels."""
    return integer(value, where, 1, MAX_SIDE)


def resolution_entry(value: Any, where: str) -> tuple[int, ...]:
    """A size as a file holds it: [height, width] in pixels, a clip's [height, width, frames], or
    one side of a square."""
    if isinstance(value, list) and len(value) in (2, 3):
        return (side(value[0], f"{where}[0]"), side(value[1], f"{where}[1]"),
                *(integer(value[2], f"{where}[2]", 1, MAX_FRAMES) for _ in value[2:]))
    square = side(value, where)
    return square, square


def composition_entry(value: Any, where: str) -> tuple[int, ...]:
    """A batch composition's [height, width, count] entry, or a clip's [height, width, frames, count]."""
    if not (isinstance(value, list) and len(value) in (3, 4)):
        raise ValueError(f"{where} must be [height, width, count] or [height, width, frames, count]; "
                         f"got {shown(value)}")
    return (*resolution_entry(value[:-1], where), integer(value[-1], f"{where}[{len(value) - 1}]"))


def entries(value: Any, where: str, least: int = 0, most: int = MAX_ROWS) -> list:
    """A JSON list of `least` to `most` entries."""
    if not isinstance(value, list) or not least <= len(value) <= most:
        count = least if least == most else f"{least} to {most}"
        raise ValueError(f"{where} must be a list of {count} entries; got {shown(value)}")
    return value


def field(row: Any, name: str, where: str = "") -> tuple[Any, str]:
    """(row[name], its name in a message) of a JSON object `row` named `where` ("": the file's own)."""
    at = f"{where}.{name}" if where else name
    if not isinstance(row, dict):
        raise ValueError(f"{where or 'the file'} must be an object; got {shown(row)}")
    if name not in row:
        raise ValueError(f"{at} is missing")
    return row[name], at


def shown(value: Any) -> str:
    """A refused value as a message names it: short even for a 400-digit integer or a long list."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:32]}... ({len(text)} characters)"
