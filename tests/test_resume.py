"""Kill and resume: a training process killed at a random step ends, once
restarted from its last checkpoint, exactly where an uninterrupted run ends.

The training process is this file run as a script, in two phases:

1. ``Model.fit`` of two small mixed_float16 models with
   ``keras.callbacks.BackupAndRestore`` (a backup at the end of every
   epoch): one with ``lossscale.LossScaleOptimizer`` (the Keras 3 rule), one
   with a ``DynamicLossScale`` with hysteresis, a floor and a skipped-step
   counter, so that the extension state is in the backups.
2. A custom loop over four copies of the model in lockstep, one per
   loss-scale path:

   * ``keras``: ``lossscale.LossScaleOptimizer`` (the Keras 3 rule),
   * ``stock``: ``keras.optimizers.LossScaleOptimizer``, the oracle of ``keras``,
   * ``tf24``: TensorFlow 2.4's custom loop on ``lossscale.experimental``,
     whose skipped steps advance ``iterations``,
   * ``extensions``: ``DynamicLossScale`` with its extensions,

   every ``EVERY`` steps saving the models, the optimizers (loss-scale state
   included) and the step number with ``tf.train.CheckpointManager``, and on
   start restoring the latest checkpoint strictly (``assert_consumed``).

Batches are a function of the step number alone, with overflow at known
steps (single ones and runs).  The process prints a digest of every variable
after every batch and step.

The test runs it once uninterrupted, and once killed (SIGKILL) three times:
between two batches of ``fit``, at a step of the custom loop, and right as
it writes a checkpoint (killed as soon as the checkpoint's first file
appears).  Every restart must resume from the last complete backup or
checkpoint, every batch and step it redoes must reproduce the uninterrupted
run's digest, and the final state must be bit-identical to the
uninterrupted run's.  The kill points come from a seeded generator and are
printed.
"""

import hashlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from helpers import child_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

STEPS = 112
EVERY = 7  # not a multiple of the growth period: counters are mid-way at saves
SEED = 20261130
LINE_TIMEOUT = 180.0  # seconds to wait for the next progress line (TensorFlow's import included)


def overflow_factor(i):
    """The loss factor of step i: runs of 12 overflows, single ones, float16 overflow."""
    if 40 <= i % 70 < 52:
        return (np.inf, np.nan, -np.inf)[i % 3]
    if i % 11 == 4:
        return np.inf
    if i % 13 == 9:
        return 1e30  # finite float32 loss; its gradient overflows float16
    return 1.0


def batch(i):
    rng = np.random.default_rng([SEED, i])
    x = rng.standard_normal((16, 6)).astype(np.float32)
    return x, np.tanh(x[:, :1] - 0.5 * x[:, 1:2]).astype(np.float32)


FIT_MODELS = ("fit_keras", "fit_object")
FIT_EPOCHS, FIT_BATCH, FIT_BATCHES = 3, 8, 12


