#pragma once
// Owns the consolidated view of sharded optimizer state that checkpoints are written from and
// read into: every laid-out tensor's full fp32 value, every rank's optimizer state gathered into
// an optimizer over full tensors (as an unsharded run would save it), and the inverse, each
// rank taking its slices back. Per slot through the layout, so that a ZeRO-2/3 layout saves and
// loads the same files. Moments in a block format move as their rows: a piece's rows are the
// rows of its blocks in the whole tensor (the layout puts its slices on block boundaries).

#include <mixprec/distributed/sharded_optimizer.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/optim/block_quantize.hpp>
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

/// Whether slot `i`'s moments are rows of `coding`'s block format (its whole tensor quantized).
inline bool rows_of(const Slot& slot, MomentCoding coding) {
  return coding.quantized() && quantizes(slot.param.numel(), coding.block);
}

/// The rows of a bucket's slots whose moments are rows, from every rank's pieces, in the
/// bucket's order of blocks: rank r fills the blocks of its slice. Collective.
template <class Part>
at::Tensor gather_rows(const ShardedOptimizer& shards, const Bucket& bucket, MomentCoding coding,
                       Part&& part) {
  const auto& layout = shards.layout();
  const auto& comm = shards.comm();
  const auto width = row_bytes(coding.format, coding.block);
  auto mine = at::zeros({bucket.chunk / coding.block, width},
                        at::TensorOptions(at::kByte).device(comm.device()));
  for (const auto i : bucket.slots) {
    const auto& slot = layout.slots()[i];
    if (!slot.piece.defined() || !rows_of(slot, coding)) continue;
    const auto value = part(slot);
    if (!value.defined()) continue;
    mine.narrow(0, layout.in_slice(i, comm.rank()) / coding.block, value.size(0)).copy_(value);
  }
  return at::cat(comm.all_gather(mine));
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
  const auto coding = shards.moments();
  for (std::size_t k = 0; k < kShardedFields; ++k) {
    for (const auto& bucket : shards.layout().buckets()) {
      bool plain = false, rows = false;
      for (const auto i : bucket.slots) {
        if (((c[3 * i + 2] >> k) & 1) == 0) continue;
        (rows_of(slots[i], coding) ? rows : plain) = true;
      }
      const auto field_of = [&](const Slot& slot) {
        auto* state = slot.piece.defined() ? state_of(sharded, slot.piece) : nullptr;
        if (state == nullptr) return at::Tensor();
        auto* field = state_fields(*state, kind)[k];
        return field != nullptr && field->defined() ? *field : at::Tensor();
      };
      at::Tensor values, coded;
      if (plain) {
        values = shards.gather_slices(bucket, at::kFloat, [&](const Slot& slot) {
          return rows_of(slot, coding) ? at::Tensor() : field_of(slot);
        });
      }
      if (rows) coded = gather_rows(shards, bucket, coding, field_of).cpu();
      for (const auto i : bucket.slots) {
        if (((c[3 * i + 2] >> k) & 1) == 0) continue;
        const auto& slot = slots[i];
        const auto& target = full.param_groups()[slot.group].params()[slot.index];
        auto& field = *state_fields(*state_of(full, target), kind)[k];
        if (rows_of(slot, coding)) {
          field = coded.narrow(0, slot.offset / coding.block, slot.param.numel() / coding.block)
                      .to(target.device(), false, true);
        } else {
          field = values.narrow(0, slot.offset, slot.param.numel()).view(target.sizes())
                      .to(target.scalar_type(), false, true);
        }
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
  const auto coding = shards.moments();
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
      if (from[k] == nullptr || !from[k]->defined()) continue;
      if (from[k]->scalar_type() == at::kByte) {  // rows (recode_moments made them P's)
        *to[k] = from[k]->narrow(0, slot.piece_from / coding.block, slot.piece.numel() / coding.block)
                     .to(slot.piece.device(), false, true);
      } else {
        *to[k] = slice(*from[k]).to(slot.piece.scalar_type(), false, true);
      }
    }
    set_state(sharded, slot.piece, std::move(state));
  }
  copy_group_options(full, sharded);
}

}  // namespace mixprec::detail
