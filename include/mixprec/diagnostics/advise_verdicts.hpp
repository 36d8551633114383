#pragma once
// What advise() concludes from what its fp32 steps recorded (advise_recorder.hpp): per layer,
// whether fp16 and bf16 hold it and why not; per Float8Linear, whether fp8 does; for the model,
// the loss scales fp16 offers, the policy to start with and the reasons (decide).

#include <mixprec/core/capabilities.hpp>
#include <mixprec/core/policy.hpp>
#include <mixprec/diagnostics/advice.hpp>
#include <mixprec/diagnostics/advise_recorder.hpp>
#include <mixprec/fp8/linear.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec::detail {

constexpr double kBFloat16Max = 3.3895313892515355e38;

/// The layers in the order the forward pass first used them, with what their outputs reached;
/// after them those whose parameters had gradients but that no op was seen to read. Not judged.
inline std::vector<LayerAdvice> recorded_layers(
    const std::vector<std::pair<std::string, LayerRecorder::Activations>>& activations,
    const std::unordered_map<std::string, GradientRecord>& gradients,
    const std::vector<std::pair<std::string, at::Tensor>>& params) {
  std::vector<LayerAdvice> layers;
  auto layer_slot = [&](const std::string& name) -> LayerAdvice& {
    for (auto& l : layers) {
      if (l.name == name) return l;
    }
    layers.push_back(LayerAdvice{});
    layers.back().name = name;
    return layers.back();
  };
  for (const auto& [name, a] : activations) {
    auto& layer = layer_slot(name);
    layer.activations = a.elements;
    layer.activation_max = a.max;
    layer.activation_tiny = a.nonzero == 0 ? 0.0 : static_cast<double>(a.tiny) / static_cast<double>(a.nonzero);
    layer.non_finite = a.non_finite;
  }
  for (const auto& [name, p] : params) {  // layers whose parameters no op read keep their place
    (void)p;
    if (gradients.count(name)) (void)layer_slot(name);
  }
  for (auto& layer : layers) {
    layer.module = std::any_of(params.begin(), params.end(),
                               [&](const auto& param) { return param.first == layer.name; });
  }
  return layers;
}

/// Whether fp16 and bf16 hold each layer, and why not: its outputs against their ranges (fp16's
/// divided by the headroom) and fp16's subnormals, its gradients against fp16's loss scales.
inline void judge_layers(std::vector<LayerAdvice>& layers,
                         const std::unordered_map<std::string, GradientRecord>& gradients,
                         const AdviseOptions& options) {
  const double fp16_limit = kHalfMax / options.headroom();
  for (auto& layer : layers) {
    auto& l = layer;
    if (l.non_finite) {
      l.fp16 = l.bf16 = false;
      l.fp16_reason = l.bf16_reason = "inf/NaN already in fp32";
      continue;
    }
    if (l.activation_max >= kBFloat16Max) {
      l.bf16 = false;
      l.bf16_reason = "|x| reaches " + short_number(l.activation_max) + ", beyond bf16's 3.4e38";
    }
    if (l.activation_max > fp16_limit) {
      l.fp16 = l.fp16_outputs = false;
      l.fp16_reason = "|x| reaches " + short_number(l.activation_max) + ", beyond fp16's " +
                      "65504" + (options.headroom() > 1 ? " / headroom " + short_number(options.headroom()) : "");
    } else if (l.activation_tiny > options.underflow_tolerance()) {
      l.fp16 = l.fp16_outputs = false;
      l.fp16_reason = short_number(100 * l.activation_tiny) +
                      "% of its nonzero outputs are below fp16's 2^-24 and would be 0";
    }
    const auto it = gradients.find(l.name);
    if (it == gradients.end()) continue;
    const auto& g = it->second;
    l.gradients = g.elements;
    l.gradient_max = g.max;
    l.gradient_min = std::isfinite(g.min) ? g.min : 0.0;
    if (g.non_finite) {
      l.non_finite = true;
      l.fp16 = l.bf16 = false;
      l.fp16_reason = l.bf16_reason = "inf/NaN gradients already in fp32";
      continue;
    }
    l.scale_log2_min = g.scale_log2_min(options.underflow_tolerance());
    l.scale_log2_max = g.scale_log2_max(options.headroom());
    if (l.fp16 && l.scale_log2_min && l.scale_log2_max && *l.scale_log2_min > *l.scale_log2_max) {
      l.fp16 = false;
      l.fp16_reason = "no loss scale fits its gradients: from " + short_number(l.gradient_min) +
                      " to " + short_number(l.gradient_max) + " is more than fp16 spans";
    }
  }
}

