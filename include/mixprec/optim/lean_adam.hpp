#pragma once
/// One Adam or AdamW step over the lean storages (core/state_storage.hpp) in a single pass per
/// element: read the gradient (bf16, or fp32 where micro-batches accumulated it), divide it by
/// the scale, read the master (the bf16 weight and its remainder, the bf16 weight alone under
/// stochastic rounding, or an fp32 parameter), update the moments (fp32 or bf16) and the master,
/// write the bf16 weight and its remainder (or its stochastic rounding). No fp32 master, master
/// gradient or fp32 moment is made: what the step moves is what the state holds.
///
/// The arithmetic is that of ATen's fused CPU kernel (at::_fused_adam_ / _fused_adamw_), in
/// its order and roundings: the gradient divided by the scale, AdamW's decay of the weight
/// (Adam's added to the gradient), the first moment as a lerp, the second as v*beta2 + (c*g)*g,
/// the step (lr/bc1 * m) / (sqrt(v)/sqrt(bc2) + eps). ATen's kernels for AVX2 and AVX-512 fuse
/// three of those multiply-adds (its compiler contracts them, and its vector lerp is an fma),
/// and group the second moment of the last numel % 8 elements of a tensor the other way (under
/// AVX-512 too: measured element by element, LibTorch 2.13); its DEFAULT kernel fuses none. The
/// kernel below takes the grouping of the capability ATen dispatches to (ATEN_CPU_CAPABILITY
/// included), so on x86-64 an fp32 master steps here exactly as ATen's fused kernel steps it
/// (tests/optim/test_lean_state.cpp compares them bit for bit under each capability). Its fused
/// multiply-adds are explicit, and its other products are kept from being contracted into
/// adds, whatever the consumer's -ffp-contract.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/cpu_dispatch.hpp>
#include <mixprec/core/parallel.hpp>
#include <mixprec/optim/lean_kernels.hpp>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <vector>

namespace mixprec::detail {

/// Which of ATen's groupings of Adam's arithmetic the kernel takes (see the top of this file).
struct AdamArithmetic {
  bool fused = true;        // ATen's AVX2 and AVX-512 kernels: fused multiply-adds
  std::int64_t width = 8;   // their tail: a tensor's last numel % width elements
};

/// The grouping of ATen's fused Adam on this CPU under this process's ATen capability. Where
/// LibTorch has no fused kernel (< 2.4) there is nothing to agree with: fused where the CPU has
/// FMA. Other architectures: fused (no claim of ATen's bits there).
inline AdamArithmetic aten_adam_arithmetic() {
  static const AdamArithmetic arithmetic = [] {
    AdamArithmetic a;
#ifdef MIXPREC_X86_DISPATCH
    const auto capability = aten_cpu_capability();
    const bool fma = cpu_isa() != Isa::base && cpu_has_fma();
    a.fused = fma && (capability.empty() || capability == "AVX2" || capability == "AVX512");
#endif
    return a;
  }();
  return arithmetic;
}

/// The constants of one parameter's step, each computed in double and rounded to float once,
/// as ATen's fused kernel (and LibTorch's Adam) pass their scalars.
struct LeanAdamStep {
  float beta1 = 0, beta2 = 0, one_minus_beta1 = 0, one_minus_beta2 = 0, eps = 0;
  float one_minus_beta1_minus_one = 0;  // the lerp's other form, for 1 - beta1 >= 0.5
  float weight_decay = 0;
  float decay = 1;                  // AdamW with weight decay: 1 - lr * weight_decay; else 1
  float step_size = 0;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt = 1;  // sqrt(1 - beta2^step)
  float grad_scale = 1;  // the divisor of the gradients (loss scale / clip coefficient); 1: none
  bool adamw = true;
  bool amsgrad = false;
  AdamArithmetic arithmetic;  // ATen's, by default

