#pragma once
// The element loops of the lean training state (core/state_storage.hpp), on bits:
//   split:  an fp32 master -> its bf16 rounding (to nearest, ties to even: what copy_ makes)
//           and the int16 remainder that brings it back, exactly;
//   join:   bf16 weight + remainder -> the fp32 master;
//   stochastic_round: fp32 -> bf16, up or down with the probabilities that make it unbiased.
// CPU tensors run the loops below (AVX2 / AVX-512 copies chosen at run time, as the unscale
// kernels are); other devices run the same arithmetic as ATen integer ops (aten_* below), which
// the tests also run on the CPU and compare bit for bit.
//
// The remainder of x is bits(x) - bits(bf16(x)) << 16, in [-32768, 32768]. 32768 does not fit
// an int16, and both of its neighbours at the top of the range round to the same even bf16
// value (the tie that rounded down and the tie that rounded up), so 16 bits cannot tell them
// apart: the remainder stores -32768 for both and the few ties that rounded down (one element
// in 2^17 on average) are listed by index. The pair is then exactly the fp32 value, and the bf16
// weight is exactly what MixedO2's copy_ rounds, so the training is bit for bit the same.

#include <mixprec/core/parallel.hpp>
#include <mixprec/core/cpu_dispatch.hpp>

#include <ATen/ATen.h>

#include <atomic>
#include <bit>
#include <cstdint>
#include <vector>

namespace mixprec::detail {

inline constexpr std::uint32_t kBf16QuietNan = 0x7fc0U;

// One fp32 value's bf16 rounding and remainder; a tie that rounded down is reported.
MIXPREC_ALWAYS_INLINE inline std::uint32_t split_one(std::uint32_t bits, std::uint16_t& hi_out,
                                                       std::int16_t& rem_out) {
  const bool nan = (bits & 0x7fffffffU) > 0x7f800000U;
  const std::uint32_t hi = (bits + 0x7fffU + ((bits >> 16) & 1U)) >> 16;
  const auto rem = static_cast<std::int32_t>(bits - (hi << 16));
  const std::uint32_t down_tie = rem == 32768 ? 1U : 0U;
  hi_out = static_cast<std::uint16_t>(nan ? kBf16QuietNan : hi);
  rem_out = static_cast<std::int16_t>(nan ? 0 : (down_tie != 0U ? -32768 : rem));
  return nan ? 0U : down_tie;
}

MIXPREC_ALWAYS_INLINE inline std::int64_t split_loop(const std::uint32_t* master,
                                                     std::uint16_t* hi, std::int16_t* rem,
                                                     std::int64_t begin, std::int64_t end) {
  std::uint32_t ties = 0;
  for (std::int64_t i = begin; i < end; ++i) ties += split_one(master[i], hi[i], rem[i]);
  return ties;
}

MIXPREC_ALWAYS_INLINE inline void join_loop(const std::uint16_t* hi, const std::int16_t* rem,
                                            std::uint32_t* master, std::int64_t begin,
                                            std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) {
    master[i] = (static_cast<std::uint32_t>(hi[i]) << 16) +
                static_cast<std::uint32_t>(static_cast<std::int32_t>(rem[i]));
  }
}

// A 32-bit integer hash with full avalanche (Chris Wellons' "lowbias32" constants).
MIXPREC_ALWAYS_INLINE inline std::uint32_t hash32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// The key of one tensor's roundings at one step: element i adds the top 16 bits of
/// hash32(i ^ key) (indices past 2^32 repeat the low ones' bits).
inline std::uint32_t rounding_key(std::uint64_t seed, std::uint64_t step, std::uint64_t tensor) {
  return static_cast<std::uint32_t>(splitmix64(seed ^ splitmix64(step ^ splitmix64(tensor))));
}

// fp32 -> bf16 rounded up in magnitude with probability (low 16 bits) / 2^16: adding a uniform
// 16-bit number below the cut carries into the kept bits exactly that often. inf stays inf; a
// NaN becomes bf16's quiet NaN; the largest values may round up to inf, as they should.
MIXPREC_ALWAYS_INLINE inline void stochastic_round_loop(const std::uint32_t* in,
                                                        std::uint16_t* out, std::int64_t begin,
                                                        std::int64_t end, std::uint32_t key,
                                                        std::int64_t first = 0) {
  for (std::int64_t i = begin; i < end; ++i) {
    const std::uint32_t bits = in[i];
    const bool finite = (bits & 0x7f800000U) != 0x7f800000U;
    const bool nan = (bits & 0x7fffffffU) > 0x7f800000U;
    const std::uint32_t noise = hash32(static_cast<std::uint32_t>(i + first) ^ key) >> 16;
    const std::uint32_t rounded = (bits + (finite ? noise : 0U)) >> 16;
    out[i] = static_cast<std::uint16_t>(nan ? kBf16QuietNan : rounded);
  }
}

