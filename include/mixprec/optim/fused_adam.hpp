#pragma once
/// One Adam or AdamW step through ATen's fused kernel (`at::_fused_adam_` / `_fused_adamw_`,
/// CPU from LibTorch 2.4, and CUDA): a single pass over each parameter that reads the gradient,
/// divides it by an optional grad_scale (writing it back unscaled, as unscale_ would), updates
/// the moments and the parameter. LibTorch's own Adam makes about eight passes.
///
/// The user's optimizer stays the source of truth: hyperparameters come from its param groups
/// (read at every step), and its state is LibTorch's own AdamParamState / AdamWParamState,
/// created as Adam::step creates it. Its state_dict therefore loads into an unfused optimizer,
/// and the reverse. Results equal LibTorch's Adam up to rounding: the kernel groups the same
/// arithmetic differently (tests/optim/test_fused_adam.cpp states and checks the bound).
///
///   torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
///   mixprec::Trainer<mixprec::MixedO2<at::BFloat16>> trainer(
///       model, optimizer, mixprec::TrainerOptions().fused_optimizer(true));

#include <mixprec/core/compat.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Type.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace mixprec {

namespace detail {

enum class AdamKind { adam, adamw };

// Exactly torch::optim::Adam or AdamW: a subclass may override step(), which the fused kernel
// would silently bypass.
inline std::optional<AdamKind> adam_kind(const torch::optim::Optimizer& optimizer) {
  if (typeid(optimizer) == typeid(torch::optim::Adam)) return AdamKind::adam;
  if (typeid(optimizer) == typeid(torch::optim::AdamW)) return AdamKind::adamw;
  return std::nullopt;
}

/// The hyperparameters of one param group, from Adam's or AdamW's options.
struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad;
};

template <class Options>
AdamHyper adam_hyper(const torch::optim::OptimizerOptions& options) {
  const auto* o = dynamic_cast<const Options*>(&options);
  MIXPREC_CHECK(o != nullptr, "fused_adam_step: a param group's options are not the "
                "optimizer's own options type; add groups with the optimizer's options");
  return {o->lr(), std::get<0>(o->betas()), std::get<1>(o->betas()), o->eps(),
          o->weight_decay(), o->amsgrad()};
}

template <class State>
const State* adam_state(const torch::optim::Optimizer& optimizer, const at::Tensor& p) {
  const auto& states = optimizer.state();
  const auto it = states.find(state_key<decltype(states)>(p));
  if (it == states.end()) return nullptr;
  const auto* state = dynamic_cast<const State*>(it->second.get());
  MIXPREC_CHECK(state != nullptr, "fused_adam_step: the optimizer holds a state of another "
                "optimizer type for a tensor of shape ", p.sizes());
  return state;
}

inline void check_state_tensor(const at::Tensor& state, const at::Tensor& p, const char* name) {
  MIXPREC_CHECK(state.defined() && state.sizes() == p.sizes() &&
                    state.scalar_type() == p.scalar_type() && state.device() == p.device() &&
                    state.strides() == p.strides(),
                "fused_adam_step: the optimizer state '", name, "' of a parameter of shape ",
                p.sizes(), " (", p.scalar_type(), ", ", p.device(), ") is ",
                state.defined() ? state.toString() : std::string("undefined"), " of shape ",
                state.defined() ? state.sizes() : at::IntArrayRef{},
                ": the fused kernel needs the parameter's shape, dtype, device and layout (was "
                "the state loaded for another model, or moved to another device?)");
}

// Validates every parameter that has a gradient before anything changes.
template <class Options, class State>
void check_fused_params(const torch::optim::Optimizer& optimizer) {
  const auto repeated = first_repeated(optimizer_tensors(optimizer));
  MIXPREC_CHECK(!repeated.defined(), "fused_adam_step: a tensor of shape ", repeated.sizes(),
                " is listed twice in the optimizer (tied weights listed once per name?) and "
                "would be stepped twice: list each tensor once");
  for (const auto& group : optimizer.param_groups()) {
    const bool amsgrad = adam_hyper<Options>(group.options()).amsgrad;
    for (const auto& p : group.params()) {
      const auto& grad = p.grad();
      if (!grad.defined()) continue;
      MIXPREC_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble,
                    "fused_adam_step: a parameter of shape ", p.sizes(), " is ", p.scalar_type(),
                    "; ATen's fused Adam divides by grad_scale in the parameter's dtype (65536 "
                    "is inf in fp16), so the fused step takes fp32 (or fp64) parameters only");
      MIXPREC_CHECK(!grad.is_sparse(), "Adam does not support sparse gradients; the fused "
                    "step neither (use a dense embedding, sparse=false)");
      MIXPREC_CHECK(p.device().is_cpu() || p.device().is_cuda(), "fused_adam_step: a parameter "
                    "is on ", p.device(), "; ATen's fused Adam runs on CPU and CUDA only");
      MIXPREC_CHECK(p.is_contiguous(), "fused_adam_step: a parameter of shape ", p.sizes(),
                    " has strides ", p.strides(), "; the fused kernel reads parameters, "
                    "gradients and moments as flat arrays: make it contiguous, or use the "
                    "unfused step");
      MIXPREC_CHECK(grad.scalar_type() == p.scalar_type() && grad.device() == p.device() &&
                        grad.sizes() == p.sizes(),
                    "fused_adam_step: the gradient of a parameter of shape ", p.sizes(), " (",
                    p.scalar_type(), ") is ", grad.scalar_type(), " of shape ", grad.sizes(),
                    " on ", grad.device(), "; the fused kernel needs the parameter's");
      if (const auto* state = adam_state<State>(optimizer, p)) {
        check_state_tensor(state->exp_avg(), p, "exp_avg");
        check_state_tensor(state->exp_avg_sq(), p, "exp_avg_sq");
        if (amsgrad) check_state_tensor(state->max_exp_avg_sq(), p, "max_exp_avg_sq");
      }
    }
  }
}

