"""`gouache bench soak`: a long overload per policy, checking that no request and nothing else leaks.

Per policy, one real `gouache serve` process. Its capacity is measured first (a closed loop of
plain generations from the run's sizes and steps), then a seeded Poisson trace at `--load` x
that capacity runs for `--duration-s`, mixing plain generations, edits, streams with partial
images, streams the client abandons mid-way, streams cancelled with
`DELETE /v1/images/requests/{id}`, and non-streamed requests whose client disconnects.
Capacity counts whole requests; the cancelling kinds cost less, so the offered work is
somewhat below `--load` x capacity. The trace's kinds, sizes and seeds come from `--seed`
alone; only its arrival times scale with each policy's capacity.

Every request must end in its images, an HTTP error, an SSE `error` event or the client's own
cancel. Anything else is *lost*: no answer within the server's `--request-timeout` plus
`--grace-s`, a broken connection, a stream or 200 that ends without images or error. DELETE
is sent on streams only: a non-streamed request's `x-request-id` arrives with its answer.

Meanwhile the server is sampled every `--sample-s`: RSS of the server and all its descendant
processes, the server's open file descriptors, /health, and every descendant ever seen. At
the end the server gets SIGTERM; its exit code and the descendants still alive afterwards
(leaked) are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import io
import json
import os
import random
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from gouache.bench.server_process import ServerWatch, server_process, terminate
from gouache.stats import percentile

KINDS = ("plain", "edit", "stream", "stream_cancel", "delete", "disconnect")
RESULTS = ("images", "error", "cancelled", "lost")
COST_MODEL_POLICIES = ("patched-slo", "round-knapsack")  # policies that plan with --cost-model
PROMPT = "a red fox in the snow"


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-sdxl", help="model each server serves (default: %(default)s)")
    p.add_argument("--policies", default="orca,patched,patched-slo,round-knapsack,fcfs-static",
                   help="comma-separated policies, one server each (default: %(default)s)")
    p.add_argument("--cost-model", default=None, help=f"step-cost JSON, passed only to {', '.join(COST_MODEL_POLICIES)} (default: none)")
    p.add_argument("--load", type=float, default=2.0, help="arrival rate as a multiple of the measured capacity (default: %(default)s)")
    p.add_argument("--duration-s", type=float, default=600.0, help="seconds of Poisson arrivals per policy (default: %(default)s)")
    p.add_argument("--sizes", default="256x256,384x384", help="comma-separated WxH in pixels, drawn uniformly (default: %(default)s)")
    p.add_argument("--steps", default="10,20,30", help="comma-separated step counts, drawn uniformly (default: %(default)s)")
    p.add_argument("--mix", default="plain=0.3,edit=0.15,stream=0.15,stream_cancel=0.15,delete=0.1,disconnect=0.15",
                   help=f"kind=weight, kinds: {', '.join(KINDS)} (default: %(default)s)")
    p.add_argument("--capacity-requests", type=int, default=12, help="plain requests of the capacity measurement (default: %(default)s)")
    p.add_argument("--capacity-concurrency", type=int, default=2, help="concurrent clients of the capacity measurement (default: %(default)s)")
    p.add_argument("--max-requests", type=int, default=20000, help="cap on the trace's length in requests (default: %(default)s)")
    p.add_argument("--max-batch-size", type=int, default=8, help="each server's images per step (default: %(default)s)")
    p.add_argument("--max-queue-len", type=int, default=64, help="the server's images in flight before 429 (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="the server's request timeout in seconds; its 504 comes after this (default: %(default)s)")
    p.add_argument("--grace-s", type=float, default=30.0, help="seconds: a request unanswered this long after the 504 is lost (default: %(default)s)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples of RSS, fds and /health (default: %(default)s)")
    p.add_argument("--shutdown-timeout-s", type=float, default=30.0, help="seconds to wait for exit after SIGTERM (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace and mix (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/results/soak.json", help="JSON output path (default: %(default)s)")


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


# -- the client ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def edit_png(width: int, height: int) -> bytes:
    """An RGBA noise image whose transparent centre (half of each side) is the region to repaint."""
    from PIL import Image

    image = Image.effect_noise((width, height), 60).convert("RGBA")
    image.paste((0, 0, 0, 0), (width // 4, height // 4, 3 * width // 4, 3 * height // 4))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def _fields(item: SoakItem, model: str) -> dict:
    return {"prompt": PROMPT, "model": model, "size": f"{item.width}x{item.height}", "num_inference_steps": item.steps,
            "seed": item.seed}


def _error_code(body) -> str | None:
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def _sse_error_code(data: str) -> str:
    """The code of an SSE `error` event; one without a readable code is still an explicit error."""
    try:
        return _error_code(json.loads(data)) or "none"
    except ValueError:
        return "unreadable"


def _from_json(response: httpx.Response) -> Seen:
    try:
        body = response.json()
    except ValueError:
        return Seen(response.status_code, failure="bad_body")
    if response.status_code == 200:
        return Seen(200, images=len(body.get("data", [])))
    return Seen(response.status_code, code=_error_code(body))


async def _plain(client: httpx.AsyncClient, item: SoakItem, model: str) -> Seen:
    return _from_json(await client.post("/v1/images/generations", json=_fields(item, model)))


async def _edit(client: httpx.AsyncClient, item: SoakItem, model: str) -> Seen:
    files = {"image": ("image.png", edit_png(item.width, item.height), "image/png")}
    data = {name: str(value) for name, value in _fields(item, model).items()}
    return _from_json(await client.post("/v1/images/edits", data=data, files=files))


async def _disconnect(client: httpx.AsyncClient, item: SoakItem, model: str, after_s: float) -> Seen:
    try:  # cancelling the request closes its connection, as a client that goes away does
        return await asyncio.wait_for(_plain(client, item, model), after_s)
    except TimeoutError:
        return Seen(closed=True)


async def _stream(client: httpx.AsyncClient, item: SoakItem, model: str) -> Seen:
    """A stream; `stream_cancel` closes it and `delete` DELETEs it after `cut` of its steps."""
    stop_at = None if item.kind == "stream" else max(1, round(item.cut * item.steps))
    body = _fields(item, model) | {"stream": True, "partial_images": 2}
    async with client.stream("POST", "/v1/images/generations", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return _from_json(response)
        seen, event, progress = Seen(200), "", 0
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif not line.startswith("data: "):
                continue
            elif event == "error":
                seen.code = _sse_error_code(line.removeprefix("data: "))
            elif event.endswith(".completed"):
                seen.images += 1
            elif event == "gouache.progress":
                progress += 1
                if progress == stop_at and item.kind == "stream_cancel":
                    seen.closed = True
                    return seen
                if progress == stop_at:
                    request_id = response.headers["x-request-id"]
                    seen.deleted = (await client.delete(f"/v1/images/requests/{request_id}")).status_code
        return seen


def _request(client: httpx.AsyncClient, item: SoakItem, model: str, disconnect_s: float) -> Coroutine[Any, Any, Seen]:
    if item.kind == "disconnect":
        return _disconnect(client, item, model, item.cut * disconnect_s)
    return {"plain": _plain, "edit": _edit}.get(item.kind, _stream)(client, item, model)


async def send(client: httpx.AsyncClient, item: SoakItem, model: str, deadline_s: float, disconnect_s: float) -> Outcome:
    start = time.perf_counter()
    try:
        async with asyncio.timeout(deadline_s):
            seen = await _request(client, item, model, disconnect_s)
    except TimeoutError:
        seen = Seen(failure="timeout")
    except httpx.TransportError as error:
        seen = Seen(failure=type(error).__name__)
    return judge(item.kind, seen, time.perf_counter() - start)


def _client(base_url: str) -> httpx.AsyncClient:
    # A fresh connection per request: no idle connection the server may close under a reuse.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None, connect=10), limits=limits)


async def measure_capacity(base_url: str, items: list[SoakItem], model: str, concurrency: int,
                           deadline_s: float) -> tuple[float, float]:
    """(completed requests per second, median latency in s) of a closed loop over `items`."""
    todo, latencies = list(items), []
    async with _client(base_url) as client:
        async def worker() -> None:
            while todo:
                outcome = await send(client, todo.pop(0), model, deadline_s, 0)
                if outcome.result == "images":
                    latencies.append(outcome.latency_s)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    if not latencies:
        raise RuntimeError("no request of the capacity measurement returned images")
    return len(latencies) / elapsed, percentile(latencies, 50)


async def drive(base_url: str, trace: list[SoakItem], model: str, deadline_s: float, disconnect_s: float) -> list[Outcome]:
    async with _client(base_url) as client:
        bar = tqdm(total=len(trace), desc="requests", unit="req", disable=os.environ.get("CI") == "true")
        start = time.perf_counter()

        async def fire(item: SoakItem) -> Outcome:
            await asyncio.sleep(max(0.0, item.at - (time.perf_counter() - start)))
            outcome = await send(client, item, model, deadline_s, disconnect_s)
            bar.update()
            return outcome

        outcomes = await asyncio.gather(*(fire(item) for item in trace))
        bar.close()
    return list(outcomes)


# -- one policy ------------------------------------------------------------------------------


def _serve_args(args, policy: str) -> list[str]:
    serve = ["--model", args.model, "--policy", policy, "--max-batch-size", str(args.max_batch_size),
             "--max-queue-len", str(args.max_queue_len), "--request-timeout", str(args.request_timeout)]
    return serve + (["--cost-model", args.cost_model] if policy in COST_MODEL_POLICIES else [])


def _drain(base_url: str, timeout_s: float) -> dict | None:
    """/health once nothing is waiting or running, or as it is after `timeout_s`; None if it never answered."""
    deadline, health = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            health = httpx.get(f"{base_url}/health", timeout=5).json()
            if health.get("waiting") == 0 and health.get("running") == 0:
                break
        time.sleep(0.5)
    return health


def _server_errors(base_url: str) -> dict[str, float] | None:
    """errors_total by kind, as the server counted them; None if /metrics does not answer."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    prefix = 'gouache_errors_total{kind="'
    return {line[len(prefix):].partition('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def _resources(samples: list, load_start_s: float, duration_s: float) -> dict:
    """RSS after warm-up (the first sample past 20 % of the load) and at the end; fds before and after."""
    start = next(s for s in samples if s.mark == "load_start")
    warm = next((s for s in samples if s.t_s >= load_start_s + 0.2 * duration_s), start)
    end = samples[-1]
    return {"rss_warm_mb": warm.rss_mb, "rss_end_mb": end.rss_mb, "rss_max_mb": max(s.rss_mb for s in samples),
            "rss_growth_pct": 100 * (end.rss_mb - warm.rss_mb) / warm.rss_mb, "fds_start": start.fds,
            "fds_end": end.fds, "fds_max": max(s.fds for s in samples),
            "health_not_ok": sum(s.health != 200 for s in samples)}


def soak_policy(args, policy: str, mix: dict[str, float], sizes: list[tuple[int, int]], steps: list[int]) -> dict:
    fd, log_name = tempfile.mkstemp(prefix=f"gouache-soak-{policy}-", suffix=".log")
    os.close(fd)
    log_path = Path(log_name)
    with server_process(_serve_args(args, policy), log_path) as (proc, base_url):
        watch = ServerWatch(proc.pid, base_url, args.sample_s)
        watch.start()
        try:
            probe = make_trace(1.0, float("inf"), sizes, steps, {"plain": 1.0}, args.seed + 1, args.capacity_requests)
            deadline_s = args.request_timeout + args.grace_s
            capacity, median_s = asyncio.run(
                measure_capacity(base_url, probe, args.model, args.capacity_concurrency, deadline_s))
            trace = make_trace(args.load * capacity, args.duration_s, sizes, steps, mix, args.seed, args.max_requests)
            load_start = watch.sample("load_start")
            start = time.perf_counter()
            outcomes = asyncio.run(drive(base_url, trace, args.model, deadline_s, 2 * median_s))
            wall = time.perf_counter() - start
            after_drain = _drain(base_url, args.grace_s)
            server_errors = _server_errors(base_url)
            watch.sample("end")
        finally:
            watch.stop()
        shutdown = terminate(proc, watch, args.shutdown_timeout_s)
    log = log_path.read_text(errors="replace")
    return {"policy": policy, "capacity_rps": capacity, "capacity_median_latency_s": median_s,
            "offered_rps": args.load * capacity, "load_wall_s": wall, **tally(outcomes),
            **_resources(watch.samples, load_start.t_s, args.duration_s), **shutdown,
            "after_drain": after_drain, "server_errors_total": server_errors, "server_log": str(log_path),
            "server_log_tracebacks": log.count("Traceback"), "timeline": [asdict(s) for s in watch.samples]}


# -- the command -----------------------------------------------------------------------------

COLUMNS = [("policy", "policy", "{}"), ("capacity req/s", "capacity_rps", "{:.2f}"), ("offered req/s", "offered_rps", "{:.2f}"),
           ("sent", "sent", "{}"), ("images", "images", "{}"), ("errors", "error", "{}"), ("429", "status_429", "{}"),
           ("cancelled", "cancelled", "{}"), ("lost", "lost", "{}"), ("p50 s", "latency_p50_s", "{:.2f}"),
           ("p95 s", "latency_p95_s", "{:.2f}"), ("p99 s", "latency_p99_s", "{:.2f}"), ("RSS warm MiB", "rss_warm_mb", "{:.0f}"),
           ("RSS end MiB", "rss_end_mb", "{:.0f}"), ("RSS growth %", "rss_growth_pct", "{:+.1f}"),
           ("fds start", "fds_start", "{}"), ("fds end", "fds_end", "{}"), ("/health not 200", "health_not_ok", "{}"),
           ("leaked procs", "leaked", "{}"), ("exit code", "exit_code", "{}")]


def format_table(rows: list[dict]) -> str:
    def cell(row: dict, key: str, fmt: str) -> str:
        value = row[key]
        if key == "leaked":
            value = len(value)
        return "-" if value is None else fmt.format(value)

    lines = ["| " + " | ".join(c[0] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row, key, fmt) for _, key, fmt in COLUMNS) + " |" for row in rows]
    for row in rows:
        errors = ", ".join(f"{code} {n}" for code, n in sorted(row["errors_by_code"].items())) or "none"
        lost = ", ".join(f"{why} {n}" for why, n in sorted(row["lost_by_reason"].items())) or "none"
        leaked = "; ".join(f"{p['pid']} {p['cmdline'][:80]}" for p in row["leaked"]) or "none"
        lines.append(f"\n{row['policy']}: errors by code: {errors}; lost: {lost}; leaked: {leaked}; "
                     f"tracebacks in the server log: {row['server_log_tracebacks']}")
    return "\n".join(lines)


def _command() -> str:
    argv = sys.argv[1:]
    if "soak" in argv:  # `gouache bench soak ...`; otherwise `python -m gouache.bench.soak ...`
        argv = argv[argv.index("soak") + 1:]
    return shlex.join(["gouache", "bench", "soak", *argv])


def _write(args, rows: list[dict]) -> str:
    table = format_table(rows)
    result = {"command": _command(), "args": vars(args), "machine": f"{os.cpu_count()} CPU cores", "results": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(f"`{result['command']}`\n\n{table}\n")
    return table


def run(args) -> int:
    from gouache.sched.policies import POLICIES

    policies = args.policies.split(",")
    if set(policies) - set(POLICIES):
        raise ValueError(f"unknown policies {sorted(set(policies) - set(POLICIES))}; known: {', '.join(sorted(POLICIES))}")
    if args.cost_model is None and set(policies) & set(COST_MODEL_POLICIES):
        raise ValueError(f"{' and '.join(COST_MODEL_POLICIES)} need --cost-model (JSON from `gouache profile`)")
    mix = parse_mix(args.mix)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    steps = [int(s) for s in args.steps.split(",")]
    rows = []
    for policy in policies:  # written after each policy: a long run keeps what it measured
        rows.append(soak_policy(args, policy, mix, sizes, steps))
        table = _write(args, rows)
    print(table)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="gouache bench soak", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