/// The block-scaled recipes' verdicts on one layer: features the block tiles, and (MXFP8,
/// blockwise) no operand losing more than `tolerance` of its nonzero elements to 0 in its cast
/// along the last dimension. NVFP4, whose 4-bit values round a block's elements below a 24th
/// of its largest to 0 by design, is judged on its shapes here and on its depth by the caller.
inline void judge_block_recipes(Fp8LayerAdvice& layer, const Fp8Watch::Operands& operands,
                                const torch::nn::Module* module, double tolerance) {
  const auto* linear = dynamic_cast<const nn::Float8LinearImpl*>(module);
  const std::int64_t in = linear != nullptr ? linear->options.in_features() : 0;
  const std::int64_t out = linear != nullptr ? linear->options.out_features() : 0;
  const auto check = [&](bool& holds, std::string& reason, std::int64_t block, const char* format,
                         std::int64_t Fp8Watch::Operand::*flushed, double Fp8OperandAdvice::*share) {
    if (in % block != 0 || out % block != 0) {
      holds = false;
      reason = "its features (" + std::to_string(in) + " -> " + std::to_string(out) +
               ") are no multiples of " + format + "'s block of " + std::to_string(block);
      return;
    }
    const char* what[] = {"inputs", "weights", "output gradients"};
    Fp8OperandAdvice* advice[] = {&layer.input, &layer.weight, &layer.grad_output};
    for (int r = 0; r < 3; ++r) {
      const auto& o = operands[r];
      const double fraction = o.*flushed < 0 ? 0.0
                              : static_cast<double>(o.*flushed) /
                                    static_cast<double>(std::max<std::int64_t>(o.nonzero, 1));
      advice[r]->*share = fraction;
      if (!holds || share == &Fp8OperandAdvice::flushed_nvfp4 || fraction <= tolerance) continue;
      holds = false;
      reason = short_number(100 * fraction) + "% of its nonzero " + what[r] + " would round to 0 " +
               "in " + format + " (one scale per block of " + std::to_string(block) + ")";
    }
  };
  check(layer.mxfp8, layer.mxfp8_reason, 32, "MXFP8", &Fp8Watch::Operand::flushed_mxfp8,
        &Fp8OperandAdvice::flushed_mxfp8);
  check(layer.blockwise, layer.blockwise_reason, 128, "blockwise fp8",
        &Fp8Watch::Operand::flushed_blockwise, &Fp8OperandAdvice::flushed_blockwise);
  check(layer.nvfp4, layer.nvfp4_reason, 16, "NVFP4", &Fp8Watch::Operand::flushed_nvfp4,
        &Fp8OperandAdvice::flushed_nvfp4);
}

