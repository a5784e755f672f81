"""Peak memory of one loss-scale step on one big float32 gradient (1 GiB;
64 MiB in the quick run), each method in its own process
(``memory_child.py``; the quick run skips Keras 3's order and the
gradient passed in, and runs its processes side by side), the gradient's
own memory (the ``producer`` run) taken off.  Stored in the raw JSON
(``lossscale.records.memory``) as bytes and as a fraction of the gradient:
the fused op writes over a gradient made in the step and adds nothing; the
stock composite adds an ``is_finite`` temporary, or a whole copy when it
divides before it can drop the input.
"""

import json
import os
import subprocess
import sys

import pytest

import harness
import workloads

LAYER = "memory"
HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ["native", "composite", "composite_check_first"]


def _added(runs, values, at_once):
    """``{(method, situation): bytes added}``, each run in its own child
    process, ``at_once`` of them at a time.  Each child's peak is its own, so
    running them side by side changes no result, only the wall time (most of
    which is each child importing TensorFlow)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [harness.ROOT, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    out = {}
    for i in range(0, len(runs), at_once):
        children = {run: subprocess.Popen(
            [sys.executable, os.path.join(HERE, "memory_child.py"), *run, str(values)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            cwd=harness.ROOT) for run in runs[i:i + at_once]}
        for (method, situation), child in children.items():
            stdout, stderr = child.communicate()
            if child.returncode != 0:
                raise RuntimeError(f"memory child {method}/{situation} failed:\n"
                                   f"{stderr[-3000:]}")
            out[(method, situation)] = json.loads(stdout.strip().splitlines()[-1])["added_bytes"]
    return out


def test_peak_memory():
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("peak-memory measurement skipped: needs Linux /proc/self/clear_refs")
    quick = harness.Settings.quick
    nbytes = (64 << 20) if quick else workloads.GIB
    values = nbytes // 4
    situations = ["inside"] if quick else ["inside", "argument"]
    methods = METHODS[:2] if quick else METHODS
    runs = [(m, s) for s in situations for m in (["producer"] if s == "inside" else []) + methods]
    # The quick run's children (64 MiB each) run side by side; the full run's
    # take several GiB each, one at a time.
    added = _added(runs, values, at_once=len(runs) if quick else 1)
    out = {"gradient_bytes": nbytes, "situations": {}}
    for situation in situations:
        base = added[("producer", situation)] if situation == "inside" else 0
        rows = {}
        for m in methods:
            a = added[(m, situation)] - base
            rows[m] = {"added_bytes": a, "fraction_of_gradient": a / nbytes}
        rows["producer_bytes"] = base
        out["situations"][situation] = rows
    harness.record("memory", out)
    inside = out["situations"]["inside"]
    assert inside["native"]["fraction_of_gradient"] < 0.05, inside
