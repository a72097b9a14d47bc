"""The pure half of `gouache bench soak`: the seeded trace of request kinds, and the judgement of
what each request ended as (images, an explicit error, its client's own cancel, or lost)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from gouache.stats import percentile

KINDS = ("plain", "edit", "stream", "stream_cancel", "delete", "disconnect", "lora", "controlnet", "template")
ADAPTER_KINDS = {"lora": "lora_dir", "controlnet": "controlnet_dir"}  # kinds whose server needs a directory
RESULTS = ("images", "error", "cancelled", "lost")


@dataclass
class SoakItem:
    at: float  # seconds after the start of the load
    kind: str  # one of KINDS
    width: int
    height: int
    steps: int
    seed: int
    # in [0.1, 0.9]: when a cancelling kind gives up. stream_cancel, delete: this fraction of the
    # steps; disconnect: this fraction of 2 x the median latency of the capacity measurement
    cut: float


@dataclass
class Seen:
    """What the client saw of one request, before it is judged."""

    status: int | None = None  # HTTP status; None if no response arrived
    images: int = 0  # images received
    code: str | None = None  # `code` of the error body or the SSE `error` event
    closed: bool = False  # the client closed the connection on purpose
    deleted: int | None = None  # status of the DELETE sent for it, if one was
    failure: str | None = None  # why nothing came: "timeout", "bad_body" or an httpx transport error's name


@dataclass
class Outcome:
    kind: str
    result: str  # one of RESULTS
    status: int | None  # HTTP status; None if no response arrived
    code: str | None  # the error's code; for "lost" why it is lost
    latency_s: float  # send -> the end the client saw
    deleted: int | None = None  # status of the DELETE sent for it, if one was


def parse_mix(text: str) -> dict[str, float]:
    message = f"--mix must be kind=weight,... with kinds in {', '.join(KINDS)}, weights >= 0, one > 0; got {text!r}"
    try:
        mix = {kind: float(weight) for kind, _, weight in (part.partition("=") for part in text.split(","))}
    except ValueError:
        raise ValueError(message) from None
    if set(mix) - set(KINDS) or not any(w > 0 for w in mix.values()) or any(w < 0 for w in mix.values()):
        raise ValueError(message)
    return mix


def make_trace(rate: float, duration_s: float, sizes: list[tuple[int, int]], steps: list[int], mix: dict[str, float],
               seed: int, max_requests: int) -> list[SoakItem]:
    """Poisson arrivals at `rate` for `duration_s`. The draws do not depend on `rate`, so two
    rates give the same sequence of requests at scaled times."""
    rng, t, trace = random.Random(seed), 0.0, []
    kinds, weights = list(mix), list(mix.values())
    while len(trace) < max_requests:
        t += rng.expovariate(1.0) / rate
        if t > duration_s:
            break
        kind = rng.choices(kinds, weights)[0]
        (w, h), n_steps, cut = rng.choice(sizes), rng.choice(steps), rng.uniform(0.1, 0.9)
        trace.append(SoakItem(round(t, 4), kind, w, h, n_steps, seed * 100_000 + len(trace), round(cut, 4)))
    return trace


def judge(kind: str, seen: Seen, latency_s: float) -> Outcome:
    """One result per request. A `cancelled` error is how a DELETEd stream is meant to end."""
    if seen.images >= 1:
        result, code = "images", None
    elif seen.closed or (kind == "delete" and seen.code == "cancelled"):
        result, code = "cancelled", seen.code
    elif seen.code is not None or (seen.status or 0) >= 400:
        result, code = "error", seen.code
    else:
        result, code = "lost", seen.failure or "no_images"
    return Outcome(kind, result, seen.status, code, latency_s, seen.deleted)


def tally(outcomes: list[Outcome]) -> dict:
    """Counts of the results; each outcome is in exactly one of images/error/cancelled/lost.
    An SSE error came with status 200: it is counted under the status "sse"."""
    errors = [o for o in outcomes if o.result == "error"]
    latencies = [o.latency_s for o in outcomes if o.result == "images"]
    results = Counter(o.result for o in outcomes)
    return {
        "sent": len(outcomes),
        **{result: results[result] for result in RESULTS},
        "status_429": sum(o.status == 429 for o in errors),
        "errors_by_status": dict(Counter(str(o.status) if (o.status or 0) >= 400 else "sse" for o in errors)),
        "errors_by_code": dict(Counter(o.code or "none" for o in errors)),
        "lost_by_reason": dict(Counter(o.code for o in outcomes if o.result == "lost")),
        "results_by_kind": {k: dict(Counter(o.result for o in outcomes if o.kind == k)) for k in KINDS},
        "delete_status": dict(Counter(str(o.deleted) for o in outcomes if o.deleted is not None)),
        **{f"latency_p{q}_s": percentile(latencies, q) if latencies else None for q in (50, 95, 99)},
    }
