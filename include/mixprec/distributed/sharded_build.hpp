#pragma once
/// A model whose units no rank ever holds whole: built unit by unit under a ShardedBuild, each
/// unit's weights cut into this rank's pieces as soon as the unit is built (the rest freed),
/// then trained by a ZeRO-3 Trainer that takes the pieces as they are:
///
///   auto group = mixprec::gloo_group(mixprec::LaunchEnvironment::from_env());
///   torch::manual_seed(1);          // the same seed on every rank: the same initial weights
///   encoder::Classifier model = nullptr;
///   {
///     mixprec::ShardedBuild build(group);  // each Checkpointed/Mappable built here: a unit
///     model = encoder::Classifier(config, classes);
///   }
///   mixprec::load_weights(*model, "model.safetensors");  // optional: each tensor read, cut
///   torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-4));
///   mixprec::Trainer<mixprec::MixedO2<at::BFloat16>> trainer(model, optimizer,
///       mixprec::TrainerOptions().distributed(
///           mixprec::DistributedOptions(group).shard_parameters({"bert.encoder.layer.*"})));
///
/// A parameter held in shards (core/held_shards.hpp) reads NaN until gathered: a unit's forward
/// outside a Trainer gathers it for its time (evaluation, without gradients; collective), and
/// unshard() / reshard() gather and cut any module's. After a ZeRO-3 Trainer the model's units
/// are held so, in the model's dtype.

#include <mixprec/core/error.hpp>
#include <mixprec/core/held_shards.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/distributed/collectives.hpp>
#include <mixprec/nn/unit_hooks.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mixprec {
namespace detail {

/// The ranks of a process group, as the holders of parameters' pieces.
class CollectiveShardGroup final : public ShardGroup {
 public:
  explicit CollectiveShardGroup(Collectives comm) : comm_(std::move(comm)) {}
  int rank() const noexcept override { return comm_.rank(); }
  int world_size() const noexcept override { return comm_.world_size(); }
  std::vector<at::Tensor> all_gather(const at::Tensor& piece) const override {
    return comm_.all_gather(piece);
  }

 private:
  Collectives comm_;
};

/// A held unit's forward outside a Trainer: its held weights gathered before it and held
/// again after it (their pieces unchanged); parameters that are not held are left alone. It
/// owns its parameters' shards (the registry's references are weak): they go with the model.
class HeldUnitHooks final : public UnitHooks {
 public:
  explicit HeldUnitHooks(std::vector<at::Tensor> params) : params_(std::move(params)) {
    for (const auto& p : params_) {
      if (auto shard = HeldShards::find(p)) shards_.push_back(std::move(shard));
    }
  }

  void before_forward() override {
    std::vector<std::pair<at::Tensor, std::shared_ptr<HeldShard>>> held;
    for (const auto& p : params_) {
      auto shard = HeldShards::find(p);
      if (!shard || shard->whole) continue;
      check_intact(p, *shard, "of a unit");
      // Every rank runs the same forward in the same grad mode: each throws alike, before any
      // gathers.
      MIXPREC_CHECK(!at::GradMode::is_enabled() || !p.requires_grad(), "a unit whose weights "
                    "are held in shards (a parameter of shape ", p.sizes(), ") ran a forward pass "
                    "with gradients outside a Trainer: outside one its weights are gathered for "
                    "evaluation only; run it under torch::NoGradGuard, or train it with a ZeRO-3 "
                    "Trainer (DistributedOptions::shard_parameters naming it)");
      held.emplace_back(p, std::move(shard));
    }
    for (auto& [p, shard] : held) unshard_param(p, *shard);
    gathered_ = std::move(held);
  }
  at::Tensor after_forward(const at::Tensor& output) override {
    for (auto& [p, shard] : gathered_) reshard_param(p, *shard, /*recut=*/false);
    gathered_.clear();
    return output;
  }

 private:
  std::vector<at::Tensor> params_;
  std::vector<std::shared_ptr<HeldShard>> shards_;
  std::vector<std::pair<at::Tensor, std::shared_ptr<HeldShard>>> gathered_;
};

/// Sets HeldUnitHooks on `hooked` (the wrapper `unit`) for its floating-point parameters (their
/// shards held meanwhile by the caller, or by the hooks of the wrappers inside it), and takes
/// those inner hooks off: its own gather their weights.
inline void hook_held_unit(torch::nn::Module& unit, HookedModule& hooked) {
  std::vector<at::Tensor> params;
  for (const auto& p : unique_tensors(unit.parameters())) {
    if (at::isFloatingType(p.scalar_type())) params.push_back(p);
  }
  auto hooks = std::make_shared<HeldUnitHooks>(std::move(params));
  for (const auto& m : unit.modules(/*include_self=*/false)) {
    auto* inner = dynamic_cast<HookedModule*>(m.get());
    if (inner != nullptr && dynamic_cast<HeldUnitHooks*>(inner->unit_hooks().get()) != nullptr) {
      inner->set_unit_hooks(nullptr);
    }
  }
  hooked.set_unit_hooks(std::move(hooks));
}

}  // namespace detail

