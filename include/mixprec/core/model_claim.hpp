#pragma once
// Which model tensors a live Trainer trains: a second Trainer must not cast or step them, and
// weights must not be loaded into them behind the Trainer's back (its fp32 master weights would
// overwrite them at the next step). Here, below every subsystem, so that io/ can ask too.

#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>

#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mixprec::detail {

/// A live Trainer's hold on its model's parameters. The registry keeps weak references, so the
/// hold ends with the Trainer that has it (moving a Trainer moves its hold).
class ModelClaim {
 public:
  /// Whether a live Trainer trains any of `params`.
  static bool any_claimed(const std::vector<at::Tensor>& params) {
    return !claimant(params).empty();
  }

  /// The policy of the live Trainer that trains any of `params` ("MixedO2<BFloat16>"); empty
  /// where none does.
  static std::string claimant(const std::vector<at::Tensor>& params) {
    auto& registry = instance();
    std::lock_guard<std::mutex> lock(registry.mutex);
    for (const auto& p : params) {
      const auto it = registry.owners.find(p.unsafeGetTensorImpl());
      if (it == registry.owners.end()) continue;
      if (const auto owner = it->second.lock()) return owner->policy_;
    }
    return {};
  }

  /// Claims `params` for a Trainer of `policy`; throws if a live Trainer other than the holder
  /// of `previous` (the caller's own earlier claim) trains any of them.
  static std::shared_ptr<ModelClaim> acquire(const std::vector<at::Tensor>& params,
                                             std::string_view policy,
                                             const ModelClaim* previous = nullptr) {
    auto& registry = instance();
    std::lock_guard<std::mutex> lock(registry.mutex);
    std::erase_if(registry.owners, [](const auto& entry) { return entry.second.expired(); });
    for (const auto& p : params) {
      const auto it = registry.owners.find(p.unsafeGetTensorImpl());
      if (it == registry.owners.end()) continue;
      const auto owner = it->second.lock();
      MIXPREC_CHECK(owner == nullptr || owner.get() == previous, "Trainer<", policy, ">: a "
                    "parameter of shape ", p.sizes(), " is trained by another Trainer<",
                    owner->policy_, "> that is still alive. A Trainer casts its model and owns "
                    "its gradients, so a second one would break the first one's steps: destroy "
                    "the first Trainer (or train every part through one model and one Trainer)");
    }
    std::shared_ptr<ModelClaim> claim(new ModelClaim(std::string(policy)));
    for (const auto& p : params) registry.owners[p.unsafeGetTensorImpl()] = claim;
    return claim;
  }

 private:
  explicit ModelClaim(std::string policy) : policy_(std::move(policy)) {}

  struct Registry {
    std::mutex mutex;
    std::unordered_map<const void*, std::weak_ptr<ModelClaim>> owners;  // by TensorImpl
  };
  static Registry& instance() {
    static Registry registry;
    return registry;
  }

  std::string policy_;
};

}  // namespace mixprec::detail
