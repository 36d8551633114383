#pragma once
// The gradient passes over tensors, as the scalers run them: a list of gradients unscaled and
// checked (unscale_pairs_), its norm and finiteness (grad_stats), its finiteness alone
// (any_non_finite). On the CPU each tensor goes to the loops of unscale_kernels.hpp, as a flat
// span in its own layout or through a contiguous copy, per dtype; elsewhere (CUDA) ATen's fused
// kernel does the work, per device and dtype.

#include <mixprec/scaling/unscale_kernels.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// One gradient to unscale: read from `from`, write into `to` (the same tensor when in place).
struct GradPair {
  at::Tensor from;
  at::Tensor to;
};

// Dense tensors whose elements fill one block of memory (contiguous, transposed, permuted) are
// processed in place as a flat span; other views (slices with gaps) go through a copy.
inline bool is_flat(const at::Tensor& t) { return t.is_non_overlapping_and_dense(); }

inline const void* flat_begin(const at::Tensor& t) {
  // The lowest address of a dense tensor is data_ptr minus the negative-stride offsets;
  // LibTorch forbids negative strides, so it is data_ptr itself.
  return t.data_ptr();
}

template <class F>
void dispatch_grad_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kDouble: f(double{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "mixprec: unexpected gradient dtype ", dtype);
  }
}

// Whether two dense tensors of the same sizes hold their elements in the same order. A
// size-1 dimension's stride does not place anything: a gradient hook can return strides [1, 1]
// for a [1, N] tensor whose master has [N, 1], and autograd keeps them.
inline bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  for (std::int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

/// CPU: to = from * factor in one pass; true when any written value is inf or NaN.
inline bool scale_and_check_cpu(const at::Tensor& from, const at::Tensor& to, float factor) {
  const bool same = from.is_same(to);
  const bool flat = is_flat(from) && (same || (is_flat(to) && same_layout(from, to)));
  if (!flat) {
    // Both contiguous, so of one layout: one level down the copies are flat.
    auto from_c = from.contiguous();
    auto to_c = at::empty_like(to, at::MemoryFormat::Contiguous);
    const bool bad = scale_and_check_cpu(from_c, to_c, factor);
    to.copy_(to_c);
    return bad;
  }
  bool bad = false;
  const auto n = from.numel();
  dispatch_grad_dtype(from.scalar_type(), [&](auto in_tag) {
    using In = decltype(in_tag);
    const auto* in = static_cast<const In*>(flat_begin(from));
    dispatch_grad_dtype(to.scalar_type(), [&](auto out_tag) {
      using Out = decltype(out_tag);
      bad = scale_and_check_span(in, static_cast<Out*>(to.data_ptr()), n, factor);
    });
  });
  return bad;
}

/// CPU: sum of squares and finiteness of one tensor, one read pass.
inline GradStats grad_stats_cpu(const at::Tensor& from) {
  const auto t = is_flat(from) ? from : from.contiguous();
  GradStats stats;
  dispatch_grad_dtype(t.scalar_type(), [&](auto tag) {
    using In = decltype(tag);
    stats = grad_stats_span(static_cast<const In*>(flat_begin(t)), t.numel());
  });
  return stats;
}

/// CPU: whether a Float, Double, Half or BFloat16 tensor holds inf or NaN, one read pass.
inline bool non_finite_cpu(const at::Tensor& from) {
  const auto t = is_flat(from) ? from : from.contiguous();
  bool bad = false;
  dispatch_grad_dtype(t.scalar_type(), [&](auto tag) {
    using In = decltype(tag);
    bad = non_finite_span(static_cast<const In*>(flat_begin(t)), t.numel());
  });
  return bad;
}

/// The gradient values a pass works on: a sparse gradient's values, a dense gradient itself.
inline at::Tensor grad_values(const at::Tensor& grad) {
  return grad.is_sparse() ? grad._values() : grad;
}

/// ATen's own fused check-and-unscale where it has a kernel for `device`: CUDA in every
/// supported LibTorch, the CPU from 2.3 on. On the CPU mixprec's pass is used all the same: it
/// is as fast or faster (docs/benchmarks.md, "ATen's AMP kernel vs mixprec's pass") and checks
/// what it writes.
inline bool use_aten_unscale(const at::Device& device) { return !device.is_cpu(); }

/// ATen's kernel over `grads` (one device and dtype), ORed into found_inf. The kernel checks its
/// inputs, which decides found_inf exactly when |factor| <= 1: a finite value times such a
/// factor stays finite in any dtype. Otherwise (a scale below 1) a second check reads the outputs.
inline void aten_unscale_(const std::vector<at::Tensor>& grads, float factor,
                          const at::Tensor& found_inf) {
  if (grads.front().scalar_type() == at::kBFloat16) {
    // The CUDA kernel has no BFloat16 version (it throws for bf16, seen on an H200 with LibTorch
    // 2.11): fp32 copies, each value computed in fp32 and rounded once, as on the CPU.
    std::vector<at::Tensor> wide;
    wide.reserve(grads.size());
    for (const auto& g : grads) wide.push_back(g.to(at::kFloat));
    aten_unscale_(wide, factor, found_inf);
    for (std::size_t i = 0; i < grads.size(); ++i) grads[i].copy_(wide[i]);
    if (!(std::abs(factor) <= 1.0F)) {
      // A finite fp32 result above bf16's largest value rounds to inf: check what was written.
      wide.clear();
      for (const auto& g : grads) wide.push_back(g.to(at::kFloat));
      aten_unscale_(wide, 1.0F, found_inf);
    }
    return;
  }
  const auto device = grads.front().device();
  const auto options = at::TensorOptions(at::kFloat).device(device);
  // at::full on the device is a fill kernel, not a copy from the host: no synchronisation.
  auto found_here = at::zeros({}, options);
  at::_amp_foreach_non_finite_check_and_unscale_(grads, found_here, at::full({}, factor, options));
  if (!(std::abs(factor) <= 1.0F)) {
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_here, at::ones({}, options));
  }
  found_inf.add_(found_here.to(found_inf.device())).clamp_max_(1.0);
}

