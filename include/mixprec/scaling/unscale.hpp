#pragma once
// The gradient passes behind the scalers. On CPU with LibTorch < 2.3 there is no
// _amp_foreach_non_finite_check_and_unscale_ kernel, and `isfinite(g).all()` reads the data
// ~25x slower than a multiply; so the CPU passes are written here, one pass each:
//   scale_and_check_: read `from`, write `to = from * factor`, flag a non-finite result;
//   grad_stats:       read `from`, sum of squares (double) and non-finite flag together;
//   any_non_finite:   read `from`, the non-finite flag alone (no clipping: no norm to compute).
// Elsewhere (CUDA) the fused ATen kernels do the work.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__GNUC__) || defined(__clang__)
#define MIXPREC_ALWAYS_INLINE [[gnu::always_inline]]
#else
#define MIXPREC_ALWAYS_INLINE
#endif

namespace mixprec::detail {

/// One gradient to unscale: read from `from`, write into `to` (the same tensor when in place).
struct GradPair {
  at::Tensor from;
  at::Tensor to;
};

struct GradStats {
  double sum_of_squares = 0.0;
  bool non_finite = false;
};

inline constexpr std::int64_t kGrainSize = 1 << 15;

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

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define MIXPREC_X86_DISPATCH 1
#include <immintrin.h>
// The same loops compiled for AVX2 and AVX-512, chosen at run time: the library is header-only
// and built with the consumer's flags (often plain x86-64: SSE2), while ATen's own kernels
// dispatch on the CPU. Multiplies and integer ops only (no FMA): results are bit-identical
// whichever loop runs.
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

// Dense tensors whose elements fill one block of memory (contiguous, transposed, permuted) are
// processed in place as a flat span; other views (slices with gaps) go through a copy.
inline bool is_flat(const at::Tensor& t) { return t.is_non_overlapping_and_dense(); }

inline const void* flat_begin(const at::Tensor& t) {
  // The lowest address of a dense tensor is data_ptr minus the negative-stride offsets;
  // LibTorch forbids negative strides, so it is data_ptr itself.
  return t.data_ptr();
}

template <class F>
void dispatch_grad_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kDouble: f(double{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "mixprec: unexpected gradient dtype ", dtype);
  }
}

// Whether two dense tensors of the same sizes hold their elements in the same order. A
// size-1 dimension's stride does not place anything: a gradient hook can return strides [1, 1]
// for a [1, N] tensor whose master has [N, 1], and autograd keeps them.
inline bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  for (std::int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

/// CPU: to = from * factor in one pass; true when any written value is inf or NaN.
inline bool scale_and_check_cpu(const at::Tensor& from, const at::Tensor& to, float factor) {
  const bool same = from.is_same(to);
  const bool flat = is_flat(from) && (same || (is_flat(to) && same_layout(from, to)));
  if (!flat) {
    // Both contiguous, so of one layout: one level down the copies are flat.
    auto from_c = from.contiguous();
    auto to_c = at::empty_like(to, at::MemoryFormat::Contiguous);
    const bool bad = scale_and_check_cpu(from_c, to_c, factor);
    to.copy_(to_c);
    return bad;
  }
  bool bad = false;
  const auto n = from.numel();
  dispatch_grad_dtype(from.scalar_type(), [&](auto in_tag) {
    using In = decltype(in_tag);
    const auto* in = static_cast<const In*>(flat_begin(from));
    dispatch_grad_dtype(to.scalar_type(), [&](auto out_tag) {
      using Out = decltype(out_tag);
      bad = scale_and_check_span(in, static_cast<Out*>(to.data_ptr()), n, factor);
    });
  });
  return bad;
}

/// CPU: sum of squares and finiteness of one tensor, one read pass.
inline GradStats grad_stats_cpu(const at::Tensor& from) {
  const auto t = is_flat(from) ? from : from.contiguous();
  GradStats stats;
  dispatch_grad_dtype(t.scalar_type(), [&](auto tag) {
    using In = decltype(tag);
    stats = grad_stats_span(static_cast<const In*>(flat_begin(t)), t.numel());
  });
  return stats;
}

/// CPU: whether a Float, Double, Half or BFloat16 tensor holds inf or NaN, one read pass.
inline bool non_finite_cpu(const at::Tensor& from) {
  const auto t = is_flat(from) ? from : from.contiguous();
  bool bad = false;
  dispatch_grad_dtype(t.scalar_type(), [&](auto tag) {
    using In = decltype(tag);
    bad = non_finite_span(static_cast<const In*>(flat_begin(t)), t.numel());
  });
  return bad;
}

/// The gradient values a pass works on: a sparse gradient's values, a dense gradient itself.
inline at::Tensor grad_values(const at::Tensor& grad) {
  return grad.is_sparse() ? grad._values() : grad;
}

/// ATen's own fused check-and-unscale where it has a kernel for `device`: CUDA in every
/// supported LibTorch, the CPU from 2.3 on. On the CPU mixprec's pass is used all the same: it
/// is as fast or faster (docs/benchmarks.md, "ATen's AMP kernel vs mixprec's pass") and checks
/// what it writes.
inline bool use_aten_unscale(const at::Device& device) { return !device.is_cpu(); }

/// ATen's kernel over `grads` (one device and dtype), ORed into found_inf. The kernel checks its
/// inputs, which decides found_inf exactly when |factor| <= 1: a finite value times such a
/// factor stays finite in any dtype. Otherwise (a scale below 1) a second check reads the outputs.
inline void aten_unscale_(const std::vector<at::Tensor>& grads, float factor,
                          const at::Tensor& found_inf) {
  if (grads.front().scalar_type() == at::kBFloat16) {
    // The CUDA kernel has no BFloat16 version (it throws for bf16, seen on an H200 with LibTorch
    // 2.11): fp32 copies, each value computed in fp32 and rounded once, as on the CPU.
    std::vector<at::Tensor> wide;
    wide.reserve(grads.size());
    for (const auto& g : grads) wide.push_back(g.to(at::kFloat));
    aten_unscale_(wide, factor, found_inf);
    for (std::size_t i = 0; i < grads.size(); ++i) grads[i].copy_(wide[i]);
    if (!(std::abs(factor) <= 1.0F)) {
      // A finite fp32 result above bf16's largest value rounds to inf: check what was written.
      wide.clear();
      for (const auto& g : grads) wide.push_back(g.to(at::kFloat));
      aten_unscale_(wide, 1.0F, found_inf);
    }
    return;
  }
  const auto device = grads.front().device();
  const auto options = at::TensorOptions(at::kFloat).device(device);
  // at::full on the device is a fill kernel, not a copy from the host: no synchronisation.
  auto found_here = at::zeros({}, options);
  at::_amp_foreach_non_finite_check_and_unscale_(grads, found_here, at::full({}, factor, options));
  if (!(std::abs(factor) <= 1.0F)) {
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_here, at::ones({}, options));
  }
  found_inf.add_(found_here.to(found_inf.device())).clamp_max_(1.0);
}

