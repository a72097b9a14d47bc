import argparse
import json

import pytest

from gouache.bench.soak import CACHES, _compiled, _during, add_arguments, run
from gouache.bench.soak_trace import KINDS, RESULTS, Outcome, Seen, judge, make_trace, parse_mix, tally

SIZES = [(64, 64), (64, 128)]
UNIFORM = {kind: 1.0 for kind in KINDS}


def test_trace_is_drawn_from_the_seed_and_only_its_times_scale_with_the_rate():
    slow = make_trace(1.0, 60, SIZES, [2, 4], UNIFORM, seed=3, max_requests=1000)
    fast = make_trace(2.0, 60, SIZES, [2, 4], UNIFORM, seed=3, max_requests=1000)
    assert slow == make_trace(1.0, 60, SIZES, [2, 4], UNIFORM, seed=3, max_requests=1000)
    assert slow != make_trace(1.0, 60, SIZES, [2, 4], UNIFORM, seed=4, max_requests=1000)
    assert len(fast) > len(slow) and all(item.at <= 60 for item in fast)
    for a, b in zip(slow, fast):
        assert ((a.kind, a.width, a.height, a.steps, a.seed, a.cut)
                == (b.kind, b.width, b.height, b.steps, b.seed, b.cut))
        assert b.at == pytest.approx(a.at / 2, abs=1e-4)
    assert len(make_trace(100.0, 60, SIZES, [2], UNIFORM, seed=3, max_requests=7)) == 7


def test_trace_draws_only_kinds_of_positive_weight():
    trace = make_trace(1.0, 200, SIZES, [2], {"plain": 1.0, "delete": 0.0, "edit": 1.0}, seed=0, max_requests=1000)
    assert {item.kind for item in trace} == {"plain", "edit"}


def test_mix_must_name_known_kinds_with_nonnegative_weights():
    assert parse_mix("plain=0.5,edit=0.5") == {"plain": 0.5, "edit": 0.5}
    for bad in ("plain=1,cats=1", "plain=-1,edit=2", "plain=0"):
        with pytest.raises(ValueError, match="--mix"):
            parse_mix(bad)


@pytest.mark.parametrize(("kind", "seen", "result", "code"), [
    ("plain", Seen(200, images=1), "images", None),
    ("delete", Seen(200, images=1, deleted=404), "images", None),  # finished before the DELETE landed
    ("plain", Seen(429, code="queue_full"), "error", "queue_full"),
    ("stream", Seen(200, code="timeout"), "error", "timeout"),  # an SSE error event
    ("plain", Seen(502), "error", None),  # an error status without an OpenAI error body
    ("stream", Seen(200, code="cancelled"), "error", "cancelled"),  # nobody asked for that cancel
    ("delete", Seen(200, code="cancelled", deleted=200), "cancelled", "cancelled"),
    ("stream_cancel", Seen(200, closed=True), "cancelled", None),
    ("disconnect", Seen(closed=True), "cancelled", None),
    ("plain", Seen(failure="timeout"), "lost", "timeout"),
    ("stream", Seen(failure="RemoteProtocolError"), "lost", "RemoteProtocolError"),
    ("stream", Seen(200), "lost", "no_images"),  # the stream ended with neither images nor error
    ("delete", Seen(200, deleted=200), "lost", "no_images"),
    ("plain", Seen(200, failure="bad_body"), "lost", "bad_body"),
])
def test_judge_gives_each_request_exactly_one_result(kind, seen, result, code):
    outcome = judge(kind, seen, 1.5)
    assert (outcome.result, outcome.code, outcome.latency_s) == (result, code, 1.5)


def test_tally_counts_every_outcome_once_and_times_only_completed_requests():
    outcomes = [Outcome("plain", "images", 200, None, s) for s in (1.0, 2.0, 3.0, 4.0)]
    outcomes += [Outcome("plain", "error", 429, "queue_full", 0.1), Outcome("edit", "error", 429, "queue_full", 0.1),
                 Outcome("stream", "error", 200, "timeout", 9.0),
                 Outcome("delete", "cancelled", 200, "cancelled", 2.0, 200),
                 Outcome("disconnect", "cancelled", None, None, 0.5), Outcome("stream", "lost", None, "timeout", 99.0)]
    report = tally(outcomes)
    assert report["sent"] == 10 == sum(report[result] for result in RESULTS)
    assert (report["images"], report["error"], report["cancelled"], report["lost"]) == (4, 3, 2, 1)
    assert report["status_429"] == 2
    assert report["errors_by_status"] == {"429": 2, "sse": 1}
    assert report["errors_by_code"] == {"queue_full": 2, "timeout": 1}
    assert report["lost_by_reason"] == {"timeout": 1}
    assert report["delete_status"] == {"200": 1}
    assert report["results_by_kind"]["plain"] == {"images": 4, "error": 1}
    assert report["latency_p50_s"] == 2.5 and report["latency_p95_s"] == pytest.approx(3.85)


