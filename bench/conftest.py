"""pytest set-up of the benchmark suite: options, thread pinning, machine
facts, the order in which items run, and a progress line.

Every benchmark module declares ``LAYER`` and ``items(settings)``, a list of
``(workload, peer)`` pairs; the hooks here parametrize its test with those
pairs, the thread counts (``threads``, or the module's ``THREADS(settings)``)
and the round index (``rnd``, up to the module's ``ROUNDS(settings)`` where
it has one), and
then order all items so that one workload is measured at a time, round by
round, with every peer of that workload inside each round (in an order
rotated from round to round).  Timings of the peers of one workload are
thus interleaved, and a change of machine load hits all of them alike.

    pytest bench --benchmark-json=bench/results/raw.json           # full run
    pytest bench --quick ...            # or LOSSSCALE_BENCH_QUICK=1: a small subset
"""

import os
import sys
import time
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402


def pytest_addoption(parser):
    group = parser.getgroup("lossscale benchmarks")
    group.addoption("--quick", action="store_true",
                    default=os.environ.get("LOSSSCALE_BENCH_QUICK", "") not in ("", "0"),
                    help="a small subset, the one CI runs (also LOSSSCALE_BENCH_QUICK=1)")
    group.addoption("--threads", type=int, default=0,
                    help="threads for every implementation (default: the cores available)")
    group.addoption("--rounds", type=int, default=0,
                    help="interleaved rounds per workload (default: 5; 2 with --quick)")
    group.addoption("--warmup-s", type=float, default=0.0,
                    help="seconds each method runs, after its first two calls, before its "
                         "first sample (test_alone.py's children, a process per round, "
                         "pass it)")
    group.addoption("--cases", default="",
                    help="comma-separated parts of case names: the step, recipe and tf_keras "
                         "step layers, and their own-process children, run only the cases "
                         "whose names contain one (--cases bert_finetune,resnet50/float32/adam)")


def pytest_configure(config):
    threads = config.getoption("--threads") or harness.machine_threads()
    harness.Settings.configure(config.getoption("--quick"), threads,
                               config.getoption("--rounds"), config.getoption("--cases"),
                               config.getoption("--warmup-s"))
    # TensorFlow's pools are sized once, before its first op.
    harness.tensorflow()
    harness.pin_threads(threads)
    config._lossscale_facts = harness.machine_facts()
    # A layer that times nothing in this process gets its JSON from
    # pytest_sessionfinish below, so pytest-benchmark's warning is wrong here.
    warnings.filterwarnings("ignore", "Not saving anything, no benchmarks have been run")
    config._lossscale_t0 = time.perf_counter()


def pytest_collection_finish(session):
    # The run order, after every plugin's deselection.
    session.config._lossscale_items = list(session.items)
    # Printed here rather than as pytest's header, which -q hides.
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        for line in harness.facts_lines(session.config._lossscale_facts):
            tr.write_line(line)
        tr.write_line(f"{len(session.items)} benchmark items")


def pytest_generate_tests(metafunc):
    module = metafunc.module
    names = metafunc.fixturenames
    if "case" in names and "peer" in names:
        pairs = module.items(harness.Settings)
        metafunc.parametrize("case,peer", pairs, ids=[f"{c}-{p}" for c, p in pairs])
    if "threads" in names:
        ts = getattr(module, "THREADS", None)
        ts = ts(harness.Settings) if ts else (harness.Settings.threads,)
        metafunc.parametrize("threads", ts, ids=[f"t{t}" for t in ts])
    if "rnd" in names:
        rounds = getattr(module, "ROUNDS", None)
        n = rounds(harness.Settings) if rounds else harness.Settings.rounds
        metafunc.parametrize("rnd", range(n), ids=[f"r{r}" for r in range(n)])


def _layer(item):
    return getattr(item.module, "LAYER", item.module.__name__)


def _group(item):
    """The items that share one workload's data: (layer, workload, threads)."""
    p = getattr(item, "callspec", None)
    p = p.params if p else {}
    return (_layer(item), p.get("case", item.name), p.get("threads", harness.Settings.threads))


