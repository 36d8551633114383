#pragma once
/// lean_adam_step: torch::optim::Adam's or AdamW's step over lean masters (MasterWeights', or,
/// sharded, a rank's pieces: LeanTargets names each tensor's), through the one-pass kernel of
/// lean_adam.hpp, on the CPU: TrainerOptions::fused_optimizer
/// under RemainderMasters or StochasticRounding. The optimizer stays the source of truth for
/// hyperparameters (read from its param groups at every step) and holds LibTorch's own
/// AdamParamState / AdamWParamState, keyed by the master tensors as its step would key them;
/// the moments in it are bf16 where the storage keeps them so, and made so at the first step.

#include <mixprec/core/error.hpp>
#include <mixprec/optim/fused_adam.hpp>
#include <mixprec/optim/lean_adam.hpp>
#include <mixprec/optim/master_weights.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace mixprec::detail {

/// The lean target of each tensor the optimizer steps (nullopt: an fp32 tensor, stepped as is).
using LeanTargets = std::function<std::optional<LeanTarget>(const at::Tensor&)>;

namespace lean_step {

inline void check_state(const at::Tensor& state, const at::Tensor& like, c10::ScalarType dtype,
                        const char* name) {
  MIXPREC_CHECK(state.defined() && state.sizes() == like.sizes() && state.scalar_type() == dtype &&
                    state.device() == like.device() && state.is_contiguous(),
                "the lean Adam step: the optimizer state '", name, "' of a parameter of shape ",
                like.sizes(), " is ", state.defined() ? state.toString() : std::string("undefined"),
                state.defined() ? " of shape " : "", state.defined() ? state.sizes() : at::IntArrayRef{},
                "; it needs ", dtype, " of the parameter's shape, contiguous on its device (was "
                "the state loaded for another model or storage?)");
}

template <AdamKind Kind>
void step(torch::optim::Optimizer& optimizer, const LeanTargets& targets, float grad_scale,
          bool narrow_moments) {
  using Options = typename AdamTypes<Kind>::Options;
  using State = typename AdamTypes<Kind>::State;
  struct Work {
    at::Tensor param, grad, model;
    std::optional<LeanTarget> lean;
    State* state;
    AdamHyper h;
    c10::ScalarType moment_dtype;
  };
  std::vector<Work> work;
  auto& states = optimizer.state();
  // Every check before anything changes.
  const auto repeated = first_repeated(optimizer_tensors(optimizer));
  MIXPREC_CHECK(!repeated.defined(), "the lean Adam step: a tensor of shape ", repeated.sizes(),
                " is listed twice in the optimizer: list each tensor once");
  for (auto& group : optimizer.param_groups()) {
    const auto h = adam_hyper<Options>(group.options());
    for (auto& p : group.params()) {
      const auto& grad = p.grad();
      if (!grad.defined()) continue;
      Work w{p, grad, p, targets(p), nullptr, h, at::kFloat};
      if (w.lean) w.model = w.lean->model;
      const auto& shape = w.model;
      MIXPREC_CHECK(shape.device().is_cpu(), "the lean Adam step runs on the CPU; a parameter is "
                    "on ", shape.device());
      MIXPREC_CHECK(!grad.is_sparse() && grad.sizes() == shape.sizes() &&
                        (grad.scalar_type() == at::kFloat ||
                         (w.lean && grad.scalar_type() == at::kBFloat16)),
                    "the lean Adam step: the gradient of a parameter of shape ", shape.sizes(),
                    " is ", grad.scalar_type(), " of shape ", grad.sizes());
      MIXPREC_CHECK(w.lean || p.scalar_type() == at::kFloat, "the lean Adam step: a parameter "
                    "of shape ", p.sizes(), " is ", p.scalar_type(), ", neither fp32 nor a "
                    "lean master");
      MIXPREC_CHECK(shape.is_contiguous(), "the lean Adam step reads parameters as flat arrays: "
                    "a parameter of shape ", shape.sizes(), " has strides ", shape.strides(),
                    "; make it contiguous");
      w.moment_dtype = w.lean && narrow_moments ? at::kBFloat16 : at::kFloat;
      const auto it = states.find(state_key<decltype(states)>(p));
      if (it != states.end()) {
        auto* state = dynamic_cast<State*>(it->second.get());
        MIXPREC_CHECK(state != nullptr, "the lean Adam step: the optimizer holds a state of "
                      "another optimizer type for a tensor of shape ", shape.sizes());
        check_state(state->exp_avg(), shape, w.moment_dtype, "exp_avg");
        check_state(state->exp_avg_sq(), shape, w.moment_dtype, "exp_avg_sq");
        if (h.amsgrad) check_state(state->max_exp_avg_sq(), shape, w.moment_dtype, "max_exp_avg_sq");
        w.state = state;
      }
      work.push_back(std::move(w));
    }
  }
  at::NoGradGuard no_grad;
  for (auto& w : work) {
    if (w.state == nullptr) {  // as Adam::step creates it, in the storage's dtype
      auto state = std::make_unique<State>();
      state->step(0);
      const auto zeros = [&] { return at::zeros(w.model.sizes(), w.model.options().dtype(w.moment_dtype)); };
      state->exp_avg(zeros());
      state->exp_avg_sq(zeros());
      if (w.h.amsgrad) state->max_exp_avg_sq(zeros());
      w.state = state.get();
      states[state_key<decltype(states)>(w.param)] = std::move(state);
    }
    w.state->step(w.state->step() + 1);
    auto s = LeanAdamStep::make(w.h.lr, w.h.beta1, w.h.beta2, w.h.eps, w.h.weight_decay,
                                w.state->step(), Kind == AdamKind::adamw, w.h.amsgrad);
    s.grad_scale = grad_scale;
    const auto grad = w.grad.contiguous();
    LeanAdamTensors t;
    t.numel = w.model.numel();
    t.grad = grad.data_ptr();
    t.grad_bf16 = grad.scalar_type() == at::kBFloat16;
    t.exp_avg = w.state->exp_avg().data_ptr();
    t.exp_avg_sq = w.state->exp_avg_sq().data_ptr();
    if (w.h.amsgrad) t.max_exp_avg_sq = w.state->max_exp_avg_sq().data_ptr();
    t.moments_bf16 = w.moment_dtype == at::kBFloat16;
    if (!w.lean) {
      t.fp32 = static_cast<float*>(w.param.data_ptr());
      lean_adam_update(t, s, {});
      continue;
    }
    auto& kept = w.lean->kept;
    t.bf16 = static_cast<std::uint16_t*>(w.model.data_ptr());
    t.key = kept.key;
    t.first = kept.first;  // a rank's slice steps as the whole tensor's elements do
    t.whole = kept.whole;
    if (kept.remainder.defined()) {
      t.remainder = static_cast<std::int16_t*>(kept.remainder.data_ptr());
      *kept.down_ties = lean_adam_update(t, s, *kept.down_ties);
    } else {
      lean_adam_update(t, s, {});
    }
  }
}

}  // namespace lean_step

