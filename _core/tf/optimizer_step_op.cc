/*
 * LossScaleApplySgd and LossScaleApplyAdam: one Keras optimizer step over a
 * whole variable list, the gradients unscaled on the fly, in one pass over
 * memory (the core's ls_optim_step_range on TensorFlow's intra-op pool).
 *
 * `apply` is the step's verdict, computed before (the finite check of the
 * gradients and the loss-scale rule): when it is false the op returns at
 * once and no variable or slot is touched.  Otherwise every variable and
 * slot is looked up, checked (initialized, float32, the gradient's shape)
 * and locked in mutex-address order, as TensorFlow's training ops lock;
 * a buffer another tensor still reads is copied first
 * (copy-on-write, as the training ops' PrepareToUpdateVariable does), and
 * only then is anything written, so an error leaves every variable as it
 * was.  The arithmetic is the core's, with subnormals flushed as
 * TensorFlow's CPU kernels compute.
 */
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "lossscale_tf.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tsl/platform/blocking_counter.h"

namespace lossscale_tf {
namespace {

using tf::shape_inference::InferenceContext;

// Below this many elements per thread, waking a thread costs more than the
// share of the pass it would take; no chunk is smaller either.
constexpr size_t kMinElementsPerPart = size_t{1} << 16;
// Chunks per thread: enough that a thread the machine takes away for a
// while costs only its share, few enough that every chunk is a long stream.
constexpr size_t kChunksPerThread = 32;
// Chunks begin on multiples of this many elements: no two threads write
// into one cache line.
constexpr size_t kPartGrain = 64;

// `range` over [0, total) on the calling thread and the intra-op pool's
// threads, in contiguous chunks each thread takes in turn from a shared
// counter.  Measured on ResNet-50-sized lists, 2 threads:
// - Shard's cost-model splitting (many small blocks) made the two-thread
//   update slower than one thread; chunks of at least 64K elements stream
//   at the memory's rate;
// - one fixed half per thread waits for the later thread: on a shared
//   machine the pool's thread started 1-5 ms late in about one step in
//   six (the cores busy outside the process), and the caller then idled
//   after its half.  With chunks the caller takes over the work: the op's
//   mean time over 5 x 40 steps 7% lower (its median about the same).
// Returns 1 or the first negative status.
int RunInParts(tf::OpKernelContext* ctx, size_t total,
               const std::function<int(size_t, size_t)>& range) {
    const auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    const size_t threads = std::min<size_t>(static_cast<size_t>(pool->num_threads),
                                            total / kMinElementsPerPart);
    if (threads < 2)
        return range(0, total);
    // At least one chunk per thread: threads <= total / kMinElementsPerPart.
    const size_t chunks = std::min(threads * kChunksPerThread, total / kMinElementsPerPart);
    const size_t grains = (total + kPartGrain - 1) / kPartGrain;
    auto bound = [&](size_t c) { return std::min(total, grains * c / chunks * kPartGrain); };
    std::atomic<size_t> next{0};
    std::atomic<int> failed{0};
    auto work = [&] {
        for (size_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
            const int rc = range(bound(c), bound(c + 1));
            if (rc < 0) {
                int none = 0;
                failed.compare_exchange_strong(none, rc);
                next.store(chunks, std::memory_order_relaxed);
            }
        }
    };
    tsl::BlockingCounter done(static_cast<int>(threads - 1));
    for (size_t t = 1; t < threads; ++t)
        pool->workers->Schedule([&] {
            work();
            done.DecrementCount();
        });
    work();
    done.Wait();
    const int rc = failed.load();
    return rc < 0 ? rc : 1;
}

// Shape function of both ops: `apply` and the trailing `scalars` inputs are
// scalars.  Before the scalars: `apply`, the variables, `lists` more lists
// of num_variables resources, `optional` (an attr) resources, the gradients.
tf::Status ScalarShapes(InferenceContext* c, int lists, const char* optional, int scalars) {
    int n = 0, k = 0;
    TF_RETURN_IF_ERROR(c->GetAttr("num_variables", &n));
    TF_RETURN_IF_ERROR(c->GetAttr(optional, &k));
    tf::shape_inference::ShapeHandle unused;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
    const int first = 1 + (1 + lists) * n + k + n;
    for (int i = first; i < first + scalars; ++i)
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
    return tf::OkStatus();
}

REGISTER_OP("LossScaleApplySgd")
    .Input("apply: bool")
    .Input("variables: num_variables * resource")
    .Input("momentums: num_momentums * resource")
    .Input("grads: T")
    .Input("scale: float")
    .Input("learning_rate: float")
    .Input("weight_decay: float")
    .Attr("T: list({half, bfloat16, float}) >= 1")
    .Attr("num_variables: int >= 1")
    .Attr("num_momentums: int >= 0")
    .Attr("momentum: float = 0.0")
    .Attr("nesterov: bool = false")
    .Attr("decay: list(int)")
    .Attr("unscale: {'none', 'divide', 'multiply'} = 'divide'")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) { return ScalarShapes(c, 0, "num_momentums", 3); })
    .Doc(R"doc(
When `apply`, one Keras SGD step of every variable (with momentum and
Nesterov as Keras computes them, weight decay as `decay` says: 0 none,
1 var - (var * wd) * lr, 2 var - var * (wd * lr)), its
gradient first unscaled: divided by `scale` ('divide', Keras 3), times
1/scale in the gradient's dtype ('multiply', TensorFlow 2.4), or as it is.
)doc");