#ifdef MIXPREC_X86_DISPATCH
[[gnu::target("avx2")]] inline std::int64_t split_loop_avx2(const std::uint32_t* m, std::uint16_t* h,
                                                           std::int16_t* r, std::int64_t b,
                                                           std::int64_t e) {
  return split_loop(m, h, r, b, e);
}
[[gnu::target("avx512f,avx512bw")]] inline std::int64_t split_loop_avx512(
    const std::uint32_t* m, std::uint16_t* h, std::int16_t* r, std::int64_t b, std::int64_t e) {
  return split_loop(m, h, r, b, e);
}
[[gnu::target("avx2")]] inline void join_loop_avx2(const std::uint16_t* h, const std::int16_t* r,
                                                   std::uint32_t* m, std::int64_t b,
                                                   std::int64_t e) {
  join_loop(h, r, m, b, e);
}
[[gnu::target("avx512f,avx512bw")]] inline void join_loop_avx512(const std::uint16_t* h,
                                                                 const std::int16_t* r,
                                                                 std::uint32_t* m, std::int64_t b,
                                                                 std::int64_t e) {
  join_loop(h, r, m, b, e);
}
[[gnu::target("avx2")]] inline void stochastic_round_loop_avx2(const std::uint32_t* in,
                                                               std::uint16_t* out, std::int64_t b,
                                                               std::int64_t e, std::uint32_t key,
                                                               std::int64_t first) {
  stochastic_round_loop(in, out, b, e, key, first);
}
[[gnu::target("avx512f,avx512bw")]] inline void stochastic_round_loop_avx512(
    const std::uint32_t* in, std::uint16_t* out, std::int64_t b, std::int64_t e,
    std::uint32_t key, std::int64_t first) {
  stochastic_round_loop(in, out, b, e, key, first);
}
#endif

