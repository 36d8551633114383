#pragma once
// Owns the consolidated view of sharded optimizer state that checkpoints are written from and
// read into: every laid-out tensor's full fp32 value, every rank's optimizer state gathered into
// an optimizer over full tensors (as an unsharded run would save it), and the inverse, each
// rank taking its slices back. Per slot through the layout, so that a ZeRO-2/3 layout saves and
// loads the same files.

#include <mixprec/distributed/sharded_optimizer.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/optim/sharded_state.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/optimizer.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mixprec::detail {

/// Every laid-out tensor's fp32 value (its master's where the pieces are copies), by the
/// optimizer's groups. Collective.
inline std::vector<std::vector<at::Tensor>> gather_values(const ShardedOptimizer& shards) {
  std::vector<std::vector<at::Tensor>> result(shards.groups().size());
  for (std::size_t g = 0; g < result.size(); ++g) result[g].resize(shards.groups()[g].size());
  const auto& layout = shards.layout();
  at::NoGradGuard no_grad;
  for (const auto& bucket : layout.buckets()) {
    const auto full = shards.gather_slices(bucket, at::kFloat, [](const Slot& slot) { return slot.piece; });
    for (const auto i : bucket.slots) {
      const auto& slot = layout.slots()[i];
      result[slot.group][slot.index] =
          full.narrow(0, slot.offset, slot.param.numel()).view(slot.param.sizes()).clone();
    }
  }
  return result;
}

/// Every laid-out tensor with this rank's piece of it, in the layout's order: what a sharded
/// checkpoint writes and reads.
inline std::vector<ShardSlot> shard_slots(const ShardedOptimizer& shards) {
  std::vector<ShardSlot> result;
  for (const auto& slot : shards.layout().slots()) {
    ShardSlot s;
    s.param = slot.param;
    s.piece = slot.piece;
    s.from = slot.piece_from;
    s.group = slot.group;
    s.index = slot.index;
    s.bucket = slot.bucket;
    s.offset = slot.offset;
    s.copy = slot.copy;
    s.unit = slot.unit;
    s.master = slot.copy && slot.piece.defined() && slot.piece.scalar_type() == at::kFloat &&
               slot.param.scalar_type() != at::kFloat;
    result.push_back(std::move(s));
  }
  return result;
}

/// Bucket `b`'s fp32 values from every rank's pieces (a master's value, a lean one's made from
/// what is kept), flat and padded. Collective.
inline at::Tensor gather_fp32(const ShardedOptimizer& shards, std::size_t b) {
  const auto& layout = shards.layout();
  const auto& bucket = layout.buckets().at(b);
  at::NoGradGuard no_grad;
  return shards.gather_slices(bucket, at::kFloat, [&](const Slot& slot) {
    return shards.piece_value(static_cast<std::size_t>(&slot - layout.slots().data()));
  });
}

/// `full`, an optimizer of the user's type whose groups hold one full tensor per
/// ShardedOptimizer::groups() entry, gets every rank's state of its pieces and the param groups'
/// options. Collective.
inline void gather_state(ShardedOptimizer& shards, torch::optim::Optimizer& full) {
  const auto& slots = shards.layout().slots();
  auto& sharded = shards.optimizer();
  const auto kind = *sharded_kind(full);
  // Per slot: whether its pieces have state, its step, which fields are set (equal on every
  // rank that holds a piece of it; 0 on the others).
  auto meta = at::zeros({static_cast<std::int64_t>(slots.size()), 3}, at::kLong);
  auto* m = meta.data_ptr<std::int64_t>();
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const auto& piece = slots[i].piece;
    auto* state = piece.defined() ? state_of(sharded, piece) : nullptr;
    if (state == nullptr) continue;
    m[3 * i] = 1;
    m[3 * i + 1] = state_step(*state, kind);
    const auto fields = state_fields(*state, kind);
    for (std::size_t k = 0; k < fields.size(); ++k) {
      if (fields[k] != nullptr && fields[k]->defined()) m[3 * i + 2] |= std::int64_t{1} << k;
    }
  }
  auto combined = meta.clone();
  for (const auto& other : shards.comm().all_gather(meta.to(shards.comm().device()))) {
    combined = at::maximum(combined, other.cpu());
  }
  const auto* c = combined.data_ptr<std::int64_t>();
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (c[3 * i] == 0) continue;
    const auto& slot = slots[i];
    set_state(full, full.param_groups()[slot.group].params()[slot.index],
              new_state(kind, c[3 * i + 1]));
  }
  for (std::size_t k = 0; k < kShardedFields; ++k) {
    for (const auto& bucket : shards.layout().buckets()) {
      bool any = false;
      for (const auto i : bucket.slots) any = any || ((c[3 * i + 2] >> k) & 1) != 0;
      if (!any) continue;
      const auto values = shards.gather_slices(bucket, at::kFloat, [&](const Slot& slot) {
        auto* state = slot.piece.defined() ? state_of(sharded, slot.piece) : nullptr;
        if (state == nullptr) return at::Tensor();
        auto* field = state_fields(*state, kind)[k];
        return field != nullptr && field->defined() ? *field : at::Tensor();
      });
      for (const auto i : bucket.slots) {
        if (((c[3 * i + 2] >> k) & 1) == 0) continue;
        const auto& slot = slots[i];
        const auto& target = full.param_groups()[slot.group].params()[slot.index];
        *state_fields(*state_of(full, target), kind)[k] =
            values.narrow(0, slot.offset, slot.param.numel()).view(target.sizes()).to(target.scalar_type(), false, true);
      }
    }
  }
  copy_group_options(sharded, full);
}

/// After `full` (as in gather_state) was loaded: this rank's pieces get their slices of its
/// tensors (the copies; the views see the model's) and of its state, the sharded optimizer its
/// param groups' options.
inline void scatter_state(ShardedOptimizer& shards, torch::optim::Optimizer& full) {
  auto& sharded = shards.optimizer();
  const auto kind = *sharded_kind(full);
  at::NoGradGuard no_grad;
  auto& states = sharded.state();
  states.clear();
  for (const auto& slot : shards.layout().slots()) {
    if (!slot.piece.defined()) continue;
    const auto& source = full.param_groups()[slot.group].params()[slot.index];
    const auto slice = [&](const at::Tensor& t) {
      return t.reshape({-1}).narrow(0, slot.piece_from, slot.piece.numel());
    };
    if (slot.copy) slot.piece.copy_(slice(source));
    auto* loaded = state_of(full, source);
    if (loaded == nullptr) continue;
    auto state = new_state(kind, state_step(*loaded, kind));
    const auto from = state_fields(*loaded, kind);
    const auto to = state_fields(*state, kind);
    for (std::size_t k = 0; k < kShardedFields; ++k) {
      if (from[k] != nullptr && from[k]->defined()) {
        *to[k] = slice(*from[k]).to(slot.piece.scalar_type(), false, true);
      }
    }
    set_state(sharded, slot.piece, std::move(state));
  }
  copy_group_options(full, sharded);
}

}  // namespace mixprec::detail
