#pragma once
// ScalerCore: PyTorch's GradScaler API over the gradient passes, for the scalers and the
// Trainer's StepEngine. It owns the scale as the loss sees it (host value and device copy),
// and each iteration's records per optimizer: the stage (unscale_ and step once each, in that
// order, until update()) and the inf flag, read back to the host at most once. The passes
// themselves are grad_passes.hpp's; how the scale evolves is the scalers'.

#include <mixprec/core/error.hpp>
#include <mixprec/scaling/grad_passes.hpp>
#include <mixprec/scaling/options.hpp>
#include <mixprec/scaling/unscale.hpp>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

namespace mixprec::detail {

enum class Stage { ready, unscaled, stepped };

/// What the three scalers share: per-optimizer stages, the inf checks, unscale_ and step.
/// StepEngine (trainer/step_engine.hpp) builds the Trainer's step on it.
class ScalerCore {
 public:
  /// loss * scale; the scale lives on the loss's device from the first call on.
  at::Tensor scale(const at::Tensor& loss) {
    MIXPREC_CHECK(loss.defined(), "scale() got an undefined tensor: pass the loss");
    MIXPREC_CHECK(at::isFloatingType(loss.scalar_type()),
                  "scale() needs a floating-point loss, got ", loss.scalar_type());
    if (!scaling_) return loss;
    if (!scale_.defined()) scale_ = at::full({}, host_scale_, loss.options().dtype(at::kFloat));
    return loss * scale_.to(loss.device());
  }

  /// Divides the optimizer's gradients by the scale and records whether any is inf or NaN.
  void unscale_(torch::optim::Optimizer& optimizer) { (void)unscale_(optimizer, {}); }

  /// unscale_ with options; returns the total gradient norm (unscaled) when clipping.
  std::optional<double> unscale_(torch::optim::Optimizer& optimizer, const UnscaleOptions& options) {
    return unscale_planned(optimizer, UnscalePlan().max_grad_norm(options.max_grad_norm()));
  }

  /// Unscales if not done yet, then steps the optimizer unless its gradients hold inf or NaN.
  /// Returns whether it stepped. On a device this is the iteration's one host synchronisation
  /// (with clipping, the norm's read has taken its place).
  bool step(torch::optim::Optimizer& optimizer) {
    auto& entry = entry_of(optimizer);
    MIXPREC_CHECK(entry.stage != Stage::stepped,
                  "step() has already been called since the last update()");
    if (entry.stage == Stage::ready) unscale_(optimizer);
    if (!entry.found_inf.defined()) {
      entry.stage = Stage::ready;  // nothing was unscaled: the iteration can still go on
      detail::fail("step() found no gradients in this optimizer: call backward() on "
                   "scaler.scale(loss) before step()");
    }
    const bool finite = !found_of(entry);
    if (finite) {
      optimizer.step();
    } else {
      ++skipped_steps_;
    }
    entry.stage = Stage::stepped;
    return finite;
  }

  /// The current scale (1 for NoScaler). The scale is kept on the host and copied to the
  /// loss's device, so reading it never waits for the device.
  double get_scale() const { return scaling_ ? static_cast<double>(host_scale_) : 1.0; }

  /// Optimizer steps that this scaler's step() skipped because of inf or NaN, since
  /// construction (in your own loop; a Trainer's skipped steps are in Trainer::stats()).
  std::int64_t skipped_steps() const noexcept { return skipped_steps_; }

  /// Forgets this iteration's unscale_/step records without touching the scale, e.g. after an
  /// error between backward() and update() in your own loop.
  void reset_stages() noexcept { entries_.clear(); }

  // A copy would share the scale tensor with the original: move only.
  ScalerCore(const ScalerCore&) = delete;
  ScalerCore& operator=(const ScalerCore&) = delete;
  ScalerCore(ScalerCore&&) noexcept = default;
  ScalerCore& operator=(ScalerCore&&) noexcept = default;

 protected:
  ScalerCore(float init_scale, bool scaling, bool allow_fp16)
      : host_scale_(init_scale), scaling_(scaling), allow_fp16_(allow_fp16) {}

