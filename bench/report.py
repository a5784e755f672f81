"""Turns the raw pytest-benchmark JSON of one run of the suite into
``REPORT.md`` and its plots, in the JSON's directory.

    python bench/report.py [--no-readme] bench/results/raw.json

Per method on a workload, every timed sample of every round is divided by
the calls (and, for ``fit``, the steps) it covered; the report gives their
median with the minimum and maximum.  Methods that make their gradients
inside a ``tf.function`` have the time of making them alone (the
``producer``, timed just before each sample) taken off that sample.  Ratios
are times, ours divided by the peer: below 1 ours is faster.  The report
opens with the speed goals set for the step (met or not, each with its measured
ratio) and the step a user times -- the optimizer step against its roofline,
stock Keras and torch, a parameter-heavy ``fit`` step, tracing, the finite
check alone -- and keeps the isolated ops below.  Plots need
matplotlib; without it the report says so and is written without them.
The raw JSON is rewritten without indentation (same content).

The README's performance headline is generated here too, never copied by
hand: from the results of a full run written where ``make bench`` writes
them (``bench/results/raw.json``; not ``--quick`` ones, not a JSON elsewhere,
as a run of a few items is, and not with ``--no-readme``) the text between
the README's ``<!-- headline:start -->`` and ``<!-- headline:end -->``
markers is rewritten by ``readme_block``.
``tests/test_readme_headline.py`` checks that the README holds what the
committed ``bench/results/raw.json`` gives.
"""

import dataclasses
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import workloads  # noqa: E402

LAYER_TITLES = {
    "core": "numpy layer: `lossscale.core.unscale_` (in place)",
    "tf_op": "TensorFlow op: unscale + check + update, `tf.function`",
    "loss_scale": "`LossScale.update` (TensorFlow 2.4 API)",
    "optimizer": "Keras `LossScaleOptimizer.apply`, `tf.function`",
    "fit": "a whole `fit` step",
    "step": "optimizer step: check + unscale + update, `apply` in `tf.function`",
    "tf_keras_step": "tf_keras step: TensorFlow 2.4's loop, `get_unscaled_gradients` + "
                     "`apply_gradients` in `tf.function`",
    "check": "finite check alone: gradients made in the graph, `tf.function`",
    "recipes": "recipe battery: one published recipe's optimizer, `apply` in `tf.function`",
}
# What each peer of a layer is called in the tables.
_PEER_NAMES = {
    "core": dict(ours="lossscale.core", torch="torch foreach", numpy="numpy isfinite+multiply",
                 roofline="np.multiply roofline"),
    "tf_op": dict(ours="ours (tf.function)", composite="TF composite (tf.function)",
                  ours_eager="ours eager", composite_eager="TF composite eager",
                  torch="torch unscale+update"),
    "loss_scale": dict(ours="ours (tf.function)", stock="tf.compat.v1 (tf.function)",
                       ours_eager="ours eager", stock_eager="tf.compat.v1 eager"),
    "optimizer": dict(ours="ours", stock="stock Keras", sgd="inner SGD alone"),
    "fit": dict(ours="mixed, ours", ours_unfused="mixed, ours fused=False",
                stock="mixed, stock Keras", grads_only="forward + backward alone",
                float32="float32, no loss scaling"),
    "step": dict(ours="ours", ours_unfused="ours, fused=False", stock="stock Keras",
                 torch_fused="torch fused", torch_foreach="torch foreach",
                 core="lossscale.core on numpy buffers",
                 core_cached="lossscale.core in cache, scaled",
                 ours_fixed="ours, 4-value variables"),
    "tf_keras_step": dict(ours="ours", ours_unfused="ours, fused=False", stock="stock tf_keras",
                          torch_fused="torch fused", torch_foreach="torch foreach"),
    "check": dict(composite="stock composite", ours_per_tensor="ours per tensor",
                  ours_list="ours, one op", ours_grouped="ours grouped"),
    "recipes": dict(ours="ours", stock="stock Keras", torch="torch nearest equivalent"),
}
PEER_LABELS = {(layer, peer): label for layer, names in _PEER_NAMES.items()
               for peer, label in names.items()}
# Layers whose graph methods make their gradients in the graph; the
# producer's time, measured before each sample, comes off.
NET = ("tf_op", "loss_scale", "optimizer", "step", "tf_keras_step", "check", "recipes")
for _layer in NET:
    PEER_LABELS[(_layer, "producer")] = "making the gradients (subtracted)"
# (layer, ours, peer, label) -> the ratio columns of each layer's table.
RATIOS = {
    "core": [("ours", "torch", "÷ torch"), ("ours", "numpy", "÷ numpy"),
             ("ours", "roofline", "÷ roofline")],
    "tf_op": [("ours", "composite", "÷ composite"),
              ("ours_eager", "composite_eager", "eager ÷ composite eager"),
              ("ours", "torch", "÷ torch"), ("ours", "roofline", "÷ roofline")],
    "loss_scale": [("ours", "stock", "÷ stock"),
                   ("ours_eager", "stock_eager", "eager ÷ stock eager")],
    "optimizer": [("ours", "stock", "÷ stock")],
    "fit": [("ours", "stock", "÷ stock")],
}


# Ratios are ours ÷ peer (time).  Above SLOWER ours is slower: the cell is
# bold and listed under "Where we lose"; from FASTER to SLOWER it is a tie.
SLOWER = 1.05
FASTER = 0.95
# A first call (tracing) is a loss only when it is also this much longer in
# seconds: a few milliseconds of tracing are noise, whatever their ratio.
FIRST_CALL_SLACK_S = 0.05
# torch's pass at more threads this many times slower than at one is its
# threading, not the work (see why_torch_threads).
TORCH_THREADS_ABSURD = 5.0


def percent(band):
    """The band around 1 as a percentage: 1.05 -> '5%'."""
    return f"{abs(band - 1) * 100:.0f}%"


# Bytes per parameter the fused step must move: a read-only finite check of
# the gradient (4 B), then the update -- SGD-momentum reads the gradient, the
# variable and the momentum and writes the last two (20 B); Adam reads the
# gradient, the variable and two moments and writes the last three (28 B).
STEP_BYTES_PER_PARAM = {"sgdm": 4 + 20, "adam": 4 + 28}
OPTIMIZER_LABELS = {"sgdm": "SGD-momentum", "adam": "Adam"}

# The step's peers that split ours: its kernels alone, the same fed from the
# cache, its fixed cost.
STEP_SPLIT = ("core", "core_cached", "ours_fixed")
# The speed goals set for the step.  Step, per optimizer: the most ours ÷ roofline,
# the least stock ÷ ours, the torch peers ours must not be slower than
# (ours ÷ the faster of them at most NOT_SLOWER).
STEP_GOALS = {"adam": (1.15, 3.0, ("torch_fused", "torch_foreach")),
              "sgdm": (1.15, 2.5, ("torch_fused",))}
STEP_GOAL_WORKLOADS = ("resnet50", "bert_base")
FIT_GOAL = ("mlp_4096x3/mixed_float16", 1.3)          # least stock ÷ ours
TRACING_GOAL_WORKLOAD = "tiny_2000x64"              # first call: ours ÷ stock ≤ NOT_SLOWER
CHECK_GOALS = {"resnet50/float32": 1.25, "tiny_2000x64/float32": 5.0}  # least composite ÷ ours
NOT_SLOWER = SLOWER
# The recipes: the least stock ÷ ours (Adam-like families, the others), the
# most ours ÷ the roofline of the bytes the recipe's step must move.
RECIPE_GOALS = {"adam_like": 3.0, "other": 2.5, "roofline": 1.1}
ADAM_LIKE = ("Adam", "AdamW", "Nadam", "Adamax", "Lamb")
MIRRORED_GOAL = 1.5                                 # least stock ÷ ours, the whole step

# The tf_keras step (bench/tf_keras_step_child.py): its optimizers, legacy
# line first, and the least stock tf_keras ÷ ours per rule on both lines, for
# the step goals' workloads.
TF_KERAS_STEP = "tf_keras_step"
TF_KERAS_OPTIMIZERS = ("legacy_adam", "legacy_rmsprop", "legacy_sgdm", "adam", "rmsprop", "sgdm")
TF_KERAS_STEP_GOALS = {"adam": 2.5, "rmsprop": 2.5, "sgdm": 2.0}
# The fused step's bytes per parameter on either line, as STEP_BYTES_PER_PARAM
# counts them (RMSprop without momentum: the gradient twice, the variable
# and its one slot read and written).
TF_KERAS_STEP_BYTES_PER_PARAM = dict(STEP_BYTES_PER_PARAM, rmsprop=4 + 20)
OPTIMIZER_LABELS.update(rmsprop="RMSprop", legacy_adam="legacy Adam",
                        legacy_rmsprop="legacy RMSprop", legacy_sgdm="legacy SGD-momentum")


# ------------------------------------------------------------ reading


def ratio_line(layer, case, threads, ours, peer, r):
    """One bullet of the where-we-lose and ties lists."""
    return (f"- {LAYER_TITLES[layer].split(':')[0]}, {case_label(case)}, "
            f"{threads} thread{'s' if threads > 1 else ''}: "
            f"{PEER_LABELS.get((layer, ours), ours)} ÷ "
            f"{PEER_LABELS.get((layer, peer), peer)} = {r:.2f}")

@dataclasses.dataclass(frozen=True)
class Stat:
    """The samples of one method on one workload (seconds per step)."""

    samples: list
    median: float
    min: float
    max: float
    n: int
    rounds: dict            # round index -> median of that round's samples
    gross: "Stat" = None    # before the producer was subtracted, where it was

    @classmethod
    def of(cls, xs, by_round, gross=None):
        xs = sorted(xs)
        return cls(xs, statistics.median(xs), xs[0], xs[-1], len(xs),
                   {r: statistics.median(x) for r, x in by_round.items()}, gross)


def load(path):
    with open(path) as f:
        raw = json.load(f)
    samples, by_round = {}, {}
    info, first = {}, {}

    def add(key, rnd, xs):
        samples.setdefault(key, []).extend(xs)
        by_round.setdefault(key, {}).setdefault(rnd, []).extend(xs)

    for b in raw["benchmarks"]:
        e = b["extra_info"]
        if "peer" not in e:
            continue
        # workload_share: one call covers that share of the workload's step.
        per = (e.get("calls_per_sample", 1) * e.get("steps_per_call", 1)
               * e.get("workload_share", 1))
        key = (e["layer"], e["case"], e["threads"], e["peer"])
        xs = [x / per for x in b["stats"]["data"]]
        rnd = e.get("rnd", 0)
        base = e.get("baseline_s")
        if base:
            # The baseline ran just before each sample: subtract pairwise.
            add(key[:3] + ("producer",), rnd, base)
            add(key + ("gross",), rnd, xs)
            xs = [x - b for x, b in zip(xs, base)]
        add(key, rnd, xs)
        info[key] = e
        if "first_call_s" in e:
            first[key] = e["first_call_s"]
    stats = {}
    for k, v in samples.items():
        if len(k) == 4:
            g = k + ("gross",)
            gross = Stat.of(samples[g], by_round[g]) if g in samples else None
            stats[k] = Stat.of(v, by_round[k], gross)
    meta = raw.get("lossscale", {})
    return raw, stats, info, first, meta.get("facts", {}), meta.get("records", {})


# ------------------------------------------------------------ formatting

def fmt_s(s):
    if s <= 0:
        return "≤0 (noise)"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms" if s < 0.1 else f"{s * 1e3:.0f} ms"
    return f"{s * 1e6:.3g} µs"


def cell(st):
    if st is None:
        return "—"
    return f"{fmt_s(st.median)} <sub>{fmt_s(st.min)}–{fmt_s(st.max)}</sub>"


@dataclasses.dataclass(frozen=True)
class Ratio:
    """ours ÷ peer taken round by round (each round's medians, measured back
    to back): ``value`` is the median of those ratios, ``lo`` and ``hi``
    their range.  With one round, the ratio of the medians and no range."""

    value: float
    lo: float = None
    hi: float = None


def ratio(a, b):
    """The ``Ratio`` of two ``Stat``s, or None where either is missing or not
    positive."""
    if a is None or b is None or a.median <= 0 or b.median <= 0:
        return None
    per = [a.rounds[k] / b.rounds[k] for k in a.rounds
           if k in b.rounds and a.rounds[k] > 0 and b.rounds[k] > 0]
    if len(per) > 1:
        return Ratio(statistics.median(per), min(per), max(per))
    return Ratio(a.median / b.median)


@dataclasses.dataclass(frozen=True)
class Goal:
    """One speed goal against this run: ``value`` is the
    measured ratio (None where this run did not measure it), ``limit`` the
    bound, ``at_least`` whether the ratio must reach it or stay under it."""

    what: str
    value: float
    limit: float
    at_least: bool
    # stock ÷ ours were ours as fast as its floor in this run (stock ÷ the
    # roofline of our bytes; the whole step less our update, under a
    # strategy): a "stock ÷ ours" goal above it asks ours to beat the
    # bandwidth, which only a working set that stays in cache can.
    ceiling: float = None

    @property
    def met(self):
        if self.value is None:
            return None
        return self.value >= self.limit if self.at_least else self.value <= self.limit


