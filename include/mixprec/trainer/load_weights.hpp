#pragma once
// Weights loaded into a model a Trainer trains (Trainer::load_state_dict, Trainer::load_weights):
// io/'s matching and checks, then each fp32 master weight takes the state dict's value and the
// model its rounding, as after an optimizer step, so that the next step starts from the loaded
// weights and not from the masters' old ones.

#include <mixprec/io/load_state_dict.hpp>
#include <mixprec/optim/master_weights.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <string>
#include <utility>
#include <vector>

namespace mixprec::detail {

inline LoadReport load_into_trained(torch::nn::Module& model, MasterWeights* masters,
                                    const WeightsFile& weights, const LoadOptions& options,
                                    const std::string& source) {
  auto plan = plan_load(model, weights.tensors, options, weights.versions);
  std::vector<std::pair<at::Tensor, at::Tensor>> master_values;
  for (auto& a : plan.assignments) {
    const auto master = masters != nullptr ? masters->master_of(a.target) : at::Tensor();
    if (!master.defined() || master.is_same(a.target)) {
      a.value = converted(a.source, a.target.scalar_type(), a.name, plan.into.c_str(), plan.problems);
      continue;
    }
    // The model's value is the master's rounding, as MasterWeights::copy_to_model makes it.
    auto fp32 = converted(a.source, master.scalar_type(), a.name, "its fp32 master weight",
                          plan.problems);
    a.value = converted(fp32, a.target.scalar_type(), a.name, plan.into.c_str(), plan.problems);
    master_values.emplace_back(a.target, std::move(fp32));
  }
  check_plan(plan, options, source);
  // Each master takes its value (under a lean storage, what it keeps of it).
  for (auto& [target, value] : master_values) masters->assign(target, value);
  copy_values(plan.assignments);
  return std::move(plan.report);
}

}  // namespace mixprec::detail
