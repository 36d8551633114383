#pragma once
// What a Trainer is told and what it tells: TrainerOptions, StepReport, TrainerStats.

#include <mixprec/diagnostics.hpp>
#include <mixprec/distributed.hpp>
#include <mixprec/scaler.hpp>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>

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

/// Settings of a Trainer.
struct TrainerOptions {
  /// Micro-batches per optimizer step; their gradients are averaged.
  TORCH_ARG(std::int64_t, accumulation_steps) = 1;
  /// Clip the total L2 norm of the unscaled gradients to this value.
  TORCH_ARG(std::optional<double>, max_grad_norm) = std::nullopt;
  /// Options of the policy's scaler; an error for a policy whose scaler is NoScaler.
  TORCH_ARG(std::optional<GradScalerOptions>, scaler) = std::nullopt;
  /// Called after every step() with its report: steps, skips and accumulation alike.
  TORCH_ARG(std::function<void(const StepReport&)>, on_step) = nullptr;
  /// Steps a torch::optim::Adam or AdamW through ATen's fused kernel, with the unscale (and the
  /// clip factor) folded into it: one pass over the parameters instead of about ten. Needs
  /// LibTorch >= 2.4 and fp32 optimizer parameters (every policy but PureHalf); results equal
  /// the unfused step's up to rounding (docs/guide.md, "Fused Adam").
  TORCH_ARG(bool, fused_optimizer) = false;
  /// Data-parallel training over a c10d process group (docs/distributed.md): gradients are
  /// averaged across ranks before unscaling, every rank steps or skips alike, rank 0 writes
  /// the checkpoints. Every rank must construct its Trainer and call step/save/load alike.
  TORCH_ARG(std::optional<DistributedOptions>, distributed) = std::nullopt;
  /// Debugging: watch every op of each forward pass (loss_fn) and report the first whose output
  /// held inf/NaN in StepReport::non_finite_op. Slow: it reads every op's output (on a device,
  /// a synchronisation per op); docs/diagnostics.md.
  TORCH_ARG(bool, find_non_finite_op) = false;
  /// Every N optimizer steps, count per parameter (or module prefix) how many gradient elements
  /// fp16 would flush to zero or overflow at the loss scale: StepReport::gradient_stats and
  /// TrainerStats::gradient_stats. One extra read of the gradients on those steps only.
  TORCH_ARG(GradientStatsOptions, gradient_stats) = {};
  /// Receives the Trainer's warnings (a precision that will be slow on this machine, ...);
  /// unset, they go to LibTorch's warning handler (TORCH_WARN: stderr unless the program set
  /// c10::WarningUtils' handler). mixprec never writes to stdout.
  TORCH_ARG(std::function<void(const std::string&)>, on_warning) = nullptr;
  /// After this many optimizer steps in a row skipped for inf/NaN, step() throws an Error
  /// naming where the last one was (its StepReport::overflow), after reporting that step.
  /// A run whose loss scale only halves (a NaN in the data, a diverged model) is not training.
  /// 64 halvings take the default initial scale 2^16 to 2^-48, far below where any gradient
  /// survives; a healthy run skips a few steps in a row at most (log2(init_scale / the scale it
  /// needs) at the start, one at a time later). 0: no limit.
  TORCH_ARG(std::int64_t, max_consecutive_skips) = 64;
};

}  // namespace mixprec
