#pragma once
// StepEngine: the gradient passes of a Trainer's step (only the Trainer uses it). The policy's
// LossScaler chooses the scale and nothing else; this engine scales the loss by it, then
// unscales, checks (the loss included), clips, lets data parallel ranks agree, and steps or
// skips, either as unscale_ then step or fused into an optimizer step that divides the
// gradients itself (mixprec::fused_adam_step). Its records and passes are ScalerCore's.

#include <mixprec/core/error.hpp>
#include <mixprec/scaling/grad_passes.hpp>
#include <mixprec/scaling/options.hpp>
#include <mixprec/scaling/scaler_core.hpp>
#include <mixprec/scaling/unscale.hpp>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <limits>
#include <optional>
#include <utility>

namespace mixprec::detail {

/// What StepEngine::step_fused did.
struct FusedStepResult {
  bool stepped = false;                ///< false: inf/NaN, the optimizer step was skipped
  std::optional<double> grad_norm;     ///< the total unscaled gradient norm, when clipping
};

/// The gradient passes of a Trainer's step: scale the loss, then unscale, check, clip, agree
/// across ranks and step or skip, with the scale of the policy's LossScaler, which chooses the
/// scale and nothing else. Move only, as the scalers.
class StepEngine final : public ScalerCore {
 public:
  /// allow_fp16: unscale fp16 gradients in place (a policy that casts the model without masters).
  explicit StepEngine(bool allow_fp16) : ScalerCore(1.0F, false, allow_fp16) {}

  /// Uses `scale` (the scaler's get_scale()) from now on; scale 1 multiplies and divides
  /// nothing. An Error, before anything changes, unless it is a positive normal fp32 value.
  void use_scale(double value) {
    const auto scale = checked_scale(value, "the scaler's get_scale()");
    if (scale == host_scale_ && scaling_ == (scale != 1.0F)) return;
    scaling_ = scale != 1.0F;
    set_scale(scale);
  }

  /// The scale of a step's micro-batch: taken on the first, and the same after it (their
  /// gradients add up), compared as the fp32 values the step uses (1000.1 is not an fp32 number).
  void use_scale(double value, bool first_micro_batch) {
    if (first_micro_batch) return use_scale(value);
    MIXPREC_CHECK(static_cast<float>(value) == static_cast<float>(get_scale()), "the scaler's "
                  "scale changed from ", get_scale(), " to ", value, " between micro-batches of "
                  "one step: set it between optimizer steps");
  }

  /// unscale_ and step in one, for an optimizer whose own step divides the gradients, such as
  /// mixprec::fused_adam_step: the gradients are checked for inf/NaN (under master weights,
  /// copied from grads_from first) but not divided; unless they hold inf/NaN,
  /// `fused_step(grad_scale)` steps the optimizer, grad_scale being the one fp32 divisor it must
  /// apply: the scale, divided by the clip coefficient when clipping; undefined when that is 1.
  /// update() follows as usual. One host synchronisation, on the inf flag.
  template <class FusedStep>
  FusedStepResult step_fused(torch::optim::Optimizer& optimizer, const UnscalePlan& options,
                             FusedStep&& fused_step) {
    auto& entry = entry_of(optimizer);
    MIXPREC_CHECK(entry.stage == Stage::ready, "step_fused() unscales inside the optimizer's "
                  "step: call it instead of unscale_() and step(), once per iteration");
    check_unscale_call(options);
    auto pairs = collect_grads(optimizer, options.grads_from());
    MIXPREC_CHECK(!pairs.empty() || options.collective_on(), "step_fused() found no gradients "
                  "in this optimizer: call backward() on scaler.scale(loss) first");
    auto found_inf = passes_.new_found_inf(flag_device(pairs, options));
    FusedStepResult result;
    at::Tensor grad_scale;
    const bool masters = !options.grads_from().empty();
    try {
      if (masters) {
        // The model's gradients into the optimizer's, checked, undivided (fp16/bf16 values are
        // finite in fp32: the check is exact).
        detail::unscale_pairs_(pairs, 1.0F, found_inf);
        for (auto& pair : pairs) pair.from = pair.to;
      }
      const double scale = scaling_ ? static_cast<double>(host_scale_) : 1.0;
      double clip = 1.0;
      if (options.max_grad_norm()) {
        // One read pass: the norm and finiteness (the loss's included).
        const auto stats = GradPasses::summed_stats(pairs, options);
        entry.found_host = stats.non_finite;
        if (stats.non_finite) found_inf.fill_(1.0);
        result.grad_norm = stats.non_finite ? std::numeric_limits<double>::infinity()
                                            : std::sqrt(stats.sum_of_squares) * inv_scale();
        if (!stats.non_finite) clip = GradPasses::clip_coefficient(*result.grad_norm, options);
      } else if (!masters) {
        // Finiteness alone (the loss's included).
        entry.found_host = detail::any_non_finite(pairs, options.also_check());
        if (*entry.found_host) found_inf.fill_(1.0);
      } else {
        GradPasses::check_also(options, found_inf);
      }
      if (clip < 1.0) {
        grad_scale = at::full({}, static_cast<float>(scale / clip),
                              at::TensorOptions(at::kFloat).device(found_inf.device()));
      } else if (scaling_) {
        grad_scale = scale_;
      }
    } catch (...) {
      entry.found_inf = found_inf.fill_(1.0);  // nothing was divided; the step must not run
      entry.found_host = true;
      entry.stage = Stage::stepped;
      throw;
    }
    entry.found_inf = found_inf;
    entry.stage = Stage::stepped;
    agree(options, entry);
    result.stepped = !found_of(entry);
    if (result.stepped) {
      std::forward<FusedStep>(fused_step)(grad_scale);
    } else {
      ++skipped_steps_;
    }
    return result;
  }

  using ScalerCore::scale;
  using ScalerCore::step;
  using ScalerCore::unscale_planned;
  using ScalerCore::reset_stages;
};

}  // namespace mixprec::detail
