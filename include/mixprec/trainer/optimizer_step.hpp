#pragma once
// The end of a Trainer's optimizer step: what the gradient passes are asked to do (clip, read
// the model's gradients into the masters', agree across ranks, check the losses and fp8's amaxes
// too), the step taken or skipped (the optimizer's own step, or ATen's fused Adam with the
// unscale folded in), and what follows a step taken.

#include <mixprec/distributed/step_group.hpp>
#include <mixprec/optim/fused_adam.hpp>
#include <mixprec/optim/lean_adam_step.hpp>
#include <mixprec/optim/master_weights.hpp>
#include <mixprec/scaling/grad_passes.hpp>
#include <mixprec/trainer/options.hpp>
#include <mixprec/trainer/step_engine.hpp>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>

namespace mixprec::detail {

/// The gradient passes of the last micro-batch of `n`: masters read the model's gradients only
/// where nothing accumulated them first (one micro-batch, one process); data parallel agrees on
/// the inf/NaN flag (and, sharded, sums the norm's parts) at step() call `calls`; `losses` and
/// fp8's `amaxes` join the inf/NaN check (a NaN loss can have finite gradients).
inline UnscalePlan plan_unscale(const TrainerOptions& options, const MasterWeights* masters,
                                std::int64_t n, StepGroup* group, std::int64_t calls,
                                const at::Tensor& losses, const at::Tensor& amaxes) {
  UnscalePlan plan;
  plan.max_grad_norm(options.max_grad_norm());
  if (masters != nullptr && n == 1 && group == nullptr) {
    plan.grads_from(masters->grad_sources());  // else in place
  }
  if (group != nullptr) {
    plan.agree([group, calls](at::Tensor& found) { group->agree_step(found, calls); });
    if (group->sharded()) {
      plan.collective_on(group->device());
      plan.sum_over_ranks([group](double& sum_of_squares, bool& non_finite) {
        group->sum_over_shards(sum_of_squares, non_finite);
      });
    }
  }
  // On the CPU the loss check is a read of one float; on a device it joins the gradients' inf
  // check, without a synchronisation.
  at::Tensor also_check;
  if (!losses.device().is_cpu() || !std::isfinite(losses.item<double>())) also_check = losses;
  // fp8: an inf/NaN amax skips the step (a saturating cast would have hidden an inf).
  if (amaxes.defined()) {
    also_check = also_check.defined()
                     ? at::cat({also_check.reshape({-1}).to(amaxes.options()), amaxes})
                     : amaxes;
  }
  if (also_check.defined()) plan.also_check(also_check);
  return plan;
}

/// What take_optimizer_step did.
struct OptimizerStep {
  bool stepped = false;             ///< false: inf/NaN, skipped
  std::optional<double> grad_norm;  ///< the total unscaled gradient norm, when clipping
  /// What the optimizer's gradients must still be divided by to be the step's unscaled (and
  /// clipped) ones: 1 where the passes or ATen's fused step wrote them so; the scale where a
  /// skipped step left them scaled; the step's divisor where mixprec's one-pass lean step
  /// divided as it read them (step_gradients.hpp).
  double grad_divisor = 1.0;
};

/// A one-pass step over what a storage keeps, gradients divided by its argument (lean_step.hpp's
/// one_pass_step_of: lean_adam_step, quantized_adam_step).
using OnePassStep = std::function<void(const at::Tensor&)>;

/// A step skipped because clipping's read pass found inf/NaN writes nothing: masters that
/// were to read the model's gradients (UnscalePlan::grads_from) get them as they are, scaled.
inline void copy_skipped_grads(torch::optim::Optimizer& optimizer, const UnscalePlan& plan) {
  const auto& sources = plan.grads_from();
  std::size_t i = 0;
  at::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      const auto& grad = sources[i++].grad();
      if (grad.defined() && !grad.is_sparse()) p.mutable_grad() = grad.to(p.scalar_type());
    }
  }
}

/// Unscales, checks, clips, and steps or skips (`fused`: through ATen's fused Adam/AdamW, which
/// divides by the scale itself); the engine is ready for the next step whatever happens.
/// `one_pass`: the step that updates what a lean storage keeps in one pass instead of ATen's
/// kernel (it divides by the scale too).
inline OptimizerStep take_optimizer_step(StepEngine& engine, torch::optim::Optimizer& optimizer,
                                         const UnscalePlan& plan, bool fused,
                                         const OnePassStep& one_pass = {}) {
  OptimizerStep result;
  const double scale = engine.get_scale();
  try {
    if (fused || one_pass) {
      const auto done = engine.step_fused(optimizer, plan, [&](const at::Tensor& divisor) {
        if (one_pass) {
          one_pass(divisor);
          // The one pass divides as it reads (on the CPU: a host value).
          if (divisor.defined()) result.grad_divisor = divisor.item<double>();
        } else {
          fused_adam_step(optimizer, divisor);  // writes the divided gradients back
        }
      });
      result.stepped = done.stepped;
      result.grad_norm = done.grad_norm;
      if (!result.stepped) result.grad_divisor = scale;
    } else {
      result.grad_norm = engine.unscale_planned(optimizer, plan);
      result.stepped = engine.step(optimizer);
      // Clipping's read pass found inf/NaN (here, or sharded on any rank): nothing was divided.
      if (!result.stepped && result.grad_norm && !std::isfinite(*result.grad_norm)) {
        result.grad_divisor = scale;
        if (!plan.grads_from().empty()) copy_skipped_grads(optimizer, plan);
      }
    }
  } catch (...) {
    engine.reset_stages();
    throw;
  }
  engine.reset_stages();
  return result;
}

/// After a step taken: the masters rounded into the model; sharded, every rank's stepped
/// slices into every rank's model (a peer lost here leaves this rank's slices stepped and its
/// model not: restore from a checkpoint); autocast's cached casts of the old weights dropped.
inline void after_step_taken(MasterWeights* masters, StepGroup* group) {
  if (masters != nullptr) masters->copy_to_model();
  if (group != nullptr && group->sharded()) group->gather_parameters();
  at::autocast::clear_cache();
}

}  // namespace mixprec::detail