  /// The constants of step `step` (counted from 1).
  static LeanAdamStep make(double lr, double beta1, double beta2, double eps, double weight_decay,
                           std::int64_t step, bool adamw, bool amsgrad) {
    LeanAdamStep s;
    const auto count = static_cast<double>(step);
    s.beta1 = static_cast<float>(beta1);
    s.beta2 = static_cast<float>(beta2);
    s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    s.one_minus_beta1_minus_one = s.one_minus_beta1 - 1.0F;
    s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    s.eps = static_cast<float>(eps);
    s.weight_decay = static_cast<float>(weight_decay);
    s.decay = adamw && weight_decay != 0 ? static_cast<float>(1.0 - lr * weight_decay) : 1.0F;
    s.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, count)));
    s.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, count)));
    s.adamw = adamw;
    s.amsgrad = amsgrad;
    s.arithmetic = aten_adam_arithmetic();
    return s;
  }
};

/// Where one parameter's values live. Exactly one weight form: `fp32` (an fp32 parameter, or a
/// master in the kernel's fp32 mode), or `bf16` with `remainder` (RemainderMasters) or without
/// (stochastic rounding with `key`).
struct LeanAdamTensors {
  float* fp32 = nullptr;
  std::uint16_t* bf16 = nullptr;
  std::int16_t* remainder = nullptr;
  std::uint32_t key = 0;
  std::int64_t first = 0;  // the index of element 0 in its whole tensor (a rank's slice)
  std::int64_t whole = 0;  // the whole tensor's numel (0: numel; ATen's tail is its end)
  const void* grad = nullptr;
  bool grad_bf16 = false;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* max_exp_avg_sq = nullptr;  // amsgrad
  bool moments_bf16 = false;
  std::int64_t numel = 0;
};

namespace lean_adam {

enum class Weight { fp32, remainder, stochastic };

MIXPREC_ALWAYS_INLINE inline float bf16_to_float(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}
MIXPREC_ALWAYS_INLINE inline std::uint16_t float_to_bf16(float f) {  // to nearest, ties to even
  std::uint16_t hi;
  std::int16_t rem;
  split_one(std::bit_cast<std::uint32_t>(f), hi, rem);
  return hi;
}

template <class T>
MIXPREC_ALWAYS_INLINE inline float load(const void* p, std::int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<const float*>(p)[i];
  } else {
    return bf16_to_float(static_cast<const std::uint16_t*>(p)[i]);
  }
}
template <class T>
MIXPREC_ALWAYS_INLINE inline void store(void* p, std::int64_t i, float v) {
  if constexpr (std::is_same_v<T, float>) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<std::uint16_t*>(p)[i] = float_to_bf16(v);
  }
}

// A product the compiler must round as written, never contract into the add that uses it
// (GCC contracts a * b + c into an fma under -ffp-contract=fast, its default, where the target
// has FMA: ATen's DEFAULT kernel has none). Only the loops of the unfused grouping use it.
MIXPREC_ALWAYS_INLINE inline float rounded(float x) {
#ifdef MIXPREC_X86_DISPATCH
  asm("" : "+x"(x));
#endif
  return x;
}

// Each chunk goes in three loops, so that each vectorises: the moments (keeping the decayed
// weight, m and the second moment in three chunk-sized scratch arrays), their square roots
// (sqrtps: with errno, GCC guards a std::sqrt in a loop with a branch to the library call and
// leaves the loop scalar), then the weights. Every value is the one a single loop computes:
// the same bits.
template <Weight W>
MIXPREC_ALWAYS_INLINE inline float load_weight(const LeanAdamTensors& t, std::int64_t i) {
  if constexpr (W == Weight::fp32) {
    return t.fp32[i];
  } else if constexpr (W == Weight::remainder) {
    return std::bit_cast<float>((static_cast<std::uint32_t>(t.bf16[i]) << 16) +
                                static_cast<std::uint32_t>(static_cast<std::int32_t>(t.remainder[i])));
  } else {
    return bf16_to_float(t.bf16[i]);
  }
}

