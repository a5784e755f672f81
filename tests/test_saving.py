"""Saved models: ``.keras`` files of models with ``lossscale.Policy`` layers
and our optimizer load back with their loss-scale state, and load where
``lossscale`` cannot be imported at all (a subprocess whose import system
refuses it), with plain Keras policies.

Oracles: the state and predictions recorded before saving, and training the
original and the reloaded model one more epoch side by side (same bits).
"""

import json
import os
import subprocess
import sys
import textwrap
import zipfile

import keras
import numpy as np
import pytest

import lossscale
from lossscale import loss_scale as loss_scale_module
from lossscale.optimizer import LossScaleOptimizer
from lossscale.policy import Policy

OVERFLOW_STEPS = (1, 4, 5, 9)
N = 12


def _data(overflow=True):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = rng.normal(size=(N, 2)).astype("float32")
    if overflow:
        y[list(OVERFLOW_STEPS)] = np.inf
    return x, y


def _model(model_policy):
    """Layers with our policies (loss scales included); the model's own
    policy -- the global one at construction -- is ``model_policy``."""
    keras.mixed_precision.set_global_policy(model_policy)
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(
        6, activation="relu", name="hidden",
        dtype=Policy("mixed_float16", loss_scale=loss_scale_module.DynamicLossScale(
            initial_loss_scale=64, increment_period=5)))(inputs)
    outputs = keras.layers.Dense(2, name="out", dtype=Policy("float32", loss_scale=None))(hidden)
    return keras.Model(inputs, outputs)


def _optimizer_state(optimizer):
    state = {"iterations": int(optimizer.iterations), "class": type(optimizer).__name__}
    if getattr(optimizer, "loss_scale_object", None) is not None:
        ls = optimizer.loss_scale_object
        state.update(current_loss_scale=float(ls()),
                     good_steps=int(ls._num_good_steps),  # pylint: disable=protected-access
                     skipped_steps=int(ls.skipped_steps))
    else:
        state.update(dynamic_scale=float(optimizer.dynamic_scale),
                     step_counter=int(optimizer.step_counter))
    return state



