"""`gouache bench soak`: a long overload per policy, checking that no request and nothing else leaks.

Per policy, one real `gouache serve` process. Its capacity is measured first (a closed loop of
plain generations from the run's sizes and steps), then a seeded Poisson trace at `--load` x
that capacity runs for `--duration-s`, mixing plain generations, edits, streams with partial
images, streams the client abandons mid-way, streams cancelled with
`DELETE /v1/images/requests/{id}`, non-streamed requests whose client disconnects, and requests
of the features users reach for next: a LoRA, a ControlNet, an edit of a template. The server
gets random LoRAs and ControlNets of its model (`soak_adapters`), and one LoRA file is rewritten
in place every `--rewrite-s` seconds while the load runs.
Capacity counts whole requests; the cancelling kinds cost less, so the offered work is
somewhat below `--load` x capacity. The trace's kinds, sizes and seeds come from `--seed`
alone; only its arrival times scale with each policy's capacity.

Every request must end in its images, an HTTP error, an SSE `error` event or the client's own
cancel. Anything else is *lost*: no answer within the server's `--request-timeout` plus
`--grace-s`, a broken connection, a stream or 200 that ends without images or error. DELETE
is sent on streams only: a non-streamed request's `x-request-id` arrives with its answer.

`--server-args` gives every server more flags; with `--compile` the row also says how many
graphs the server compiled during the load that its warm-up had not foreseen (`recompiles`,
from `gouache_compile_recompiles_total`) and how its steps ran (compiled, or eagerly and why).

Meanwhile the server is sampled every `--sample-s`: RSS of the server and all its descendant
processes, the server's open file descriptors, /health, and every descendant ever seen. At
the end the server gets SIGTERM; its exit code and the descendants still alive afterwards
(leaked) are reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from gouache.bench.server_process import ServerWatch, server_process, terminate
from gouache.bench.soak_adapters import Rewriter, make_adapters
from gouache.bench.soak_client import drive, measure_capacity
from gouache.bench.soak_trace import ADAPTER_KINDS, KINDS, make_trace, parse_mix, tally
from gouache.cli_flags import Given, given, refuse_ignored
from gouache.sched.policies import POLICIES

# the policies that plan with a step-cost model, and so take --cost-model
COST_MODEL_POLICIES = tuple(name for name, cls in POLICIES.items() if cls.needs_predictor)


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-sdxl", help="model each server serves (default: %(default)s)")
    p.add_argument("--policies", default="orca,patched,patched-slo,round-knapsack,fcfs-static",
                   help="comma-separated policies, one server each (default: %(default)s)")
    p.add_argument("--cost-model", default=None,
                   help=f"step-cost JSON, passed only to {', '.join(COST_MODEL_POLICIES)} (default: none)")
    p.add_argument("--load", type=float, default=2.0,
                   help="arrival rate as a multiple of the measured capacity (default: %(default)s)")
    p.add_argument("--duration-s", type=float, default=600.0,
                   help="seconds of Poisson arrivals per policy (default: %(default)s)")
    p.add_argument("--sizes", default="256x256,384x384",
                   help="comma-separated WxH in pixels, drawn uniformly (default: %(default)s)")
    p.add_argument("--steps", default="10,20,30",
                   help="comma-separated step counts, drawn uniformly (default: %(default)s)")
    p.add_argument("--mix", default="plain=0.2,edit=0.1,stream=0.1,stream_cancel=0.1,delete=0.1,disconnect=0.1,"
                                    "lora=0.1,controlnet=0.1,template=0.1",
                   help=f"kind=weight, kinds: {', '.join(KINDS)} (default: %(default)s)")
    p.add_argument("--rewrite-s", type=float, default=5.0, action=Given,
                   help="seconds between in-place rewrites of one LoRA file during the load; 0: none "
                        "(default: %(default)s)")
    p.add_argument("--capacity-requests", type=int, default=12,
                   help="plain requests of the capacity measurement (default: %(default)s)")
    p.add_argument("--capacity-concurrency", type=int, default=2,
                   help="concurrent clients of the capacity measurement (default: %(default)s)")
    p.add_argument("--max-requests", type=int, default=20000,
                   help="cap on the trace's length in requests (default: %(default)s)")
    p.add_argument("--max-batch-size", type=int, default=8, help="each server's images per step (default: %(default)s)")
    p.add_argument("--max-queue-len", type=int, default=64,
                   help="the server's images in flight before 429 (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="the server's request timeout in seconds; its 504 comes after this (default: %(default)s)")
    p.add_argument("--grace-s", type=float, default=30.0,
                   help="seconds: a request unanswered this long after the 504 is lost (default: %(default)s)")
    p.add_argument("--sample-s", type=float, default=5.0,
                   help="seconds between samples of RSS, fds and /health (default: %(default)s)")
    p.add_argument("--shutdown-timeout-s", type=float, default=30.0,
                   help="seconds to wait for exit after SIGTERM (default: %(default)s)")
    p.add_argument("--server-args", default="",
                   help="more flags for each server, one string, given with '=' "
                        "(--server-args='--compile --compile-sizes 64x64': the table then counts the graphs "
                        "compiled during the load, `recompiles`; default: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace and mix (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/results/soak.json", help="JSON output path (default: %(default)s)")


# -- one policy ------------------------------------------------------------------------------


def _serve_args(args, policy: str, directories: dict[str, Path]) -> list[str]:
    serve = ["--model", args.model, "--policy", policy, "--max-batch-size", str(args.max_batch_size),
             "--max-queue-len", str(args.max_queue_len), "--request-timeout", str(args.request_timeout)]
    for flag, path in directories.items():
        serve += [f"--{flag.replace('_', '-')}", str(path)]
    serve += ["--cost-model", args.cost_model] if policy in COST_MODEL_POLICIES else []
    return serve + shlex.split(args.server_args)


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


CACHES = {"block_cache": "gouache_block_cache_bytes", "templates": "gouache_template_store_bytes",
          "lora_host": "gouache_lora_host_bytes"}  # what the server's caches hold, by /metrics gauge


def _metrics(base_url: str) -> str | None:
    try:
        return httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None


def _compiled(text: str | None) -> dict[str, float] | None:
    """A compiling server's compile counters (`recompiles`, `graphs`, and steps by path and
    reason: `compiled`, `eager:<reason>`); None without them."""
    if text is None or "gouache_compile_recompiles_total " not in text:
        return None
    counts: dict[str, float] = {}
    for line in text.splitlines():
        name, value = line.partition("{")[0].partition(" ")[0], line.rsplit(" ", 1)[-1]
        if name in ("gouache_compile_recompiles_total", "gouache_compile_graphs_total"):
            counts[name.split("_")[2]] = float(value)
        elif name == "gouache_compile_steps_total":
            labels = dict(part.split("=") for part in line.partition("{")[2].partition("}")[0].split(","))
            path, reason = labels['path'].strip('"'), labels['reason'].strip('"')
            counts[path if path == "compiled" else f"{path}:{reason}"] = float(value)
    return counts


def _during(start: dict[str, float] | None, end: dict[str, float] | None) -> dict[str, float] | None:
    """What the compile counters counted between two samples (None: the server does not compile)."""
    if start is None or end is None:
        return None
    return {name: value - start.get(name, 0.0) for name, value in end.items()}


def _server_metrics(text: str | None) -> tuple[dict[str, float] | None, dict[str, float] | None]:
    """errors_total by kind, as the server counted them, and the bytes each cache holds in memory
    (summed over devices and the template store's memory tiers); (None, None) if /metrics did not answer."""
    if text is None:
        return None, None
    errors, caches = {}, dict.fromkeys(CACHES, 0.0)
    prefix = 'gouache_errors_total{kind="'
    for line in text.splitlines():
        name, value = line.partition("{")[0], line.rsplit(" ", 1)[-1]
        if line.startswith(prefix):
            errors[line[len(prefix):].partition('"')[0]] = float(value)
        for cache, gauge in CACHES.items():
            if name == gauge and 'tier="disk"' not in line:
                caches[cache] += float(value)
    return errors, caches


def _resources(samples: list, load_start_s: float, duration_s: float) -> dict:
    """RSS after warm-up (the first sample past 20 % of the load) and at the end; fds before and after."""
    start = next(s for s in samples if s.mark == "load_start")
    warm = next((s for s in samples if s.t_s >= load_start_s + 0.2 * duration_s), start)
    end = samples[-1]
    return {"rss_warm_mb": warm.rss_mb, "rss_end_mb": end.rss_mb, "rss_max_mb": max(s.rss_mb for s in samples),
            "rss_growth_pct": 100 * (end.rss_mb - warm.rss_mb) / warm.rss_mb, "fds_start": start.fds,
            "fds_end": end.fds, "fds_max": max(s.fds for s in samples),
            "health_not_ok": sum(s.health != 200 for s in samples)}


def soak_policy(args, policy: str, mix: dict[str, float], sizes: list[tuple[int, int]], steps: list[int],
                adapters: Path) -> dict:
    fd, log_name = tempfile.mkstemp(prefix=f"gouache-soak-{policy}-", suffix=".log")
    os.close(fd)
    log_path = Path(log_name)
    wanted = {flag for kind, flag in ADAPTER_KINDS.items() if mix.get(kind)}
    directories = make_adapters(args.model, adapters, wanted) if wanted else {}
    rewriter = Rewriter(adapters, args.rewrite_s if "lora_dir" in wanted else 0)
    with server_process(_serve_args(args, policy, directories), log_path) as (proc, base_url):
        watch = ServerWatch(proc.pid, base_url, args.sample_s)
        watch.start()
        try:
            probe = make_trace(1.0, float("inf"), sizes, steps, {"plain": 1.0}, args.seed + 1, args.capacity_requests)
            deadline_s = args.request_timeout + args.grace_s
            capacity, median_s = asyncio.run(
                measure_capacity(base_url, probe, args.model, args.capacity_concurrency, deadline_s))
            trace = make_trace(args.load * capacity, args.duration_s, sizes, steps, mix, args.seed, args.max_requests)
            load_start = watch.sample("load_start")
            compiles = "--compile" in shlex.split(args.server_args)
            compile_start = _compiled(_metrics(base_url)) if compiles else None
            start = time.perf_counter()
            rewriter.start()
            try:
                outcomes = asyncio.run(drive(base_url, trace, args.model, deadline_s, 2 * median_s))
            finally:
                rewriter.stop()
            wall = time.perf_counter() - start
            after_drain = _drain(base_url, args.grace_s)
            text = _metrics(base_url)
            server_errors, caches = _server_metrics(text)
            compiled = _during(compile_start, _compiled(text))
            watch.sample("end")
        finally:
            watch.stop()
        shutdown = terminate(proc, watch, args.shutdown_timeout_s)
    log = log_path.read_text(errors="replace")
    return {"policy": policy, "capacity_rps": capacity, "capacity_median_latency_s": median_s,
            "offered_rps": args.load * capacity, "load_wall_s": wall, "lora_rewrites": rewriter.rewrites,
            **tally(outcomes), **_resources(watch.samples, load_start.t_s, args.duration_s), **shutdown,
            "after_drain": after_drain, "server_errors_total": server_errors,
            "caches_end_mb": None if caches is None else {k: v / 2**20 for k, v in caches.items()},
            "compile_during_load": compiled, "recompiles": None if compiled is None else compiled.get("recompiles"),
            "server_log": str(log_path), "server_log_tracebacks": log.count("Traceback"),
            "timeline": [asdict(s) for s in watch.samples]}


# -- the command -----------------------------------------------------------------------------

COLUMNS = [("policy", "policy", "{}"), ("capacity req/s", "capacity_rps", "{:.2f}"),
           ("offered req/s", "offered_rps", "{:.2f}"),
           ("sent", "sent", "{}"), ("images", "images", "{}"), ("errors", "error", "{}"), ("429", "status_429", "{}"),
           ("cancelled", "cancelled", "{}"), ("lost", "lost", "{}"), ("p50 s", "latency_p50_s", "{:.2f}"),
           ("p95 s", "latency_p95_s", "{:.2f}"), ("p99 s", "latency_p99_s", "{:.2f}"),
           ("RSS warm MiB", "rss_warm_mb", "{:.0f}"),
           ("RSS end MiB", "rss_end_mb", "{:.0f}"), ("RSS growth %", "rss_growth_pct", "{:+.1f}"),
           ("caches end MiB", "caches_end_mb", "{:.0f}"),
           ("recompiles", "recompiles", "{:.0f}"),
           ("fds start", "fds_start", "{}"), ("fds end", "fds_end", "{}"), ("/health not 200", "health_not_ok", "{}"),
           ("leaked procs", "leaked", "{}"), ("exit code", "exit_code", "{}")]


def format_table(rows: list[dict]) -> str:
    def cell(row: dict, key: str, fmt: str) -> str:
        value = row[key]
        if key == "leaked":
            value = len(value)
        elif key == "caches_end_mb" and value is not None:
            value = sum(value.values())
        return "-" if value is None else fmt.format(value)

    lines = ["| " + " | ".join(c[0] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row, key, fmt) for _, key, fmt in COLUMNS) + " |" for row in rows]
    for row in rows:
        errors = ", ".join(f"{code} {n}" for code, n in sorted(row["errors_by_code"].items())) or "none"
        lost = ", ".join(f"{why} {n}" for why, n in sorted(row["lost_by_reason"].items())) or "none"
        leaked = "; ".join(f"{p['pid']} {p['cmdline'][:80]}" for p in row["leaked"]) or "none"
        caches = ", ".join(f"{name} {mb:.0f} MiB" for name, mb in (row["caches_end_mb"] or {}).items()) or "unknown"
        compiled = row.get("compile_during_load")
        steps = "" if compiled is None else "; steps during the load: " + ", ".join(
            f"{name} {n:.0f}" for name, n in sorted(compiled.items()) if name not in ("recompiles", "graphs") and n)
        lines.append(f"\n{row['policy']}: errors by code: {errors}; lost: {lost}; leaked: {leaked}; "
                     f"caches at the end: {caches}; tracebacks in the server log: {row['server_log_tracebacks']}"
                     + steps)
    return "\n".join(lines)


