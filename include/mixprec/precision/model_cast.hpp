#pragma once
// What a Trainer does to its model as a whole: casting its parameters and buffers to a policy's
// low dtype, module by module, so that BatchNorm can stay fp32 (LibTorch's batch_norm takes
// bf16/fp16 input with fp32 weights and running statistics; layer_norm and group_norm do not on
// the CPU of LibTorch 1.13). Claiming it, so that a second Trainer cannot cast or step it too,
// is core/model_claim.hpp.

#include <mixprec/core/held_shards.hpp>
#include <mixprec/core/model_claim.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/nn/linear.hpp>
#include <mixprec/nn/unit_hooks.hpp>

#include <c10/core/TensorImpl.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// The base of mixprec::nn::Mappable (precision_map.hpp): the module it wraps, the region
/// apply_precision_map gave it, and the hooks of a sharded unit (nn/unit_hooks.hpp).
class MappableBase : public virtual HookedModule {
 public:
  struct Region {
    bool active = false;       // its precision differs from its parent's
    std::string path;          // its named_modules() path in the mapped model, for Errors
    c10::ScalarType dtype = c10::ScalarType::Float;
    bool cast_inputs = false;  // floating inputs to `dtype`
    bool cast_output = false;  // the output to `output_dtype` (unset: the input's dtype)
    std::optional<c10::ScalarType> output_dtype;
    std::optional<bool> autocast;  // MixedO1: off in an fp32 region, on in a low one
    c10::ScalarType autocast_dtype = c10::ScalarType::BFloat16;
  };
  virtual ~MappableBase() = default;
  virtual const torch::nn::Module& wrapped() const = 0;
  void set_region(const Region& region) { region_ = region; }
  const Region& region() const noexcept { return region_; }
  /// A linear layer that can compute in fp8 (mixprec::nn::Float8Linear, fp8.hpp).
  virtual bool fp8_capable() const { return false; }
  /// Whether a precision map leaves it to compute in fp8 under an fp8 policy (default: yes).
  bool fp8_allowed() const noexcept { return fp8_allowed_; }
  void allow_fp8(bool allowed) noexcept { fp8_allowed_ = allowed; }

 protected:
  Region region_;
  bool fp8_allowed_ = true;
};

/// The module itself, or the one a Mappable wraps: what the module computes.
inline const torch::nn::Module& unwrapped(const torch::nn::Module& module) {
  const auto* mappable = dynamic_cast<const MappableBase*>(&module);
  return mappable != nullptr ? mappable->wrapped() : module;
}

inline bool is_batch_norm(const torch::nn::Module& wrapper) {
  const auto& module = unwrapped(wrapper);
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module) != nullptr;
}

/// LayerNorm and GroupNorm, whose CPU kernels take bf16/fp16 input with fp32 weights from
/// LibTorch 2.x on (1.13 refuses; checked on 1.13 and 2.13).
inline bool is_layer_or_group_norm(const torch::nn::Module& wrapper) {
  const auto& module = unwrapped(wrapper);
  return dynamic_cast<const torch::nn::LayerNormImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::GroupNormImpl*>(&module) != nullptr;
}

/// The modules that apply_precision_map keeps in fp32 (precision_map.hpp), and the models it
/// mapped: process-wide, by address, each with a weak reference that tells a live module from a
/// new one at a freed one's address.
class PrecisionRegistry {
 public:
  static PrecisionRegistry& instance() {
    static PrecisionRegistry registry;
    return registry;
  }
  void keep_fp32(const std::shared_ptr<torch::nn::Module>& module) { add(fp32_, module, {}); }
  void mark_mapped(const std::shared_ptr<torch::nn::Module>& model, std::string_view policy) {
    add(mapped_, model, std::string(policy));
  }
  bool kept_fp32(const torch::nn::Module& module) { return live(fp32_, module) != nullptr; }
  /// The policy a map was applied for, if `model` is the root of a mapped model.
  std::optional<std::string> mapped_policy(const torch::nn::Module& model) {
    const auto* entry = live(mapped_, model);
    return entry != nullptr ? std::optional<std::string>(entry->policy) : std::nullopt;
  }

