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
  /// Masters for the (already cast) parameters the optimizer holds, from `fp32_values` (the
  /// values of `model_params` before the cast, so the masters are exact); rebinds `optimizer`
  /// from the model's tensors to them. Pairing is by tensor identity: any parameter-group order,
  /// a subset of the model (frozen layers left out) and tied weights all work. fp32 parameters
  /// (kept BatchNorm) are their own masters.
  MasterWeights(const std::vector<at::Tensor>& model_params,
                const std::vector<at::Tensor>& fp32_values, torch::optim::Optimizer& optimizer) {
    MIXPREC_CHECK(fp32_values.size() == model_params.size(), "MasterWeights needs one fp32 "
                  "value per parameter, got ", fp32_values.size(), " for ", model_params.size());
    check_rebindable(model_params, optimizer);
    std::unordered_map<const void*, std::size_t> model_index;
    for (std::size_t i = 0; i < model_params.size(); ++i) {
      model_index.emplace(model_params[i].unsafeGetTensorImpl(), i);
    }
    std::unordered_map<const void*, at::Tensor> master_of;  // one master per model tensor
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) {
        const auto i = model_index.at(p.unsafeGetTensorImpl());
        auto [it, inserted] = master_of.try_emplace(p.unsafeGetTensorImpl());
        if (inserted) {
          const auto& model = model_params[i];
          it->second = model.scalar_type() == at::kFloat
                           ? model
                           : fp32_values[i].detach().to(at::kFloat).clone().requires_grad_(
                                 model.requires_grad());
          pairs_.push_back({model, it->second});
        }
        sources_.push_back(model_params[i]);
        p = it->second;
      }
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

  /// The fp32 tensors the optimizer updates, one per model tensor, in the optimizer's order.
  std::vector<at::Tensor> masters() const {
    std::vector<at::Tensor> result;
    for (const auto& pair : pairs_) result.push_back(pair.master);
    return result;
  }

  /// For each parameter the optimizer holds, in its order, the model tensor whose gradient
  /// feeds it: UnscaleOptions::grads_from.
  const std::vector<at::Tensor>& grad_sources() const noexcept { return sources_; }

  /// Adds the model's gradients into the masters' fp32 gradients and zeroes the model's, so
  /// that gradients accumulated over micro-batches sum in fp32, not in the model's dtype.
  void accumulate_grads() {
    at::NoGradGuard no_grad;
    for (auto& pair : pairs_) {
      if (pair.master.is_same(pair.model) || !pair.model.grad().defined()) continue;
      auto& master_grad = pair.master.mutable_grad();
      if (!master_grad.defined()) master_grad = at::zeros_like(pair.master);
      master_grad.add_(pair.model.grad());
      pair.model.mutable_grad().zero_();
    }
  }

  /// Writes the masters, rounded, into the model's parameters.
  void copy_to_model() {
    at::NoGradGuard no_grad;
    for (auto& pair : pairs_) {
      if (!pair.master.is_same(pair.model)) pair.model.copy_(pair.master);
    }
  }

 private:
  struct Pair {
    at::Tensor model;
    at::Tensor master;
  };
  std::vector<Pair> pairs_;
  std::vector<at::Tensor> sources_;
};

}  // namespace mixprec