/// Whether fp8 holds each of the model's Float8Linear layers that `watch` saw, per recipe, in
/// named_modules() order. A recipe fails a layer where one of the casts it makes of an operand
/// would round more than fp8_underflow_tolerance of its nonzero elements to 0.
inline std::vector<Fp8LayerAdvice> judge_fp8_layers(const torch::nn::Module& model,
                                                    const Fp8Watch& watch,
                                                    const AdviseOptions& options) {
  std::vector<Fp8LayerAdvice> result;
  const double tolerance = options.fp8_underflow_tolerance();
  // The first failing cast of a recipe gives its reason.
  const auto judge = [tolerance](bool& holds, std::string& reason, double flushed,
                                 const char* what, const std::string& how) {
    if (!holds || flushed <= tolerance) return;
    holds = false;
    reason = short_number(100 * flushed) + "% of its nonzero " + what + " would round to 0 in " +
             how;
  };
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const auto* operands = watch.find(item.value().get());
    if (operands == nullptr) continue;
    Fp8LayerAdvice layer;
    layer.name = item.key().empty() ? "(model)" : item.key();
    const auto fill = [&](Fp8OperandAdvice& out, Fp8Role role, const char* what, const char* format) {
      const auto& o = (*operands)[static_cast<int>(role)];
      out.amax = o.amax;
      const auto nonzero = static_cast<double>(std::max<std::int64_t>(o.nonzero, 1));
      out.flushed = static_cast<double>(o.flushed) / nonzero;
      out.subnormal = static_cast<double>(o.subnormal) / nonzero;
      out.flushed_rows = static_cast<double>(o.flushed_rows) / nonzero;
      out.flushed_columns = static_cast<double>(o.flushed_columns) / nonzero;
      out.flushed_power_of_2 = static_cast<double>(o.flushed_power_of_2) / nonzero;
      judge(layer.fp8, layer.reason, out.flushed, what, std::string(format) + " (their largest, " +
            short_number(o.amax) + ", sets the scale)");
      const std::string rows = "e4m3 with one scale per row", columns = "e4m3 with one scale per column";
      judge(layer.rowwise, layer.rowwise_reason, out.flushed_rows, what, rows);
      judge(layer.rowwise, layer.rowwise_reason, out.flushed_columns, what, columns);
      // RowwiseScalingWithGwHp casts each operand per row, and the weight once more as a whole.
      judge(layer.rowwise_with_gw_hp, layer.rowwise_with_gw_hp_reason, out.flushed_rows, what, rows);
      if (role == Fp8Role::weight) {
        judge(layer.rowwise_with_gw_hp, layer.rowwise_with_gw_hp_reason, out.flushed_power_of_2,
              what, "e4m3 with one power-of-2 scale for the whole weight (their largest, " +
              short_number(o.amax) + ", sets it)");
      }
    };
    fill(layer.input, Fp8Role::input, "inputs", "e4m3");
    fill(layer.weight, Fp8Role::weight, "weights", "e4m3");
    fill(layer.grad_output, Fp8Role::grad_output, "output gradients", "e5m2");
    judge_block_recipes(layer, *operands, item.value().get(), tolerance);
    result.push_back(std::move(layer));
  }
  // NVFP4 keeps the last layers in bf16 (NVIDIA's recipe: about 15% of them).
  const auto share = options.nvfp4_bf16_share();
  const auto kept = static_cast<std::size_t>(std::ceil(share * static_cast<double>(result.size())));
  for (std::size_t i = result.size() - std::min(kept, result.size()); i < result.size(); ++i) {
    if (!result[i].nvfp4) continue;
    result[i].nvfp4 = false;
    result[i].nvfp4_reason = "NVIDIA's NVFP4 recipe keeps the last " + short_number(100 * share) +
                             "% of the linear layers in bf16, where 4-bit weight gradients err "
                             "most (AdviseOptions::nvfp4_bf16_share)";
  }
  return result;
}

