/*
 * LossScaleApplyOptimizer: one Keras optimizer step (any of the core's
 * fused families, by name) over a whole variable list, the gradients
 * unscaled on the fly, in one pass over memory (the core's
 * ls_optim_update_with on TensorFlow's intra-op pool).
 *
 * `apply` is the step's verdict, computed before (the finite check of the
 * gradients and the loss-scale rule): when it is false the op returns at
 * once and no variable or slot is touched.  Otherwise every variable and
 * slot is looked up and locked as TensorFlow's training ops lock
 * (lossscale_tf.h's UpdatedVariables), checked (initialized, float32, the
 * gradient's shape), a buffer another tensor still reads is copied first
 * (TensorFlow's PrepareToUpdateVariable), and only then is anything
 * written, so an error leaves every variable as it was.  The core
 * validates the step once and splits it over the intra-op pool; the
 * arithmetic is the core's, with subnormals flushed as TensorFlow's CPU
 * kernels compute.
 */
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "lossscale_tf.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace lossscale_tf {
namespace {

using tf::shape_inference::InferenceContext;

// `apply` and the trailing scalars (scale, learning_rate, weight_decay, the
// family's step scalars, the clip scalars) are scalars.
tf::Status ScalarShapes(InferenceContext* c) {
    int n = 0, k = 0, scalars = 0, clip_scalars = 0;
    TF_RETURN_IF_ERROR(c->GetAttr("num_variables", &n));
    TF_RETURN_IF_ERROR(c->GetAttr("num_slots", &k));
    TF_RETURN_IF_ERROR(c->GetAttr("num_scalars", &scalars));
    TF_RETURN_IF_ERROR(c->GetAttr("num_clip_scalars", &clip_scalars));
    tf::shape_inference::ShapeHandle unused;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
    const int first = 1 + n + k + n;
    for (int i = first; i < first + 3 + scalars + clip_scalars; ++i)
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
    int terms = 0, averages = 0, ema = 0;
    TF_RETURN_IF_ERROR(c->GetAttr("num_terms", &terms));
    TF_RETURN_IF_ERROR(c->GetAttr("num_averages", &averages));
    TF_RETURN_IF_ERROR(c->GetAttr("num_ema", &ema));
    const int ema_first = first + 3 + scalars + clip_scalars + terms + averages;
    for (int i = ema_first; i < ema_first + ema; ++i)
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
    int sparse = 0, factors = 0;
    TF_RETURN_IF_ERROR(c->GetAttr("num_sparse", &sparse));
    TF_RETURN_IF_ERROR(c->GetAttr("num_slice_factors", &factors));
    for (int i = ema_first + ema; i < ema_first + ema + sparse; ++i)
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 1, &unused));
    for (int i = ema_first + ema + sparse; i < ema_first + ema + sparse + factors; ++i)
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
    return tf::OkStatus();
}

