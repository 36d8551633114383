#pragma once
// What a Trainer asks of data parallel, in words that need no c10d header: distributed.hpp's
// DataParallel is the one implementation. trainer.hpp includes this header only, so that a
// program that trains in one process compiles without c10d; TrainerOptions::distributed(...)
// takes DistributedOptions, whose header brings c10d and the factory below with it.

#include <mixprec/core/state_storage.hpp>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn
namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace mixprec {

struct DistributedOptions;  // mixprec/distributed.hpp

namespace detail {

class LeanMasters;  // optim/lean_masters.hpp
struct LeanTarget;

/// One tensor of the sharded optimizer state, as a sharded checkpoint writes and reads it:
/// where it sits in the layout, and this rank's piece of it.
struct ShardSlot {
  at::Tensor param;         ///< the model tensor (a ZeRO-3 unit's has no bytes between uses)
  at::Tensor piece;         ///< this rank's piece, the optimizer's tensor; undefined: none here
  std::int64_t from = 0;    ///< where the piece starts in the flattened tensor
  std::size_t group = 0;    ///< the param group that holds it, as an unsharded optimizer would
  std::size_t index = 0;    ///< its place in that group
  std::size_t bucket = 0;   ///< its bucket (gather_fp32)
  std::int64_t offset = 0;  ///< where it starts in the bucket
  bool copy = false;        ///< the piece has bytes of its own (else it is a view of param's)
  bool unit = false;        ///< a ZeRO-3 unit's: param's bytes are released between uses
  bool master = false;      ///< the piece is the fp32 master of a tensor of another dtype
};

class StepGroup {
 public:
  virtual ~StepGroup() = default;
  StepGroup() = default;
  StepGroup(const StepGroup&) = delete;
  StepGroup& operator=(const StepGroup&) = delete;

  virtual int rank() const noexcept = 0;
  virtual int world_size() const noexcept = 0;
  /// Where the collectives' tensors live.
  virtual at::Device device() const noexcept = 0;
  /// DistributedOptions::broadcast_buffers.
  virtual bool broadcast_buffers() const noexcept = 0;
  /// An Error on every rank unless every rank's model has the same tensors. Collective.
  virtual void check_same_model(const torch::nn::Module& model) = 0;
  /// Reduce the gradients of `params` into `holders[i].grad()` from now on. Collective.
  virtual void bind(const std::vector<at::Tensor>& params,
                    const std::vector<at::Tensor>& holders) = 0;
  /// Before a backward pass; `sync`: reduce the gradients during it; `first`: the first
  /// micro-batch of an optimizer step.
  virtual void prepare(bool sync, bool first) = 0;
  /// After the backward pass of a prepare(true): the averages are in the holders' gradients.
  virtual void finish() = 0;
  /// Every rank steps or skips alike, and every rank is at the same step() call.
  virtual void agree_step(at::Tensor& found_inf, std::int64_t calls) = 0;
  /// Whether `local` is true on any rank.
  virtual bool any(bool local) = 0;
  /// `value` of every rank, in rank order.
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& value) = 0;
  /// Rank 0's buffers (and, with `parameters`, its parameters) on every rank.
  virtual void broadcast_from_rank0(torch::nn::Module& model, bool parameters) = 0;
  /// The gradient buffers it holds now (buckets, slices), for Trainer::state_bytes().
  virtual std::vector<at::Tensor> buffers() const = 0;

  // Sharded optimizer state (DistributedOptions::shard_optimizer_state); the defaults are
  // those of a group that does not shard.

  /// Whether the optimizer steps this rank's shard only.
  virtual bool sharded() const noexcept { return false; }
  /// Sharded: this rank's piece of model tensor `param` (what the optimizer steps in its place;
  /// its gradient is this rank's slice of the average), and in `offset` where the piece starts
  /// in the flattened tensor; undefined where this rank holds none of it.
  virtual at::Tensor piece_of(const at::Tensor& /*param*/, std::int64_t& /*offset*/) const {
    return {};
  }
  /// Lays out the optimizer's tensors that `fresh` lists ((model tensor, its fp32 value before
  /// the cast: needed where `copies` and the tensor is not fp32)) and puts this rank's pieces
  /// of them in their place in the optimizer, kept as `storage` says. Collective.
  virtual void shard(torch::optim::Optimizer&, const std::vector<std::pair<at::Tensor, at::Tensor>>&,
                     bool /*copies*/, PieceStorage /*storage*/) {}
  /// A lean storage of the pieces (lean_pieces.hpp): its rounding's seed and count (null:
  /// none); every piece's fp32 value for a step or a checkpoint, and dropped unwritten after
  /// (`narrow`: after a step, the bf16 tensors' moments rounded to bf16 where the storage keeps
  /// them so); after a load into the pieces, stowed. Bytes kept beyond the model's tensors:
  /// ZeRO-3 units' bf16 pieces (`weights`), or the remainders.
  virtual LeanMasters* lean_rounding() noexcept { return nullptr; }
  /// A lean piece's target for the one-pass step (lean_adam_step) into `out`; false: none.
  virtual bool lean_target(const at::Tensor& /*piece*/, LeanTarget& /*out*/) { return false; }
  /// The elements of the whole tensor a piece is of (a block format quantizes by it).
  virtual std::int64_t whole_numel(const at::Tensor& piece) const { return piece.numel(); }
  virtual void inflate_pieces() {}
  virtual void release_pieces(bool /*narrow*/) {}
  virtual void stow_loaded_pieces() {}
  virtual std::int64_t lean_bytes(bool /*weights*/) const { return 0; }
  /// After a micro-batch whose gradients did not travel: they join the step's accumulation.
  virtual void accumulate() {}
  /// After an optimizer step: every rank's updated pieces into every rank's model. Collective.
  virtual void gather_parameters() {}
  /// The clipping norm's parts summed over the ranks' shards. Collective.
  virtual void sum_over_shards(double& /*sum_of_squares*/, bool& /*non_finite*/) {}
  /// The model tensors laid out, by the optimizer's param group, as an unsharded optimizer
  /// would hold them.
  virtual std::vector<std::vector<at::Tensor>> sharded_groups() const { return {}; }
  /// Every laid-out tensor's full fp32 value, as sharded_groups() lists them. Collective.
  virtual std::vector<std::vector<at::Tensor>> gather_values() { return {}; }
  /// `full` (an optimizer like the user's over full tensors, one per sharded_groups() entry)
  /// gets every rank's optimizer state and the param groups' options. Collective.
  virtual void gather_state(torch::optim::Optimizer& /*full*/) {}
  /// ZeRO-3 (DistributedOptions::shard_parameters): whether units' weights are released
  /// between uses.
  virtual bool shards_parameters() const noexcept { return false; }
  /// ZeRO-3: every unit's weights whole on this rank (a checkpoint reads or writes the model),
  /// and released again. Collective.
  virtual void gather_units() {}
  virtual void release_units() {}
  /// The inverse, after `full` was loaded: this rank's pieces get their slices of `full`'s
  /// tensors (where they are copies) and state, the optimizer `full`'s options.
  virtual void scatter_state(torch::optim::Optimizer& /*full*/) {}

  // Sharded checkpoints (trainer/sharded_save.hpp, sharded_load.hpp): piece by piece, never
  // a whole tensor that this rank does not hold.

  /// Every laid-out tensor, in the layout's order (bucket by bucket).
  virtual std::vector<ShardSlot> shard_slots() const { return {}; }
  /// Slot `i`'s piece as its value: a master's fp32 value where a lean storage keeps it (a new
  /// tensor), else the piece itself.
  virtual at::Tensor piece_value(std::size_t /*slot*/) const { return {}; }
  /// Slot `i`'s piece takes `value` (flat, the piece's dtype), kept as the storage keeps it.
  virtual void assign_piece(std::size_t /*slot*/, const at::Tensor& /*value*/) {}
  /// Bucket `b`'s fp32 values, every rank's slice (flat, padded), for a streamed export.
  /// Collective.
  virtual at::Tensor gather_fp32(std::size_t /*bucket*/) { return {}; }
};

/// Makes the group a Trainer trains over; distributed.hpp defines it for DistributedOptions,
/// where that type is complete.
template <class Options>
struct StepGroupFactory;

using MakeStepGroup = std::unique_ptr<StepGroup> (*)(torch::nn::Module& model,
                                                     const torch::optim::Optimizer& optimizer,
                                                     const DistributedOptions& options);

}  // namespace detail
}  // namespace mixprec
