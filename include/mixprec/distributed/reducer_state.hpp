#pragma once
// Owns what the gradient hooks reach during a backward pass: each bucket's buffer and its
// collective in this step, each slot's progress, and the launch of full buckets in bucket order.
// The hooks hold it weakly, so that a hook outliving its reducer (the model kept after the
// Trainer) does nothing. gradient_reducer.hpp binds the hooks and finishes the step.
//
// Sharded gradients (ZeRO-2) keep, per bucket, this rank's slice of the averaged gradients; the
// full-size buffer exists from the bucket's first gradient to its reduce-scatter, and at most two
// are in flight: a third waits for the oldest, which then goes into its slice.

#include <mixprec/distributed/bucket_layout.hpp>
#include <mixprec/distributed/collectives.hpp>
#include <mixprec/distributed/param_storage.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// What happened to a slot in this step.
struct SlotStep {
  bool ready = false;        // its gradient is in its bucket
  bool accumulated = false;  // sliced: earlier micro-batches of the step left their sum there
  bool had = false;          // it had a gradient (sharded gradients set the model's to none)
};

/// A bucket's buffer and its collective in this step.
struct BucketStep {
  at::Tensor flat;   // the last bucket's also carries, per slot, whether the rank has a gradient
  at::Tensor slice;  // sharded gradients: this rank's slice of the averaged bucket, kept
  std::size_t pending = 0;  // slots not ready
  c10::intrusive_ptr<c10d::Work> work;
};

struct ReducerState {
  ReducerState(Collectives group, c10::ScalarType dtype, bool sliced, bool scatter)
      : comm(std::move(group)), reduce_dtype(dtype), sharded(sliced), shard_grads(scatter) {}

  std::mutex mutex;
  BucketLayout layout;
  std::vector<SlotStep> slot_steps;      // one per layout slot
  std::vector<BucketStep> bucket_steps;  // one per layout bucket
  Collectives comm;
  c10::ScalarType reduce_dtype;
  bool sharded;
  bool shard_grads;      // ZeRO-2: buckets reduce-scatter into their slices
  at::TensorOptions flat_options;
  at::Tensor used;       // sharded gradients: per slot, whether the rank has a gradient
  std::size_t next = 0;  // the first bucket not launched: buckets launch in order on every rank
  std::size_t drained = 0;  // sharded gradients: the buckets before it are in their slices
  bool active = false;
  bool twice = false;  // a gradient arrived again after its slot was copied
  bool overlap = true;

  // The bucket's full-size buffer; sharded gradients make it on first use (the padding zeros,
  // and the gaps between block-aligned slots).
  at::Tensor& flat_of(std::size_t b) {
    auto& flat = bucket_steps[b].flat;
    if (!flat.defined()) {
      const auto& bucket = layout.buckets()[b];
      if (bucket.gaps) {
        flat = at::zeros({bucket.padded}, flat_options);
      } else {
        flat = at::empty({bucket.padded}, flat_options);
        flat.narrow(0, bucket.numel, bucket.padded - bucket.numel).zero_();
      }
    }
    return flat;
  }
  at::Tensor view(std::size_t i) {
    const auto& slot = layout.slots()[i];
    return flat_of(slot.bucket).narrow(0, slot.offset, slot.param.numel());
  }
  bool has_gradient(std::size_t i) const {
    const auto& slot = layout.slots()[i];
    return slot.param.grad().defined() || slot_steps[i].accumulated || slot_steps[i].had ||
           (!slot.holder.is_same(slot.param) && slot.holder.grad().defined());
  }
  // The slot's gradient (the holder's accumulated one plus the parameter's) into its bucket.
  void fill(std::size_t i) {
    const auto& slot = layout.slots()[i];
    const auto& grad = slot.param.grad();
    const auto& held = slot.holder.is_same(slot.param) ? at::Tensor() : slot.holder.grad();
    MIXPREC_CHECK(!(grad.defined() && grad.is_sparse()) && !(held.defined() && held.is_sparse()),
                  "DataParallel reduces dense gradients: a tensor of shape ", slot.param.sizes(),
                  " has a sparse one (an Embedding with sparse(true)); use sparse(false)");
    auto target = view(i);
    if (sharded) {  // the micro-batches before this one are in the bucket already
      const bool accumulated = slot_steps[i].accumulated;
      if (grad.defined()) {
        accumulated ? target.add_(grad.reshape({-1})) : target.copy_(grad.reshape({-1}));
        slot_steps[i].had = true;
      } else if (!accumulated) {
        target.zero_();
      }
      return;
    }
    if (!grad.defined() && !held.defined()) {
      target.zero_();
      return;
    }
    const auto value = !held.defined() ? grad : (grad.defined() ? held + grad : held);
    // A 16-bit sum of N ranks' values could overflow: divide first, in the gradient's own
    // precision, so that the value rounds to 16 bits once.
    target.copy_((reduce_dtype == at::kFloat ? value : value / comm.world_size()).reshape({-1}));
  }
  void launch_ready(bool include_last) {
    const auto n = bucket_steps.size();
    include_last = include_last || shard_grads;  // whose flags travel on their own
    while (next < n && bucket_steps[next].pending == 0 && (include_last || next + 1 < n)) {
      auto& step = bucket_steps[next];
      try {
        if (shard_grads) {
          step.work = comm.launch_reduce_scatter(flat_of(next), step.slice);
        } else {
          std::vector<at::Tensor> tensors{step.flat};
          step.work = comm.group().allreduce(tensors);
        }
      } catch (const std::exception& e) {
        fail("rank ", comm.rank(), ": launching the ", shard_grads ? "reduce-scatter" : "allreduce",
             " of gradient bucket ", next, " failed: ", message_of(e));
      }
      ++next;
      if (shard_grads && next > 2) drain(next - 2);
    }
  }
  // Sharded gradients: waits for the buckets [drained, until), keeps each one's average slice
  // and frees its full-size buffer.
  void drain(std::size_t until) {
    const auto world = comm.world_size();
    for (; drained < until; ++drained) {
      auto& step = bucket_steps[drained];
      run_collective(comm.rank(), "gradient reduce-scatter", [&] { return step.work; });
      step.work.reset();
      if (!comm.reduce_scatters()) {
        const auto chunk = layout.buckets()[drained].chunk;
        step.slice.copy_(step.flat.narrow(0, chunk * comm.rank(), chunk));
      }
      step.flat = at::Tensor();
      step.slice.div_(world);
    }
  }
  void ready(std::size_t i) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!active) return;
    if (slot_steps[i].ready) {
      twice = true;
      return;
    }
    fill(i);
    slot_steps[i].ready = true;
    // Sharded gradients: the bucket holds it now; each rank keeps its slice only. A unit's
    // weight has served its backward (its gradient is complete): its bytes go too.
    if (shard_grads) {
      const auto& slot = layout.slots()[i];
      slot.param.mutable_grad().reset();
      if (slot.unit) release_storage(slot.param);
    }
    // The last bucket waits for finish(), which adds the per-slot gradient flags to it.
    if (--bucket_steps[layout.slots()[i].bucket].pending == 0 && overlap) launch_ready(false);
  }
};

}  // namespace mixprec::detail
