/*
 * Glue between TensorFlow kernels and the C core: dtype mapping, a list of
 * tensors as an ls_buffer list, core status codes as TensorFlow errors,
 * and one element range split over TensorFlow's intra-op thread pool.
 * The arithmetic itself is the core's (lossscale.h); nothing here
 * computes on gradient values.
 */
#ifndef LOSSSCALE_TF_H
#define LOSSSCALE_TF_H

#include <atomic>
#include <cstddef>
#include <functional>
#include <vector>

#include "lossscale.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/util/work_sharder.h"

namespace lossscale_tf {

namespace tf = ::tensorflow;

// Elements per scheduling unit of the thread pool.  Big enough that the
// per-range fixed cost of the core (argument checks, floating-point state)
// is negligible, small enough that a ResNet-sized list keeps every
// intra-op thread busy.
constexpr size_t kElementsPerBlock = size_t{1} << 15;

inline bool ToCoreDtype(tf::DataType dt, ls_dtype* out) {
    switch (dt) {
    case tf::DT_HALF: *out = LS_FLOAT16; return true;
    case tf::DT_BFLOAT16: *out = LS_BFLOAT16; return true;
    case tf::DT_FLOAT: *out = LS_FLOAT32; return true;
    case tf::DT_DOUBLE: *out = LS_FLOAT64; return true;
    default: return false;
    }
}

inline tf::Status CoreError(int rc, const char* what) {
    switch (rc) {
    case LS_ERR_DTYPE:
        return tf::errors::InvalidArgument(what, ": unsupported dtype");
    case LS_ERR_SIMD:
        return tf::errors::InvalidArgument(what, ": ", ls_simd_error());
    default:
        return tf::errors::InvalidArgument(what, ": invalid argument (core status ", rc, ")");
    }
}

// Runs `range(begin, end)` over [0, total) — on the calling thread when the
// list is small, else split over the device's intra-op pool.  Combines the
// results as the core's entry points do: the AND of the finite flags, or the
// first negative status.  Returns 1, 0 or a negative ls_status.
inline int RunOverRange(tf::OpKernelContext* ctx, size_t total,
                        const std::function<int(size_t, size_t)>& range) {
    const size_t block = kElementsPerBlock;
    const size_t blocks = (total + block - 1) / block;
    if (blocks <= 1)
        return range(0, total);
    std::atomic<int> finite{1};
    std::atomic<int> error{0};
    auto work = [&](int64_t first_block, int64_t last_block) {
        size_t begin = static_cast<size_t>(first_block) * block;
        size_t end = static_cast<size_t>(last_block) * block;
        if (end > total)
            end = total;
        int rc = range(begin, end);
        if (rc < 0) {
            int expected = 0;
            error.compare_exchange_strong(expected, rc);
        } else if (rc == 0) {
            finite.store(0, std::memory_order_relaxed);
        }
    };
    const auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    // Cost of one block, in the units Shard compares against (about one per
    // element): always worth parallelising once there are two blocks.
    tf::Shard(pool->num_threads, pool->workers, static_cast<int64_t>(blocks),
              static_cast<int64_t>(block), work);
    int err = error.load();
    return err < 0 ? err : finite.load();
}

}  // namespace lossscale_tf

#endif  // LOSSSCALE_TF_H
