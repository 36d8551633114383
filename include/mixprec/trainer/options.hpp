#pragma once
// What a Trainer is told and what it tells: TrainerOptions, StepReport, TrainerStats.

#include <mixprec/distributed/step_group.hpp>
#include <mixprec/diagnostics/overflow.hpp>
#include <mixprec/diagnostics/gradient_stats.hpp>
#include <mixprec/diagnostics/non_finite_op.hpp>
#include <mixprec/core/policy.hpp>
#include <mixprec/scaling/scalers.hpp>

#include <ATen/core/Tensor.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>

namespace mixprec {

/// What a Trainer::step call did.
enum class StepStatus {
  stepped,       ///< the optimizer stepped
  skipped,       ///< inf or NaN in the loss or gradients: no update, the scale backed off
  accumulating,  ///< a micro-batch was added; the optimizer steps after accumulation_steps
};

/// "stepped", "skipped" or "accumulating", for logs.
inline std::ostream& operator<<(std::ostream& out, StepStatus status) {
  switch (status) {
    case StepStatus::stepped: return out << "stepped";
    case StepStatus::skipped: return out << "skipped";
    case StepStatus::accumulating: return out << "accumulating";
  }
  return out << "StepStatus(" << static_cast<int>(status) << ")";
}

/// The result of one Trainer::step call.
struct StepReport {
  StepStatus status = StepStatus::accumulating;
  at::Tensor loss;                   ///< the micro-batch loss, fp32, detached, unscaled
  double scale = 1.0;                ///< the loss scale this step used
  std::optional<double> grad_norm;   ///< total gradient norm, when clipping (max_grad_norm)
  std::int64_t step = 0;             ///< optimizer steps so far (taken or skipped)
  /// Which micro-batch of its optimizer step this is, 1 to accumulation_steps. 1 starts a
  /// step: what an on_step observer sums over a step's micro-batches starts over there (after
  /// load() or drop_accumulation() too, which drop the micro-batches accumulated before).
  std::int64_t micro_batch = 1;
  /// The learning rate of the optimizer's first param group for this optimizer step: the one
  /// its update used (or would have, when skipped); while accumulating, the one it will use.
  /// NaN for an optimizer whose options have no get_lr().
  double lr = 0.0;
  /// On a skipped step: where the inf/NaN was (the loss, which parameters' gradients).
  std::optional<Overflow> overflow;
  /// With TrainerOptions::find_non_finite_op: the first op of this micro-batch's forward pass
  /// whose output held inf/NaN, if one did.
  std::optional<NonFiniteOp> non_finite_op;
  /// With TrainerOptions::gradient_stats, on the steps it counts: fp16's view of the gradients.
  std::optional<GradientStats> gradient_stats;
  bool stepped() const noexcept { return status == StepStatus::stepped; }
};

/// Counters of a Trainer.
struct TrainerStats {
  std::int64_t steps = 0;          ///< optimizer steps taken or skipped
  std::int64_t skipped_steps = 0;  ///< of which skipped for inf/NaN
  std::int64_t micro_batches = 0;  ///< step() calls
  double scale = 1.0;              ///< the current loss scale
  /// The latest TrainerOptions::gradient_stats counted, if any.
  std::optional<GradientStats> gradient_stats;
};

namespace detail {

// The values of a TrainerOptions, kept together so that a policy's options convert whole.
struct TrainerSettings {
  std::int64_t accumulation_steps = 1;
  std::optional<double> max_grad_norm;
  std::optional<GradScalerOptions> scaler;
  std::function<void(const StepReport&)> on_step;
  bool fused_optimizer = false;
  std::shared_ptr<const DistributedOptions> distributed;  // null: one process
  MakeStepGroup make_step_group = nullptr;                 // set with `distributed`
  bool shard_optimizer_state = false;                      // distributed's, known before c10d
  bool find_non_finite_op = false;
  GradientStatsOptions gradient_stats;
  std::function<void(const std::string&)> on_warning;
  std::int64_t max_consecutive_skips = 64;
  std::shared_ptr<torch::optim::LRScheduler> lr_scheduler;
  std::function<double(std::int64_t)> lr_lambda;
  std::uint64_t rounding_seed = 0;
  bool step_in_backward = false;
};

// What a policy's options may set: scaler options where its scaler takes them; the fused
// optimizer step where the optimizer's parameters are fp32 (masters: MixedO2's, or the copies
// PureHalf<BFloat16, StochasticRounding<>> steps; not plain PureHalf's low dtype, where ATen's
// fused Adam would divide by the loss scale in that dtype), as the Trainer checks at run time.
// void: any policy, checked when the Trainer is built.
template <class P>
concept scaler_from_options =
    !std::is_same_v<typename P::scaler_type, NoScaler> &&
    std::is_constructible_v<typename P::scaler_type, const GradScalerOptions&>;
template <class P>
concept takes_scaler_options = std::is_void_v<P> || scaler_from_options<P>;
template <class P>
concept fp32_optimizer_params = !P::cast_model || P::master_weights;
template <class P>
concept takes_fused_optimizer = std::is_void_v<P> || fp32_optimizer_params<P>;

}  // namespace detail

/// Settings of a Trainer. `TrainerOptions` (P = void) fits every policy, and the Trainer checks
/// when it is built what its policy cannot take (an Error). `Trainer<P>::Options`, the same
/// settings typed by the policy, makes those mistakes compile errors: scaler(...) where P scales
/// nothing (NoScaler) or its scaler takes no GradScalerOptions, fused_optimizer(...) where P
/// keeps the optimizer's parameters in its low dtype (PureHalf without stochastic rounding).
// A setter that returns the options (for chaining) and a getter, as LibTorch's TORCH_ARG.
#define MIXPREC_TRAINER_OPTION(T, name)         \
  BasicTrainerOptions& name(T value) {          \
    settings_.name = std::move(value);          \
    return *this;                               \
  }                                             \
  const T& name() const noexcept { return settings_.name; }

template <class P = void>
class BasicTrainerOptions {
 public:
  BasicTrainerOptions() = default;
  /// A policy's options as TrainerOptions (what Trainer<P> keeps).
  template <class Q>
    requires(std::is_void_v<P> && !std::is_void_v<Q>)
  explicit BasicTrainerOptions(const BasicTrainerOptions<Q>& options)
      : settings_(options.settings()) {}

