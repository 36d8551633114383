#pragma once
// Owns ZeRO-1 (DistributedOptions::shard_optimizer_state): the optimizer's tensors laid out in
// buckets and sliced across the ranks (bucket_layout.hpp), each replaced in the optimizer by
// this rank's piece of it (an fp32 master, or a view of the model's tensor), so that the
// optimizer keeps and steps 1/world_size of the state; after a step, every rank's updated
// pieces gathered into every rank's model; the clipping norm's parts summed over the shards.
// The gradient reducer puts each piece's averaged gradient in place; sharded_checkpoint.hpp
// reads and writes the consolidated state through gather_slices.
//
// ZeRO-3 extends this room: its units are BucketRanges whose pieces are the parameters' only
// storage; gather_into_model(range) before a unit's forward and again for its backward, the
// model's full tensors freed after each. Under a lean storage its masters are LeanPieces.

#include <mixprec/distributed/agreement.hpp>
#include <mixprec/distributed/bucket_layout.hpp>
#include <mixprec/distributed/collectives.hpp>
#include <mixprec/distributed/gradient_reducer.hpp>
#include <mixprec/distributed/lean_pieces.hpp>
#include <mixprec/optim/lean_moments.hpp>
#include <mixprec/optim/sharded_state.hpp>
#include <mixprec/core/held_shards.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/optimizer.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec::detail {