  /// unscale_ as the Trainer plans it (UnscalePlan): checks the stage, runs the passes, records.
  std::optional<double> unscale_planned(torch::optim::Optimizer& optimizer,
                                        const UnscalePlan& options) {
    auto& entry = entry_of(optimizer);
    MIXPREC_CHECK(entry.stage != Stage::unscaled,
                  "unscale_() has already been called on this optimizer since the last update()");
    MIXPREC_CHECK(entry.stage != Stage::stepped, "unscale_() is being called after step(): call it "
                  "between backward() and step(), and update() once per iteration");
    check_unscale_call(options);
    auto pairs = collect_grads(optimizer, options.grads_from());
    std::optional<double> norm;
    if (!pairs.empty() || options.collective_on()) {
      auto found_inf = passes_.new_found_inf(flag_device(pairs, options));
      try {
        norm = passes_.run_passes(pairs, options, found_inf, entry.found_host, scaling_, inv_scale());
      } catch (...) {
        // Some gradients may be unscaled already: poison the step rather than risk a retry
        // unscaling them twice.
        entry.found_inf = found_inf.fill_(1.0);
        entry.found_host = true;
        entry.stage = Stage::unscaled;
        throw;
      }
      entry.found_inf = found_inf;
      agree(options, entry);
    }
    entry.stage = Stage::unscaled;
    return norm;
  }

  /// Sets the scale on the host and, once it exists, on the device.
  void set_scale(float scale) {
    if (scale_.defined()) scale_.fill_(scale);  // a host value: no synchronisation
    host_scale_ = scale;
  }

  /// Whether any optimizer of this iteration had inf/NaN gradients; then the stages start
  /// over. step() has read each flag already; only an unscale_ without step() reads it here.
  bool take_found_inf(std::string_view caller) {
    bool any = false;
    bool recorded = false;
    for (auto& [optimizer, entry] : entries_) {
      if (!entry.found_inf.defined()) continue;
      recorded = true;
      any |= found_of(entry);
    }
    MIXPREC_CHECK(recorded, caller, " found no inf checks recorded in this iteration: call "
                  "step(optimizer) (or unscale_) after scale(loss).backward(), then update()");
    entries_.clear();
    return any;
  }

  /// One optimizer's record of this iteration.
  struct Entry {
    Stage stage = Stage::ready;
    at::Tensor found_inf;            // undefined: no gradient seen
    std::optional<bool> found_host;  // found_inf on the host, once known
  };

  /// The Errors of an unscale_ that must come before anything is touched.
  void check_unscale_call(const UnscalePlan& options) const {
    MIXPREC_CHECK(!scaling_ || scale_.defined(),
                  "unscale_() before scale(loss): the gradients were never scaled; call "
                  "scaler.scale(loss).backward() first");
    if (options.max_grad_norm()) {
      MIXPREC_CHECK(*options.max_grad_norm() > 0 && std::isfinite(*options.max_grad_norm()),
                    "max_grad_norm must be finite and > 0, got ", *options.max_grad_norm());
    }
  }

  /// The optimizer's gradients, each once, all validated (GradPasses::collect_grads).
  std::vector<GradPair> collect_grads(torch::optim::Optimizer& optimizer,
                                      const std::vector<at::Tensor>& grads_from) {
    return passes_.collect_grads(optimizer, grads_from, /*refuse_fp16=*/scaling_ && !allow_fp16_);
  }

  /// The device of the inf flag: the scale's (the gradients' without scaling).
  at::Device flag_device(const std::vector<GradPair>& pairs, const UnscalePlan& options) const {
    return scaling_         ? scale_.device()
           : !pairs.empty() ? pairs.front().to.device()
                            : *options.collective_on();
  }

  /// The entry's flag as every rank sees it (UnscalePlan::agree).
  static void agree(const UnscalePlan& options, Entry& entry) {
    GradPasses::agree(options, entry.found_inf, entry.found_host);
  }

  /// inv_scale = float(1 / double(scale)), as PyTorch computes it.
  double inv_scale() const {
    return scaling_ ? static_cast<double>(static_cast<float>(1.0 / static_cast<double>(host_scale_)))
                    : 1.0;
  }

  /// The entry's inf flag on the host, read back (a synchronisation on a device) only if unknown.
  static bool found_of(Entry& entry) {
    if (!entry.found_host) entry.found_host = entry.found_inf.item<float>() != 0.0F;
    return *entry.found_host;
  }

  /// This iteration's records, one per optimizer (a vector: one or two optimizers, and clearing
  /// it keeps its capacity, so a step allocates nothing here).
  Entry& entry_of(const torch::optim::Optimizer& optimizer) {
    for (auto& [key, entry] : entries_) {
      if (key == &optimizer) return entry;
    }
    return entries_.emplace_back(&optimizer, Entry{}).second;
  }

  at::Tensor scale_;  // 0-dim fp32 copy of host_scale_, made by the first scale() on the loss's device
  float host_scale_;  // the scale
  bool scaling_;
  bool allow_fp16_;
  std::int64_t skipped_steps_ = 0;
  GradPasses passes_;

 private:
  std::vector<std::pair<const torch::optim::Optimizer*, Entry>> entries_;
};

}  // namespace mixprec::detail
