#pragma once
// Owns the gradients' way through a step: a post-hook on each parameter's gradient accumulator
// that copies the gradient into its bucket as soon as autograd has it (reducer_state.hpp launches
// each full bucket's collective while the backward pass still runs, in bucket order on every
// rank), and finish(): the averages into the holders' gradients, or, with sliced buckets, this
// rank's part of them into its pieces' gradients. Sliced, the micro-batches whose gradients do
// not travel accumulate in the buckets. Sharded gradients (ZeRO-2) reduce-scatter each bucket
// into this rank's slice, and the pieces' gradients are views of the slices.

#include <mixprec/distributed/agreement.hpp>
#include <mixprec/distributed/bucket_layout.hpp>
#include <mixprec/distributed/collectives.hpp>
#include <mixprec/distributed/options.hpp>
#include <mixprec/distributed/reducer_state.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace mixprec::detail {

class GradientReducer {
 public:
  GradientReducer(const Collectives& comm, const DistributedOptions& options)
      : state_(std::make_shared<ReducerState>(
            comm, options.reduce_dtype(),
            options.shard_optimizer_state() || options.shard_gradients(), options.shard_gradients())),
        caps_{options.first_bucket_cap_mb() * 1024.0 * 1024.0,
              options.bucket_cap_mb() * 1024.0 * 1024.0, at::elementSize(options.reduce_dtype())},
        overlap_(options.overlap()) {}
  ~GradientReducer() { unbind(); }
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  BucketLayout& layout() noexcept { return state_->layout; }
  const BucketLayout& layout() const noexcept { return state_->layout; }
  /// Whether the buckets are sliced across the ranks (DistributedOptions::shard_optimizer_state).
  bool sharded() const noexcept { return state_->sharded; }

