#pragma once
// What a step's gradients say, for its report: fp16's view of them (GradientStats, every N
// steps) and, for a skipped step, which of the loss and the parameters held inf/NaN (Overflow).
// Read from the model's gradients and, under MixedO2, the masters' where they hold them.

#include <mixprec/core/tensor_set.hpp>
#include <mixprec/diagnostics/gradient_stats.hpp>
#include <mixprec/diagnostics/overflow.hpp>
#include <mixprec/optim/master_weights.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mixprec::detail {

/// fp16's view of the gradients, per parameter or name prefix, still scaled: in the masters'
/// gradients where they hold them at the end of the backward pass (`in_masters`: MixedO2
/// with accumulation or data parallel), else in the model's.
inline GradientStats gradient_stats(const torch::nn::Module& model, const MasterWeights* masters,
                                  std::int64_t step, double scale, std::int64_t group_depth,
                                  bool in_masters) {
  std::vector<std::string> names;
  std::vector<at::Tensor> grads;
  for (const auto& [name, p] : unique_named(model.named_parameters())) {
    const auto master = in_masters && masters != nullptr ? masters->master_of(p) : at::Tensor();
    const auto grad = master.defined() ? master.grad() : p.grad();
    if (!grad.defined()) continue;
    names.push_back(name_prefix(name, group_depth));
    grads.push_back(grad);
  }
  auto ranges = gradient_ranges(grads, scale);
  for (std::size_t i = 0; i < ranges.size(); ++i) ranges[i].name = std::move(names[i]);
  GradientStats stats;
  stats.step = step;
  stats.scale = scale;
  stats.entries = merge_ranges(std::move(ranges));
  return stats;
}

/// A skipped step's second pass: which of the loss and the gradients held inf/NaN. After the
/// unscale pass a non-finite gradient is still non-finite, in the model's gradient and, under
/// MixedO2, in the master's: both are read.
inline Overflow find_overflow(const torch::nn::Module& model, const MasterWeights* masters,
                            const at::Tensor& losses, bool data_parallel) {
  Overflow overflow;
  overflow.loss = losses.defined() && !std::isfinite(losses.item<double>());
  std::vector<std::string> names;
  std::vector<at::Tensor> grads;
  std::vector<std::size_t> owner;  // index into names of each gradient read
  for (const auto& [name, p] : unique_named(model.named_parameters())) {
    const auto master = masters != nullptr ? masters->master_of(p) : at::Tensor();
    bool has_grad = false;
    for (const auto& grad : {p.grad(), master.defined() ? master.grad() : at::Tensor()}) {
      if (!grad.defined()) continue;
      owner.push_back(names.size());
      grads.push_back(grad);
      has_grad = true;
    }
    overflow.checked += has_grad ? 1 : 0;
    names.push_back(name);
  }
  const auto flags = non_finite_flags(grads);
  std::vector<bool> bad(names.size(), false);
  for (std::size_t i = 0; i < flags.size(); ++i) bad[owner[i]] = bad[owner[i]] || flags[i];
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (!bad[i]) continue;
    ++overflow.param_count;
    if (overflow.params.size() < Overflow::max_names) overflow.params.push_back(names[i]);
  }
  overflow.other_rank = data_parallel && !overflow.loss && overflow.param_count == 0;
  return overflow;
}

}  // namespace mixprec::detail
