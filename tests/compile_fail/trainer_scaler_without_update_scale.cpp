// A user-written scaler with everything but update_scale(found_inf), the call a Trainer makes
// after each step or skip, is refused by name.
// expect: the policy's scaler_type must satisfy mixprec::LossScaler
#include <mixprec/trainer/trainer.hpp>

struct AlmostAScaler {
  double get_scale() const { return 1024.0; }
#ifndef MIXPREC_COMPILE_FAIL
  void update_scale(bool /*found_inf*/) {}
#endif
  c10::impl::GenericDict state_dict() const {
    return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
  }
  void load_state_dict(const c10::impl::GenericDict& /*state*/) {}
};

struct AlmostPolicy : mixprec::MixedO2<at::BFloat16> {
  static constexpr std::string_view name = "AlmostPolicy";
  using scaler_type = AlmostAScaler;
};

std::size_t size() { return sizeof(mixprec::Trainer<AlmostPolicy>); }