  /// Reduces the gradients of `params` (leaf tensors, each once) into `holders[i].grad()`.
  /// Sliced, the layout is the optimizer's (the sharding room's) and a parameter it does not
  /// hold is not reduced. Replaces an earlier binding. Collective: every rank must bind the
  /// same shapes.
  void bind(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& holders) {
    auto& s = *state_;
    MIXPREC_CHECK(params.size() == holders.size(), "DataParallel::bind needs one holder per "
                  "parameter, got ", holders.size(), " for ", params.size());
    std::int64_t total = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      MIXPREC_CHECK(params[i].requires_grad() && params[i].is_leaf(), "DataParallel reduces the "
                    "gradients of leaf tensors that require grad; tensor ", i, " of shape ",
                    params[i].sizes(), " is not one");
      MIXPREC_CHECK(params[i].device() == params.front().device(), "DataParallel: the model "
                    "spans devices ", params.front().device(), " and ", params[i].device(),
                    "; use one device per process, as DDP does");
      MIXPREC_CHECK(holders[i].sizes() == params[i].sizes(), "DataParallel::bind: holder ", i,
                    " has shape ", holders[i].sizes(), ", its parameter ", params[i].sizes());
      total += params[i].numel();
    }
    // The same tensors on every rank, or the buckets would not match.
    const auto counts = all_equal(s.comm, static_cast<std::int64_t>(params.size()), total);
    MIXPREC_CHECK(counts, "rank ", s.comm.rank(), ": the ranks train different parameter sets (",
                  params.size(), " tensors, ", total, " elements here): freeze and unfreeze the "
                  "same parameters on every rank");
    unbind();
    if (s.sharded) {
      for (const auto& p : params) {
        const auto i = s.layout.find(p);
        if (i != BucketLayout::npos) hook(i);
      }
      return;
    }
    s.layout.clear();
    s.slot_steps.clear();
    s.bucket_steps.clear();
    lay_out(params, holders);
    for (std::size_t i = 0; i < s.layout.slots().size(); ++i) hook(i);
  }

  /// Lays out `params` after the existing buckets and allocates every bucket's buffer in the
  /// reduced dtype, on their device.
  /// `allocate` false: the caller lays out more and allocates once (allocate_flats). `block`:
  /// a block format's (BucketLayout::lay_out).
  BucketRange lay_out(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& holders,
                      bool allocate = true, std::int64_t block = 0) {
    auto& s = *state_;
    const auto range = s.layout.lay_out(params, holders, caps_, block);
    if (allocate) {
      allocate_flats(at::TensorOptions(s.reduce_dtype)
                         .device(params.empty() ? s.comm.device() : params.front().device()));
    }
    return range;
  }

  /// Every bucket's buffer anew (zeros), after the layout grew or its buckets were sliced;
  /// sharded gradients: every bucket's slice (unwritten), the full-size buffers made when they
  /// fill.
  void allocate_flats(const at::TensorOptions& options) {
    auto& s = *state_;
    const auto& slots = s.layout.slots();
    const auto& buckets = s.layout.buckets();
    s.slot_steps.resize(slots.size());
    s.bucket_steps.resize(buckets.size());
    s.flat_options = options;
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      if (s.shard_grads) {
        s.bucket_steps[b].flat = at::Tensor();
        // Written whole by each reduction before it is read: its pages are not touched (not
        // resident) until the first backward pass, so a ZeRO-2/3 Trainer's construction costs
        // its masters, not its gradients too.
        s.bucket_steps[b].slice = at::empty({buckets[b].chunk}, options);
        continue;
      }
      const auto extra = b + 1 == buckets.size() ? static_cast<std::int64_t>(slots.size()) : 0;
      s.bucket_steps[b].flat = at::zeros({buckets[b].padded + extra}, options);
    }
    if (s.shard_grads) s.used = at::zeros({static_cast<std::int64_t>(slots.size())}, options);
  }

  /// The buffers held now: full-size buckets, slices, the flags of sharded gradients.
  std::vector<at::Tensor> buffers() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    std::vector<at::Tensor> result{state_->used};
    for (const auto& step : state_->bucket_steps) {
      result.push_back(step.flat);
      result.push_back(step.slice);
    }
    return result;
  }

  /// Removes the hooks: gradients no longer travel until the next bind().
  void unbind() {
    for (std::size_t i = 0; i < accumulators_.size(); ++i) {
      accumulators_[i]->del_post_hook(hook_keys_[i]);
    }
    accumulators_.clear();
    hook_keys_.clear();
  }

  /// Before a backward pass: `sync` on the micro-batch after which gradients are reduced;
  /// `first`: the first micro-batch of an optimizer step (sliced: the accumulation starts over).
  void prepare(bool sync, bool first) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto& s = *state_;
    if (first) {
      for (auto& step : s.slot_steps) step.accumulated = false;
    }
    s.active = sync && !s.layout.slots().empty();
    s.next = 0;
    s.drained = 0;
    s.twice = false;
    s.overlap = overlap_;
    for (auto& step : s.slot_steps) {
      step.ready = false;
      step.had = false;
    }
    for (std::size_t b = 0; b < s.bucket_steps.size(); ++b) {
      s.bucket_steps[b].pending = s.layout.buckets()[b].slots.size();
      s.bucket_steps[b].work.reset();
    }
  }

  /// After the backward pass of a prepare(true): reduces what is left (a parameter that got no
  /// gradient on this rank counts as zeros), waits, and writes the averages into the holders'
  /// gradients (sliced: this rank's part into its pieces'). A tensor with no gradient on any
  /// rank keeps its undefined gradient, as in one process.
  void finish() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto& s = *state_;
    if (!s.active) return;
    s.active = false;
    MIXPREC_CHECK(!s.twice, "rank ", s.comm.rank(), ": a parameter's gradient was accumulated "
                  "again after its bucket had been copied (backward() ran twice before the step, "
                  "e.g. inside loss_fn): its second part would be missing from the average; "
                  "return one loss and let the Trainer run the backward pass");
    auto& slots = s.layout.slots();
    const auto& buckets = s.layout.buckets();
    bool all_local = true;
    for (std::size_t i = 0; i < slots.size(); ++i) {
      if (!s.slot_steps[i].ready) {
        s.fill(i);
        s.slot_steps[i].ready = true;
        --s.bucket_steps[slots[i].bucket].pending;
      }
    }
    std::vector<float> local_used(slots.size());
    for (std::size_t i = 0; i < slots.size(); ++i) {
      local_used[i] = s.has_gradient(i) ? 1.0F : 0.0F;
      all_local = all_local && local_used[i] != 0.0F;
    }
    // The flags ride at the end of the last bucket, or (sharded gradients) on their own.
    auto used = s.shard_grads ? s.used
                              : s.bucket_steps.back().flat.narrow(
                                    0, buckets.back().padded, static_cast<std::int64_t>(slots.size()));
    used.copy_(at::from_blob(local_used.data(), {static_cast<std::int64_t>(local_used.size())},
                             at::kFloat));
    s.launch_ready(/*include_last=*/true);
    if (s.shard_grads) {
      s.comm.allreduce_(used, c10d::ReduceOp::SUM, "gradient flags allreduce");
      s.drain(buckets.size());
    }
    for (std::size_t b = 0; b < buckets.size() && !s.shard_grads; ++b) {
      auto& step = s.bucket_steps[b];
      run_collective(s.comm.rank(), "gradient allreduce", [&] { return step.work; });
      step.work.reset();
      if (s.reduce_dtype == at::kFloat) step.flat.narrow(0, 0, buckets[b].numel).div_(s.comm.world_size());
    }
    // Whether another rank had a gradient matters only where this one had none: read the
    // counts (a host copy) only then.
    std::vector<float> global_used;
    if (!all_local) {
      auto counts = used.to(at::kFloat).cpu();
      global_used.assign(counts.data_ptr<float>(), counts.data_ptr<float>() + counts.numel());
    }
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < slots.size(); ++i) {
      auto& slot = slots[i];
      s.slot_steps[i].accumulated = false;
      if (slot.unit) release_storage(slot.param);  // one that had no gradient
      if (s.sharded) {
        // This rank's slice of the average is its piece's gradient; a tensor no rank had a
        // gradient for has none, and the optimizer skips it.
        if (!slot.piece.defined()) continue;
        if (!all_local && global_used[i] == 0.0F) {
          slot.piece.mutable_grad().reset();
          continue;
        }
        auto value = s.shard_grads
                         ? s.bucket_steps[slot.bucket].slice.narrow(
                               0, s.layout.in_slice(i, s.comm.rank()), slot.piece.numel())
                         : s.view(i).narrow(0, slot.piece_from, slot.piece.numel());
        slot.piece.mutable_grad() = slot.piece.scalar_type() == value.scalar_type()
                                        ? value
                                        : value.to(slot.piece.scalar_type());
        continue;
      }
      if (!all_local && global_used[i] == 0.0F) continue;
      const auto value = s.view(i).view(slot.holder.sizes());
      auto& grad = slot.holder.mutable_grad();
      if (grad.defined()) {
        grad.copy_(value);
      } else {
        grad = value.to(slot.holder.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      }
    }
  }

  /// Sliced, after a micro-batch whose gradients did not travel: they are added into the
  /// buckets (fp32), and the model's gradients set to none.
  void accumulate() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto& s = *state_;
    if (!s.sharded) return;
    auto& slots = s.layout.slots();
    for (const auto& slot : slots) {
      const auto& grad = slot.param.grad();
      MIXPREC_CHECK(!grad.defined() || !grad.is_sparse(), "DataParallel reduces dense "
                    "gradients: a tensor of shape ", slot.param.sizes(), " has a sparse one (an "
                    "Embedding with sparse(true)); use sparse(false)");
    }
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < slots.size(); ++i) {
      if (!slots[i].param.grad().defined()) continue;
      s.fill(i);
      s.slot_steps[i].accumulated = true;
      slots[i].param.mutable_grad().reset();
      if (slots[i].unit) release_storage(slots[i].param);
    }
  }

 private:
  struct Hook : torch::autograd::FunctionPostHook {
    Hook(const std::shared_ptr<ReducerState>& state, std::size_t slot) : state_(state), slot_(slot) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      if (auto state = state_.lock()) state->ready(slot_);
      return outputs;
    }
    std::weak_ptr<ReducerState> state_;
    std::size_t slot_;
  };

  void hook(std::size_t i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(state_->layout.slots()[i].param);
    hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<Hook>(state_, i)));
    accumulators_.push_back(std::move(accumulator));
  }

  std::shared_ptr<ReducerState> state_;
  BucketCaps caps_;
  bool overlap_;
  std::vector<decltype(torch::autograd::impl::grad_accumulator(at::Tensor()))> accumulators_;
  std::vector<std::uintptr_t> hook_keys_;
};

}  // namespace mixprec::detail