  /// Micro-batches per optimizer step; their gradients are averaged.
  MIXPREC_TRAINER_OPTION(std::int64_t, accumulation_steps)

  /// Clip the total L2 norm of the unscaled gradients to this value.
  MIXPREC_TRAINER_OPTION(std::optional<double>, max_grad_norm)

  /// Options of the policy's scaler, for a scaler constructible from them (GradScaler,
  /// StaticScaler). Under Trainer<P>::Options a compile error where P's scaler takes none
  /// (NoScaler); under TrainerOptions an Error when the Trainer is built.
  BasicTrainerOptions& scaler(std::optional<GradScalerOptions> value)
    requires detail::takes_scaler_options<P>
  {
    settings_.scaler = std::move(value);
    return *this;
  }
  const std::optional<GradScalerOptions>& scaler() const noexcept { return settings_.scaler; }

  /// Called after every step() with its report: steps, skips and accumulation alike.
  MIXPREC_TRAINER_OPTION(std::function<void(const StepReport&)>, on_step)

  /// Steps a torch::optim::Adam or AdamW through ATen's fused kernel, with the unscale (and the
  /// clip factor) folded into it: one pass over the parameters instead of about ten. Needs
  /// LibTorch >= 2.4 and fp32 optimizer parameters (every policy but PureHalf without
  /// stochastic rounding); under the lean storages on the CPU mixprec's one-pass kernel steps
  /// (any LibTorch), in ATen's arithmetic. Results equal the unfused step's within a derived
  /// rounding bound (docs/guide.md, "Fused Adam"). Under plain PureHalf a compile error with
  /// Trainer<P>::Options, an Error with TrainerOptions.
  BasicTrainerOptions& fused_optimizer(bool value)
    requires detail::takes_fused_optimizer<P>
  {
    settings_.fused_optimizer = value;
    return *this;
  }
  bool fused_optimizer() const noexcept { return settings_.fused_optimizer; }

  /// Data-parallel training over a c10d process group (docs/distributed.md): gradients are
  /// averaged across ranks before unscaling, every rank steps or skips alike, rank 0 writes
  /// the checkpoints. Every rank must construct its Trainer and call step/save/load alike.
  /// DistributedOptions comes with <mixprec/distributed.hpp>: a Trainer in one process
  /// compiles without c10d's headers (a template only for that reason).
  template <std::same_as<DistributedOptions> D>
  BasicTrainerOptions& distributed(D value) {
    settings_.shard_optimizer_state = value.shard_optimizer_state() || value.shard_gradients() ||
                                     !value.shard_parameters().empty();
    settings_.distributed = std::make_shared<const D>(std::move(value));
    settings_.make_step_group = &detail::StepGroupFactory<D>::make;
    return *this;
  }
  /// The data-parallel settings; null: one process.
  const DistributedOptions* distributed() const noexcept { return settings_.distributed.get(); }

