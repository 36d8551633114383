#pragma once
// Owns where each trained tensor lives in data parallel's flat buffers: its slot (its bucket and
// offset there, in DDP's reverse order under the size caps), and, once the buckets are sliced,
// which slice of each bucket is each rank's and which part of each tensor falls in this rank's
// (its piece). Nothing here communicates or holds a buffer: the gradient reducer keeps the
// buffers this layout describes, the sharding room the pieces.
//
// One layout serves buckets, slices and units. Each lay_out call appends its tensors as a
// BucketRange: ZeRO-1 lays out the optimizer's tensors so, one range per batch of param groups;
// ZeRO-2 reduce-scatters each bucket into this rank's slice (slice_of says where each piece's
// gradient lands); ZeRO-3 lays out one range per unit (a wrapped module), and gathers and frees a
// unit's range around its forward and backward.
//
// Under a block format of Adam's moments (Moments8bit, ...: optim/block_quantize.hpp), a tensor
// torchao would quantize starts at a multiple of the block in its bucket, and the bucket's
// slices are whole blocks: each rank's piece of it is whole blocks of the tensor, which it codes
// alone, as the unsharded run codes them. The gaps are zeros in the buckets' buffers.

#include <mixprec/optim/block_quantize.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// One trained tensor's place.
struct Slot {
  at::Tensor param;   // the tensor whose gradient is reduced
  at::Tensor holder;  // where the average goes: param, or another tensor (its fp32 master)
  std::size_t bucket;
  std::int64_t offset;  // in its bucket
  // Sliced buckets (the sharding room fills these in): this rank's piece of the tensor
  // (undefined: none), the optimizer's tensor in its place; where it starts in the flattened
  // tensor; whether it is an fp32 copy (a master) or a view of the model's tensor; its place in
  // the optimizer's param groups.
  at::Tensor piece = {};
  std::int64_t piece_from = 0;
  bool copy = false;
  bool unit = false;  // its bytes are released between uses (a ZeRO-3 unit's)
  // Under a lean storage (lean_pieces.hpp), a piece that is a master holds data only for a step
  // or a checkpoint; between them its bf16 value is here (undefined: the piece is its value).
  at::Tensor low = {};
  std::size_t group = 0;
  std::size_t index = 0;
};

/// Consecutive slots, reduced by one collective.
struct Bucket {
  std::vector<std::size_t> slots;
  std::int64_t numel = 0;
  std::int64_t padded = 0;  // numel; sliced: rounded up to world * chunk
  std::int64_t chunk = 0;   // sliced: each rank's slice
  std::int64_t block = 1;   // what its slices must be a multiple of (a block format's block)
  bool gaps = false;        // a slot starts past the end of the one before (block-aligned)
};

/// The buckets [first, last) that one lay_out call appended.
struct BucketRange {
  std::size_t first = 0;
  std::size_t last = 0;
};

/// Bucket sizes in bytes of the reduced dtype (DistributedOptions' caps).
struct BucketCaps {
  double first_bytes = 0;  // the layout's first bucket
  double bytes = 0;        // every other
  std::size_t element = 4;
};

class BucketLayout {
 public:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  std::vector<Slot>& slots() noexcept { return slots_; }
  const std::vector<Slot>& slots() const noexcept { return slots_; }
  std::vector<Bucket>& buckets() noexcept { return buckets_; }
  const std::vector<Bucket>& buckets() const noexcept { return buckets_; }
  BucketRange all() const noexcept { return {0, buckets_.size()}; }

  /// Slots for `params` (their `holders` receive the averages when not sliced), in new buckets
  /// after the existing ones; reverse order: the backward pass produces the last layers'
  /// gradients first. `block`: a block format's, whose quantized tensors start at a multiple of
  /// it (0: none).
  BucketRange lay_out(const std::vector<at::Tensor>& params,
                      const std::vector<at::Tensor>& holders, const BucketCaps& caps,
                      std::int64_t block = 0) {
    const auto element = static_cast<double>(caps.element);
    double limit = buckets_.empty() ? caps.first_bytes : caps.bytes;
    double bytes = 0;
    const BucketRange range{buckets_.size(), buckets_.size()};
    for (std::size_t k = params.size(); k-- > 0;) {
      const double size = static_cast<double>(params[k].numel()) * element;
      if (buckets_.size() == range.first || (bytes > 0 && bytes + size > limit)) {
        if (buckets_.size() > range.first) limit = caps.bytes;
        buckets_.emplace_back();
        bytes = 0;
      }
      auto& bucket = buckets_.back();
      auto offset = bucket.numel;
      if (quantizes(params[k].numel(), block)) {
        offset = (offset + block - 1) / block * block;
        bucket.gaps = bucket.gaps || offset != bucket.numel;
        bucket.block = block;
      }
      slots_.push_back({params[k], holders[k], buckets_.size() - 1, offset});
      slot_of_[params[k].unsafeGetTensorImpl()] = slots_.size() - 1;
      bucket.slots.push_back(slots_.size() - 1);
      bucket.numel = offset + params[k].numel();
      bytes += size;
    }
    for (auto b = range.first; b < buckets_.size(); ++b) buckets_[b].padded = buckets_[b].numel;
    return {range.first, buckets_.size()};
  }

  /// Splits each bucket of `range` into `world` equal slices (the last padded), each whole
  /// blocks where the bucket holds a quantized tensor.
  void slice(const BucketRange& range, int world) {
    for (auto b = range.first; b < range.last; ++b) {
      auto& bucket = buckets_[b];
      const auto chunk = (bucket.numel + world - 1) / world;
      bucket.chunk = (chunk + bucket.block - 1) / bucket.block * bucket.block;
      bucket.padded = bucket.chunk * world;
    }
  }

  /// The part [from, to) of slot `i`'s flattened tensor that lies in `rank`'s slice of its
  /// bucket; empty (from >= to) where none does.
  std::pair<std::int64_t, std::int64_t> slice_of(std::size_t i, int rank) const {
    const auto& slot = slots_[i];
    const auto& bucket = buckets_[slot.bucket];
    const auto lo = bucket.chunk * rank, hi = lo + bucket.chunk;
    return {std::max(lo, slot.offset) - slot.offset,
            std::min(hi, slot.offset + slot.param.numel()) - slot.offset};
  }

  /// Where slot `i`'s piece starts in its bucket's slice of `rank`.
  std::int64_t in_slice(std::size_t i, int rank) const {
    const auto& slot = slots_[i];
    return slot.offset + slot.piece_from - buckets_[slot.bucket].chunk * rank;
  }

  /// The slot of `param`, or npos.
  std::size_t find(const at::Tensor& param) const {
    const auto it = slot_of_.find(param.unsafeGetTensorImpl());
    return it == slot_of_.end() ? npos : it->second;
  }

  /// The model's dtype where every tensor of the bucket has it, else fp32.
  c10::ScalarType common_dtype(const Bucket& bucket) const {
    const auto dtype = slots_[bucket.slots.front()].param.scalar_type();
    for (const auto i : bucket.slots) {
      if (slots_[i].param.scalar_type() != dtype) return at::kFloat;
    }
    return dtype;
  }

  void clear() {
    slots_.clear();
    buckets_.clear();
    slot_of_.clear();
  }

 private:
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  std::unordered_map<const void*, std::size_t> slot_of_;
};

}  // namespace mixprec::detail
