#pragma once
/// LoRA: low-rank adapters on a frozen base (Hu et al., 2021; PEFT's LoraConfig). apply_lora
/// gives each linear layer that module-path patterns name two small trainable matrices, A
/// [rank, in] and B [out, rank], so that the layer computes
///
///   y = W x + b + (alpha / rank) B A dropout(x)
///
/// and freezes every other parameter of the model. A starts Kaiming-uniform (a = sqrt(5)), B at
/// zero, as PEFT draws them: the same seed gives PEFT's adapters bit for bit. The state_dict
/// keeps the base's keys and adds PEFT's ("encoder.layer.0.attention.self.query.lora_A.weight").
///
///   mixprec::apply_lora(model, {"bert.encoder.layer.*.attention.self.query",
///                               "bert.encoder.layer.*.attention.self.value"},
///                       mixprec::LoraOptions().rank(8).alpha(16).base(mixprec::LoraBase::fp8_rowwise)
///                           .trainable({"head"}));
///   torch::optim::AdamW optimizer(mixprec::trainable_parameters(*model), 1e-3);
///   mixprec::Trainer<mixprec::MixedO2<at::BFloat16>> trainer(model, optimizer);
///
/// The base needs no gradient, master or optimizer state; it may be stored in bf16, fp16 or
/// fp8 (LoraBase). The layers must be declared as mixprec::nn::Linear (LibTorch modules have no
/// forward hooks; torch::nn::Linear's forward cannot be changed).

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/model_claim.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/lora/lora_linear.hpp>
#include <mixprec/nn/linear.hpp>
#include <mixprec/nn/module_patterns.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mixprec {

/// One layer with a LoRA adapter: its path, and the adapter.
struct LoraLayer {
  std::string path;
  nn::LinearImpl* module;
  detail::LoraAdapter* adapter;
};

/// The layers of `model` that carry a LoRA adapter, in named_modules() order.
inline std::vector<LoraLayer> lora_layers(const torch::nn::Module& model) {
  std::vector<LoraLayer> layers;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* linear = dynamic_cast<nn::LinearImpl*>(item.value().get());
    if (linear == nullptr) continue;
    if (auto* adapter = dynamic_cast<detail::LoraAdapter*>(linear->adapter.get())) {
      layers.push_back({item.key(), linear, adapter});
    }
  }
  return layers;
}

/// The parameters a LoRA model trains: the adapters' and those of the modules that
/// LoraOptions::trainable left trainable (whatever requires a gradient), each once. What to
/// build the optimizer on.
inline std::vector<at::Tensor> trainable_parameters(const torch::nn::Module& model) {
  std::vector<at::Tensor> trained;
  for (const auto& p : model.parameters()) {
    if (p.requires_grad()) trained.push_back(p);
  }
  return detail::unique_tensors(trained);
}

namespace detail {

// Python's kaiming_uniform_(w, a=sqrt(5)) bound for fan_in, in its double arithmetic.
inline double kaiming_bound(std::int64_t fan_in) {
  const double a = std::sqrt(5.0);
  const double gain = std::sqrt(2.0 / (1 + std::pow(a, 2)));
  return std::sqrt(3.0) * (gain / std::sqrt(static_cast<double>(fan_in)));
}

/// A and B for a layer of `in` -> `out` features, drawn from `generator` as PEFT draws them:
/// nn.Linear(in, r) and nn.Linear(r, out) each initialise their weight on construction, then
/// PEFT draws A again (kaiming_uniform_, a = sqrt(5)) and zeroes B.
inline std::pair<at::Tensor, at::Tensor> lora_init(std::int64_t in, std::int64_t out,
                                                   std::int64_t rank, at::Generator generator) {
  at::NoGradGuard no_grad;
  auto a = at::empty({rank, in});
  auto b = at::empty({out, rank});
  a.uniform_(-kaiming_bound(in), kaiming_bound(in), generator);
  b.uniform_(-kaiming_bound(rank), kaiming_bound(rank), generator);
  a.uniform_(-kaiming_bound(in), kaiming_bound(in), generator);
  b.zero_();
  return {a, b};
}

inline std::string lora_layer_name(const std::string& path, const nn::LinearImpl& linear) {
  return "layer '" + path + "' (" + std::to_string(linear.weight.size(1)) + " -> " +
         std::to_string(linear.weight.size(0)) + " features)";
}

}  // namespace detail