 private:
  struct Entry {
    std::weak_ptr<torch::nn::Module> module;
    std::string policy;
  };
  using Entries = std::unordered_map<const torch::nn::Module*, Entry>;
  void add(Entries& entries, const std::shared_ptr<torch::nn::Module>& module, std::string policy) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::erase_if(entries, [](const auto& entry) { return entry.second.module.expired(); });
    entries[module.get()] = Entry{module, std::move(policy)};
  }
  const Entry* live(Entries& entries, const torch::nn::Module& module) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (entries.empty()) return nullptr;
    const auto it = entries.find(&module);
    return it != entries.end() && it->second.module.lock().get() == &module ? &it->second : nullptr;
  }
  std::mutex mutex_;
  Entries fp32_, mapped_;
};

/// A Trainer<policy> on `model`: an Error if a precision map was applied to it, or to a part of
/// it, for another policy (its fp32 modules would be cast, or its regions set for another one).
inline void check_precision_map(const torch::nn::Module& model, std::string_view policy) {
  auto& registry = PrecisionRegistry::instance();
  const auto root = registry.mapped_policy(model);
  MIXPREC_CHECK(!root || *root == policy, "Trainer<", policy, ">: the model's precision map "
                "was applied for ", *root, ": apply it with apply_precision_map<the Trainer's "
                "policy>, or build a Trainer<", *root, ">");
  if (root) return;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const auto part = registry.mapped_policy(*item.value());
    MIXPREC_CHECK(!part && !registry.kept_fp32(*item.value()), "Trainer<", policy, ">: module '",
                  item.key(), "' was given a precision by a map applied to ",
                  part ? "it" : "another model", ", not to this model: apply the map to the "
                  "model the Trainer trains");
  }
}

/// The parameters that a Trainer cast, with its policy: the model stays cast after that Trainer
/// is gone, and a later Trainer on it says so instead of asking the user to undo a cast they
/// never made. Weak references tell a live tensor from a new one at a freed one's address.
class CastRecord {
 public:
  static void add(const at::Tensor& p, std::string_view policy) {
    auto& r = instance();
    std::lock_guard<std::mutex> lock(r.mutex);
    std::erase_if(r.entries, [](const auto& entry) { return entry.second.tensor.expired(); });
    r.entries.insert_or_assign(p.unsafeGetTensorImpl(),
                               Entry{Weak(p.getIntrusivePtr()), std::string(policy)});
  }
  /// The policy of the Trainer that cast `p`, if one did.
  static std::optional<std::string> policy_of(const at::Tensor& p) {
    auto& r = instance();
    std::lock_guard<std::mutex> lock(r.mutex);
    const auto it = r.entries.find(p.unsafeGetTensorImpl());
    if (it == r.entries.end() || it->second.tensor.lock().get() != p.unsafeGetTensorImpl()) {
      return std::nullopt;
    }
    return it->second.policy;
  }

 private:
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Entry {
    Weak tensor;
    std::string policy;
  };
  struct Registry {
    std::mutex mutex;
    std::unordered_map<const void*, Entry> entries;
  };
  static Registry& instance() {
    static Registry registry;
    return registry;
  }
};

/// The parameters cast_model leaves in fp32: BatchNorm's when `keep_batch_norm_fp32`, and those
/// of the modules a precision map keeps in fp32.
inline std::vector<at::Tensor> parameters_kept_fp32(const torch::nn::Module& model,
                                                    bool keep_batch_norm_fp32) {
  auto& registry = PrecisionRegistry::instance();
  std::vector<at::Tensor> kept;
  for (const auto& item : model.named_modules()) {
    const auto& module = *item.value();
    if (!(keep_batch_norm_fp32 && is_batch_norm(module)) && !registry.kept_fp32(module)) continue;
    for (const auto& p : module.parameters(/*recurse=*/false)) kept.push_back(p);
  }
  return kept;
}

