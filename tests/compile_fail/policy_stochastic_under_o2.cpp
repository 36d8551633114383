// Stochastic rounding keeps no masters, so it is a PureHalf storage; under MixedO2 (whose point
// is the masters) it is a compile error naming where it belongs.
// expect: MixedO2 keeps master weights
#include <mixprec/core/policy.hpp>

#ifdef MIXPREC_COMPILE_FAIL
using Policy = mixprec::MixedO2<at::BFloat16, mixprec::StochasticRounding<>>;
#else
using Policy = mixprec::PureHalf<at::BFloat16, mixprec::StochasticRounding<>>;
#endif

constexpr auto name = Policy::name;
