// RemainderMasters keeps the fp32 master as the bf16 weight plus its 16 missing bits; an fp16
// weight is not part of its master's bits, so the pair would not be the master: a compile
// error that says so, not a silently different master.
// expect: RemainderMasters needs bf16 weights
#include <mixprec/core/policy.hpp>

#ifdef MIXPREC_COMPILE_FAIL
using Low = at::Half;
#else
using Low = at::BFloat16;
#endif

constexpr auto name = mixprec::MixedO2<Low, mixprec::RemainderMasters<>>::name;
