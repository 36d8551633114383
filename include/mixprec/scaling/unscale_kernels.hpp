#pragma once
// The CPU element loops of the gradient passes, over raw spans, per dtype and per ISA, and their
// spread over at::parallel_for. On CPU with LibTorch < 2.3 there is no
// _amp_foreach_non_finite_check_and_unscale_ kernel, and `isfinite(g).all()` reads the data
// ~25x slower than a multiply; so each pass is one loop here:
//   scale_and_check_span: read `from`, write `to = from * factor`, flag a non-finite result;
//   grad_stats_span:      read `from`, sum of squares (double) and non-finite flag together;
//   non_finite_span:      read `from`, the non-finite flag alone (no clipping: no norm to compute).
// Which tensor reaches which loop (layout, dtype, device) is unscale.hpp's business.

#include <mixprec/core/cpu_dispatch.hpp>
#include <mixprec/core/parallel.hpp>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace mixprec::detail {

struct GradStats {
  double sum_of_squares = 0.0;
  bool non_finite = false;
};

// |v| < threshold <=> v stored as T is finite. fp16 rounds |v| >= 65520 to inf; bf16 rounds
// floats at or above the midpoint between its largest finite value and inf (0x7f7f8000) to inf.
template <class T>
inline float finite_threshold() {
  if constexpr (std::is_same_v<T, at::Half>) {
    return 65520.0F;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    return std::bit_cast<float>(std::uint32_t{0x7f7f8000U});
  } else {
    return std::numeric_limits<float>::infinity();
  }
}

// The float/Half/BFloat16 element loop, written so that it vectorises: the finiteness test is an
// integer compare on the bits (|v| as int32 >= the threshold's bits: exactly !(|v| < threshold),
// NaN included), ORed into an int; the float compare `bad |= !(abs(v) < t)` left the loop scalar
// ("control flow in loop"), ~3x slower than mul_ for fp32 and ~7x for bf16.
template <class In, class Out>
MIXPREC_ALWAYS_INLINE inline bool scale_and_check_loop(const In* from, Out* to, std::int64_t begin,
                                                        std::int64_t end, float factor) {
  const auto threshold = std::bit_cast<std::int32_t>(finite_threshold<Out>());
  std::int32_t bad = 0;
  for (std::int64_t i = begin; i < end; ++i) {
    const float v = static_cast<float>(from[i]) * factor;
    to[i] = static_cast<Out>(v);
    bad |= static_cast<std::int32_t>((std::bit_cast<std::int32_t>(v) & 0x7fffffff) >= threshold);
  }
  return bad != 0;
}

#ifdef MIXPREC_X86_DISPATCH
// The same loops compiled for AVX2 and AVX-512, chosen at run time: the library is header-only
// and built with the consumer's flags (often plain x86-64: SSE2), while ATen's own kernels
// dispatch on the CPU (core/cpu_dispatch.hpp). Multiplies and integer ops only (no FMA):
// results are bit-identical whichever loop runs.
template <class In, class Out>
[[gnu::target("avx2")]] bool scale_and_check_loop_avx2(const In* from, Out* to, std::int64_t begin,
                                                       std::int64_t end, float factor) {
  return scale_and_check_loop(from, to, begin, end, factor);
}
template <class In, class Out>
[[gnu::target("avx512f,avx512bw")]] bool scale_and_check_loop_avx512(
    const In* from, Out* to, std::int64_t begin, std::int64_t end, float factor) {
  return scale_and_check_loop(from, to, begin, end, factor);
}
#endif

template <class In, class Out>
bool scale_and_check_dispatch(const In* from, Out* to, std::int64_t begin, std::int64_t end,
                              float factor) {
#ifdef MIXPREC_X86_DISPATCH
  switch (cpu_isa()) {
    case Isa::avx512: return scale_and_check_loop_avx512(from, to, begin, end, factor);
    case Isa::avx2: return scale_and_check_loop_avx2(from, to, begin, end, factor);
    case Isa::base: break;
  }
#endif
  return scale_and_check_loop(from, to, begin, end, factor);
}

template <class In, class Out>
bool scale_and_check_span(const In* from, Out* to, std::int64_t n, float factor) {
  std::atomic<bool> non_finite{false};
  at::parallel_for(0, n, kGrainSize, [&](std::int64_t begin, std::int64_t end) {
    bool bad = false;
    if constexpr (std::is_same_v<In, double> || std::is_same_v<Out, double>) {
      // Rare (fp64 parameters): clarity over speed.
      for (std::int64_t i = begin; i < end; ++i) {
        const double v = static_cast<double>(from[i]) * static_cast<double>(factor);
        if constexpr (std::is_same_v<Out, double>) {
          to[i] = v;
        } else {
          to[i] = static_cast<Out>(static_cast<float>(v));
        }
        bad |= !std::isfinite(static_cast<double>(to[i]));
      }
    } else {
      bad = scale_and_check_dispatch(from, to, begin, end, factor);
    }
    if (bad) non_finite.store(true, std::memory_order_relaxed);
  });
  return non_finite.load(std::memory_order_relaxed);
}

