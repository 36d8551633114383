#pragma once
/// One Adam or AdamW step over the lean storages (core/state_storage.hpp) in a single pass per
/// element: read the gradient (bf16, or fp32 where micro-batches accumulated it), divide it by
/// the scale, read the master (the bf16 weight and its remainder, the bf16 weight alone under
/// stochastic rounding, or an fp32 parameter), update the moments (fp32 or bf16) and the master,
/// write the bf16 weight and its remainder (or its stochastic rounding). No fp32 master, master
/// gradient or fp32 moment is made: what the step moves is what the state holds.
///
/// The arithmetic is Adam's as ATen's fused kernel groups it (the weight decay first, the
/// moments as m*beta + g*(1-beta), the update lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)), in fp32;
/// the same steps on fp32 masters give the same bits (the kernel has an fp32 mode, and
/// tests/optim/test_lean_state.cpp compares the two over 200 steps), and ATen's own kernel
/// within the few ulps by which any two groupings differ.

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

/// The constants of one parameter's step, each computed in double and rounded to float once,
/// as LibTorch's Adam passes its scalars (1 - 0.999 in float arithmetic is 1.3e-5 off).
struct LeanAdamStep {
  float beta1 = 0, beta2 = 0, one_minus_beta1 = 0, one_minus_beta2 = 0, eps = 0;
  float weight_decay = 0;
  float decay = 1;                  // AdamW: 1 - lr * weight_decay
  float step_size = 0;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt = 1;  // sqrt(1 - beta2^step)
  float inv_scale = 1;  // 1 / (loss scale / clip coefficient); 1: nothing to divide
  bool adamw = true;
  bool amsgrad = false;

  /// The constants of step `step` (counted from 1).
  static LeanAdamStep make(double lr, double beta1, double beta2, double eps, double weight_decay,
                           std::int64_t step, bool adamw, bool amsgrad) {
    LeanAdamStep s;
    const auto count = static_cast<double>(step);
    s.beta1 = static_cast<float>(beta1);
    s.beta2 = static_cast<float>(beta2);
    s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    s.eps = static_cast<float>(eps);
    s.weight_decay = static_cast<float>(weight_decay);
    s.decay = static_cast<float>(1.0 - lr * weight_decay);
    s.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, count)));
    s.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, count)));
    s.adamw = adamw;
    s.amsgrad = amsgrad;
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

// Each chunk goes in three loops, so that each vectorises: the moments (keeping m and the
// second moment in two chunk-sized scratch arrays), their square roots (sqrtps: with errno,
// GCC guards a std::sqrt in a loop with a branch to the library call and leaves the loop
// scalar), then the weights. Every value is the one a single loop computes: the same bits.
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

