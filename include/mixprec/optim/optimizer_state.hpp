#pragma once
// What mixprec needs to know of a torch::optim optimizer's state, whatever the optimizer: whether
// it has stepped, the state LibTorch's Adagrad makes at construction fitted to the tensors it
// holds now, and the optimizers a Trainer cannot drive.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <type_traits>

namespace mixprec::detail {

/// Whether the optimizer has taken a step. Most torch::optim optimizers create their state at
/// their first step; Adagrad creates it in its constructor (step 0, `sum` filled with
/// initial_accumulator_value), which is not a step.
inline bool has_stepped(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::Adagrad*>(&optimizer) == nullptr) {
    return !optimizer.state().empty();
  }
  for (const auto& entry : optimizer.state()) {
    const auto* state = dynamic_cast<const torch::optim::AdagradParamState*>(entry.second.get());
    if (state == nullptr || state->step() > 0) return true;
  }
  return false;
}

/// Gives an optimizer whose state exists from construction (LibTorch's Adagrad) the state its
/// constructor would have built for the tensors it holds now, after the Trainer replaced them
/// (fp32 masters: `replaced(t)` is the model tensor a master replaced, else undefined), cast
/// them, or found a param group added since. An entry is kept, or moved from the replaced
/// tensor, with its `sum` converted to the tensor's dtype (exact before a first step: it holds
/// initial_accumulator_value); where none exists it is made from the group's
/// initial_accumulator_value (LibTorch's add_param_group makes none, and its step() would
/// fail). Entries of tensors no longer held are dropped. Optimizers that create their state at
/// their first step: nothing to do.
template <class Replaced>
void fit_construction_state(torch::optim::Optimizer& optimizer, Replaced&& replaced) {
  if (dynamic_cast<const torch::optim::Adagrad*>(&optimizer) == nullptr) return;
  auto& states = optimizer.state();
  std::decay_t<decltype(states)> fitted;
  for (const auto& group : optimizer.param_groups()) {
    const auto& options = static_cast<const torch::optim::AdagradOptions&>(group.options());
    for (const auto& p : group.params()) {
      auto key = state_key<decltype(states)>(p);
      if (fitted.count(key) == 1) continue;
      auto it = states.find(key);
      if (it == states.end()) {
        const at::Tensor source = replaced(p);
        if (source.defined()) it = states.find(state_key<decltype(states)>(source));
      }
      auto state = std::make_unique<torch::optim::AdagradParamState>();
      state->step(0);
      if (it != states.end()) {
        const auto& old = static_cast<const torch::optim::AdagradParamState&>(*it->second);
        state->step(old.step());
        state->sum(old.sum().to(p.options(), /*non_blocking=*/false, /*copy=*/true));
      } else {
        state->sum(at::full_like(p.detach(), options.initial_accumulator_value(),
                                 at::MemoryFormat::Preserve));
      }
      fitted.emplace(std::move(key), std::move(state));
    }
  }
  states = std::move(fitted);
}

inline void fit_construction_state(torch::optim::Optimizer& optimizer) {
  fit_construction_state(optimizer, [](const at::Tensor&) { return at::Tensor(); });
}

/// Refuses optimizers the Trainer cannot drive: LBFGS re-evaluates the loss through a closure
/// inside its step(), several times per step.
inline void check_supported_optimizer(const torch::optim::Optimizer& optimizer) {
  MIXPREC_CHECK(dynamic_cast<const torch::optim::LBFGS*>(&optimizer) == nullptr,
                "torch::optim::LBFGS is not supported by the Trainer: its step() re-evaluates "
                "the loss through a closure several times (a line search on unscaled losses), "
                "while Trainer::step runs loss_fn once per micro-batch. Train LBFGS in a "
                "hand-written loop (under mixprec::autocast for mixed precision), or use SGD, "
                "Adam, AdamW, Adagrad or RMSprop");
}

}  // namespace mixprec::detail
