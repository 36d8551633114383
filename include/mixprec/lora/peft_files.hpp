#pragma once
/// LoRA weights out to Python and back, in PEFT's form: a directory with adapter_config.json
/// and adapter_model.safetensors (keys "base_model.model.<path>.lora_A.weight"), which
/// PeftModel.from_pretrained(base, directory) loads, and which load_lora_adapter loads here; and
/// the merged model as one safetensors file under the base's own names (for transformers'
/// from_pretrained, or any Python model with the same paths), streamed layer by layer.
///
///   mixprec::save_lora_adapter(*model, "out/adapter");             // for PeftModel
///   mixprec::save_merged_safetensors(*model, "out/model.safetensors");  // W + (alpha/r) B A

#include <mixprec/core/error.hpp>
#include <mixprec/io/json.hpp>
#include <mixprec/io/safetensors.hpp>
#include <mixprec/io/save_safetensors.hpp>
#include <mixprec/io/atomic_file.hpp>
#include <mixprec/lora/apply_lora.hpp>
#include <mixprec/nn/module_patterns.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <charconv>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <set>
#include <string>
#include <vector>

namespace mixprec {

namespace detail {

inline constexpr const char* kPeftPrefix = "base_model.model.";

// The modules whose parameters train besides the adapters (PEFT's modules_to_save).
inline std::vector<std::string> trained_modules(const torch::nn::Module& model) {
  std::vector<std::string> modules;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (dynamic_cast<const LoraMatrix*>(item.value().get()) != nullptr) continue;
    bool trained = false;
    for (const auto& p : item.value()->parameters(/*recurse=*/false)) trained |= p.requires_grad();
    if (trained) modules.push_back(item.key());
  }
  return modules;
}

// PEFT's rule for a target name: a string is a regular expression the whole path must match;
// a list entry matches a path equal to it or ending in "." + it.
inline bool peft_matches(const Json& targets, const std::string& entry, const std::string& path) {
  if (targets.is_string()) return std::regex_match(path, std::regex(entry));
  return path == entry ||
         (path.size() > entry.size() && path.compare(path.size() - entry.size(), entry.size(), entry) == 0 &&
          path[path.size() - entry.size() - 1] == '.');
}

}  // namespace detail

