#pragma once
// Owns this rank's line to the others: the process group with its rank, size and device, and the
// blocking collectives every other room uses (all_gather, allreduce, broadcast), each failure
// an Error that names the rank and the operation, 16-bit floats sent as bytes. A value type:
// the gradient hooks keep a copy, since they can outlive the DataParallel that set them.
// Also the launch of a reduce-scatter (sharded gradients), which the caller waits for.

#include <mixprec/distributed/options.hpp>
#include <mixprec/io/checkpoint_file.hpp>  // message_of
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <exception>
#include <utility>
#include <vector>

namespace mixprec::detail {

// Runs a collective and waits for it; any failure (a peer gone, a timeout, a dtype the backend
// refuses) becomes a mixprec::Error that names the rank and the operation.
template <class Launch>
void run_collective(int rank, const char* what, Launch&& launch) {
  try {
    auto work = launch();
    work->wait();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("rank ", rank, ": the ", what, " across ranks failed: ", message_of(e),
         ". A peer process has probably exited or stalled (every rank must make the same Trainer "
         "calls in the same order); this process group cannot continue");
  }
}

/// A copy is a copy of bits: floats narrower than fp32 travel as bytes, which every backend
/// takes (LibTorch 1.13's Gloo refuses bf16, and int16; no Gloo takes fp8, a LoRA base's dtype).
inline at::Tensor as_bits(const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  const bool narrow_float = at::isFloatingType(dtype) && dtype != at::kFloat && dtype != at::kDouble;
  return narrow_float ? t.reshape({-1}).view(at::kByte) : t;
}

/// The inverse of as_bits, to the dtype and shape of `like`.
inline at::Tensor from_bits(const at::Tensor& bits, const at::Tensor& like) {
  return bits.scalar_type() == like.scalar_type() ? bits
                                                  : bits.view(like.scalar_type()).view(like.sizes());
}

class Collectives {
 public:
  /// `group` must not be null (detail::checked); `device`: where the collectives' tensors live.
  Collectives(c10::intrusive_ptr<ProcessGroup> group, at::Device device)
      : group_(std::move(group)),
        rank_(group_->getRank()),
        world_(group_->getSize()),
        device_(device) {}

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_; }
  at::Device device() const noexcept { return device_; }
  ProcessGroup& group() const { return *group_; }

  /// `value` of every rank, in rank order (same shape and dtype on every rank).
  std::vector<at::Tensor> all_gather(const at::Tensor& value) const {
    const auto bits = as_bits(value.contiguous());
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < world_; ++r) outputs[0].push_back(at::empty_like(bits));
    std::vector<at::Tensor> inputs{bits};
    run_collective(rank_, "all_gather", [&] { return group_->allgather(outputs, inputs); });
    for (auto& t : outputs[0]) t = from_bits(t, value);
    return outputs[0];
  }

  /// `tensor` reduced over the ranks in place by `op`; `what` names it in an Error.
  void allreduce_(at::Tensor& tensor, c10d::ReduceOp op, const char* what) const {
    c10d::AllreduceOptions options;
    options.reduceOp = op;
    std::vector<at::Tensor> tensors{tensor};
    run_collective(rank_, what, [&] { return group_->allreduce(tensors, options); });
  }

  /// Whether the backend reduce-scatters into a slice (compat.hpp: 1.13's Gloo cannot).
  bool reduce_scatters() const {
    return gloo_reduce_scatters || group_->getBackendName() != "gloo";
  }

  /// Launches the sum over the ranks of `flat` (world_size equal slices) into `slice`, this
  /// rank's; where the backend cannot (reduce_scatters()), the sum into `flat` itself, whose
  /// slice the caller keeps. The caller waits (run_collective).
  c10::intrusive_ptr<c10d::Work> launch_reduce_scatter(at::Tensor& flat, at::Tensor& slice) const {
    if (!reduce_scatters()) {
      std::vector<at::Tensor> tensors{flat};
      return group_->allreduce(tensors);
    }
    return group_->_reduce_scatter_base(slice, flat, c10d::ReduceScatterOptions());
  }

  /// Rank 0's `flat` (one tensor: Gloo broadcasts one per call) on every rank, bit for bit.
  void broadcast_from_rank0_(at::Tensor& flat) const {
    std::vector<at::Tensor> tensors{as_bits(flat)};
    c10d::BroadcastOptions options;
    options.rootRank = 0;
    run_collective(rank_, "broadcast from rank 0", [&] { return group_->broadcast(tensors, options); });
    flat = from_bits(tensors[0], flat);
  }

 private:
  c10::intrusive_ptr<ProcessGroup> group_;
  int rank_;
  int world_;
  at::Device device_;
};

}  // namespace mixprec::detail
