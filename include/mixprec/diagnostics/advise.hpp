#pragma once
/// mixprec::advise: a few fp32 steps of the user's own loss function, watched op by op, and what
/// they say about each precision: which layers fp16 and bf16 can hold, the loss scales at which
/// fp16 keeps the gradients, which layers to keep in fp32, and the policy to start with.
///
///   auto advice = mixprec::advise(model, [&] { return loss_of(model, next_batch()); });
///   std::cout << advice;                           // the table, the verdicts, the reasons
///   advice.require<mixprec::MixedO2<at::Half>>();  // an Error naming the layers fp16 breaks
///
/// advise() changes nothing: parameters, gradients, buffers (BatchNorm's running statistics)
/// and the RNG states are as they were. The model must still be fp32 (call it before a Trainer
/// casts the model). Layers are the modules whose parameters an op reads (at::linear reading
/// fc.weight is layer "fc"); an op that reads none is named by the user's NamedScope around it,
/// or else by itself ("aten::softmax"). docs/diagnostics.md explains the thresholds.
///
/// This header holds advise() itself: its checks of the model and options, the fp32 steps that
/// advise_recorder.hpp watches, and the guard that puts the model's state back; the verdicts are
/// advise_verdicts.hpp's, the result types advice.hpp's.

#include <mixprec/core/autocast.hpp>
#include <mixprec/core/capabilities.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/policy.hpp>
#include <mixprec/core/rng_states.hpp>
#include <mixprec/diagnostics/advice.hpp>
#include <mixprec/diagnostics/advise_recorder.hpp>
#include <mixprec/diagnostics/advise_verdicts.hpp>
#include <mixprec/fp8/linear.hpp>
#include <mixprec/nn/conv.hpp>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec {

namespace detail {

// Restores the model's parameters' gradients, its buffers and the RNG states on exit.
class AdviseStateGuard {
 public:
  explicit AdviseStateGuard(torch::nn::Module& model) {
    for (auto& p : model.parameters()) {
      grads_.emplace_back(p, p.grad().defined() ? p.grad().detach().clone() : at::Tensor());
    }
    for (auto& b : model.buffers()) buffers_.emplace_back(b, b.detach().clone());
  }
  ~AdviseStateGuard() {
    at::NoGradGuard no_grad;
    for (auto& [p, grad] : grads_) p.mutable_grad() = grad;
    for (auto& [b, value] : buffers_) b.copy_(value);
    rngs_.restore();
  }
  AdviseStateGuard(const AdviseStateGuard&) = delete;
  AdviseStateGuard& operator=(const AdviseStateGuard&) = delete;

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> grads_, buffers_;
  RngStates rngs_ = RngStates::capture();
};

}  // namespace detail