/// Writes the LoRA adapters of `model` in PEFT's form into `directory` (created if need be):
/// adapter_model.safetensors with every adapter, and the parameters of the modules left
/// trainable (modules_to_save), in fp32; adapter_config.json with r, lora_alpha, lora_dropout,
/// use_rslora, target_modules (the adapted layers' paths) and modules_to_save. `values`: tensors
/// by the model's names to write instead of the model's own (Trainer::fp32_state_dict(), whose
/// fp32 masters under MixedO2 are more precise than the model's Low adapters). Each file is
/// written atomically. Errors: a model without adapters, adapters of several settings.
inline void save_lora_adapter(const torch::nn::Module& model, const std::string& directory,
                              const StateDict& values = StateDict(),
                              const std::string& base_model_name_or_path = "") {
  const auto layers = lora_layers(model);
  MIXPREC_CHECK(!layers.empty(), "save_lora_adapter: the model has no LoRA adapters (apply_lora)");
  const auto& first = *layers.front().adapter;
  const auto rank = first.lora_a().weight.size(0);
  for (const auto& layer : layers) {
    MIXPREC_CHECK(layer.adapter->lora_a().weight.size(0) == rank &&
                      layer.adapter->scaling() == first.scaling() &&
                      layer.adapter->dropout() == first.dropout(),
                  "save_lora_adapter: layer '", layer.path, "' has other LoRA settings than '",
                  layers.front().path, "': one adapter_config.json holds one rank, alpha and "
                  "dropout");
  }
  const auto value_of = [&](const std::string& name, const at::Tensor& own) {
    const auto& t = values.contains(name) ? values[name] : own;
    return t.detach().to(at::kFloat);
  };
  std::vector<detail::SafetensorsSlot> slots;
  std::string targets, saved;
  for (const auto& layer : layers) {
    for (const auto* which : {"lora_A", "lora_B"}) {
      const auto name = layer.path + "." + which + ".weight";
      const auto& own = std::string(which) == "lora_A" ? layer.adapter->lora_a().weight
                                                      : layer.adapter->lora_b().weight;
      slots.push_back({detail::kPeftPrefix + name, at::kFloat,
                       std::vector<std::int64_t>(own.sizes().begin(), own.sizes().end()),
                       [&value_of, name, own] { return value_of(name, own); }});
    }
    targets += (targets.empty() ? "" : ", ") + detail::json_string(layer.path);
  }
  const auto modules = detail::trained_modules(model);
  for (const auto& module_path : modules) {
    const auto& module = *model.named_modules("", false)[module_path];
    for (const auto& item : module.named_parameters(/*recurse=*/false)) {
      const auto name = module_path + "." + item.key();
      const auto own = item.value();
      const auto dtype = at::isFloatingType(own.scalar_type()) ? at::kFloat : own.scalar_type();
      slots.push_back({detail::kPeftPrefix + name, dtype,
                       std::vector<std::int64_t>(own.sizes().begin(), own.sizes().end()),
                       [&value_of, name, own, dtype] { return value_of(name, own).to(dtype); }});
    }
    saved += (saved.empty() ? "" : ", ") + detail::json_string(module_path);
  }
  const double scaling = first.scaling();
  // alpha from the scaling: alpha / r (use_rslora is not written: scaling holds it as alpha).
  const double alpha = scaling * static_cast<double>(rank);
  std::filesystem::create_directories(directory);
  detail::write_safetensors(directory + "/adapter_model.safetensors", std::move(slots), {});
  const std::string config =
      "{\n  \"peft_type\": \"LORA\",\n  \"task_type\": null,\n  \"base_model_name_or_path\": " +
      (base_model_name_or_path.empty() ? std::string("null")
                                       : detail::json_string(base_model_name_or_path)) +
      ",\n  \"r\": " + std::to_string(rank) + ",\n  \"lora_alpha\": " + detail::Json::number(alpha) +
      ",\n  \"lora_dropout\": " + detail::Json::number(first.dropout()) +
      ",\n  \"use_rslora\": false,\n  \"target_modules\": [" + targets +
      "],\n  \"modules_to_save\": " + (saved.empty() ? std::string("null") : "[" + saved + "]") +
      ",\n  \"bias\": \"none\",\n  \"fan_in_fan_out\": false,\n  \"init_lora_weights\": true,\n"
      "  \"inference_mode\": true,\n  \"use_dora\": false,\n  \"lora_bias\": false,\n"
      "  \"rank_pattern\": {},\n  \"alpha_pattern\": {},\n  \"layers_to_transform\": null,\n"
      "  \"layers_pattern\": null\n}\n";
  detail::AtomicFile file(directory + "/adapter_config.json");
  file.write(config.data(), config.size());
  file.commit();
}