REGISTER_OP("LossScaleApplyAdam")
    .Input("apply: bool")
    .Input("variables: num_variables * resource")
    .Input("m: num_variables * resource")
    .Input("v: num_variables * resource")
    .Input("v_hat: num_v_hat * resource")
    .Input("grads: T")
    .Input("scale: float")
    .Input("learning_rate: float")
    .Input("alpha: float")
    .Input("weight_decay: float")
    .Attr("T: list({half, bfloat16, float}) >= 1")
    .Attr("num_variables: int >= 1")
    .Attr("num_v_hat: int >= 0")
    .Attr("one_minus_beta_1: float")
    .Attr("one_minus_beta_2: float")
    .Attr("epsilon: float")
    .Attr("decay: list(int)")
    .Attr("unscale: {'none', 'divide', 'multiply'} = 'divide'")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) { return ScalarShapes(c, 2, "num_v_hat", 4); })
    .Doc(R"doc(
When `apply`, one Keras Adam step (AdamW with weight decay where `decay`
says, amsgrad with `v_hat`) of every variable, its gradient first unscaled
as in LossScaleApplySgd.  `alpha` is lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)
as the caller computed it.
)doc");

int UnscaleMode(const std::string& name) {
    if (name == "divide")
        return LS_UNSCALE_DIVIDE;
    if (name == "multiply")
        return LS_UNSCALE_MULTIPLY;
    return LS_UNSCALE_NONE;
}

float ScalarInput(tf::OpKernelContext* ctx, int index) {
    return ctx->input(index).scalar<float>()();
}

// One resource input and the tensor the step will write.
struct Target {
    int input;
    tf::core::RefCountPtr<tf::Var> var;
};

class FusedStepOp : public tf::OpKernel {
  public:
    FusedStepOp(tf::OpKernelConstruction* ctx, int optimizer) : tf::OpKernel(ctx) {
        std::string unscale;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_variables", &num_variables_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("decay", &decay_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("unscale", &unscale));
        OP_REQUIRES(ctx, static_cast<int>(decay_.size()) == num_variables_,
                    tf::errors::InvalidArgument("decay has ", decay_.size(),
                                                " entries for ", num_variables_, " variables"));
        std::memset(&config_, 0, sizeof config_);
        config_.optimizer = optimizer;
        config_.unscale = UnscaleMode(unscale);
    }

  protected:
    int num_variables_ = 0;
    std::vector<int> decay_;  // ls_decay per variable
    ls_optim_config config_;

    // Whether the step applies: `apply`, a scalar.
    static bool Applies(tf::OpKernelContext* ctx) {
        const tf::Tensor& apply = ctx->input(0);
        return tf::TensorShapeUtils::IsScalar(apply.shape()) && apply.scalar<bool>()();
    }