def fit_data():
    """One epoch of fit's data: 12 batches, five of them with an inf sample,
    four of those in a row, so every epoch has skipped steps."""
    x, y = zip(*(batch(1000 + i) for i in range(FIT_BATCHES * FIT_BATCH // 16)))
    x, y = np.concatenate(x), np.concatenate(y)
    for b in (2, 6, 7, 8, 9):
        x[b * FIT_BATCH + 3, b % 6] = np.inf
    return x, y


def fit_progress_class():
    import keras

    class FitProgress(keras.callbacks.Callback):
        """Prints where fit starts and a digest after every batch; waits to be
        killed at the batch named by ``TRAINER_PAUSE_AT`` ("name epoch batch")."""

        def __init__(self, name, digest_of):
            super().__init__()
            self.name, self.digest_of = name, digest_of
            self.epoch, self.started = None, False
            self.pause_at = os.environ.get("TRAINER_PAUSE_AT")

        def on_epoch_begin(self, epoch, logs=None):
            if not self.started:
                self.started = True
                print(f"fit {self.name} from {epoch}", flush=True)
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            where = f"{self.name} {self.epoch} {batch}"
            state = list(self.model.variables) + list(self.model.optimizer.variables)
            print(f"fit {where} {self.digest_of(state)}", flush=True)
            if where == self.pause_at:
                time.sleep(3600)

    return FitProgress


# ------------------------------------------------------- the training process

def train(directory, out):
    import keras
    import tensorflow as tf

    from helpers import keras3_train_step, mixed_mlp, tf24_train_step
    from lossscale import experimental
    from lossscale.loss_scale import DynamicLossScale
    from lossscale.optimizer import LossScaleOptimizer

    tf.config.experimental.enable_op_determinism()
    FitProgress = fit_progress_class()  # noqa: N806 - a class

    def digest_of(variables):
        digest = hashlib.sha1()
        for v in variables:
            digest.update(np.asarray(v).tobytes())
        return digest.hexdigest()

    # Phase 1: Model.fit with keras.callbacks.BackupAndRestore (end of every
    # epoch, the two latest kept), the loss scale in the optimizer's weights.
    fitted = {}
    for name in FIT_MODELS:
        m = mixed_mlp(0, hidden=12)
        inner = keras.optimizers.Adam(1e-2)
        m.compile(loss="mse", optimizer=(
            LossScaleOptimizer(inner, initial_scale=2.0**10, dynamic_growth_steps=3)
            if name == "fit_keras" else
            LossScaleOptimizer(inner, loss_scale=DynamicLossScale(
                2.0**10, 3, min_loss_scale=2.0, hysteresis=2, count_skipped_steps=True))))
        m.fit(*fit_data(), batch_size=FIT_BATCH, epochs=FIT_EPOCHS, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(os.path.join(directory, name),
                                                          delete_checkpoint=False),
                         FitProgress(name, digest_of)])
        fitted[name] = list(m.variables) + list(m.optimizer.variables)
        print(f"fit {name} end {digest_of(fitted[name])}", flush=True)

    # Phase 2: a custom loop per loss-scale path, tf.train.CheckpointManager.
    models = {name: mixed_mlp(0, hidden=12) for name in ("keras", "stock", "tf24", "extensions")}
    optimizers = {
        "keras": LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=2.0**10,
                                    dynamic_growth_steps=3),
        "stock": keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2),
                                                     initial_scale=2.0**10,
                                                     dynamic_growth_steps=3),
        "tf24": experimental.LossScaleOptimizer(keras.optimizers.Adam(1e-2),
                                                experimental.DynamicLossScale(2.0**10, 3)),
        "extensions": LossScaleOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9),
            loss_scale=DynamicLossScale(2.0**10, 3, min_loss_scale=2.0, hysteresis=2,
                                        count_skipped_steps=True)),
    }
    for name, opt in optimizers.items():
        opt.build(models[name].trainable_variables)

    steps = {name: tf.function(
        (tf24_train_step if name == "tf24" else keras3_train_step)(models[name], opt))
        for name, opt in optimizers.items()}
    state = {name: list(models[name].variables) + list(opt.variables)
             for name, opt in optimizers.items()}

    @tf.function
    def read_all():
        return {name: [tf.convert_to_tensor(v) for v in variables]
                for name, variables in state.items()}

    step_number = tf.Variable(0, dtype=tf.int64, trainable=False)
    # Ballast: a write long enough for a kill to land inside it.
    ballast = tf.Variable(tf.random.stateless_normal([1 << 22], seed=[1, 2]), trainable=False)
    checkpoint = tf.train.Checkpoint(
        step=step_number, ballast=ballast,
        models=dict(models), optimizers=dict(optimizers))
    manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).assert_consumed()
    start = int(step_number.numpy())
    print(f"restored {start}", flush=True)

    for i in range(start, STEPS):
        x, y = batch(i)
        factor = np.float32(overflow_factor(i))
        for step in steps.values():
            step(x, y, factor)
        values = read_all()
        digest = hashlib.sha1()
        for name in sorted(values):
            for v in values[name]:
                digest.update(v.numpy().tobytes())
        step_number.assign(i + 1)
        print(f"step {i} {digest.hexdigest()}", flush=True)
        if (i + 1) % EVERY == 0:
            print(f"saving {i + 1}", flush=True)
            manager.save(checkpoint_number=i + 1)
            print(f"saved {i + 1}", flush=True)

    values = {name: [v.numpy() for v in vs] for name, vs in read_all().items()}
    values.update({name: [np.asarray(v) for v in vs] for name, vs in fitted.items()})
    arrays = {f"{name}/{k:02d}": v for name in values for k, v in enumerate(values[name])}
    arrays["step"] = step_number.numpy()
    arrays["scale/keras"] = optimizers["keras"].loss_scale.numpy()
    arrays["scale/stock"] = optimizers["stock"].dynamic_scale.numpy()
    arrays["iterations/keras"] = optimizers["keras"].iterations.numpy()
    arrays["iterations/tf24"] = optimizers["tf24"].iterations.numpy()
    with open(out + ".tmp", "wb") as f:
        np.savez(f, **arrays)
    os.replace(out + ".tmp", out)
    print("done", flush=True)


