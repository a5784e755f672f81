/*
 * LossScaleUpdate: one step of the loss-scale state machine on resource
 * variables.  Locks the variables as TensorFlow's training ops do
 * (lossscale_tf.h's UpdatedVariables: mutex-address order, so two updates
 * sharing variables cannot deadlock), reads them, advances the state with
 * the core's ls_scale_update and writes every variable back (each buffer
 * copied first where a reader still holds it) before releasing the locks.
 *
 * Variables: scale (float32) and counter (int32 or int64, attr Tcounter)
 * always; overflow_run and skipped (int64) each optional, passed as a list
 * of zero or one resource.  Callers that keep only (scale, counter), as the
 * Keras 3 optimizer does, pass empty lists; hysteresis > 1 then cannot be
 * honoured and is refused.
 */
#include <string>
#include <vector>

#include "lossscale_tf.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tsl/platform/denormal.h"

namespace lossscale_tf {
namespace {

// The attr's default, from the core's.
#define LS_STRINGIFY(x) #x
#define LS_STR(x) LS_STRINGIFY(x)

using tf::shape_inference::InferenceContext;
using tf::shape_inference::ShapeHandle;

REGISTER_OP("LossScaleUpdate")
    .Input("finite: bool")
    .Input("scale: resource")
    .Input("counter: resource")
    .Input("overflow_run: num_overflow_run * resource")
    .Input("skipped: num_skipped * resource")
    .Output("should_apply: bool")
    .Attr("Tcounter: {int32, int64} = DT_INT64")
    .Attr("num_overflow_run: int >= 0 = 0")
    .Attr("num_skipped: int >= 0 = 0")
    .Attr("rule: {'tf24', 'keras3'} = 'tf24'")
    .Attr("increment_period: int >= 1 = " LS_STR(LS_DEFAULT_INCREMENT_PERIOD))
    .Attr("multiplier: float = 2.0")
    .Attr("backoff_factor: float = 0.0")
    .Attr("min_loss_scale: float = 1.0")
    .Attr("max_loss_scale: float")
    .Attr("hysteresis: int >= 1 = 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
        ShapeHandle unused;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
        c->set_output(0, c->Scalar());
        return tf::OkStatus();
    })
    .Doc(R"doc(
Advances the loss scale by one step (rules of lossscale.h) and returns
`finite`, i.e. whether the gradients should be applied.
)doc");

struct VarSlot {
    const char* name;
    int input;
    tf::DataType dtype;
};

class LossScaleUpdateOp : public tf::OpKernel {
  public:
    explicit LossScaleUpdateOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx) {
        std::string rule;
        float multiplier, backoff, min_scale, max_scale;
        tf::int64 period, hysteresis;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("Tcounter", &counter_dtype_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_overflow_run", &num_overflow_run_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_skipped", &num_skipped_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("rule", &rule));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("increment_period", &period));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("multiplier", &multiplier));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("backoff_factor", &backoff));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("min_loss_scale", &min_scale));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("max_loss_scale", &max_scale));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("hysteresis", &hysteresis));
        OP_REQUIRES(ctx, num_overflow_run_ <= 1 && num_skipped_ <= 1,
                    tf::errors::InvalidArgument(
                        "overflow_run and skipped take at most one variable each"));
        ls_scale_config_default(&config_, rule == "keras3" ? LS_RULE_KERAS3 : LS_RULE_TF24);
        config_.increment_period = period;
        config_.multiplier = multiplier;
        config_.backoff_factor = backoff;
        config_.min_loss_scale = min_scale;
        config_.max_loss_scale = max_scale;
        config_.hysteresis = hysteresis;
        const char* why = nullptr;
        OP_REQUIRES(ctx, ls_scale_config_check(&config_, &why) == LS_OK,
                    tf::errors::InvalidArgument("LossScaleUpdate: ", why));
        OP_REQUIRES(ctx, hysteresis == 1 || num_overflow_run_ == 1,
                    tf::errors::InvalidArgument(
                        "LossScaleUpdate: hysteresis > 1 needs an overflow_run variable"));
    }

    void Compute(tf::OpKernelContext* ctx) override {
        const tf::Tensor& finite_t = ctx->input(0);
        OP_REQUIRES(ctx, tf::TensorShapeUtils::IsScalar(finite_t.shape()),
                    tf::errors::InvalidArgument("finite must be a scalar, got shape ",
                                                finite_t.shape().DebugString()));
        const bool finite = finite_t.scalar<bool>()();

        std::vector<VarSlot> slots;
        slots.push_back({"scale", 1, tf::DT_FLOAT});
        slots.push_back({"counter", 2, counter_dtype_});
        int next = 3;
        if (num_overflow_run_)
            slots.push_back({"overflow_run", next++, tf::DT_INT64});
        if (num_skipped_)
            slots.push_back({"skipped", next++, tf::DT_INT64});

        std::vector<int> inputs;
        for (const VarSlot& s : slots)
            inputs.push_back(s.input);
        UpdatedVariables vars;
        int twice = -1;
        OP_REQUIRES_OK(ctx, vars.LookUp(ctx, inputs, &twice));
        OP_REQUIRES(ctx, twice < 0,
                    tf::errors::InvalidArgument("LossScaleUpdate: ", slots[twice].name,
                                                " is the same variable as another input"));
        vars.Lock();

        for (size_t i = 0; i < slots.size(); ++i) {
            const VarSlot& s = slots[i];
            const tf::Tensor* t = vars.var(i)->tensor();
            OP_REQUIRES(ctx, vars.var(i)->is_initialized,
                        tf::errors::FailedPrecondition("LossScaleUpdate: variable ", s.name,
                                                       " is not initialized"));
            OP_REQUIRES(ctx, t->dtype() == s.dtype,
                        tf::errors::InvalidArgument("LossScaleUpdate: ", s.name, " must be ",
                                                    tf::DataTypeString(s.dtype), ", got ",
                                                    tf::DataTypeString(t->dtype())));
            OP_REQUIRES(ctx, tf::TensorShapeUtils::IsScalar(t->shape()),
                        tf::errors::InvalidArgument("LossScaleUpdate: ", s.name,
                                                    " must be a scalar, got shape ",
                                                    t->shape().DebugString()));
        }

        ls_scale_state state;
        state.scale = vars.var(0)->tensor()->scalar<float>()();
        state.good_steps = counter_dtype_ == tf::DT_INT32
                               ? vars.var(1)->tensor()->scalar<tf::int32>()()
                               : vars.var(1)->tensor()->scalar<tf::int64>()();
        state.overflow_run = 0;
        state.skipped_steps = 0;
        for (size_t i = 2; i < slots.size(); ++i) {
            tf::int64 v = vars.var(i)->tensor()->scalar<tf::int64>()();
            if (slots[i].input == 3 && num_overflow_run_)
                state.overflow_run = v;
            else
                state.skipped_steps = v;
        }

        int rc;
        {
            // As TensorFlow's own CPU kernels compute `scale * multiplier`:
            // with subnormals flushed (a scale halved below FLT_MIN is 0).
            tsl::port::ScopedFlushDenormal flush;
            rc = ls_scale_update(&config_, &state, finite ? 1 : 0);
        }
        OP_REQUIRES(ctx, rc >= 0, tf::errors::InvalidArgument("LossScaleUpdate: bad config"));

        // Every buffer made the variable's own (copy-on-write) before the
        // first write, so a failure changes no variable.
        for (size_t i = 0; i < slots.size(); ++i)
            OP_REQUIRES_OK(ctx, vars.PrepareToUpdate(ctx, i));
        vars.var(0)->tensor()->scalar<float>()() = state.scale;
        if (counter_dtype_ == tf::DT_INT32)
            vars.var(1)->tensor()->scalar<tf::int32>()() = static_cast<tf::int32>(state.good_steps);
        else
            vars.var(1)->tensor()->scalar<tf::int64>()() = state.good_steps;
        for (size_t i = 2; i < slots.size(); ++i) {
            const bool is_run = slots[i].input == 3 && num_overflow_run_;
            vars.var(i)->tensor()->scalar<tf::int64>()() =
                is_run ? state.overflow_run : state.skipped_steps;
        }

        tf::Tensor* out = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &out));
        out->scalar<bool>()() = rc == 1;
    }

  private:
    tf::DataType counter_dtype_ = tf::DT_INT64;
    int num_overflow_run_ = 0;
    int num_skipped_ = 0;
    ls_scale_config config_;
};

REGISTER_KERNEL_BUILDER(Name("LossScaleUpdate").Device(tf::DEVICE_CPU), LossScaleUpdateOp);

}  // namespace
}  // namespace lossscale_tf