/// Runs `loss_fn` (the forward pass, returning the scalar loss, as for Trainer::step)
/// options.steps() times in fp32, backpropagates each loss, and judges each precision from
/// what the layers' activations and gradients reached. Changes nothing of the model.
template <class LossFn>
Advice advise(torch::nn::Module& model, LossFn&& loss_fn, const AdviseOptions& options = {}) {
  MIXPREC_CHECK(options.steps() >= 1, "AdviseOptions::steps must be >= 1, got ", options.steps());
  MIXPREC_CHECK(options.headroom() >= 1 && std::isfinite(options.headroom()),
                "AdviseOptions::headroom must be finite and >= 1, got ", options.headroom());
  MIXPREC_CHECK(options.underflow_tolerance() >= 0 && options.underflow_tolerance() < 1,
                "AdviseOptions::underflow_tolerance must be in [0, 1), got ",
                options.underflow_tolerance());
  MIXPREC_CHECK(options.fp8_underflow_tolerance() >= 0 && options.fp8_underflow_tolerance() < 1,
                "AdviseOptions::fp8_underflow_tolerance must be in [0, 1), got ",
                options.fp8_underflow_tolerance());
  const auto named = model.named_parameters();
  MIXPREC_CHECK(named.size() > 0, "advise(): the model has no parameters");
  // Each tensor's layer: the module path of its first name.
  std::unordered_map<const void*, std::string> layer_of;
  std::vector<std::pair<std::string, at::Tensor>> params;  // each tensor once
  for (const auto& item : named) {
    const auto dtype = item.value().scalar_type();
    MIXPREC_CHECK(!at::isFloatingType(dtype) || dtype == at::kFloat, "advise(): parameter '",
                  item.key(), "' is ", dtype, "; advise() measures the fp32 model: call it before "
                  "a Trainer casts the model, on a model built in fp32");
    const auto layer = detail::module_path(item.key());
    if (layer_of.try_emplace(item.value().unsafeGetTensorImpl(), layer).second) {
      params.emplace_back(layer, item.value());
    }
  }
  const auto device = params.front().second.device().type();

  std::unordered_map<std::string, detail::GradientRecord> gradients;
  std::vector<std::pair<std::string, detail::LayerRecorder::Activations>> activations;
  const auto fp8_watch = std::make_shared<detail::Fp8Watch>();
  {
    struct WatchFp8 {  // the Float8Linear layers report their operands while it is set
      explicit WatchFp8(std::shared_ptr<detail::Fp8Watch> watch) {
        detail::Fp8Watch::current() = std::move(watch);
      }
      ~WatchFp8() { detail::Fp8Watch::current().reset(); }
      WatchFp8(const WatchFp8&) = delete;
      WatchFp8& operator=(const WatchFp8&) = delete;
    } watching(fp8_watch);
    detail::AdviseStateGuard restore(model);
    std::vector<at::Tensor> tensors;
    for (const auto& [layer, p] : params) tensors.push_back(p);
    detail::LayerRecorder recorder(layer_of, tensors);
    for (std::int64_t step = 0; step < options.steps(); ++step) {
      for (auto& [layer, p] : params) {
        if (p.grad().defined()) p.mutable_grad() = at::Tensor();
      }
      at::Tensor loss;
      {
        auto guard = autocast<FullPrecision>(device);
        loss = std::invoke(loss_fn);
      }
      MIXPREC_CHECK(loss.defined() && loss.numel() == 1 && loss.requires_grad(),
                    "advise(): loss_fn must return a scalar loss computed from the model (got ",
                    loss.defined() ? loss.sizes() : at::IntArrayRef{}, ")");
      {
        // The backward pass is not watched: only the parameters' gradients are read.
        at::RecordFunctionGuard off(false);
        loss.backward();
      }
      at::RecordFunctionGuard off(false);  // the reads of the gradients are not the model's
      for (auto& [layer, p] : params) {
        if (p.grad().defined()) gradients[layer].add(p.grad());
      }
    }
    activations = std::move(recorder.layers);
  }

  Advice advice;
  advice.steps = options.steps();
  advice.device = device;
  advice.layers = detail::recorded_layers(activations, gradients, params);
  detail::judge_layers(advice.layers, gradients, options);
  advice.fp8_layers = detail::judge_fp8_layers(model, *fp8_watch, options);
  if (advice.device == c10::DeviceType::CPU && cpu_capabilities().fp16_conv_weight_grad_slow) {
    advice.slow_fp16_convolutions = nn::detail::fp16_weight_grad_convolutions(model);
  }
  advice.slow_bf16 = advice.device == c10::DeviceType::CPU && cpu_capabilities().bf16_slow;
  detail::decide(advice);
  detail::explain_slow_bf16(advice);
  detail::explain_slow_fp16_convolutions(advice);
  return advice;
}

/// advise() for a model held by shared_ptr.
template <class LossFn>
Advice advise(const std::shared_ptr<torch::nn::Module>& model, LossFn&& loss_fn,
              const AdviseOptions& options = {}) {
  MIXPREC_CHECK(model != nullptr, "advise() got a null model");
  return advise(*model, std::forward<LossFn>(loss_fn), options);
}

/// advise() for a ModuleHolder such as torch::nn::Sequential.
template <class Impl, class LossFn>
Advice advise(torch::nn::ModuleHolder<Impl>& model, LossFn&& loss_fn,
              const AdviseOptions& options = {}) {
  return advise(*model.ptr(), std::forward<LossFn>(loss_fn), options);
}

}  // namespace mixprec