/// Gives `model` the LoRA adapters that PEFT saved in `directory` (adapter_config.json and
/// adapter_model.safetensors: PeftModel.save_pretrained's files, or save_lora_adapter's), as
/// apply_lora would with the config's r, lora_alpha, lora_dropout, use_rslora, target_modules
/// (PEFT's matching: a list names module paths or their last names, a string is a regular
/// expression) and modules_to_save (left trainable, their weights loaded), then loads the
/// saved weights. `options` gives what the config does not: the seed, the base's storage.
/// Returns the adapted layers' paths. Errors, before anything changes: a config PEFT did not
/// write for LoRA, settings mixprec does not compute (use_dora, lora_bias, fan_in_fan_out, a
/// bias other than "none", rank_pattern, alpha_pattern, layers_to_transform), a target or a
/// module to save that the model does not have, a saved tensor the model has no place for or
/// of another shape, an adapter the file lacks; and apply_lora's.
inline std::vector<std::string> load_lora_adapter(const std::shared_ptr<torch::nn::Module>& model,
                                                  const std::string& directory,
                                                  LoraOptions options = {}) {
  MIXPREC_CHECK(model != nullptr, "load_lora_adapter got a null model");
  const auto config_path = directory + "/adapter_config.json";
  std::ifstream config_file(config_path, std::ios::binary);
  MIXPREC_CHECK(config_file, "load_lora_adapter: cannot open '", config_path, "'");
  const std::string text((std::istreambuf_iterator<char>(config_file)), std::istreambuf_iterator<char>());
  const auto config = detail::JsonParser::parse(text, "load_lora_adapter: '" + config_path + "'");
  MIXPREC_CHECK(config.is_object(), "load_lora_adapter: '", config_path, "' is not a JSON object");
  const auto field = [&](const char* key) { return config.find(key); };
  const auto is_null = [](const detail::Json* v) { return v == nullptr || v->type == detail::Json::Type::null; };
  const auto* type = field("peft_type");
  MIXPREC_CHECK(type != nullptr && type->is_string() && type->text == "LORA", "load_lora_adapter: '",
                config_path, "' is not a LoRA adapter's config (peft_type \"LORA\")");
  const auto number = [&](const char* key, double fallback) {
    const auto* v = field(key);
    if (is_null(v)) return fallback;
    MIXPREC_CHECK(v->type == detail::Json::Type::number, "load_lora_adapter: '", config_path,
                  "' has a ", key, " that is not a number: ", v->dump());
    return std::stod(v->text);
  };
  const auto flag = [&](const char* key) {
    const auto* v = field(key);
    return v != nullptr && v->type == detail::Json::Type::boolean && v->boolean;
  };
  for (const auto* key : {"use_dora", "lora_bias", "fan_in_fan_out"}) {
    MIXPREC_CHECK(!flag(key), "load_lora_adapter: '", config_path, "' sets ", key, ", which "
                  "mixprec's LoRA does not compute; train without it in PEFT, or merge it there "
                  "(merge_and_unload) and load the merged weights; nothing was changed");
  }
  const auto* bias = field("bias");
  MIXPREC_CHECK(is_null(bias) || (bias->is_string() && bias->text == "none"), "load_lora_adapter: '",
                config_path, "' trains biases (bias ", bias->dump(), "), which mixprec's LoRA "
                "does not; nothing was changed");
  for (const auto* key : {"rank_pattern", "alpha_pattern"}) {
    const auto* v = field(key);
    MIXPREC_CHECK(is_null(v) || (v->is_object() && v->members.empty()), "load_lora_adapter: '",
                  config_path, "' sets ", key, " (ranks or alphas per layer), which mixprec's "
                  "LoRA does not take; nothing was changed");
  }
  MIXPREC_CHECK(is_null(field("layers_to_transform")), "load_lora_adapter: '", config_path,
                "' sets layers_to_transform, which mixprec does not read: list the layers in "
                "target_modules; nothing was changed");
  options.rank(static_cast<std::int64_t>(number("r", 8)));
  options.alpha(number("lora_alpha", 8));
  options.dropout(number("lora_dropout", 0));
  options.use_rslora(flag("use_rslora"));

  const auto named = model->named_modules("", /*include_self=*/false);
  std::vector<std::string> paths;
  for (const auto& item : named) paths.push_back(item.key());
  // Each target and each module to save must name a module of the model (PEFT refuses a
  // config none of whose targets exist; one that is missing is a mistake too).
  const auto resolve = [&](const char* key, bool linear_only) {
    std::vector<std::string> found;
    const auto* v = field(key);
    if (is_null(v)) return found;
    MIXPREC_CHECK(v->is_string() || v->is_array(), "load_lora_adapter: '", config_path, "' has a ",
                  key, " that is neither a list nor a string");
    std::vector<std::string> entries;
    if (v->is_string()) entries.push_back(v->text);
    for (const auto& item : v->items) {
      MIXPREC_CHECK(item.is_string(), "load_lora_adapter: ", key, " holds a non-string: ", item.dump());
      entries.push_back(item.text);
    }
    for (const auto& entry : entries) {
      bool any = false;
      for (std::size_t i = 0; i < named.size(); ++i) {
        if (!detail::peft_matches(*v, entry, paths[i])) continue;
        if (linear_only && dynamic_cast<nn::LinearImpl*>(named[i].value().get()) == nullptr) continue;
        any = true;
        if (std::find(found.begin(), found.end(), paths[i]) == found.end()) found.push_back(paths[i]);
      }
      MIXPREC_CHECK(any, "load_lora_adapter: ", key, " '", entry, "' of '", config_path,
                    "' names no ", linear_only ? "mixprec::nn::Linear " : "", "module of the "
                    "model (the closest names: ", detail::closest_names(entry, paths), "): the "
                    "adapter was trained on another model, or the model's paths differ from "
                    "Python's; nothing was changed");
    }
    return found;
  };
  auto targets = resolve("target_modules", true);
  MIXPREC_CHECK(!targets.empty(), "load_lora_adapter: '", config_path, "' names no target_modules");
  const auto to_save = resolve("modules_to_save", false);
  options.trainable(to_save);

  // The saved tensors, each with a place in the adapted model of the right shape.
  const auto file = read_safetensors(directory + "/adapter_model.safetensors");
  const auto rank = options.rank();
  std::set<std::string> expected;
  for (const auto& path : targets) {
    const auto* linear = dynamic_cast<nn::LinearImpl*>(named[static_cast<std::size_t>(
        std::find(paths.begin(), paths.end(), path) - paths.begin())].value().get());
    const auto out = linear->weight.size(0), in = linear->weight.size(1);
    for (const auto& [which, shape] : {std::pair<std::string, std::vector<std::int64_t>>{"lora_A", {rank, in}},
                                       {"lora_B", {out, rank}}}) {
      const auto key = detail::kPeftPrefix + path + "." + which + ".weight";
      MIXPREC_CHECK(file.contains(key), "load_lora_adapter: the adapter file of '", directory,
                    "' lacks '", key, "', which its config's target_modules ask for; nothing "
                    "was changed");
      MIXPREC_CHECK(file[key].sizes() == at::IntArrayRef(shape), "load_lora_adapter: '", key,
                    "' has shape ", file[key].sizes(), ", but r ", rank, " on layer '", path,
                    "' needs ", at::IntArrayRef(shape), "; nothing was changed");
      expected.insert(key);
    }
  }
  for (const auto& path : to_save) {
    for (const auto& item : model->named_modules("", false)[path]->named_parameters(false)) {
      const auto key = detail::kPeftPrefix + path + "." + item.key();
      MIXPREC_CHECK(!file.contains(key) || file[key].sizes() == item.value().sizes(),
                    "load_lora_adapter: '", key, "' has shape ", file[key].sizes(), ", but the "
                    "model's has ", item.value().sizes(), "; nothing was changed");
      expected.insert(key);
    }
  }
  for (const auto& item : file) {
    MIXPREC_CHECK(expected.count(item.key()) == 1, "load_lora_adapter: the adapter file of '",
                  directory, "' has '", item.key(), "', for which the model has no place "
                  "(its config targets ", targets.size(), " layers); nothing was changed");
  }

  auto adapted = apply_lora(model, targets, options);
  at::NoGradGuard no_grad;
  const auto params = model->named_parameters();
  for (const auto& item : file) {
    const auto name = item.key().substr(std::string(detail::kPeftPrefix).size());
    auto target = params[name];
    target.copy_(item.value());
  }
  return adapted;
}

