// mixprec's compiled companion (CMake target mixprec::precompiled, docs/build.md): compiled once
// per policy of MIXPREC_PRECOMPILED_POLICIES (trainer/precompiled.hpp), with
// MIXPREC_PRECOMPILED_PART the policy's place in that list; each part holds that policy's
// Trainer, which the TUs that link the companion then do not compile.
#include <mixprec/trainer.hpp>

#include <type_traits>

#ifndef MIXPREC_PRECOMPILED_PART
#error "mixprec: compile src/precompiled.cpp with -DMIXPREC_PRECOMPILED_PART=<index>: CMake's mixprec::precompiled target does"
#endif

namespace mixprec::detail {
using PrecompiledPolicy = typename NthPolicy<MIXPREC_PRECOMPILED_PART, PrecompiledPolicies>::type;
static_assert(!std::is_void_v<PrecompiledPolicy>, "mixprec: MIXPREC_PRECOMPILED_PART is past the list");
}  // namespace mixprec::detail

MIXPREC_TRAINER_INSTANCE(, ::mixprec::detail::PrecompiledPolicy)
