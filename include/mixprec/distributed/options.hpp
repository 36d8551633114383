#pragma once
// Owns the settings of data parallel and what makes them valid: DistributedOptions, the
// ProcessGroup type it holds, and the checks every DataParallel runs before it talks to a peer.
// process_group.hpp makes groups from here without bringing DataParallel with it.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/optim/sharded_state.hpp>

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/optim/optimizer.h>

#include <string>
#include <utility>
#include <vector>

namespace mixprec {

/// The c10d process group type that ProcessGroupGloo and ProcessGroupNCCL derive from:
/// c10d::Backend in LibTorch 2.x, c10d::ProcessGroup in 1.13.
using ProcessGroup = MIXPREC_C10D_PROCESS_GROUP;

/// Settings of data-parallel training; DDP's defaults.
struct DistributedOptions {
  explicit DistributedOptions(c10::intrusive_ptr<ProcessGroup> group)
      : process_group_(std::move(group)) {}
  /// The ranks to average over.
  TORCH_ARG(c10::intrusive_ptr<ProcessGroup>, process_group);
  /// Bucket size in MiB of the reduced dtype; 0: one bucket per tensor.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// The first bucket (the last layers, whose gradients are ready first) is smaller, so that
  /// communication starts early in the backward pass.
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  /// The dtype gradients travel in: kFloat (default; under MixedO2 the fp32 master gradients
  /// are the result), or kBFloat16/kHalf, half the bytes, divided by the world size before the
  /// sum so that it cannot overflow, and rounded twice (docs/distributed.md).
  TORCH_ARG(c10::ScalarType, reduce_dtype) = at::kFloat;
  /// Launch each bucket as soon as its gradients are ready; false: all after the backward pass.
  TORCH_ARG(bool, overlap) = true;
  /// Copy rank 0's buffers (BatchNorm statistics) to every rank before each forward pass, as
  /// DDP's broadcast_buffers=True does.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// ZeRO stage 1 (DeepSpeed's stage 1, PyTorch's ZeroRedundancyOptimizer): each rank keeps the
  /// optimizer state and the fp32 master weights of 1/world_size of the parameters, the same
  /// slice of each gradient bucket, and steps only those; the updated parameters are then
  /// gathered to every rank. Under MixedO2 + AdamW that is 12/world_size bytes per parameter
  /// instead of 12. Adam, AdamW and SGD (docs/distributed.md); gradients reduce in fp32.
  TORCH_ARG(bool, shard_optimizer_state) = false;
  /// ZeRO stage 2 (DeepSpeed's stage 2): shard_optimizer_state, and each bucket of gradients is
  /// reduce-scattered while the backward pass runs, so that each rank keeps only its slice of
  /// the averaged gradients (fp32, 4/world_size bytes per parameter); a full-size bucket lives
  /// from its first gradient to its reduce-scatter (at most two in flight), and a model
  /// gradient from autograd's accumulation to its copy into the bucket. Micro-batches whose
  /// gradients do not travel (accumulation) add into full-size buckets until the last one.
  /// LibTorch 1.13's Gloo has no reduce-scatter: an allreduce, then the slice is kept.
  TORCH_ARG(bool, shard_gradients) = false;
  /// ZeRO stage 3, in FSDP's manner: shard_gradients, and the parameters of each module these
  /// patterns name (a unit; named_modules() paths, `*` within a name, `**` across dots:
  /// {"encoder.layer.*"}) live sharded: each rank keeps its fp32 pieces, and the unit's
  /// weights are gathered in the model's dtype just before its forward, released after it,
  /// gathered again before its backward and released once their gradients are taken. A unit
  /// must be declared as mixprec::nn::Checkpointed<M> or mixprec::nn::Mappable<M> (LibTorch
  /// modules have no forward hooks). Parameters outside every unit, and frozen ones, stay
  /// whole on every rank. Every rank must run the same forward passes (each gather is a
  /// collective), evaluate() included. Empty (the default): off.
  TORCH_ARG(std::vector<std::string>, shard_parameters) = {};
};

namespace detail {

// `options` once they are valid for training `optimizer` (null: not known yet), else an Error
// that names the setting; nothing has been communicated yet.
inline DistributedOptions checked(DistributedOptions options,
                                  const torch::optim::Optimizer* optimizer) {
  MIXPREC_CHECK(options.process_group(), "DistributedOptions got a null process group");
  if (!options.shard_parameters().empty()) options.shard_gradients(true);  // ZeRO-3 includes 2,
  if (options.shard_gradients()) options.shard_optimizer_state(true);       // which includes 1
  if (options.shard_optimizer_state()) {
    MIXPREC_CHECK(options.reduce_dtype() == at::kFloat, "DistributedOptions::"
                  "shard_optimizer_state reduces gradients in fp32 (each rank keeps its slice "
                  "of the fp32 sums): leave reduce_dtype at kFloat, got ",
                  options.reduce_dtype());
    if (optimizer != nullptr) check_shardable(*optimizer);
  }
  MIXPREC_CHECK(options.bucket_cap_mb() >= 0 && options.first_bucket_cap_mb() >= 0,
                "DistributedOptions: bucket sizes must be >= 0 MiB, got ",
                options.first_bucket_cap_mb(), " and ", options.bucket_cap_mb());
  const auto dtype = options.reduce_dtype();
  MIXPREC_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                "DistributedOptions::reduce_dtype must be kFloat, kBFloat16 or kHalf, got ",
                dtype);
  MIXPREC_CHECK(gloo_reduces_bf16 || dtype != at::kBFloat16 ||
                    options.process_group()->getBackendName() != "gloo",
                "DistributedOptions::reduce_dtype(kBFloat16): LibTorch ", torch_version,
                "'s Gloo backend cannot reduce bf16; reduce in kFloat (the default) or kHalf");
  return options;
}

}  // namespace detail
}  // namespace mixprec
