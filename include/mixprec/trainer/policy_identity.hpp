#pragma once
// What a checkpoint's policy is checked against: every setting of the policy that changes the
// numbers (the low dtype, where the model is cast, masters, BatchNorm's dtype, the scaler type,
// an fp8 recipe with every setting of it: history, margin, granularity, scale rounding, the
// gradients' format, the weight gradient's precision; a block-scaled recipe's format, block,
// scale mode and NVFP4's parts), written out from the type, not its display name.
// Two types with the same settings load each other's checkpoints; two with the same name and
// other settings (a custom policy that inherits its base's name; DelayedScaling<4> and
// DelayedScaling<4, 3>, both "MixedFP8<DelayedScaling>") do not.

#include <mixprec/core/error.hpp>
#include <mixprec/core/policy.hpp>

#include <c10/core/ScalarType.h>
#include <c10/util/Type.h>

#include <cstddef>
#include <string>
#include <string_view>
#include <typeinfo>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// A policy as checkpoints record it.
struct PolicyIdentity {
  std::string name;      // P::name: for messages, and all that checkpoints before `settings` held
  std::string settings;  // "low=BFloat16;autocast=false;...": what loading compares
};

/// P's identity. Settings, in this order: low, autocast, cast_model, master_weights,
/// keep_batch_norm_fp32, scaler (the type's name), fp8 (none, tensorwise, delayed or rowwise),
/// for delayed scaling fp8_history and fp8_margin, for the rowwise recipes
/// fp8_power_of_2_scales, fp8_grad_output (e4m3 or e5m2) and fp8_weight_grad (fp8 or bf16);
/// for a block-scaled recipe fp8 (mxfp8, blockwise or nvfp4) and its own keys (fp8_block,
/// fp8_scale_mode, fp8_weight_grad; nvfp4_weight_blocks, nvfp4_gradient_rounding,
/// nvfp4_hadamard);
/// then, for a lean storage only (so that the checkpoints of the others read as before),
/// storage (RemainderMasters<BFloat16>, ...).
template <class P>
PolicyIdentity policy_identity() {
  std::string settings;
  // Appends, not `"..." + std::string&&`: GCC 12 at -O3 sees a false overflow in that.
  const auto add = [&settings](std::string_view key, const std::string& value) {
    if (!settings.empty()) settings += ';';
    settings.append(key).append("=").append(value);
  };
  const auto flag = [](bool on) { return std::string(on ? "true" : "false"); };
  add("low", c10::toString(P::low_dtype));
  add("autocast", flag(P::autocast));
  add("cast_model", flag(P::cast_model));
  add("master_weights", flag(P::master_weights));
  add("keep_batch_norm_fp32", flag(P::keep_batch_norm_fp32));
  add("scaler", c10::demangle(typeid(typename P::scaler_type).name()));
  if constexpr (fp8_policy<P> && requires { typename P::recipe; P::recipe::identity(); }) {
    // A block-scaled recipe (fp8/block_recipes.hpp) writes out its own settings: the format,
    // the block, the scale mode, NVFP4's switches.
    for (const auto& [key, value] : P::recipe::identity()) add(key, value);
  } else if constexpr (fp8_policy<P>) {
    using Recipe = typename P::recipe;
    add("fp8", Recipe::delayed ? "delayed" : Recipe::rowwise ? "rowwise" : "tensorwise");
    if constexpr (Recipe::delayed) {
      add("fp8_history", std::to_string(Recipe::history));
      add("fp8_margin", std::to_string(Recipe::margin));
    }
    // Only where they differ from the tensorwise and delayed recipes' settings: those recipes'
    // checkpoints, written before these keys, read as before.
    if constexpr (Recipe::rowwise || Recipe::power_of_2_scales || Recipe::grad_output_e4m3 ||
                  !Recipe::weight_grad_fp8) {
      add("fp8_power_of_2_scales", flag(Recipe::power_of_2_scales));
      add("fp8_grad_output", Recipe::grad_output_e4m3 ? "e4m3" : "e5m2");
      add("fp8_weight_grad", Recipe::weight_grad_fp8 ? "fp8" : "bf16");
    }
  } else {
    add("fp8", "none");
  }
  if constexpr (lean_state<P>) add("storage", std::string(storage_of<P>::name));
  return {std::string(P::name), std::move(settings)};
}

/// "key=value" pairs of a settings string.
inline std::vector<std::pair<std::string, std::string>> parse_settings(std::string_view settings) {
  std::vector<std::pair<std::string, std::string>> pairs;
  while (!settings.empty()) {
    const auto end = settings.find(';');
    const auto item = settings.substr(0, end);
    const auto equals = item.find('=');
    pairs.emplace_back(std::string(item.substr(0, equals)),
                       equals == std::string_view::npos ? "" : std::string(item.substr(equals + 1)));
    settings = end == std::string_view::npos ? std::string_view() : settings.substr(end + 1);
  }
  return pairs;
}

/// An Error, naming both policies and each setting that differs, unless a checkpoint written by
/// `saved_name` with `saved_settings` fits `own`.
/// The storage (RemainderMasters, bf16 moments, ...) may differ: a checkpoint holds fp32 master
/// values whatever the storage, and the load converts the moments (LeanLoad).
inline void check_policy_settings(const std::string& saved_name, const std::string& saved_settings,
                                  const PolicyIdentity& own, const std::string& path) {
  if (saved_settings == own.settings) return;
  auto saved = parse_settings(saved_settings);
  auto mine = parse_settings(own.settings);
  const auto without_storage = [](auto& pairs) {
    std::erase_if(pairs, [](const auto& kv) { return kv.first == "storage"; });
  };
  without_storage(saved);
  without_storage(mine);
  if (saved == mine) return;
  const auto value_in = [](const auto& pairs, const std::string& key) {
    for (const auto& [k, v] : pairs) {
      if (k == key) return v;
    }
    return std::string("(none)");
  };
  std::vector<std::string> keys;  // every key of either, in order of appearance
  for (const auto* pairs : {&saved, &mine}) {
    for (const auto& [key, value] : *pairs) {
      bool known = false;
      for (const auto& k : keys) known = known || k == key;
      if (!known) keys.push_back(key);
    }
  }
  std::string differences;
  for (const auto& key : keys) {
    const auto a = value_in(saved, key), b = value_in(mine, key);
    if (a == b) continue;
    differences += (differences.empty() ? "" : ", ") + key + " " + a + " there, " + b + " here";
  }
  fail("checkpoint '", path, "' was written by Trainer<", saved_name, ">, this is Trainer<",
       own.name, ">, and their settings that change the numbers differ: ", differences,
       ". Load it with a policy of the same settings (a recipe's template arguments included); "
       "nothing was changed");
}

}  // namespace mixprec::detail
