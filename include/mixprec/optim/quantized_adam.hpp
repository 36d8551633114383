#pragma once
// One Adam or AdamW step of one tensor whose moments are kept in a block format (optim/
// block_quantize.hpp) or, where the tensor is too small to quantize, plain (fp32 or bf16), in
// torchao 0.18's arithmetic (torchao/optim/adam.py, single_param_adam, run eagerly): block by
// block, each block's moments decoded, updated in fp32 and coded back, and its weights stepped
// with the fp32 moments; no tensor is ever whole in fp32. The weight is an fp32 tensor, or a
// bf16 weight with its remainder (RemainderMasters) or without (stochastic rounding).
//
// torchao's step, per element, each operation rounded to fp32 as its tensor ops round:
//   AdamW: w' = w - (lr * wd) * w                 Adam: g' = g + wd * w
//   m = lerp(m0, g, 1 - beta1)   v = lerp(v0, g * g, 1 - beta2)
//   w'' = w' - (lr * (m / bc1)) / (sqrt(v) / sqrt(bc2) + eps)
// with bc = 1 - beta^step by ATen's pow of fp32 values (its step is an fp32 tensor), and every
// sqrt ATen's (where LibTorch has MKL, its vsSqrt: not correctly rounded). ATen's
// lerp is a fused multiply-add under its AVX2 and AVX-512 kernels, tail included, and two
// roundings under DEFAULT (measured, torch 2.13): the kernel takes the form of the capability
// ATen dispatches to. Every other product stays apart from the sum that uses it: each such
// pair is computed in two loops through a scratch array of the block, which no compiler
// contracts into one multiply-add, whatever -ffp-contract says. No AMSGrad: torchao's quantized
// states cannot take it (torchao gives them no torch.maximum), and the Trainer refuses it.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/cpu_dispatch.hpp>
#include <mixprec/core/parallel.hpp>
#include <mixprec/core/state_storage.hpp>
#include <mixprec/optim/block_quantize.hpp>
#include <mixprec/optim/lean_kernels.hpp>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

namespace mixprec::detail {

/// Whether ATen's lerp fuses its multiply-add on this CPU under this process's capability
/// (torchao's moments are lerps): its AVX2 and AVX-512 kernels do, its DEFAULT kernel does
/// not. Where LibTorch cannot say (< 2.4): where the CPU has FMA. Other architectures: fused.
inline bool aten_lerp_fused() {
  static const bool fused = [] {
#ifdef MIXPREC_X86_DISPATCH
    const auto capability = aten_cpu_capability();
    if (capability.empty()) return cpu_has_fma();
    return capability != "DEFAULT" && cpu_has_fma();
#else
    return true;
#endif
  }();
  return fused;
}

/// The constants of one tensor's step, as torchao's step rounds them.
struct TorchaoAdamStep {
  float lr = 0;         // lr as the fp32 tensor torchao keeps
  float lr_decay = 0;   // AdamW: lr * weight_decay (fp32)
  float decay = 0;      // Adam: weight_decay (fp32)
  float weight1 = 0;    // 1 - beta1, the lerp weight
  float weight2 = 0;    // 1 - beta2
  float bc1 = 1;        // 1 - beta1^step
  float bc2_sqrt = 1;   // sqrt(1 - beta2^step)
  float eps = 0;
  float inv_scale = 1;  // the gradients' factor (1 / (loss scale / clip coefficient)); 1: none
  bool adamw = true;
  bool fused = true;    // ATen's lerp is one multiply-add (aten_lerp_fused)

