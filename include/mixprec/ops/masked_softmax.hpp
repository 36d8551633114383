#pragma once
/// Internals of mixprec::ops::masked_softmax: the masked softmax as one autograd node.

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <mixprec/core/autograd_function.hpp>
#include <mixprec/ops/common.hpp>

namespace mixprec::ops::detail {

/// softmax over `dim` of the kept entries of `vector`, computed in `compute_dtype_of` its dtype.
/// Why a custom node rather than masked_fill + softmax: the composite allocates more
/// activation-sized tensors, and on the CPU the page faults of a fresh activation-sized buffer
/// can cost more than the pass that writes it. Here the fill writes one buffer in the compute dtype, and the
/// softmax runs in place in it; backward needs only that output and the mask, as softmax's own
/// backward does, and allocates only its result where the gradient is finite.
struct MaskedSoftmaxFunction : mixprec::detail::AutogradFunction<MaskedSoftmaxFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& vector,
                            const at::Tensor& keep, int64_t dim, bool uniform_empty_rows) {
    const auto compute = compute_dtype_of(vector.scalar_type());
    const auto row_any = keep.any(dim, /*keepdim=*/true);
    // On the CPU the checks are free and save passes; elsewhere they would be device syncs.
    const bool all_kept = vector.is_cpu() && keep.all().item<bool>();
    const bool may_have_empty_rows = !vector.is_cpu() || !row_any.all().item<bool>();
    const bool uniform = may_have_empty_rows && uniform_empty_rows;
    const auto inf = std::numeric_limits<double>::infinity();
    at::Tensor out;
    if (all_kept && vector.scalar_type() == compute) {
      // Nothing to mask (a batch without padding; Python's models drop an all-ones mask too).
      out = at::_softmax(vector, dim, /*half_to_float=*/false);
    } else {
      if (all_kept) {
        out = vector.to(compute);
      } else if (uniform) {
        // Equal logits in fully masked rows make their softmax uniform (memory_efficient); the
        // fill has a dimension, so where() promotes a reduced-float `vector` to its dtype.
        out = at::where(keep, vector, masked_fill_values(row_any, vector.options().dtype(compute)));
      } else if (vector.scalar_type() != compute) {
        // -inf is exactly 0 after exp, whatever the row's maximum: masked entries weigh
        // nothing. The cast's buffer is this node's own, so the fill goes in place.
        out = vector.to(compute).masked_fill_(keep.logical_not(), -inf);
      } else {
        out = at::where(keep, vector, -inf);
      }
      if (!out.is_contiguous()) {
        out = out.contiguous();
      }
      if (out.is_cpu()) {
        // LibTorch's CPU kernels read each element before writing it: in place is safe.
        at::_softmax_out(out, out, dim, /*half_to_float=*/false);
      } else {
        out = at::_softmax(out, dim, /*half_to_float=*/false);
      }
    }
    if (may_have_empty_rows && !uniform_empty_rows) {
      // Fully masked rows were all -inf, hence NaN; they become zeros before anyone sees them.
      out.masked_fill_(row_any.logical_not(), 0);
    }
    ctx->save_for_backward({out, keep});
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["uniform"] = uniform;
    ctx->saved_data["all_kept"] = all_kept;
    ctx->saved_data["dtype"] = static_cast<int64_t>(vector.scalar_type());
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& out = saved[0];
    const auto& keep = saved[1];
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const bool uniform = ctx->saved_data["uniform"].toBool();
    const bool all_kept = ctx->saved_data["all_kept"].toBool();
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    const auto& grad_out = grad_outputs[0];
    // Written with differentiable ops, so double backward works as for softmax itself.
    // Masked outputs are constants. Where they are 0 (every masked entry but those of uniform
    // rows), softmax's backward gives them 0 * (g - row sum): exactly zero while the gradient
    // is finite. A non-finite gradient arriving at a masked entry would instead reach the row
    // sum through 0 * inf = NaN, so then it is dropped first. A finite sum of the result means
    // every element is finite; on the CPU that check costs one read, and saves the two
    // activation-sized buffers of the careful path; elsewhere it would be a device sync.
    if (grad_out.is_cpu()) {
      auto grad = at::_softmax_backward_data(grad_out, out, dim, out.scalar_type());
      if (all_kept || at::isfinite(grad.sum()).item<bool>()) {
        if (uniform) {
          grad.masked_fill_(keep.logical_not(), 0);
        }
        return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor()};
      }
    }
    auto grad = at::_softmax_backward_data(grad_out.masked_fill(keep.logical_not(), 0), out, dim,
                                           out.scalar_type());
    grad.masked_fill_(keep.logical_not(), 0);
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace mixprec::ops::detail