/// Casts every floating parameter and buffer of `model` to `dtype`, except BatchNorm's when
/// `keep_batch_norm_fp32` and those of the modules a precision map keeps in fp32; with `only`,
/// just those of its parameters that are fp32 (a param group added after construction).
/// Tensors keep their identity (set_data), so optimizers built on model->parameters() still
/// point at them. `policy`: the Trainer's, recorded with each parameter it casts (CastRecord).
inline void cast_model(torch::nn::Module& model, at::ScalarType dtype, bool keep_batch_norm_fp32,
                       std::string_view policy, const std::vector<at::Tensor>* only = nullptr) {
  const auto selected = only != nullptr ? identities(*only) : std::unordered_set<const void*>{};
  const auto fixed = identities(nn::detail::fixed_dtype_tensors(model));  // a stored LoRA base
  auto& registry = PrecisionRegistry::instance();
  for (const auto& module : model.modules(/*include_self=*/true)) {
    if (keep_batch_norm_fp32 && is_batch_norm(*module)) continue;
    if (registry.kept_fp32(*module)) continue;
    for (auto& item : module->named_parameters(/*recurse=*/false)) {
      auto& p = item.value();
      if (only != nullptr && (selected.count(p.unsafeGetTensorImpl()) == 0 || p.scalar_type() != at::kFloat)) {
        continue;
      }
      if (fixed.count(p.unsafeGetTensorImpl()) == 1) continue;
      if (at::isFloatingType(p.scalar_type()) && p.scalar_type() != dtype) {
        if (HeldShards::is_placeholder(p)) {
          cast_held(p, dtype);  // its piece; no bytes of its size
        } else {
          p.set_data(p.data().to(dtype));
        }
        // A gradient left from before would stay fp32 and have every later one added into it.
        p.mutable_grad() = at::Tensor();
        CastRecord::add(p, policy);
      }
    }
    if (only != nullptr) continue;
    for (auto& item : module->named_buffers(/*recurse=*/false)) {
      auto& b = item.value();
      if (fixed.count(b.unsafeGetTensorImpl()) == 1) continue;
      if (at::isFloatingType(b.scalar_type())) b.set_data(b.data().to(dtype));
    }
  }
}

/// Throws if one of `trained` is the weight of an Embedding or EmbeddingBag with sparse
/// gradients: fp32 master weights take dense ones.
inline void check_dense_gradients(const torch::nn::Module& model, const std::vector<at::Tensor>& trained,
                                  std::string_view policy) {
  const auto selected = identities(trained);
  for (const auto& item : model.named_modules()) {
    const auto* embedding = dynamic_cast<const torch::nn::EmbeddingImpl*>(item.value().get());
    const auto* bag = dynamic_cast<const torch::nn::EmbeddingBagImpl*>(item.value().get());
    const bool sparse = (embedding != nullptr && embedding->options.sparse()) ||
                        (bag != nullptr && bag->options.sparse());
    if (!sparse) continue;
    const auto& weight = embedding != nullptr ? embedding->weight : bag->weight;
    MIXPREC_CHECK(selected.count(weight.unsafeGetTensorImpl()) == 0, "module '", item.key(),
                  "' has sparse gradients (sparse(true)), but ", policy, " keeps fp32 master "
                  "weights, which take dense ones: build it with sparse(false), or leave its "
                  "weight out of the optimizer");
  }
}

}  // namespace mixprec::detail

namespace mixprec {

/// Casts the floating-point parameters and buffers of `model` to `dtype`, as Python's
/// `model.to(torch.bfloat16)` does, one tensor at a time (each keeps its identity). LibTorch's
/// `model->to(dtype)` casts every tensor, the integer ones too: an encoder's position ids, whose
/// embedding lookup then fails, or BatchNorm's num_batches_tracked, which stops counting at 256
/// in bf16. For a model handed to a PureHalf Trainer already in its Low dtype. A parameter held
/// in shards (mixprec::ShardedBuild) casts its piece.
inline void cast_floating(torch::nn::Module& model, at::ScalarType dtype) {
  MIXPREC_CHECK(at::isFloatingType(dtype), "cast_floating: ", dtype, " is not a floating-point "
                "dtype");
  at::NoGradGuard no_grad;
  // A LoRA base stored in bf16 or fp8 keeps its dtype.
  const auto fixed = detail::identities(nn::detail::fixed_dtype_tensors(model));
  for (auto& p : model.parameters()) {
    if (!at::isFloatingType(p.scalar_type()) || p.scalar_type() == dtype) continue;
    if (fixed.count(p.unsafeGetTensorImpl()) == 1) continue;
    if (detail::HeldShards::is_placeholder(p)) {
      detail::cast_held(p, dtype);  // held in shards: its piece (mixprec::ShardedBuild)
    } else {
      p.set_data(p.data().to(dtype));
    }
  }
  for (auto& b : model.buffers()) {
    if (at::isFloatingType(b.scalar_type()) && fixed.count(b.unsafeGetTensorImpl()) == 0) {
      b.set_data(b.data().to(dtype));
    }
  }
}

}  // namespace mixprec