// `Fused`: ATen's AVX2/AVX-512 grouping (explicit fmas; elements from `tail_from` on, ATen's
// tail, fuse the second moment the other way); else its DEFAULT one (no fma). The loops copy
// every constant and pointer they use into locals first: the stores through the arrays could
// otherwise alias the structs', which GCC would then reload every element, and not vectorise.
template <Weight W, class Grad, class Moment, bool Amsgrad, bool Fused>
MIXPREC_ALWAYS_INLINE inline void moments_loop(const LeanAdamTensors& t, const LeanAdamStep& s,
                                               std::int64_t begin, std::int64_t end,
                                               std::int64_t tail_from, float* __restrict w_out,
                                               float* __restrict m_out, float* __restrict v_out) {
  const bool adam_decay = !s.adamw && s.weight_decay != 0.0F;
  const bool lerp_small = std::abs(s.one_minus_beta1) < 0.5F;
  const float decay = s.decay, weight_decay = s.weight_decay, grad_scale = s.grad_scale;
  const float beta2 = s.beta2, c1 = s.one_minus_beta1, c1m1 = s.one_minus_beta1_minus_one;
  const float c2 = s.one_minus_beta2;
  const LeanAdamTensors w_only{t.fp32, t.bf16, t.remainder, 0, t.first, 0, nullptr, false,
                               nullptr, nullptr, nullptr, false, 0};
  const void* __restrict grad = t.grad;
  void* __restrict exp_avg = t.exp_avg;
  void* __restrict exp_avg_sq = t.exp_avg_sq;
  void* __restrict max_exp_avg_sq = t.max_exp_avg_sq;
  for (std::int64_t i = begin; i < end; ++i) {
    const float w = load_weight<W>(w_only, i);
    float g = load<Grad>(grad, i) / grad_scale;  // / 1 is exact
    const float m0 = load<Moment>(exp_avg, i);
    const float v0 = load<Moment>(exp_avg_sq, i);
    float m, v;
    if constexpr (Fused) {
      g = adam_decay ? __builtin_fmaf(w, weight_decay, g) : g;
      const float d = g - m0;
      m = lerp_small ? __builtin_fmaf(c1, d, m0) : __builtin_fmaf(c1m1, d, g);
      const float cg = c2 * g;
      v = i >= tail_from ? __builtin_fmaf(v0, beta2, cg * g) : __builtin_fmaf(cg, g, v0 * beta2);
    } else {
      g = adam_decay ? g + rounded(w * weight_decay) : g;
      const float d = g - m0;
      m = lerp_small ? m0 + rounded(c1 * d) : rounded(c1m1 * d) + g;
      v = rounded(v0 * beta2) + rounded(rounded(c2 * g) * g);
    }
    store<Moment>(exp_avg, i, m);
    store<Moment>(exp_avg_sq, i, v);
    float vmax = v;
    if constexpr (Amsgrad) {
      vmax = std::max(load<Moment>(max_exp_avg_sq, i), v);
      store<Moment>(max_exp_avg_sq, i, vmax);
    }
    w_out[i - begin] = w * decay;  // AdamW's decay (1 otherwise: exact)
    m_out[i - begin] = m;
    v_out[i - begin] = vmax;
  }
}

