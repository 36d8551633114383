#pragma once
// Owns ZeRO-3's units (DistributedOptions::shard_parameters): the wrapper modules that the unit
// patterns name, the parameters each one holds, and what happens around their forward. Between
// a unit's uses its parameters' bytes are released (param_storage.hpp) and each rank keeps its
// pieces (ShardedOptimizer: copies, fp32 where they are masters); before its forward every
// rank's pieces are gathered into them in the model's dtype, after it they are released, and
// an alias of its output gathers them again before its backward. The gradient reducer
// releases each parameter once its gradient is in its bucket, and finish() releases what is
// left. When the Trainer goes, each rank keeps its pieces of the units' weights, held in shards
// (sharded_build.hpp), never the units whole.
//
// Parameters outside every unit, and frozen ones, stay whole on every rank (ZeRO-2).

#include <mixprec/core/autograd_function.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/distributed/bucket_layout.hpp>
#include <mixprec/distributed/param_storage.hpp>
#include <mixprec/distributed/sharded_build.hpp>
#include <mixprec/distributed/sharded_optimizer.hpp>
#include <mixprec/nn/module_patterns.hpp>
#include <mixprec/nn/unit_hooks.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// The units of a model: each unit's path and wrapper, and the unit of each trainable
/// parameter that one holds.
struct UnitPlan {
  std::vector<std::string> paths;
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  std::unordered_map<const void*, std::size_t> unit_of;
};

/// The units `patterns` name in `model` (named_modules() paths, as precision maps and
/// checkpointing match them). Errors, before anything changes: a pattern that matches no
/// module, a module that is not a one-tensor mixprec wrapper, a parameter in two units.
inline UnitPlan plan_units(torch::nn::Module& model, const std::vector<std::string>& patterns) {
  UnitPlan plan;
  if (patterns.empty()) return plan;
  const auto named = model.named_modules("", /*include_self=*/false);
  std::vector<std::string> paths;
  for (const auto& item : named) paths.push_back(item.key());
  const auto decided = decide_paths(patterns, paths, [&](std::size_t i) {
    return "shard_parameters unit pattern '" + patterns[i] + "'";
  });
  for (std::size_t i = 0; i < named.size(); ++i) {
    if (!decided[i]) continue;
    const auto& module = named[i].value();
    MIXPREC_CHECK(dynamic_cast<HookedModule*>(module.get()) != nullptr, "DistributedOptions::"
                  "shard_parameters: unit pattern '", patterns[*decided[i]], "' names module '",
                  paths[i], "' (", module->name(), "), which is not declared as "
                  "mixprec::nn::Checkpointed<M> or mixprec::nn::Mappable<M> with a forward of "
                  "one tensor: LibTorch modules have no forward hooks, so only those wrappers "
                  "can gather a unit's weights before its forward. Declare it so, or narrow the "
                  "pattern; nothing was changed");
    const auto unit = plan.paths.size();
    for (const auto& p : module->named_parameters()) {
      if (!p.value().requires_grad()) continue;
      const auto [it, fresh] = plan.unit_of.emplace(p.value().unsafeGetTensorImpl(), unit);
      MIXPREC_CHECK(fresh || it->second == unit, "DistributedOptions::shard_parameters: "
                    "parameter '", paths[i], ".", p.key(), "' is in units '",
                    plan.paths[it->second], "' and '", paths[i], "' (a tied weight, or nested "
                    "units): each parameter belongs to one unit; choose patterns that do not "
                    "nest, or keep the tied module outside the units");
      check_own_storage(p.value(), paths[i] + "." + p.key());
    }
    plan.paths.push_back(paths[i]);
    plan.modules.push_back(module);
  }
  return plan;
}

/// Before a sharded unit's backward: its weights gathered again. Passes the gradient on.
struct GatherBeforeBackward final : torch::autograd::Node {
  GatherBeforeBackward(torch::autograd::edge_list edges, std::function<void()> gather)
      : torch::autograd::Node(std::move(edges)), gather_(std::move(gather)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    gather_();
    return std::move(grads);
  }
  std::string name() const override { return "mixprec::GatherBeforeBackward"; }

 private:
  std::function<void()> gather_;
};

class ShardedUnits {
 public:
  explicit ShardedUnits(ShardedOptimizer& shards) : core_(std::make_shared<Core>(shards)) {}
  ~ShardedUnits() { detach(); }
  ShardedUnits(const ShardedUnits&) = delete;
  ShardedUnits& operator=(const ShardedUnits&) = delete;

  bool empty() const noexcept { return core_->units.empty(); }

  /// After shard() laid out each unit's parameters as `ranges[u]`: releases their bytes and
  /// hooks the wrappers.
  void take(const UnitPlan& plan, const std::vector<BucketRange>& ranges) {
    auto& core = *core_;
    for (std::size_t u = 0; u < plan.paths.size(); ++u) {
      Unit unit{plan.paths[u], plan.modules[u], ranges[u]};
      core.units.push_back(std::move(unit));
    }
    for (std::size_t u = 0; u < core.units.size(); ++u) {
      core.release(u);
      dynamic_cast<HookedModule&>(*core.units[u].module)
          .set_unit_hooks(std::make_shared<Hooks>(core_, u));
    }
  }

