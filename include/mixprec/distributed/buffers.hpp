#pragma once
// Owns the copy of rank 0's module state to every rank: the buffers before each forward pass
// (DDP's broadcast_buffers), and the parameters too when DataParallel starts. One flat
// broadcast per dtype, bit for bit.

#include <mixprec/core/held_shards.hpp>
#include <mixprec/distributed/collectives.hpp>
#include <mixprec/core/tensor_set.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace mixprec::detail {

/// Copies rank 0's buffers to every rank (or, with `parameters`, its parameters too).
inline void broadcast_from_rank0(const Collectives& comm, torch::nn::Module& model,
                                 bool parameters) {
  std::vector<at::Tensor> tensors;
  if (parameters) {
    for (const auto& p : model.parameters()) {
      // Held in shards (a unit's, built so): no value here; its pieces are laid out as they are.
      if (!HeldShards::is_placeholder(p)) tensors.push_back(p);
    }
  }
  for (const auto& b : model.buffers()) tensors.push_back(b);
  tensors = unique_tensors(tensors);
  // One flat tensor per dtype: Gloo broadcasts one tensor per call.
  std::vector<c10::ScalarType> dtypes;
  for (const auto& t : tensors) {
    if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) == dtypes.end()) {
      dtypes.push_back(t.scalar_type());
    }
  }
  at::NoGradGuard no_grad;
  for (const auto dtype : dtypes) {
    std::vector<at::Tensor> group_tensors, flat;
    for (const auto& t : tensors) {
      if (t.scalar_type() != dtype) continue;
      group_tensors.push_back(t);
      flat.push_back(t.detach().reshape({-1}));
    }
    auto all = at::cat(flat);
    comm.broadcast_from_rank0_(all);
    std::int64_t offset = 0;
    for (auto& t : group_tensors) {
      t.copy_(all.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace mixprec::detail
