// A custom policy that forgets scaler_type is told so by name.
// expect: a precision policy needs `using scaler_type
#include <mixprec/core/autocast.hpp>
#include <mixprec/core/policy.hpp>

struct MyPolicy {
  static constexpr std::string_view name = "MyPolicy";
  static constexpr c10::ScalarType low_dtype = c10::ScalarType::BFloat16;
  static constexpr bool autocast = true;
  static constexpr bool cast_model = false;
  static constexpr bool master_weights = false;
  static constexpr bool keep_batch_norm_fp32 = true;
#ifndef MIXPREC_COMPILE_FAIL
  using scaler_type = mixprec::NoScaler;
#endif
};

void use() { auto guard = mixprec::autocast<MyPolicy>(); }
