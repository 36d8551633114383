// fp32 master weights only make sense when the model itself is cast.
// expect: master_weights requires cast_model
#include <mixprec/core/autocast.hpp>
#include <mixprec/core/policy.hpp>

struct MastersWithoutCast : mixprec::MixedO1<at::BFloat16> {
#ifdef MIXPREC_COMPILE_FAIL
  static constexpr bool master_weights = true;
#endif
};

void use() { auto guard = mixprec::autocast<MastersWithoutCast>(); }
