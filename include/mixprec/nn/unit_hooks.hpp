#pragma once
// What runs around the forward of a wrapper module (mixprec::nn::Mappable, Checkpointed): LibTorch
// modules have no hooks of their own, so the wrappers that a model declares are where sharded
// parameters (DistributedOptions::shard_parameters) are gathered before a unit's forward,
// released after it, and gathered again before its backward. Nothing is set by default: a
// wrapper without hooks computes as its module. And where a wrapper tells that its module is
// built: mixprec::ShardedBuild (distributed/sharded_build.hpp) then cuts its weights into shards.

#include <ATen/ATen.h>

#include <memory>
#include <utility>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace mixprec::detail {

/// What a sharded unit does around its forward.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  /// Before the forward: the unit's parameters whole on this rank.
  virtual void before_forward() = 0;
  /// After it: the parameters released, and the output (returned, perhaps an alias) arranged
  /// so that they are whole again before its backward runs.
  virtual at::Tensor after_forward(const at::Tensor& output) = 0;
};

/// The base of the wrappers that run UnitHooks (a virtual base: Checkpointed<M> with a forward
/// of one tensor is a Mappable too).
class HookedModule {
 public:
  virtual ~HookedModule() = default;
  void set_unit_hooks(std::shared_ptr<UnitHooks> hooks) noexcept { hooks_ = std::move(hooks); }
  bool has_unit_hooks() const noexcept { return hooks_ != nullptr; }
  const std::shared_ptr<UnitHooks>& unit_hooks() const noexcept { return hooks_; }

 protected:
  /// compute(), within the hooks when there are any.
  template <class Compute>
  at::Tensor run_hooked(Compute&& compute) const {
    if (!hooks_) return compute();
    const auto hooks = hooks_;  // alive through the call, whatever the forward does
    hooks->before_forward();
    return hooks->after_forward(compute());
  }

 private:
  std::shared_ptr<UnitHooks> hooks_;
};

/// What a wrapper tells when it has built its module (the last line of its constructor): the
/// builder active on this thread, if any, takes the unit (mixprec::ShardedBuild).
class UnitBuilder {
 public:
  virtual ~UnitBuilder() = default;
  virtual void built(torch::nn::Module& unit, HookedModule& hooked) = 0;
  /// The builder active on this thread; null: none.
  static UnitBuilder*& active() noexcept {
    thread_local UnitBuilder* builder = nullptr;
    return builder;
  }
};

/// Called by each wrapper at the end of its constructor.
inline void unit_built(torch::nn::Module& unit, HookedModule& hooked) {
  if (auto* builder = UnitBuilder::active()) builder->built(unit, hooked);
}

}  // namespace mixprec::detail