// The raw words of a contiguous tensor.
template <class T>
T* words(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

inline void check_lean_operands(const at::Tensor& fp32, const at::Tensor& bf16,
                                const at::Tensor& rem) {
  TORCH_INTERNAL_ASSERT(fp32.scalar_type() == at::kFloat && fp32.is_contiguous());
  TORCH_INTERNAL_ASSERT(bf16.scalar_type() == at::kBFloat16 && bf16.is_contiguous() &&
                        bf16.numel() == fp32.numel());
  TORCH_INTERNAL_ASSERT(!rem.defined() || (rem.scalar_type() == at::kShort &&
                                            rem.is_contiguous() && rem.numel() == fp32.numel()));
}

// An int64 operand of the ATen ops below (a literal's long long is ambiguous to 1.13's Scalar).
constexpr std::int64_t i64(std::int64_t v) { return v; }

/// split_loop through ATen integer ops (any device): writes `bf16` and `rem`, returns the
/// indices of the ties that rounded down.
inline std::vector<std::int64_t> aten_split(const at::Tensor& master, at::Tensor& bf16,
                                            at::Tensor& rem) {
  const auto bits = master.view(at::kInt).to(at::kLong).bitwise_and(i64(0xffffffff));
  bf16.copy_(master);  // ATen's rounding: to nearest, ties to even; NaN to a quiet NaN
  const auto hi = bf16.view(at::kShort).to(at::kLong).bitwise_and(i64(0xffff));
  auto r = bits - hi * 65536;
  const auto nan = master.isnan();
  const auto down = r.eq(32768).logical_and(nan.logical_not());
  r = at::where(down, at::full({}, -i64(32768), r.options()), r);
  r = at::where(nan, at::zeros({}, r.options()), r);
  rem.copy_(r.to(at::kShort));
  const auto idx = down.reshape({-1}).nonzero().reshape({-1}).cpu().contiguous();
  const auto* first = idx.data_ptr<std::int64_t>();
  return std::vector<std::int64_t>(first, first + idx.numel());
}

/// join_loop through ATen integer ops (any device).
inline void aten_join(const at::Tensor& bf16, const at::Tensor& rem,
                      const std::vector<std::int64_t>& down_ties, at::Tensor& master) {
  auto bits = bf16.view(at::kShort).to(at::kLong).bitwise_and(i64(0xffff)) * 65536 +
              rem.to(at::kLong);
  if (!down_ties.empty()) {
    auto flat = bits.view({-1});
    const auto idx = at::tensor(down_ties, at::kLong).to(flat.device());
    flat.index_add_(0, idx, at::full({static_cast<std::int64_t>(down_ties.size())}, i64(65536),
                                     flat.options()));
  }
  // Wrapped to int32 as two's complement: the bit pattern of the fp32 value.
  bits = at::where(bits.ge(i64(0x80000000)), bits - i64(0x100000000), bits);
  master.view(at::kInt).copy_(bits.to(at::kInt));
}

/// stochastic_round_loop through ATen integer ops (any device).
inline void aten_stochastic_round(const at::Tensor& in, at::Tensor& out, std::uint32_t key,
                                  std::int64_t first = 0) {
  const auto mask = i64(0xffffffff);
  auto x = at::arange(first, first + in.numel(), in.options().dtype(at::kLong)).bitwise_and(mask)
               .bitwise_xor(static_cast<std::int64_t>(key));
  const auto shr = [](const at::Tensor& v, int s) { return v.bitwise_right_shift(s); };
  x = x.bitwise_xor(shr(x, 16));
  x = (x * i64(0x7feb352d)).bitwise_and(mask);
  x = x.bitwise_xor(shr(x, 15));
  x = (x * i64(0x846ca68b)).bitwise_and(mask);
  x = x.bitwise_xor(shr(x, 16));
  const auto noise = shr(x, 16);
  const auto bits = in.reshape({-1}).view(at::kInt).to(at::kLong).bitwise_and(mask);
  const auto finite = bits.bitwise_and(i64(0x7f800000)).ne(i64(0x7f800000));
  auto rounded = shr(bits + at::where(finite, noise, at::zeros_like(noise)), 16);
  const auto nan = bits.bitwise_and(i64(0x7fffffff)).gt(i64(0x7f800000));
  rounded = at::where(nan, at::full({}, static_cast<std::int64_t>(kBf16QuietNan), rounded.options()),
                      rounded);
  rounded = at::where(rounded.ge(i64(0x8000)), rounded - i64(0x10000), rounded);
  out.view(at::kShort).reshape({-1}).copy_(rounded.to(at::kShort));
}

/// Splits `master` (fp32, contiguous) into `bf16` and `rem`; returns the down ties' indices.
inline std::vector<std::int64_t> split_master(const at::Tensor& master, at::Tensor& bf16,
                                              at::Tensor& rem) {
  check_lean_operands(master, bf16, rem);
  if (!master.device().is_cpu()) return aten_split(master, bf16, rem);
  const auto* m = words<const std::uint32_t>(master);
  auto* h = words<std::uint16_t>(bf16);
  auto* r = words<std::int16_t>(rem);
  std::atomic<std::int64_t> ties{0};
  at::parallel_for(0, master.numel(), kGrainSize, [&](std::int64_t b, std::int64_t e) {
    std::int64_t n = 0;
#ifdef MIXPREC_X86_DISPATCH
    switch (cpu_isa()) {
      case Isa::avx512: n = split_loop_avx512(m, h, r, b, e); break;
      case Isa::avx2: n = split_loop_avx2(m, h, r, b, e); break;
      case Isa::base: n = split_loop(m, h, r, b, e); break;
    }
#else
    n = split_loop(m, h, r, b, e);
#endif
    if (n != 0) ties.fetch_add(n, std::memory_order_relaxed);
  });
  std::vector<std::int64_t> down;
  if (ties.load() == 0) return down;
  for (std::int64_t i = 0; i < master.numel(); ++i) {  // rare: one element in ~2^17
    if ((m[i] & 0xffffU) == 0x8000U && ((m[i] >> 16) & 1U) == 0U &&
        (m[i] & 0x7fffffffU) <= 0x7f800000U) {
      down.push_back(i);
    }
  }
  return down;
}

/// The fp32 master of `bf16` and `rem` (and the down ties), into `master` (fp32, contiguous).
inline void join_master(const at::Tensor& bf16, const at::Tensor& rem,
                        const std::vector<std::int64_t>& down_ties, at::Tensor& master) {
  check_lean_operands(master, bf16, rem);
  if (!master.device().is_cpu()) return aten_join(bf16, rem, down_ties, master);
  const auto* h = words<const std::uint16_t>(bf16);
  const auto* r = words<const std::int16_t>(rem);
  auto* m = words<std::uint32_t>(master);
  at::parallel_for(0, master.numel(), kGrainSize, [&](std::int64_t b, std::int64_t e) {
#ifdef MIXPREC_X86_DISPATCH
    switch (cpu_isa()) {
      case Isa::avx512: return join_loop_avx512(h, r, m, b, e);
      case Isa::avx2: return join_loop_avx2(h, r, m, b, e);
      case Isa::base: break;
    }
#endif
    join_loop(h, r, m, b, e);
  });
  for (const auto i : down_ties) m[i] += 0x10000U;
}

/// `in` (fp32, contiguous) rounded stochastically into `out` (bf16, contiguous) with `key`;
/// `first`: the index of in's first element in its whole tensor (a rank's slice of it rounds
/// as the whole tensor would).
inline void stochastic_round(const at::Tensor& in, at::Tensor& out, std::uint32_t key,
                             std::int64_t first = 0) {
  check_lean_operands(in, out, at::Tensor());
  if (!in.device().is_cpu()) return aten_stochastic_round(in, out, key, first);
  const auto* x = words<const std::uint32_t>(in);
  auto* y = words<std::uint16_t>(out);
  at::parallel_for(0, in.numel(), kGrainSize, [&](std::int64_t b, std::int64_t e) {
#ifdef MIXPREC_X86_DISPATCH
    switch (cpu_isa()) {
      case Isa::avx512: return stochastic_round_loop_avx512(x, y, b, e, key, first);
      case Isa::avx2: return stochastic_round_loop_avx2(x, y, b, e, key, first);
      case Isa::base: break;
    }
#endif
    stochastic_round_loop(x, y, b, e, key, first);
  });
}

}  // namespace mixprec::detail