/// Unscales all pairs: to = from * factor; found_inf (a 0-dim float tensor) becomes 1 where any
/// result is non-finite. One pass over the data per pair; no host synchronisation.
inline void unscale_pairs_(const std::vector<GradPair>& pairs, float factor,
                           const at::Tensor& found_inf) {
  std::vector<at::Tensor> kernel_grads;
  bool cpu_found = false;
  for (const auto& pair : pairs) {
    const auto from = grad_values(pair.from);
    const auto to = grad_values(pair.to);
    if (!use_aten_unscale(from.device())) {
      cpu_found |= scale_and_check_cpu(from, to, factor);
    } else {
      if (!from.is_same(to)) to.copy_(from);
      kernel_grads.push_back(to);
    }
  }
  if (cpu_found) found_inf.fill_(1.0);
  // Per device and dtype, as the fused kernel wants.
  while (!kernel_grads.empty()) {
    const auto device = kernel_grads.front().device();
    const auto dtype = kernel_grads.front().scalar_type();
    std::vector<at::Tensor> group;
    std::vector<at::Tensor> rest;
    for (auto& g : kernel_grads) {
      (g.device() == device && g.scalar_type() == dtype ? group : rest).push_back(g);
    }
    aten_unscale_(group, factor, found_inf);
    kernel_grads = std::move(rest);
  }
}

/// Sum of squares of all `from` gradients, and whether any of them or of `also` (e.g. the loss;
/// it adds nothing to the sum) is non-finite. CPU gradients are read in mixprec's pass; on a
/// device each tensor's sum stays there, and the total is read back once.
inline GradStats grad_stats(const std::vector<GradPair>& pairs, const at::Tensor& also = {}) {
  GradStats total;
  std::vector<at::Tensor> device_sums;  // one running sum per device
  const auto add_on_device = [&](const at::Tensor& sum) {
    auto it = std::find_if(device_sums.begin(), device_sums.end(),
                           [&](const at::Tensor& s) { return s.device() == sum.device(); });
    if (it == device_sums.end()) {
      device_sums.push_back(sum);
    } else {
      it->add_(sum);
    }
  };
  for (const auto& pair : pairs) {
    const auto from = grad_values(pair.from);
    if (from.device().is_cpu()) {
      const auto s = grad_stats_cpu(from);
      total.sum_of_squares += s.sum_of_squares;
      total.non_finite |= s.non_finite;
    } else {
      add_on_device(from.to(at::kDouble).square().sum());
    }
  }
  if (also.defined()) {
    if (also.device().is_cpu()) {
      total.non_finite |= !at::isfinite(also).all().item<bool>();
    } else {
      // 0 for finite values, NaN otherwise: the flag travels in the sum's one read.
      add_on_device(at::where(at::isfinite(also).all(), 0.0, std::numeric_limits<double>::quiet_NaN())
                        .to(at::kDouble));
    }
  }
  for (const auto& s : device_sums) total.sum_of_squares += s.item<double>();  // one sync each
  total.non_finite |= !(total.sum_of_squares <= std::numeric_limits<double>::max());
  return total;
}

/// Whether any `from` gradient or `also` holds inf or NaN: grad_stats without the sum of squares
/// (a pass that only compares bits) where everything is on the CPU.
inline bool any_non_finite(const std::vector<GradPair>& pairs, const at::Tensor& also = {}) {
  const auto on_cpu = [](const at::Tensor& t) {
    const auto dtype = t.scalar_type();
    return t.device().is_cpu() && (dtype == at::kFloat || dtype == at::kDouble ||
                                   dtype == at::kHalf || dtype == at::kBFloat16);
  };
  bool cpu = !also.defined() || on_cpu(also);
  for (const auto& pair : pairs) cpu = cpu && on_cpu(grad_values(pair.from));
  if (!cpu) return grad_stats(pairs, also).non_finite;
  for (const auto& pair : pairs) {
    if (non_finite_cpu(grad_values(pair.from))) return true;
  }
  return also.defined() && non_finite_cpu(also);
}

}  // namespace mixprec::detail
