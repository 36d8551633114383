#pragma once
/// Loss scalers: GradScaler (dynamic, PyTorch's algorithm and state_dict), StaticScaler (a fixed
/// scale) and NoScaler (scale 1). In your own loop they have PyTorch's GradScaler API, and all
/// three skip an optimizer step whose gradients hold inf or NaN, so a bad step never reaches the
/// weights. Under a Trainer a scaler only chooses the scale (the LossScaler concept); the
/// Trainer's step unscales, checks, clips and skips itself (detail::StepEngine,
/// trainer/step_engine.hpp).
///
///   mixprec::GradScaler scaler;                       // init_scale 65536, growth every 2000 steps
///   for (auto& batch : loader) {
///     optimizer.zero_grad();
///     auto loss = compute_loss(batch);                // under mixprec::autocast<P>() for O1
///     scaler.scale(loss).backward();
///     scaler.unscale_(optimizer);                     // optional: before clipping or inspecting grads
///     torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
///     if (!scaler.step(optimizer)) log_skip(scaler.get_scale());  // false: inf/NaN, step skipped
///     scaler.update();
///   }
//
// This room owns the three scalers: how each one's scale evolves (GradScaler through
// detail::next_scale of options.hpp), update() and update_scale(), and their state_dict. What
// they share (stages, unscale_, step) is ScalerCore's, in scaler_core.hpp.

#include <mixprec/core/concepts.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/scaling/options.hpp>
#include <mixprec/scaling/scaler_core.hpp>

#include <ATen/core/Dict.h>

#include <cmath>
#include <cstdint>
#include <utility>

namespace mixprec {
namespace detail {

/// A number of a state dict: Python saves whole-valued floats as ints in hand-written dicts.
inline double state_number(const c10::impl::GenericDict& dict, const char* key) {
  MIXPREC_CHECK(dict.contains(key), "state dict lacks the key '", key, "'");
  const auto value = dict.at(key);
  MIXPREC_CHECK(value.isDouble() || value.isInt(), "state dict key '", key,
                "' must be a number, got ", value.tagKind());
  return value.isDouble() ? value.toDouble() : static_cast<double>(value.toInt());
}

inline std::int64_t state_integer(const c10::impl::GenericDict& dict, const char* key) {
  MIXPREC_CHECK(dict.contains(key), "state dict lacks the key '", key, "'");
  const auto value = dict.at(key);
  MIXPREC_CHECK(value.isInt(), "state dict key '", key, "' must be an integer, got ",
                value.tagKind());
  return value.toInt();
}

}  // namespace detail

/// Dynamic loss scaling, PyTorch's GradScaler in C++: same algorithm, errors and state_dict keys.
class GradScaler : public detail::ScalerCore {
 public:
  explicit GradScaler(GradScalerOptions options = {})
      : ScalerCore(static_cast<float>(options.init_scale()), options.enabled(),
                   options.allow_fp16_grads()),
        options_(std::move(options)),
        growth_tracker_(0),
        hysteresis_tracker_(options_.hysteresis()) {
    detail::check_options(options_);
  }

  /// Advances the scale from this iteration's inf checks (summed over optimizers).
  /// On the host, from the inf flag that step() read: PyTorch's _amp_update_scale_ (bit for
  /// bit, tests/scaling/test_amp_kernels.cpp) without a device round trip of its own.
  void update() {
    const bool found_inf = take_found_inf("update()");
    if (!options_.enabled()) return;
    advance(found_inf);
  }

  /// The LossScaler step, as a Trainer calls it: advances the scale as update() does, from
  /// `found_inf` (this iteration's gradients held inf or NaN) instead of this scaler's records.
  void update_scale(bool found_inf) {
    reset_stages();
    if (!options_.enabled()) return;
    advance(found_inf);
  }