  /// The constants of step `step` (counted from 1).
  static TorchaoAdamStep make(double lr, double beta1, double beta2, double eps,
                              double weight_decay, std::int64_t step, bool adamw) {
    TorchaoAdamStep s;
    s.lr = static_cast<float>(lr);
    s.lr_decay = s.lr * static_cast<float>(weight_decay);
    s.decay = static_cast<float>(weight_decay);
    s.weight1 = static_cast<float>(1.0 - beta1);
    s.weight2 = static_cast<float>(1.0 - beta2);
    // As torchao's tensor ops: 1 - beta ** step, then the 0-dim tensor's sqrt, which is ATen's
    // (not always the correctly rounded one).
    const auto count = at::scalar_tensor(static_cast<double>(step), at::kFloat);
    s.bc1 = at::rsub(at::pow(beta1, count), 1).item<float>();
    s.bc2_sqrt = at::rsub(at::pow(beta2, count), 1).sqrt().item<float>();
    s.eps = static_cast<float>(eps);
    s.adamw = adamw;
    s.fused = aten_lerp_fused();
    return s;
  }
};

/// Where one tensor's values live. Exactly one weight form: `fp32`, or `bf16` with `remainder`
/// (RemainderMasters) or without (stochastic rounding with `key`). The moments: rows of
/// `moments`' block format, or plain fp32 (bf16 where `moments_bf16`).
struct QuantizedAdamTensors {
  float* fp32 = nullptr;
  std::uint16_t* bf16 = nullptr;
  std::int16_t* remainder = nullptr;
  std::uint32_t key = 0;
  std::int64_t first = 0;  // the index of element 0 in its whole tensor (a rank's piece)
  const void* grad = nullptr;
  bool grad_bf16 = false;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  MomentCoding moments;            // plain: fp32 or bf16 tensors
  bool moments_bf16 = false;
  std::int64_t numel = 0;          // a multiple of moments.block where quantized
};

namespace qadam {

enum class Weight { fp32, remainder, stochastic };

// A chunk's working values, each `n` floats.
struct Scratch {
  float *w, *w1, *g, *t, *m0, *v0, *m, *v, *x;
};

inline constexpr int kScratchArrays = 9;

// Elements stepped at a time (whole blocks where the moments are quantized): enough that
// ATen's sqrt, called once per chunk, costs little; few enough that a chunk's working values
// (kScratchArrays floats each) stay in the L2 cache.
inline constexpr std::int64_t kChunk = 8192;
inline std::int64_t chunk_of(const MomentCoding& moments) {
  if (!moments.quantized()) return kChunk;
  return std::max<std::int64_t>(1, kChunk / moments.block) * moments.block;
}

MIXPREC_ALWAYS_INLINE inline float from_bf16(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}
MIXPREC_ALWAYS_INLINE inline std::uint16_t to_bf16(float f) {  // to nearest, ties to even
  std::uint16_t hi;
  std::int16_t rem;
  split_one(std::bit_cast<std::uint32_t>(f), hi, rem);
  return hi;
}

// One moment (`slot`: exp_avg, or exp_avg_sq; `is_signed` for exp_avg) of
// elements [begin, begin + n): decoded into `out`, or coded from `in`.
inline void load_moment(const QuantizedAdamTensors& t, const void* slot, bool is_signed,
                        std::int64_t begin, std::int64_t n, float* __restrict out) {
  if (!t.moments.quantized()) {
    if (t.moments_bf16) {
      const auto* p = static_cast<const std::uint16_t*>(slot) + begin;
      for (std::int64_t i = 0; i < n; ++i) out[i] = from_bf16(p[i]);
    } else {
      std::copy_n(static_cast<const float*>(slot) + begin, n, out);
    }
    return;
  }
  const auto block = t.moments.block;
  const auto stride = row_bytes(t.moments.format, block);
  const auto* rows = static_cast<const std::uint8_t*>(slot) + (begin / block) * stride;
  const auto* map = quant_map(t.moments.format, is_signed);
  quant::dispatch(t.moments.format, [&](auto format) {
    for (std::int64_t r = 0; r * block < n; ++r) {
      dequantize_row<decltype(format)::value>(rows + r * stride, block, map, out + r * block);
    }
  });
}

inline void store_moment(const QuantizedAdamTensors& t, void* slot, bool is_signed,
                         std::int64_t begin, std::int64_t n, const float* __restrict in) {
  if (!t.moments.quantized()) {
    if (t.moments_bf16) {
      auto* p = static_cast<std::uint16_t*>(slot) + begin;
      for (std::int64_t i = 0; i < n; ++i) p[i] = to_bf16(in[i]);
    } else {
      std::copy_n(in, n, static_cast<float*>(slot) + begin);
    }
    return;
  }
  const auto block = t.moments.block;
  const auto stride = row_bytes(t.moments.format, block);
  auto* rows = static_cast<std::uint8_t*>(slot) + (begin / block) * stride;
  const auto* map = quant_map(t.moments.format, is_signed);
  quant::dispatch(t.moments.format, [&](auto format) {
    for (std::int64_t r = 0; r * block < n; ++r) {
      quantize_row<decltype(format)::value>(in + r * block, block, map, rows + r * stride);
    }
  });
}

inline void load_weights(const QuantizedAdamTensors& t, Weight form, std::int64_t begin,
                         std::int64_t n, float* __restrict out) {
  switch (form) {
    case Weight::fp32: std::copy_n(t.fp32 + begin, n, out); return;
    case Weight::remainder:
      for (std::int64_t i = 0; i < n; ++i) {
        const auto k = begin + i;
        out[i] = std::bit_cast<float>((static_cast<std::uint32_t>(t.bf16[k]) << 16) +
                                      static_cast<std::uint32_t>(static_cast<std::int32_t>(t.remainder[k])));
      }
      return;
    case Weight::stochastic:
      for (std::int64_t i = 0; i < n; ++i) out[i] = from_bf16(t.bf16[begin + i]);
      return;
  }
}

// Returns the ties that rounded down (RemainderMasters), each flagged in `down`.
inline std::uint32_t store_weights(const QuantizedAdamTensors& t, Weight form, std::int64_t begin,
                                   std::int64_t n, const float* __restrict in,
                                   std::uint8_t* __restrict down) {
  std::uint32_t ties = 0;
  switch (form) {
    case Weight::fp32: std::copy_n(in, n, t.fp32 + begin); break;
    case Weight::remainder:
      for (std::int64_t i = 0; i < n; ++i) {
        const auto tie = split_one(std::bit_cast<std::uint32_t>(in[i]), t.bf16[begin + i],
                                   t.remainder[begin + i]);
        down[i] = static_cast<std::uint8_t>(tie);
        ties += tie;
      }
      break;
    case Weight::stochastic:  // lean_kernels.hpp's stochastic_round_loop, element begin + i
      for (std::int64_t i = 0; i < n; ++i) {
        const auto bits = std::bit_cast<std::uint32_t>(in[i]);
        const bool finite = (bits & 0x7f800000U) != 0x7f800000U;
        const bool nan = (bits & 0x7fffffffU) > 0x7f800000U;
        const std::uint32_t noise = hash32(static_cast<std::uint32_t>(begin + i + t.first) ^ t.key) >> 16;
        const std::uint32_t rounded = (bits + (finite ? noise : 0U)) >> 16;
        t.bf16[begin + i] = static_cast<std::uint16_t>(nan ? kBf16QuietNan : rounded);
      }
      break;
  }
  return ties;
}

// out = sqrt(x) as ATen computes it: where LibTorch is built with MKL (the wheels), MKL's
// vsSqrt, which is not correctly rounded (1 ulp off in about 20 % of fp32 values, measured
// with torch 2.13 under every capability); one ATen call per chunk of the tensor.
inline void sqrt_of(float* x, std::int64_t n, float* out) {
  auto in = at::from_blob(x, {n}, at::TensorOptions(at::kFloat));
  auto result = at::from_blob(out, {n}, at::TensorOptions(at::kFloat));
  at::sqrt_out(result, in);
}

// lerp(a, b, weight) of n elements, as ATen computes it: one multiply-add where `Fused`, else
// the product rounded before the sum (`d`, `p`: scratch).
template <bool Fused>
MIXPREC_ALWAYS_INLINE inline void lerp(const float* __restrict a, const float* __restrict b,
                                       float weight, std::int64_t n, float* __restrict out,
                                       float* __restrict d, float* __restrict p) {
  const bool small = std::abs(weight) < 0.5F;
  for (std::int64_t i = 0; i < n; ++i) d[i] = b[i] - a[i];
  if constexpr (Fused) {
    if (small) {
      for (std::int64_t i = 0; i < n; ++i) out[i] = __builtin_fmaf(weight, d[i], a[i]);
    } else {
      const float c = weight - 1.0F;
      for (std::int64_t i = 0; i < n; ++i) out[i] = __builtin_fmaf(c, d[i], b[i]);
    }
  } else {
    if (small) {
      for (std::int64_t i = 0; i < n; ++i) p[i] = weight * d[i];
      for (std::int64_t i = 0; i < n; ++i) out[i] = a[i] + p[i];
    } else {
      const float c = 1.0F - weight;
      for (std::int64_t i = 0; i < n; ++i) p[i] = d[i] * c;
      for (std::int64_t i = 0; i < n; ++i) out[i] = b[i] - p[i];
    }
  }
}

// The arithmetic of n elements whose w, g, m0, v0 are loaded: writes w1 (the decayed weight),
// m, v, then w (the stepped weight); x and t are scratch.
template <bool Fused>
MIXPREC_ALWAYS_INLINE inline void math(const TorchaoAdamStep& s, std::int64_t n, const Scratch& k) {
  float* __restrict w = k.w;
  float* __restrict w1 = k.w1;
  float* __restrict g = k.g;
  float* __restrict t = k.t;
  float* __restrict m = k.m;
  float* __restrict v = k.v;
  float* __restrict x = k.x;
  const float lr = s.lr, bc1 = s.bc1, bc2_sqrt = s.bc2_sqrt, eps = s.eps;
  if (s.adamw) {  // p - (lr * wd) * p
    const float c = s.lr_decay;
    for (std::int64_t i = 0; i < n; ++i) t[i] = c * w[i];
    for (std::int64_t i = 0; i < n; ++i) w1[i] = w[i] - t[i];
  } else {  // g + wd * p
    const float c = s.decay;
    for (std::int64_t i = 0; i < n; ++i) t[i] = c * w[i];
    for (std::int64_t i = 0; i < n; ++i) g[i] = g[i] + t[i];
    std::copy_n(w, n, w1);
  }
  lerp<Fused>(k.m0, g, s.weight1, n, m, x, t);
  for (std::int64_t i = 0; i < n; ++i) w[i] = g[i] * g[i];  // w: g * g from here on
  lerp<Fused>(k.v0, w, s.weight2, n, v, x, t);
  sqrt_of(v, n, t);
  for (std::int64_t i = 0; i < n; ++i) {
    const float denom = t[i] / bc2_sqrt + eps;
    w[i] = w1[i] - (lr * (m[i] / bc1)) / denom;
  }
}

#ifdef MIXPREC_X86_DISPATCH
[[gnu::target("avx2,fma")]] inline void math_fused_avx2(const TorchaoAdamStep& s, std::int64_t n,
                                                        const Scratch& k) {
  math<true>(s, n, k);
}
#endif

inline void step_math(const TorchaoAdamStep& s, std::int64_t n, const Scratch& k) {
#ifdef MIXPREC_X86_DISPATCH
  if (s.fused) {
    if (cpu_isa() != Isa::base && cpu_has_fma()) return math_fused_avx2(s, n, k);
    return math<true>(s, n, k);  // a library fmaf: right, slow; ATen's capability implies FMA
  }
  return math<false>(s, n, k);
#else
  return s.fused ? math<true>(s, n, k) : math<false>(s, n, k);
#endif
}

// Elements [begin, begin + n) of one tensor: loaded, stepped, stored. Returns the ties that
// rounded down, flagged in `down`.
inline std::uint32_t step_chunk(const QuantizedAdamTensors& t, const TorchaoAdamStep& s,
                                Weight form, std::int64_t begin, std::int64_t n,
                                const Scratch& k, std::uint8_t* down) {
  load_weights(t, form, begin, n, k.w);
  if (t.grad_bf16) {
    const auto* g = static_cast<const std::uint16_t*>(t.grad) + begin;
    for (std::int64_t i = 0; i < n; ++i) k.g[i] = from_bf16(g[i]);
  } else {
    std::copy_n(static_cast<const float*>(t.grad) + begin, n, k.g);
  }
  if (s.inv_scale != 1.0F) {
    const float inv = s.inv_scale;
    float* __restrict g = k.g;
    for (std::int64_t i = 0; i < n; ++i) g[i] = g[i] * inv;
  }
  load_moment(t, t.exp_avg, true, begin, n, k.m0);
  load_moment(t, t.exp_avg_sq, false, begin, n, k.v0);
  step_math(s, n, k);
  store_moment(t, t.exp_avg, true, begin, n, k.m);
  store_moment(t, t.exp_avg_sq, false, begin, n, k.v);
  return store_weights(t, form, begin, n, k.w, down);
}

}  // namespace qadam

/// One tensor's torchao Adam step over raw CPU memory (contiguous; `t.numel` elements, the
/// moments as `t.moments` says). `down_ties`: RemainderMasters' ties that rounded down, from the
/// last step; the new ones are returned (empty for the other weight forms).
inline std::vector<std::int64_t> quantized_adam_update(QuantizedAdamTensors t,
                                                       const TorchaoAdamStep& s,
                                                       const std::vector<std::int64_t>& down_ties) {
  using qadam::Weight;
  const auto form = t.fp32 != nullptr ? Weight::fp32
                                      : (t.remainder != nullptr ? Weight::remainder : Weight::stochastic);
  if (form == Weight::remainder) {
    // A tie that rounded down to an even bf16 value hi is also (hi + 1, remainder -32768): the
    // loop reads that form, and writes every element anew.
    for (const auto i : down_ties) t.bf16[i] = static_cast<std::uint16_t>(t.bf16[i] + 1U);
  }
  const auto chunk = qadam::chunk_of(t.moments);
  TORCH_INTERNAL_ASSERT(!t.moments.quantized() || t.numel % t.moments.block == 0);
  const auto chunks = (t.numel + chunk - 1) / chunk;
  std::vector<std::int64_t> ties;  // rare: one element in ~2^17 per step
  std::mutex mutex;
  at::parallel_for(0, chunks, std::max<std::int64_t>(1, kGrainSize / chunk),
                   [&](std::int64_t first, std::int64_t last) {
    // Kept from call to call: a fresh 300 KB buffer would be mapped and zeroed every time.
    thread_local std::vector<float> buffer;
    thread_local std::vector<std::uint8_t> down;
    if (buffer.size() < static_cast<std::size_t>(qadam::kScratchArrays * chunk)) {
      buffer.resize(static_cast<std::size_t>(qadam::kScratchArrays * chunk));
      down.resize(static_cast<std::size_t>(chunk));
    }
    float* b = buffer.data();
    const qadam::Scratch k{b,             b + chunk,     b + 2 * chunk,
                           b + 3 * chunk, b + 4 * chunk, b + 5 * chunk,
                           b + 6 * chunk, b + 7 * chunk, b + 8 * chunk};
    for (auto c = first; c < last; ++c) {
      const auto begin = c * chunk;
      const auto n = std::min(chunk, t.numel - begin);
      if (qadam::step_chunk(t, s, form, begin, n, k, down.data()) == 0) continue;
      const std::lock_guard<std::mutex> lock(mutex);
      for (std::int64_t i = 0; i < n; ++i) {
        if (down[static_cast<std::size_t>(i)] != 0) ties.push_back(begin + i);
      }
    }
  });
  std::sort(ties.begin(), ties.end());
  return ties;
}

}  // namespace mixprec::detail
