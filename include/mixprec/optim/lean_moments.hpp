#pragma once
/// Optimizer moments kept in bf16 between steps (the `<at::BFloat16>` of a lean storage,
/// core/state_storage.hpp): widen() makes them fp32 for the optimizer's step, narrow() rounds
/// them back to bf16 (to nearest, ties to even) after it. Between steps Adam's and AdamW's
/// exp_avg and exp_avg_sq (and max_exp_avg_sq) take 2 bytes per parameter each instead of 4;
/// during the step the optimizer computes in fp32 as ever, so the only change to the numbers is
/// one rounding of each moment per step. Adam, AdamW and SGD's momentum are kept so; another
/// optimizer is an Error at the Trainer's construction.

#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Type.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <string_view>
#include <typeinfo>

namespace mixprec::detail {

/// An Error unless `optimizer` keeps moments that narrow() knows (Adam, AdamW, SGD).
inline void check_narrowable_moments(const torch::optim::Optimizer& optimizer,
                                     std::string_view policy) {
  const bool known = dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr ||
                     dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr ||
                     dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr;
  MIXPREC_CHECK(known, "Trainer<", policy, "> keeps the optimizer's moments in bf16 between "
                "steps, which it does for torch::optim::Adam, AdamW and SGD; this optimizer is ",
                c10::demangle(typeid(optimizer).name()), ": keep its state in fp32 (the storage's "
                "<float>, e.g. RemainderMasters<> or StochasticRounding<float>)");
}

namespace moments {

// f(key, moment) -> the tensor to keep, for every moment tensor of Adam, AdamW and SGD state.
template <class F>
void for_each_moment(torch::optim::Optimizer& optimizer, F&& f) {
  for (auto& item : optimizer.state()) {  // no structured binding: clang 14 cannot capture one
    const auto& key = item.first;
    auto& state = item.second;
    const auto g = [&](const at::Tensor& m) { return f(key, m); };
    if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(state.get())) {
      s->exp_avg(g(s->exp_avg()));
      s->exp_avg_sq(g(s->exp_avg_sq()));
      if (s->max_exp_avg_sq().defined()) s->max_exp_avg_sq(g(s->max_exp_avg_sq()));
    } else if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      w->exp_avg(g(w->exp_avg()));
      w->exp_avg_sq(g(w->exp_avg_sq()));
      if (w->max_exp_avg_sq().defined()) w->max_exp_avg_sq(g(w->max_exp_avg_sq()));
    } else if (auto* m = dynamic_cast<torch::optim::SGDParamState*>(state.get())) {
      if (m->momentum_buffer().defined()) m->momentum_buffer(g(m->momentum_buffer()));
    }
  }
}

}  // namespace moments

/// The bf16 moments of `optimizer`'s state in fp32, for its step (exact: bf16 is part of fp32).
inline void widen_moments(torch::optim::Optimizer& optimizer) {
  at::NoGradGuard no_grad;
  moments::for_each_moment(optimizer, [](const auto&, const at::Tensor& m) {
    return m.scalar_type() == at::kBFloat16 ? m.to(at::kFloat) : m;
  });
}

/// The fp32 moments of `optimizer`'s state rounded to bf16, for the time between steps; only
/// those whose state key `is_low` accepts (the tensors stepped in place of a bf16 model tensor:
/// fp32 modules keep plain fp32 state).
template <class IsLow>
void narrow_moments(torch::optim::Optimizer& optimizer, IsLow&& is_low) {
  at::NoGradGuard no_grad;
  moments::for_each_moment(optimizer, [&](const auto& key, const at::Tensor& m) {
    return m.scalar_type() == at::kFloat && is_low(key) ? m.to(at::kBFloat16) : m;
  });
}

}  // namespace mixprec::detail
