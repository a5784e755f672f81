"""``bench/run.py``, which runs the benchmark suite a layer per process and
joins the layers' raw JSON: every layer module is in the suite's order, and
the joined JSON holds every layer's benchmarks and records, as one process
running the whole suite wrote them.  And ``bench/report.py``'s reading of
that JSON: a call timed over a share of a workload stands for the whole."""

import json
import os

import pytest

from helpers import bench_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


@pytest.fixture(scope="module")
def run():
    return bench_module("run")


def test_every_layer_module_has_a_place_in_the_order(run):
    modules = sorted(n for n in os.listdir(BENCH) if n.startswith("test_") and n.endswith(".py"))
    layers = [run.layer_of(os.path.join(BENCH, n)) for n in modules]
    assert len(set(layers)) == len(layers), layers
    order = run.harness.LAYER_ORDER
    for layer in layers:
        assert layer in order, f"{layer} is not in harness.LAYER_ORDER"
    # The tf_keras step's LAYER is its child module's: read there as here.
    assert "tf_keras_step" in layers


def _part(layer, benchmarks, records, loadavg_start, loadavg_end):
    facts = {"cpu": "x", "loadavg_start": loadavg_start, "loadavg_end": loadavg_end,
             "wall_s": 1.0}
    return {"machine_info": {"layer": layer}, "version": "5",
            "benchmarks": [{"name": f"{layer}-{b}"} for b in benchmarks],
            "lossscale": {"facts": facts, "records": records}}


def test_join_keeps_every_layer_in_order(run):
    parts = [_part("core", ["a", "b"], {"skipped": ["no torch"]}, 0.1, 0.5),
             _part("fit", ["c"], {"fit_mlp": {"ours": True}, "skipped": ["no torch", "no hub"]},
                   0.5, 0.9),
             _part("memory", [], {"memory": [1, 2]}, 0.9, 1.3)]
    runs = {"core": {"wall_s": 1.0, "peak_rss_gib": 1.0, "exit": 0}}
    joined = run.join(parts, 12.34, runs)
    assert [b["name"] for b in joined["benchmarks"]] == ["core-a", "core-b", "fit-c"]
    assert joined["lossscale"]["records"] == {"skipped": ["no torch", "no hub"],
                                              "fit_mlp": {"ours": True}, "memory": [1, 2]}
    facts = joined["lossscale"]["facts"]
    assert (facts["loadavg_start"], facts["loadavg_end"]) == (0.1, 1.3)
    assert facts["wall_s"] == 12.3 and facts["layer_processes"] == runs
    assert joined["machine_info"] == {"layer": "core"}
    # The parts themselves are left as they were.
    assert [b["name"] for b in parts[0]["benchmarks"]] == ["core-a", "core-b"]
    assert parts[0]["lossscale"]["facts"]["loadavg_end"] == 0.5


@pytest.fixture(scope="module")
def report():
    return bench_module("report")


def test_a_call_over_a_share_of_the_workload_is_scaled_to_the_whole(report, tmp_path):
    # core_cached times a cut of the workload: a call over a quarter of it,
    # 4 calls a sample, stands for 4 times its time per call.
    def bench(peer, data, **extra):
        info = {"layer": "step", "case": "w/float32/adam", "threads": 2, "peer": peer,
                "rnd": 0, "calls_per_sample": 4, **extra}
        return {"extra_info": info, "stats": {"data": data}}

    raw = {"benchmarks": [bench("core_cached", [2.0, 4.0, 6.0], workload_share=0.25),
                          bench("core", [2.0, 4.0, 6.0])]}
    path = tmp_path / "raw.json"
    path.write_text(json.dumps(raw))
    _raw, stats, *_ = report.load(str(path))
    cached = stats[("step", "w/float32/adam", 2, "core_cached")]
    plain = stats[("step", "w/float32/adam", 2, "core")]
    assert cached.samples == [2.0, 4.0, 6.0] and cached.median == 4.0
    assert plain.samples == [0.5, 1.0, 1.5] and plain.median == 1.0


def test_cases_keeps_the_names_that_contain_a_part(run):
    settings = run.harness.Settings
    saved = dict(quick=settings.quick, threads=settings.threads, rounds=settings.rounds,
                 cases=settings.cases)
    names = ["resnet50/float32/adam", "bert_base/float32/adam", "bert_finetune/mixed_float16",
             "lstm/mixed_float16"]
    try:
        settings.configure(False, 2, 0, "bert,lstm")
        assert settings.cases == ("bert", "lstm")
        assert run.harness.wanted(names, settings) == names[1:]
        settings.configure(False, 2, 0, "resnet50/float32/adam,")
        assert run.harness.wanted(names, settings) == names[:1]
        settings.configure(False, 2, 0, "")
        assert settings.cases == () and run.harness.wanted(names, settings) == names
    finally:
        settings.configure(saved["quick"], saved["threads"], saved["rounds"],
                           ",".join(saved["cases"]))


def test_resume_keeps_only_the_layers_a_stopped_run_passed_and_kept(run, tmp_path):
    layers = tmp_path / "layers"
    layers.mkdir()
    out = tmp_path / "raw.json"
    assert run.finished(str(out), str(layers)) == ({}, 0.0)
    processes = {"core": {"wall_s": 60.0, "peak_rss_gib": 1.0, "exit": 0},
                 "check": {"wall_s": 5.0, "peak_rss_gib": 1.0, "exit": 5},
                 "fit": {"wall_s": 30.0, "peak_rss_gib": 2.0, "exit": 1},
                 "memory": {"wall_s": 9.0, "peak_rss_gib": 1.0, "exit": 0}}
    joined = run.join([_part("core", ["a"], {}, 0.1, 0.2)], 104.0, processes)
    out.write_text(json.dumps(joined))
    for layer in ("core", "check", "fit"):   # memory's own JSON is gone
        (layers / f"{layer}.json").write_text(json.dumps(_part(layer, [], {}, 0, 0)))
    done, wall_s = run.finished(str(out), str(layers))
    assert done == {"core": processes["core"], "check": processes["check"]}
    assert wall_s == 65.0   # the layers kept: a layer run again counts once
    out.write_text("{not json")
    assert run.finished(str(out), str(layers)) == ({}, 0.0)