/// Builds a model's units piece by piece (see the top of this header): while it is alive, each
/// mixprec::nn::Checkpointed or Mappable constructed on this thread, as soon as its module is
/// built, keeps only this rank's piece of each floating-point parameter (an even cut of the
/// flattened tensor, in `dtype` where given: the cast a PureHalf Trainer's model takes first),
/// and the whole tensor is freed: a rank holds at most one unit whole while the model is built.
/// Every rank builds the whole of each unit from the same random stream, so the initial values
/// are those of the model built whole with that seed, at any world size. The parameters keep
/// their identity, names, shapes (a NaN placeholder's data). Units may nest: the outer one is
/// the unit. Parameters outside every wrapper are built whole, as without a ShardedBuild.
class ShardedBuild final : public detail::UnitBuilder {
 public:
  explicit ShardedBuild(c10::intrusive_ptr<ProcessGroup> group,
                        std::optional<c10::ScalarType> dtype = std::nullopt)
      : dtype_(dtype), previous_(detail::UnitBuilder::active()) {
    MIXPREC_CHECK(group, "ShardedBuild: the process group is null");
    MIXPREC_CHECK(!dtype || at::isFloatingType(*dtype), "ShardedBuild: ", *dtype, " is not a "
                  "floating-point dtype");
    group_ = std::make_shared<detail::CollectiveShardGroup>(
        detail::Collectives(std::move(group), at::Device(at::kCPU)));
    detail::UnitBuilder::active() = this;
  }
  ~ShardedBuild() override { detail::UnitBuilder::active() = previous_; }
  ShardedBuild(const ShardedBuild&) = delete;
  ShardedBuild& operator=(const ShardedBuild&) = delete;

  /// The units built so far, and the parameters' elements they hold in shards.
  std::int64_t units() const noexcept { return units_; }
  std::int64_t elements() const noexcept { return elements_; }

 private:
  void built(torch::nn::Module& unit, detail::HookedModule& hooked) override {
    at::NoGradGuard no_grad;
    std::vector<std::shared_ptr<detail::HeldShard>> held;  // until the unit's hooks own them
    for (const auto& p : detail::unique_tensors(unit.parameters())) {
      if (!at::isFloatingType(p.scalar_type()) || detail::HeldShards::is_placeholder(p)) continue;
      const auto value = dtype_ ? p.detach().to(*dtype_) : p.detach();
      held.push_back(detail::HeldShards::hold(p, detail::cut_shard(value, group_)));  // whole freed
      elements_ += p.numel();
    }
    detail::hook_held_unit(unit, hooked);
    ++units_;
  }

  std::shared_ptr<const detail::ShardGroup> group_;
  std::optional<c10::ScalarType> dtype_;
  detail::UnitBuilder* previous_;
  std::int64_t units_ = 0;
  std::int64_t elements_ = 0;
};

/// Whether any parameter of `module` is held in shards now (not gathered).
inline bool holds_shards(const torch::nn::Module& module) {
  for (const auto& p : module.parameters()) {
    if (detail::HeldShards::is_placeholder(p) && detail::HeldShards::find(p)) return true;
  }
  return false;
}

/// Every parameter of `module` held in shards whole on this rank, gathered from every rank's
/// piece, until reshard(module): to read or export it (a unit at a time keeps the memory of a
/// unit), or to load into it. Collective: every rank calls it on the same module.
inline void unshard(torch::nn::Module& module) {
  std::vector<std::pair<at::Tensor, std::shared_ptr<detail::HeldShard>>> held;
  for (const auto& item : detail::unique_named(module.named_parameters())) {
    if (auto shard = detail::HeldShards::find(item.second)) {
      detail::check_intact(item.second, *shard, "'" + item.first + "'");
      held.emplace_back(item.second, std::move(shard));
    }
  }
  for (auto& [p, shard] : held) detail::unshard_param(p, *shard);
}

/// The parameters unshard() gathered held in shards again, each piece cut anew from the
/// parameter's value as it is now (what was loaded or written meanwhile is kept). Local.
inline void reshard(torch::nn::Module& module) {
  for (const auto& p : detail::unique_tensors(module.parameters())) {
    if (auto shard = detail::HeldShards::find(p)) detail::reshard_param(p, *shard, /*recut=*/true);
  }
}

}  // namespace mixprec
