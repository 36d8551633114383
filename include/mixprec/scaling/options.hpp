#pragma once
/// The settings of the scalers (GradScalerOptions, UnscaleOptions) and the arithmetic of the
/// scale: its fp32 checks and bounds, and the dynamic update of DESIGN.md §4 (PyTorch's
/// _amp_update_scale_ with hysteresis), which GradScaler applies and the tests trace.

#include <mixprec/core/error.hpp>

#include <torch/arg.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

namespace mixprec {

/// Settings of GradScaler; the defaults are PyTorch's.
struct GradScalerOptions {
  /// The first scale; PyTorch's 2^16.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// The scale is multiplied by this after `growth_interval` steps without inf/NaN.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// The scale is multiplied by this after a step with inf/NaN.
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(std::int64_t, growth_interval) = 2000;
  /// Overflowing steps tolerated before backing off (1: PyTorch; DeepSpeed and Megatron use 2).
  /// The count refills when the scale grows, as in Megatron-LM and DeepSpeed's default.
  TORCH_ARG(std::int64_t, hysteresis) = 1;
  /// Bounds of the scale; PyTorch has none (0 and +inf). The scale never grows to inf. Like the
  /// scale, they are fp32: 1e-4 bounds it at float(1e-4).
  TORCH_ARG(double, min_scale) = 0.0;
  TORCH_ARG(double, max_scale) = std::numeric_limits<double>::infinity();
  /// false: behaves as NoScaler (scale 1, inf/NaN steps still skipped), state_dict empty.
  TORCH_ARG(bool, enabled) = true;
  /// Unscale fp16 gradients in place. Off, as in PyTorch: only PureHalf<at::Half> needs it.
  TORCH_ARG(bool, allow_fp16_grads) = false;
};

/// Optional parts of an unscale_ call.
struct UnscaleOptions {
  /// Clip the unscaled gradients to this total L2 norm, fused into the unscale pass.
  TORCH_ARG(std::optional<double>, max_grad_norm) = std::nullopt;
};

namespace detail {

/// The dynamic-scale state that GradScaler::update advances.
struct ScaleState {
  float scale;
  std::int32_t growth_tracker;
  std::int64_t hysteresis_tracker;
};

/// `value` rounded to the fp32 scale; an Error unless that is a normal fp32 number, which also
/// keeps 1 / scale finite. Bounds and checks are applied to this fp32 value, never the double.
inline float checked_scale(double value, std::string_view what) {
  const auto scale = static_cast<float>(value);
  MIXPREC_CHECK(std::isnormal(scale) && scale > 0, what, " must be a positive normal fp32 value (",
                std::numeric_limits<float>::min(), " to ", std::numeric_limits<float>::max(),
                "), got ", value, ", which is ", scale, " in fp32, the scale's type");
  return scale;
}

/// The bounds of the scale as fp32, where they are applied.
inline float min_scale_fp32(const GradScalerOptions& o) { return static_cast<float>(o.min_scale()); }
inline float max_scale_fp32(const GradScalerOptions& o) { return static_cast<float>(o.max_scale()); }

/// One update of the scale: PyTorch's _amp_update_scale_ (fp32 scale, int32 tracker), with
/// hysteresis, bounds and the never-grow-to-inf guard of LibTorch >= 2.1.
inline ScaleState next_scale(ScaleState s, bool found_inf, const GradScalerOptions& o) {
  if (found_inf) {
    s.growth_tracker = 0;
    if (--s.hysteresis_tracker <= 0) {
      const auto backed_off = static_cast<float>(static_cast<double>(s.scale) * o.backoff_factor());
      s.scale = std::max(backed_off, min_scale_fp32(o));
    }
    return s;
  }
  if (s.growth_tracker + 1 < o.growth_interval()) {
    ++s.growth_tracker;
    return s;
  }
  s.growth_tracker = 0;
  s.hysteresis_tracker = o.hysteresis();
  const auto grown = static_cast<float>(static_cast<double>(s.scale) * o.growth_factor());
  if (std::isfinite(grown)) s.scale = std::min(grown, max_scale_fp32(o));
  return s;
}

/// Validates everything but init_scale, which load_state_dict replaces by a saved scale.
inline void check_dynamics(const GradScalerOptions& o) {
  MIXPREC_CHECK(o.growth_factor() > 1 && std::isfinite(o.growth_factor()),
                "GradScalerOptions::growth_factor must be finite and > 1, got ", o.growth_factor(),
                " (the scale grows by it after growth_interval clean steps)");
  MIXPREC_CHECK(o.backoff_factor() > 0 && o.backoff_factor() < 1,
                "GradScalerOptions::backoff_factor must be in (0, 1), got ", o.backoff_factor(),
                " (the scale shrinks by it after an overflow)");
  MIXPREC_CHECK(o.growth_interval() >= 1 && o.growth_interval() <= std::numeric_limits<std::int32_t>::max(),
                "GradScalerOptions::growth_interval must be in [1, 2^31), got ", o.growth_interval());
  MIXPREC_CHECK(o.hysteresis() >= 1, "GradScalerOptions::hysteresis must be >= 1, got ",
                o.hysteresis(), " (1 backs off at the first overflow, as PyTorch does)");
  // 0 is PyTorch's "no bound"; a positive bound that fp32 flushes to 0 (1e-46), or a subnormal
  // one (whose inverse is inf), would bound nothing.
  MIXPREC_CHECK(o.min_scale() == 0 || (o.min_scale() > 0 && std::isnormal(min_scale_fp32(o))),
                "GradScalerOptions::min_scale must be 0 or a positive normal fp32 value (at least ",
                std::numeric_limits<float>::min(), "), got ", o.min_scale());
  MIXPREC_CHECK(o.max_scale() == std::numeric_limits<double>::infinity() ||
                    (o.max_scale() > 0 && std::isnormal(max_scale_fp32(o))),
                "GradScalerOptions::max_scale must be +infinity or a normal fp32 value (at most ",
                std::numeric_limits<float>::max(), "), got ", o.max_scale());
  MIXPREC_CHECK(min_scale_fp32(o) <= max_scale_fp32(o), "GradScalerOptions needs min_scale <= "
                "max_scale, got ", o.min_scale(), " > ", o.max_scale());
}

/// `scale` checked against the bounds of `o`, compared in fp32 as the scale is stored.
inline void check_in_bounds(float scale, const GradScalerOptions& o, std::string_view what) {
  MIXPREC_CHECK(min_scale_fp32(o) <= scale && scale <= max_scale_fp32(o), what, " ", scale,
                " is outside [min_scale, max_scale] = [", min_scale_fp32(o), ", ",
                max_scale_fp32(o), "] (compared in fp32, the scale's type)");
}

inline void check_options(const GradScalerOptions& o) {
  check_dynamics(o);
  check_in_bounds(checked_scale(o.init_scale(), "GradScalerOptions::init_scale"), o,
                  "GradScalerOptions::init_scale");
}

}  // namespace detail
}  // namespace mixprec