// Sum of squares of one chunk: eight double accumulators, lane k taking elements i + k, so that
// the loop vectorises without reassociation (the sum is the same whatever the vector width).
template <class In>
MIXPREC_ALWAYS_INLINE inline double sum_of_squares_loop(const In* from, std::int64_t begin,
                                                         std::int64_t end) {
  double acc[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  std::int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const double v = static_cast<double>(from[i + k]);
      acc[k] += v * v;
    }
  }
  for (; i < end; ++i) {
    const double v = static_cast<double>(from[i]);
    acc[0] += v * v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

#ifdef MIXPREC_X86_DISPATCH
// AVX2 only: targets that imply FMA would let the compiler fuse v * v + acc, which rounds
// differently from the baseline loop.
template <class In>
[[gnu::target("avx2")]] double sum_of_squares_loop_avx2(const In* from, std::int64_t begin,
                                                        std::int64_t end) {
  return sum_of_squares_loop(from, begin, end);
}
#endif

template <class In>
double sum_of_squares_dispatch(const In* from, std::int64_t begin, std::int64_t end) {
#ifdef MIXPREC_X86_DISPATCH
  if (cpu_isa() != Isa::base) return sum_of_squares_loop_avx2(from, begin, end);
#endif
  return sum_of_squares_loop(from, begin, end);
}

template <class In>
GradStats grad_stats_span(const In* from, std::int64_t n) {
  std::atomic<bool> non_finite{false};
  const std::int64_t chunks = (n + kGrainSize - 1) / kGrainSize;
  std::vector<double> partial(static_cast<std::size_t>(chunks), 0.0);
  at::parallel_for(0, chunks, 1, [&](std::int64_t chunk_begin, std::int64_t chunk_end) {
    bool bad = false;
    for (std::int64_t c = chunk_begin; c < chunk_end; ++c) {
      const std::int64_t begin = c * kGrainSize;
      const std::int64_t end = std::min(n, begin + kGrainSize);
      // The order within a chunk is fixed, so results are reproducible whatever the thread count.
      const double sum = sum_of_squares_dispatch(from, begin, end);
      bad |= !(sum <= std::numeric_limits<double>::max());  // any inf or NaN reaches the sum
      partial[static_cast<std::size_t>(c)] = sum;
    }
    if (bad) non_finite.store(true, std::memory_order_relaxed);
  });
  GradStats stats;
  for (const double p : partial) stats.sum_of_squares += p;
  stats.non_finite = non_finite.load(std::memory_order_relaxed) ||
                     !(stats.sum_of_squares <= std::numeric_limits<double>::max());
  return stats;
}

// Finiteness alone (no clipping, so no norm): the largest magnitude's bits, an unsigned max
// reduction that vectorises, compared once with the exponent mask (inf and NaN at or above it).
template <class In>
struct FloatBits;
template <>
struct FloatBits<float> {
  using type = std::uint32_t;
  static constexpr type magnitude = 0x7fffffffU, exponent = 0x7f800000U;
};
template <>
struct FloatBits<double> {
  using type = std::uint64_t;
  static constexpr type magnitude = 0x7fffffffffffffffULL, exponent = 0x7ff0000000000000ULL;
};
template <>
struct FloatBits<at::Half> {
  using type = std::uint16_t;
  static constexpr type magnitude = 0x7fff, exponent = 0x7c00;
};
template <>
struct FloatBits<at::BFloat16> {
  using type = std::uint16_t;
  static constexpr type magnitude = 0x7fff, exponent = 0x7f80;
};

template <class In>
MIXPREC_ALWAYS_INLINE inline bool non_finite_loop(const In* from, std::int64_t begin,
                                                  std::int64_t end) {
  using Bits = FloatBits<In>;
  static_assert(sizeof(typename Bits::type) == sizeof(In));
  typename Bits::type most = 0;
  for (std::int64_t i = begin; i < end; ++i) {
    typename Bits::type bits;
    std::memcpy(&bits, from + i, sizeof bits);
    bits &= Bits::magnitude;
    most = bits > most ? bits : most;
  }
  return most >= Bits::exponent;
}

#ifdef MIXPREC_X86_DISPATCH
#if !defined(__FAST_MATH__) && !(defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__)
#define MIXPREC_FLOAT_FMA_CHECK 1
// float: x * 0 + acc is NaN when x is inf or NaN and leaves acc (±0) as it was otherwise, so one
// multiply-add per vector, into eight independent sums, decides finiteness: ~3x fewer
// instructions than the bit reduction (AND and max per vector, and the loop's own). Not under
// -ffast-math, whose finite-math assumption may fold x * 0 to 0: there the bit loop runs.
// (The two loops are spelled out: GCC does not compile a lambda's body for its caller's target.)
[[gnu::target("avx2,fma")]] inline bool non_finite_floats_avx2(const float* from,
                                                               std::int64_t begin,
                                                               std::int64_t end) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 a0 = zero, a1 = zero, a2 = zero, a3 = zero, a4 = zero, a5 = zero, a6 = zero, a7 = zero;
  std::int64_t i = begin;
  for (; i + 64 <= end; i += 64) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(from + i), zero, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(from + i + 8), zero, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(from + i + 16), zero, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(from + i + 24), zero, a3);
    a4 = _mm256_fmadd_ps(_mm256_loadu_ps(from + i + 32), zero, a4);
    a5 = _mm256_fmadd_ps(_mm256_loadu_ps(from + i + 40), zero, a5);
    a6 = _mm256_fmadd_ps(_mm256_loadu_ps(from + i + 48), zero, a6);
    a7 = _mm256_fmadd_ps(_mm256_loadu_ps(from + i + 56), zero, a7);
  }
  for (; i + 8 <= end; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(from + i), zero, a0);
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                   _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  return _mm256_movemask_ps(_mm256_cmp_ps(sum, sum, _CMP_UNORD_Q)) != 0 ||
         non_finite_loop(from, i, end);
}

