#pragma once
// The user's forward pass under a Trainer: what step() takes (a callable returning the loss), the
// forward run under the policy's autocast, watched for the first inf/NaN op where asked, with
// LibTorch's dtype errors explained (a kept fp32 output read by a low module; a floating input
// that did not go through cast_input()), and the loss checked and upcast to fp32.

#include <mixprec/core/autocast.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/diagnostics/non_finite_op.hpp>
#include <mixprec/precision/own_outputs.hpp>
#include <mixprec/trainer/setup.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/FunctionRef.h>
#include <torch/nn/module.h>

#include <cctype>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace mixprec::detail {

// What step() takes: a callable with no arguments that returns the loss as a tensor.
template <class LossFn>
constexpr bool returns_loss_impl() {
  if constexpr (std::is_invocable_v<LossFn&>) {
    return std::is_convertible_v<std::invoke_result_t<LossFn&>, at::Tensor>;
  } else {
    return false;
  }
}
template <class LossFn>
inline constexpr bool returns_loss = returns_loss_impl<LossFn>();

// step()'s loss_fn past step() itself: one type, so that the step's stages are functions of
// the policy alone (compiled once per policy, not once per caller's lambda).
using LossFnRef = c10::function_ref<at::Tensor()>;

// Whether a LibTorch message says that two dtypes met: fp32 and `low` together, in any of the
// spellings its kernels use (Float, float, float32, FloatTensor against BFloat16, bfloat16,
// CPUBFloat16Type, Half, float16, HalfTensor), or a "mixed dtype" or "same dtype" without names
// (LibTorch 1.13's "mat1 and mat2 must have the same dtype").
inline bool mixes_fp32_with(std::string_view message, c10::ScalarType low) {
  if (message.find("same dtype") != std::string_view::npos) return true;
  bool fp32 = false, other = message.find("mixed dtype") != std::string_view::npos;
  std::size_t i = 0;
  while (i < message.size()) {
    std::size_t j = i;
    while (j < message.size() && (std::isalnum(static_cast<unsigned char>(message[j])) != 0)) ++j;
    if (j == i) {
      ++i;
      continue;
    }
    std::string word(message.substr(i, j - i));
    for (auto& c : word) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    fp32 = fp32 || word == "float" || word == "float32" || word == "floattensor" ||
           word == "cpufloattype";
    if (low == c10::ScalarType::BFloat16) {
      other = other || word.find("bfloat16") != std::string::npos;
    } else {
      other = other || word == "half" || word == "float16" || word == "halftensor" ||
              word == "cpuhalftype";
    }
    i = j;
  }
  return fp32 && other;
}

// Runs the user's forward (step()'s loss_fn, evaluate()'s forward). Under a policy that casts
// the model, a LibTorch error that mixes fp32 with the low dtype is nearly always a floating
// input that did not go through cast_input(): the Error says so, LibTorch's message after it.
template <class P, class Fn>
decltype(auto) run_forward(std::string_view what, Fn&& fn) {
  if constexpr (!P::cast_model) {
    return std::invoke(std::forward<Fn>(fn));
  } else {
    try {
      return std::invoke(std::forward<Fn>(fn));
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      if (!mixes_fp32_with(message, P::low_dtype)) throw;
      const char* low = c10::toString(P::low_dtype);
      fail(what, " mixed tensors of two dtypes (fp32 and ", low, "?). ", P::name, " keeps the "
           "model's parameters in ", low, ", so its floating inputs must be ", low, " too: pass "
           "each one through trainer.cast_input(x) (integer tensors such as labels and token "
           "ids pass unchanged), and make tensors created inside the forward (torch::zeros, a "
           "float mask) in the model's dtype. LibTorch said: ", message);
    }
  }
}

// The loss that loss_fn returned, as the fp32 scalar the step scales: a bf16/fp16 loss times
// 65536 loses digits or overflows.
inline at::Tensor checked_loss(const at::Tensor& loss) {
  MIXPREC_CHECK(loss.defined(), "loss_fn returned an undefined tensor: return the loss");
  MIXPREC_CHECK(loss.numel() == 1, "loss_fn must return a scalar loss, got shape ",
                loss.sizes(), ": reduce it, e.g. with .mean()");
  MIXPREC_CHECK(at::isFloatingType(loss.scalar_type()), "loss_fn must return a floating-point "
                "loss, got ", loss.scalar_type());
  MIXPREC_CHECK(loss.requires_grad(), "the loss does not require grad: compute it from the "
                "model's output inside loss_fn, not under NoGradGuard");
  return loss.scalar_type() == at::kFloat && loss.dim() == 0 ? loss
                                                             : loss.to(at::kFloat).reshape({});
}

/// What a micro-batch's forward pass gave: the loss as the fp32 scalar the step scales, and with
/// TrainerOptions::find_non_finite_op the first op whose output held inf/NaN.
struct ForwardResult {
  at::Tensor loss;
  std::optional<NonFiniteOp> non_finite_op;
};

/// Runs `loss_fn` on `model` under P's autocast on `devices`.
template <class P, class LossFn>
ForwardResult forward_pass(torch::nn::Module& model, const std::vector<c10::DeviceType>& devices,
                           bool find_non_finite_op, LossFn& loss_fn) {
  ForwardResult result;
  at::Tensor loss;
  {
    std::optional<NonFiniteOpFinder> finder;
    if (find_non_finite_op) finder.emplace();
    const PolicyAutocast<P> guard(devices);
    OwnOutputWatch watch(model);
    loss = run_forward<P>("step()'s loss_fn", [&] { return watch.run(loss_fn); });
    if (finder) result.non_finite_op = finder->first();
  }
  result.loss = checked_loss(loss);
  return result;
}

/// Runs `forward` for evaluate(): every module in eval mode (each one's own mode restored after),
/// without grad, under P's autocast on `devices`, LibTorch's dtype errors explained.
template <class P, class Forward>
decltype(auto) evaluation_pass(torch::nn::Module& model,
                               const std::vector<c10::DeviceType>& devices, Forward& forward) {
  at::NoGradGuard no_grad;
  TrainingModeGuard mode(model, /*training=*/false);
  const PolicyAutocast<P> guard(devices);
  OwnOutputWatch watch(model);
  return run_forward<P>("evaluate()'s forward",
                        [&]() -> decltype(auto) { return watch.run(forward); });
}

/// After loss_fn: with every gradient cleared or held aside before it ran, a model tensor with a
/// gradient now means that loss_fn ran a backward pass itself, which the Trainer's own (scaled)
/// one would add to, or fail on ("backward through the graph a second time").
template <class Tensors>
void check_no_backward_in(const torch::nn::Module& model, Tensors& tensors,
                          std::string_view policy) {
  const auto name = tensors.first_with_grad(model);
  if (name.empty()) return;
  tensors.clear_model_grads();  // the partial sums of earlier micro-batches stay held
  fail("loss_fn ran a backward pass itself (parameter '", name, "' has a gradient after it): "
       "return the loss and let the Trainer run backward(), which scales it for ", policy,
       ", accumulates and steps. Nothing was stepped");
}

}  // namespace mixprec::detail
