// A block format's block holds 1 to 65536 elements: 0 (no block to scale) or more than 65536 (a
// block no longer fits the cache while it steps) is a compile error naming the range.
// expect: block size is 1 to 65536 elements
#include <mixprec/core/policy.hpp>

#ifdef MIXPREC_COMPILE_FAIL
using Moments = mixprec::Moments8bit<0>;
#else
using Moments = mixprec::Moments8bit<64>;
#endif

constexpr auto name = mixprec::MixedO2<at::BFloat16, mixprec::RemainderMasters<Moments>>::name;