    void Run(tf::OpKernelContext* ctx, int first_scalar, ls_optim_config config) {
        const int n = num_variables_;
        const int grads_first = 1 + n + TotalSlots();
        config.scale = ScalarInput(ctx, first_scalar);
        config.learning_rate = ScalarInput(ctx, first_scalar + 1);

        // Every resource: the variables, then each slot list in order.
        std::vector<Target> targets;
        for (int i = 1; i < grads_first; ++i)
            targets.push_back({i, {}});
        std::vector<tf::mutex*> mutexes;
        for (Target& t : targets) {
            OP_REQUIRES_OK(ctx, tf::LookupResource(ctx, tf::HandleFromInput(ctx, t.input), &t.var));
            mutexes.push_back(t.var->mu());
        }
        std::vector<tf::mutex*> order = mutexes;
        std::sort(order.begin(), order.end());
        for (size_t i = 1; i < order.size(); ++i)
            OP_REQUIRES(ctx, order[i] != order[i - 1],
                        tf::errors::InvalidArgument(
                            type_string(), ": a variable or slot is passed twice (",
                            NameOf(ctx, Duplicate(mutexes, order[i])), ")"));
        std::vector<tf::mutex_lock> locks;
        locks.reserve(order.size());
        for (tf::mutex* mu : order)
            locks.emplace_back(*mu);

        // Check everything before any write.
        std::vector<ls_param> params(n);
        for (int i = 0; i < n; ++i) {
            const tf::Tensor& g = ctx->input(grads_first + i);
            ls_dtype dt;
            OP_REQUIRES(ctx, ToCoreDtype(g.dtype(), &dt) && dt != LS_FLOAT64,
                        tf::errors::InvalidArgument("gradient of ", NameOf(ctx, 1 + i),
                                                    " has unsupported dtype ",
                                                    tf::DataTypeString(g.dtype())));
            for (int s = 0; s * n + i < grads_first - 1; ++s) {
                const Target& t = targets[s * n + i];
                const tf::Tensor* value = t.var->tensor();
                const std::string what = NameOf(ctx, t.input);
                OP_REQUIRES(ctx, t.var->is_initialized,
                            tf::errors::FailedPrecondition(type_string(), ": ", what,
                                                           " is not initialized"));
                OP_REQUIRES(ctx, value->dtype() == tf::DT_FLOAT,
                            tf::errors::InvalidArgument(type_string(), ": ", what,
                                                        " must be float32, got ",
                                                        tf::DataTypeString(value->dtype())));
                OP_REQUIRES(ctx, value->shape() == g.shape(),
                            tf::errors::InvalidArgument(
                                type_string(), ": ", what, " has shape ",
                                value->shape().DebugString(), ", its gradient has shape ",
                                g.shape().DebugString()));
            }
            params[i].grad = g.tensor_data().data();
            params[i].grad_dtype = dt;
            params[i].length = static_cast<size_t>(g.NumElements());
            params[i].decay = decay_[i];
        }
        int rc = ls_optim_validate(params.data(), 0, &config);
        OP_REQUIRES(ctx, rc == LS_OK,
                    tf::errors::InvalidArgument(
                        type_string(), ": the learning rate (", config.learning_rate,
                        "), the loss scale (", config.scale,
                        ") or a hyperparameter is not finite or out of range"));

        // Copy-on-write where a reader still holds a buffer; then point the
        // core at the buffers it may write.
        for (Target& t : targets) {
            tf::Tensor* value = t.var->tensor();
            if (t.var->copy_on_read_mode.load() || !value->RefCountIsOne()) {
                tf::Tensor copy;
                tf::AllocatorAttributes attr;
                attr.set_gpu_compatible(true);
                attr.set_nic_compatible(true);
                OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_FLOAT, value->shape(), &copy, attr));
                std::memcpy(const_cast<char*>(copy.tensor_data().data()),
                            value->tensor_data().data(), value->TotalBytes());
                *value = copy;
            }
        }
        for (int i = 0; i < n; ++i) {
            params[i].var = Floats(targets[i]);
            for (int s = 1; s * n + i < grads_first - 1; ++s)
                params[i].slot[s - 1] = Floats(targets[s * n + i]);
        }
        rc = ls_optim_validate(params.data(), params.size(), &config);
        OP_REQUIRES(ctx, rc == LS_OK, CoreError(rc, type_string().c_str()));
        size_t total = 0;
        for (const ls_param& p : params)
            total += p.length;
        rc = RunInParts(ctx, total, [&](size_t begin, size_t end) {
            return ls_optim_step_range(params.data(), params.size(), &config, LS_FLUSH_DENORMALS,
                                       begin, end);
        });
        OP_REQUIRES(ctx, rc >= 0, CoreError(rc, type_string().c_str()));
    }

    virtual int TotalSlots() const = 0;

  private:
    static float* Floats(const Target& t) {
        return reinterpret_cast<float*>(const_cast<char*>(t.var->tensor()->tensor_data().data()));
    }

    static size_t Duplicate(const std::vector<tf::mutex*>& all, tf::mutex* mu) {
        return static_cast<size_t>(std::find(all.begin(), all.end(), mu) - all.begin());
    }

    static std::string NameOf(tf::OpKernelContext* ctx, size_t input) {
        return "variable '" + tf::HandleFromInput(ctx, static_cast<int>(input)).name() + "'";
    }
};