class ShardedOptimizer {
 public:
  ShardedOptimizer(const Collectives& comm, GradientReducer& reducer)
      : comm_(comm), reducer_(reducer) {}
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  /// Lays out the optimizer's tensors listed in `fresh` (model tensors, each with its fp32
  /// value from before the model's cast, needed where `copies` and the tensor is not fp32) in
  /// new buckets after the existing ones, each bucket split into world_size equal slices, and
  /// replaces each of them in the optimizer by this rank's piece of it: an fp32 copy (a master
  /// weight) where `copies` and the tensor is not fp32, a view of it otherwise; a tensor with no
  /// element in this rank's slices leaves the optimizer. Every other tensor the optimizer holds
  /// must be a piece already. Collective; the reducer's bind() hooks the gradients next.
  /// `unit_of` (ZeRO-3): the unit of each tensor that is in one, of `unit_count`; returns each
  /// unit's buckets, its tensors' pieces are always copies (fp32 where `copies`, else in the
  /// tensor's dtype). `storage`: a lean one keeps the copies of bf16 tensors as LeanPieces.
  /// `held`: units' tensors held in shards (held_params.hpp), whose values are their pieces,
  /// gathered one tensor at a time (or taken as they are where cut as here), in their dtype
  /// from before the Trainer's cast.
  std::vector<BucketRange> shard(torch::optim::Optimizer& optimizer,
                                 const std::vector<std::pair<at::Tensor, at::Tensor>>& fresh,
                                 bool copies, PieceStorage storage = {},
                                 const std::unordered_map<const void*, std::size_t>* unit_of = nullptr,
                                 std::size_t unit_count = 0, const HeldByParam* held = nullptr) {
    static const std::unordered_map<const void*, std::size_t> no_units;
    const auto& in_unit = unit_of != nullptr ? *unit_of : no_units;
    auto& layout = reducer_.layout();
    MIXPREC_CHECK(reducer_.sharded(), "DataParallel::shard() needs DistributedOptions::shard_optimizer_state");
    check_shardable(optimizer);
    MIXPREC_CHECK(optimizer_ == nullptr || optimizer_ == &optimizer, "DataParallel::shard(): "
                  "the optimizer is not the one sharded before");
    std::unordered_map<const void*, std::size_t> fresh_index;
    std::int64_t total = 0;
    for (std::size_t i = 0; i < fresh.size(); ++i) {
      const auto& t = fresh[i].first;
      fresh_index.emplace(t.unsafeGetTensorImpl(), i);
      MIXPREC_CHECK(t.is_contiguous() || HeldShards::is_placeholder(t), "shard_optimizer_state: "
                    "a parameter of shape ", t.sizes(), " is not contiguous; make it so before "
                    "building the Trainer");
      MIXPREC_CHECK(layout.find(t) == BucketLayout::npos, "a param group added to the "
                    "optimizer holds a model tensor of shape ", t.sizes(), " that it already "
                    "trains (sharded, in an earlier group): put each tensor in one group");
      MIXPREC_CHECK(!copies || t.scalar_type() == at::kFloat || fresh[i].second.defined(),
                    "DataParallel::shard(): no fp32 value for a ", t.scalar_type(), " tensor");
      total += t.numel();
    }
    // In the optimizer's order, grouped as it groups them (what an unsharded optimizer holds).
    std::vector<std::vector<std::size_t>> order(optimizer.param_groups().size());
    std::vector<std::size_t> group_of(fresh.size(), order.size());
    for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
      for (const auto& p : unique_tensors(optimizer.param_groups()[g].params())) {
        const void* id = p.unsafeGetTensorImpl();
        if (piece_slot_.count(id) == 1) continue;
        const auto it = fresh_index.find(id);
        MIXPREC_CHECK(it != fresh_index.end(), "the optimizer holds a tensor of shape ",
                      p.sizes(), " that is not a parameter of the model: build it on "
                      "model->parameters()");
        MIXPREC_CHECK(group_of[it->second] == order.size(), "a tensor of shape ", p.sizes(),
                      " is in param groups ", group_of[it->second], " and ", g, " of the "
                      "optimizer (PyTorch refuses this too): put each tensor in one group");
        group_of[it->second] = g;
        order[g].push_back(it->second);
      }
    }
    MIXPREC_CHECK(all_equal(comm_, static_cast<std::int64_t>(fresh.size()), total), "rank ",
                  comm_.rank(), ": the ranks' optimizers hold different tensors (", fresh.size(),
                  " tensors, ", total, " elements here): build the same optimizer on every rank");
    // All checks passed.
    reducer_.unbind();
    optimizer_ = &optimizer;
    groups_.resize(order.size());
    // Each unit's tensors in buckets of their own (the last unit's first: its gradients come
    // first), then the others; each in the optimizer's order.
    const auto units = in_unit.empty() ? std::size_t{0} : unit_count;
    std::vector<std::vector<at::Tensor>> by_unit(units + 1);
    std::unordered_map<const void*, std::pair<std::size_t, std::size_t>> places;
    for (std::size_t g = 0; g < order.size(); ++g) {
      for (const auto i : order[g]) {
        const auto& t = fresh[i].first;
        const auto found = in_unit.find(t.unsafeGetTensorImpl());
        by_unit[found != in_unit.end() ? found->second : units].push_back(t);
        places.emplace(t.unsafeGetTensorImpl(), std::make_pair(g, groups_[g].size()));
        groups_[g].push_back(t);
      }
    }
    const auto first_bucket = layout.buckets().size();
    std::vector<BucketRange> ranges(units);
    // Buckets launch in order: the tensors outside the units (an encoder's embeddings, whose
    // gradient comes last) must not come first, or no unit's bucket is reduced, and freed,
    // before the backward pass ends.
    for (std::size_t n = 0; n <= units; ++n) {
      const auto k = n < units ? units - 1 - n : units;
      const auto range = reducer_.lay_out(by_unit[k], by_unit[k], /*allocate=*/false,
                                          storage.moments.block);
      layout.slice(range, comm_.world_size());
      if (k < units) ranges[k] = range;
    }
    at::NoGradGuard no_grad;
    for (auto b = first_bucket; b < layout.buckets().size(); ++b) {
      for (const auto i : layout.buckets()[b].slots) {
        auto& slot = layout.slots()[i];
        std::tie(slot.group, slot.index) = places.at(slot.param.unsafeGetTensorImpl());
        slot.unit = in_unit.count(slot.param.unsafeGetTensorImpl()) == 1;
        const auto [from, to] = layout.slice_of(i, comm_.rank());
        // Held in shards: its whole value, one tensor at a time on every rank (collective),
        // unless this rank's piece is cut as here already (then on every rank).
        at::Tensor held_value;
        bool held_piece = false;
        if (held != nullptr) {
          if (const auto it = held->find(slot.param.unsafeGetTensorImpl()); it != held->end()) {
            const auto& shard = *it->second;
            held_piece = shard.cut == ShardCut{slot.offset, layout.buckets()[b].chunk} &&
                         shard.group->world_size() == comm_.world_size() &&
                         shard.group->rank() == comm_.rank();
            held_value = held_piece ? shard.piece : gather_shard(shard, slot.param.sizes());
            it->second->piece = at::Tensor();  // consumed: the pieces are never held twice
          }
        }
        if (from >= to) continue;
        slot.piece_from = from;
        const auto& fp32 = fresh[fresh_index.at(slot.param.unsafeGetTensorImpl())].second;
        // A unit's weights are released between uses: its pieces are the only copy, fp32 where
        // they are masters, else in the model's dtype (PureHalf steps its bf16 weights as they
        // are, sharded or not).
        slot.copy = slot.unit || (copies && slot.param.scalar_type() != at::kFloat);
        const auto& value = held_value.defined() ? held_value : fp32.defined() ? fp32 : slot.param;
        const auto dtype = copies ? at::kFloat : slot.param.scalar_type();
        slot.piece = held_piece  ? value.to(dtype, false, /*copy=*/true)
                     : slot.copy ? value.detach().to(dtype).reshape({-1}).narrow(0, from, to - from).clone()
                                 : slot.param.detach().view({-1}).narrow(0, from, to - from);
        piece_slot_[slot.piece.unsafeGetTensorImpl()] = i;
      }
    }
    // The masters of bf16 tensors, numbered as MasterWeights numbers them (the optimizer's
    // order, on every rank: those without a piece of a tensor count it too).
    storage_ = storage;
    if (storage.lean_masters() && !lean_) lean_.emplace(storage.masters);
    for (const auto& group : order) {
      for (const auto i : group) {
        const auto& t = fresh[i].first;
        if (!copies || t.scalar_type() != at::kBFloat16) continue;
        const auto s = layout.find(t);
        const auto number = lean_count_++;
        if (!layout.slots()[s].piece.defined()) continue;
        low_moments_.push_back(s);
        if (lean_) lean_->add(layout, s, number);
      }
    }
    reducer_.allocate_flats(at::TensorOptions(at::kFloat).device(comm_.device()));
    for (std::size_t g = 0; g < order.size(); ++g) {
      std::vector<at::Tensor> pieces;
      for (const auto& p : unique_tensors(optimizer.param_groups()[g].params())) {
        const void* id = p.unsafeGetTensorImpl();
        if (piece_slot_.count(id) == 1) {
          pieces.push_back(p);
          continue;
        }
        const auto& piece = layout.slots()[layout.find(p)].piece;
        if (piece.defined()) pieces.push_back(piece);
      }
      optimizer.param_groups()[g].params() = std::move(pieces);
    }
    return ranges;
  }

  /// After an optimizer step: every rank's updated pieces, rounded to the model's dtype, into
  /// every rank's model (one all_gather per bucket, in the model's dtype where the bucket holds
  /// one).
  /// A unit's (ZeRO-3) are gathered when it next runs. Lean pieces are stowed first, rounded.
  void gather_parameters() {
    if (!reducer_.sharded()) return;
    if (lean_) lean_->stow(reducer_.layout(), /*stepped=*/true);
    at::NoGradGuard no_grad;
    gather_into_model(reducer_.layout().all());
  }

  /// The block format of Adam's moments (plain: none), whose rows gather_state moves whole.
  MomentCoding moments() const noexcept { return storage_.moments; }
  /// A lean storage's pieces (null: none), their rounding's seed and count.
  LeanMasters* lean_rounding() noexcept { return lean_ ? &lean_->rounding() : nullptr; }
  /// A lean piece's bf16 value and what is kept of it, for the one-pass step.
  std::optional<LeanTarget> lean_target(const at::Tensor& piece) {
    return lean_ ? lean_->target(reducer_.layout(), piece) : std::nullopt;
  }
  /// The elements of the whole tensor `piece` is of (itself: its own).
  std::int64_t whole_numel(const at::Tensor& piece) const {
    const auto it = piece_slot_.find(piece.unsafeGetTensorImpl());
    return it == piece_slot_.end() ? piece.numel()
                                   : reducer_.layout().slots()[it->second].param.numel();
  }
  /// Lean pieces: every piece's fp32 value, for a step or a checkpoint (and its moments fp32,
  /// for a step).
  void inflate_pieces() {
    if (lean_) lean_->inflate(reducer_.layout());
  }
  /// Lean pieces: the fp32 values dropped unwritten; `narrow`: the moments of bf16 tensors'
  /// masters rounded to bf16, where the storage keeps them so (after a step).
  void release_pieces(bool narrow) {
    if (lean_) lean_->release(reducer_.layout());
    if (narrow) narrow_moments();
  }
  /// After a load into the pieces' fp32 values and fp32 moments: stowed, moments narrowed.
  void stow_loaded_pieces() {
    if (lean_) lean_->stow(reducer_.layout(), /*stepped=*/false);
    narrow_moments();
  }
  /// Bytes a lean storage keeps beyond the model's tensors: ZeRO-3 units' bf16 pieces
  /// (`weights`), remainders (the rest).
  std::int64_t lean_bytes(bool weights) const {
    if (!lean_) return 0;
    const auto units = lean_->unit_bytes(reducer_.layout());
    return weights ? units : lean_->kept_bytes(reducer_.layout()) - units;
  }

  /// Slot `i`'s piece as its value: under a lean storage a master's fp32 value (a new
  /// tensor), else the piece itself. A sharded checkpoint writes it.
  at::Tensor piece_value(std::size_t i) const {
    if (lean_) {
      auto value = lean_->value(reducer_.layout(), i);
      if (value.defined()) return value;
    }
    return reducer_.layout().slots()[i].piece;
  }
  /// Slot `i`'s piece takes `value` (flat, the piece's dtype), kept as the storage keeps it. A
  /// sharded checkpoint's load.
  void assign_piece(std::size_t i, const at::Tensor& value) {
    if (lean_ && lean_->assign(reducer_.layout(), i, value)) return;
    at::NoGradGuard no_grad;
    reducer_.layout().slots()[i].piece.copy_(value.reshape({-1}));
  }

  /// A piece's value in the model's dtype where a lean storage keeps it so, else the piece.
  static const at::Tensor& model_value(const Slot& slot) {
    return slot.low.defined() ? slot.low : slot.piece;
  }

  /// Sums the clipping norm's parts over the ranks (each holds those of its slices).
  void sum_over_shards(double& sum_of_squares, bool& non_finite) const {
    auto parts = at::tensor({sum_of_squares, non_finite ? 1.0 : 0.0}, at::kDouble).to(comm_.device());
    comm_.allreduce_(parts, c10d::ReduceOp::SUM, "gradient norm allreduce");
    const auto sums = parts.cpu();
    sum_of_squares = sums[0].item<double>();
    non_finite = sums[1].item<double>() != 0.0;
  }

  /// The model tensors laid out, by the optimizer's param group, as an unsharded optimizer
  /// would hold them.
  const std::vector<std::vector<at::Tensor>>& groups() const noexcept { return groups_; }
  /// The optimizer shard() replaced the tensors of (it must have run).
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  const BucketLayout& layout() const noexcept { return reducer_.layout(); }
  const Collectives& comm() const noexcept { return comm_; }

  /// The bucket's flat values (padded) from every rank's slice, in `dtype`: each rank fills its
  /// slice with `part(slot)` of its pieces (undefined: zeros). Collective.
  template <class Part>
  at::Tensor gather_slices(const Bucket& bucket, c10::ScalarType dtype, Part&& part) const {
    const auto& layout = reducer_.layout();
    auto mine = at::zeros({bucket.chunk}, at::TensorOptions(dtype).device(comm_.device()));
    for (const auto i : bucket.slots) {
      const auto& slot = layout.slots()[i];
      if (!slot.piece.defined()) continue;
      const auto value = part(slot);
      if (!value.defined()) continue;
      mine.narrow(0, layout.in_slice(i, comm_.rank()), slot.piece.numel()).copy_(value.reshape({-1}));
    }
    return at::cat(comm_.all_gather(mine));
  }

 private:
  // The moments of the masters of bf16 tensors rounded to bf16, where the storage keeps them so.
  void narrow_moments() {
    if (!storage_.bf16_moments || low_moments_.empty()) return;
    using States = std::decay_t<decltype(optimizer_->state())>;
    std::set<typename States::key_type> low;
    for (const auto i : low_moments_) {
      low.insert(state_key<States>(reducer_.layout().slots()[i].piece));
    }
    detail::narrow_moments(*optimizer_, [&low](const auto& key) { return low.count(key) == 1; });
  }

  // The pieces of the buckets in `range` into the model's tensors.
  void gather_into_model(const BucketRange& range) {
    const auto& layout = reducer_.layout();
    for (auto b = range.first; b < range.last; ++b) {
      const auto& bucket = layout.buckets()[b];
      if (layout.slots()[bucket.slots.front()].unit) continue;
      const auto full = gather_slices(bucket, layout.common_dtype(bucket), model_value);
      for (const auto i : bucket.slots) {
        const auto& slot = layout.slots()[i];
        slot.param.detach().view({-1}).copy_(full.narrow(0, slot.offset, slot.param.numel()));
      }
    }
  }

  Collectives comm_;
  GradientReducer& reducer_;
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::vector<std::vector<at::Tensor>> groups_;
  std::unordered_map<const void*, std::size_t> piece_slot_;  // the slot of each piece
  PieceStorage storage_;
  std::optional<LeanPieces> lean_;         // a lean storage's
  std::vector<std::size_t> low_moments_;   // slots whose pieces are masters of bf16 tensors
  std::uint64_t lean_count_ = 0;           // bf16 tensors numbered so far
};

}  // namespace mixprec::detail
