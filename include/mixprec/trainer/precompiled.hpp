#pragma once
/// The Trainers that mixprec's compiled companion holds (CMake target mixprec::precompiled,
/// docs/build.md). With MIXPREC_PRECOMPILED defined (the target defines it for whatever links
/// it), each is declared `extern template`: a translation unit that trains with one of them
/// compiles none of its set-up, step stages or checkpoints, which the companion's object holds
/// once. Without it (header-only, the default) nothing here changes a thing.
///
/// The list is MIXPREC_PRECOMPILED_POLICIES(X): X(policy) for each policy; src/precompiled.cpp
/// instantiates exactly these, from the same list. Any other policy is compiled in the TU that
/// uses it, as header-only.

#include <mixprec/core/policy.hpp>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

// The Apex levels, each in bf16 and fp16, and the two lean storages' common forms.
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

#if defined(MIXPREC_PRECOMPILED)
#define MIXPREC_EXTERN_TRAINER(...) MIXPREC_TRAINER_INSTANCE(extern, __VA_ARGS__)
MIXPREC_PRECOMPILED_POLICIES(MIXPREC_EXTERN_TRAINER)
#undef MIXPREC_EXTERN_TRAINER
#endif
