#pragma once
// The Float8Linear layers one Trainer<MixedFP8<Recipe>> runs in fp8: found in its model, turned
// on for the Trainer's lifetime, finished after each step, and their delayed-scaling state in
// its checkpoints.

#include <mixprec/core/error.hpp>
#include <mixprec/fp8/linear.hpp>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mixprec {
namespace detail {

/// The Float8Linear layers a Trainer<MixedFP8<Recipe>> runs in fp8: those a precision map left
/// in fp8. Turns them on for its lifetime; step hooks, and their state in checkpoints.
class Fp8Layers {
 public:
  Fp8Layers() = default;
  Fp8Layers(const Fp8Layers&) = delete;
  Fp8Layers& operator=(const Fp8Layers&) = delete;
  Fp8Layers(Fp8Layers&& other) noexcept : layers_(std::move(other.layers_)) { other.layers_.clear(); }
  Fp8Layers& operator=(Fp8Layers&& other) noexcept {
    if (this != &other) {
      release();
      layers_ = std::move(other.layers_);
      other.layers_.clear();
    }
    return *this;
  }
  ~Fp8Layers() { release(); }

  using Found = std::vector<std::pair<std::string, std::shared_ptr<nn::Float8LinearImpl>>>;

  /// The layers of `model` that would compute in fp8; throws (naming plain Linear layers) if
  /// there are none.
  static Found find(const torch::nn::Module& model, std::string_view policy) {
    Found found;
    std::string plain, adapted;
    auto& registry = PrecisionRegistry::instance();
    for (const auto& item : model.named_modules("", /*include_self=*/true)) {
      auto layer = std::dynamic_pointer_cast<nn::Float8LinearImpl>(item.value());
      if (layer != nullptr) {
        if (!layer->fp8_allowed() || registry.kept_fp32(*layer)) continue;
        if (layer->adapter) adapted += (adapted.empty() ? "'" : ", '") + item.key() + "'";
        found.emplace_back(item.key(), layer);
      } else if (dynamic_cast<const torch::nn::LinearImpl*>(&unwrapped(*item.value())) != nullptr) {
        plain += (plain.empty() ? "'" : ", '") + item.key() + "'";
      }
    }
    MIXPREC_CHECK(adapted.empty(), "Trainer<", policy, ">: LoRA adapters sit on Float8Linear "
                  "layers that would compute in fp8: ", adapted, ". An adapted layer computes as "
                  "mixprec::nn::Linear (its frozen base in fp8 is LoraBase::fp8_rowwise); keep "
                  "these out of fp8 with a precision map (PrecisionMap().add(\"name\", "
                  "Precision::low)); nothing was changed");
    MIXPREC_CHECK(!found.empty(), "Trainer<", policy, ">: no layer of the model computes in fp8: "
                  "only linear layers declared as mixprec::nn::Float8Linear do (the same "
                  "parameters, state_dict keys and forward as torch::nn::Linear), and the model "
                  "has none, or a precision map keeps them all out of fp8", plain.empty() ? "" :
                  "; its plain torch::nn::Linear layers: " + plain, "; nothing was changed");
    return found;
  }

  /// find(), and for a block-scaled recipe, that each layer's features fill its blocks
  /// (torchao's casts assert it; here an Error naming the layers, before anything changes).
  template <class Recipe>
  static Found find(const torch::nn::Module& model, std::string_view policy) {
    auto found = find(model, policy);
    if constexpr (block_format_of<Recipe>() != BlockFormat::none) {
      std::string misfits;
      for (const auto& [name, layer] : found) {
        const auto in = layer->options.in_features(), out = layer->options.out_features();
        if (in % Recipe::block == 0 && out % Recipe::block == 0) continue;
        misfits += (misfits.empty() ? "'" : ", '") + name + "' (" + std::to_string(in) + " -> " +
                   std::to_string(out) + ")";
      }
      MIXPREC_CHECK(misfits.empty(), "Trainer<", policy, ">: the in and out features of a layer "
                    "in", block_format_name(Recipe::block_format), " must be multiples of its "
                    "block, ", Recipe::block, " (torchao refuses these shapes too); these are "
                    "not: ", misfits, ". Keep them in bf16 with a precision map (PrecisionMap()"
                    ".add(\"name\", Precision::low)); nothing was changed");
    }
    return found;
  }

