#pragma once
/// DataParallel: averages gradients across processes on PyTorch's own distributed engine, c10d
/// (ProcessGroupGloo on the CPU, ProcessGroupNCCL on CUDA), as DistributedDataParallel does:
/// in buckets (25 MiB, the first 1 MiB, reverse parameter order) launched while the backward
/// pass still runs, in fp32 by default. A Trainer given TrainerOptions::distributed uses it:
///
///   auto group = mixprec::gloo_group(mixprec::LaunchEnvironment::from_env());  // torchrun's
///   mixprec::Trainer<mixprec::MixedO2<at::BFloat16>> trainer(
///       model, optimizer, mixprec::TrainerOptions().distributed(mixprec::DistributedOptions(group)));
///
/// Every rank must make the same calls (steps, saves, loads) in the same order: each is a
/// collective. A rank that dies makes the others' next collective throw mixprec::Error.
///
/// This header owns the StepGroup a Trainer drives and nothing else: each call goes to the room
/// that does the job. options.hpp (the settings and their checks), collectives.hpp (the process
/// group), agreement.hpp (what the ranks agree on), buffers.hpp (rank 0's buffers to all),
/// bucket_layout.hpp (where each tensor sits in the buckets and slices), gradient_reducer.hpp
/// (the hooks and the bucket collectives; reducer_state.hpp, ZeRO-2's slices),
/// sharded_optimizer.hpp (ZeRO-1), sharded_units.hpp (ZeRO-3) and sharded_checkpoint.hpp
/// (their consolidated state).

#include <mixprec/distributed/options.hpp>
#include <mixprec/distributed/agreement.hpp>
#include <mixprec/distributed/buffers.hpp>
#include <mixprec/distributed/collectives.hpp>
#include <mixprec/distributed/gradient_reducer.hpp>
#include <mixprec/distributed/held_params.hpp>
#include <mixprec/distributed/sharded_checkpoint.hpp>
#include <mixprec/distributed/sharded_build.hpp>
#include <mixprec/distributed/sharded_optimizer.hpp>
#include <mixprec/distributed/sharded_units.hpp>
#include <mixprec/distributed/step_group.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace mixprec {

/// Gradient averaging across the ranks of a process group, with DDP's buckets and overlap;
/// the Trainer drives it (see TrainerOptions::distributed), a custom loop can too: bind(), then
/// per optimizer step prepare(true), backward, finish(), and agree() on the inf flag.
class DataParallel final : public detail::StepGroup {
 public:
  /// Checks that every rank holds a model of the same structure (an Error on every rank if
  /// not), then copies rank 0's parameters and buffers to every rank. Collective.
  DataParallel(torch::nn::Module& model, DistributedOptions options)
      : DataParallel(model, nullptr, std::move(options)) {}

  /// As above; with shard_optimizer_state, first checks that `optimizer` is one whose state
  /// can be sharded (an Error naming it otherwise).
  DataParallel(torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
               DistributedOptions options)
      : DataParallel(model, &optimizer, std::move(options)) {}

 private:
  DataParallel(torch::nn::Module& model, const torch::optim::Optimizer* optimizer,
               DistributedOptions options)
      : options_(detail::checked(std::move(options), optimizer)),
        comm_(options_.process_group(), device_of(model)),
        reducer_(comm_, options_),
        shards_(comm_, reducer_),
        units_(shards_),
        plan_(detail::plan_units(model, options_.shard_parameters())) {
    check_same_model(model);
    // Parameters held in shards (a ShardedBuild's): the units' are laid out from their pieces
    // by shard(), the others gathered whole now; rank 0's values reach every rank for the rest.
    detail::take_held(comm_, model, plan_, held_);
    broadcast_from_rank0(model, /*parameters=*/true);
  }

 public:
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int rank() const noexcept override { return comm_.rank(); }
  /// The model's device, where the collectives' tensors live (NCCL reduces CUDA tensors only).
  at::Device device() const noexcept override { return comm_.device(); }
  int world_size() const noexcept override { return comm_.world_size(); }
  const DistributedOptions& options() const noexcept { return options_; }
  bool broadcast_buffers() const noexcept override { return options_.broadcast_buffers(); }

  /// An Error on every rank unless every rank's model has the same tensors: names, shapes,
  /// dtypes and requires_grad, parameter by parameter and buffer by buffer. Collective (one
  /// all_gather); the constructor runs it, and the Trainer whenever it rebinds the gradients
  /// (a parameter frozen or unfrozen).
  void check_same_model(const torch::nn::Module& model) override {
    detail::check_same_model(comm_, model);
  }