REGISTER_OP("LossScaleApplyOptimizer")
    .Input("apply: bool")
    .Input("variables: num_variables * resource")
    .Input("slots: num_slots * resource")
    .Input("grads: T")
    .Input("scale: float")
    .Input("learning_rate: float")
    .Input("weight_decay: float")
    .Input("scalars: num_scalars * float")
    .Input("clip_scalars: num_clip_scalars * float")
    .Input("terms: num_terms * float")
    .Input("averages: num_averages * resource")
    .Input("ema: num_ema * float")
    .Input("indices: num_sparse * int64")
    .Input("slice_factor: num_slice_factors * float")
    .Input("accumulators: num_accumulators * resource")
    .Attr("T: list({half, bfloat16, float}) >= 1")
    .Attr("family: string")
    .Attr("hyper: list(float)")
    .Attr("num_variables: int >= 1")
    .Attr("num_slots: int >= 0")
    .Attr("num_scalars: int >= 0")
    .Attr("num_terms: int >= 0 = 0")
    .Attr("decay: list(int)")
    .Attr("unscale: {'none', 'divide', 'multiply'} = 'divide'")
    .Attr("clip: {'none', 'value', 'norm', 'global'} = 'none'")
    .Attr("clip_value: float = 0")
    .Attr("num_clip_scalars: int >= 0 = 0")
    .Attr("num_averages: int >= 0 = 0")
    .Attr("num_ema: int >= 0 = 0")
    .Attr("sparse: list(int) = []")
    .Attr("num_sparse: int >= 0 = 0")
    .Attr("num_slice_factors: int >= 0 = 0")
    .Attr("num_accumulators: int >= 0 = 0")
    .Attr("accumulation: {'none', 'divide', 'multiply'} = 'none'")
    .Attr("accumulation_steps: int >= 0 = 0")
    .SetIsStateful()
    .SetShapeFn(ScalarShapes)
    .Doc(R"doc(
When `apply`, one step of the Keras optimizer `family` ("sgd", "adam", ...:
the core's fused families) of every variable, its gradient first unscaled:
divided by `scale` ('divide', Keras 3), times 1/scale in the gradient's dtype
('multiply', TensorFlow 2.4), or as it is.  `slots` holds the family's slots
slot by slot (slot s of variable i at s * num_variables + i); the family's
numbers are `hyper` followed by `scalars` (the ones Keras derives from its
step counter), in the family's order; weight decay as `decay` says for each
variable (0 none, 1 var - (var * wd) * lr, 2 var - var * (wd * lr), 3
var - var * wd: `weight_decay` the whole factor).
Each unscaled gradient is clipped first as `clip` says (Keras' clipvalue,
clipnorm, global_clipnorm): 'value' to [-clip_value, clip_value]; 'norm'
(g * clip_value) / its variable's `clip_scalars` entry (max(l2norm,
clipnorm), one per variable); 'global' g * `clip_scalars`' one factor, or
its variable's entry where there is one per variable.

`terms`, none or one per variable (then with unscale 'none', for a family
that takes one): what the family takes in place of one function of the
gradient (Adam's g * g, Adamax's |g|, Lion's g * (1 - beta_2)), a sparse
gradient's slices mapped, then summed per row, as Keras densifies them.

`averages`, none or one per variable (then `ema` is Keras' EMA momentum and
1 - momentum): each variable's exponential moving average, moved right
after the variable's update, average = momentum * average + (1 - momentum)
* var, as Keras' use_ema moves it.

`sparse` (ascending positions of variables, one `indices` each, then with
one `slice_factor`): those variables' gradients are sparse (an
IndexedSlices): their `grads` entry holds the slices, row indices[k] of the
variable for slice k.  The update runs on the dense gradient Keras' ops make
of them -- every slice value unscaled and (but under 'global') clipped, times
`slice_factor`, each row's slices added in their order onto 0, the family's
term summed the same way -- made a block at a time, never whole; under
'global' the sums are clipped.  Only families whose update of an element
reads that element alone take them (sgd, adam, adamax, lion), and adagrad,
as Keras' update scatters them: each slice's squares onto its row of the
accumulator, then each slice's step, in their order; other rows untouched.
rmsprop without momentum, not centered, alike: every velocity decayed and
the named rows' densified squares added, then each slice's step.
The legacy families take them as tf_keras hands them to TensorFlow: a row's
slices summed, then their sparse forms (family_legacy_*.h); tf_keras_adam,
tf_keras_sgd and tf_keras_rmsprop, tf_keras' current Adam, Nesterov SGD and
RMSprop, alike (family_tf_keras_*.h; RMSprop's TensorFlow Rsqrt of the named
rows gathered in the order of their first slice).  accumulate (Keras'
accumulating step) adds each named row's sum, made so, to that row alone.

`accumulators`, none or one per variable (then with `accumulation` 'divide'
or 'multiply' and `accumulation_steps` >= 1; no sparse gradient, no terms):
the update step of Keras' gradient accumulation.  Each variable's gradient,
unscaled, plus its accumulator, is divided by float32(accumulation_steps)
('divide', Keras' (g + acc) / steps as it runs eagerly) or multiplied by
float32(1 / accumulation_steps) ('multiply', that division as TensorFlow's
graph optimizer rewrites it), then clipped and applied; and the accumulator
is set to 0, in the same pass.
)doc");

