// Anything that is not a policy is rejected with the first missing member named.
// expect: a precision policy needs `static constexpr std::string_view name`
#include <mixprec/core/autocast.hpp>
#include <mixprec/core/policy.hpp>

#ifdef MIXPREC_COMPILE_FAIL
using Policy = float;
#else
using Policy = mixprec::O0;
#endif

void use() { auto guard = mixprec::autocast<Policy>(); }
