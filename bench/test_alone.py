"""Each peer in its own process: the optimizer step (``test_step.py``) and the
recipe battery (``test_recipes.py``) timed again with one peer per Python
process.

Side by side in one process, another framework's threads distort the
timing of the peer running beside them (torch's OpenMP workers spin after
each op; TensorFlow's pools hold their threads), so every figure the report
leads with for the step and the recipes comes from here: each item starts
a child ``pytest`` that runs the same benchmark items of one layer, every
case and round, for one peer alone, at the same thread count, and hands
back its samples.  The
child's benchmarks enter this run's raw JSON under the layer
``"<layer>/alone"`` (``conftest.py``), so that the report reads them as it
reads any other.

Full runs only (a child pays TensorFlow's start-up and the workload's set-up
again: ``--quick`` has no time for it).  The 2,000-tensor step is left out:
it is the tracing benchmark, and tracing does not depend on the process.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import harness
import test_recipes
import test_step

LAYER = "alone"
HERE = os.path.dirname(os.path.abspath(__file__))
# The peers a user compares: stock Keras and torch's nearest equivalent.
# (``case`` of an item is the layer; its child runs all of the layer's cases.)
STEP_PEERS = ("ours", "stock", "torch_fused", "torch_foreach")
RECIPE_PEERS = ("ours", "stock", "torch")
CHILD_ROUNDS = 3
CHILD_TIMEOUT_S = 1800


def _step_cases(settings):
    return [c for c in test_step.cases(settings) if not c.startswith("tiny_")]


def _recipe_cases(settings):
    return [f"{r.name}/{test_recipes.POLICY}" for r in test_recipes.recipes(settings)]


# layer -> (module, test function, its cases, the peers timed alone)
_LAYERS = {
    "step": ("test_step.py", "test_step", _step_cases, STEP_PEERS),
    "recipes": ("test_recipes.py", "test_recipe", _recipe_cases, RECIPE_PEERS),
}


def items(settings):
    """One item per (layer, peer): its child runs every case of the layer
    for that peer."""
    if settings.quick:
        return []
    pairs = [("step", p) for p in STEP_PEERS if p in test_step.peers()]
    pairs += [("recipes", p) for p in RECIPE_PEERS]
    return pairs


def child_rounds(settings):
    return min(CHILD_ROUNDS, settings.rounds)


def node_ids(layer, peer, settings):
    module, function, cases, _peers = _LAYERS[layer]
    have = {(c, p) for c, p in (test_step.items(settings) if layer == "step"
                                else test_recipes.items(settings))}
    return [f"{os.path.join(HERE, module)}::{function}[{case}-{peer}-r{r}]"
            for case in cases(settings) if (case, peer) in have
            for r in range(child_rounds(settings))]


def run_child(layer, peer, settings):
    """The child's benchmarks (pytest-benchmark's JSON entries), layer renamed."""
    rounds = child_rounds(settings)
    nodes = node_ids(layer, peer, settings)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "child.json")
        cmd = [sys.executable, "-m", "pytest", *nodes, "-q",
               "-p", "no:cacheprovider", f"--threads={settings.threads}",
               f"--rounds={rounds}", "--benchmark-disable-gc", f"--benchmark-json={out}"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=os.path.dirname(HERE), capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise AssertionError(f"the child for {layer} {peer} failed "
                                 f"(exit {proc.returncode}):\n{tail}")
        with open(out) as f:
            benchmarks = json.load(f)["benchmarks"]
    for b in benchmarks:
        b["extra_info"]["layer"] = f"{layer}/alone"
        b["extra_info"]["child_wall_s"] = round(wall, 1)
        b["name"] = f"alone:{b['name']}"
    return benchmarks


def test_alone(case, peer):
    benchmarks = run_child(case, peer, harness.Settings)
    assert benchmarks, f"the child for {case} {peer} timed nothing"
    harness.CHILD_BENCHMARKS.extend(benchmarks)
