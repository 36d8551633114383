#pragma once
/// AutocastGuard: RAII over LibTorch's autocast switches, and mixprec::autocast<P>() for a policy.
///
///   {
///     auto guard = mixprec::autocast<mixprec::MixedO1<at::BFloat16>>(torch::kCPU);
///     auto y = model->forward(x);  // matmuls in bf16, reductions in fp32
///   }                              // previous autocast state restored, cast cache cleared

#include <mixprec/core/concepts.hpp>
#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <vector>

namespace mixprec {
namespace detail {

inline void check_autocast_device(c10::DeviceType device) {
  MIXPREC_CHECK(device == c10::DeviceType::CPU || device == c10::DeviceType::CUDA,
                "autocast supports the CPU and CUDA devices, not ", c10::DeviceTypeName(device));
}

}  // namespace detail

/// Sets autocast on `device` to (`enabled`, `dtype`) for a scope, like Python's `torch.autocast`.
/// Nests; restores the previous state on exit, exceptions included; the outermost guard clears
/// the cast cache. `enabled = false` turns autocast off inside the scope.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled = true)
      : device_(device), previous_{} {
    detail::check_autocast_device(device);
    if (enabled) {
      MIXPREC_CHECK(dtype == c10::ScalarType::Half || dtype == c10::ScalarType::BFloat16,
                    "autocast casts to Half or BFloat16, not ", c10::toString(dtype));
      // LibTorch 1.13's CPU autocast knows bf16 only; with Half it fails later, inside an op.
      MIXPREC_CHECK(cpu_half_math || device != c10::DeviceType::CPU ||
                        dtype == c10::ScalarType::BFloat16,
                    "CPU autocast in LibTorch ", torch_version,
                    " supports BFloat16 only: use MixedO1<at::BFloat16> on the CPU, Half on a "
                    "CUDA device, or LibTorch >= 2.4 for Half on the CPU");
    }
    previous_ = detail::get_autocast_state(device);
    // Keep the previous dtype when disabling, as Python does, so nested guards restore exactly.
    detail::set_autocast_state(device, {enabled, enabled ? dtype : previous_.dtype});
    at::autocast::increment_nesting();
  }

  ~AutocastGuard() {
    if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    detail::set_autocast_state(device_, previous_);
  }

  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&&) = delete;
  AutocastGuard& operator=(AutocastGuard&&) = delete;

 private:
  c10::DeviceType device_;
  detail::AutocastState previous_;
};

/// The autocast state policy P needs on `device`: on with P's dtype for MixedO1, off otherwise,
/// so that an outer autocast cannot silently lower a FullPrecision or MixedO2 computation.
template <class P>
[[nodiscard]] AutocastGuard autocast(c10::DeviceType device = c10::DeviceType::CPU) {
  static_assert(require_policy<P>);
  return AutocastGuard(device, P::low_dtype, P::autocast);
}

/// The device types of `tensors`, each once, in first-seen order; an Error for any that autocast
/// does not support (the Trainer engages its policy's autocast on each).
template <class Tensors>
std::vector<c10::DeviceType> autocast_device_types(const Tensors& tensors) {
  std::vector<c10::DeviceType> types;
  for (const auto& t : tensors) {
    const auto type = t.device().type();
    bool seen = false;
    for (const auto known : types) seen = seen || known == type;
    if (seen) continue;
    MIXPREC_CHECK(type == c10::DeviceType::CPU || type == c10::DeviceType::CUDA,
                  "a parameter of shape ", t.sizes(), " is on the ",
                  c10::DeviceTypeName(type, /*lower_case=*/true), " device; mixed precision "
                  "(autocast) supports CPU and CUDA tensors: move the model with "
                  "->to(torch::kCPU) or ->to(torch::kCUDA)");
    types.push_back(type);
  }
  return types;
}

/// autocast<P>() on each of several device types at once (CPU and CUDA), for a model whose
/// parameters are on both: a CPU+CUDA model under MixedO1 computes in P's low dtype on both.
template <class P>
class PolicyAutocast {
  static_assert(require_policy<P>);

 public:
  explicit PolicyAutocast(const std::vector<c10::DeviceType>& types) {
    for (const auto type : types) {
      auto& guard = type == c10::DeviceType::CPU ? cpu_ : cuda_;
      if (!guard) guard.emplace(type, P::low_dtype, P::autocast);
    }
  }

 private:
  std::optional<AutocastGuard> cpu_;
  std::optional<AutocastGuard> cuda_;
};

}  // namespace mixprec
