"""Flags a command line typed, so that a command can refuse one the rest of its line would ignore."""

from __future__ import annotations

import argparse
import math


class Given(argparse.Action):
    """Stores a flag's value as `store` does and notes its dest in `args.given`, so that a
    command can refuse a flag the rest of its command line would ignore, even one typed with
    its default value."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


class GivenBool(argparse.BooleanOptionalAction):
    """`--flag` / `--no-flag`, noted in `args.given` as `Given` notes its flags."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


def given(args: argparse.Namespace) -> frozenset[str]:
    """The dests of the `Given` flags typed on this command line."""
    return getattr(args, "given", frozenset())


def refuse_ignored(ignored: dict[str, str]) -> None:
    """Raise one error naming every flag (by dest) that this command line would ignore, and why."""
    if ignored:
        lines = (f"--{dest.replace('_', '-')} would be ignored: {why}" for dest, why in ignored.items())
        raise ValueError("\n  ".join(lines))


def parse_size(text: str) -> tuple[int, int]:
    """'128x64' (WxH, as OpenAI's `size`) -> (64, 128): (height, width), as every size tuple in
    gouache; ValueError saying what a size looks like otherwise."""
    try:
        width, height = (int(v) for v in text.strip().lower().split("x"))
    except ValueError:
        raise ValueError(f"a size looks like WxH, e.g. 512x512; got {text!r}") from None
    return height, width


def parse_shape(text: str) -> tuple[int, ...]:
    """'512' (a square), '128x64' (WxH) or a clip's '128x64x9' (WxHxF: F frames) -> (height,
    width) or (height, width, frames), as a `Resolution`; ValueError saying what one looks like."""
    try:
        numbers = [int(v) for v in text.strip().lower().split("x")]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2, 3) or min(numbers) < 1:
        raise ValueError(f"a size looks like S (a square), WxH, or a clip's WxHxF (F frames), e.g. 512, 832x480 "
                         f"or 832x480x81; got {text!r}")
    if len(numbers) == 1:
        return numbers[0], numbers[0]
    return numbers[1], numbers[0], *numbers[2:]


def size_arg(text: str) -> tuple[int, int]:
    """`parse_size` as an argparse `type`, keeping its message."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def shapes_arg(text: str) -> tuple[tuple[int, ...], ...]:
    """Comma-separated WxH sizes, or a video model's WxHxF clips, as an argparse `type`: (h, w[, frames]) each."""
    try:
        return tuple(parse_shape(part) for part in text.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def counts_arg(text: str) -> tuple[int, ...]:
    """Comma-separated positive counts as an argparse `type`, e.g. 1,2,4,8."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts >= 1, e.g. 1,2,4,8; got {text!r}")
    return counts


def batch_size_arg(text: str) -> int | None:
    """`--max-batch-size` as an argparse `type`: a count >= 1, or auto (None: measured at start)."""
    if text == "auto":
        return None
    (count,) = counts_arg(text)
    return count


# The most MiB a memory flag (`--paused-host-mb`, `--block-cache-mb`, ...) may give: a pebibyte,
# past any host's memory; their bytes (MiB << 20) then stay exact in the floats metrics report.
MAX_MIB = 1 << 30


def mib_arg(text: str) -> int:
    """A memory flag in MiB as an argparse `type`: an integer in [0, MAX_MIB]."""
    try:
        mib = int(text)
    except ValueError:
        mib = -1
    if not 0 <= mib <= MAX_MIB:
        raise argparse.ArgumentTypeError(f"expected a whole number of MiB in [0, {MAX_MIB}]; got {text!r}")
    return mib


def tier_slo_arg(text: str) -> tuple[tuple[str, float], ...]:
    """`--tier-slo-ms` as an argparse `type`: comma-separated TIER=MS, e.g. priority=2000,default=10000,
    each MS in the range a deadline is planned with (`config.MIN_TIER_SLO_MS`, `MAX_TIER_SLO_MS`)."""
    from gouache.config import MAX_TIER_SLO_MS, MIN_TIER_SLO_MS

    return _tier_pairs(text, "MS", f"MS in [{MIN_TIER_SLO_MS:g}, {MAX_TIER_SLO_MS:g}]",
                       lambda ms: MIN_TIER_SLO_MS <= ms <= MAX_TIER_SLO_MS, "priority=2000,default=10000")


def tier_share_arg(text: str) -> tuple[tuple[str, float], ...]:
    """`--tier-queue-share` as an argparse `type`: comma-separated TIER=SHARE, e.g. flex=0.5,default=0.9.
    A share however small still holds one place (`sched.tiers.queue_limit`)."""
    return _tier_pairs(text, "SHARE", "SHARE in (0, 1]", lambda share: 0 < share <= 1, "flex=0.5,default=0.9")


def _tier_pairs(text: str, unit: str, rule: str, valid, example: str) -> tuple[tuple[str, float], ...]:
    from gouache.request import TIERS

    pairs = []
    for part in text.split(","):
        tier, _, number = part.partition("=")
        try:
            value = float(number)
        except ValueError:
            value = math.nan  # fails every rule: NaN is in no range
        if tier.strip() not in TIERS or not valid(value):
            raise argparse.ArgumentTypeError(f"expected TIER={unit} pairs with tiers from {', '.join(TIERS)} and "
                                             f"{rule}, e.g. {example}; got {text!r}")
        pairs.append((tier.strip(), value))
    repeated = sorted({t for t, _ in pairs if [p for p, _ in pairs].count(t) > 1})
    if repeated:  # only the last would count
        raise argparse.ArgumentTypeError(f"each tier once; {', '.join(repeated)} is given twice in {text!r}")
    return tuple(pairs)