  /// Debugging: watch every op of each forward pass (loss_fn) and report the first whose output
  /// held inf/NaN in StepReport::non_finite_op. Slow: it reads every op's output (on a device,
  /// a synchronisation per op); docs/diagnostics.md.
  MIXPREC_TRAINER_OPTION(bool, find_non_finite_op)

  /// Every N optimizer steps, count per parameter (or module prefix) how many gradient elements
  /// fp16 would flush to zero or overflow at the loss scale: StepReport::gradient_stats and
  /// TrainerStats::gradient_stats. One extra read of the gradients on those steps only.
  MIXPREC_TRAINER_OPTION(GradientStatsOptions, gradient_stats)

  /// Receives the Trainer's warnings (a precision that will be slow on this machine, ...);
  /// unset, they go to LibTorch's warning handler (TORCH_WARN: stderr unless the program set
  /// c10::WarningUtils' handler). mixprec never writes to stdout.
  MIXPREC_TRAINER_OPTION(std::function<void(const std::string&)>, on_warning)

  /// After this many optimizer steps in a row skipped for inf/NaN, step() throws an Error
  /// naming where the last one was (its StepReport::overflow), after reporting that step.
  /// A run whose loss scale only halves (a NaN in the data, a diverged model) is not training.
  /// 64 halvings take the default initial scale 2^16 to 2^-48, far below where any gradient
  /// survives; a healthy run skips a few steps in a row at most (log2(init_scale / the scale it
  /// needs) at the start, one at a time later). 0: no limit.
  MIXPREC_TRAINER_OPTION(std::int64_t, max_consecutive_skips)

  /// A LibTorch learning-rate scheduler (torch::optim::StepLR, or a subclass of LRScheduler)
  /// built on the Trainer's optimizer, which the Trainer steps once per optimizer step, taken
  /// or skipped (as `scheduler.step()` after `scaler.update()` in Python's loop; not once per
  /// micro-batch), and saves in its checkpoints. A scheduler that has not stepped yet makes its
  /// first step when the Trainer is built, as Python's schedulers do in their constructor: the
  /// lrs are then Python's step for step (LibTorch's StepLR stepped by hand decays one step
  /// later). Do not step it yourself too (an Error at the next step).
  MIXPREC_TRAINER_OPTION(std::shared_ptr<torch::optim::LRScheduler>, lr_scheduler)

  /// Python's LambdaLR: each param group's lr is its lr when the Trainer was built times
  /// f(step), step counting optimizer steps (taken or skipped) from 0. Saved in checkpoints
  /// (the base lrs; the step is the Trainer's). An lr that is not finite and >= 0 is an Error.
  MIXPREC_TRAINER_OPTION(std::function<double(std::int64_t)>, lr_lambda)

  /// StochasticRounding's seed: the bits that round element i of the k-th tensor at optimizer
  /// step s are a hash of (seed, s, k, i) (optim/lean_kernels.hpp), the same on every data
  /// parallel rank and after a checkpoint's load (which restores the seed and s). 0 by default.
  /// MixedFP8<NVFP4Scaling<>> draws its gradients' stochastic rounding and its Hadamard signs
  /// from the same seed (fp8/nvfp4.hpp).
  MIXPREC_TRAINER_OPTION(std::uint64_t, rounding_seed)

  /// The optimizer step inside the backward pass (PyTorch's optimizer-in-backward recipe): each
  /// trained tensor is checked and stepped as soon as its gradient is complete, and that
  /// gradient freed at once, so that the step holds one tensor's gradient at a time instead of
  /// all of them (docs/guide.md, "The step inside the backward pass"). The same updates as the
  /// ordinary step, bit for bit. Needs LibTorch >= 2.1, a policy that scales no loss (fp32,
  /// bf16), the one-pass step under a lean storage, one process; an Error with clipping by the
  /// global norm, accumulation_steps > 1, gradient_stats or an fp8 policy, which need every
  /// gradient before the first update. A loss that is inf/NaN skips the step whole; a gradient
  /// that is (the loss finite) stops it with an Error that names the tensor, the tensors
  /// stepped before it updated: restore a checkpoint. on_step's gradients() are gone (freed).
  MIXPREC_TRAINER_OPTION(bool, step_in_backward)

  /// Every value, as the Trainer reads them.
  const detail::TrainerSettings& settings() const noexcept { return settings_; }

 private:
  detail::TrainerSettings settings_;
};

#undef MIXPREC_TRAINER_OPTION

/// Options for any policy (checked at run time by the Trainer).
using TrainerOptions = BasicTrainerOptions<>;

}  // namespace mixprec
