#pragma once
// A Trainer's checkpoints under data parallel: every rank's RNG state in one file (and a stream of
// its own for a rank the file did not have), the consolidated view of sharded optimizer state
// that makes a checkpoint the same at any world size, rank 0 writing while the others wait for
// its verdict, and every rank voting before any loads.

#include <mixprec/core/error.hpp>
#include <mixprec/core/rng_states.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/optim/master_weights.hpp>
#include <mixprec/optim/sharded_state.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace mixprec::detail {

/// The CPU random stream of a rank that a checkpoint did not have (a run resumed on more ranks
/// than it was saved with): a generator seeded with splitmix64(d ^ rank), where d is the first
/// 64-bit draw of rank 0's saved stream. Distinct for every rank, the same on every resume.
inline at::Tensor derived_rng_state(const at::Tensor& rank0_state, int rank) {
  auto rank0 = at::make_generator<at::CPUGeneratorImpl>();
  rank0.set_state(rank0_state);
  std::uint64_t z =
      rank0.get<at::CPUGeneratorImpl>()->random64() ^ static_cast<std::uint64_t>(rank);
  z += 0x9e3779b97f4a7c15ULL;  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return at::make_generator<at::CPUGeneratorImpl>(z).get_state();
}

/// Data parallel: every rank's CPU RNG state, and CUDA's of its model's device, in rank order.
struct RankRngs {
  std::vector<at::Tensor> cpu, cuda;
};

// Collective; one process: none (the checkpoint holds this process's own).
inline RankRngs gather_rngs(StepGroup* group) {
  if (group == nullptr) return {};
  RankRngs rngs;
  rngs.cpu = group->all_gather(cpu_rng_state().to(group->device()));
  if (group->device().is_cuda()) {
    auto generator = cuda_generator(static_cast<std::size_t>(group->device().index()));
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(generator.mutex());
      state = generator.get_state();
    }
    rngs.cuda = group->all_gather(state.to(group->device()));
  }
  return rngs;
}

/// Sharded data parallel: the optimizer (and masters) an unsharded Trainer would hold, over full
/// tensors, so that a checkpoint is the same whatever the world size or sharding: written from
/// it, read into it and then scattered to the ranks' pieces.
struct ConsolidatedState {
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::optional<MasterWeights> masters;
  const MasterWeights* masters_or_null() const { return masters ? &*masters : nullptr; }
};

/// The consolidated view of a sharded `group` training `optimizer`: with masters (MixedO2)
/// made from every rank's pieces where `values` (else of undefined value, for a load to fill),
/// and every rank's optimizer state where `state`. Collective when either is true.
inline ConsolidatedState consolidate(StepGroup& group, const torch::optim::Optimizer& optimizer,
                                     bool master_weights, bool values, bool state) {
  ConsolidatedState view;
  const auto groups = group.sharded_groups();
  view.optimizer = optimizer_like(optimizer, groups);
  if (master_weights) {
    const auto gathered = values ? group.gather_values() : std::vector<std::vector<at::Tensor>>{};
    std::vector<at::Tensor> params, fp32_values;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      for (std::size_t j = 0; j < groups[g].size(); ++j) {
        params.push_back(groups[g][j]);
        fp32_values.push_back(values ? gathered[g][j]
                                     : at::empty(groups[g][j].sizes(),
                                                 groups[g][j].options().dtype(at::kFloat)));
      }
    }
    view.masters.emplace(params, fp32_values, *view.optimizer);
  }
  if (state) group.gather_state(*view.optimizer);
  return view;
}

// Data parallel: rank 0 runs `write`; every rank throws if it failed (rank 0 its own Error).
template <class Write>
void write_on_rank0(StepGroup* group, const std::string& path, Write&& write) {
  if (group == nullptr) return write();
  std::exception_ptr failure;
  if (group->rank() == 0) {
    try {
      write();
    } catch (...) {
      failure = std::current_exception();
    }
  }
  const bool failed = group->any(failure != nullptr);
  if (failure) std::rethrow_exception(failure);
  MIXPREC_CHECK(!failed, "rank ", group->rank(), ": rank 0 could not write checkpoint '", path,
                "' (its Error says why)");
}

// Data parallel: `load(commit)` reads and checks, then calls commit(), which returns only if
// every rank could; after it, `load` changes the trainer. Any rank that fails, fails them all.
template <class Load>
auto voted_load(StepGroup* group, const std::string& source, Load&& load) {
  bool voted = false;  // whether this rank has said if it can load
  auto commit = [&] {
    if (group == nullptr) return;
    voted = true;
    MIXPREC_CHECK(!group->any(false), "rank ", group->rank(), ": another rank could not load "
                  "checkpoint '", source, "' (its Error says why); nothing was changed on any "
                  "rank");
  };
  try {
    return load(commit);
  } catch (...) {
    if (group != nullptr && !voted) (void)group->any(true);
    throw;
  }
}

}  // namespace mixprec::detail
