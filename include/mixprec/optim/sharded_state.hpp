#pragma once
// The optimizers whose state can be sharded (DistributedOptions::shard_optimizer_state): those
// that update each element from that element alone (Adam, AdamW, SGD), so that a slice of a
// tensor steps as the whole tensor would. Their state's tensors, read and written field by
// field, and an optimizer of the same type over other tensors (the consolidated view that
// checkpoints are written from and read into).

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/tensor_set.hpp>

#include <ATen/ATen.h>
#include <c10/util/Type.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace mixprec::detail {

enum class ShardedKind { adam, adamw, sgd };

/// The kind of `optimizer`, or nullopt where its state cannot be sharded.
inline std::optional<ShardedKind> sharded_kind(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return ShardedKind::adamw;
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return ShardedKind::adam;
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return ShardedKind::sgd;
  return std::nullopt;
}

/// An Error naming `optimizer` unless its state can be sharded.
inline void check_shardable(const torch::optim::Optimizer& optimizer) {
  MIXPREC_CHECK(sharded_kind(optimizer).has_value(), "DistributedOptions::shard_optimizer_state "
                "supports torch::optim::Adam, AdamW and SGD, whose update of an element reads "
                "that element alone; this optimizer is a ", c10::demangle(typeid(optimizer).name()),
                ": use one of those, or train without shard_optimizer_state");
}

/// Adam/AdamW: exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad); SGD: momentum_buffer.
inline constexpr std::size_t kShardedFields = 3;

/// The state tensors of one parameter, in field order (an undefined tensor: the field is unset).
inline std::array<at::Tensor*, kShardedFields> state_fields(torch::optim::OptimizerParamState& s,
                                                            ShardedKind kind) {
  switch (kind) {
    case ShardedKind::adam: {
      auto& a = static_cast<torch::optim::AdamParamState&>(s);
      return {&a.exp_avg(), &a.exp_avg_sq(), &a.max_exp_avg_sq()};
    }
    case ShardedKind::adamw: {
      auto& a = static_cast<torch::optim::AdamWParamState&>(s);
      return {&a.exp_avg(), &a.exp_avg_sq(), &a.max_exp_avg_sq()};
    }
    case ShardedKind::sgd:
      return {&static_cast<torch::optim::SGDParamState&>(s).momentum_buffer(), nullptr, nullptr};
  }
  return {nullptr, nullptr, nullptr};
}

/// Adam's and AdamW's step count; 0 for SGD, which keeps none.
inline std::int64_t state_step(const torch::optim::OptimizerParamState& s, ShardedKind kind) {
  if (kind == ShardedKind::adam) return static_cast<const torch::optim::AdamParamState&>(s).step();
  if (kind == ShardedKind::adamw) return static_cast<const torch::optim::AdamWParamState&>(s).step();
  return 0;
}

inline std::unique_ptr<torch::optim::OptimizerParamState> new_state(ShardedKind kind,
                                                                    std::int64_t step) {
  switch (kind) {
    case ShardedKind::adam: {
      auto s = std::make_unique<torch::optim::AdamParamState>();
      s->step(step);
      return s;
    }
    case ShardedKind::adamw: {
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(step);
      return s;
    }
    case ShardedKind::sgd: return std::make_unique<torch::optim::SGDParamState>();
  }
  return nullptr;
}

/// The state of `p` in `optimizer`, or null.
inline torch::optim::OptimizerParamState* state_of(torch::optim::Optimizer& optimizer,
                                                   const at::Tensor& p) {
  auto& states = optimizer.state();
  const auto it = states.find(state_key<std::decay_t<decltype(states)>>(p));
  return it == states.end() ? nullptr : it->second.get();
}

/// Sets the state of `p` in `optimizer`.
inline void set_state(torch::optim::Optimizer& optimizer, const at::Tensor& p,
                      std::unique_ptr<torch::optim::OptimizerParamState> state) {
  auto& states = optimizer.state();
  states[state_key<std::decay_t<decltype(states)>>(p)] = std::move(state);
}

/// An optimizer of the same type as `like`, over `groups` (each group's options cloned from the
/// group of the same index of `like`); it never steps.
inline std::unique_ptr<torch::optim::Optimizer> optimizer_like(
    const torch::optim::Optimizer& like, const std::vector<std::vector<at::Tensor>>& groups) {
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    param_groups.emplace_back(groups[g], like.param_groups()[g].options().clone());
  }
  switch (*sharded_kind(like)) {
    case ShardedKind::adam: return std::make_unique<torch::optim::Adam>(param_groups);
    case ShardedKind::adamw: return std::make_unique<torch::optim::AdamW>(param_groups);
    case ShardedKind::sgd:
      return std::make_unique<torch::optim::SGD>(param_groups, torch::optim::SGDOptions(0.0));
  }
  return nullptr;
}

/// Each param group's options of `from` into the group of the same index of `to`.
inline void copy_group_options(const torch::optim::Optimizer& from, torch::optim::Optimizer& to) {
  for (std::size_t g = 0; g < from.param_groups().size(); ++g) {
    to.param_groups()[g].set_options(from.param_groups()[g].options().clone());
  }
}

}  // namespace mixprec::detail