  /// Sets the scale (a normal fp32 value within [min_scale, max_scale]); leaves the growth
  /// tracker alone, as PyTorch does.
  void update(double new_scale) {
    const auto scale = detail::checked_scale(new_scale, "update(new_scale)");
    detail::check_in_bounds(scale, options_, "update(new_scale)");
    reset_stages();
    if (options_.enabled()) set_scale(scale);
  }

  bool is_enabled() const noexcept { return options_.enabled(); }
  /// The options as constructed; load_state_dict replaces the growth settings, not init_scale.
  const GradScalerOptions& options() const noexcept { return options_; }

  /// Steps since the last growth or overflow (PyTorch's _growth_tracker).
  std::int64_t growth_tracker() const noexcept { return growth_tracker_; }

  /// Overflows still tolerated before the next backoff; 0 or less backs off at the next one.
  std::int64_t hysteresis_tracker() const noexcept { return hysteresis_tracker_; }

  /// PyTorch's keys (scale, growth_factor, backoff_factor, growth_interval, _growth_tracker)
  /// plus hysteresis and _hysteresis_tracker; empty when disabled.
  c10::impl::GenericDict state_dict() const {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    if (!options_.enabled()) return dict;
    dict.insert("scale", get_scale());
    dict.insert("growth_factor", options_.growth_factor());
    dict.insert("backoff_factor", options_.backoff_factor());
    dict.insert("growth_interval", options_.growth_interval());
    dict.insert("_growth_tracker", growth_tracker());
    dict.insert("hysteresis", options_.hysteresis());
    dict.insert("_hysteresis_tracker", hysteresis_tracker_);
    return dict;
  }

  /// Loads a state_dict from C++ or from Python's GradScaler; validates before changing anything.
  /// Every state the scaler can reach loads, a scale that underflowed to 0 included (PyTorch's
  /// does too); min_scale and max_scale stay this scaler's own and bound the saved scale.
  void load_state_dict(const c10::impl::GenericDict& dict) {
    if (!options_.enabled()) return;
    MIXPREC_CHECK(!dict.empty(), "load_state_dict() got an empty state dict, possibly saved "
                  "from a disabled scaler");
    auto options = options_;
    options.growth_factor(detail::state_number(dict, "growth_factor"))
        .backoff_factor(detail::state_number(dict, "backoff_factor"))
        .growth_interval(detail::state_integer(dict, "growth_interval"));
    if (dict.contains("hysteresis")) options.hysteresis(detail::state_integer(dict, "hysteresis"));
    detail::check_dynamics(options);
    // A saved scale is a state, not a choice: backoff reaches subnormal values and 0.
    const double saved = detail::state_number(dict, "scale");
    const auto scale = static_cast<float>(saved);
    MIXPREC_CHECK(saved >= 0 && std::isfinite(scale) && (scale > 0) == (saved > 0),
                  "state dict has scale ", saved, ", which is ", scale, " in fp32; a GradScaler's "
                  "scale is a finite fp32 value >= 0");
    detail::check_in_bounds(scale, options, "the state dict's scale");
    const auto tracker = detail::state_integer(dict, "_growth_tracker");
    MIXPREC_CHECK(tracker >= 0 && tracker < options.growth_interval(), "state dict has "
                  "_growth_tracker ", tracker, " outside [0, growth_interval)");
    const auto hysteresis_tracker = dict.contains("_hysteresis_tracker")
                                        ? detail::state_integer(dict, "_hysteresis_tracker")
                                        : options.hysteresis();
    MIXPREC_CHECK(hysteresis_tracker <= options.hysteresis(), "state dict has "
                  "_hysteresis_tracker ", hysteresis_tracker, " above hysteresis ",
                  options.hysteresis());
    options_ = options;
    set_scale(scale);
    growth_tracker_ = tracker;
    hysteresis_tracker_ = hysteresis_tracker;
  }