def pytest_collection_modifyitems(session, config, items):
    peer_rank = {}
    case_rank = {}
    for i, item in enumerate(items):
        p = getattr(item, "callspec", None)
        p = p.params if p else {}
        if "peer" in p:
            peers = peer_rank.setdefault(_layer(item), {})
            peers.setdefault(p["peer"], len(peers))
        case_rank.setdefault((_layer(item), p.get("case", item.name)), i)

    def key(item):
        layer, case, threads = _group(item)
        p = getattr(item, "callspec", None)
        p = p.params if p else {}
        rnd = p.get("rnd", 0)
        peers = peer_rank.get(layer, {})
        turn = (peers.get(p.get("peer"), 0) + rnd) % max(1, len(peers))
        return (harness.layer_rank(layer), case_rank[(layer, case)], threads, rnd, turn)

    items.sort(key=key)


# ------------------------------------------------------------ progress


def pytest_report_teststatus(report, config):
    # The progress line below replaces pytest's dot per item.
    if report.when == "call" and report.passed:
        return "passed", "", "PASSED"


def _summary(config, group):
    """'peer median' for the benchmarks of one finished workload group, this
    process's and its children's."""
    bs = getattr(config, "_benchmarksession", None)
    if bs is None:
        return ""
    timed = [(b.extra_info, b.stats.data) for b in bs.benchmarks]
    timed += [(b["extra_info"], b["stats"]["data"]) for b in harness.CHILD_BENCHMARKS]
    per_peer = {}
    for info, data in timed:
        if (info.get("layer"), info.get("case"), info.get("threads")) != group:
            continue
        calls = info.get("calls_per_sample", 1) * info.get("steps_per_call", 1)
        per_peer.setdefault(info.get("peer"), []).extend(s / calls for s in data)
    parts = []
    for peer, xs in per_peer.items():
        xs.sort()
        m = xs[len(xs) // 2]
        parts.append(f"{peer} {m * 1e3:.3f} ms" if m >= 1e-4 else f"{peer} {m * 1e6:.1f} us")
    return ", ".join(parts)


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.skipped and report.when in ("setup", "call"):
        # A peer that is not installed is skipped with a line saying so;
        # the report repeats it.
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        skipped = harness.RECORDS.setdefault("skipped", [])
        if reason not in skipped:
            skipped.append(reason)
    if report.when != "teardown":
        return
    config = _CONFIG[0]
    items = getattr(config, "_lossscale_items", None)
    if not items:
        return
    done = config._lossscale_done = getattr(config, "_lossscale_done", 0) + 1
    item = items[done - 1] if done <= len(items) else None
    if item is None or item.nodeid != report.nodeid:
        return
    group = _group(item)
    last = done == len(items) or _group(items[done]) != group
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or not last:
        return
    elapsed = time.perf_counter() - config._lossscale_t0
    layer, case, threads = group
    label = f"{layer} {case} threads={threads}"
    summary = _summary(config, group)
    tr.write_line(f"[{done:4d}/{len(items)} {100 * done // len(items):3d}% "
                  f"{int(elapsed) // 60:2d}:{int(elapsed) % 60:02d}] {label}"
                  + (f": {summary}" if summary else ""))


_CONFIG = []


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _CONFIG.append(session.config)


# ------------------------------------------------------------ raw JSON


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["lossscale"] = config._lossscale_facts


def pytest_benchmark_update_json(config, benchmarks, output_json):
    facts = dict(config._lossscale_facts, loadavg_end=harness.load_average(),
                 wall_s=round(time.perf_counter() - config._lossscale_t0, 1))
    output_json["lossscale"] = {"facts": facts, "records": harness.RECORDS}
    output_json["benchmarks"].extend(harness.CHILD_BENCHMARKS)


def pytest_sessionfinish(session):
    """pytest-benchmark writes no JSON for a run that timed nothing in this
    process; a layer whose results are its children's benchmarks or its
    records alone (the tf_keras step, the peers alone, memory, the training
    run, a layer run on its own by ``run.py``) still gets one."""
    config = session.config
    bs = getattr(config, "_benchmarksession", None)
    if (bs is None or not bs.json or bs.benchmarks
            or not (harness.CHILD_BENCHMARKS or harness.RECORDS)):
        return
    commit_info = config.hook.pytest_benchmark_generate_commit_info(config=config)
    output_json = config.hook.pytest_benchmark_generate_json(
        config=config, benchmarks=[], include_data=True,
        machine_info=bs.get_machine_info(), commit_info=commit_info)
    config.hook.pytest_benchmark_update_json(config=config, benchmarks=[],
                                             output_json=output_json)
    bs.save_json(output_json)