def speedup(ours, peer):
    """How many times faster ours is: 1 ÷ (ours ÷ peer), so that it reads the
    same ratio as every other cell of the report; None where not measured."""
    r = ratio(ours, peer)
    return None if r is None else 1 / r.value


def scaled(st, k):
    """``st`` with every time multiplied by ``k``."""
    return Stat.of([x * k for x in st.samples], {r: [m * k] for r, m in st.rounds.items()})


def _r(x):
    return f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"



def real_models_note(ex):
    """The recipe's real-model lockstep (``test_recipes.real_lockstep``) for
    its exactness cell: each KerasHub model's verdict, and its path where
    the model's step took another one than the battery's."""
    real = (ex or {}).get("real_models")
    if not real:
        return ""
    if "skipped" in real:
        return "; real models not run (no keras_hub)"
    parts = []
    for arch, r in real.items():
        name = {"bert": "BERT", "gpt2": "GPT-2"}.get(arch, arch)
        verdict = "bit-identical" if r["exact"] else "**DIFFERENT** (steps " + ", ".join(
            str(i + 1) for i in r["mismatched_steps"]) + ")"
        path = "" if r["step_path"] == ex.get("step_path") else f", `{r['step_path']}`"
        parts.append(f"{name} {verdict}{path}, {r['applied']} of {r['steps']} applied")
    return "; KerasHub `fit`: " + "; ".join(parts)

def fmt_ratio(r, spread=True):
    if r is None:
        return "—"
    s = _r(r.value)
    s = f"**{s}**" if r.value > SLOWER else s
    if spread and r.lo is not None:
        s += f" <sub>{_r(r.lo)}–{_r(r.hi)}</sub>"
    return s


def case_label(case):
    name, dtype, *variant = case.split("/")
    if name.startswith("sweep_"):
        return f"1 tensor, {workloads.size_label(int(name[6:]))}"
    pretty = {"resnet50": "ResNet-50", "bert_base": "BERT-base", "tiny_2000x64": "2,000 × 64",
              workloads.BIG: "1 tensor, 1 GiB", "digits_cnn": "digits CNN",
              "mlp_4096x3": "MLP 3 × 4096",
              "bert_classifier_adam": "KerasHub BERT classifier, Adam",
              "bert_classifier_adamw_clip": "KerasHub BERT classifier, AdamW + "
                                            "global_clipnorm",
              "bert_classifier_rmsprop": "KerasHub BERT classifier, RMSprop",
              "bert_classifier_adamw_accumulate": "KerasHub BERT classifier, AdamW "
              "(polynomial decay) + global_clipnorm, gradient accumulation over 4 "
              "steps",
              "bert_classifier_lamb": "KerasHub BERT classifier, Lamb (polynomial decay, "
                                      "weight decay)"}.get(name, name)
    return " ".join([pretty, dtype] + [OPTIMIZER_LABELS.get(v, v) for v in variant])


def is_sweep(case):
    return case.startswith("sweep_")


# ------------------------------------------------------------ the report