inline void decide(Advice& advice) {
  // One scale for all layers: the largest of their minima, the smallest of their maxima.
  std::optional<int> lo, hi;
  for (const auto& layer : advice.layers) {
    if (layer.scale_log2_min) lo = std::max(lo.value_or(*layer.scale_log2_min), *layer.scale_log2_min);
    if (layer.scale_log2_max) hi = std::min(hi.value_or(*layer.scale_log2_max), *layer.scale_log2_max);
  }
  // fp32's scale must stay a normal number; GradScaler's default starts at 2^16.
  const int low = std::max(lo.value_or(-20), -100);
  const int high = std::min(hi.value_or(40), 100);
  if (low <= high) {
    advice.init_scale_min = std::ldexp(1.0, low);
    advice.init_scale_max = std::ldexp(1.0, high);
    advice.init_scale = std::clamp(65536.0, advice.init_scale_min, advice.init_scale_max);
  }
  for (const auto& layer : advice.layers) {
    advice.fp32_finite = advice.fp32_finite && !layer.non_finite;
    advice.fp16_safe = advice.fp16_safe && layer.fp16;
    advice.bf16_safe = advice.bf16_safe && layer.bf16;
  }
  advice.fp16_safe = advice.fp16_safe && advice.fp32_finite && low <= high;
  advice.bf16_safe = advice.bf16_safe && advice.fp32_finite;
  const auto keep16 = advice.keep_fp32(c10::ScalarType::Half);
  auto list = [](const std::vector<std::string>& names) {
    std::string text;
    for (std::size_t i = 0; i < names.size(); ++i) text += (i ? ", " : "") + names[i];
    return text;
  };
  auto& why = advice.reasons;
  if (!advice.fp32_finite) {
    advice.recommended = std::string(FullPrecision::name);
    std::vector<std::string> bad;
    for (const auto& layer : advice.layers) {
      if (layer.non_finite) bad.push_back(layer.name);
    }
    why.push_back("the fp32 run itself produced inf/NaN (in " + list(bad) +
                  "): no lower precision can help; fix the model, its initialisation or the data");
    return;
  }
  if (!advice.bf16_safe) {
    advice.recommended = std::string(FullPrecision::name);
    why.push_back("activations beyond bf16's range (3.4e38) in " +
                  list(advice.keep_fp32(c10::ScalarType::BFloat16)) +
                  ": only fp32 holds them (or MixedO1<BFloat16> with those layers outside "
                  "autocast)");
    return;
  }
  const bool half_is_fast = advice.device == c10::DeviceType::CUDA;
  if (advice.fp16_safe && half_is_fast) {
    advice.recommended = std::string(MixedO2<at::Half>::name);
    why.push_back("every layer's activations and gradients fit fp16, with a loss scale from " +
                  power_of_two(low) + " to " + power_of_two(high) + " (init_scale " +
                  short_number(advice.init_scale) + "); fp16 keeps 3 more mantissa bits than bf16");
    why.push_back("MixedO2<BFloat16> needs no loss scaling, if the GPU has bf16 (Ampere or later)");
    return;
  }
  advice.recommended = std::string(MixedO2<at::BFloat16>::name);
  if (advice.fp16_safe) {
    why.push_back(std::string(advice.slow_bf16
                                  ? "bf16 holds every layer and needs no loss scaling "
                                  : "bf16 holds every layer; on the CPU bf16 is computed natively "
                                    "and fp16 is not ") +
                  "(fp16 would also fit, with a loss scale from " + power_of_two(low) + " to " +
                  power_of_two(high) + ")");
    return;
  }
  if (!keep16.empty()) {
    why.push_back("fp16 cannot hold " + list(keep16) + "; bf16 has fp32's range and needs no "
                  "loss scaling");
  } else {
    why.push_back("no single loss scale keeps every layer's gradients within fp16 (from " +
                  power_of_two(lo.value_or(0)) + " up, to at most " + power_of_two(hi.value_or(0)) +
                  "); bf16 has fp32's range and needs no loss scaling");
  }
  why.push_back("to use fp16 anyway: MixedO1<Half> with " +
                (keep16.empty() ? std::string("a loss scale per layer group") : list(keep16)) +
                " outside autocast (mixprec::AutocastGuard(device, at::kHalf, false))");
}

/// After decide's reasons: on a CPU where bf16 computes slower than fp32 (advice.slow_bf16), what
/// a recommendation that computes in bf16 costs there, and what is faster.
inline void explain_slow_bf16(Advice& advice) {
  if (!advice.slow_bf16) return;
  const bool computes_bf16 = advice.recommended.find("BFloat16") != std::string::npos ||
                             advice.recommended.find("MixedFP8") != std::string::npos;
  if (!computes_bf16) return;
  advice.reasons.push_back("bf16 is slower than fp32 on this CPU: " +
                           slow_bf16_reason(cpu_capabilities()) + "; " + advice.recommended +
                           " still halves the memory of what it stores in bf16, but for speed "
                           "here train in FullPrecision");
}

/// The last reason, after decide's: on a CPU whose fp16 convolution weight gradients are oneDNN's
/// reference loop, what that costs advice.slow_fp16_convolutions and the remedy.
inline void explain_slow_fp16_convolutions(Advice& advice) {
  if (advice.slow_fp16_convolutions.empty()) return;
  const auto& cpu = cpu_capabilities();
  std::string names;
  for (const auto& name : advice.slow_fp16_convolutions) names += (names.empty() ? "" : ", ") + name;
  advice.reasons.push_back(
      "fp16 on this CPU (" + cpu.model + ": AVX512-FP16 without AMX-FP16): LibTorch computes "
      "the weight gradients of fp16 convolutions (" + names + ") with oneDNN's reference loop, " +
      fp16_conv_cost(cpu) + "; under a Half "
      "policy declare them mixprec::nn::Conv2d and call mixprec::nn::fp32_conv_weight_grads");
}

}  // namespace mixprec::detail