/// Writes `model` with its LoRA adapters folded in, W + (alpha / rank) B A (an fp8 base
/// dequantized first), under the base's names: the adapters and the fp8 scales are left out,
/// so that the file is the fine-tuned model for Python (transformers' from_pretrained of the
/// base model's class). Floating tensors in `dtype` (fp32 by default), each computed when its
/// turn comes; the model is not changed. Atomic, as save_safetensors.
inline void save_merged_safetensors(const torch::nn::Module& model, const std::string& path,
                                    c10::ScalarType dtype = at::kFloat,
                                    const SafetensorsOptions& options = {}) {
  MIXPREC_CHECK(at::isFloatingType(dtype), "save_merged_safetensors: ", dtype, " is not a "
                "floating-point dtype");
  const auto layers = lora_layers(model);
  std::vector<detail::SafetensorsSlot> slots;
  const auto add = [&](const std::string& name, const at::Tensor& t) {
    auto slot = detail::tensor_slot(name, t);
    if (at::isFloatingType(t.scalar_type())) {
      slot.dtype = dtype;
      slot.values = [t, dtype] { return t.detach().to(dtype); };
    }
    for (const auto& layer : layers) {
      if (name == layer.path + ".lora_A.weight" || name == layer.path + ".lora_B.weight" ||
          name == layer.path + ".weight_scale") {
        return;
      }
      if (name != layer.path + ".weight") continue;
      const auto* adapter = layer.adapter;
      slot.values = [t, adapter, dtype] {
        auto w = detail::dequantize(t.detach(), adapter->scale(), at::kFloat);
        return (adapter->merged() ? w : w + adapter->delta_weight()).to(dtype);
      };
    }
    slots.push_back(std::move(slot));
  };
  for (const auto& item : model.named_parameters()) add(item.key(), item.value());
  for (const auto& item : model.named_buffers()) add(item.key(), item.value());
  detail::write_safetensors(path, std::move(slots), options);
}

}  // namespace mixprec
