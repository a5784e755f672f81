/*
 * LossScaleDebugBufferAddress: a testing aid that makes buffer forwarding
 * observable.  It passes its input through unchanged (the output *is* the
 * input tensor: same buffer, no copy, no allocation) and reports the
 * address of that buffer.  Placed before and after LossScaleUnscaleAndCheck
 * in a graph, equal addresses prove the op wrote its result into its
 * input's buffer.
 */
#include <cstdint>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace lossscale_tf {
namespace {

namespace tf = ::tensorflow;
using tf::shape_inference::InferenceContext;

REGISTER_OP("LossScaleDebugBufferAddress")
    .Input("x: T")
    .Output("y: T")
    .Output("address: int64")
    .Attr("T: type")
    // Stateful so that it is neither folded nor merged with a twin.
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
        c->set_output(0, c->input(0));
        c->set_output(1, c->Scalar());
        return tf::OkStatus();
    })
    .Doc("Testing aid: y = x (same buffer) and the address of that buffer.");

class DebugBufferAddressOp : public tf::OpKernel {
  public:
    explicit DebugBufferAddressOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx) {}

    void Compute(tf::OpKernelContext* ctx) override {
        const tf::Tensor& x = ctx->input(0);
        ctx->set_output(0, x);
        tf::Tensor* address = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({}), &address));
        address->scalar<tf::int64>()() =
            static_cast<tf::int64>(reinterpret_cast<std::uintptr_t>(x.tensor_data().data()));
    }
};

REGISTER_KERNEL_BUILDER(Name("LossScaleDebugBufferAddress").Device(tf::DEVICE_CPU),
                        DebugBufferAddressOp);

}  // namespace
}  // namespace lossscale_tf
