#pragma once
// Where a Trainer's gradients are between its calls: none after an optimizer step (cleared, as
// PyTorch's zero_grad(set_to_none=True)), and between the micro-batches of an accumulation the
// partial sums held here, out of the tensors' .grad(), where an optimizer.step() outside the
// Trainer would apply them. Moves handles, copies nothing.

#include <mixprec/core/tensor_set.hpp>
#include <mixprec/optim/master_weights.hpp>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <utility>
#include <vector>

namespace mixprec::detail {

class GradientHold {
 public:
  /// Every gradient none: the model's tensors, the optimizer's, the masters'; nothing held.
  void clear(const std::vector<at::Tensor>& params, const torch::optim::Optimizer& optimizer,
             const MasterWeights* masters) {
    held_.clear();
    clear_grads(params);
    for (const auto& group : optimizer.param_groups()) clear_grads(group.params());
    if (masters != nullptr) clear_grads(masters->masters());
  }

  /// The same tensors' gradients taken out of .grad() and kept.
  void hold(const std::vector<at::Tensor>& params, const torch::optim::Optimizer& optimizer,
            const MasterWeights* masters) {
    for (const auto& p : params) take(p);
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) take(p);
    }
    if (masters != nullptr) {
      for (const auto& m : masters->masters()) take(m);
    }
  }

  /// The held gradients back in .grad(), where the next backward pass adds to them.
  void release() {
    for (auto& [tensor, grad] : held_) tensor.mutable_grad() = std::move(grad);
    held_.clear();
  }

 private:
  void take(const at::Tensor& t) {
    if (!t.grad().defined()) return;
    held_.emplace_back(t, t.grad());
    t.mutable_grad().reset();
  }

  std::vector<std::pair<at::Tensor, at::Tensor>> held_;  // (tensor, its gradient)
};

}  // namespace mixprec::detail