/// Unscales all pairs: to = from * factor; found_inf (a 0-dim float tensor) becomes 1 where any
/// result is non-finite. One pass over the data per pair; no host synchronisation.
inline void unscale_pairs_(const std::vector<GradPair>& pairs, float factor,
                           const at::Tensor& found_inf) {
  std::vector<at::Tensor> kernel_grads;
  bool cpu_found = false;
  for (const auto& pair : pairs) {
    const auto from = grad_values(pair.from);
    const auto to = grad_values(pair.to);
    if (!use_aten_unscale(from.device())) {
      cpu_found |= scale_and_check_cpu(from, to, factor);
    } else {
      if (!from.is_same(to)) to.copy_(from);
      kernel_grads.push_back(to);
    }
  }
  if (cpu_found) found_inf.fill_(1.0);
  // Per device and dtype, as the fused kernel wants.
  while (!kernel_grads.empty()) {
    const auto device = kernel_grads.front().device();
    const auto dtype = kernel_grads.front().scalar_type();
    std::vector<at::Tensor> group;
    std::vector<at::Tensor> rest;
    for (auto& g : kernel_grads) {
      (g.device() == device && g.scalar_type() == dtype ? group : rest).push_back(g);
    }
    aten_unscale_(group, factor, found_inf);
    kernel_grads = std::move(rest);
  }
}

/// Sum of squares of all `from` gradients, and whether any of them or of `also` (e.g. the loss;
/// it adds nothing to the sum) is non-finite. CPU gradients are read in mixprec's pass; on a
/// device each tensor's sum stays there, and the total is read back once.
inline GradStats grad_stats(const std::vector<GradPair>& pairs, const at::Tensor& also = {}) {
  GradStats total;
  std::vector<at::Tensor> device_sums;  // one running sum per device
  const auto add_on_device = [&](const at::Tensor& sum) {
    auto it = std::find_if(device_sums.begin(), device_sums.end(),
                           [&](const at::Tensor& s) { return s.device() == sum.device(); });
    if (it == device_sums.end()) {
      device_sums.push_back(sum);
    } else {
      it->add_(sum);
    }
  };
  for (const auto& pair : pairs) {
    const auto from = grad_values(pair.from);
    if (from.device().is_cpu()) {
      const auto s = grad_stats_cpu(from);
      total.sum_of_squares += s.sum_of_squares;
      total.non_finite |= s.non_finite;
    } else {
      add_on_device(from.to(at::kDouble).square().sum());
    }
  }
  if (also.defined()) {
    if (also.device().is_cpu()) {
      total.non_finite |= !at::isfinite(also).all().item<bool>();
    } else {
      // 0 for finite values, NaN otherwise: the flag travels in the sum's one read.
      add_on_device(at::where(at::isfinite(also).all(), 0.0, std::numeric_limits<double>::quiet_NaN())
                        .to(at::kDouble));
    }
  }
  for (const auto& s : device_sums) total.sum_of_squares += s.item<double>();  // one sync each
  total.non_finite |= !(total.sum_of_squares <= std::numeric_limits<double>::max());
  return total;
}

/// Whether any `from` gradient or `also` holds inf or NaN: grad_stats without the sum of squares
/// (a pass that only compares bits) where everything is on the CPU.
inline bool any_non_finite(const std::vector<GradPair>& pairs, const at::Tensor& also = {}) {
  const auto on_cpu = [](const at::Tensor& t) {
    const auto dtype = t.scalar_type();
    return t.device().is_cpu() && (dtype == at::kFloat || dtype == at::kDouble ||
                                   dtype == at::kHalf || dtype == at::kBFloat16);
  };
  bool cpu = !also.defined() || on_cpu(also);
  for (const auto& pair : pairs) cpu = cpu && on_cpu(grad_values(pair.from));
  if (!cpu) return grad_stats(pairs, also).non_finite;
  for (const auto& pair : pairs) {
    if (non_finite_cpu(grad_values(pair.from))) return true;
  }
  return also.defined() && non_finite_cpu(also);
}

}  // namespace mixprec::detail