// The loops copy every constant and pointer they use into locals first: the stores through
// the arrays could otherwise alias the structs', which GCC would then reload every element,
// and not vectorise.
template <Weight W, class Grad, class Moment, bool Amsgrad>
MIXPREC_ALWAYS_INLINE inline void moments_loop(const LeanAdamTensors& t, const LeanAdamStep& s,
                                               std::int64_t begin, std::int64_t end,
                                               float* __restrict m_out, float* __restrict v_out) {
  // AdamW decays the weight (grad_decay 0: g + 0 * w is g), Adam the gradient (decay 1).
  const float decay = s.adamw ? s.decay : 1.0F;
  const float grad_decay = s.adamw ? 0.0F : s.weight_decay;
  const float inv_scale = s.inv_scale, beta1 = s.beta1, beta2 = s.beta2;
  const float one_minus_beta1 = s.one_minus_beta1, one_minus_beta2 = s.one_minus_beta2;
  const LeanAdamTensors w_only{t.fp32, t.bf16, t.remainder, 0, t.first, nullptr, false, nullptr,
                               nullptr, nullptr, false, 0};
  const void* __restrict grad = t.grad;
  void* __restrict exp_avg = t.exp_avg;
  void* __restrict exp_avg_sq = t.exp_avg_sq;
  void* __restrict max_exp_avg_sq = t.max_exp_avg_sq;
  for (std::int64_t i = begin; i < end; ++i) {
    const float w = load_weight<W>(w_only, i) * decay;
    const float g = load<Grad>(grad, i) * inv_scale + grad_decay * w;
    const float m = load<Moment>(exp_avg, i) * beta1 + g * one_minus_beta1;
    const float v = load<Moment>(exp_avg_sq, i) * beta2 + (g * g) * one_minus_beta2;
    store<Moment>(exp_avg, i, m);
    store<Moment>(exp_avg_sq, i, v);
    float vmax = v;
    if constexpr (Amsgrad) {
      vmax = std::max(load<Moment>(max_exp_avg_sq, i), v);
      store<Moment>(max_exp_avg_sq, i, vmax);
    }
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
template <Weight W>
MIXPREC_ALWAYS_INLINE inline std::uint32_t weights_loop(const LeanAdamTensors& t,
                                                        const LeanAdamStep& s, std::int64_t begin,
                                                        std::int64_t end,
                                                        const float* __restrict m_in,
                                                        const float* __restrict root_in,
                                                        std::uint8_t* __restrict down) {
  const float decay = s.adamw ? s.decay : 1.0F;
  const float bc2 = s.bias_correction2_sqrt, eps = s.eps, step_size = s.step_size;
  float* __restrict fp32 = t.fp32;
  std::uint16_t* __restrict bf16 = t.bf16;
  std::int16_t* __restrict remainder = t.remainder;
  const std::uint32_t key = t.key;
  const std::int64_t first = t.first;
  std::uint32_t ties = 0;
  for (std::int64_t i = begin; i < end; ++i) {
    const float denom = root_in[i - begin] / bc2 + eps;
    float w;
    if constexpr (W == Weight::fp32) {
      w = fp32[i];
    } else if constexpr (W == Weight::remainder) {
      w = std::bit_cast<float>((static_cast<std::uint32_t>(bf16[i]) << 16) +
                               static_cast<std::uint32_t>(static_cast<std::int32_t>(remainder[i])));
    } else {
      w = bf16_to_float(bf16[i]);
    }
    w = w * decay - step_size * (m_in[i - begin] / denom);
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
      const std::uint32_t rounded = (bits + (finite ? noise : 0U)) >> 16;
      bf16[i] = static_cast<std::uint16_t>(nan ? kBf16QuietNan : rounded);
    }
  }
  return ties;
}

// One chunk (at most kGrainSize elements: the scratch arrays stay in the cache).
template <Weight W, class Grad, class Moment, bool Amsgrad>
MIXPREC_ALWAYS_INLINE inline std::uint32_t loop(const LeanAdamTensors& t, const LeanAdamStep& s,
                                                std::int64_t begin, std::int64_t end,
                                                std::uint8_t* down, float* m, float* root) {
  moments_loop<W, Grad, Moment, Amsgrad>(t, s, begin, end, m, root);
  sqrt_loop(root, end - begin);
  return weights_loop<W>(t, s, begin, end, m, root, down);
}

#ifdef MIXPREC_X86_DISPATCH
template <Weight W, class Grad, class Moment, bool Amsgrad>
[[gnu::target("avx2")]] std::uint32_t loop_avx2(const LeanAdamTensors& t, const LeanAdamStep& s,
                                                std::int64_t b, std::int64_t e, std::uint8_t* d,
                                                float* m, float* root) {
  return loop<W, Grad, Moment, Amsgrad>(t, s, b, e, d, m, root);
}
#endif

// AVX2 or the consumer's own flags, never AVX-512: AVX-512F brings fused multiply-adds, which
// GCC contracts m * beta + g * (1 - beta) into (-ffp-contract=fast, its default), and the bits
// would then depend on the machine. AVX2 without FMA rounds each product as the scalar code
// does: the same bits on every x86-64.
template <Weight W, class Grad, class Moment, bool Amsgrad>
std::uint32_t chunk(const LeanAdamTensors& t, const LeanAdamStep& s, std::int64_t b,
                    std::int64_t e, std::uint8_t* d, float* m, float* root) {
#ifdef MIXPREC_X86_DISPATCH
  switch (cpu_isa()) {
    case Isa::avx512:
    case Isa::avx2: return loop_avx2<W, Grad, Moment, Amsgrad>(t, s, b, e, d, m, root);
    case Isa::base: break;
  }
#endif
  return loop<W, Grad, Moment, Amsgrad>(t, s, b, e, d, m, root);
}

template <Weight W, class Grad, class Moment, bool Amsgrad>
std::vector<std::int64_t> run(const LeanAdamTensors& t, const LeanAdamStep& s) {
  std::vector<std::int64_t> ties;  // rare: one element in ~2^17 per step
  std::mutex mutex;
  at::parallel_for(0, t.numel, kGrainSize, [&](std::int64_t first, std::int64_t last) {
    thread_local std::vector<std::uint8_t> down;
    thread_local std::vector<float> m, root;
    // A thread may get more than a grain: chunks of a grain at most, for the cache.
    for (std::int64_t begin = first; begin < last; begin += kGrainSize) {
      const auto end = std::min(last, begin + kGrainSize);
      const auto n = static_cast<std::size_t>(end - begin);
      if (down.size() < n) {
        down.resize(n);
        m.resize(n);
        root.resize(n);
      }
      if (chunk<W, Grad, Moment, Amsgrad>(t, s, begin, end, down.data(), m.data(),
                                          root.data()) == 0) {
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