  /// Reduces the gradients of `params` (leaf tensors, each once): after finish(),
  /// `holders[i].grad()` is the average over ranks of params[i]'s gradient (plus what
  /// holders[i].grad() had accumulated, when holders[i] is another tensor, an fp32 master).
  /// Replaces an earlier binding. Collective: every rank must bind the same shapes.
  void bind(const std::vector<at::Tensor>& params,
            const std::vector<at::Tensor>& holders) override {
    reducer_.bind(params, holders);
  }

  /// Whether the optimizer steps this rank's shard only (DistributedOptions::shard_optimizer_state).
  bool sharded() const noexcept override { return reducer_.sharded(); }

  /// Sharded: this rank's piece of `param` and where it starts in the flattened tensor.
  at::Tensor piece_of(const at::Tensor& param, std::int64_t& offset) const override {
    const auto& layout = reducer_.layout();
    const auto i = layout.find(param);
    if (i == detail::BucketLayout::npos) return {};
    offset = layout.slots()[i].piece_from;
    return layout.slots()[i].piece;
  }

  /// Sharded: lays out the optimizer's tensors listed in `fresh` in buckets sliced across the
  /// ranks, and replaces each of them in the optimizer by this rank's piece of it
  /// (ShardedOptimizer::shard). Collective; bind() hooks the gradients next.
  /// ZeRO-3: the units' tensors in buckets of their own, whose pieces are fp32 copies, and
  /// their weights released until a unit runs.
  void shard(torch::optim::Optimizer& optimizer,
             const std::vector<std::pair<at::Tensor, at::Tensor>>& fresh, bool copies,
             detail::PieceStorage storage) override {
    if (!shards_parameters()) {
      shards_.shard(optimizer, fresh, copies, storage);
      return;
    }
    MIXPREC_CHECK(units_.empty(), "DistributedOptions::shard_parameters: the units are laid "
                  "out once, when the Trainer is built; a later param group cannot join them");
    const auto ranges = shards_.shard(optimizer, fresh, copies, storage, &plan_.unit_of,
                                      plan_.paths.size(), &held_.by_param());
    // A held unit's parameter that the optimizer does not train stays whole, as a frozen one.
    for (const auto& [p, shard] : held_.taken()) {
      if (shards_.layout().find(p) == detail::BucketLayout::npos) {
        at::NoGradGuard no_grad;
        p.set_data(detail::gather_shard(*shard, p.sizes()).to(p.scalar_type()));
      }
    }
    held_.consumed();
    units_.take(plan_, ranges);
  }
  detail::LeanMasters* lean_rounding() noexcept override { return shards_.lean_rounding(); }
  bool lean_target(const at::Tensor& piece, detail::LeanTarget& out) override {
    auto target = shards_.lean_target(piece);
    if (!target) return false;
    out = std::move(*target);
    return true;
  }
  std::int64_t whole_numel(const at::Tensor& piece) const override {
    return shards_.whole_numel(piece);
  }
  void inflate_pieces() override { shards_.inflate_pieces(); }
  void release_pieces(bool narrow) override { shards_.release_pieces(narrow); }
  void stow_loaded_pieces() override { shards_.stow_loaded_pieces(); }
  std::int64_t lean_bytes(bool weights) const override { return shards_.lean_bytes(weights); }

  bool shards_parameters() const noexcept override { return !options_.shard_parameters().empty(); }
  void gather_units() override { units_.gather_all(); }
  void release_units() override { units_.release_all(); }

  /// Sharded, after a micro-batch whose gradients did not travel: they are added into the
  /// buckets (fp32), and the model's gradients set to none.
  void accumulate() override { reducer_.accumulate(); }

  /// Sharded, after an optimizer step: every rank's updated pieces, rounded to the model's
  /// dtype, into every rank's model.
  void gather_parameters() override { shards_.gather_parameters(); }

  /// Sums the clipping norm's parts over the ranks (each holds those of its slices).
  void sum_over_shards(double& sum_of_squares, bool& non_finite) override {
    shards_.sum_over_shards(sum_of_squares, non_finite);
  }

  std::vector<std::vector<at::Tensor>> sharded_groups() const override { return shards_.groups(); }

  /// Every laid-out tensor's fp32 value (its master's where the pieces are copies), by the
  /// optimizer's groups. Collective.
  std::vector<std::vector<at::Tensor>> gather_values() override {
    return detail::gather_values(shards_);
  }

