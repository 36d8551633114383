#pragma once
// A custom policy shared by the catalogue, the reliability programs and the fuzz targets.

#include <mixprec/core/policy.hpp>
#include <mixprec/scaling/scalers.hpp>

#include <string_view>

namespace test {

/// MixedO2<BFloat16> with a dynamic GradScaler, as a user would derive it: the one policy with a
/// moving scale that LibTorch 1.13's CPU can train.
struct ScaledO2 : mixprec::MixedO2<at::BFloat16> {
  static constexpr std::string_view name = "ScaledO2";
  using scaler_type = mixprec::GradScaler;
};

}  // namespace test
