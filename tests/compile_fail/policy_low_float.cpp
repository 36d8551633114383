// A policy's low-precision type is Half or BFloat16; float is a mistake worth a message.
// expect: the low-precision type of a policy must be at::Half or at::BFloat16
#include <mixprec/core/policy.hpp>

#ifdef MIXPREC_COMPILE_FAIL
using Low = float;
#else
using Low = at::BFloat16;
#endif

constexpr auto name = mixprec::MixedO2<Low>::name;
