"""Run by ``test_memory.py`` in a fresh process: the peak resident memory that
one loss-scale step adds on one big float32 gradient, printed as JSON.

    python bench/memory_child.py METHOD SITUATION VALUES

METHOD: ``producer`` (the gradient alone, consumed), ``native`` (the
lossscale ops), ``composite`` (TensorFlow 2.4's order: multiply, then check)
or ``composite_check_first`` (Keras 3's order: check, then divide).
SITUATION: ``inside`` (the gradient is made inside the step, as backprop
makes it, so an op may take over its buffer) or ``argument`` (passed in
and kept alive by the caller, so nothing may reuse it).  The peak is reset
just before the step (``/proc/self/clear_refs``), so tracing and TensorFlow's
own start-up do not count.  One method per process: TensorFlow keeps freed
buffers for reuse, so a second step in the same process would hide what it
allocates.  Linux only.
"""

import gc
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def main(method, situation, values):
    import harness

    harness.Settings.configure(False, harness.machine_threads())
    tf = harness.tensorflow()
    from test_tf_op import loss_scale_steps

    native_step, composite_step = loss_scale_steps()

    def step(g):
        if method == "producer":
            return tf.reduce_sum(g[:1]), tf.constant(True)
        if method == "native":
            (u,), finite = native_step([g])
        elif method == "composite":
            (u,), finite = composite_step([g])
        elif method == "composite_check_first":
            finite = tf.reduce_all(tf.math.is_finite(g))
            u = g / 2.0 ** 8
        else:
            raise ValueError(method)
        return tf.reduce_sum(u[:1]), finite

    if situation == "inside":
        fn = tf.function(lambda v: step(tf.fill([values], v)))
        arg = tf.constant(1.5)
    else:
        fn = tf.function(step)
        arg = tf.fill([values], 1.5)
    fn.get_concrete_function(arg)
    gc.collect()
    before = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = fn(arg)
    _ = [o.numpy() for o in out]
    print(json.dumps({"added_bytes": (_kib("VmHWM") - before) * 1024}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