# ----------------------------------------------------------- the test side

class Trainer:
    """The training process, its progress lines read on a thread."""

    def __init__(self, directory, out, log, pause_at=None):
        env = child_env(
            drop=("LOSSSCALE_FORCE_FALLBACK", "LOSSSCALE_SIMD", "TF_CONFIG", "TRAINER_PAUSE_AT"),
            TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
        if pause_at:
            env["TRAINER_PAUSE_AT"] = pause_at
        self.log = log
        self.lines = []
        self._queue = queue.Queue()
        with open(log, "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(directory), str(out)],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def stderr_tail(self):
        with open(self.log, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def next_line(self, timeout=LINE_TIMEOUT):
        try:
            line = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no progress for {timeout} s; stderr:\n{self.stderr_tail()}")
        if line is None:
            self.proc.wait(timeout=60)
            raise AssertionError(f"the trainer exited ({self.proc.returncode}) after "
                                 f"{self.lines[-3:]}; stderr:\n{self.stderr_tail()}")
        self.lines.append(line)
        return line

    def until(self, predicate):
        while True:
            line = self.next_line()
            if predicate(line):
                return line

    def kill(self):
        """SIGKILL, then take in every line it printed before it died."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        while True:
            try:
                line = self._queue.get(timeout=10)
            except queue.Empty:
                return
            if line is None:
                self._queue.put(None)
                return
            self.lines.append(line)

    def finish(self):
        self.until(lambda line: line == "done")
        assert self.proc.wait(timeout=60) == 0, self.stderr_tail()

    def digests(self):
        """{what: digest} of every step, fit batch and fit end it reported."""
        return {line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1] for line in self.lines
                if line.startswith("step ") or (line.startswith("fit ") and " from " not in line)}

    def restored(self):
        (first,) = [line for line in self.lines if line.startswith("restored ")]
        return int(first.split()[1])

    def fit_started(self):
        """{fit model: the epoch fit started from}, for the fits that ran an epoch."""
        return {line.split()[1]: int(line.split()[3]) for line in self.lines
                if line.startswith("fit ") and " from " in line}

    def saved(self):
        return [int(line.split()[1]) for line in self.lines if line.startswith("saved ")]


def kill_once_written(trainer, directory, prefix, timeout=60.0):
    """SIGKILLs the trainer as soon as a file of checkpoint ``prefix`` appears
    (the write has begun); returns the entries of that checkpoint seen then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and trainer.proc.poll() is None:
        written = sorted(n for n in os.listdir(directory) if n.startswith(prefix))
        if written:
            trainer.kill()
            return written
        time.sleep(0.0005)
    trainer.kill()
    raise AssertionError(f"{prefix} was never written; stderr:\n{trainer.stderr_tail()}")


def load(path):
    with np.load(path) as data:
        return {k: (data[k].dtype.str, data[k].shape, data[k].tobytes()) for k in data.files}


def test_killed_and_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    rng = np.random.default_rng(SEED)
    fit_kill = (FIT_MODELS[rng.integers(len(FIT_MODELS))], int(rng.integers(1, FIT_EPOCHS)),
                int(rng.integers(FIT_BATCHES)))
    kill_step = int(rng.integers(EVERY + 1, STEPS // 2))
    kill_save = EVERY * int(rng.integers(STEPS // 2 // EVERY + 2, STEPS // EVERY - 1))
    print(f"seed {SEED}: kill in fit of {fit_kill[0]} at epoch {fit_kill[1]} batch "
          f"{fit_kill[2]}, at step {kill_step}, during the write of checkpoint {kill_save}")
    run = tmp_path / "run"
    trainers = []

    def trainer(log, **kwargs):
        trainers.append(Trainer(run, tmp_path / "run.npz", tmp_path / log, **kwargs))
        return trainers[-1]

    try:
        whole = Trainer(tmp_path / "whole", tmp_path / "whole.npz", tmp_path / "whole.log")
        trainers.append(whole)

        # 1. Killed in Model.fit, between two batches.
        pause_at = " ".join(map(str, fit_kill))
        first = trainer("first.log", pause_at=pause_at)
        first.until(lambda line: line.startswith(f"fit {pause_at} "))
        first.kill()
        assert first.proc.returncode == -signal.SIGKILL

        # 2. Resumed: fit goes on from the epoch it was in; then killed at a
        # step of the custom loops.
        second = trainer("second.log")
        assert second.until(lambda line: line.startswith("restored ")) == "restored 0"
        assert second.fit_started()[fit_kill[0]] == fit_kill[1]
        second.until(lambda line: line.startswith(f"step {kill_step} "))
        second.kill()
        assert second.proc.returncode == -signal.SIGKILL
        last_saved = max(second.saved(), default=0)

        # 3. Resumed, killed as it writes a checkpoint.
        third = trainer("third.log")
        third.until(lambda line: line.startswith("restored "))
        # From the last checkpoint the second run announced, or one it was
        # writing when killed; never from scratch, never from a torn one.
        assert last_saved >= EVERY and not third.fit_started()
        assert third.restored() in (last_saved, last_saved + EVERY), third.lines
        third.until(lambda line: line == f"saving {kill_save}")
        written = kill_once_written(third, run, f"ckpt-{kill_save}")
        assert third.proc.returncode == -signal.SIGKILL
        # Killed with the checkpoint begun but not complete.
        assert f"saved {kill_save}" not in third.lines
        assert f"ckpt-{kill_save}.index" not in written, written
        print(f"killed with {written} written; left: {sorted(os.listdir(run))}")

        # 4. Resumed to the end.
        fourth = trainer("fourth.log")
        fourth.finish()
        assert fourth.restored() in (kill_save - EVERY, kill_save), fourth.lines
        whole.finish()
    finally:
        for t in trainers:
            t.kill()

    expected = whole.digests()
    assert whole.restored() == 0 and sum(k.startswith("step ") for k in expected) == STEPS
    assert sum(k.startswith("fit ") for k in expected) == len(FIT_MODELS) * (
        FIT_EPOCHS * FIT_BATCHES + 1)
    for t in trainers[1:]:
        redone = t.digests()
        assert redone, t.lines
        for what, digest in redone.items():
            assert digest == expected[what], f"{what} differs after a restart"
    assert not os.path.exists(tmp_path / "run.npz.tmp")

    final, reference = load(tmp_path / "run.npz"), load(tmp_path / "whole.npz")
    assert sorted(final) == sorted(reference)
    for key in reference:
        assert final[key] == reference[key], f"{key} differs from the uninterrupted run"

    # The uninterrupted run itself: ours equals stock Keras, variable for
    # variable, and the schedule exercised skipping.
    ours = {k.split("/")[1]: v for k, v in reference.items() if k.startswith("keras/")}
    stock = {k.split("/")[1]: v for k, v in reference.items() if k.startswith("stock/")}
    assert ours == stock and reference["scale/keras"] == reference["scale/stock"]
    skipped = sum(not np.isfinite(overflow_factor(i)) for i in range(STEPS))
    iterations = np.frombuffer(reference["iterations/keras"][2], np.int64)[0]
    assert iterations <= STEPS - skipped
    assert np.frombuffer(reference["iterations/tf24"][2], np.int64)[0] == STEPS
    assert np.frombuffer(reference["step"][2], np.int64)[0] == STEPS


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2])
