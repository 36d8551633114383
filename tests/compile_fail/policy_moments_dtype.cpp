// The moments of a lean storage are float, at::BFloat16 or a block format; a dtype none of them
// is (fp16, whose range Adam's second moment leaves, or double) is a compile error that lists
// the ones it takes.
// expect: or in a block format
#include <mixprec/core/policy.hpp>

#ifdef MIXPREC_COMPILE_FAIL
using Moments = at::Half;
#else
using Moments = mixprec::MomentsFp8<>;
#endif

constexpr auto name = mixprec::MixedO2<at::BFloat16, mixprec::Fp32Masters<Moments>>::name;