  /// Every unit's weights whole (a checkpoint reads or writes them). Collective.
  void gather_all() {
    for (std::size_t u = 0; u < core_->units.size(); ++u) core_->gather(u);
  }
  /// Every unit's weights released. Collective in that every rank does it alike.
  void release_all() {
    for (std::size_t u = 0; u < core_->units.size(); ++u) core_->release(u);
  }

 private:
  struct Unit {
    std::string path;
    std::shared_ptr<torch::nn::Module> module;
    BucketRange range;
  };

  struct Core {
    explicit Core(ShardedOptimizer& s) : shards(s) {}
    ShardedOptimizer& shards;
    std::vector<Unit> units;

    // Gathers where any of the unit's weights is released (the same on every rank: each
    // forward releases them all, and backward releases each once its gradient is taken).
    void gather(std::size_t u) {
      const auto& unit = units[u];
      const auto& layout = shards.layout();
      bool released = false;
      for (auto b = unit.range.first; b < unit.range.last && !released; ++b) {
        for (const auto i : layout.buckets()[b].slots) {
          released = released || storage_released(layout.slots()[i].param);
        }
      }
      if (!released) return;
      at::NoGradGuard no_grad;
      for (auto b = unit.range.first; b < unit.range.last; ++b) {
        const auto& bucket = layout.buckets()[b];
        const auto full = shards.gather_slices(bucket, layout.common_dtype(bucket),
                                               ShardedOptimizer::model_value);
        for (const auto i : bucket.slots) {
          const auto& slot = layout.slots()[i];
          allocate_storage(slot.param);
          storage_alias(slot.param).view({-1}).copy_(full.narrow(0, slot.offset, slot.param.numel()));
        }
      }
    }
    void release(std::size_t u) {
      const auto& unit = units[u];
      const auto& layout = shards.layout();
      for (auto b = unit.range.first; b < unit.range.last; ++b) {
        for (const auto i : layout.buckets()[b].slots) release_storage(layout.slots()[i].param);
      }
    }
  };

  struct Hooks final : UnitHooks {
    Hooks(const std::shared_ptr<Core>& core, std::size_t unit) : core_(core), unit_(unit) {}
    void before_forward() override {
      if (auto core = core_.lock()) core->gather(unit_);
    }
    at::Tensor after_forward(const at::Tensor& output) override {
      auto core = core_.lock();
      if (!core) return output;
      core->release(unit_);
      if (!output.requires_grad()) return output;
      auto gather = [weak = core_, unit = unit_] {
        if (auto c = weak.lock()) c->gather(unit);
      };
      auto node = make_autograd_node<GatherBeforeBackward>(
          torch::autograd::edge_list{torch::autograd::impl::gradient_edge(output)}, std::move(gather));
      auto alias = output.detach();  // the same data and version counter
      torch::autograd::set_history(alias, node);
      return alias;
    }
    std::weak_ptr<Core> core_;
    std::size_t unit_;
  };

  // The Trainer goes: the hooks come off, and each unit's released weights are held in shards
  // (core/held_shards.hpp) as this rank's pieces in the model's dtype, the parameters' data NaN
  // placeholders: no unit is allocated whole (a forward outside a Trainer gathers a unit for
  // its time, mixprec::unshard() for good). A unit whole now (its forward threw) stays whole.
  void detach() {
    at::NoGradGuard no_grad;
    const auto& layout = core_->shards.layout();
    const auto group = std::make_shared<CollectiveShardGroup>(core_->shards.comm());
    for (auto& unit : core_->units) {
      auto& hooked = dynamic_cast<HookedModule&>(*unit.module);
      hooked.set_unit_hooks(nullptr);
      std::vector<std::shared_ptr<HeldShard>> held;  // until the unit's hooks own them
      for (auto b = unit.range.first; b < unit.range.last; ++b) {
        const auto& bucket = layout.buckets()[b];
        for (const auto i : bucket.slots) {
          const auto& slot = layout.slots()[i];
          const auto& p = slot.param;
          if (!storage_released(p)) continue;
          HeldShard shard;
          shard.group = group;
          shard.cut = ShardCut{slot.offset, bucket.chunk};
          const auto& value = ShardedOptimizer::model_value(slot);
          shard.piece = value.defined()
                            ? value.detach().reshape({-1}).to(p.scalar_type(), false, /*copy=*/true)
                            : at::empty({0}, p.options());
          held.push_back(HeldShards::hold(p, std::move(shard)));
        }
      }
      if (!held.empty()) hook_held_unit(*unit.module, hooked);
    }
  }

  std::shared_ptr<Core> core_;
};

}  // namespace mixprec::detail