class Report:
    def __init__(self, path):
        self.path = path
        self.out_dir = os.path.dirname(os.path.abspath(path))
        (self.raw, self.stats, self.info, self.first, self.facts,
         self.records) = load(path)
        self.threads = self.facts.get("threads") or max(k[2] for k in self.stats)
        self.lines = []
        self.losses = []
        self.ties = []
        self.first_losses = []
        self.sweep_losses = {}

    def get(self, layer, case, peer, threads=None):
        t = self.threads if threads is None else threads
        if peer == "roofline" and layer != "core":
            layer = "core"
        return self.stats.get((layer, case, t, peer))

    def cases(self, layer, threads=None, sweep=False):
        t = self.threads if threads is None else threads
        seen = []
        for (la, case, th, _), _st in self.stats.items():
            if la == layer and th == t and is_sweep(case) == sweep and case not in seen:
                seen.append(case)
        order = {n: i for i, n in enumerate(list(workloads.LISTS) + [workloads.BIG])}
        return sorted(seen, key=lambda c: (order.get(c.split("/")[0], 99),
                                           c.split("/")[1] != "float32", c))

    def peers(self, layer):
        found = []
        for (la, _c, _t, p) in self.stats:
            if la == layer and p not in found:
                found.append(p)
        order = [p for (la, p) in PEER_LABELS if la == layer] + ["producer"]
        return sorted(found, key=lambda p: order.index(p) if p in order else 99)

    def w(self, *lines):
        self.lines.extend(lines)

    # -------------------------------------------------------- the step a user times

    def roofline_for(self, moved_bytes):
        """``moved_bytes`` at the bandwidth of the in-place multiply over
        1 GiB (which moves 2 GiB) in this run, as a ``Stat``; None without
        either."""
        bw = (self.get("core", f"{workloads.BIG}/float32", "roofline")
              or self.get("core", f"{workloads.BIG}/float32", "roofline", 1))
        if bw is None or not moved_bytes:
            return None
        return scaled(bw, moved_bytes / (2 * workloads.GIB))

    def step_roofline(self, case):
        """The fused step's bytes at the roofline's bandwidth."""
        info = next((e for k, e in self.info.items() if k[:3] == ("step", case, self.threads)),
                    None)
        if info is None:
            return None
        optimizer = case.split("/")[2]
        return self.roofline_for(STEP_BYTES_PER_PARAM[optimizer] * info["values"])

    def own_or_side(self, layer, case, peer, alone=True):
        """``peer``'s ``Stat`` on ``case`` of ``layer``: timed in its own
        process where the run has that (``test_alone.py``), else side by
        side; ``alone=False``: side by side."""
        return ((alone and self.get(f"{layer}/alone", case, peer))
                or self.get(layer, case, peer))

    def alone_method(self, layer):
        """How ``test_alone.py`` timed ``layer`` in this run, for a table's lead."""
        warm = {e["warmup_s"] for k, e in self.info.items()
                if k[0] == f"{layer}/alone" and e.get("warmup_s")}
        return ("one Python process per peer and round, every workload of it"
                + (f", each method warmed up for {fmt_s(min(warm))} before its samples"
                   if warm else "")
                + ", the peers' processes interleaved round by round")

    def step_get(self, case, peer, alone=True):
        """The step's ``Stat`` for ``peer`` (``own_or_side``); ``roofline``:
        the step's bytes at the roofline's bandwidth."""
        if peer == "roofline":
            return self.step_roofline(case)
        return self.own_or_side("step", case, peer, alone)

    def has_alone(self, layer):
        return any(k[0] == f"{layer}/alone" for k in self.stats)

    def best_check(self):
        """The lossscale check the goals judge: grouped where the run has it."""
        peers = self.peers("check")
        return "ours_grouped" if "ours_grouped" in peers else "ours_list"

    def first_ratio(self, layer, case, ours, peer):
        a = self.first.get((layer, case, self.threads, ours))
        b = self.first.get((layer, case, self.threads, peer))
        return Ratio(a / b) if a and b else None

    def torch_best(self, case, peers):
        found = [(st.median, p) for p in peers for st in [self.get("step", case, p)] if st]
        return min(found)[1] if found else None

    def goals(self):
        out = []
        for optimizer, name in ((o, w) for o in STEP_GOALS for w in STEP_GOAL_WORKLOADS):
            case = f"{name}/float32/{optimizer}"
            roof_max, stock_min, torch_peers = STEP_GOALS[optimizer]
            label = f"step, {case_label(case)}"
            r = ratio(self.step_get(case, "ours"), self.step_get(case, "roofline"))
            out.append(Goal(f"{label}: ours ÷ roofline", r and r.value, roof_max, False))
            out.append(Goal(f"{label}: stock ÷ ours",
                            speedup(self.step_get(case, "ours"), self.step_get(case, "stock")),
                            stock_min, True,
                            speedup(self.step_get(case, "roofline"),
                                    self.step_get(case, "stock"))))
            best = self.torch_best(case, torch_peers)
            r = ratio(self.step_get(case, "ours"), self.step_get(case, best)) if best else None
            names = " or ".join(PEER_LABELS[("step", p)] for p in torch_peers)
            out.append(Goal(f"{label}: ours ÷ "
                            + (names if len(torch_peers) == 1 else
                               f"the faster of {names}"
                               + (f" ({PEER_LABELS[('step', best)]})" if best else "")),
                            r and r.value, NOT_SLOWER, False))
        case, least = FIT_GOAL
        out.append(Goal(f"`fit` step, {case_label(case)}, Adam: stock ÷ ours",
                        speedup(self.get("fit", case, "ours"), self.get("fit", case, "stock")),
                        least, True))
        for optimizer in STEP_GOALS:
            case = f"{TRACING_GOAL_WORKLOAD}/float32/{optimizer}"
            r = self.first_ratio("step", case, "ours", "stock")
            out.append(Goal(f"tracing (first call of `apply`), {case_label(case)}: "
                            "ours ÷ stock", r and r.value, NOT_SLOWER, False))
        ours = self.best_check()
        for case, least in CHECK_GOALS.items():
            out.append(Goal(f"finite check alone, {case_label(case)}: stock composite ÷ "
                            f"{PEER_LABELS[('check', ours)]}",
                            speedup(self.get("check", case, ours),
                                    self.get("check", case, "composite")), least, True))
        return out + self.tf_keras_goals() + self.recipe_goals() + self.distributed_goals()

    def recipe_goals(self):
        """Per recipe: stock ÷ ours, ours ÷ torch's nearest equivalent, ours ÷
        the roofline of its own bytes, each peer in its own process where
        the run has that."""
        out = []
        for case in self.recipe_cases():
            e = self.recipe_info(case)
            name = case.split("/")[0]
            ours = self.recipe_get(case, "ours")
            least = RECIPE_GOALS["adam_like" if e.get("family") in ADAM_LIKE else "other"]
            stock = self.recipe_get(case, "stock")
            out.append(Goal(f"recipe {name} ({e.get('family', '?')}): stock ÷ ours",
                            speedup(ours, stock), least, True,
                            speedup(self.recipe_get(case, "roofline"), stock)))
            if e.get("torch_peer"):
                r = ratio(ours, self.recipe_get(case, "torch"))
                out.append(Goal(f"recipe {name}: ours ÷ torch ({e['torch_peer']})",
                                r and r.value, NOT_SLOWER, False))
            r = ratio(ours, self.recipe_get(case, "roofline"))
            out.append(Goal(f"recipe {name}: ours ÷ roofline", r and r.value,
                            RECIPE_GOALS["roofline"], False))
        return out

    def distributed_goals(self):
        mirrored = self.records.get("distributed", {}).get("mirrored")
        if not mirrored:
            return []
        s = mirrored["seconds"]
        floor = s["ours"]["gradients"] + s["ours"]["all_reduce"]
        return [Goal(f"MirroredStrategy, 2 replicas, {mirrored['layers']} × {mirrored['width']} "
                     "MLP, Adam, the whole step: stock ÷ ours", mirrored["ours_vs_stock"],
                     MIRRORED_GOAL, True, s["stock"]["step"] / floor if floor > 0 else None)]

    def goals_section(self):
        self.goal_rows = self.goals()
        if all(g.met is None for g in self.goal_rows):
            return
        self.w("## Goals", "",
               "The speed goals the issues set, against this run.  \"Not slower\" allows "
               f"the tie band of this report (ours ÷ peer up to {NOT_SLOWER:g}).  *Ceiling*, "
               "for a \"stock ÷ ours\" goal: what that ratio would be were ours as fast as "
               "its floor, stock's time ÷ the roofline of our own bytes (under a strategy, "
               "stock's step ÷ our forward, backward and all-reduce, the update free).  A "
               "goal above its ceiling asks ours to move its bytes faster than the "
               "machine's bandwidth, which only a working set that stays in cache allows.",
               "", "| goal | measured | bound | ceiling | |", "|---|---:|---:|---:|---|")
        for g in self.goal_rows:
            if g.met is not None:
                bound = f"≥ {g.limit:g}" if g.at_least else f"≤ {g.limit:g}"
                ceiling = "—" if g.ceiling is None else _r(g.ceiling)
                self.w(f"| {g.what} | {_r(g.value)} | {bound} | {ceiling} | "
                       f"{'met' if g.met else '**not met**'} |")
        missing = [g.what for g in self.goal_rows if g.met is None]
        self.w("")
        if missing:
            self.w("Not measured in this run (its case was not run): "
                   + "; ".join(missing) + ".", "")

    def lead_rows(self):
        """Headline rows for the step a user times, ahead of the isolated ops."""
        rows = []
        for case in self.cases("step"):
            for peer in ("stock", "torch_fused", "torch_foreach", "roofline"):
                r = ratio(self.step_get(case, "ours"), self.step_get(case, peer))
                if r is not None and not (case.startswith(TRACING_GOAL_WORKLOAD + "/")
                                          and peer == "roofline"):
                    rows.append((f"optimizer step, {case_label(case)}: ours ÷ "
                                 f"{PEER_LABELS.get(('step', peer), 'roofline')}", r))
        for case in self.cases("fit"):
            if case != "digits_cnn/mixed_float16":
                r = ratio(self.get("fit", case, "ours"), self.get("fit", case, "stock"))
                if r is not None:
                    rows.append((f"`fit` step, {case_label(case)}: ours ÷ stock Keras", r))
        for case in self.cases("step"):
            if case.startswith(TRACING_GOAL_WORKLOAD + "/"):
                r = self.first_ratio("step", case, "ours", "stock")
                if r is not None:
                    rows.append((f"tracing `apply`, {case_label(case)}: ours ÷ stock Keras", r))
        ours = self.best_check()
        for case in self.cases("check"):
            r = ratio(self.get("check", case, ours), self.get("check", case, "composite"))
            if r is not None:
                rows.append((f"finite check alone, {case_label(case)}: "
                             f"{PEER_LABELS[('check', ours)]} ÷ stock composite", r))
        return rows

    def times_table(self, layer, cases, peers, ratios, get, extra=None, losses=True):
        """Times of ``peers`` on ``cases``, then ``ratios``: (label, a, b) for
        a ÷ b; ``extra``: (label, case -> cell) columns at the end.  With
        ``losses`` its ratios feed "Where we lose" and the ties."""
        extra = extra or []
        self.w("| workload | " + " | ".join(PEER_LABELS.get((layer, p), p) for p in peers)
               + "".join(f" | {label}" for label, _a, _b in ratios)
               + "".join(f" | {label}" for label, _f in extra) + " |",
               "|---|" + "---:|" * (len(peers) + len(ratios)) + "---|" * len(extra))
        for case in cases:
            cells = [cell(get(case, p)) for p in peers]
            for _label, a, b in ratios:
                r = ratio(get(case, a), get(case, b))
                cells.append(fmt_ratio(r))
                if losses and r is not None and a.startswith("ours") and b != "roofline":
                    entry = (layer, case, self.threads, a, b, r.value)
                    if r.value > SLOWER:
                        self.losses.append(entry)
                    elif r.value >= FASTER:
                        self.ties.append(entry)
            cells += [f(case) for _label, f in extra]
            self.w(f"| {case_label(case)} | " + " | ".join(cells) + " |")
        self.w("")

    def step_split(self, cases):
        """Where the step's time goes: ours beside what it costs whatever the
        sizes (``ours_fixed``), beside its kernels with no TensorFlow around
        them (``core``) and the same fed from the cache (``core_cached``),
        with the roofline."""
        cases = [c for c in cases if all(self.step_get(c, p) for p in STEP_SPLIT)]
        if not cases:
            return
        self.w("**Where the step's time goes.**  *" + PEER_LABELS[("step", "ours_fixed")]
               + "*: the same optimizer on as many variables of 4 values each, what a step "
               "costs whatever the sizes (calling the function, TensorFlow's executor, the "
               "small ops).  *" + PEER_LABELS[("step", "core")] + "*: the same fused step "
               "(check, unscale, update) through `lossscale.core` over numpy buffers of the "
               "same shapes at the same thread count, the kernels with no TensorFlow around "
               "them.  *" + PEER_LABELS[("step", "core_cached")] + "*: the same through "
               "`lossscale.core` over a cut of 2^20 values in 16 tensors, whose variables, "
               "gradients and slots (12 MiB for SGD-momentum, 16 MiB for Adam) stay in the "
               "last-level cache, times the workload's values over the cut's: the kernels fed "
               "from the cache instead of memory, their arithmetic (Adam's exact division and "
               "square root among it) and the cache's own bandwidth, the Python call's few "
               "microseconds included.  So *core ÷ roofline* is how close the kernels come to "
               "memory's bound, *cached ÷ roofline* how near they come to it with memory out "
               "of the way (near 1 or above: the cores, not memory, set the pace), and "
               "*ours ÷ core* what running them inside TensorFlow adds: the fixed part and "
               "the finite check in ops of its own beside the producer.", "")
        self.times_table(
            "step", cases, ["ours", "ours_fixed", "core", "core_cached", "roofline"],
            [("fixed ÷ ours", "ours_fixed", "ours"), ("core ÷ roofline", "core", "roofline"),
             ("cached ÷ roofline", "core_cached", "roofline"),
             ("ours ÷ core", "ours", "core")], self.step_get, losses=False)

    def split_ranges(self):
        """The split of the step (``step_split``) over the goals' cases, each
        ratio as its range across them: ``core`` ÷ roofline, ``cached``
        (core_cached) ÷ roofline, ``ours`` ÷ core; None where a case lacks
        a part."""
        cases = [f"{w}/float32/{o}" for o in STEP_GOALS for w in STEP_GOAL_WORKLOADS]
        pairs = {"core": ("core", "roofline"), "cached": ("core_cached", "roofline"),
                 "ours": ("ours", "core")}
        out = {}
        for name, (a, b) in pairs.items():
            rs = [ratio(self.step_get(c, a), self.step_get(c, b)) for c in cases]
            if not rs or any(r is None for r in rs):
                return None
            lo, hi = min(r.value for r in rs), max(r.value for r in rs)
            out[name] = _r(lo) if _r(lo) == _r(hi) else f"{_r(lo)}–{_r(hi)}"
        return out

    def step_peers(self):
        """The step's peers for its main tables: not the producer, not the
        peers that split ours (``step_split``)."""
        return [p for p in self.peers("step") if p != "producer" and p not in STEP_SPLIT]

    def user_step(self):
        """Table 1 and its companions: what a user of the optimizer times."""
        cases = self.cases("step")
        if cases:
            peers = self.step_peers()
            paths = {case: "; ".join(
                f"{PEER_LABELS[('step', p)]}: {e['step_path']}" for p in ("ours", "ours_unfused")
                for e in [self.info.get(("step", case, self.threads, p))]
                if e and "step_path" in e) for case in cases}
            self.w("## The step a user times", "",
                   f"### 1. {LAYER_TITLES['step']}", "",
                   "Scaled float32 gradients in, the variables updated.  Keras methods make "
                   "their gradients in the graph and torch copies them into `.grad`; making "
                   "them alone is timed before every sample and taken off.  torch is stepped "
                   "by `GradScaler` as a training loop does.  The roofline is the bytes the "
                   "fused step must move ("
                   + ", ".join(f"{OPTIMIZER_LABELS[o]} {b} B" for o, b in
                               STEP_BYTES_PER_PARAM.items())
                   + " per parameter, a read-only check of the gradients included) at the "
                   "bandwidth of the in-place multiply over 1 GiB"
                   + (" at the same thread count" if self.facts.get("roofline_threads") == "item"
                      else "") + " in this run.", "")
            ratios = [("ours ÷ roofline", "ours", "roofline"), ("ours ÷ stock", "ours", "stock"),
                      ("ours ÷ torch fused", "ours", "torch_fused"),
                      ("ours ÷ torch foreach", "ours", "torch_foreach")]
            alone = [c for c in cases if self.get("step/alone", c, "ours")]
            if alone:
                self.w(f"**Each peer in its own process** ({self.alone_method('step')}; the "
                       "figures the goals and the README use):", "")
                self.times_table(
                    "step", alone, [p for p in peers if self.get("step/alone", alone[0], p)]
                    + ["roofline"], ratios, self.step_get,
                    [("path taken", lambda c: paths[c])])
                self.w("**Side by side in one process** (the peers of a workload interleaved "
                       "round by round):", "")
            self.times_table(
                "step", cases, peers + ["roofline"], ratios,
                lambda c, p: self.step_get(c, p, alone=False),
                [("path taken", lambda c: paths[c])], losses=not alone)
            speedups = []
            for case in cases:
                x = speedup(self.get("step", case, "ours"), self.get("step", case, "stock"))
                if x is not None:
                    speedups.append(f"{case_label(case)} {_r(x)}")
            if speedups:
                self.w("stock ÷ ours (how many times faster ours is): "
                       + "; ".join(speedups) + ".", "")
            self.step_split(cases)
        mlp = [c for c in self.cases("fit") if c.startswith("mlp_")]
        if mlp:
            ident = self.records.get("fit_mlp", {})
            peers = [p for p in self.peers("fit") if p in ("ours", "ours_unfused", "stock")]
            self.w(f"### 2. {LAYER_TITLES['fit']} of a parameter-heavy model", "",
                   "A mixed_float16 MLP"
                   + (f" of {ident['params']:,} parameters, batch {ident['batch']}"
                      if ident else "")
                   + ", Adam: time per `train_on_batch`.", "")
            self.times_table("fit", mlp, peers,
                             [("ours ÷ stock", "ours", "stock")],
                             lambda c, p: self.get("fit", c, p))
            if ident:
                same = ", ".join(f"{PEER_LABELS[('fit', p)]}: "
                                 f"**{'bit-identical' if v else 'DIFFERENT'}**"
                                 for p, v in ident["identical"].items())
                self.w(f"Weights after {ident['steps']} steps from the same weights on the "
                       f"same batch, against stock Keras: {same}.", "")
        self.bert_fit()
        tiny = [c for c in cases if c.startswith(TRACING_GOAL_WORKLOAD + "/")]
        if tiny:
            peers = self.step_peers()
            self.w("### 3. Tracing: the first call of the step", "",
                   "The first call of each method before any timing: for Keras, tracing "
                   "`apply` and optimizing the graph (the gradients' producer included alike).",
                   "", "| workload | " + " | ".join(PEER_LABELS[("step", p)] for p in peers)
                   + " | ours ÷ stock |", "|---|" + "---:|" * (len(peers) + 1))
            for case in tiny:
                cells = [fmt_s(self.first[k]) if k in self.first else "—"
                         for k in (("step", case, self.threads, p) for p in peers)]
                r = self.first_ratio("step", case, "ours", "stock")
                self.w(f"| {case_label(case)} | " + " | ".join(cells)
                       + f" | {fmt_ratio(r)} |")
                a = self.first.get(("step", case, self.threads, "ours"))
                b = self.first.get(("step", case, self.threads, "stock"))
                if r is not None and a > SLOWER * b and a - b > FIRST_CALL_SLACK_S:
                    self.first_losses.append(("step", case, "ours", "stock", a, b))
            self.w("")
        checks = self.cases("check")
        if checks:
            peers = [p for p in self.peers("check") if p != "producer"]
            ours = [p for p in peers if p.startswith("ours")]
            self.w(f"### 4. {LAYER_TITLES['check']}", "",
                   "Gradients made in the graph, their producer's time taken off: stock Keras' "
                   "`is_finite` + `reduce_all` per tensor against `lossscale.ops.all_finite` "
                   "per tensor, over the whole list, and grouped where the package has "
                   "`all_finite_grouped`.", "")
            self.times_table("check", checks, peers,
                             [(f"{PEER_LABELS[('check', p)]} ÷ composite", p, "composite")
                              for p in ours],
                             lambda c, p: self.get("check", c, p))

    def bert_fit(self):
        """The KerasHub BERT classifier's ``fit`` step, with what share of it
        the optimizer is (the step less its forward and backward pass)."""
        cases = [c for c in self.cases("fit") if c.startswith("bert_classifier_")]
        if not cases:
            return
        ident = self.records.get(f"fit_{cases[0].split('/')[0]}", {})
        self.w("### 2b. A whole `fit` step of a KerasHub BERT classifier", "",
               "`keras_hub.models.BertTextClassifier` built from a config (random weights)"
               + (f", {ident['params']:,} parameters, a batch of {ident['batch']} × "
                  f"{ident['tokens']} tokens" if ident else "")
               + ", mixed_float16: time per `train_on_batch` (under gradient accumulation, "
               "the mean over a cycle of the steps that accumulate and the one that "
               "updates).  Its word-embedding gradient "
               "is an `IndexedSlices`.  *forward + backward alone* is the same pass without "
               "the optimizer; the optimizer's share is stock's step less it.", "")

        def share(case):
            step, rest = self.get("fit", case, "stock"), self.get("fit", case, "grads_only")
            return (f"{(step.median - rest.median) / step.median:.0%}"
                    if step and rest and step.median > 0 else "—")

        def cell_of(case):
            e = self.records.get(f"fit_{case.split('/')[0]}", {})
            same = e.get("identical", {}).get("ours")
            if same is None:
                return "—"
            cell = "bit-identical" if same else "**DIFFERENT**"
            checked = e.get("checked_batch", e.get("batch"))
            if checked != e.get("batch"):
                # Stock's own scatter is repeatable below 1,024 slices only.
                cell += f" (checked on {checked} sequences, {checked * e['tokens']:,} tokens)"
            return cell

        def path(case):
            e = self.records.get(f"fit_{case.split('/')[0]}", {})
            return f"`{e['step_path']}`" if e.get("step_path") else "—"

        peers = [p for p in ("ours", "stock", "grads_only") if p in self.peers("fit")]
        self.times_table("fit", cases, peers, [("ours ÷ stock", "ours", "stock")],
                         lambda c, p: self.get("fit", c, p),
                         [("optimizer's share of stock's step", share),
                          ("weights vs stock", cell_of), ("path taken", path)])

    def recipe_cases(self):
        """The recipe battery's cases in the order they ran."""
        return list(dict.fromkeys(c for (la, c, t, _p) in self.stats
                                  if la == "recipes" and t == self.threads))

    def recipe_info(self, case):
        """The extra info of the ``ours`` item of a recipe (any peer's if
        ours did not run)."""
        return (self.info.get(("recipes", case, self.threads, "ours"))
                or next((e for k, e in self.info.items() if k[:2] == ("recipes", case)), {}))

    def recipe_get(self, case, peer, alone=True):
        """As ``step_get``, for a recipe; ``roofline``: its own bytes."""
        if peer == "roofline":
            return self.roofline_for(self.recipe_info(case).get("moved_bytes"))
        return self.own_or_side("recipes", case, peer, alone)

    def recipes(self):
        """The recipe battery: per recipe, the path ours took, whether it stayed
        bit-identical to stock in the lockstep, and its apply time against
        stock Keras and torch's nearest equivalent.  Only where the run has it."""
        cases = self.recipe_cases()
        if not cases:
            return
        infos = {c: self.info.get(("recipes", c, self.threads, "ours"), {}) for c in cases}
        check = next((e["exactness"] for e in infos.values() if "exactness" in e), None)
        ours = [self.get("recipes", c, "ours") for c in cases]
        rounds = max((len(st.rounds) for st in ours if st), default=0)
        self.w("## Recipes", "",
               "Optimizers configured as published recipes set them, under the mixed_float16 "
               "policy, wrapped by ours and by stock `keras.optimizers.LossScaleOptimizer`.  "
               + (f"*Exact*: a lockstep of {check['steps']} steps of ours and stock in "
                  "`tf.function` on the same small variable list (an embedding table with an "
                  "`IndexedSlices` gradient with repeated indices for the sparse recipes), the "
                  f"gradients of step {check['overflow_step'] + 1} times infinity; every "
                  "variable and optimizer variable compared bit for bit after every step; "
                  "then the same on two small KerasHub models built from a config, a "
                  "`BertTextClassifier` (sparse embedding gradients, LayerNorm variables "
                  "named as BERT's recipes exclude them from weight decay) and a "
                  "`GPT2CausalLM` (tied embedding, dense gradient), trained with "
                  "`train_on_batch` from a scale whose first steps overflow.  "
                  if check else "")
               + "*Time*: `apply` in `tf.function` on scaled gradients made in the graph "
               "(making them alone taken off), the scale fixed; torch's nearest equivalent "
               "stepped by `GradScaler` on the same values in `.grad` (accumulating, its "
               "step adds each fresh gradient into `.grad`, the add its autograd does in "
               "backward, as ours adds it into its accumulator)"
               + (f"; {rounds} round{'s' if rounds > 1 else ''} per recipe." if rounds else "."),
               "")
        workloads_seen = {}
        for e in infos.values():
            if e:
                workloads_seen.setdefault(e["workload"], e)
        for name, e in workloads_seen.items():
            rows = e.get("embedding_rows")
            self.w(f"- {name}: {e['tensors']:,} gradients, {e['values']:,} values"
                   + (f", the {e['table'][0]:,} × {e['table'][1]:,} embedding's gradient "
                      f"`IndexedSlices` of {rows:,} token rows (dense for torch)"
                      if rows else ""))
        alone = self.has_alone("recipes")
        if alone:
            self.w("", "*Own processes*: the same items run again, "
                   f"{self.alone_method('recipes')}; the side-by-side ratios follow.")
        if any(e.get("moved_bytes") for e in infos.values()):
            self.w("", "*Roofline*: the bytes an updating step must move at least (every "
                   "gradient value read twice, for the finite check or the norm and for the "
                   "update, the embedding's gradient counted dense; every variable and every "
                   "value of the optimizer's state, its slots, EMA copies and accumulators, "
                   "read and written once) at the bandwidth of the in-place multiply over "
                   "1 GiB in this run.")
        self.w("", "| recipe | source | step_path | exact vs stock | ours, per step | "
               + ("ours ÷ stock, own processes | ours ÷ torch, own processes | " if alone else "")
               + "ours ÷ stock | ours ÷ torch | ours ÷ roofline | torch peer used |",
               "|---|---|---|---|---:|" + ("---:|---:|" if alone else "") + "---:|---:|---:|---|")
        self.recipe_exact = []
        for case in cases:
            e = infos[case] or next((i for k, i in self.info.items()
                                     if k[:2] == ("recipes", case)), {})
            ex = e.get("exactness")
            if ex is None:
                exact = "—"
            elif ex["exact"]:
                exact = "bit-identical"
            elif ex["mismatched_steps"]:
                steps = ", ".join(str(i + 1) for i in ex["mismatched_steps"])
                exact = f"**DIFFERENT** (steps {steps})"
            else:
                exact = "**DIFFERENT**"
            exact += real_models_note(ex)
            if ex is not None:
                self.recipe_exact.append((case.split("/")[0], ex["exact"]))
            ours = self.get("recipes", case, "ours")
            cells = []
            layers = (["recipes/alone"] if alone else []) + ["recipes"]
            for layer, peer in ((la, p) for la in layers for p in ("stock", "torch")):
                r = ratio(self.get(layer, case, "ours"), self.get(layer, case, peer))
                cells.append(fmt_ratio(r) if r is not None else
                             "n/a" if peer == "torch" and not e.get("torch_peer") else "—")
                if r is not None and layer == layers[0]:
                    entry = ("recipes", case, self.threads, "ours", peer, r.value)
                    if r.value > SLOWER:
                        self.losses.append(entry)
                    elif r.value >= FASTER:
                        self.ties.append(entry)
            cells.append(fmt_ratio(ratio(self.recipe_get(case, "ours"),
                                         self.recipe_get(case, "roofline"))))
            path = f"`{e['step_path']}`" if e.get("step_path") else "—"
            self.w(f"| {case.split('/')[0]} | {e.get('source', '—')} | {path} | {exact} | "
                   f"{cell(ours)} | " + " | ".join(cells) + " | "
                   f"{e.get('torch_peer') or 'n/a (torch has no equivalent)'} |")
        self.w("")

    def distributed(self):
        """The step under tf.distribute (``test_distributed.py``): Mirrored
        over two logical CPUs, and 1, 2, 4 worker processes, each step split
        into its parts."""
        rec = self.records.get("distributed")
        if not rec:
            return
        self.w("## Several replicas and workers", "",
               "A mixed_float16 ReLU MLP (no bias, 10 logits) trained with Adam in a custom "
               "loop (`strategy.run` of the forward and backward pass and `apply`, in "
               "`tf.function`), ours against stock `keras.optimizers.LossScaleOptimizer`, each "
               "strategy in its own processes; medians of samples of back-to-back calls.  "
               "*forward + backward* is that pass alone, *all-reduce* the strategy's "
               "all-reduce of a list shaped as the gradients alone, *update* what the whole "
               "step adds to both: the finite check, the unscale, the scale's update and the "
               "optimizer's.  Before timing, fresh models trained with ours and with stock "
               "must end bit-identical.", "")

        def row(label, r):
            s = r["seconds"]
            cells = [fmt_s(s[p][k]) for p in ("ours", "stock")
                     for k in ("step", "gradients", "all_reduce", "update")]
            share = s["ours"]["all_reduce"] / s["ours"]["step"]
            self.w(f"| {label} | {r.get('replicas', '—')} | {r['params']:,} | "
                   + " | ".join(cells) + f" | {share:.0%} | {_r(r['ours_vs_stock'])} |")

        self.w("| strategy | replicas | parameters | ours: step | ours: forward + backward | "
               "ours: all-reduce | ours: update | stock: step | stock: forward + backward | "
               "stock: all-reduce | stock: update | all-reduce's share of ours | "
               "stock ÷ ours |", "|---|---:|---:|" + "---:|" * 10)
        mirrored = rec.get("mirrored")
        if mirrored:
            row(f"MirroredStrategy, 2 logical CPUs, {mirrored['layers']} × "
                f"{mirrored['width']}", mirrored)
        for n, r in sorted(rec.get("workers", {}).items(), key=lambda kv: int(kv[0])):
            row(f"MultiWorkerMirroredStrategy, {n} worker{'s' if int(n) > 1 else ''} "
                "(the slowest)", r)
        self.w("", "The workers are processes on this machine's cores, which they share: the "
               "split says where a step's time goes, not how a cluster scales.", "")

    # -------------------------------------------------------- the tf_keras step

    def tf_keras_get(self, case, peer, alone=True):
        """The tf_keras step's ``Stat`` for ``peer`` (``own_or_side``)."""
        return self.own_or_side(TF_KERAS_STEP, case, peer, alone)

    def tf_keras_cases(self):
        """The tf_keras step's cases, workload by workload, legacy line first."""
        rank = {n: i for i, n in enumerate(workloads.LISTS)}
        order = {o: i for i, o in enumerate(TF_KERAS_OPTIMIZERS)}
        return sorted(self.cases(TF_KERAS_STEP),
                      key=lambda c: (rank.get(c.split("/")[0], 99), order.get(c.split("/")[2], 99)))

    def tf_keras_goals(self):
        """Issue 21's goals: stock tf_keras ÷ ours, per workload and optimizer."""
        out = []
        for name in STEP_GOAL_WORKLOADS:
            for optimizer in TF_KERAS_OPTIMIZERS:
                case = f"{name}/float32/{optimizer}"
                rule = optimizer.removeprefix("legacy_")
                stock = self.tf_keras_get(case, "stock")
                info = self.info.get((TF_KERAS_STEP, case, self.threads, "ours"), {})
                floor = (self.roofline_for(TF_KERAS_STEP_BYTES_PER_PARAM[rule] * info["values"])
                         if info.get("values") else None)
                out.append(Goal(f"tf_keras step (TF 2.4 loop), {case_label(case)}: "
                                "stock tf_keras ÷ ours",
                                speedup(self.tf_keras_get(case, "ours"), stock),
                                TF_KERAS_STEP_GOALS[rule], True, speedup(floor, stock)))
        return out

    def tf_keras_step(self):
        """The tf_keras step's table: times, ratios, the goal, the path ours
        took and the lockstep against stock.  Only where the run has it."""
        cases = self.tf_keras_cases()
        if not cases:
            return
        layer = TF_KERAS_STEP
        infos = {c: self.info.get((layer, c, self.threads, "ours"), {}) for c in cases}

        def goal(case, alone):
            x = speedup(self.tf_keras_get(case, "ours", alone),
                        self.tf_keras_get(case, "stock", alone))
            least = TF_KERAS_STEP_GOALS[case.split("/")[2].removeprefix("legacy_")]
            if x is None:
                return "—"
            return f"{_r(x)} (≥ {least:g}: {'met' if x >= least else '**not met**'})"

        def path(case):
            e = infos[case]
            return f"`{e['step_path']}`" if e.get("step_path") else "—"

        def exact(case):
            ex = infos[case].get("exactness")
            if ex is None:
                return "—"
            if ex["exact"]:
                return (f"bit-identical, {ex['steps']} steps (step {ex['overflow_step'] + 1} "
                        "overflows)")
            return ("**DIFFERENT** (steps "
                    + ", ".join(str(i + 1) for i in ex["mismatched_steps"]) + ")")

        self.w("## The tf_keras step: TensorFlow 2.4's custom loop", "",
               "Scaled float32 gradients made in the graph (making them alone timed before "
               "every sample and taken off), `opt.get_unscaled_gradients(grads)`, "
               "`opt.apply_gradients(zip(unscaled, variables))` in one `tf.function`, with "
               "`TF_USE_LEGACY_KERAS=1` (a child process per case), for "
               "`tf_keras.optimizers.legacy` and `tf_keras.optimizers` Adam, RMSprop and "
               "SGD-momentum; ours is `lossscale.LossScaleOptimizer`, stock "
               "`tf_keras.mixed_precision.LossScaleOptimizer`; torch is the step layer's "
               "(`GradScaler`, fused Adam and SGD, foreach for all three), one rule for both "
               "Keras lines.  The goal: stock ÷ ours at least "
               + ", ".join(f"{g:g} for {OPTIMIZER_LABELS[o]}" for o, g in
                           TF_KERAS_STEP_GOALS.items())
               + ", on both lines.  *Exact*: fresh ours and stock stepped together from zero "
               "variables, every variable and optimizer variable compared bit for bit after "
               "every step (full runs).", "")
        peers = [p for p in self.peers(layer) if p != "producer"]
        ratios = [(f"ours ÷ {PEER_LABELS[(layer, p)]}", "ours", p)
                  for p in ("stock", "torch_fused", "torch_foreach") if p in peers]
        alone = [c for c in cases if self.get(f"{layer}/alone", c, "ours")]
        if alone:
            self.w(f"**Each peer in its own process** ({self.alone_method(layer)}; the "
                   "figures the goals use):", "")
            self.times_table(layer, alone,
                             [p for p in peers if self.get(f"{layer}/alone", alone[0], p)],
                             ratios, self.tf_keras_get,
                             [("stock ÷ ours (goal)", lambda c: goal(c, True)),
                              ("path taken", path), ("exact vs stock", exact)])
            self.w("**Side by side in one process** (the peers of a case interleaved round by "
                   "round):", "")
        self.times_table(layer, cases, peers, ratios,
                         lambda c, p: self.tf_keras_get(c, p, alone=False),
                         [("stock ÷ ours" + ("" if alone else " (goal)"),
                           lambda c: goal(c, False)),
                          ("path taken", path), ("exact vs stock", exact)], losses=not alone)

    # -------------------------------------------------------- README headline

    def readme_headline(self):
        """The README's performance headline, as lines of Markdown: what lies
        between its ``headline`` markers, generated from this run alone."""
        f = self.facts
        t = self.threads
        out = [GENERATED_NOTE, ""]

        def rv(layer, case, ours, peer, threads=None):
            return ratio(self.get(layer, case, ours, threads), self.get(layer, case, peer, threads))

        def cells(*rs):
            return " / ".join(fmt_ratio(r, spread=False) for r in rs)

        rounds = f.get("rounds")
        out.append(
            f"From the committed run of `make bench` ({f.get('cpu', 'unknown CPU')}, "
            f"{f.get('cores_available')} cores, kernel set `{f.get('simd_level')}`, "
            f"{t} thread{'s' if t > 1 else ''}; TensorFlow {f.get('tensorflow')}, Keras "
            f"{f.get('keras')}, torch {f.get('torch') or 'absent'}).  Time ratios **ours ÷ "
            "peer**: below 1 ours is faster"
            + (f"; the median of the {rounds} rounds' ratios" if rounds else "")
            + "; where the gradients are made in the graph, making them is timed apart "
            "and taken off.")
        out += ["", "The step a user times, `LossScaleOptimizer.apply` on scaled float32 "
                "gradients made in the graph:", "",
                "| | path | ours ÷ stock Keras | ours ÷ torch `fused=True` + GradScaler "
                "| ours ÷ roofline |", "|---|---|---:|---:|---:|"]
        for optimizer in ("adam", "sgdm"):
            for name in STEP_GOAL_WORKLOADS:
                case = f"{name}/float32/{optimizer}"
                if not self.get("step", case, "ours"):
                    continue
                out.append(f"| {OPTIMIZER_LABELS[optimizer]}, {case_label(case).split(' ')[0]}"
                           f" ({workloads.values(name) / 1e6:.1f}M values) | "
                           f"{self.step_path(case)} | "
                           + " | ".join(fmt_ratio(ratio(self.step_get(case, "ours"),
                                                        self.step_get(case, peer)), spread=False)
                                        for peer in ("stock", "torch_fused", "roofline"))
                           + " |")
        tiny = [f"{TRACING_GOAL_WORKLOAD}/float32/{o}" for o in ("adam", "sgdm")]
        if all(self.get("step", c, "ours") for c in tiny):
            out.append(f"| Adam / SGD-momentum, {case_label(tiny[0]).split(' float32')[0]} | "
                       + " / ".join(self.step_path(c) for c in tiny) + " | "
                       + " | ".join(cells(*(ratio(self.step_get(c, "ours"),
                                                  self.step_get(c, peer)) for c in tiny))
                                    for peer in ("stock", "torch_fused"))
                       + " | — |")
        bw = rv("core", f"{workloads.BIG}/float32", "ours", "roofline")
        out += ["", "The roofline is the bytes the step must move ("
                + ", ".join(f"{b} B per value for {OPTIMIZER_LABELS[o]}"
                            for o, b in sorted(STEP_BYTES_PER_PARAM.items(),
                                               key=lambda kv: kv[1]))
                + (f") at the bandwidth of an in-place `np.multiply` over 1 GiB on {t} "
                   f"thread{'s' if t > 1 else ''} (the step's own count), measured in this run"
                   + (f"; `lossscale.core` streams the same 1 GiB in {_r(bw.value)} of its "
                      "time." if bw else ".")
                   if f.get("roofline_threads") == "item" else
                   ") at the bandwidth of numpy's single-threaded in-place `np.multiply` over "
                   "1 GiB"
                   + (f"; `lossscale.core` at {t} threads streams the same 1 GiB in "
                      f"{_r(bw.value)} of its time, hence ratios below 1." if bw and t > 1
                      else "."))]
        split = self.split_ranges()
        if split:
            out[-1] += (" Where the time goes (REPORT.md): the same fused step through "
                        "`lossscale.core` over numpy buffers takes " + split["core"]
                        + " of the roofline, fed from the cache instead " + split["cached"]
                        + ", and ours inside TensorFlow " + split["ours"]
                        + " of `lossscale.core`.")
        rows = []

        def row(what, *rs):
            if any(r is not None for r in rs):
                rows.append(f"| {what} | {cells(*rs)} |")

        mlp = "mlp_4096x3/mixed_float16"
        ident = self.records.get("fit_mlp", {})
        same = ident.get("identical", {}).get("ours")
        row(f"a whole `fit` step, {case_label(mlp).replace('MLP ', '')} MLP"
            + (f" ({ident['params'] / 1e6:.1f}M parameters)" if ident else "")
            + ", Adam ÷ stock Keras" + (" (weights bit-identical)" if same else ""),
            rv("fit", mlp, "ours", "stock"))
        row("tracing `apply` over 2,000 variables, Adam / SGD-momentum ÷ stock Keras",
            *(self.first_ratio("step", c, "ours", "stock") for c in tiny))
        check = self.best_check()
        row(f"finite check alone ({PEER_LABELS[('check', check)]}), gradients made in the "
            "graph, ResNet-50 / 2,000 × 64 ÷ stock composite",
            *(rv("check", f"{w}/float32", check, "composite")
              for w in ("resnet50", TRACING_GOAL_WORKLOAD)))
        row("`lossscale.core`, ResNet-50 float32, 1 thread ÷ in-place `np.multiply` "
            "(memory roofline)", rv("core", "resnet50/float32", "ours", "roofline", 1))
        dtypes = ("float32", "float16", "bfloat16")
        for threads in sorted({1, t}):
            row(f"`lossscale.core`, ResNet-50 {' / '.join(dtypes)}, {threads} thread"
                f"{'s' if threads > 1 else ''} ÷ torch `_amp_foreach_non_finite_check_and_"
                "unscale_`", *(rv("core", f"resnet50/{d}", "ours", "torch", threads)
                               for d in dtypes))
        row(f"`lossscale.core`, 2,000 tiny float32 tensors, {t} thread{'s' if t > 1 else ''}"
            " ÷ numpy loop / ÷ torch",
            *(rv("core", "tiny_2000x64/float32", "ours", p) for p in ("numpy", "torch")))
        row("TF op in `tf.function`, ResNet-50 / BERT-base / 2,000 tiny float32 ÷ stock "
            "composite", *(rv("tf_op", f"{w}/float32", "ours", "composite")
                           for w in workloads.LISTS))
        row("`LossScale.update`, ResNet-50 / 2,000 tiny float32 ÷ "
            "`tf.compat.v1.mixed_precision.DynamicLossScale`",
            *(rv("loss_scale", f"{w}/float32", "ours", "stock")
              for w in ("resnet50", TRACING_GOAL_WORKLOAD)))
        mem, tr = self.memory_cells(), self.training_cells()
        if mem:
            rows.append(f"| peak memory one step adds to a {mem[0]} gradient made in the "
                        f"step: ours / stock composite | {mem[1]} |")
        if tr:
            rows.append(f"| digits CNN, {tr[0]} epochs: test accuracy stock / ours | {tr[1]} |")
        mirrored = self.records.get("distributed", {}).get("mirrored")
        if mirrored:
            rows.append(f"| a whole custom-loop step under `MirroredStrategy` (2 replicas), "
                        f"{mirrored['layers']} × {mirrored['width']} MLP, Adam ÷ stock Keras "
                        f"| {_r(1 / mirrored['ours_vs_stock'])} |")
        bert = [c for c in self.cases("fit") if c.startswith("bert_classifier_")]
        for case in bert:
            r = rv("fit", case, "ours", "stock")
            if r is not None:
                rows.append(f"| a whole `fit` step, KerasHub BERT classifier, "
                            f"{case.split('/')[0].split('bert_classifier_')[1]} ÷ stock Keras "
                            f"| {fmt_ratio(r, spread=False)} |")
        if rows:
            out += ["", "| | ours ÷ peer |", "|---|---:|", *rows]
        out += self.readme_recipes()
        out += ["", *self.readme_summary(tiny)]
        return out

    def readme_recipes(self):
        """The recipe battery in the headline: path, exactness and the three
        ratios of each recipe (own processes where the run has them)."""
        cases = self.recipe_cases()
        if not cases:
            return []
        out = ["", "Published recipes' optimizers (`apply` on ResNet-50-shaped gradients, "
               "BERT-base with an `IndexedSlices` embedding gradient for the sparse ones; "
               "`bench/results/REPORT.md` has their sources and torch peers):", "",
               "| recipe | path | exact vs stock | ours ÷ stock Keras | ours ÷ torch | "
               "ours ÷ roofline |", "|---|---|---|---:|---:|---:|"]
        for case in cases:
            e = self.recipe_info(case)
            ex = e.get("exactness")
            path = e.get("step_path", "—")
            path = "fused" if path.startswith("fused") else "stock" if path.startswith(
                "stock") else path
            out.append(f"| {case.split('/')[0]} | {path} | "
                       + ("—" if ex is None else "bit-identical" if ex["exact"]
                          else "**DIFFERENT**") + " | "
                       + " | ".join(fmt_ratio(ratio(self.recipe_get(case, "ours"),
                                                    self.recipe_get(case, peer)), spread=False)
                                    for peer in ("stock", "torch", "roofline")) + " |")
        return out

    def step_path(self, case):
        """The path ``ours`` took on a step workload, as ``step_path`` said it."""
        e = self.info.get(("step", case, self.threads, "ours"), {})
        return f"`{e['step_path']}`" if "step_path" in e else "—"

    def memory_cells(self):
        """(the gradient's size, "ours% / composite%" of the peak memory one
        step adds to a gradient made in it), or None without a memory run."""
        mem = self.records.get("memory")
        if not mem:
            return None
        inside = mem["situations"]["inside"]
        return (workloads.size_label(mem["gradient_bytes"]),
                f"{inside['native']['fraction_of_gradient'] * 100:.0f}% / "
                f"{inside['composite']['fraction_of_gradient'] * 100:.0f}%")

    def training_cells(self):
        """(the float32 run's epochs, "stock / ours" test accuracy of the
        digits training), or None without a training run."""
        tr = self.records.get("training")
        if not tr:
            return None
        runs = tr["runs"]
        return (runs["float32"]["epochs"], f"{runs['mixed_stock']['test_accuracy']:.4f} / "
                                           f"{runs['mixed_lossscale']['test_accuracy']:.4f}")

    def readme_summary(self, tiny):
        """The headline's closing paragraph: speed-ups and losses, read from this run."""
        parts = []
        for optimizer in ("adam", "sgdm"):
            cases = [f"{w}/float32/{optimizer}" for w in STEP_GOAL_WORKLOADS]
            ups = [x for c in cases for x in [speedup(self.step_get(c, "ours"),
                                                      self.step_get(c, "stock"))] if x]
            torch = [r.value for c in cases for r in [ratio(self.step_get(c, "ours"),
                                                            self.step_get(c, "torch_fused"))]
                     if r is not None]
            if not ups:
                continue
            label = "Adam" if optimizer == "adam" else "SGD with momentum"
            text = (f"{label} steps {self._span(ups, lambda x: f'{x:.1f}')}× faster than "
                    "stock Keras on ResNet-50 and BERT-base")
            if torch:
                span = f"(ours ÷ torch {self._span(torch, _r)})"
                if max(torch) < FASTER:
                    text += f", faster than torch's fused CPU optimizer {span}"
                elif min(torch) > SLOWER:
                    text += f", slower than torch's fused CPU optimizer {span}"
                elif FASTER <= min(torch) and max(torch) <= SLOWER:
                    text += f", level with torch's fused CPU optimizer {span}"
                else:
                    text += (", and against torch's fused CPU optimizer faster on one of "
                             f"them and slower on the other {span}")
            parts.append(text)
        lines = []
        if parts:
            lines += ["; ".join(parts) + ".", ""]
        losses = []
        big = [f"{w}/float32/{o}" for w in STEP_GOAL_WORKLOADS for o in ("adam", "sgdm")]
        for case in big + list(tiny):
            for peer in ("torch_fused", "torch_foreach"):
                r = ratio(self.step_get(case, "ours"), self.step_get(case, peer))
                if r is not None and r.value > SLOWER:
                    losses.append(f"{case_label(case).split(' float32')[0]} "
                                  f"{OPTIMIZER_LABELS[case.split('/')[2]]} ÷ "
                                  f"{PEER_LABELS[('step', peer)]} {_r(r.value)}")
        if losses:
            lines += ["Where the step loses in this run: " + "; ".join(losses) + ".", ""]
        return lines[:-1]

    # -------------------------------------------------------- sections

    def header(self):
        f = self.facts
        quick = " (QUICK subset)" if f.get("quick") else ""
        self.w(f"# lossscale benchmark report{quick}", "",
               "Every implementation below ran in one `make bench` run, side by side on the "
               "same data at the same thread count, interleaved round by round.  Times are "
               "medians with <sub>min–max</sub> over every sample; ratios are **ours ÷ peer** "
               f"(time: below 1 ours is faster; above {SLOWER:g} in bold, ours is slower), taken "
               "round by round from that round's medians: the median of the rounds' ratios "
               "with <sub>their range</sub>.", "")
        if f:
            self.w("## Machine and method", "",
                   f"- CPU: {f.get('cpu')} ({f.get('arch')}), {f.get('cores_available')} cores "
                   f"available, last-level cache {f.get('last_level_cache')}, memory "
                   f"{f.get('memory')}"
                   + (f", transparent huge pages `{f['transparent_huge_pages']}`"
                      if f.get("transparent_huge_pages") else ""),
                   f"- lossscale kernel set chosen: `{f.get('simd_level')}` (best on this CPU: "
                   f"`{f.get('simd_best')}`); TensorFlow op library: {f.get('native_op')}",
                   f"- threads pinned: **{f.get('threads')}** for TensorFlow's intra- and "
                   f"inter-op pools, `lossscale.core` and torch"
                   + (" (torch intra-/inter-op: {}/{})".format(*f["torch_threads"])
                      if f.get("torch_threads") else "")
                   + "; the numpy layer is also run at "
                   f"{', '.join(map(str, f.get('core_threads', [])))} "
                   + ("(the numpy peer is single-threaded whatever the setting; the roofline's "
                      "multiply runs on as many threads as the item)"
                      if f.get("roofline_threads") == "item"
                      else "(numpy itself is single-threaded whatever the setting)"),
                   f"- versions: Python {f.get('python')}, numpy {f.get('numpy')}, TensorFlow "
                   f"{f.get('tensorflow')}, Keras {f.get('keras')}, torch "
                   f"{f.get('torch') or 'absent'}, matplotlib {f.get('matplotlib') or 'absent'}; "
                   f"pytest-benchmark {self.raw.get('version')}",
                   f"- method: per workload, {f.get('rounds')} rounds; in each round every "
                   f"method (order rotated) is warmed up, then timed "
                   f"{f.get('samples_per_round')} times, each sample "
                   + (f"at least {f['min_sample_s'] * 1e3:g} ms of " if "min_sample_s" in f
                      else "")
                   + f"back-to-back calls after a {f.get('settle_s', 0) * 1e3:g} ms pause (torch's "
                   "OpenMP workers spin after a parallel region and would otherwise steal the "
                   "next method's cores); an optimizer that accumulates gradients is timed over "
                   "whole cycles of its calls, one update in each",
                   f"- load average {f.get('loadavg_start')} at the start, "
                   f"{f.get('loadavg_end')} at the end; the run took "
                   f"{f.get('wall_s', 0) / 60:.1f} min",
                   *self.layer_processes(),
                   f"- raw results: `{os.path.basename(self.path)}` (pytest-benchmark JSON, every "
                   "sample kept; `extra_info` says what each one is)", "")
        skipped = self.records.get("skipped", [])
        if skipped:
            self.w("Skipped in this run:", "", *[f"- {s}" for s in skipped], "")

    def layer_processes(self):
        """A line on the processes the layers ran in (``bench/run.py``), for
        runs that say."""
        runs = self.facts.get("layer_processes")
        if not runs:
            return []
        return ["- each layer ran in a pytest process of its own (`bench/run.py`); their "
                "minutes and peak resident size (of the process and its children): "
                + ", ".join(f"{layer} {r['wall_s'] / 60:.1f} min {r['peak_rss_gib']:.1f} GiB"
                            + ("" if r.get("exit") in (0, 5) else f" (exit {r['exit']})")
                            + (" (after a resume)" if r.get("resumed") else "")
                            for layer, r in runs.items())
                + ("; the run was stopped and resumed (`bench/run.py --resume`): the layers "
                   "marked ran in the second invocation, the others in the first"
                   if any(r.get("resumed") for r in runs.values()) else "")]

    def headline(self):
        t = self.threads
        rows = []

        def add(what, layer, case, ours, peer, threads=None):
            r = ratio(self.get(layer, case, ours, threads), self.get(layer, case, peer, threads))
            if r is not None:
                rows.append((what, r))

        rows.extend(self.lead_rows())

        add("numpy layer, ResNet-50 float32, 1 thread: ours ÷ roofline", "core",
            "resnet50/float32", "ours", "roofline", 1)
        for threads in sorted({1, t}):
            for dtype in ("float32", "float16", "bfloat16"):
                add(f"numpy layer, ResNet-50 {dtype}, {threads} thread"
                    f"{'s' if threads > 1 else ''}: ours ÷ torch", "core",
                    f"resnet50/{dtype}", "ours", "torch", threads)
        add(f"numpy layer, 1 GiB float32, {t} threads: ours ÷ roofline", "core",
            f"{workloads.BIG}/float32", "ours", "roofline")
        add(f"numpy layer, 2,000 tiny float32, {t} threads: ours ÷ numpy loop", "core",
            "tiny_2000x64/float32", "ours", "numpy")
        add(f"numpy layer, 2,000 tiny float32, {t} threads: ours ÷ torch", "core",
            "tiny_2000x64/float32", "ours", "torch")
        for case, label in (("resnet50/float32", "ResNet-50 float32"),
                            ("bert_base/float32", "BERT-base float32"),
                            ("tiny_2000x64/float32", "2,000 tiny float32")):
            add(f"TF op in tf.function, {label}: ours ÷ TF composite", "tf_op", case, "ours",
                "composite")
        add("TF op eager, ResNet-50 float32: ours ÷ TF composite", "tf_op", "resnet50/float32",
            "ours_eager", "composite_eager")
        add("TF op in tf.function, ResNet-50 float32: ours ÷ torch", "tf_op",
            "resnet50/float32", "ours", "torch")
        add("LossScale.update, ResNet-50 float32: ours ÷ tf.compat.v1", "loss_scale",
            "resnet50/float32", "ours", "stock")
        add("LossScale.update, 2,000 tiny float32: ours ÷ tf.compat.v1", "loss_scale",
            "tiny_2000x64/float32", "ours", "stock")
        add("LossScaleOptimizer.apply, ResNet-50 float32: ours ÷ stock Keras", "optimizer",
            "resnet50/float32", "ours", "stock")
        add("LossScaleOptimizer.apply, BERT-base float32: ours ÷ stock Keras", "optimizer",
            "bert_base/float32", "ours", "stock")
        add("fit step, digits CNN mixed_float16: ours ÷ stock Keras", "fit",
            "digits_cnn/mixed_float16", "ours", "stock")
        self.headline_rows = rows
        self.w("## Headline", "", "| | ours ÷ peer (time) | |", "|---|---:|---|")
        for what, r in rows:
            verdict = (f"{1 / r.value:.1f}× faster" if r.value < FASTER else
                       f"tie (within {percent(SLOWER)})" if r.value <= SLOWER
                       else f"{r.value:.2f}× slower")
            self.w(f"| {what} | {fmt_ratio(r)} | {verdict} |")
        mem, tr = self.memory_cells(), self.training_cells()
        if mem:
            self.w(f"| peak memory added, {mem[0]} gradient made in the step: ours / TF "
                   f"composite | {mem[1]} | of the gradient |")
        if tr:
            record = self.records["training"]
            self.w(f"| digits training: test accuracy stock / ours | {tr[1]} | "
                   f"{'equal' if record['accuracy_equal'] else 'DIFFERENT'}"
                   f"{', weights bit-identical' if record['weights_identical'] else ''} |")
        self.w("")

    def layer_table(self, layer, threads=None, title=None, note=None):
        cases = self.cases(layer, threads)
        if not cases:
            return
        peers = self.peers(layer)
        cols = [PEER_LABELS.get((layer, p), p) for p in peers]
        rcols = [c for c in RATIOS[layer] if c[1] in peers or c[1] == "roofline"]
        self.w(f"### {title or LAYER_TITLES[layer]}", "")
        if note:
            self.w(note, "")
        gross = rcols[0] if layer in NET else None
        self.w("| workload | " + " | ".join(cols) + " | "
               + " | ".join(f"ours {c[2]}" if not c[0].endswith("eager") else c[2]
                            for c in rcols)
               + (f" | ours {gross[2]}, making the gradients included" if gross else "") + " |",
               "|---|" + "---:|" * (len(cols) + len(rcols) + (1 if gross else 0)))
        for case in cases:
            row = [cell(self.get(layer, case, p, threads)) for p in peers]
            rs = []
            if gross:
                a, b = (self.get(layer, case, p, threads) for p in gross[:2])
                g = ratio(a.gross or a if a else None, b.gross or b if b else None)
                gross_cell = fmt_ratio(g)
            for ours, peer, label in rcols:
                r = ratio(self.get(layer, case, ours, threads),
                          self.get(layer, case, peer, threads))
                rs.append(fmt_ratio(r))
                if r is not None and peer != "roofline":
                    entry = (layer, case, threads or self.threads, ours, peer, r.value)
                    if r.value > SLOWER:
                        self.losses.append(entry)
                    elif r.value >= FASTER:
                        self.ties.append(entry)
            if gross:
                rs.append(gross_cell)
            self.w(f"| {case_label(case)} | " + " | ".join(row) + " | " + " | ".join(rs) + " |")
        self.w("")

    def sweep_table(self):
        core_threads = self.facts.get("core_threads") or [self.threads]
        cols = [("core", p, t) for t in core_threads for p in self.peers("core")]
        cols += [("tf_op", p, self.threads) for p in self.peers("tf_op") if p != "producer"]
        sizes = set()
        for layer, _p, t in cols:
            sizes |= {int(c.split("/")[0][6:]) for c in self.cases(layer, t, sweep=True)}
        if not sizes:
            return
        if self.get("core", f"{workloads.BIG}/float32", "ours"):
            sizes.add(workloads.GIB)
        self.w("### Throughput against tensor size (one float32 tensor)", "",
               "GB/s counts the bytes read plus written, 2 × the tensor's size, whatever an "
               "implementation does on the way (the TF composite also writes a boolean "
               "temporary).  TensorFlow methods here take a ready-made tensor the caller "
               "keeps, so both write a fresh output; the 1 GiB row of the numpy layer is the "
               "1 GiB workload above.", "")
        for part, title in (("core", "numpy layer"), ("tf_op", "TensorFlow layer")):
            pc = [c for c in cols if c[0] == part]
            if not pc:
                continue
            multi = part == "core" and len(core_threads) > 1
            self.w(f"{title}:", "",
                   "| size | " + " | ".join(
                       PEER_LABELS.get((la, p), p) + (f", {t} thr" if multi else "")
                       for la, p, t in pc) + " |",
                   "|---|" + "---:|" * len(pc))
            for size in sorted(sizes):
                if part == "tf_op" and size >= workloads.GIB:
                    continue
                case = (f"{workloads.sweep_name(size)}/float32" if size < workloads.GIB
                        else f"{workloads.BIG}/float32")
                cells = []
                for layer, peer, t in pc:
                    st = self.get(layer, case, peer, t)
                    cells.append(f"{2 * size / st.median / 1e9:.2f}"
                                 if st and st.median > 0 else "—")
                self.w(f"| {workloads.size_label(size)} | " + " | ".join(cells) + " |")
                for ours, peer, _label in RATIOS[part]:
                    if peer == "roofline":
                        continue
                    for t in (core_threads if part == "core" else [self.threads]):
                        r = ratio(self.get(part, case, ours, t), self.get(part, case, peer, t))
                        if r is not None and r.value > SLOWER:
                            self.sweep_losses.setdefault((part, t, ours, peer), []).append(
                                (size, r.value))
            self.w("")

    def first_calls(self):
        """The one-off cost of the first call of every method (tracing a
        ``tf.function``, creating kernels), from the first round."""
        rows = []
        for layer in ("tf_op", "loss_scale", "optimizer", "fit"):
            for case in self.cases(layer):
                cells = {}
                for peer in self.peers(layer):
                    first = self.first.get((layer, case, self.threads, peer))
                    if first is not None:
                        cells[peer] = first
                if cells:
                    rows.append((layer, case, cells))
        if not rows:
            return
        self.w("### First call: tracing and set-up, paid once per function", "",
               "The first call of each method, before any timing (for `tf.function`: "
               "tracing and graph optimization, with the gradients' producer included "
               "alike in every method).", "",
               "| layer | workload | " + " | ".join(
                   ["ours", "stock / composite", "ours eager", "stock eager"]) + " |",
               "|---|---|---:|---:|---:|---:|")
        for layer, case, cells in rows:
            for ours, peer in (("ours", "stock"), ("ours", "composite"),
                               ("ours_eager", "stock_eager"), ("ours_eager", "composite_eager")):
                if ours in cells and peer in cells and cells[ours] > SLOWER * cells[peer] \
                        and cells[ours] - cells[peer] > FIRST_CALL_SLACK_S:
                    self.first_losses.append((layer, case, ours, peer, cells[ours], cells[peer]))

            def c(*names):
                for n in names:
                    if n in cells:
                        return fmt_s(cells[n])
                return "—"
            short = {"tf_op": "TF op", "loss_scale": "`LossScale.update`",
                     "optimizer": "`LossScaleOptimizer.apply`",
                     "fit": "`fit` epoch" if case.startswith("digits_cnn/")
                     else "`train_on_batch`"}[layer]
            self.w(f"| {short} | "
                   f"{case_label(case)} | {c('ours')} | {c('stock', 'composite')} | "
                   f"{c('ours_eager')} | {c('stock_eager', 'composite_eager')} |")
        self.w("")

    def memory(self):
        mem = self.records.get("memory")
        if not mem:
            return
        self.w(f"### Peak memory one step adds, one {workloads.size_label(mem['gradient_bytes'])} "
               "float32 gradient", "",
               "Each method in its own process; the peak resident memory during the step "
               "minus the memory before it (and, for a gradient made in the step, minus what "
               "making it costs alone), as a fraction of the gradient's size.", "")
        methods = [m for m in ("native", "composite", "composite_check_first")
                   if m in next(iter(mem["situations"].values()))]
        label = {"native": "ours", "composite": "TF composite (multiply, then check: TF 2.4)",
                 "composite_check_first": "TF composite (check, then divide: Keras 3)"}
        self.w("| gradient | " + " | ".join(label[m] for m in methods) + " |",
               "|---|" + "---:|" * len(methods))
        for situation, rows in mem["situations"].items():
            name = {"inside": "made inside the step",
                    "argument": "passed in, kept alive"}[situation]
            self.w(f"| {name} | " + " | ".join(
                f"{rows[m]['fraction_of_gradient'] * 100:.1f}%" for m in methods) + " |")
        self.w("", "A gradient made in the step (as backprop makes it) is a buffer nobody else "
               "reads: the fused op writes the unscaled values over it and adds nothing. "
               "TensorFlow's own `Mul` also reuses such a buffer, so TF 2.4's order adds its "
               "`is_finite` temporary (1 byte per value); Keras 3's order divides while the "
               "input is still needed by the check's consumers and adds a whole copy.  A "
               "gradient the caller keeps cannot be overwritten by anyone.", "")

    def training(self):
        tr = self.records.get("training")
        if not tr:
            return
        runs = tr["runs"]
        self.w("## A real training run: digits CNN", "",
               f"{tr['dataset']}, batch {tr['batch']}, SGD (0.05, momentum 0.9), "
               f"{runs['float32']['epochs']} epochs, same seed and initial weights for all "
               f"three; loss scale from 2^15, growth every {tr['growth_steps']} steps "
               "(`bench/train_digits.py`).", "",
               "| run | test accuracy | test loss | skipped steps | final loss scale | "
               "step time, median <sub>min–max</sub> |", "|---|---:|---:|---:|---:|---:|")
        names = {"float32": "float32", "mixed_stock": "mixed_float16, stock Keras optimizer",
                 "mixed_lossscale": "mixed_float16, lossscale optimizer"}
        for kind, r in runs.items():
            final = "—"
            if r["loss_scale"]:
                v = r["loss_scale"][-1]
                e = math.frexp(v)[1] - 1
                final = f"2^{e}" if v == 2.0 ** e else f"{v:g}"
            self.w(f"| {names[kind]} | {r['test_accuracy']:.4f} | {r['test_loss']:.4f} | "
                   f"{r['skipped_steps'] if r['loss_scale'] else '—'} | {final} | "
                   f"{r['step_ms_median']:.2f} ms <sub>{r['step_ms_min']:.2f}–"
                   f"{r['step_ms_max']:.2f}</sub> |")
        equal = "equal" if tr["accuracy_equal"] else "DIFFERENT"
        self.w("", f"- accuracy, stock vs ours: **{equal}**"
               f"; final weights bit-identical: **{tr['weights_identical']}**; loss-scale "
               f"trajectories identical: **{tr['scales_identical']}**.",
               "- Step times here include Keras' per-step callback overhead; on a CPU, "
               "float16 layers are slower than float32 ones (there is no float16 arithmetic "
               "to gain from, only casts), so this run is about correctness and the "
               "loss-scale trajectory, not speed.", "")
        if self.plots.get("training"):
            self.w(f"![loss scale and training loss]({self.plots['training']})", "")

    def where_we_lose(self):
        self.w("## Where we lose", "")
        if not self.losses and not self.sweep_losses and not self.first_losses:
            self.w(f"Nowhere in this run is ours more than {percent(SLOWER)} slower than a "
                   "peer.", "")
        else:
            self.w(f"Every cell above where ours is more than {percent(SLOWER)} slower than "
                   "a peer:", "")
            for row in self.losses:
                self.w(ratio_line(*row))
            for layer, case, ours, peer, a, b in self.first_losses:
                self.w(f"- first call (tracing, set-up), {LAYER_TITLES[layer].split(':')[0]}, "
                       f"{case_label(case)}: {PEER_LABELS.get((layer, ours), ours)} "
                       f"{fmt_s(a)} against {PEER_LABELS.get((layer, peer), peer)} {fmt_s(b)}")
            for (layer, threads, ours, peer), pts in self.sweep_losses.items():
                self.w(f"- {LAYER_TITLES[layer].split(':')[0]}, one float32 tensor, "
                       f"{threads} thread{'s' if threads > 1 else ''}: "
                       f"{PEER_LABELS.get((layer, ours), ours)} ÷ "
                       f"{PEER_LABELS.get((layer, peer), peer)} = "
                       + ", ".join(f"{r:.2f} at {workloads.size_label(n)}" for n, r in pts))
            self.w("")
        if self.ties:
            self.w(f"Ties, where ours is within {percent(SLOWER)} of a peer:", "")
            for row in self.ties:
                self.w(ratio_line(*row))
            self.w("")
        self.w("Why, where it is understood:", "", *self.why(), "")

    # -------------------------------------------------------- measured prose

    def _medians(self, layer, cases, peers, threads=None, gross=False):
        out = []
        for case in cases:
            for peer in peers:
                st = self.get(layer, case, peer, threads)
                if st is not None and gross:
                    st = st.gross
                if st is not None and st.median > 0:
                    out.append(st.median)
        return out

    def _ratios(self, layer, cases, ours, peer, threads=None):
        rs = (ratio(self.get(layer, c, ours, threads), self.get(layer, c, peer, threads))
              for c in cases)
        return [r.value for r in rs if r is not None]

    @staticmethod
    def _span(xs, fmt):
        lo, hi = fmt(min(xs)), fmt(max(xs))
        return lo if lo == hi else f"{lo}–{hi}"

    def why(self):
        """The explanations under "Where we lose"; every figure in them is
        read from this run."""
        out = ["- **Memory-bound float32 lists.** A list larger than the cache is one read and "
               "one write of every byte whoever does it: ours, torch and the in-place multiply "
               "all sit at the machine's bandwidth, and ratios there are ties within the noise."
               + ("" if self.facts.get("roofline_threads") == "item" else
                  " numpy's roofline is single-threaded, so at more threads ours can go "
                  "below it.")]
        # The lists larger than the cache: 2,000 tiny tensors are numpy's call
        # overhead, not a roofline.
        lists16 = [c for c in self.cases("core", 1) if c.split("/")[1] != "float32"
                   and not c.startswith(("tiny_", workloads.BIG))]
        roof = self._ratios("core", lists16, "ours", "roofline", 1)
        if roof:
            ahead = [r for peer in ("numpy", "torch")
                     for r in self._ratios("core", lists16, "ours", peer, 1)]
            out.append(
                "- **16-bit lists against the roofline.** The roofline for float16 and bfloat16 "
                "is a float32 multiply over the same bytes; ours converts every value to "
                "float32 and back, and on one thread its ours ÷ roofline is "
                f"{self._span(roof, _r)}"
                + (f", while ours ÷ numpy and ours ÷ torch are at most {_r(max(ahead))}."
                   if ahead else "."))
        bert = [c for c in self.cases("tf_op") if c.startswith("bert_base/")]
        net = self._medians("tf_op", bert, ("ours", "composite"))
        gross = self._medians("tf_op", bert, ("ours", "composite"), gross=True)
        if net and gross:
            out.append(
                f"- **Differences of big graph runs.** For BERT-base the loss-scale work "
                f"({self._span(net, fmt_s)}) is the difference of two graph runs of "
                f"{self._span(gross, fmt_s)}; its round-by-round range is wide, and a single "
                "ratio there (against torch, say) is soft.")
        tiny = [c for c in self.cases("optimizer") if c.startswith("tiny_2000x64/")]
        firsts = [(self.first.get(("optimizer", c, self.threads, "ours")),
                   self.first.get(("optimizer", c, self.threads, "stock"))) for c in tiny]
        firsts = [(a, b) for a, b in firsts if a is not None and b is not None]
        if firsts:
            a, b = firsts[0]
            out.append(
                "- **Tracing the Keras optimizer.** Tracing `apply` over thousands of variables "
                + ("takes longer with ours than with the stock optimizer" if a > b else
                   "takes no longer with ours than with the stock optimizer")
                + f" ({fmt_s(a)} against {fmt_s(b)}, the first-call table); it is paid once "
                "per function.")
        sweep = self.cases("tf_op", sweep=True)
        if sweep:
            smallest = min(sweep, key=lambda c: int(c.split("/")[0][6:]))
            tf_calls = self._medians("tf_op", [smallest],
                                     ("ours", "composite", "ours_eager", "composite_eager"))
            torch_call = self._medians("tf_op", [smallest], ("torch",))
            if tf_calls:
                size = workloads.size_label(int(smallest.split("/")[0][6:]))
                out.append(
                    f"- **Small single tensors under TensorFlow.** For one tensor of {size}, "
                    f"calling a `tf.function` or an eager op costs {self._span(tf_calls, fmt_s)} "
                    "whatever the kernel does; both TensorFlow methods are call overhead there"
                    + (f", and torch's direct C++ call ({fmt_s(torch_call[0])}) is "
                       f"{min(tf_calls) / torch_call[0]:.0f}× faster.  The same overhead is "
                       "why torch can beat the TensorFlow op on 2,000 tiny tensors."
                       if torch_call else "."))
        if self.facts.get("transparent_huge_pages") != "never":
            out.append(
                "- **The roofline's pages.** The roofline multiplies numpy's buffers, which "
                "numpy puts on transparent huge pages where the kernel offers them "
                "(`madvise`); TensorFlow's variables, slots and gradients lie on 4 KiB "
                "pages.  That is not what a TensorFlow step's ours ÷ roofline is made of: "
                "with ours' variables and slots moved onto huge pages (`MADV_COLLAPSE`), the "
                "ResNet-50 and BERT-base Adam steps took as long as before, within their "
                "noise, on an AMD EPYC (Zen 4), and the first step paid up to 2.5 s for the "
                "move; the library leaves the pages as TensorFlow's allocator makes them.")
        out.append(
            "- **The TF composite in a graph overlaps with the producer.** Its per-tensor ops "
            "run as soon as each gradient exists, while it is in cache, and in parallel with "
            "making the next one; the one fused op waits for the whole list and streams it "
            "back from memory.")
        if self.optimizer_fused():
            out.append(
                "- **Keras `apply`.** Ours takes the fused step: the check, the unscale and "
                "the SGD update in one pass, so it can go below the *inner SGD alone* column, "
                "which stock hands its unscaled gradients to.")
        else:
            out.append(
                "- **Keras `apply`.** Both optimizers hand the unscaled gradients to the same "
                "inner SGD, whose update is the larger part of `apply` (the *inner SGD alone* "
                "column): the most any loss scaling can save is stock minus SGD alone.")
        digits = self._ratios("fit", ["digits_cnn/mixed_float16"], "ours", "stock")
        if digits:
            out.append(
                "- **A whole `fit` step of a small model.** The optimizer's share of the step "
                "is small; "
                + ("the two agree within the step time's scatter." if FASTER <= digits[0] <= SLOWER
                   else f"ours ÷ stock is {_r(digits[0])}."))
        for case in self.recipe_cases():
            peer = self.recipe_info(case).get("torch_peer") or ""
            r = ratio(self.recipe_get(case, "ours"), self.recipe_get(case, "torch"))
            if "accumulated gradients" in peer and r is not None:
                out.append(
                    f"- **Gradient accumulation against torch ({case.split('/')[0]}, "
                    f"{_r(r.value)}).** Keras' loss scale moves on every call, so every call "
                    "of ours (and of stock) checks the gradients it is handed before adding "
                    "them to the accumulators; GradScaler checks once per update, the "
                    "accumulated `.grad`, so torch's other calls are the add alone.")
        out.extend(self.why_torch_threads())
        return out

    def optimizer_fused(self):
        """Whether ours took the fused step in the Keras `apply` layer."""
        return any(e.get("step_path", "").startswith("fused") for k, e in self.info.items()
                   if k[0] == "optimizer" and k[3] == "ours")

    def why_torch_threads(self):
        """Single tensors where torch's pass at more threads took longer than
        at one thread: its OpenMP barrier, not the work."""
        core_threads = self.facts.get("core_threads") or [self.threads]
        many = max(core_threads)
        if 1 not in core_threads or many == 1:
            return []
        slow = []
        for case in self.cases("core", many, sweep=True):
            a, b = self.get("core", case, "torch", many), self.get("core", case, "torch", 1)
            if a is not None and b is not None and a.median > TORCH_THREADS_ABSURD * b.median:
                slow.append((int(case.split("/")[0][6:]), a.median, b.median))
        if not slow:
            return []
        where = ", ".join(f"{workloads.size_label(n)} ({fmt_s(a)} against {fmt_s(b)})"
                          for n, a, b in sorted(slow))
        return [
            "- **torch at more than one thread.** Its OpenMP workers meet at a barrier; when "
            "another process holds a core a parallel region can wait a scheduler tick.  On "
            f"single tensors its {many}-thread pass took over {TORCH_THREADS_ABSURD:g} times "
            f"as long as its one-thread pass in this run at {where} (the cause is not pinned "
            "down).  Its one-thread rows and "
            "panel show torch without it.  Where a torch cell looks absurd, read it as the "
            "peer's threading on this machine, not as the work."]

    def reading(self):
        self.w("## How to read the TensorFlow numbers", "",
               "- In `tf.function` the gradients are made inside the graph, as a backward pass "
               "leaves them: fresh buffers, each ending in an op Grappler cannot see through "
               "(otherwise Grappler folds the composite's multiply by a scalar into the "
               "producer and the stock unscale looks free).  Making them alone (ending in "
               "the same one-value-per-tensor read as every method) is timed just before "
               "every sample and taken off it: the tables show the loss-scale work alone, "
               "and the last column the whole step, making the gradients included.",
               "- Eager methods take ready-made tensors the caller keeps; nobody may write "
               "over them, so they write fresh outputs.",
               "- torch works in place on its own copy of the same values, and its column "
               "includes `_amp_update_scale_`.",
               "- `ours ÷ roofline` compares with the numpy layer's in-place multiply over the "
               "same bytes at the same thread count (for 16-bit lists, float32 buffers of the "
               "same byte sizes: numpy's float16 multiply is not vectorized).", "")

    def reproduce(self):
        self.w("## Reproduce", "", "```sh",
               "make bench            # this report: bench/results/REPORT.md, raw.json, *.png",
               "make bench QUICK=1    # the small subset CI runs: bench/results/quick/",
               "```", "",
               "`make bench` creates `.venv`, installs the requirements (and the optional "
               "peers in `requirements-bench.txt`: torch CPU, matplotlib), builds in place, "
               "runs each layer's `pytest bench/test_<layer>.py` with pytest-benchmark in a "
               "process of its own (`bench/run.py`, which joins their JSON), then "
               "`python bench/report.py`.  "
               "Extra pytest arguments go in `BENCH_ARGS`, e.g. "
               "`make bench BENCH_ARGS='-k core --threads 1'`.", "")

    # -------------------------------------------------------- assembly

    def write(self):
        self.plots = make_plots(self)
        self.header()
        self.goals_section()
        self.headline()
        self.user_step()
        if self.plots.get("throughput"):
            self.w(f"![throughput against tensor size]({self.plots['throughput']})", "")
        if self.plots.get("step_time"):
            self.w(f"![time per step, per workload]({self.plots['step_time']})", "")
        self.tf_keras_step()
        self.recipes()
        self.distributed()
        self.w("## Results by layer", "")
        core_threads = self.facts.get("core_threads") or [self.threads]
        for t in core_threads:
            self.layer_table("core", t, title=f"{LAYER_TITLES['core']}, {t} thread"
                             f"{'s' if t > 1 else ''}")
        self.sweep_table()
        self.layer_table("tf_op", note="Gradients made in the graph for the tf.function "
                         "columns (the producer's time taken off), ready-made tensors for "
                         "the eager ones.")
        self.layer_table("loss_scale")
        self.layer_table("optimizer", note="Ratios above 1 here would mean ours is slower; "
                         + ("ours fuses the SGD update into its step; stock hands its "
                            "unscaled gradients to *inner SGD alone*." if self.optimizer_fused()
                            else "*inner SGD alone* is the part both optimizers share."))
        self.layer_table("fit", note="Time per training step (one sample is an epoch of `fit`, "
                         "divided by its steps).")
        self.first_calls()
        self.memory()
        self.training()
        self.where_we_lose()
        self.reading()
        self.reproduce()
        path = os.path.join(self.out_dir, "REPORT.md")
        with open(path, "w") as f:
            f.write("\n".join(self.lines))
        return path


