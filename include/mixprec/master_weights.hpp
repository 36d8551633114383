#pragma once
/// MasterWeights: fp32 copies of a model's low-precision parameters, which the optimizer updates
/// instead of the model (Apex O2). Small updates that would vanish when added to a bf16/fp16
/// weight accumulate in the fp32 master, and the model gets the rounded result after each step.

#include <mixprec/error.hpp>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <unordered_map>
#include <vector>

namespace mixprec {

class MasterWeights {
 public:
  /// Masters for the (already cast) `model_params` from `fp32_values`, their values before the
  /// cast, so the masters are exact; rebinds `optimizer` from the model's parameters to them.
  /// Refuses an optimizer that already has state or holds tensors that are not the model's.
  MasterWeights(const std::vector<at::Tensor>& model_params,
                const std::vector<at::Tensor>& fp32_values, torch::optim::Optimizer& optimizer)
      : model_params_(model_params) {
    MIXPREC_CHECK(fp32_values.size() == model_params_.size(), "MasterWeights needs one fp32 "
                  "value per parameter, got ", fp32_values.size(), " for ", model_params_.size());
    check_rebindable(model_params_, optimizer);
    std::unordered_map<const void*, std::size_t> index;
    for (std::size_t i = 0; i < model_params_.size(); ++i) {
      index.emplace(model_params_[i].unsafeGetTensorImpl(), i);
    }
    masters_.reserve(model_params_.size());
    for (std::size_t i = 0; i < model_params_.size(); ++i) {
      const auto& p = model_params_[i];
      // fp32 parameters (kept norm layers) are their own masters.
      masters_.push_back(p.scalar_type() == at::kFloat
                             ? p
                             : fp32_values[i].detach().to(at::kFloat).clone().requires_grad_(
                                   p.requires_grad()));
    }
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) p = masters_[index.at(p.unsafeGetTensorImpl())];
    }
  }

  /// Throws unless `optimizer` has no state and holds only tensors of `model_params`.
  static void check_rebindable(const std::vector<at::Tensor>& model_params,
                               const torch::optim::Optimizer& optimizer) {
    MIXPREC_CHECK(optimizer.state().empty(),
                  "the optimizer already has state (it has stepped): build the Trainer before "
                  "the first step, so its state is created for the fp32 master weights");
    check_params_of(model_params, optimizer);
  }

  /// Throws unless every tensor `optimizer` holds is one of `model_params`.
  static void check_params_of(const std::vector<at::Tensor>& model_params,
                              const torch::optim::Optimizer& optimizer) {
    std::unordered_map<const void*, std::size_t> index;
    for (std::size_t i = 0; i < model_params.size(); ++i) {
      index.emplace(model_params[i].unsafeGetTensorImpl(), i);
    }
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        MIXPREC_CHECK(index.count(p.unsafeGetTensorImpl()) == 1,
                      "the optimizer holds a tensor of shape ", p.sizes(), " that is not a "
                      "parameter of the model: build it on model->parameters()");
      }
    }
  }

  /// The fp32 tensors the optimizer updates, in the order of the model's parameters.
  const std::vector<at::Tensor>& masters() const noexcept { return masters_; }
  /// The model's parameters, in the model's order.
  const std::vector<at::Tensor>& model_params() const noexcept { return model_params_; }

  /// Writes the masters, rounded, into the model's parameters.
  void copy_to_model() {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < masters_.size(); ++i) {
      if (!masters_[i].is_same(model_params_[i])) model_params_[i].copy_(masters_[i]);
    }
  }

  /// Replaces the masters' values (checkpoint loading); shapes must match.
  void load(const std::vector<at::Tensor>& values) {
    MIXPREC_CHECK(values.size() == masters_.size(), "checkpoint has ", values.size(),
                  " master weights, the model ", masters_.size());
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < values.size(); ++i) masters_[i].copy_(values[i]);
    copy_to_model();
  }

 private:
  std::vector<at::Tensor> model_params_;
  std::vector<at::Tensor> masters_;
};

}  // namespace mixprec
