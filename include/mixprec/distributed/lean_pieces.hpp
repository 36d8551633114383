#pragma once
// Owns a lean storage (core/state_storage.hpp: RemainderMasters, StochasticRounding) of the
// sharded optimizer's pieces: between steps a piece that is a master of a bf16 tensor holds no
// data (LeanMasters' NaN placeholder), and what stays of it is its bf16 value (`Slot::low`: a
// view of the model's tensor, or for a ZeRO-3 unit's, whose model tensor is released, a tensor
// of its own) and, under RemainderMasters, its 16-bit remainder. Each piece's stochastic
// rounding takes the bits its elements get in the whole tensor unsharded, so that sharded
// training rounds as unsharded data parallel does, bit for bit, at any world size.

#include <mixprec/core/state_storage.hpp>
#include <mixprec/distributed/bucket_layout.hpp>
#include <mixprec/optim/lean_masters.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

namespace mixprec::detail {

class LeanPieces {
 public:
  explicit LeanPieces(MasterStorage storage) : lean_(storage) {}

  /// Takes slot `i` of `layout`, whose piece is a fresh fp32 copy (a master) of a bf16 tensor,
  /// as tensor `tensor` of the lean numbering (the optimizer's order, as MasterWeights numbers
  /// them): its bf16 value goes to `slot.low`, then the piece is stowed.
  void add(BucketLayout& layout, std::size_t i, std::uint64_t tensor) {
    auto& slot = layout.slots()[i];
    at::NoGradGuard no_grad;
    const auto n = slot.piece.numel();
    slot.low = slot.unit ? slot.piece.to(at::kBFloat16)  // its own: the unit's is released
                         : slot.param.detach().view({-1}).narrow(0, slot.piece_from, n);
    index_of_.emplace(slot.piece.unsafeGetTensorImpl(), slots_.size());
    slots_.push_back(i);
    lean_.add(slot.low, slot.piece, tensor, slot.piece_from, slot.param.numel());
  }

  /// A piece's bf16 value and what is kept of it, for the one-pass step (lean_adam_step), which
  /// updates them in place without inflating; nullopt for a tensor that is no lean piece.
  std::optional<LeanTarget> target(const BucketLayout& layout, const at::Tensor& piece) {
    const auto it = index_of_.find(piece.unsafeGetTensorImpl());
    if (it == index_of_.end()) return std::nullopt;
    return LeanTarget{layout.slots()[slots_[it->second]].low, lean_.in_place(it->second)};
  }

  bool empty() const noexcept { return slots_.empty(); }

  /// Slot `i`'s fp32 value (a new tensor unless the piece holds it now); undefined for a slot
  /// that is no lean piece.
  at::Tensor value(const BucketLayout& layout, std::size_t i) const {
    const auto& slot = layout.slots()[i];
    const auto it = slot.piece.defined() ? index_of_.find(slot.piece.unsafeGetTensorImpl())
                                         : index_of_.end();
    if (it == index_of_.end()) return at::Tensor();
    return lean_.inflated(it->second) ? slot.piece : lean_.value(it->second, slot.low);
  }

  /// Slot `i`'s piece takes `value` (fp32, flat, a tensor of its own), then is stowed as after a
  /// load; false for a slot that is no lean piece.
  bool assign(BucketLayout& layout, std::size_t i, const at::Tensor& value) {
    auto& slot = layout.slots()[i];
    const auto it = slot.piece.defined() ? index_of_.find(slot.piece.unsafeGetTensorImpl())
                                         : index_of_.end();
    if (it == index_of_.end()) return false;
    at::NoGradGuard no_grad;
    lean_.inflate_with(it->second, slot.piece, value);
    if (lean_.storage() == MasterStorage::stochastic) slot.low.copy_(value.reshape({-1}));
    lean_.stow_one(it->second, slot.low, slot.piece, /*stepped=*/false);
    return true;
  }

  /// Every piece's fp32 value, for a step or a checkpoint.
  void inflate(BucketLayout& layout) {
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      auto& slot = layout.slots()[slots_[k]];
      lean_.inflate(k, slot.low, slot.piece);
    }
  }

  /// After a step taken (`stepped`: rounded stochastically, and the next step rounds with other
  /// bits) or a load: the pieces' values into their bf16 values and remainders, their fp32 data
  /// dropped. A load's values are bf16 values already under StochasticRounding.
  void stow(BucketLayout& layout, bool stepped) {
    at::NoGradGuard no_grad;
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      auto& slot = layout.slots()[slots_[k]];
      if (!lean_.inflated(k)) continue;
      if (!stepped && lean_.storage() == MasterStorage::stochastic) {
        slot.low.copy_(slot.piece.reshape({-1}));
      }
      lean_.stow_one(k, slot.low, slot.piece, stepped);
    }
    if (stepped) lean_.finish_round();
  }

  /// Drops the pieces' fp32 data unwritten (a step skipped or failed, a checkpoint written).
  void release(BucketLayout& layout) noexcept {
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      if (lean_.inflated(k)) lean_.release_one(k, layout.slots()[slots_[k]].piece);
    }
  }

  /// The rounding's seed and count (checkpoints carry them).
  LeanMasters& rounding() noexcept { return lean_; }

  /// Bytes kept between steps beyond the model's tensors: the units' bf16 pieces, the
  /// remainders and their tie lists.
  std::int64_t kept_bytes(const BucketLayout& layout) const {
    return lean_.stowed_bytes() + unit_bytes(layout);
  }
  /// The units' bf16 pieces alone (ZeRO-3: the weights each rank keeps of them).
  std::int64_t unit_bytes(const BucketLayout& layout) const {
    std::int64_t bytes = 0;
    for (const auto i : slots_) {
      const auto& slot = layout.slots()[i];
      if (slot.unit) bytes += slot.low.numel() * 2;
    }
    return bytes;
  }

 private:
  LeanMasters lean_;
  std::vector<std::size_t> slots_;  // of the layout, in the order added
  std::unordered_map<const void*, std::size_t> index_of_;  // each piece's place in slots_
};

}  // namespace mixprec::detail