@pytest.mark.slow
def test_soak_of_a_real_server_accounts_for_every_request(tmp_path):
    out = tmp_path / "soak.json"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--policies", "orca", "--sizes", "64x64,64x128", "--steps", "4,6", "--duration-s", "3", "--max-requests", "24",
        "--mix", ",".join(f"{kind}=1" for kind in KINDS), "--capacity-requests", "4", "--sample-s", "0.5",
        "--request-timeout", "20", "--grace-s", "10", "--seed", "1", "--rewrite-s", "0.5", "--out", str(out),
    ])
    trace = make_trace(1.0, float("inf"), [(64, 64), (64, 128)], [4, 6], parse_mix(args.mix), 1, 24)
    assert {item.kind for item in trace} == set(KINDS)  # the run below sends every kind
    assert run(args) == 0
    result = json.loads(out.read_text())
    assert "soak" in result["command"] and result["args"]["policies"] == "orca"
    row = result["results"][0]
    assert row["lost"] == 0, row["lost_by_reason"]
    assert row["sent"] == sum(row[r] for r in RESULTS) == sum(sum(k.values()) for k in row["results_by_kind"].values())
    assert (0 < row["sent"] <= 24 and row["capacity_rps"] > 0
            and row["offered_rps"] == pytest.approx(2 * row["capacity_rps"]))
    assert {"load_start", "end"} <= {sample["mark"] for sample in row["timeline"]}
    for key in ("rss_warm_mb", "rss_end_mb", "rss_growth_pct", "fds_start", "fds_end", "exit_code", "leaked",
                "children_seen", "latency_p99_s", "errors_by_code", "server_errors_total", "after_drain"):
        assert key in row
    assert row["recompiles"] is None and row["compile_during_load"] is None  # the server does not compile
    caches = row["caches_end_mb"]  # what the caches hold, beside the RSS they explain
    assert set(caches) == set(CACHES) and min(caches.values()) >= 0
    assert out.with_suffix(".md").read_text().startswith("`gouache bench soak")


def test_compile_counters_are_read_from_metrics_and_counted_over_the_load():
    text = "\n".join([
        "# HELP gouache_compile_steps_total Steps under --compile",
        'gouache_compile_steps_total{path="eager",reason="compiling"} 41.0',
        'gouache_compile_steps_created{path="eager",reason="compiling"} 1.79e+09',
        'gouache_compile_steps_total{path="compiled",reason=""} 10.0',
        "gouache_compile_graphs_total 6.0", "gouache_compile_recompiles_total 0.0",
        "gouache_compile_recompiles_created 1.79e+09"])
    start = _compiled(text)
    assert start == {"eager:compiling": 41, "compiled": 10, "graphs": 6, "recompiles": 0}
    end = _compiled(text.replace("} 10.0", "} 25.0").replace("recompiles_total 0.0", "recompiles_total 2.0"))
    assert _during(start, end) == {"eager:compiling": 0, "compiled": 15, "graphs": 0, "recompiles": 2}
    assert _compiled('gouache_errors_total{kind="x"} 1.0') is None and _during(None, end) is None


@pytest.mark.parametrize("flags, message", [
    (["--policies", "orca,patched", "--cost-model", "costmodel.json"], "--cost-model would be ignored"),
    (["--policies", "orca,round-knapsack"], "round-knapsack need --cost-model"),
    (["--policies", "orca,no-such"], "unknown policies"),
    (["--policies", "orca", "--mix", "plain=1,edit=1", "--rewrite-s", "2"], "--rewrite-s would be ignored"),
])
def test_policies_cost_model_and_rewrites_are_checked_before_any_server_starts(flags, message):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match=message):
        run(parser.parse_args(flags))


def test_adapters_are_made_as_the_mix_asks_and_a_transformer_refuses_controlnets(tmp_path):
    from gouache.bench.soak_adapters import make_adapters

    made = make_adapters("tiny-sd3", tmp_path, {"lora_dir"})
    assert set(made) == {"lora_dir"} and len(list(made["lora_dir"].glob("*.safetensors"))) == 3
    assert not (tmp_path / "controlnets").exists()
    with pytest.raises(ValueError, match="controlnet requests, which tiny-sd3 does not serve: ControlNets are"):
        make_adapters("tiny-sd3", tmp_path, {"lora_dir", "controlnet_dir"})