/// Gives every mixprec::nn::Linear of `model` that `patterns` name a LoRA adapter (see the top
/// of this header) and freezes every parameter but the adapters' and LoraOptions::trainable's.
/// Returns the adapted layers' paths. Errors, before anything changes: a pattern that matches
/// no module (naming the closest) or is shadowed, a named module that is not a
/// mixprec::nn::Linear or has an adapter already, a rank below 1 or above a layer's
/// min(in, out), alpha 0, a dropout outside [0, 1), an fp8 base where LibTorch has no fp8, a
/// model a Trainer trains already.
inline std::vector<std::string> apply_lora(const std::shared_ptr<torch::nn::Module>& model,
                                           const std::vector<std::string>& patterns,
                                           const LoraOptions& options = {}) {
  MIXPREC_CHECK(model != nullptr, "apply_lora got a null model");
  MIXPREC_CHECK(!patterns.empty(), "apply_lora got no patterns: name the linear layers to "
                "adapt, e.g. {\"encoder.layer.*.attention.self.query\"}");
  MIXPREC_CHECK(options.alpha() != 0 && std::isfinite(options.alpha()), "apply_lora: alpha ",
                options.alpha(), " scales the adapters' output by alpha / rank = 0 or a "
                "non-number, so they would never change the model: PEFT's default is alpha 8 "
                "(alpha = rank, or twice it, are common); nothing was changed");
  MIXPREC_CHECK(options.rank() >= 1, "apply_lora: rank ", options.rank(), " leaves no adapter: "
                "choose a rank of 1 or more (PEFT's default is 8); nothing was changed");
  MIXPREC_CHECK(options.dropout() >= 0 && options.dropout() < 1, "apply_lora: dropout ",
                options.dropout(), " is not a probability in [0, 1); nothing was changed");
  const bool fp8 = detail::lora_base_fp8(options.base());
  MIXPREC_CHECK(!fp8 || has_fp8, "apply_lora: LoraBase::", detail::lora_base_name(options.base()),
                " stores the base in fp8, which needs LibTorch >= 2.5 (this is ", torch_version,
                "): store it in bf16; nothing was changed");
  MIXPREC_CHECK(!detail::ModelClaim::any_claimed(detail::unique_tensors(model->parameters())),
                "apply_lora: a Trainer trains this model already (and has bound its optimizer "
                "to the parameters it had): apply the adapters before constructing the Trainer; "
                "nothing was changed");
  const auto named = model->named_modules("", /*include_self=*/false);
  std::vector<std::string> paths;
  for (const auto& item : named) paths.push_back(item.key());
  const auto decided = detail::decide_paths(patterns, paths, [&](std::size_t i) {
    return "LoRA pattern '" + patterns[i] + "'";
  });
  const auto kept = options.trainable().empty()
                        ? std::vector<std::optional<std::size_t>>(paths.size())
                        : detail::decide_paths(options.trainable(), paths, [&](std::size_t i) {
                            return "LoraOptions::trainable pattern '" + options.trainable()[i] + "'";
                          });
  std::vector<std::pair<std::string, nn::LinearImpl*>> targets;
  for (std::size_t i = 0; i < named.size(); ++i) {
    if (!decided[i]) continue;
    auto* linear = dynamic_cast<nn::LinearImpl*>(named[i].value().get());
    const bool plain = dynamic_cast<const torch::nn::LinearImpl*>(named[i].value().get()) != nullptr;
    MIXPREC_CHECK(linear != nullptr, "LoRA pattern '", patterns[*decided[i]], "' names module '",
                  paths[i], "' (", named[i].value()->name(), "), ",
                  plain ? "a torch::nn::Linear, whose forward mixprec cannot change (LibTorch "
                          "modules have no forward hooks): declare it as mixprec::nn::Linear "
                          "(the same parameters, state_dict keys and init)"
                        : "which is not a linear layer: LoRA adapts mixprec::nn::Linear layers; "
                          "narrow the pattern (`*` stops at dots)",
                  "; nothing was changed");
    MIXPREC_CHECK(!linear->adapter, "apply_lora: ", detail::lora_layer_name(paths[i], *linear),
                  " has a LoRA adapter already (adapters applied twice): put every pattern in "
                  "one apply_lora call on a fresh model; nothing was changed");
    const auto limit = std::min(linear->weight.size(0), linear->weight.size(1));
    MIXPREC_CHECK(options.rank() <= limit, "apply_lora: rank ", options.rank(), " is larger than ",
                  detail::lora_layer_name(paths[i], *linear), " allows: B A of rank ",
                  options.rank(), " has no more than min(in, out) = ", limit, " independent "
                  "directions, and costs more than training the layer. Choose rank <= ", limit,
                  ", or leave this layer out of the patterns; nothing was changed");
    MIXPREC_CHECK(at::isFloatingType(linear->weight.scalar_type()), "apply_lora: ",
                  detail::lora_layer_name(paths[i], *linear), " has a ",
                  linear->weight.scalar_type(), " weight, not a floating-point one");
    MIXPREC_CHECK(!kept[i], "apply_lora: ", detail::lora_layer_name(paths[i], *linear), " is "
                  "both adapted and left trainable by LoraOptions::trainable pattern '",
                  options.trainable()[*kept[i]], "': train it whole or adapt it, not both; "
                  "nothing was changed");
    targets.emplace_back(paths[i], linear);
  }

  // All checks passed.
  at::NoGradGuard no_grad;
  // A generator object either way (LibTorch 1.13 takes c10::optional, not std::optional).
  const auto generator = options.seed() ? at::detail::createCPUGenerator(*options.seed())
                                        : at::detail::getDefaultCPUGenerator();
  // PEFT freezes every parameter but the adapters' and those of modules_to_save.
  for (auto& p : model->parameters()) p.requires_grad_(false);
  for (std::size_t i = 0; i < named.size(); ++i) {
    if (!kept[i]) continue;
    for (auto& p : named[i].value()->parameters()) p.requires_grad_(true);
  }
  const double scaling = options.use_rslora()
                             ? options.alpha() / std::sqrt(static_cast<double>(options.rank()))
                             : options.alpha() / static_cast<double>(options.rank());
  std::vector<std::string> adapted;
  for (auto& [path, linear] : targets) {
    const auto out = linear->weight.size(0), in = linear->weight.size(1);
    const auto [a, b] = detail::lora_init(in, out, options.rank(), generator);
    // The adapters in fp32 beside any base (PEFT's autocast_adapter_dtype), on its device.
    const auto device = linear->weight.device();
    auto lora_a = std::make_shared<detail::LoraMatrix>(a.to(device));
    auto lora_b = std::make_shared<detail::LoraMatrix>(b.to(device));
    linear->register_module("lora_A", lora_a);
    linear->register_module("lora_B", lora_b);
    at::Tensor scale;
    auto& weight = linear->weight;
    auto& bias = linear->bias;
    switch (options.base()) {
      case LoraBase::as_is: break;
      case LoraBase::bf16:
      case LoraBase::fp16: {
        const auto dtype = options.base() == LoraBase::bf16 ? at::kBFloat16 : at::kHalf;
        weight.set_data(weight.data().to(dtype));
        if (bias.defined()) bias.set_data(bias.data().to(dtype));
        break;
      }
      case LoraBase::fp8_rowwise:
      case LoraBase::fp8_tensorwise: {
        auto [q, s] = detail::quantize_e4m3(weight, options.base() == LoraBase::fp8_rowwise);
        weight.set_data(q);
        if (bias.defined()) bias.set_data(bias.data().to(at::kBFloat16));
        scale = linear->register_buffer("weight_scale", s);
        break;
      }
    }
    weight.mutable_grad() = at::Tensor();
    linear->adapter = std::make_shared<detail::LoraAdapter>(
        *linear, lora_a, lora_b, scaling, options.dropout(), options.base(), weight, bias, scale);
    adapted.push_back(path);
  }
  return adapted;
}