# ------------------------------------------------------------ README

README = os.path.join(os.path.dirname(HERE), "README.md")
HEADLINE_START = "<!-- headline:start -->"
HEADLINE_END = "<!-- headline:end -->"
GENERATED_NOTE = ("<!-- Generated by bench/report.py from bench/results/raw.json "
                  "(a full make bench): edit report.py, not this. -->")


def readme_block(rep):
    """The text that lies between the README's headline markers."""
    return "\n".join(rep.readme_headline()) + "\n"


def split_readme(text):
    """``(before, headline, after)``: the README around its headline markers;
    exactly one pair must be there, in order."""
    if text.count(HEADLINE_START) != 1 or text.count(HEADLINE_END) != 1:
        raise ValueError(f"README.md: expected one {HEADLINE_START} and one {HEADLINE_END}")
    before, rest = text.split(HEADLINE_START)
    headline, after = rest.split(HEADLINE_END)
    if not headline.startswith("\n"):
        raise ValueError(f"README.md: {HEADLINE_START} must end its line")
    return before + HEADLINE_START + "\n", headline[1:], HEADLINE_END + after


def update_readme(rep, path=README):
    """Rewrites the README's headline from ``rep``; True when it changed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    before, old, after = split_readme(text)
    new = readme_block(rep)
    if new == old:
        return False
    with open(path, "w", encoding="utf-8") as f:
        f.write(before + new + after)
    return True


# ------------------------------------------------------------ plots

def make_plots(rep):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"report: plots skipped, matplotlib not importable ({e}); "
              "pip install -r requirements-bench.txt")
        return {}
    out = {}
    if plot_throughput(rep, plt, os.path.join(rep.out_dir, "throughput.png")):
        out["throughput"] = "throughput.png"
    if plot_steps(rep, plt, os.path.join(rep.out_dir, "step_time.png")):
        out["step_time"] = "step_time.png"
    if plot_training(rep, plt, os.path.join(rep.out_dir, "training.png")):
        out["training"] = "training.png"
    return out


def _series(rep, layer, peer, threads):
    pts = []
    for case in rep.cases(layer, threads, sweep=True):
        st = rep.get(layer, case, peer, threads)
        if st and st.median > 0:
            size = int(case.split("/")[0][6:])
            pts.append((size, 2 * size / st.median / 1e9))
    if layer == "core":
        st = rep.get(layer, f"{workloads.BIG}/float32", peer, threads)
        if st and st.median > 0:
            pts.append((workloads.GIB, 2 * workloads.GIB / st.median / 1e9))
    return sorted(pts)


def plot_throughput(rep, plt, path):
    styles = {("core", "ours"): ("C0", "-", "o"), ("core", "torch"): ("C1", "-", "s"),
              ("core", "numpy"): ("C2", "-", "^"), ("core", "roofline"): ("k", ":", "."),
              ("tf_op", "ours"): ("C0", "--", "o"), ("tf_op", "composite"): ("C3", "--", "v"),
              ("tf_op", "ours_eager"): ("C4", "--", "D"),
              ("tf_op", "composite_eager"): ("C5", "--", "x"),
              ("tf_op", "torch"): ("C1", "--", "s")}
    core_threads = rep.facts.get("core_threads") or [rep.threads]
    panels = [("core", t, f"numpy layer, in place, {t} thread{'s' if t > 1 else ''}")
              for t in core_threads]
    panels.append(("tf_op", rep.threads, f"TensorFlow layer (unscale + check + update), "
                                         f"{rep.threads} threads"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.8), sharey=True)
    axes = list(axes) if len(panels) > 1 else [axes]
    drew = False
    for ax, (layer, threads, title) in zip(axes, panels):
        for peer in rep.peers(layer):
            pts = _series(rep, layer, peer, threads)
            if not pts:
                continue
            color, ls, marker = styles.get((layer, peer), (None, "-", "o"))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, linestyle=ls,
                    marker=marker, markersize=4, label=PEER_LABELS.get((layer, peer), peer))
            drew = True
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tensor size (bytes, one float32 tensor)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ticks = [1 << k for k in range(10, 31, 4)]
        ax.set_xticks(ticks, [workloads.size_label(t).replace(" ", "") for t in ticks])
    axes[0].set_ylabel("GB/s (2 × tensor bytes / time)")
    fig.suptitle(f"{rep.facts.get('cpu', '')}, kernel set {rep.facts.get('simd_level', '')}",
                 fontsize=10)
    fig.tight_layout()
    if drew:
        fig.savefig(path, dpi=90)
    plt.close(fig)
    return drew


def plot_steps(rep, plt, path):
    """One row per workload, one marker per implementation at its median with
    a min-max whisker, on a log axis (bars would start at an arbitrary
    floor there and mislead)."""
    layers = [la for la in ("step", "check", "core", "tf_op", "loss_scale", "optimizer", "fit")
              if rep.cases(la)]
    if not layers:
        return False
    heights = [0.9 + 0.45 * len(rep.cases(la)) for la in layers]
    fig, axes = plt.subplots(len(layers), 1, figsize=(10, sum(heights) + 0.8),
                             gridspec_kw={"height_ratios": heights})
    if len(layers) == 1:
        axes = [axes]
    markers = "oDs^vxP*"
    for ax, layer in zip(axes, layers):
        cases = rep.cases(layer)
        peers = [p for p in rep.peers(layer) if not (layer == "step" and p in STEP_SPLIT)]
        for j, peer in enumerate(peers):
            ys, xs, lo, hi = [], [], [], []
            for i, case in enumerate(cases):
                st = rep.get(layer, case, peer)
                if st and st.median > 0:
                    ys.append(i + (j - (len(peers) - 1) / 2) * 0.12)
                    xs.append(st.median * 1e3)
                    lo.append(st.median * 1e3 - max(st.min, st.median * 1e-3) * 1e3)
                    hi.append((st.max - st.median) * 1e3)
            ax.errorbar(xs, ys, xerr=[lo, hi], fmt=markers[j % len(markers)],
                        color=f"C{j}", markersize=7 if peer == "ours" else 5, capsize=2,
                        elinewidth=0.8, label=PEER_LABELS.get((layer, peer), peer))
        ax.set_yticks(range(len(cases)), [case_label(c) for c in cases], fontsize=8)
        ax.set_ylim(len(cases) - 0.5, -0.5)
        ax.set_xscale("log")
        # A whisker of a time with the producer subtracted may reach near
        # zero; the axis follows the medians and clips such whiskers.
        meds = [st.median * 1e3 for p in peers for c in cases
                for st in [rep.get(layer, c, p)] if st and st.median > 0]
        if meds:
            ax.set_xlim(min(meds) / 3, max(meds) * 3)
        ax.set_xlabel("ms per step: median, min-max (lower is better)", fontsize=8)
        ax.set_title(LAYER_TITLES[layer].replace("`", ""), fontsize=9)
        ax.grid(True, axis="x", which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_training(rep, plt, path):
    tr = rep.records.get("training")
    if not tr:
        return False
    runs = tr["runs"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for kind, style in (("mixed_stock", dict(color="C1", lw=3, alpha=0.5, label="stock Keras")),
                        ("mixed_lossscale", dict(color="C0", lw=1.2, ls="--",
                                                 label="lossscale"))):
        s = runs[kind]["loss_scale"]
        a.step(range(1, len(s) + 1), s, where="post", **style)
    a.set_yscale("log", base=2)
    a.set_xlabel("training step")
    a.set_ylabel("loss scale after the step")
    a.set_title("loss-scale trajectory (mixed_float16)", fontsize=10)
    a.grid(True, alpha=0.3)
    a.legend(fontsize=8)
    names = {"float32": "float32", "mixed_stock": "mixed, stock Keras",
             "mixed_lossscale": "mixed, lossscale"}
    for kind, r in runs.items():
        b.plot(range(1, len(r["train_loss"]) + 1), r["train_loss"],
               lw=3 if kind == "mixed_stock" else 1.2, alpha=0.5 if kind == "mixed_stock" else 1,
               ls="--" if kind == "mixed_lossscale" else "-",
               label=f"{names[kind]} (test acc. {r['test_accuracy']:.4f})")
    b.set_yscale("log")
    b.set_xlabel("epoch")
    b.set_ylabel("training loss")
    b.set_title("digits CNN", fontsize=10)
    b.grid(True, alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    readme = README
    if argv[:1] == ["--no-readme"]:
        readme, argv = None, argv[1:]
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    rep = Report(argv[0])
    # pytest-benchmark indents its JSON; the same content without the
    # indentation is half the size of a file that is kept in the repository.
    with open(argv[0], "w") as f:
        json.dump(rep.raw, f, separators=(",", ":"))
    path = rep.write()
    print(f"report: {path}")
    if os.path.abspath(argv[0]) != os.path.join(HERE, "results", "raw.json"):
        readme = None   # a run of its own, not the committed results
    if readme and not rep.facts.get("quick"):
        changed = update_readme(rep, readme)
        print(f"report: README headline {'rewritten' if changed else 'unchanged'} ({readme})")
    exact = getattr(rep, "recipe_exact", [])
    if exact:
        different = [name for name, same in exact if not same]
        print(f"  recipes: {len(exact) - len(different)} of {len(exact)} bit-identical to stock"
              + (f"; DIFFERENT: {', '.join(different)}" if different else ""))
    for line in rep.records.get("skipped", []):
        print(f"  skipped in this run: {line}")
    for what, r in getattr(rep, "headline_rows", []):
        print(f"  {what}: {r.value:.2f}")
    for g in getattr(rep, "goal_rows", []):
        verdict = {True: "met", False: "NOT MET", None: "not measured"}[g.met]
        value = "—" if g.value is None else f"{g.value:.2f}"
        print(f"  goal: {g.what}: {value} ({'≥' if g.at_least else '≤'} {g.limit:g}) {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
