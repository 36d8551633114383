#pragma once
/// Internals of mixprec::ops::masked_softmax: the masked softmax as one autograd node.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <limits>
#include <mixprec/detail/ops_common.hpp>

namespace mixprec::ops::detail {

/// softmax over `dim` of the kept entries of `vector` (already in its compute dtype).
/// Why a custom node rather than masked_fill + softmax: the composite allocates two
/// activation-sized tensors, and on the CPU the page faults of a fresh 64 MiB buffer cost as much
/// as the softmax itself. Here the fill writes one buffer and the softmax runs in place in it;
/// backward needs only that output and the mask, as softmax's own backward does.
struct MaskedSoftmaxFunction : torch::autograd::Function<MaskedSoftmaxFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& vector,
                            const at::Tensor& keep, int64_t dim, bool uniform_empty_rows) {
    const auto row_any = keep.any(dim, /*keepdim=*/true);
    // On the CPU the check is free and saves a pass; elsewhere it would be a device sync.
    const bool may_have_empty_rows = !vector.is_cpu() || !row_any.all().item<bool>();
    at::Tensor out;
    if (may_have_empty_rows && uniform_empty_rows) {
      // Equal logits in fully masked rows make their softmax uniform (memory_efficient).
      out = at::where(keep, vector, masked_fill_values(row_any, vector.options()));
    } else {
      // Exactly 0 after exp, whatever the row's maximum, so masked entries weigh nothing.
      out = at::where(keep, vector, -std::numeric_limits<double>::infinity());
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
    if (may_have_empty_rows && !uniform_empty_rows) {
      // Fully masked rows were all -inf, hence NaN; they become zeros before anyone sees them.
      out.masked_fill_(row_any.logical_not(), 0);
    }
    ctx->save_for_backward({out, keep});
    ctx->saved_data["dim"] = dim;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& out = saved[0];
    const auto& keep = saved[1];
    const int64_t dim = ctx->saved_data["dim"].toInt();
    // Written with differentiable ops, so double backward works as for softmax itself.
    // Masked outputs are constants: an inf/NaN gradient arriving there must not reach the row
    // sum of the softmax backward, so it is dropped first; masked entries then get exactly zero.
    const auto grad_out = grad_outputs[0].masked_fill(keep.logical_not(), 0);
    auto grad = at::_softmax_backward_data(grad_out, out, dim, out.scalar_type());
    grad.masked_fill_(keep.logical_not(), 0);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace mixprec::ops::detail