def _command() -> str:
    argv = sys.argv[1:]
    options = argv[argv.index("soak") + 1:] if "soak" in argv else []  # none when run() is called directly
    return shlex.join(["gouache", "bench", "soak", *options])


def _write(args, rows: list[dict]) -> str:
    table = format_table(rows)
    result = {"command": _command(), "args": {k: v for k, v in vars(args).items() if k != "given"},
              "machine": f"{os.cpu_count()} CPU cores", "results": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(f"`{result['command']}`\n\n{table}\n")
    return table


def run(args) -> int:
    policies = args.policies.split(",")
    if set(policies) - set(POLICIES):
        raise ValueError(f"unknown policies {sorted(set(policies) - set(POLICIES))}; "
                         f"known: {', '.join(sorted(POLICIES))}")
    planned = set(policies) & set(COST_MODEL_POLICIES)
    if args.cost_model is None and planned:
        raise ValueError(f"{' and '.join(sorted(planned))} need --cost-model (JSON from `gouache profile`)")
    if args.cost_model is not None and not planned:
        raise ValueError(f"--cost-model would be ignored: only {', '.join(COST_MODEL_POLICIES)} read it, "
                         f"and --policies names neither")
    mix = parse_mix(args.mix)
    if "rewrite_s" in given(args) and args.rewrite_s and not mix.get("lora"):
        refuse_ignored({"rewrite_s": "--mix sends no lora requests, so no server reads the rewritten LoRA"})
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    steps = [int(s) for s in args.steps.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="gouache-soak-adapters-") as adapters:
        for policy in policies:  # written after each policy: a long run keeps what it measured
            rows.append(soak_policy(args, policy, mix, sizes, steps, Path(adapters) / policy))
            table = _write(args, rows)
    print(table)
    print(f"wrote {args.out}")
    return 0