/// One Adam or AdamW step of `optimizer` (exactly torch::optim::Adam or AdamW) over `targets`
/// (a lean storage's), gradients divided by `grad_scale` (one fp32 value; undefined: by 1), in
/// the arithmetic of ATen's fused kernel (lean_adam.hpp).
/// `narrow_moments`: the moments of the lean masters are bf16 (RemainderMasters<BFloat16>, ...).
inline void lean_adam_step(torch::optim::Optimizer& optimizer, const LeanTargets& targets,
                           const at::Tensor& grad_scale, bool narrow_moments) {
  const auto kind = adam_kind(optimizer);
  MIXPREC_CHECK(kind.has_value(), "the lean one-pass step (fused_optimizer under a lean "
                "storage) is Adam's or AdamW's: the optimizer must be exactly torch::optim::Adam "
                "or AdamW; turn fused_optimizer off for another");
  // Divided by, as ATen's fused kernel divides (a multiplication by 1 / scale rounds otherwise).
  const float scale = grad_scale.defined() ? grad_scale.to(at::kCPU).item<float>() : 1.0F;
  if (*kind == AdamKind::adam) {
    lean_step::step<AdamKind::adam>(optimizer, targets, scale, narrow_moments);
  } else {
    lean_step::step<AdamKind::adamw>(optimizer, targets, scale, narrow_moments);
  }
}

}  // namespace mixprec::detail
