#pragma once
// mixprec's CPU element loops are compiled with the consumer's flags (a header-only library:
// often plain x86-64, SSE2), while ATen's own kernels dispatch on the CPU. Each loop is written
// once, so that it vectorises, and compiled again for AVX2 and AVX-512 under [[gnu::target]];
// cpu_isa() picks one at run time. Used by the gradient passes (scaling/unscale_kernels.hpp)
// and the lean training state (optim/lean_kernels.hpp).

#include <cstdint>

#if defined(__GNUC__) || defined(__clang__)
#define MIXPREC_ALWAYS_INLINE [[gnu::always_inline]]
#else
#define MIXPREC_ALWAYS_INLINE
#endif

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define MIXPREC_X86_DISPATCH 1
#include <immintrin.h>
#endif

namespace mixprec::detail {

/// Elements per chunk of at::parallel_for in the element loops.
inline constexpr std::int64_t kGrainSize = 1 << 15;

#ifdef MIXPREC_X86_DISPATCH
enum class Isa { base, avx2, avx512 };
inline Isa cpu_isa() {
  static const Isa isa = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                             ? Isa::avx512
                             : (__builtin_cpu_supports("avx2") ? Isa::avx2 : Isa::base);
  return isa;
}
inline bool cpu_has_fma() {
  static const bool fma = __builtin_cpu_supports("fma");
  return fma;
}
#endif

}  // namespace mixprec::detail