/// For a ModuleHolder such as torch::nn::Sequential.
template <class Impl>
std::vector<std::string> apply_lora(torch::nn::ModuleHolder<Impl>& model,
                                    const std::vector<std::string>& patterns,
                                    const LoraOptions& options = {}) {
  return apply_lora(std::static_pointer_cast<torch::nn::Module>(model.ptr()), patterns, options);
}

/// Folds each adapter into its base weight, W += (alpha / rank) B A (computed in fp32, rounded
/// once to W's dtype), and stops computing it: the model computes as a plain one (the adapters
/// stay, for unmerge_lora). Errors, before anything changes: a base stored in fp8 (its scales
/// were fitted to the pretrained weight; write the merged weights out with
/// save_merged_safetensors instead), an adapter merged already.
inline void merge_lora(torch::nn::Module& model) {
  const auto layers = lora_layers(model);
  MIXPREC_CHECK(!layers.empty(), "merge_lora: the model has no LoRA adapters (apply_lora)");
  for (const auto& layer : layers) {
    MIXPREC_CHECK(!detail::lora_base_fp8(layer.adapter->base()), "merge_lora: ",
                  detail::lora_layer_name(layer.path, *layer.module), " stores its base in fp8 "
                  "(LoraBase::", detail::lora_base_name(layer.adapter->base()), "), which would "
                  "round the adapter's update to e4m3 under scales fitted to the pretrained "
                  "weight: write the merged weights for Python with save_merged_safetensors "
                  "(dequantized, in fp32 or bf16), or apply the adapters over a bf16 base; "
                  "nothing was changed");
    MIXPREC_CHECK(!layer.adapter->merged(), "merge_lora: ",
                  detail::lora_layer_name(layer.path, *layer.module), " is merged already; "
                  "nothing was changed");
  }
  at::NoGradGuard no_grad;
  for (const auto& layer : layers) {
    auto& w = layer.module->weight;
    w.copy_((w.to(at::kFloat) + layer.adapter->delta_weight()).to(w.scalar_type()));
    layer.adapter->set_merged(true);
  }
}

/// Takes the adapters out of the base weights again, W -= (alpha / rank) B A. Not exact in
/// general: |W' - W| <= u (|W + D| + |W|) elementwise, u the unit roundoff of W's dtype (2^-24
/// fp32, 2^-8 bf16) plus fp32's for the sum; exact where the sums are (D = 0, values on a
/// coarse enough grid). Errors: an adapter that is not merged.
inline void unmerge_lora(torch::nn::Module& model) {
  const auto layers = lora_layers(model);
  MIXPREC_CHECK(!layers.empty(), "unmerge_lora: the model has no LoRA adapters (apply_lora)");
  for (const auto& layer : layers) {
    MIXPREC_CHECK(layer.adapter->merged(), "unmerge_lora: ",
                  detail::lora_layer_name(layer.path, *layer.module), " is not merged "
                  "(merge_lora); nothing was changed");
  }
  at::NoGradGuard no_grad;
  for (const auto& layer : layers) {
    auto& w = layer.module->weight;
    w.copy_((w.to(at::kFloat) - layer.adapter->delta_weight()).to(w.scalar_type()));
    layer.adapter->set_merged(false);
  }
}

}  // namespace mixprec
