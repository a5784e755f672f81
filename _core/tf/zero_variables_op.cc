/*
 * LossScaleZeroVariables: every variable set to +0, as Keras zeroes its
 * gradient accumulators after an update step (assign(zeros)), but in the
 * variable's own buffer.  Keras' assign of a zeros tensor leaves the
 * variable sharing the buffer of a constant, so the next in-place update
 * of it (the fused accumulating step) would first have to copy the whole
 * buffer (TensorFlow's copy-on-write); zeroed here, the buffer stays the
 * variable's own.  A buffer another tensor still reads is replaced by a
 * fresh zeroed one instead of being written.
 */
#include <algorithm>
#include <cstring>
#include <vector>

#include "lossscale_tf.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace lossscale_tf {
namespace {

// The variables' buffers as one run of elements, for the pool to zero in
// pieces.
struct Buffers {
    std::vector<float*> data;
    std::vector<size_t> start;
    size_t total = 0;
};

int ZeroRange(const void* arg, size_t begin, size_t end) {
    const auto* b = static_cast<const Buffers*>(arg);
    // The last buffer starting at or before `begin`, then on.
    size_t i = static_cast<size_t>(
        std::upper_bound(b->start.begin(), b->start.end(), begin) - b->start.begin()) - 1;
    for (; i < b->data.size() && b->start[i] < end; ++i) {
        const size_t next = i + 1 < b->start.size() ? b->start[i + 1] : b->total;
        const size_t lo = std::max(begin, b->start[i]), hi = std::min(end, next);
        if (lo < hi)
            std::memset(b->data[i] + (lo - b->start[i]), 0, (hi - lo) * sizeof(float));
    }
    return 1;
}

REGISTER_OP("LossScaleZeroVariables")
    .Input("variables: N * resource")
    .Attr("N: int >= 1")
    .SetIsStateful()
    .SetShapeFn(tf::shape_inference::NoOutputs)
    .Doc(R"doc(
Sets every element of every (initialized, float32) variable to +0.
)doc");

class ZeroVariablesOp : public tf::OpKernel {
  public:
    explicit ZeroVariablesOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx) {
        OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_));
    }

    void Compute(tf::OpKernelContext* ctx) override {
        std::vector<int> inputs(static_cast<size_t>(n_));
        for (int i = 0; i < n_; ++i)
            inputs[static_cast<size_t>(i)] = i;
        UpdatedVariables vars;
        int twice = -1;
        OP_REQUIRES_OK(ctx, vars.LookUp(ctx, inputs, &twice));
        vars.Lock();
        // Every variable checked before any is written.
        for (size_t i = 0; i < vars.size(); ++i) {
            const tf::Tensor* t = vars.var(i)->tensor();
            OP_REQUIRES(ctx, t->IsInitialized() && t->dtype() == tf::DT_FLOAT,
                        tf::errors::InvalidArgument(
                            "LossScaleZeroVariables: variable ", i,
                            " is not an initialized float32 variable"));
        }
        // Every fresh buffer allocated before any variable takes one: a
        // failed allocation leaves every variable as it was.
        // (A default Tensor counts as initialized: `replace` says which.)
        std::vector<tf::Tensor> fresh(vars.size());
        std::vector<bool> replace(vars.size(), false);
        for (size_t i = 0; i < vars.size(); ++i) {
            tf::Var* v = vars.var(i);
            replace[i] = !v->tensor()->RefCountIsOne() || v->copy_on_read_mode.load();
            if (replace[i])
                OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_FLOAT, v->tensor()->shape(),
                                                       &fresh[i]));
        }
        Buffers buffers;
        for (size_t i = 0; i < vars.size(); ++i) {
            tf::Tensor* t = vars.var(i)->tensor();
            if (replace[i])
                *t = fresh[i];
            auto flat = t->flat<float>();
            buffers.data.push_back(flat.data());
            buffers.start.push_back(buffers.total);
            buffers.total += static_cast<size_t>(flat.size());
        }
        ParallelForOnPool(ctx, ZeroRange, &buffers, buffers.total);
    }

  private:
    int n_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("LossScaleZeroVariables").Device(tf::DEVICE_CPU), ZeroVariablesOp);

}  // namespace
}  // namespace lossscale_tf
