"""The step under tf.distribute strategies, ours against stock Keras'
loss-scale optimizer, each run in its own processes
(``distributed_child.py``: a strategy fixes TensorFlow's devices or its
cluster when it starts):

* ``MirroredStrategy`` over two logical CPUs: a mixed_float16 MLP of three
  2,048-wide ReLU layers with Adam, global batch 16; the whole custom-loop
  step, the forward and backward pass alone, and the strategy's all-reduce
  of the gradient list alone, whose share of the step is reported;
* ``MultiWorkerMirroredStrategy`` with 1, 2 and 4 worker processes on
  127.0.0.1 (gRPC, CPU collectives), the same model: each worker's step,
  split into the collective (the all-reduce alone) and the update (what the
  step adds to the pass and the collective: check, unscale, scale update,
  the optimizer's update).  The workers share this machine's cores, so the
  split says where a step goes, not how a cluster scales.

Stored in the raw JSON (``lossscale.records.distributed``), seconds per
step; before timing, fresh models trained with ours and with stock must
end bit-identical.  The quick run takes a 256-wide MLP, one sample and no
workers (it shows that the benchmark works; its times are not to be read).
"""

import json
import os
import socket
import subprocess
import sys

import pytest

import harness

LAYER = "distributed"
HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = (1, 2, 4)
TIMEOUT_S = 600


def _shape():
    """(width, layers, global batch, samples, calls per sample)."""
    return (256, 3, 16, 1, 2) if harness.Settings.quick else (2048, 3, 16, 5, 5)


def _env(tf_config=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [harness.ROOT, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["CUDA_VISIBLE_DEVICES"] = ""
    # gRPC would send the loopback connections through a proxy.
    for name in ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy"):
        env.pop(name, None)
        env.pop(name.upper(), None)
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return env


def _start(mode, tf_configs):
    """One child per TF_CONFIG (None: no cluster), all started together."""
    args = [sys.executable, os.path.join(HERE, "distributed_child.py"), mode,
            *map(str, _shape())]
    return [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=_env(c), cwd=harness.ROOT) for c in tf_configs]


def _collect(children):
    """The JSON line of each child."""
    out = []
    try:
        for child in children:
            stdout, stderr = child.communicate(timeout=TIMEOUT_S)
            if child.returncode != 0:
                raise RuntimeError(f"distributed child failed:\n{stderr[-3000:]}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return out


def _cluster(n):
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    return [{"cluster": cluster, "task": {"type": "worker", "index": i}} for i in range(n)]


def _check(report):
    assert report["identical"], f"{report['mode']}: ours and stock differ after the checked steps"
    assert report["path"].startswith("fused ("), report["path"]


def test_mirrored_two_replicas():
    (report,) = _collect(_start("mirrored", [None]))
    _check(report)
    for peer in ("ours", "stock"):
        s = report["seconds"][peer]
        s["all_reduce_share"] = s["all_reduce"] / s["step"]
    seconds = report["seconds"]
    report["ours_vs_stock"] = seconds["stock"]["step"] / seconds["ours"]["step"]
    harness.RECORDS.setdefault("distributed", {})["mirrored"] = report


def test_multi_worker():
    if harness.Settings.quick:
        pytest.skip("multi-worker step: full runs only (its workers' start-up is the quick "
                    "run's longest item)")
    runs = {n: _collect(_start("worker", _cluster(n))) for n in WORKERS}
    out = {}
    for n, reports in runs.items():
        for r in reports:
            _check(r)
        assert sorted(r["task"] for r in reports) == list(range(n))
        # The slowest worker sets the step time; its split is reported.
        slowest = max(reports, key=lambda r: r["seconds"]["ours"]["step"])
        out[str(n)] = {"replicas": slowest["replicas"], "params": slowest["params"],
                       "seconds": slowest["seconds"],
                       "ours_vs_stock": slowest["seconds"]["stock"]["step"]
                       / slowest["seconds"]["ours"]["step"]}
    harness.RECORDS.setdefault("distributed", {})["workers"] = out
