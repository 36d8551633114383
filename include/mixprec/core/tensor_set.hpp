#pragma once
// "Each tensor once": the one de-duplication of tensors by identity that every part of mixprec
// uses, and the same over an optimizer's param groups. LibTorch's Module::parameters() and named_parameters() list a tensor registered under
// two names (tied weights) once per name, where Python lists it once; an optimizer built on
// them holds it twice.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// A tensor's identity: its TensorImpl, which set_data() keeps (a cast parameter is the same).
using TensorId = const void*;
inline TensorId id_of(const at::Tensor& t) noexcept { return t.unsafeGetTensorImpl(); }

/// The identities of `tensors`.
inline std::unordered_set<TensorId> identities(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<TensorId> result;
  for (const auto& t : tensors) result.insert(id_of(t));
  return result;
}

/// Each tensor once, in first-seen order.
inline std::vector<at::Tensor> unique_tensors(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<TensorId> seen;
  std::vector<at::Tensor> result;
  for (const auto& t : tensors) {
    if (seen.insert(id_of(t)).second) result.push_back(t);
  }
  return result;
}

/// Each tensor once, under its first name (Module::named_parameters() order).
inline std::vector<std::pair<std::string, at::Tensor>> unique_named(
    const torch::OrderedDict<std::string, at::Tensor>& named) {
  std::unordered_set<TensorId> seen;
  std::vector<std::pair<std::string, at::Tensor>> result;
  for (const auto& item : named) {
    if (seen.insert(id_of(item.value())).second) result.emplace_back(item.key(), item.value());
  }
  return result;
}

/// The tensors of every param group, in order.
inline std::vector<at::Tensor> optimizer_tensors(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> result;
  for (const auto& group : optimizer.param_groups()) {
    result.insert(result.end(), group.params().begin(), group.params().end());
  }
  return result;
}

/// The first tensor listed twice in `tensors`, or an undefined one.
inline at::Tensor first_repeated(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<TensorId> seen;
  for (const auto& t : tensors) {
    if (!seen.insert(id_of(t)).second) return t;
  }
  return {};
}

/// Sets each tensor's gradient to none (PyTorch's zero_grad(set_to_none=True)).
inline void clear_grads(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) t.mutable_grad().reset();
}

/// Drops the repeats of a tensor within each param group, so that the optimizer steps it once
/// (a group built on model->parameters() lists tied weights once per name).
inline void dedupe_param_groups(torch::optim::Optimizer& optimizer) {
  for (auto& group : optimizer.param_groups()) {
    auto& params = group.params();
    if (unique_tensors(params).size() != params.size()) params = unique_tensors(params);
  }
}

}  // namespace mixprec::detail