int AccumulationMode(const std::string& name) {
    if (name == "divide")
        return LS_ACCUMULATION_DIVIDE;
    if (name == "multiply")
        return LS_ACCUMULATION_MULTIPLY;
    return LS_ACCUMULATION_NONE;
}

int ClipMode(const std::string& name) {
    if (name == "value")
        return LS_CLIP_VALUE;
    if (name == "norm")
        return LS_CLIP_NORM;
    if (name == "global")
        return LS_CLIP_GLOBAL;
    return LS_CLIP_NONE;
}

float ScalarInput(tf::OpKernelContext* ctx, int index) {
    return ctx->input(index).scalar<float>()();
}

class FusedStepOp : public tf::OpKernel {
  public:
    explicit FusedStepOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx) {
        std::string unscale, family, clip;
        std::vector<float> hyper;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_variables", &num_variables_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_slots", &num_slots_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_scalars", &num_scalars_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_terms", &num_terms_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("family", &family));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("hyper", &hyper));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("decay", &decay_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("unscale", &unscale));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("clip", &clip));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_clip_scalars", &num_clip_scalars_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_averages", &num_averages_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("sparse", &sparse_));
        int num_sparse = 0, factors = 0;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_sparse", &num_sparse));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_slice_factors", &factors));
        OP_REQUIRES(ctx, static_cast<int>(sparse_.size()) == num_sparse &&
                             factors == (num_sparse > 0 ? 1 : 0),
                    tf::errors::InvalidArgument(
                        "LossScaleApplyOptimizer: sparse names ", sparse_.size(),
                        " variables for ", num_sparse, " indices and ", factors,
                        " slice factors (one when any)"));
        OP_REQUIRES(ctx, AscendingPositions(sparse_, num_variables_),
                    tf::errors::InvalidArgument(
                        "LossScaleApplyOptimizer: sparse must name variables in "
                        "ascending order, each once"));
        int ema = 0;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_ema", &ema));
        OP_REQUIRES(ctx, (num_averages_ == 0 && ema == 0) ||
                             (num_averages_ == num_variables_ && ema == 2),
                    tf::errors::InvalidArgument(
                        "LossScaleApplyOptimizer: averages are none or one per variable, "
                        "then with 2 EMA numbers; got ", num_averages_, " averages for ",
                        num_variables_, " variables and ", ema, " numbers"));
        std::string accumulation;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_accumulators", &num_accumulators_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("accumulation", &accumulation));
        int steps = 0;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("accumulation_steps", &steps));
        const bool accumulates = accumulation != "none";
        OP_REQUIRES(ctx, (num_accumulators_ == 0 && !accumulates) ||
                             (num_accumulators_ == num_variables_ && accumulates && steps >= 1),
                    tf::errors::InvalidArgument(
                        "LossScaleApplyOptimizer: accumulators are none or one per variable, "
                        "then with accumulation 'divide' or 'multiply' over steps >= 1; got ",
                        num_accumulators_, " accumulators for ", num_variables_,
                        " variables, accumulation '", accumulation, "', steps ", steps));
        OP_REQUIRES(ctx, num_accumulators_ == 0 || (num_sparse == 0 && num_terms_ == 0),
                    tf::errors::InvalidArgument(
                        "LossScaleApplyOptimizer: accumulators take dense gradients: no "
                        "sparse gradient, no terms; got ", num_sparse, " sparse and ",
                        num_terms_, " terms"));
        OP_REQUIRES(ctx, static_cast<int>(decay_.size()) == num_variables_,
                    tf::errors::InvalidArgument("decay has ", decay_.size(),
                                                " entries for ", num_variables_, " variables"));
        std::memset(&config_, 0, sizeof config_);
        config_.family = ls_optim_family(family.c_str());
        OP_REQUIRES(ctx, config_.family >= 0,
                    tf::errors::InvalidArgument("LossScaleApplyOptimizer: no fused family '",
                                                family, "'"));
        config_.num_hyper = ls_optim_hyper_count(config_.family);
        OP_REQUIRES(ctx, static_cast<int>(hyper.size()) + num_scalars_ == config_.num_hyper,
                    tf::errors::InvalidArgument(
                        "LossScaleApplyOptimizer: family '", family, "' takes ",
                        config_.num_hyper, " numbers, got ", hyper.size(), " in hyper and ",
                        num_scalars_, " scalars"));
        std::copy(hyper.begin(), hyper.end(), config_.hyper);
        config_.unscale = UnscaleMode(unscale);
        config_.accumulation = AccumulationMode(accumulation);
        config_.accumulation_steps = steps;
        config_.clip = ClipMode(clip);
        OP_REQUIRES_OK(ctx, ctx->GetAttr("clip_value", &config_.clip_value));
        // 'global': the step's one factor, or one per variable.
        const int clip_scalars =
            config_.clip == LS_CLIP_NORM ||
                    (config_.clip == LS_CLIP_GLOBAL && num_clip_scalars_ == num_variables_)
                ? num_variables_
            : config_.clip == LS_CLIP_GLOBAL ? 1
                                             : 0;
        OP_REQUIRES(ctx, num_clip_scalars_ == clip_scalars,
                    tf::errors::InvalidArgument("LossScaleApplyOptimizer: clip '", clip,
                                                "' takes ", clip_scalars,
                                                " clip scalars, got ", num_clip_scalars_));
        OP_REQUIRES(ctx, num_terms_ == 0 ||
                             (num_terms_ == num_variables_ &&
                              ls_optim_takes_term(config_.family) &&
                              config_.unscale == LS_UNSCALE_NONE),
                    tf::errors::InvalidArgument(
                        "LossScaleApplyOptimizer: terms are one per variable, for a "
                        "family that takes one ('", family, "': ",
                        ls_optim_takes_term(config_.family) ? "yes" : "no",
                        "), with unscale 'none'; got ", num_terms_, " for ",
                        num_variables_, " variables, unscale '", unscale, "'"));
        // The slot count follows from the constant numbers alone.
        const int slots = ls_optim_slot_count(&config_);
        OP_REQUIRES(ctx, num_slots_ == slots * num_variables_,
                    tf::errors::InvalidArgument(
                        "LossScaleApplyOptimizer: family '", family, "' as configured keeps ",
                        slots, " slots per variable, that is ", slots * num_variables_,
                        " slot variables; got ", num_slots_));
    }

    void Compute(tf::OpKernelContext* ctx) override {
        if (!Applies(ctx))
            return;
        ls_optim_config config = config_;
        const int first_scalar = 1 + 2 * num_variables_ + num_slots_;
        OP_REQUIRES_OK(ctx, CheckScalarInputs(ctx, first_scalar,
                                              3 + num_scalars_ + num_clip_scalars_,
                                              type_string()));
        config.weight_decay = ScalarInput(ctx, first_scalar + 2);
        const int constants = config.num_hyper - num_scalars_;
        for (int s = 0; s < num_scalars_; ++s)
            config.hyper[constants + s] = ScalarInput(ctx, first_scalar + 3 + s);
        Run(ctx, first_scalar, config);
    }

  private:
    int num_variables_ = 0;
    int num_slots_ = 0;
    int num_scalars_ = 0;
    int num_clip_scalars_ = 0;
    int num_terms_ = 0;
    int num_averages_ = 0;
    int num_accumulators_ = 0;
    std::vector<int> decay_;  // ls_decay per variable
    std::vector<int> sparse_; // variables whose gradients are slices
    ls_optim_config config_;

    // Whether the step applies: `apply`, a scalar.
    static bool Applies(tf::OpKernelContext* ctx) {
        const tf::Tensor& apply = ctx->input(0);
        return tf::TensorShapeUtils::IsScalar(apply.shape()) && apply.scalar<bool>()();
    }

    void Run(tf::OpKernelContext* ctx, int first_scalar, ls_optim_config config) {
        const int n = num_variables_;
        const int grads_first = 1 + n + num_slots_;
        config.scale = ScalarInput(ctx, first_scalar);
        config.learning_rate = ScalarInput(ctx, first_scalar + 1);

        // Every resource: the variables, then each slot list in order, then
        // the averages, then the accumulators.
        std::vector<int> inputs;
        for (int i = 1; i < grads_first; ++i)
            inputs.push_back(i);
        const int averages_first =
            first_scalar + 3 + num_scalars_ + num_clip_scalars_ + num_terms_;
        for (int i = 0; i < num_averages_; ++i)
            inputs.push_back(averages_first + i);
        if (num_averages_ > 0) {
            OP_REQUIRES_OK(ctx, CheckScalarInputs(ctx, averages_first + num_averages_, 2,
                                                  type_string()));
            config.ema_momentum = ScalarInput(ctx, averages_first + num_averages_);
            config.ema_rest = ScalarInput(ctx, averages_first + num_averages_ + 1);
        }
        const int indices_first = averages_first + num_averages_ + (num_averages_ > 0 ? 2 : 0);
        const int num_sparse = static_cast<int>(sparse_.size());
        if (num_sparse > 0) {
            OP_REQUIRES_OK(ctx, CheckScalarInputs(ctx, indices_first + num_sparse, 1,
                                                  type_string()));
            config.slice_factor = ScalarInput(ctx, indices_first + num_sparse);
        }
        const int accumulators_first = indices_first + num_sparse + (num_sparse > 0 ? 1 : 0);
        const int accumulator_at = static_cast<int>(inputs.size()); // in `vars`
        for (int i = 0; i < num_accumulators_; ++i)
            inputs.push_back(accumulators_first + i);
        UpdatedVariables vars;
        int twice = -1;
        OP_REQUIRES_OK(ctx, vars.LookUp(ctx, inputs, &twice));
        OP_REQUIRES(ctx, twice < 0,
                    tf::errors::InvalidArgument(type_string(),
                                                ": a variable, slot, average or accumulator "
                                                "is passed twice (",
                                                VariableNameAt(ctx, inputs[twice]), ")"));
        vars.Lock();

        // Check everything before any write.
        std::vector<ls_param> params(n);
        for (int i = 0, next_sparse = 0; i < n; ++i) {
            const tf::Tensor& g = ctx->input(grads_first + i);
            const bool sparse = next_sparse < num_sparse && sparse_[next_sparse] == i;
            const tf::Tensor* indices =
                sparse ? &ctx->input(indices_first + next_sparse++) : nullptr;
            // What the variable, its slots and average must be shaped as.
            const tf::TensorShape shape = sparse ? vars.var(i)->tensor()->shape() : g.shape();
            ls_dtype dt;
            OP_REQUIRES(ctx, ToCoreDtype(g.dtype(), &dt) && dt != LS_FLOAT64,
                        tf::errors::InvalidArgument("gradient of ", VariableNameAt(ctx, 1 + i),
                                                    " has unsupported dtype ",
                                                    tf::DataTypeString(g.dtype())));
            // The variable, its slots, its average, its accumulator.
            std::vector<int> mine;
            for (int s = 0; s * n + i < grads_first - 1; ++s)
                mine.push_back(s * n + i);
            if (num_averages_ > 0)
                mine.push_back(grads_first - 1 + i);
            if (num_accumulators_ > 0)
                mine.push_back(accumulator_at + i);
            for (int t : mine) {
                tf::Var* var = vars.var(t);
                const tf::Tensor* value = var->tensor();
                // Named only in a message: building the name costs more than the checks.
                const auto what = [&] { return VariableNameAt(ctx, inputs[t]); };
                OP_REQUIRES(ctx, var->is_initialized,
                            tf::errors::FailedPrecondition(type_string(), ": ", what(),
                                                           " is not initialized"));
                OP_REQUIRES(ctx, value->dtype() == tf::DT_FLOAT,
                            tf::errors::InvalidArgument(type_string(), ": ", what(),
                                                        " must be float32, got ",
                                                        tf::DataTypeString(value->dtype())));
                OP_REQUIRES(ctx, value->shape() == shape,
                            tf::errors::InvalidArgument(
                                type_string(), ": ", what(), " has shape ",
                                value->shape().DebugString(), ", its ",
                                sparse ? "variable" : "gradient", " has shape ",
                                shape.DebugString()));
            }
            params[i].grad = g.tensor_data().data();
            params[i].grad_dtype = dt;
            params[i].length = static_cast<size_t>(shape.num_elements());
            if (sparse) {
                OP_REQUIRES_OK(ctx, CheckSlices(ctx, i, g, *indices, shape, &params[i]));
                if (params[i].length == 0)
                    params[i].indices = nullptr; // nothing to update
            }
            params[i].decay = decay_[i];
            if (num_clip_scalars_ > 0)
                params[i].clip_scalar = ScalarInput(
                    ctx, first_scalar + 3 + num_scalars_ + (num_clip_scalars_ > 1 ? i : 0));
            if (num_terms_ > 0) {
                const tf::Tensor& term =
                    ctx->input(first_scalar + 3 + num_scalars_ + num_clip_scalars_ + i);
                OP_REQUIRES(ctx, term.shape() == g.shape(),
                            tf::errors::InvalidArgument(
                                type_string(), ": the gradient term of ",
                                VariableNameAt(ctx, 1 + i), " has shape ",
                                term.shape().DebugString(),
                                ", its gradient has shape ", g.shape().DebugString()));
                params[i].grad_term = term.flat<float>().data();
            }
        }
        const char* why = nullptr;
        OP_REQUIRES(ctx, ls_optim_config_check(&config, &why) == LS_OK,
                    tf::errors::InvalidArgument(type_string(), ": ", why, " (learning rate ",
                                                config.learning_rate, ", loss scale ",
                                                config.scale, ")"));
        if (num_sparse > 0) {
            why = ls_optim_sparse_problem(&config);
            OP_REQUIRES(ctx, why == nullptr,
                        tf::errors::InvalidArgument(type_string(), ": sparse gradients: ", why,
                                                    " (slice factor ", config.slice_factor,
                                                    ")"));
        }

        // Copy-on-write where a reader still holds a buffer; then point the
        // core at the buffers it may write.
        for (size_t t = 0; t < vars.size(); ++t)
            OP_REQUIRES_OK(ctx, vars.PrepareToUpdate(ctx, t));
        for (int i = 0; i < n; ++i) {
            params[i].var = FloatsOf(vars.var(i));
            for (int s = 1; s * n + i < grads_first - 1; ++s)
                params[i].slot[s - 1] = FloatsOf(vars.var(s * n + i));
            if (num_averages_ > 0)
                params[i].average = FloatsOf(vars.var(grads_first - 1 + i));
            if (num_accumulators_ > 0)
                params[i].accumulator = FloatsOf(vars.var(accumulator_at + i));
        }
        // Validated once (buffers included), then split over the pool.
        const int rc = ls_optim_update_with(params.data(), params.size(), &config,
                                            LS_FLUSH_DENORMALS, ParallelForOnPool, ctx);
        OP_REQUIRES(ctx, rc >= 0, CoreError(rc, type_string().c_str()));
    }

    // A sparse gradient's slices and indices against its variable's
    // `shape` (CheckSparseSlices), into *p.
    tf::Status CheckSlices(tf::OpKernelContext* ctx, int i, const tf::Tensor& g,
                           const tf::Tensor& indices, const tf::TensorShape& shape,
                           ls_param* p) {
        SparseSlices rows;
        TF_RETURN_IF_ERROR(CheckSparseSlices(
            type_string(), "the sparse gradient of " + VariableNameAt(ctx, 1 + i), g, indices,
            shape, &rows));
        p->indices = rows.indices;
        p->slices = rows.slices;
        p->row_length = rows.row_length;
        return tf::OkStatus();
    }
};

REGISTER_KERNEL_BUILDER(Name("LossScaleApplyOptimizer").Device(tf::DEVICE_CPU), FusedStepOp);

}  // namespace
}  // namespace lossscale_tf
