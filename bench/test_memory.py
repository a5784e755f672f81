"""Peak memory of one loss-scale step on one big float32 gradient (1 GiB;
64 MiB in the quick run), each method in its own process
(``memory_child.py``; the quick run skips Keras 3's order and the
gradient passed in), the gradient's own memory (the ``producer`` run)
taken off.  Stored in the raw JSON (``lossscale.records.memory``) as bytes
and as a fraction of the gradient: the fused op writes over a gradient made
in the step and adds nothing; the stock composite adds an ``is_finite``
temporary, or a whole copy when it divides before it can drop the input.
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


def _added(method, situation, values):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [harness.ROOT, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    done = subprocess.run([sys.executable, os.path.join(HERE, "memory_child.py"), method,
                           situation, str(values)], capture_output=True, text=True, env=env,
                          cwd=harness.ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"memory child {method}/{situation} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["added_bytes"]


def test_peak_memory():
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("peak-memory measurement skipped: needs Linux /proc/self/clear_refs")
    quick = harness.Settings.quick
    nbytes = (64 << 20) if quick else workloads.GIB
    values = nbytes // 4
    situations = ["inside"] if quick else ["inside", "argument"]
    methods = METHODS[:2] if quick else METHODS
    out = {"gradient_bytes": nbytes, "situations": {}}
    for situation in situations:
        base = _added("producer", situation, values) if situation == "inside" else 0
        rows = {}
        for m in methods:
            added = _added(m, situation, values) - base
            rows[m] = {"added_bytes": added, "fraction_of_gradient": added / nbytes}
        rows["producer_bytes"] = base
        out["situations"][situation] = rows
    harness.record("memory", out)
    inside = out["situations"]["inside"]
    assert inside["native"]["fraction_of_gradient"] < 0.05, inside