 private:
  void advance(bool found_inf) {
    detail::ScaleState state{host_scale_, static_cast<std::int32_t>(growth_tracker_),
                             hysteresis_tracker_};
    state = detail::next_scale(state, found_inf, options_);
    set_scale(state.scale);
    growth_tracker_ = state.growth_tracker;
    hysteresis_tracker_ = state.hysteresis_tracker;
  }

  GradScalerOptions options_;
  std::int64_t growth_tracker_;
  std::int64_t hysteresis_tracker_;
};

/// A fixed loss scale: the scale never changes by itself; update(new_scale) sets it.
class StaticScaler : public detail::ScalerCore {
 public:
  explicit StaticScaler(double scale = 1.0, bool allow_fp16_grads = false)
      : ScalerCore(detail::checked_scale(scale, "StaticScaler's scale"), true, allow_fp16_grads) {}
  /// From GradScalerOptions, as the Trainer builds scalers: init_scale is the fixed scale, and
  /// the dynamic settings, which it would ignore, must keep their defaults.
  explicit StaticScaler(const GradScalerOptions& options)
      : StaticScaler(static_only(options).init_scale(), options.allow_fp16_grads()) {}

  /// Ends the iteration; the scale stays.
  void update() { (void)take_found_inf("update()"); }
  /// The LossScaler step: the scale stays.
  void update_scale(bool /*found_inf*/) { reset_stages(); }

  /// Sets the scale (a normal fp32 value).
  void update(double new_scale) {
    const auto scale = detail::checked_scale(new_scale, "update(new_scale)");
    reset_stages();
    set_scale(scale);
  }

  bool is_enabled() const noexcept { return true; }

  /// {"scale": the scale}.
  c10::impl::GenericDict state_dict() const {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    dict.insert("scale", get_scale());
    return dict;
  }

  /// Loads the scale of a StaticScaler's (or a GradScaler's) state dict.
  void load_state_dict(const c10::impl::GenericDict& dict) {
    set_scale(detail::checked_scale(detail::state_number(dict, "scale"), "state dict's scale"));
  }

 private:
  static const GradScalerOptions& static_only(const GradScalerOptions& o) {
    const GradScalerOptions d;
    MIXPREC_CHECK(o.enabled() && o.growth_factor() == d.growth_factor() &&
                      o.backoff_factor() == d.backoff_factor() &&
                      o.growth_interval() == d.growth_interval() &&
                      o.hysteresis() == d.hysteresis() && o.min_scale() == d.min_scale() &&
                      o.max_scale() == d.max_scale(),
                  "StaticScaler keeps its scale fixed: of GradScalerOptions it uses init_scale and "
                  "allow_fp16_grads only, and would ignore enabled(false), growth_factor, "
                  "backoff_factor, growth_interval, hysteresis, min_scale and max_scale; leave "
                  "them at their defaults, or use GradScaler (dynamic) or NoScaler (no scaling)");
    return o;
  }
};

/// No scaling: scale() returns the loss itself; step() still skips inf/NaN gradients.
class NoScaler : public detail::ScalerCore {
 public:
  NoScaler() : ScalerCore(1.0, false, true) {}
  /// Accepts the options the Trainer passes to every scaler; only their defaults make sense.
  explicit NoScaler(const GradScalerOptions&) : NoScaler() {}

  void update() { (void)take_found_inf("update()"); }
  /// The LossScaler step: the scale stays 1.
  void update_scale(bool /*found_inf*/) { reset_stages(); }
  void update(double new_scale) {
    MIXPREC_CHECK(false, "NoScaler has no scale to set (got update(", new_scale,
                  ")); use StaticScaler or GradScaler");
  }
  bool is_enabled() const noexcept { return false; }
  c10::impl::GenericDict state_dict() const {
    return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
  }
  /// Ignores the dict, as a disabled PyTorch GradScaler does.
  void load_state_dict(const c10::impl::GenericDict&) {}
};

static_assert(LossScaler<GradScaler> && LossScaler<StaticScaler> && LossScaler<NoScaler>);

}  // namespace mixprec
