"""Runs the benchmark suite one layer at a time, each layer in a ``pytest``
process of its own, and joins the layers' raw JSON into one.

    python bench/run.py OUT.json [--resume] [pytest arguments ...]

A full run builds workloads of gigabytes, layer after layer: TensorFlow's
and torch's native caches keep part of what one layer used after its
workloads are dropped, so in one process a full run's resident size grows
from layer to layer until a 24 GB machine runs out.  A process per layer
gives every layer the whole machine.  After each layer the joined JSON is
written again, so a run that is stopped keeps every layer that finished;
``--resume`` (with the same pytest arguments) runs only the layers that it
did not finish and joins them to those it did.

Each layer's own JSON is kept beside ``OUT.json`` in ``layers/``.  The
``pytest`` arguments go to every layer (``-k core --threads 1``); a layer
that they leave without items is passed over (one collection of the whole
suite, first, says which).  The exit status is 0 when every layer passed.
"""

import ast
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402

NO_TESTS_COLLECTED = 5


def layer_of(path):
    """The ``LAYER`` a benchmark module declares (read, not imported: the
    modules import TensorFlow), or its name after ``test_``."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "LAYER"
                and isinstance(node.value, ast.Constant)):
            return node.value.value
    return os.path.basename(path)[len("test_"):-len(".py")]


def layer_modules(args):
    """``(layer, path)`` of every benchmark module with items that ``args``
    select, in the suite's order (one collection of the whole suite)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", HERE, "--collect-only", "-q",
                           "-p", "no:cacheprovider", *args],
                          cwd=harness.ROOT, capture_output=True, text=True)
    if proc.returncode not in (0, NO_TESTS_COLLECTED):
        sys.exit(f"bench/run.py: collecting the suite failed (exit {proc.returncode}):\n"
                 + (proc.stdout + proc.stderr)[-3000:])
    selected = {line.split("::", 1)[0] for line in proc.stdout.splitlines() if "::" in line}
    found = []
    for name in sorted(os.listdir(HERE)):
        path = os.path.join(HERE, name)
        if os.path.relpath(path, harness.ROOT) in selected:
            found.append((layer_of(path), path))
    return sorted(found, key=lambda lp: harness.layer_rank(lp[0]))


def join(parts, wall_s, runs):
    """One raw JSON from the layers' ``parts`` (in run order): every
    benchmark, every record (the skipped peers' lines merged), the machine
    facts of the first layer with the last one's end load, the whole run's
    wall time and ``runs``, each layer's process (wall time, peak resident
    size, exit status)."""
    joined = dict(parts[0], benchmarks=[])
    facts, records = dict(parts[0]["lossscale"]["facts"]), {}
    for part in parts:
        joined["benchmarks"].extend(part["benchmarks"])
        for key, value in part["lossscale"]["records"].items():
            if key == "skipped":
                seen = records.setdefault(key, [])
                seen.extend(line for line in value if line not in seen)
            else:
                records[key] = value
    facts["loadavg_end"] = parts[-1]["lossscale"]["facts"].get("loadavg_end")
    facts["wall_s"] = round(wall_s, 1)
    facts["layer_processes"] = runs
    joined["lossscale"] = {"facts": facts, "records": records}
    return joined


def finished(out, layers_dir):
    """What a stopped run left at ``out``: ``({layer: process}, wall_s)``,
    each layer whose process the joined JSON records as passed and whose own
    JSON is still in ``layers_dir``, and the seconds those layers took.
    Nothing, if there is no joined JSON."""
    try:
        with open(out) as f:
            facts = json.load(f)["lossscale"]["facts"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}, 0.0
    done = {layer: ran for layer, ran in facts.get("layer_processes", {}).items()
            if ran.get("exit") in (0, NO_TESTS_COLLECTED)
            and os.path.exists(os.path.join(layers_dir, f"{layer}.json"))}
    return done, sum(ran.get("wall_s", 0.0) for ran in done.values())


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        sys.exit(__doc__)
    out, args = os.path.abspath(argv[0]), argv[1:]
    resume = "--resume" in args
    args = [a for a in args if a != "--resume"]
    layers_dir = os.path.join(os.path.dirname(out), "layers")
    os.makedirs(layers_dir, exist_ok=True)
    done, wall_before = finished(out, layers_dir) if resume else ({}, 0.0)
    t0 = time.perf_counter() - wall_before
    parts, failed, runs = [], [], {}

    def save():
        with open(out, "w") as f:
            json.dump(join(parts, time.perf_counter() - t0, runs), f)

    for layer, path in layer_modules(args):
        part = os.path.join(layers_dir, f"{layer}.json")
        if layer in done:
            print(f"=== layer {layer}: kept from the stopped run", flush=True)
            runs[layer] = done[layer]
            with open(part) as f:
                parts.append(json.load(f))
            continue
        if os.path.exists(part):
            os.remove(part)
        print(f"=== layer {layer} ({time.strftime('%H:%M:%S')})", flush=True)
        t = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "pytest", path, "-q",
                                 "-p", "no:cacheprovider", "--benchmark-disable-gc",
                                 "--benchmark-quiet", f"--benchmark-json={part}", *args],
                                cwd=harness.ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
        # ru_maxrss: KiB, the largest of the layer's process and its children.
        ran = {"wall_s": round(time.perf_counter() - t, 1),
               "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2), "exit": rc}
        if done:
            ran["resumed"] = True
        print(f"=== layer {layer}: {ran['wall_s'] / 60:.1f} min, "
              f"peak resident {ran['peak_rss_gib']:.1f} GiB, exit {rc}", flush=True)
        runs[layer] = ran
        if rc not in (0, NO_TESTS_COLLECTED):
            failed.append(f"{layer} (exit {rc})")
        if os.path.exists(part):
            with open(part) as f:
                parts.append(json.load(f))
            save()
    if parts:
        save()  # kept layers after the last one run are joined too
    else:
        failed.append("no layer timed anything")
    if failed:
        print("bench/run.py: failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
