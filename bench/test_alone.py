"""Each peer in its own process: the optimizer step (``test_step.py``), the
recipe battery (``test_recipes.py``) and the tf_keras step
(``tf_keras_step_child.py``, its child with ``TF_USE_LEGACY_KERAS=1`` as
always) timed again with one peer per Python process.

Side by side in one process, another framework's threads distort the
timing of the peer running beside them (torch's OpenMP workers spin after
each op; TensorFlow's pools hold their threads), so every figure the report
leads with for the step and the recipes comes from here: each item starts
a child ``pytest`` that runs the same benchmark items of one layer, every
case, for one peer and one round alone, at the same thread count, and
hands back its samples.  A layer's children run round by round, the peers'
order rotated each round (``conftest.py``), as the side-by-side layers
interleave their peers: load that drifts on the machine over the minutes a
layer takes then lands on every peer alike, not on the one whose rounds
all ran while it lasted.  The child's benchmarks enter this run's raw JSON
under the layer ``"<layer>/alone"`` (``conftest.py``), so that the report
reads them as it reads any other.

Full runs only (a child pays TensorFlow's start-up and the workload's set-up
again: ``--quick`` has no time for it).  The children leave out the recipes'
and the tf_keras step's exactness locksteps, which need ours and stock in
one process: the side-by-side layers run them.  The 2,000-tensor step is
left out: it is the tracing benchmark, and tracing does not depend on the
process.
"""

import os

import harness
import test_recipes
import test_step
import tf_keras_step_child

LAYER = "alone"
HERE = os.path.dirname(os.path.abspath(__file__))
# The peers a user compares: stock Keras and torch's nearest equivalent;
# for the step, also the peers that split ours (test_step.SPLIT_PEERS).
# (``case`` of an item is the layer; its child runs all of the layer's cases.)
STEP_PEERS = ("ours", "stock", "torch_fused", "torch_foreach") + test_step.SPLIT_PEERS
RECIPE_PEERS = ("ours", "stock", "torch")
# The tf_keras step's goal is against tf_keras' own optimizer; its torch
# peers are the step layer's.
TF_KERAS_STEP_PEERS = ("ours", "stock")
CHILD_ROUNDS = 3
# A child is a fresh process for one round: before its first sample each
# method runs this long, so that the round is timed warm (TensorFlow's and
# the C library's allocators past their first growth, the caches and the
# producer settled), as the side-by-side layers' later rounds are.
WARMUP_S = 1.0


def _step_cases(settings):
    return [c for c in test_step.cases(settings) if not c.startswith("tiny_")]


def _recipe_cases(settings):
    return [f"{r.name}/{test_recipes.POLICY}" for r in test_recipes.recipes(settings)]


# layer -> (module, test function, its items, its cases, the peers timed
# alone, what the child's environment adds)
_LAYERS = {
    "step": ("test_step.py", "test_step", test_step.items, _step_cases, STEP_PEERS, {}),
    "recipes": ("test_recipes.py", "test_recipe", test_recipes.items, _recipe_cases,
                RECIPE_PEERS, {}),
    "tf_keras_step": ("tf_keras_step_child.py", "test_tf_keras_step", tf_keras_step_child.items,
                      tf_keras_step_child.cases, TF_KERAS_STEP_PEERS, tf_keras_step_child.ENV),
}


def items(settings):
    """One item per (layer, peer), and per round (``ROUNDS``): its child
    runs every case of the layer for that peer and round."""
    if settings.quick:
        return []
    pairs = [("step", p) for p in STEP_PEERS if p in test_step.peers()]
    pairs += [("recipes", p) for p in RECIPE_PEERS]
    pairs += [("tf_keras_step", p) for p in TF_KERAS_STEP_PEERS]
    # A layer whose cases --cases leaves out has no child to start.
    return [(layer, p) for layer, p in pairs if node_ids(layer, p, settings, 0)]


def ROUNDS(settings):
    return min(CHILD_ROUNDS, settings.rounds)


def node_ids(layer, peer, settings, rnd):
    """The child's items: every case of ``layer`` for ``peer``, in round ``rnd``."""
    module, function, layer_items, cases, _peers, _env = _LAYERS[layer]
    have = set(layer_items(settings))
    return [f"{os.path.join(HERE, module)}::{function}[{case}-{peer}-r{rnd}]"
            for case in cases(settings) if (case, peer) in have]


def run_child(layer, peer, rnd, settings):
    """The child's benchmarks (pytest-benchmark's JSON entries), layer renamed."""
    # The child's items keep their round's index (``-r<rnd>``), by which the
    # report pairs the peers; ``--rounds`` makes that index exist there.
    benchmarks = harness.child_benchmarks(f"{layer} {peer} round {rnd}",
                                          node_ids(layer, peer, settings, rnd), settings,
                                          ROUNDS(settings), _LAYERS[layer][5], WARMUP_S)
    for b in benchmarks:
        b["extra_info"]["layer"] = f"{layer}/alone"
        b["name"] = f"alone:{b['name']}"
    return benchmarks


def test_alone(case, peer, rnd):
    benchmarks = run_child(case, peer, rnd, harness.Settings)
    assert benchmarks, f"the child for {case} {peer} round {rnd} timed nothing"
    harness.CHILD_BENCHMARKS.extend(benchmarks)
