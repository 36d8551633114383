#pragma once
/// The Trainers that mixprec's compiled companion holds (CMake target mixprec::precompiled,
/// docs/build.md). With MIXPREC_PRECOMPILED defined (the target defines it for whatever links
/// it), each is declared `extern template`: a translation unit that trains with one of them
/// compiles none of its set-up, step stages or checkpoints, which the companion's objects hold
/// once. Without it (header-only, the default) nothing here changes a thing.
///
/// The list is MIXPREC_PRECOMPILED_POLICIES(X): X(policy) for each policy; src/ instantiates
/// exactly these (a policy declared here and instantiated nowhere fails to link, never runs
/// other code). Any other policy is compiled in the TU that uses it, as header-only.

#include <mixprec/core/policy.hpp>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstddef>

// The Apex levels, each in bf16 and fp16, and the two lean storages' common forms. One
// `  X(policy)` line each: cmake/mixprecPrecompiled.cmake counts them, one object per line.
#define MIXPREC_PRECOMPILED_POLICIES(X)                                          \
  X(::mixprec::FullPrecision)                                                    \
  X(::mixprec::MixedO1<::at::BFloat16>)                                          \
  X(::mixprec::MixedO1<::at::Half>)                                              \
  X(::mixprec::MixedO2<::at::BFloat16>)                                          \
  X(::mixprec::MixedO2<::at::Half>)                                              \
  X(::mixprec::PureHalf<::at::BFloat16>)                                         \
  X(::mixprec::PureHalf<::at::Half>)                                             \
  X(::mixprec::MixedO2<::at::BFloat16, ::mixprec::RemainderMasters<>>)           \
  X(::mixprec::PureHalf<::at::BFloat16, ::mixprec::StochasticRounding<>>)

/// `template class` (in the companion) or `extern template class` (everywhere else) of the
/// Trainer of policy P and its checkpoint base.
#define MIXPREC_TRAINER_INSTANCE(prefix, ...)                  \
  prefix template class ::mixprec::detail::TrainerCheckpoints<__VA_ARGS__>; \
  prefix template class ::mixprec::Trainer<__VA_ARGS__>;

namespace mixprec::detail {

// The list as types, for the companion's sources: part I instantiates the I-th.
template <class... Policies>
struct PolicyList {};
template <std::size_t I, class List>
struct NthPolicy;
template <class First, class... Rest>
struct NthPolicy<0, PolicyList<First, Rest...>> {
  using type = First;
};
template <std::size_t I, class First, class... Rest>
struct NthPolicy<I, PolicyList<First, Rest...>> : NthPolicy<I - 1, PolicyList<Rest...>> {};
#define MIXPREC_POLICY_LIST_ITEM(...) __VA_ARGS__,
using PrecompiledPolicies = PolicyList<MIXPREC_PRECOMPILED_POLICIES(MIXPREC_POLICY_LIST_ITEM) void>;
#undef MIXPREC_POLICY_LIST_ITEM

}  // namespace mixprec::detail

#if defined(MIXPREC_PRECOMPILED)
#define MIXPREC_EXTERN_TRAINER(...) MIXPREC_TRAINER_INSTANCE(extern, __VA_ARGS__)
MIXPREC_PRECOMPILED_POLICIES(MIXPREC_EXTERN_TRAINER)
#undef MIXPREC_EXTERN_TRAINER
#endif
