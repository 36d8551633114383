#pragma once
// What on_step sees of a step's gradients: the gradient each model parameter was stepped with,
// unscaled (and clipped, where clipping applied), by the model's parameter names, read from the
// tensors the optimizer stepped (the fp32 masters under MixedO2, this rank's pieces under
// sharding, the parameters otherwise). Python's reference: `p.grad` after `scaler.step(opt)`,
// which GradScaler leaves unscaled (the fused optimizers write it back unscaled too).
//
// The gradient passes leave the step's gradients unscaled in place, except where the step
// divided by the scale without writing them (mixprec's one-pass lean step) or did not run (a
// step skipped after clipping found inf/NaN, or a fused step skipped): then `divisor` says what
// they must still be divided by. Those gradients are taken out of .grad() while on_step runs
// (a tensor's .grad() there is the step's gradient or none, never a scaled stand-in), and
// Trainer::gradients() returns them divided.

#include <mixprec/core/error.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/optim/master_weights.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <string>
#include <unordered_map>

namespace mixprec {

/// A model parameter's gradient as the optimizer stepped it (Trainer::gradients(), in on_step).
struct StepGradient {
  /// Unscaled (divided by the loss scale), averaged over the micro-batches (and ranks), clipped
  /// where clipping applied; in the dtype of what was stepped (fp32 for MixedO2's masters). The
  /// parameter's shape; with sharded data parallel, what this rank holds of it, flattened.
  at::Tensor value;
  /// Sharded data parallel: where `value` starts in the flattened parameter; else 0.
  std::int64_t offset = 0;
  /// Sharded data parallel: `value` is this rank's part of the gradient, flattened.
  bool part = false;
};

namespace detail {

/// The step's gradients while on_step runs on a report that ends an optimizer step.
class StepGradients {
 public:
  /// From the end of the optimizer step to the end of on_step: the gradients of the tensors
  /// the optimizer stepped, to be divided by `divisor` (1: they are unscaled already; else
  /// taken out of .grad() and kept here, handles only).
  void open(const torch::optim::Optimizer& optimizer, double divisor) {
    open_ = true;
    divisor_ = divisor;
    if (divisor == 1.0) return;
    for (const auto& t : unique_tensors(optimizer_tensors(optimizer))) {
      if (!t.grad().defined()) continue;
      held_.emplace(id_of(t), t.grad());
      t.mutable_grad().reset();
    }
  }
  void close() noexcept {
    open_ = false;
    held_.clear();
  }

  /// Each model parameter that the optimizer stepped with a gradient, by its name (a tied
  /// tensor under its first name): its master's gradient where it has one, sharded this rank's
  /// piece's, else its own. An Error outside on_step's report of an optimizer step (taken or
  /// skipped).
  torch::OrderedDict<std::string, StepGradient> read(const torch::nn::Module& model,
                                                     const torch::optim::Optimizer& optimizer,
                                                     const MasterWeights* masters,
                                                     const StepGroup* group) const {
    MIXPREC_CHECK(open_, "Trainer::gradients() is read inside on_step, on a report that ends "
                  "an optimizer step (status stepped or skipped): after step() returns the "
                  "gradients are none (as zero_grad() leaves them), and while accumulating "
                  "there is no step's gradient yet");
    const bool sharded = group != nullptr && group->sharded();
    // A parameter outside the optimizer may have a gradient, never unscaled: not stepped.
    const auto stepped = identities(optimizer_tensors(optimizer));
    torch::OrderedDict<std::string, StepGradient> result;
    for (const auto& [name, p] : unique_named(model.named_parameters())) {
      StepGradient g;
      at::Tensor holder;
      if (sharded) {
        holder = group->piece_of(p, g.offset);
        g.part = true;
      } else {
        holder = masters != nullptr ? masters->master_of(p) : at::Tensor();
        if (!holder.defined()) holder = p;
      }
      if (!holder.defined() || stepped.count(id_of(holder)) == 0) continue;
      const auto kept = held_.find(id_of(holder));
      const auto grad = kept != held_.end() ? kept->second : holder.grad();
      if (!grad.defined()) continue;
      // A lean master's gradient may be its model tensor's (bf16): given in the master's dtype.
      if (divisor_ != 1.0) {
        g.value = (grad.to(at::kFloat) / divisor_).to(holder.scalar_type());
      } else {
        g.value = grad.scalar_type() == holder.scalar_type() ? grad : grad.to(holder.scalar_type());
      }
      result.insert(name, std::move(g));
    }
    return result;
  }

 private:
  bool open_ = false;
  double divisor_ = 1.0;
  std::unordered_map<TensorId, at::Tensor> held_;  // where divisor_ != 1: the gradients
};

}  // namespace detail
}  // namespace mixprec