MIXPREC_ALWAYS_INLINE inline void sqrt_loop(float* x, std::int64_t n) {
  std::int64_t i = 0;
#ifdef MIXPREC_X86_DISPATCH
  for (; i + 4 <= n; i += 4) _mm_storeu_ps(x + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::sqrt(x[i]);
}

// Returns the number of ties that rounded down (RemainderMasters), each flagged in `down`.
// No product here feeds an add: the same bits under either grouping.
template <Weight W>
MIXPREC_ALWAYS_INLINE inline std::uint32_t weights_loop(const LeanAdamTensors& t,
                                                        const LeanAdamStep& s, std::int64_t begin,
                                                        std::int64_t end,
                                                        const float* __restrict w_in,
                                                        const float* __restrict m_in,
                                                        const float* __restrict root_in,
                                                        std::uint8_t* __restrict down) {
  const float bc2 = s.bias_correction2_sqrt, eps = s.eps, step_size = s.step_size;
  float* __restrict fp32 = t.fp32;
  std::uint16_t* __restrict bf16 = t.bf16;
  std::int16_t* __restrict remainder = t.remainder;
  const std::uint32_t key = t.key;
  const std::int64_t first = t.first;
  std::uint32_t ties = 0;
  for (std::int64_t i = begin; i < end; ++i) {
    const float denom = root_in[i - begin] / bc2 + eps;
    const float w = w_in[i - begin] - (step_size * m_in[i - begin]) / denom;
    if constexpr (W == Weight::fp32) {
      fp32[i] = w;
    } else if constexpr (W == Weight::remainder) {
      std::uint16_t hi;
      std::int16_t rem;
      const auto tie = split_one(std::bit_cast<std::uint32_t>(w), hi, rem);
      bf16[i] = hi;
      remainder[i] = rem;
      down[i - begin] = static_cast<std::uint8_t>(tie);
      ties += tie;
    } else {
      // stochastic_round_loop's rounding, element i of the tensor.
      const auto bits = std::bit_cast<std::uint32_t>(w);
      const bool finite = (bits & 0x7f800000U) != 0x7f800000U;
      const bool nan = (bits & 0x7fffffffU) > 0x7f800000U;
      const std::uint32_t noise = hash32(static_cast<std::uint32_t>(i + first) ^ key) >> 16;
      const std::uint32_t rounded_bits = (bits + (finite ? noise : 0U)) >> 16;
      bf16[i] = static_cast<std::uint16_t>(nan ? kBf16QuietNan : rounded_bits);
    }
  }
  return ties;
}

// The scratch of one chunk: the decayed weights, m, and the second moments' roots.
struct LeanScratch {
  float* w;
  float* m;
  float* root;
};

// One chunk (at most kGrainSize elements: the scratch arrays stay in the cache).
template <Weight W, class Grad, class Moment, bool Amsgrad, bool Fused>
MIXPREC_ALWAYS_INLINE inline std::uint32_t loop(const LeanAdamTensors& t, const LeanAdamStep& s,
                                                std::int64_t begin, std::int64_t end,
                                                std::int64_t tail_from, std::uint8_t* down,
                                                LeanScratch scratch) {
  moments_loop<W, Grad, Moment, Amsgrad, Fused>(t, s, begin, end, tail_from, scratch.w,
                                                scratch.m, scratch.root);
  sqrt_loop(scratch.root, end - begin);
  return weights_loop<W>(t, s, begin, end, scratch.w, scratch.m, scratch.root, down);
}

#ifdef MIXPREC_X86_DISPATCH
// ATen's AVX2 and AVX-512 grouping: AVX2 with FMA (the multiply-adds are explicit; AVX-512's
// wider vectors would compute the same bits).
template <Weight W, class Grad, class Moment, bool Amsgrad>
[[gnu::target("avx2,fma")]] std::uint32_t loop_fma(const LeanAdamTensors& t,
                                                   const LeanAdamStep& s, std::int64_t b,
                                                   std::int64_t e, std::int64_t tail_from,
                                                   std::uint8_t* d, LeanScratch scratch) {
  return loop<W, Grad, Moment, Amsgrad, true>(t, s, b, e, tail_from, d, scratch);
}
#endif

template <Weight W, class Grad, class Moment, bool Amsgrad>
std::uint32_t chunk(const LeanAdamTensors& t, const LeanAdamStep& s, std::int64_t b,
                    std::int64_t e, std::int64_t tail_from, std::uint8_t* d, LeanScratch scratch) {
#ifdef MIXPREC_X86_DISPATCH
  if (s.arithmetic.fused && cpu_isa() != Isa::base && cpu_has_fma()) {
    return loop_fma<W, Grad, Moment, Amsgrad>(t, s, b, e, tail_from, d, scratch);
  }
  return loop<W, Grad, Moment, Amsgrad, false>(t, s, b, e, tail_from, d, scratch);
#else
  return loop<W, Grad, Moment, Amsgrad, true>(t, s, b, e, tail_from, d, scratch);
#endif
}

template <Weight W, class Grad, class Moment, bool Amsgrad>
std::vector<std::int64_t> run(const LeanAdamTensors& t, const LeanAdamStep& s) {
  // ATen's tail: the last whole % width elements of the whole tensor, in this slice's indices.
  const auto whole = t.whole > 0 ? t.whole : t.numel;
  const auto tail_from = whole - whole % s.arithmetic.width - t.first;
  std::vector<std::int64_t> ties;  // rare: one element in ~2^17 per step
  std::mutex mutex;
  at::parallel_for(0, t.numel, kGrainSize, [&](std::int64_t first, std::int64_t last) {
    thread_local std::vector<std::uint8_t> down;
    thread_local std::vector<float> w, m, root;
    // A thread may get more than a grain: chunks of a grain at most, for the cache.
    for (std::int64_t begin = first; begin < last; begin += kGrainSize) {
      const auto end = std::min(last, begin + kGrainSize);
      const auto n = static_cast<std::size_t>(end - begin);
      if (down.size() < n) {
        down.resize(n);
        w.resize(n);
        m.resize(n);
        root.resize(n);
      }
      if (chunk<W, Grad, Moment, Amsgrad>(t, s, begin, end, tail_from, down.data(),
                                          {w.data(), m.data(), root.data()}) == 0) {
        continue;
      }
      const std::lock_guard<std::mutex> lock(mutex);
      for (std::int64_t i = begin; i < end; ++i) {
        if (down[static_cast<std::size_t>(i - begin)] != 0) ties.push_back(i);
      }
    }
  });
  std::sort(ties.begin(), ties.end());
  return ties;
}

template <Weight W, class Grad, class Moment>
std::vector<std::int64_t> run_amsgrad(const LeanAdamTensors& t, const LeanAdamStep& s) {
  return s.amsgrad ? run<W, Grad, Moment, true>(t, s) : run<W, Grad, Moment, false>(t, s);
}

template <Weight W>
std::vector<std::int64_t> run_weight(const LeanAdamTensors& t, const LeanAdamStep& s) {
  if (t.grad_bf16) {
    return t.moments_bf16 ? run_amsgrad<W, c10::BFloat16, c10::BFloat16>(t, s)
                          : run_amsgrad<W, c10::BFloat16, float>(t, s);
  }
  return t.moments_bf16 ? run_amsgrad<W, float, c10::BFloat16>(t, s)
                        : run_amsgrad<W, float, float>(t, s);
}

}  // namespace lean_adam

/// One parameter's Adam step over raw CPU memory (contiguous, `t.numel` elements each).
/// `down_ties`: RemainderMasters' ties that rounded down, from the last step; the new ones are
/// returned (empty for the other forms).
inline std::vector<std::int64_t> lean_adam_update(LeanAdamTensors t, const LeanAdamStep& s,
                                                  const std::vector<std::int64_t>& down_ties) {
  using lean_adam::Weight;
  if (t.fp32 != nullptr) return lean_adam::run_weight<Weight::fp32>(t, s);
  if (t.remainder == nullptr) return lean_adam::run_weight<Weight::stochastic>(t, s);
  // A tie that rounded down to an even bf16 value hi is also (hi + 1, remainder -32768): the
  // loop reads that form, and writes every element anew.
  for (const auto i : down_ties) t.bf16[i] = static_cast<std::uint16_t>(t.bf16[i] + 1U);
  return lean_adam::run_weight<Weight::remainder>(t, s);
}

}  // namespace mixprec::detail