@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Three trained models saved as .keras, with what they held when saved."""
    before = keras.mixed_precision.global_policy()
    folder = tmp_path_factory.mktemp("saved")
    x, y = _data()
    cases = {
        # Ours, Keras's rule, passed explicitly.
        "explicit": lambda: LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0**10,
                                               dynamic_growth_steps=3),
        # Ours following a DynamicLossScale with its extensions.
        "object": lambda: LossScaleOptimizer(
            keras.optimizers.SGD(0.05), loss_scale=loss_scale_module.DynamicLossScale(
                initial_loss_scale=2**10, increment_period=3, count_skipped_steps=True)),
        # A plain optimizer that the patched compile wraps (mixed_float16).
        "patched": lambda: keras.optimizers.SGD(0.05),
    }
    out = {"folder": folder, "models": {}, "records": {}}
    try:
        for name, make in cases.items():
            if name == "patched":
                lossscale.patch_keras()
            model = _model("mixed_float16")
            model.compile(optimizer=make(), loss="mse")
            lossscale.unpatch_keras()
            assert type(model.optimizer) is LossScaleOptimizer
            model.fit(x, y, batch_size=1, shuffle=False, verbose=0)
            path = folder / f"{name}.keras"
            model.save(path)
            out["models"][name] = model
            out["records"][name] = {
                "path": str(path),
                "optimizer": _optimizer_state(model.optimizer),
                "predictions": model.predict(x, verbose=0).tolist(),
            }
    finally:
        lossscale.unpatch_keras()
        keras.mixed_precision.set_global_policy(before)
    return out


@pytest.fixture(autouse=True)
def _restore_global_policy():
    before = keras.mixed_precision.global_policy()
    yield
    lossscale.unpatch_keras()
    keras.mixed_precision.set_global_policy(before)


def test_saved_state_is_not_trivial(saved):
    explicit = saved["records"]["explicit"]["optimizer"]
    assert explicit["dynamic_scale"] < 2.0**10 and explicit["iterations"] < N
    obj = saved["records"]["object"]["optimizer"]
    assert obj["skipped_steps"] == len(OVERFLOW_STEPS)
    assert obj["iterations"] == N - len(OVERFLOW_STEPS)


def test_saved_file_holds_plain_policies(saved):
    for record in saved["records"].values():
        with zipfile.ZipFile(record["path"]) as archive:
            config = json.loads(archive.read("config.json"))
        layers = {layer["name"]: layer["config"]["dtype"] for layer in config["config"]["layers"]}
        for name, policy in (("hidden", "mixed_float16"), ("out", "float32")):
            assert layers[name] == keras.saving.serialize_keras_object(keras.DTypePolicy(policy))


@pytest.mark.parametrize("name", ["explicit", "object"])
def test_loads_back_with_its_loss_scale_state(saved, name):
    record = saved["records"][name]
    model = keras.models.load_model(
        record["path"], custom_objects={"lossscale>LossScaleOptimizer": LossScaleOptimizer})
    assert type(model.optimizer) is LossScaleOptimizer
    assert _optimizer_state(model.optimizer) == record["optimizer"]
    if name == "object":
        assert (model.optimizer.loss_scale_object.get_config()
                == saved["models"][name].optimizer.loss_scale_object.get_config())
    # The loss scales of the layers' policies are dropped; the dtypes stay.
    policies = {layer.name: layer.dtype_policy for layer in model.layers[1:]}
    assert policies == {"hidden": keras.DTypePolicy("mixed_float16"),
                        "out": keras.DTypePolicy("float32")}
    np.testing.assert_array_equal(model.predict(_data()[0], verbose=0),
                                  np.array(record["predictions"], dtype="float32"))


def test_reloaded_model_trains_on_as_the_original(saved):
    record = saved["records"]["explicit"]
    loaded = keras.models.load_model(record["path"])
    original = saved["models"]["explicit"]
    x, y = _data()
    for model in (original, loaded):
        model.fit(x[:6], y[:6], batch_size=1, shuffle=False, verbose=0)
    assert _optimizer_state(loaded.optimizer) == _optimizer_state(original.optimizer)
    for a, b in zip(loaded.weights, original.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_patched_model_reloads_through_the_patch(saved):
    record = saved["records"]["patched"]
    keras.mixed_precision.set_global_policy("mixed_float16")
    lossscale.patch_keras()
    model = keras.models.load_model(record["path"])
    assert type(model.optimizer) is LossScaleOptimizer
    assert _optimizer_state(model.optimizer) == record["optimizer"]


# ----------------------------------------------------------------------
# Where lossscale is not installed

_WITHOUT_LOSSSCALE = textwrap.dedent("""
    import importlib.abc, json, sys, warnings

    class NoLossscale(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "lossscale" or name.startswith("lossscale."):
                raise ImportError("lossscale is not installed here")
            return None

    sys.meta_path.insert(0, NoLossscale())
    try:
        import lossscale
    except ImportError:
        pass
    else:
        raise SystemExit("lossscale was importable")

    import keras
    import numpy as np

    records = json.load(open(sys.argv[1]))
    x = np.array(records.pop("x"), dtype="float32")
    results = {}
    for name, record in records.items():
        result = results[name] = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = keras.models.load_model(record["path"], compile=False)
        result["warnings"] = [str(w.message) for w in caught]
        result["policies"] = {layer.name: [type(layer.dtype_policy).__name__,
                                           type(layer.dtype_policy).__module__,
                                           layer.dtype_policy.name]
                              for layer in model.layers[1:]}
        result["same_predictions"] = bool(np.array_equal(
            model.predict(x, verbose=0), np.array(record["predictions"], dtype="float32")))

        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            model = keras.models.load_model(record["path"])
        except Exception as e:  # reported, judged by the test
            result["compiled"] = {"error": f"{type(e).__name__}: {e}"}
        else:
            opt = model.optimizer
            result["compiled"] = {
                "class": f"{type(opt).__module__}.{type(opt).__name__}",
                "dynamic_scale": float(opt.dynamic_scale),
                "step_counter": int(opt.step_counter),
                "iterations": int(opt.iterations),
            }
        keras.mixed_precision.set_global_policy("float32")
    print("RESULTS" + json.dumps(results))
""")


def test_loads_where_lossscale_cannot_be_imported(saved, tmp_path):
    records = {name: {"path": r["path"], "predictions": r["predictions"]}
               for name, r in saved["records"].items()}
    records["x"] = _data()[0].tolist()
    (tmp_path / "records.json").write_text(json.dumps(records))
    script = tmp_path / "load_without_lossscale.py"
    script.write_text(_WITHOUT_LOSSSCALE)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "records.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULTS")][-1]
    results = json.loads(line[len("RESULTS"):])

    for name, result in results.items():
        # compile=False: the architecture and weights, with plain policies.
        assert result["policies"] == {
            "hidden": ["DTypePolicy", "keras.src.dtype_policies.dtype_policy", "mixed_float16"],
            "out": ["DTypePolicy", "keras.src.dtype_policies.dtype_policy", "float32"]}, name
        assert result["same_predictions"], name
        assert not result["warnings"], (name, result["warnings"])

    # Compiled by the patch: the compile config holds the plain optimizer, as
    # stock Keras's does, so stock Keras recompiles it with its own
    # LossScaleOptimizer -- same variables, so the same state.
    saved_state = saved["records"]["patched"]["optimizer"]
    assert results["patched"]["compiled"] == {
        "class": "keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer",
        **{k: saved_state[k] for k in ("dynamic_scale", "step_counter", "iterations")}}

    # Compiled with our optimizer explicitly: Keras cannot rebuild a class it
    # cannot import; it must say so (never load something else silently).
    for name in ("explicit", "object"):
        compiled = results[name]["compiled"]
        assert "error" in compiled and "LossScaleOptimizer" in compiled["error"], compiled
