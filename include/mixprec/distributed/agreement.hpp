#pragma once
// Owns what the ranks must agree on before they may go on: the same model (a fingerprint of its
// tensors), the same counts, the same step() call, one verdict on inf/NaN, "did any rank ...".
// Each is one small collective over Collectives; a disagreement is an Error on every rank.

#include <mixprec/core/held_shards.hpp>
#include <mixprec/distributed/collectives.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mixprec::detail {

// FNV-1a over the names, dtypes, shapes and requires_grad of a module's tensors, and which
// parameters are held in shards (core/held_shards.hpp).
inline std::uint64_t module_fingerprint(const torch::nn::Module& module) {
  std::uint64_t hash = 14695981039346656037ULL;
  auto mix = [&](const void* data, std::size_t size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < size; ++i) hash = (hash ^ bytes[i]) * 1099511628211ULL;
  };
  auto mix_tensor = [&](const std::string& name, const at::Tensor& t, bool grad) {
    mix(name.data(), name.size());
    const auto dtype = static_cast<int>(t.scalar_type());
    mix(&dtype, sizeof dtype);
    for (const auto size : t.sizes()) mix(&size, sizeof size);
    mix(&grad, sizeof grad);
  };
  for (const auto& item : module.named_parameters()) {
    mix_tensor("p:" + item.key(), item.value(), item.value().requires_grad());
    const bool held = HeldShards::is_placeholder(item.value());  // its value in shards
    mix(&held, sizeof held);
  }
  for (const auto& item : module.named_buffers()) mix_tensor("b:" + item.key(), item.value(), false);
  return hash;
}

/// An Error on every rank unless every rank's model has the same tensors: names, shapes,
/// dtypes and requires_grad, parameter by parameter and buffer by buffer. One all_gather.
inline void check_same_model(const Collectives& comm, const torch::nn::Module& model) {
  const auto mine = static_cast<std::int64_t>(module_fingerprint(model));
  const auto n = static_cast<std::int64_t>(model.named_parameters().size() +
                                           model.named_buffers().size());
  const auto all = comm.all_gather(at::tensor({mine, n}, at::kLong).to(comm.device()));
  std::vector<int> differ;
  for (int r = 0; r < comm.world_size(); ++r) {
    if (!all[static_cast<std::size_t>(r)].cpu().equal(all.front().cpu())) differ.push_back(r);
  }
  MIXPREC_CHECK(differ.empty(), "rank ", comm.rank(), ": the models of ranks ",
                at::IntArrayRef(std::vector<std::int64_t>(differ.begin(), differ.end())),
                " differ from rank 0's in their parameters or buffers (names, shapes, dtypes, "
                "requires_grad, or which are held in shards): build the same model, and freeze "
                "the same parameters, on every rank");
}

/// Whether two counts are the same on every rank (one all_gather).
inline bool all_equal(const Collectives& comm, std::int64_t a, std::int64_t b) {
  const auto all = comm.all_gather(at::tensor({a, b}, at::kLong).to(comm.device()));
  for (const auto& t : all) {
    if (!t.cpu().equal(all.front().cpu())) return false;
  }
  return true;
}

/// MAX-reduces a one-element inf flag, so that every rank steps or skips alike.
inline void agree(const Collectives& comm, at::Tensor& found_inf) {
  comm.allreduce_(found_inf, c10d::ReduceOp::MAX, "inf/NaN agreement");
}

/// A step's agreement: MAX-reduces `found_inf` so that every rank steps or skips alike, and
/// checks in the same allreduce (MAX over [found_inf, calls, -calls]) that every rank is at
/// the same step() call. A rank that went on after its step() threw is one call ahead: its
/// gradients were averaged with the others' previous step, and every rank gets this Error
/// before anything steps.
inline void agree_step(const Collectives& comm, at::Tensor& found_inf, std::int64_t calls) {
  const auto mine = static_cast<double>(calls % (std::int64_t{1} << 24));  // exact in fp32
  auto flags = at::cat({found_inf.reshape({1}).to(at::kFloat),
                        at::tensor({mine, -mine}, at::kFloat).to(found_inf.device())});
  agree(comm, flags);
  found_inf.copy_(flags.narrow(0, 0, 1).reshape(found_inf.sizes()));
  const auto seen = flags.narrow(0, 1, 2).cpu();
  const double most = seen[0].item<double>(), least = -seen[1].item<double>();
  MIXPREC_CHECK(most == mine && least == mine, "rank ", comm.rank(), ": the ranks are at "
                "different steps (this rank's step() call ", calls, "; the ranks' calls, "
                "modulo 2^24, range from ", least, " to ", most, "): a rank went on after its "
                "step() threw, so its gradients were averaged with another step's. Every rank "
                "must make the same Trainer calls; restart all ranks from the last checkpoint");
}

/// Whether `local` is true on any rank.
inline bool any(const Collectives& comm, bool local) {
  auto flag = at::full({1}, local ? 1.0F : 0.0F, at::kFloat).to(comm.device());
  agree(comm, flag);
  return flag.item<float>() != 0.0F;
}

}  // namespace mixprec::detail