  /// `full`, an optimizer of the user's type whose groups hold one full tensor per
  /// sharded_groups() entry, gets every rank's state of its pieces and the param groups'
  /// options. Collective.
  void gather_state(torch::optim::Optimizer& full) override { detail::gather_state(shards_, full); }

  /// After `full` (as in gather_state) was loaded: this rank's pieces get their slices of its
  /// tensors (the copies; the views see the model's) and of its state, the optimizer its
  /// param groups' options.
  void scatter_state(torch::optim::Optimizer& full) override { detail::scatter_state(shards_, full); }

  /// Sharded checkpoints: the laid-out tensors and this rank's pieces of them; a piece's value
  /// and its assignment; a bucket's fp32 values gathered (collective).
  std::vector<detail::ShardSlot> shard_slots() const override { return detail::shard_slots(shards_); }
  at::Tensor piece_value(std::size_t slot) const override { return shards_.piece_value(slot); }
  void assign_piece(std::size_t slot, const at::Tensor& value) override {
    shards_.assign_piece(slot, value);
  }
  at::Tensor gather_fp32(std::size_t bucket) override { return detail::gather_fp32(shards_, bucket); }

  /// Before a backward pass: `sync` on the micro-batch after which gradients are reduced
  /// (the last of an accumulation); before the others nothing is communicated. `first`: the
  /// first micro-batch of an optimizer step (sharded: the accumulation starts over).
  void prepare(bool sync, bool first = true) override { reducer_.prepare(sync, first); }

  /// After the backward pass of a prepare(true): reduces what is left (a parameter that got no
  /// gradient on this rank counts as zeros), waits, and writes the averages into the holders'
  /// gradients. A tensor with no gradient on any rank keeps its undefined gradient, as in one
  /// process.
  void finish() override { reducer_.finish(); }

  std::vector<at::Tensor> buffers() const override { return reducer_.buffers(); }

  /// MAX-reduces a one-element inf flag, so that every rank steps or skips alike.
  void agree(at::Tensor& found_inf) { detail::agree(comm_, found_inf); }

  /// A step's agreement: MAX-reduces `found_inf` so that every rank steps or skips alike, and
  /// checks in the same allreduce that every rank is at the same step() call (an Error on
  /// every rank, before anything steps, if not).
  void agree_step(at::Tensor& found_inf, std::int64_t calls) override {
    detail::agree_step(comm_, found_inf, calls);
  }

  /// Whether `local` is true on any rank.
  bool any(bool local) override { return detail::any(comm_, local); }

  /// `value` of every rank, in rank order (same shape and dtype on every rank).
  std::vector<at::Tensor> all_gather(const at::Tensor& value) override {
    return comm_.all_gather(value);
  }

  /// A copy is a copy of bits: 16-bit floats travel as bytes, which every backend takes
  /// (LibTorch 1.13's Gloo refuses bf16, and int16).
  static at::Tensor as_bits(const at::Tensor& t) { return detail::as_bits(t); }
  /// The inverse of as_bits, to the dtype and shape of `like`.
  static at::Tensor from_bits(const at::Tensor& bits, const at::Tensor& like) {
    return detail::from_bits(bits, like);
  }

  /// Copies rank 0's buffers to every rank (or, with `parameters`, its parameters too).
  void broadcast_from_rank0(torch::nn::Module& model, bool parameters = false) override {
    detail::broadcast_from_rank0(comm_, model, parameters);
  }

 private:
  static at::Device device_of(const torch::nn::Module& model) {
    const auto params = model.parameters();
    return params.empty() ? at::Device(at::kCPU) : params.front().device();
  }

  DistributedOptions options_;
  detail::Collectives comm_;
  detail::GradientReducer reducer_;
  detail::ShardedOptimizer shards_;
  detail::ShardedUnits units_;  // after shards_: its destructor reads the layout
  detail::UnitPlan plan_;
  detail::TakenShards held_;  // the units' held parameters, until shard() lays them out
};

namespace detail {
template <>
struct StepGroupFactory<DistributedOptions> {
  static std::unique_ptr<StepGroup> make(torch::nn::Module& model,
                                         const torch::optim::Optimizer& optimizer,
                                         const DistributedOptions& options) {
    return std::make_unique<DataParallel>(model, optimizer, options);
  }
};
}  // namespace detail

}  // namespace mixprec