  /// Turns on fp8 in the layers find() returned. `rounding_seed`: NVFP4's random bits
  /// (TrainerOptions::rounding_seed).
  template <class Recipe>
  void enable(Found found, std::uint64_t rounding_seed = 0) {
    for (auto& [name, module] : found) {
      auto state = c10::make_intrusive<Fp8LayerState>(Fp8Settings::of<Recipe>());
      state->set_rounding(rounding_seed, layers_.size());
      module->set_fp8_state(state);
      layers_.push_back({name, module, state});
    }
  }

  bool empty() const noexcept { return layers_.empty(); }
  std::size_t size() const noexcept { return layers_.size(); }

  /// The amaxes of the step in progress, all layers (undefined: none).
  at::Tensor pending_amaxes() const {
    std::vector<at::Tensor> amaxes;
    for (const auto& layer : layers_) {
      auto a = layer.state->pending_amaxes();
      if (a.defined()) amaxes.push_back(a);
    }
    return amaxes.empty() ? at::Tensor() : at::cat(amaxes);
  }

  void finish_step(bool stepped) {
    for (auto& layer : layers_) layer.state->finish_step(stepped);
  }

  /// Delayed scaling's histories and scales by "<layer>.<operand>.amax_history" / ".scale",
  /// NVFP4's random bits by "<layer>.rounding" ([seed, draws]; the other recipes: empty).
  c10::Dict<std::string, at::Tensor> state_dict() const {
    c10::Dict<std::string, at::Tensor> dict;
    for (const auto& layer : layers_) {
      if (layer.state->settings().block == BlockFormat::nvfp4) {
        dict.insert(layer.name + ".rounding", layer.state->rounding_state().clone());
      }
      if (!layer.state->delayed()) continue;
      for (const auto role : {Fp8Role::input, Fp8Role::weight, Fp8Role::grad_output}) {
        const auto& slot = layer.state->slot(role);
        const auto prefix = layer.name + "." + role_name(role);
        dict.insert(prefix + ".amax_history", slot.history.cpu().clone());
        dict.insert(prefix + ".scale", slot.scale.cpu().clone());
      }
    }
    return dict;
  }

  /// Checks `state` against these layers (before anything changes); returns the assignments.
  /// A checkpoint whose policy settings do not record the recipe (`recipe_recorded` false:
  /// written before they did) is checked against its own state: a delayed scale must be the one
  /// its history gives with this recipe's margin.
  std::vector<std::pair<at::Tensor*, at::Tensor>> check_state(const c10::IValue& state,
                                                             const std::string& source,
                                                             bool recipe_recorded) {
    std::vector<std::pair<at::Tensor*, at::Tensor>> assignments;
    const auto expected = state_dict();
    MIXPREC_CHECK(state.isGenericDict(), "'", source, "' lacks the fp8 scaling state of a ",
                  "MixedFP8 checkpoint (written by another policy?)");
    const auto dict = state.toGenericDict();
    MIXPREC_CHECK(dict.size() == expected.size(), "'", source, "' holds fp8 scaling state for ",
                  dict.size(), " tensors, this model's fp8 layers have ", expected.size(),
                  ": another model or recipe");
    for (auto& layer : layers_) {
      if (layer.state->settings().block == BlockFormat::nvfp4) {
        const auto key = layer.name + ".rounding";
        MIXPREC_CHECK(dict.contains(key) && dict.at(key).isTensor(), "'", source,
                      "' lacks the NVFP4 rounding state '", key, "': another model");
        const auto value = dict.at(key).toTensor();
        MIXPREC_CHECK(value.scalar_type() == at::kLong && value.numel() == 2, "'", source,
                      "': NVFP4 rounding state '", key, "' is not [seed, draws] (two int64); "
                      "the file is damaged");
        assignments.emplace_back(&layer.state->rounding_state(), value.reshape({2}).cpu());
      }
      if (!layer.state->delayed()) continue;
      for (const auto role : {Fp8Role::input, Fp8Role::weight, Fp8Role::grad_output}) {
        auto& slot = layer.state->slot(role);
        const auto prefix = layer.name + "." + role_name(role);
        for (auto [key, target] : {std::pair{prefix + ".amax_history", &slot.history},
                                   std::pair{prefix + ".scale", &slot.scale}}) {
          MIXPREC_CHECK(dict.contains(key) && dict.at(key).isTensor(), "'", source,
                        "' lacks the fp8 scaling state '", key, "': another model");
          const auto value = dict.at(key).toTensor();
          MIXPREC_CHECK(value.sizes() == target->sizes() && value.scalar_type() == at::kFloat,
                        "'", source, "': fp8 state '", key, "' has shape ", value.sizes(),
                        ", this layer's has ", target->sizes(), " (another history length?)");
          assignments.emplace_back(target, value.to(target->device()));
        }
        if (!recipe_recorded) {
          check_margin(dict.at(prefix + ".amax_history").toTensor(),
                       dict.at(prefix + ".scale").toTensor(), role, layer.state->margin(),
                       prefix + ".scale", source);
        }
      }
    }
    return assignments;
  }