class ApplySgdOp : public FusedStepOp {
  public:
    explicit ApplySgdOp(tf::OpKernelConstruction* ctx) : FusedStepOp(ctx, LS_OPTIM_SGD) {
        bool nesterov = false;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_momentums", &num_momentums_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("momentum", &config_.momentum));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("nesterov", &nesterov));
        config_.nesterov = nesterov ? 1 : 0;
        OP_REQUIRES(ctx, num_momentums_ == (config_.momentum != 0.0f ? num_variables_ : 0),
                    tf::errors::InvalidArgument(
                        "LossScaleApplySgd: momentum ", config_.momentum, " needs ",
                        config_.momentum != 0.0f ? num_variables_ : 0,
                        " momentum variables, got ", num_momentums_));
    }

    void Compute(tf::OpKernelContext* ctx) override {
        if (!Applies(ctx))
            return;
        ls_optim_config config = config_;
        const int first_scalar = 1 + 2 * num_variables_ + num_momentums_;
        config.weight_decay = ScalarInput(ctx, first_scalar + 2);
        Run(ctx, first_scalar, config);
    }

    int TotalSlots() const override { return num_momentums_; }

  private:
    int num_momentums_ = 0;
};

class ApplyAdamOp : public FusedStepOp {
  public:
    explicit ApplyAdamOp(tf::OpKernelConstruction* ctx) : FusedStepOp(ctx, LS_OPTIM_ADAM) {
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_v_hat", &num_v_hat_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("one_minus_beta_1", &config_.one_minus_beta_1));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("one_minus_beta_2", &config_.one_minus_beta_2));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &config_.epsilon));
        OP_REQUIRES(ctx, num_v_hat_ == 0 || num_v_hat_ == num_variables_,
                    tf::errors::InvalidArgument("LossScaleApplyAdam: v_hat must be empty or "
                                                "one per variable, got ", num_v_hat_));
        config_.amsgrad = num_v_hat_ > 0 ? 1 : 0;
    }

    void Compute(tf::OpKernelContext* ctx) override {
        if (!Applies(ctx))
            return;
        ls_optim_config config = config_;
        const int first_scalar = 1 + 4 * num_variables_ + num_v_hat_;
        config.alpha = ScalarInput(ctx, first_scalar + 2);
        config.weight_decay = ScalarInput(ctx, first_scalar + 3);
        Run(ctx, first_scalar, config);
    }

    int TotalSlots() const override { return 2 * num_variables_ + num_v_hat_; }

  private:
    int num_v_hat_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("LossScaleApplySgd").Device(tf::DEVICE_CPU), ApplySgdOp);
REGISTER_KERNEL_BUILDER(Name("LossScaleApplyAdam").Device(tf::DEVICE_CPU), ApplyAdamOp);

}  // namespace
}  // namespace lossscale_tf