template <AdamKind Kind>
struct AdamTypes;
template <>
struct AdamTypes<AdamKind::adam> {
  using Options = torch::optim::AdamOptions;
  using State = torch::optim::AdamParamState;
};
template <>
struct AdamTypes<AdamKind::adamw> {
  using Options = torch::optim::AdamWOptions;
  using State = torch::optim::AdamWParamState;
};

}  // namespace detail

/// An Error unless fused_adam_step can step `optimizer`: exactly torch::optim::Adam or AdamW
/// (not a subclass), on a LibTorch with the fused kernels.
inline void check_fused_adam(const torch::optim::Optimizer& optimizer) {
  MIXPREC_CHECK(fused_adam_available, "the fused Adam/AdamW step needs LibTorch >= 2.4 (ATen's "
                "_fused_adam_ CPU kernel); this is LibTorch ", torch_version, ": turn "
                "fused_optimizer off");
  MIXPREC_CHECK(detail::adam_kind(optimizer).has_value(), "the fused step folds unscaling into "
                "ATen's fused Adam/AdamW kernel, so the optimizer must be exactly "
                "torch::optim::Adam or torch::optim::AdamW (a subclass could override step()); "
                "got ", c10::demangle(typeid(optimizer).name()), ": turn fused_optimizer off");
}

namespace detail {

template <AdamKind Kind>
void fused_adam_step_impl(torch::optim::Optimizer& optimizer, const at::Tensor& grad_scale) {
  using Options = typename AdamTypes<Kind>::Options;
  using State = typename AdamTypes<Kind>::State;
  check_fused_params<Options, State>(optimizer);
  MIXPREC_CHECK(!grad_scale.defined() || (grad_scale.scalar_type() == at::kFloat &&
                                          grad_scale.numel() == 1),
                "fused_adam_step: grad_scale must be one fp32 value, got ",
                grad_scale.toString(), " of shape ", grad_scale.sizes());
  // All checks passed: from here on state and parameters change.
  at::NoGradGuard no_grad;
  auto& states = optimizer.state();
  for (auto& group : optimizer.param_groups()) {
    const auto h = adam_hyper<Options>(group.options());
    // One kernel call per (device, dtype), as the CUDA kernel wants; the step counts are
    // per-parameter tensors, shared between parameters at the same count.
    std::map<std::pair<std::string, int>, FusedAdamBatch> batches;
    std::map<std::pair<std::string, std::int64_t>, at::Tensor> step_tensors;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const auto key = state_key<decltype(states)>(p);
      auto it = states.find(key);
      if (it == states.end()) {  // as Adam::step creates it
        auto state = std::make_unique<State>();
        state->step(0);
        state->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        state->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (h.amsgrad) state->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        it = states.insert({key, std::move(state)}).first;
      }
      auto& state = static_cast<State&>(*it->second);
      // The count the kernel's bias correction uses, as Adam::step increments before it. A
      // float holds every count to 2^24; past that, 1 - beta^step is 1 in double anyway.
      state.step(state.step() + 1);
      const auto device = p.device().str();
      auto& step = step_tensors[{device, state.step()}];
      if (!step.defined()) {
        step = at::full({}, static_cast<double>(state.step()),
                        at::TensorOptions(at::kFloat).device(p.device()));
      }
      auto& batch = batches[{device, static_cast<int>(p.scalar_type())}];
      batch.params.push_back(p);
      batch.grads.push_back(p.grad());
      batch.exp_avgs.push_back(state.exp_avg());
      batch.exp_avg_sqs.push_back(state.exp_avg_sq());
      if (h.amsgrad) batch.max_exp_avg_sqs.push_back(state.max_exp_avg_sq());
      batch.steps.push_back(step);
    }
    for (auto& [where, b] : batches) {
      std::optional<at::Tensor> scale;
      if (grad_scale.defined()) scale = grad_scale.reshape({}).to(b.params.front().device());
      fused_adam_kernel(Kind == AdamKind::adamw, b, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps,
                        h.amsgrad, scale);
    }
  }
}

}  // namespace detail

/// One step of `optimizer` (exactly torch::optim::Adam or AdamW) through ATen's fused kernel.
/// A defined `grad_scale` (one fp32 value) divides every gradient first; the divided gradient
/// is written back, as unscale_ would leave it. Parameters without a gradient are skipped, as
/// Adam::step skips them. Everything is checked before anything changes.
inline void fused_adam_step(torch::optim::Optimizer& optimizer, const at::Tensor& grad_scale = {}) {
  check_fused_adam(optimizer);
  if (*detail::adam_kind(optimizer) == detail::AdamKind::adam) {
    detail::fused_adam_step_impl<detail::AdamKind::adam>(optimizer, grad_scale);
  } else {
    detail::fused_adam_step_impl<detail::AdamKind::adamw>(optimizer, grad_scale);
  }
}

}  // namespace mixprec
