#pragma once
// Trainer::state_bytes(): the bytes of training state a Trainer holds now, summed from the
// tensors themselves (numel x element size of each distinct storage, not an allocator's
// statistics), by kind: what a lean storage (core/state_storage.hpp) saves is read here.

#include <mixprec/distributed/step_group.hpp>
#include <mixprec/optim/master_weights.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <initializer_list>
#include <set>

namespace mixprec {

/// What Trainer::state_bytes() counts. Each storage once (a tied weight, a master that is the
/// fp32 parameter itself).
struct TrainingStateBytes {
  std::int64_t weights = 0;    ///< the model's parameters
  /// Gradients held now: the model's, the masters', data parallel's buckets and slices.
  std::int64_t gradients = 0;
  /// fp32 masters (sharded: this rank's pieces), or what a lean storage keeps of them.
  std::int64_t masters = 0;
  std::int64_t optimizer = 0;  ///< the optimizer's state (moments, momentum buffers, sums)
  /// Whether the optimizer's state was counted: Adam, AdamW, SGD, RMSprop and Adagrad are.
  bool optimizer_known = true;
  std::int64_t total() const noexcept { return weights + gradients + masters + optimizer; }
};

namespace detail {

class StorageCounter {
 public:
  std::int64_t add(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return 0;
    if (!seen_.insert(t.storage().unsafeGetStorageImpl()).second) return 0;
    return static_cast<std::int64_t>(t.storage().nbytes());
  }

 private:
  std::set<const void*> seen_;
};

inline std::int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer,
                                          StorageCounter& count, bool& known) {
  std::int64_t bytes = 0;
  const auto add = [&](std::initializer_list<at::Tensor> tensors) {
    for (const auto& t : tensors) bytes += count.add(t);
  };
  for (const auto& [key, state] : optimizer.state()) {
    const auto* s = state.get();
    if (const auto* a = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
      add({a->exp_avg(), a->exp_avg_sq(), a->max_exp_avg_sq()});
    } else if (const auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
      add({w->exp_avg(), w->exp_avg_sq(), w->max_exp_avg_sq()});
    } else if (const auto* m = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
      add({m->momentum_buffer()});
    } else if (const auto* r = dynamic_cast<const torch::optim::RMSpropParamState*>(s)) {
      add({r->square_avg(), r->momentum_buffer(), r->grad_avg()});
    } else if (const auto* g = dynamic_cast<const torch::optim::AdagradParamState*>(s)) {
      add({g->sum()});
    } else {
      known = false;
    }
  }
  return bytes;
}

inline TrainingStateBytes state_bytes(const torch::nn::Module& model, const MasterWeights* masters,
                                      const torch::optim::Optimizer& optimizer,
                                      const StepGroup* group = nullptr) {
  TrainingStateBytes bytes;
  StorageCounter count;
  for (const auto& p : model.parameters()) {
    bytes.weights += count.add(p);
    bytes.gradients += count.add(p.grad());
  }
  if (group != nullptr) {
    // Sharded: the optimizer's tensors that are not the model's are this rank's masters (a
    // piece that is a view of an fp32 parameter was counted with the weights), or, in a Low
    // dtype, what it keeps of a ZeRO-3 unit's weights (PureHalf: no masters); the pieces'
    // gradients are views of the buffers.
    for (const auto& t : group->buffers()) bytes.gradients += count.add(t);
    // A lean storage of the pieces (their placeholders count a few bytes): ZeRO-3 units' bf16
    // pieces are what this rank keeps of their weights; remainders are masters.
    bytes.weights += group->lean_bytes(/*weights=*/true);
    bytes.masters += group->lean_bytes(/*weights=*/false);
    for (const auto& g : optimizer.param_groups()) {
      for (const auto& p : g.params()) {
        (p.scalar_type() == at::kFloat ? bytes.masters : bytes.weights) += count.add(p);
        bytes.gradients += count.add(p.grad());
      }
    }
  }
  if (masters != nullptr) {
    for (const auto& m : masters->masters()) {
      bytes.masters += count.add(m);  // a lean master between steps: its one-element NaN
      bytes.gradients += count.add(m.grad());
    }
    if (const auto* lean = masters->lean()) bytes.masters += lean->stowed_bytes();
  }
  bytes.optimizer = optimizer_state_bytes(optimizer, count, bytes.optimizer_known);
  return bytes;
}

}  // namespace detail
}  // namespace mixprec
