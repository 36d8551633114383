// Moments4bit keeps two 4-bit codes a byte, each block's codes in whole bytes (so that a rank's
// piece is whole rows): an odd block cannot be kept so, and is a compile error that says why.
// expect: Moments4bit keeps two codes a byte
#include <mixprec/core/policy.hpp>

#ifdef MIXPREC_COMPILE_FAIL
using Moments = mixprec::Moments4bit<127>;
#else
using Moments = mixprec::Moments4bit<126>;
#endif

constexpr auto name = mixprec::PureHalf<at::BFloat16, mixprec::StochasticRounding<Moments>>::name;