  static void apply_state(std::vector<std::pair<at::Tensor*, at::Tensor>>& assignments) {
    for (auto& [target, value] : assignments) *target = value.clone().contiguous();
  }

 private:
  // Turns its layers back to Linear's computation (unless another Trainer took them since).
  void release() noexcept {
    for (auto& layer : layers_) {
      if (layer.module->fp8_state() == layer.state) layer.module->set_fp8_state({});
    }
    layers_.clear();
  }

  // The saved scale of one operand is the one its saved history gives with `margin`, as
  // Fp8LayerState::finish_step computes it; else an Error naming the margin that gives it.
  static void check_margin(const at::Tensor& history, const at::Tensor& scale, Fp8Role role,
                           int margin, const std::string& key, const std::string& source) {
    const auto amax = history.to(at::kFloat).max();
    const float saved = scale.item<float>();
    const auto scale_with = [&](int m) {
      return scale_from_amax(amax, fp8_max(role), m).template item<float>();
    };
    const auto before = [&] {
      return "checkpoint '" + source + "' was written before checkpoints recorded "
             "DelayedScaling's History and Margin, ";
    };
    if (amax.item<float>() <= 0) {
      // No amax seen yet: the initial scale, the same for every margin; or one from amaxes
      // the history has dropped since, whose margin cannot be told.
      MIXPREC_CHECK(saved == 1.0f, before(), "and its fp8 scale '", key, "' comes from amaxes "
                    "its history no longer holds: whether it was computed with this recipe's "
                    "Margin ", margin, " cannot be checked; resume from another checkpoint of "
                    "that run; nothing was changed");
      return;
    }
    if (scale_with(margin) == saved) return;
    int found = -1;
    for (int m = 0; m < 64 && found < 0; ++m) {
      if (scale_with(m) == saved) found = m;
    }
    fail(before(), "and its fp8 scale '", key, "' was computed with ",
         found >= 0 ? "Margin " + std::to_string(found) : std::string("no Margin in [0, 64)"),
         ", this Trainer's DelayedScaling with Margin ", margin, found >= 0 ? ": load it with "
         "DelayedScaling<" + std::to_string(history.size(0)) + ", " + std::to_string(found) +
         ">" : std::string(), "; nothing was changed");
  }

  struct Layer {
    std::string name;
    std::shared_ptr<nn::Float8LinearImpl> module;
    c10::intrusive_ptr<Fp8LayerState> state;
  };
  std::vector<Layer> layers_;
};

}  // namespace detail
}  // namespace mixprec