[[gnu::target("avx512f")]] inline bool non_finite_floats_avx512(const float* from,
                                                               std::int64_t begin,
                                                               std::int64_t end) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 a0 = zero, a1 = zero, a2 = zero, a3 = zero, a4 = zero, a5 = zero, a6 = zero, a7 = zero;
  std::int64_t i = begin;
  for (; i + 128 <= end; i += 128) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(from + i), zero, a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(from + i + 16), zero, a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(from + i + 32), zero, a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(from + i + 48), zero, a3);
    a4 = _mm512_fmadd_ps(_mm512_loadu_ps(from + i + 64), zero, a4);
    a5 = _mm512_fmadd_ps(_mm512_loadu_ps(from + i + 80), zero, a5);
    a6 = _mm512_fmadd_ps(_mm512_loadu_ps(from + i + 96), zero, a6);
    a7 = _mm512_fmadd_ps(_mm512_loadu_ps(from + i + 112), zero, a7);
  }
  for (; i + 16 <= end; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(from + i), zero, a0);
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                   _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
  return _mm512_cmp_ps_mask(sum, sum, _CMP_UNORD_Q) != 0 || non_finite_loop(from, i, end);
}
#endif

template <class In>
[[gnu::target("avx2")]] bool non_finite_loop_avx2(const In* from, std::int64_t begin,
                                                  std::int64_t end) {
  return non_finite_loop(from, begin, end);
}
template <class In>
[[gnu::target("avx512f,avx512bw")]] bool non_finite_loop_avx512(const In* from, std::int64_t begin,
                                                                std::int64_t end) {
  return non_finite_loop(from, begin, end);
}
#endif

// One chunk of non_finite_span, on the CPU's widest loop.
template <class In>
bool non_finite_dispatch(const In* from, std::int64_t begin, std::int64_t end) {
#ifdef MIXPREC_X86_DISPATCH
  switch (cpu_isa()) {
#ifdef MIXPREC_FLOAT_FMA_CHECK
    case Isa::avx512:
      if constexpr (std::is_same_v<In, float>) return non_finite_floats_avx512(from, begin, end);
      return non_finite_loop_avx512(from, begin, end);
    case Isa::avx2:
      if constexpr (std::is_same_v<In, float>) {
        if (cpu_has_fma()) return non_finite_floats_avx2(from, begin, end);
      }
      return non_finite_loop_avx2(from, begin, end);
#else
    case Isa::avx512: return non_finite_loop_avx512(from, begin, end);
    case Isa::avx2: return non_finite_loop_avx2(from, begin, end);
#endif
    case Isa::base: break;
  }
#endif
  return non_finite_loop(from, begin, end);
}

template <class In>
bool non_finite_span(const In* from, std::int64_t n) {
  if (n <= kGrainSize) return non_finite_dispatch(from, 0, n);  // one chunk: no parallel_for
  std::atomic<bool> non_finite{false};
  at::parallel_for(0, n, kGrainSize, [&](std::int64_t begin, std::int64_t end) {
    if (non_finite_dispatch(from, begin, end)) non_finite.store(true, std::memory_order_relaxed);
  });
  return non_finite.load(std::memory_order_relaxed);
}

}  // namespace mixprec::detail
