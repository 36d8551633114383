#pragma once
// Block formats of Adam's moments (core/state_storage.hpp's Moments8bit, Moments4bit,
// MomentsFp8): torchao 0.18's low-bit optimizer states, bit for bit (torchao/optim/
// quant_utils.py, subclass_8bit.py, subclass_4bit.py, subclass_fp8.py).
//
// A tensor of n elements (n % block == 0) is kept as n / block rows of bytes, one per block:
// the block's codes, then its fp32 scale (4 bytes, the machine's byte order). So a block's
// codes and scale lie together, a slice of whole blocks is a slice of rows (a data-parallel
// rank's piece), and the optimizer holds one uint8 tensor per moment.
//
//   dynamic8: scale = max |x| of the block (at least 1e-12); each x / scale coded as the entry
//             of a 256-value map found by torchao's branchless binary search (the largest entry
//             <= it), moved one up where it lies at least half way to the next; the map is
//             bitsandbytes' dynamic map (create_dynamic_map), signed for exp_avg, unsigned for
//             exp_avg_sq.
//   dynamic4: the same over 16 values (signed: create_dynamic_map(True, 3, 4); unsigned: 1/16 ..
//             1), two codes a byte, the even element's in the high half.
//   fp8:      scale = max |x| (at least 1e-12) / 448; x / scale as float8_e4m3fn (to nearest,
//             ties to even, saturated at 448 as ATen's cast is).
// Decoding is map[code] * scale (fp8: the e4m3 value * scale), in fp32 as torchao computes it.
//
// The maps are computed as torchao computes them, with ATen's linspace (whose AVX2 and AVX-512
// kernels fuse a multiply-add that its DEFAULT kernel does not: the 8-bit maps differ in the
// last bit between the two, in torchao too), once per process: equal to torchao's under the
// same LibTorch and CPU capability.

#include <mixprec/core/cpu_dispatch.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/parallel.hpp>
#include <mixprec/core/state_storage.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace mixprec::detail {

/// torchao's rule: a tensor is quantized where it has 4096 elements or more, a multiple of the
/// block (bitsandbytes' threshold); the others keep plain moments.
inline bool quantizes(std::int64_t numel, std::int64_t block) {
  return block > 0 && numel >= 4096 && numel % block == 0;
}

/// The bytes of one block's codes, and of its row (codes and scale).
constexpr std::int64_t code_bytes(MomentFormat format, std::int64_t block) {
  return format == MomentFormat::dynamic4 ? block / 2 : block;
}
constexpr std::int64_t row_bytes(MomentFormat format, std::int64_t block) {
  return code_bytes(format, block) + 4;
}

/// The quantization maps of torchao 0.18's AdamW8bit and AdamW4bit.
struct QuantMaps {
  std::array<float, 256> signed8{}, unsigned8{};
  std::array<float, 16> signed4{}, unsigned4{};
};

namespace quant {

// bitsandbytes' dynamic map as torchao's create_dynamic_map(signed, max_exponent_bits,
// total_bits) makes it (no additional items for the maps used here: their count is 0).
template <std::size_t N>
std::array<float, N> dynamic_map(bool is_signed, int max_exponent_bits, int total_bits) {
  const int non_sign_bits = total_bits - 1;
  std::vector<float> data;
  for (int i = 0; i < max_exponent_bits; ++i) {
    const int shift = i + non_sign_bits - max_exponent_bits + (is_signed ? 0 : 1);
    const auto items = (std::int64_t{1} << shift) + 1;
    const auto bounds = at::linspace(0.1, 1, items, at::kFloat).contiguous();
    const auto* b = bounds.data_ptr<float>();
    // Python's 10 ** k (a float for k < 0, an int from 0 on), as the fp32 scalar ATen multiplies by.
    const int k = -(max_exponent_bits - 1) + i;
    const auto power = static_cast<float>(k < 0 ? std::pow(10.0, k) : std::pow(10, k));
    for (std::int64_t j = 0; j + 1 < items; ++j) {
      const float mean = (b[j] + b[j + 1]) / 2.0F;
      data.push_back(power * mean);
      if (is_signed) data.push_back(-power * mean);
    }
  }
  data.push_back(0.0F);
  data.push_back(1.0F);
  TORCH_INTERNAL_ASSERT(data.size() == N);
  std::sort(data.begin(), data.end());
  std::array<float, N> out{};
  std::copy(data.begin(), data.end(), out.begin());
  return out;
}

}  // namespace quant

/// The maps, made once per process (at::linspace: see the top of this file).
inline const QuantMaps& quant_maps() {
  static const QuantMaps maps = [] {
    QuantMaps m;
    m.signed8 = quant::dynamic_map<256>(true, 7, 8);
    m.unsigned8 = quant::dynamic_map<256>(false, 7, 8);
    m.signed4 = quant::dynamic_map<16>(true, 3, 4);
    const auto steps = at::linspace(0, 1, 17, at::kFloat).contiguous();
    std::copy(steps.data_ptr<float>() + 1, steps.data_ptr<float>() + 17, m.unsigned4.begin());
    return m;
  }();
  return maps;
}

/// The map of `format` for exp_avg (`is_signed`) or exp_avg_sq; null for fp8, which has none.
inline const float* quant_map(MomentFormat format, bool is_signed) {
  const auto& m = quant_maps();
  switch (format) {
    case MomentFormat::dynamic8: return is_signed ? m.signed8.data() : m.unsigned8.data();
    case MomentFormat::dynamic4: return is_signed ? m.signed4.data() : m.unsigned4.data();
    default: return nullptr;
  }
}

namespace quant {

// fp32 -> float8_e4m3fn bits as torch 2.13's x.to(torch.float8_e4m3fn) converts on the CPU
// (measured under every capability): to nearest, ties to even; beyond 448, inf included,
// saturated to 448; NaN to NaN (0x7f), each with x's sign. Below 2^-6 (the smallest normal)
// the value is added to 2^14, where fp32's last bit is e4m3's subnormal step 2^-9: the sum's
// low bits are the code, rounded by the add.
MIXPREC_ALWAYS_INLINE inline std::uint8_t to_e4m3fn(float x) {
  std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80U);
  bits &= 0x7fffffffU;
  std::uint8_t code;
  if (bits > 0x7f800000U) {  // NaN
    code = 0x7f;
  } else if (bits >= 0x43e00000U) {  // 448 and beyond
    code = 0x7e;
  } else if (bits < 0x3c800000U) {  // below 2^-6
    constexpr std::uint32_t kDenorm = 141U << 23;  // 2^14
    const float sum = std::bit_cast<float>(bits) + std::bit_cast<float>(kDenorm);
    code = static_cast<std::uint8_t>(std::bit_cast<std::uint32_t>(sum) - kDenorm);
  } else {
    const std::uint32_t odd = (bits >> 20) & 1U;
    bits += (static_cast<std::uint32_t>(7 - 127) << 23) + 0x7ffffU + odd;
    code = static_cast<std::uint8_t>(bits >> 20);
  }
  return static_cast<std::uint8_t>(code | sign);
}

// float8_e4m3fn bits -> fp32 (exact): every value, NaN for 0x7f and 0xff.
inline const std::array<float, 256>& e4m3fn_values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> v{};
    for (int c = 0; c < 256; ++c) {
      const int exponent = (c >> 3) & 0xf, mantissa = c & 7;
      float x;
      if (exponent == 0xf && mantissa == 7) {
        x = std::numeric_limits<float>::quiet_NaN();
      } else if (exponent == 0) {
        x = std::ldexp(static_cast<float>(mantissa), -9);
      } else {
        x = std::ldexp(1.0F + static_cast<float>(mantissa) / 8.0F, exponent - 7);
      }
      v[static_cast<std::size_t>(c)] = (c & 0x80) != 0 ? -x : x;
    }
    return v;
  }();
  return values;
}

// The code of y (x / scale) in a sorted map of 2^Bits values: torchao's branchless binary
// search (the largest entry <= y, 0 where none is or y is NaN), then one up where
// y - map[c] >= (map[c + 1] - map[c]) * 0.5, each in fp32 as it computes them.
template <int Bits>
MIXPREC_ALWAYS_INLINE inline std::uint8_t map_code(float y, const float* map) {
  constexpr int last = (1 << Bits) - 1;
  int c = 0;
  for (int step = 1 << (Bits - 1); step >= 1; step >>= 1) c += y >= map[c + step] ? step : 0;
  const int up = std::min(c + 1, last);
  const float down_value = map[c], up_value = map[up];
  const float residual = y - down_value;
  if (residual >= (up_value - down_value) * 0.5F) c = up;
  return static_cast<std::uint8_t>(c);
}

// max |x| over n values, NaN where any is NaN (as ATen's amax), clipped below at 1e-12 (as
// ATen's clip, which keeps NaN).
MIXPREC_ALWAYS_INLINE inline float block_absmax(const float* x, std::int64_t n) {
  float m = 0.0F;
  bool nan = false;
  for (std::int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    nan = nan || a != a;
    m = a > m ? a : m;
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  constexpr float kFloor = static_cast<float>(1e-12);
  return m < kFloor ? kFloor : m;
}

}  // namespace quant

/// Block `x` (`block` fp32 values) coded into `row` (row_bytes(format, block) bytes); `map`:
/// quant_map(format, signed).
template <MomentFormat Format>
MIXPREC_ALWAYS_INLINE inline void quantize_row(const float* x, std::int64_t block,
                                               const float* map, std::uint8_t* row) {
  const float absmax = quant::block_absmax(x, block);
  float scale;
  if constexpr (Format == MomentFormat::fp8) {
    scale = absmax / 448.0F;
    for (std::int64_t i = 0; i < block; ++i) row[i] = quant::to_e4m3fn(x[i] / scale);
  } else if constexpr (Format == MomentFormat::dynamic8) {
    scale = absmax;
    for (std::int64_t i = 0; i < block; ++i) row[i] = quant::map_code<8>(x[i] / scale, map);
  } else {
    scale = absmax;
    for (std::int64_t i = 0; i < block; i += 2) {
      const auto hi = quant::map_code<4>(x[i] / scale, map);
      const auto lo = quant::map_code<4>(x[i + 1] / scale, map);
      row[i / 2] = static_cast<std::uint8_t>((hi << 4) | lo);
    }
  }
  std::memcpy(row + code_bytes(Format, block), &scale, sizeof(float));
}

/// `row` decoded into `out` (`block` fp32 values).
template <MomentFormat Format>
MIXPREC_ALWAYS_INLINE inline void dequantize_row(const std::uint8_t* row, std::int64_t block,
                                                 const float* map, float* out) {
  float scale;
  std::memcpy(&scale, row + code_bytes(Format, block), sizeof(float));
  if constexpr (Format == MomentFormat::fp8) {
    const float* values = quant::e4m3fn_values().data();
    for (std::int64_t i = 0; i < block; ++i) out[i] = values[row[i]] * scale;
  } else if constexpr (Format == MomentFormat::dynamic8) {
    for (std::int64_t i = 0; i < block; ++i) out[i] = map[row[i]] * scale;
  } else {
    for (std::int64_t i = 0; i < block; i += 2) {
      out[i] = map[row[i / 2] >> 4] * scale;
      out[i + 1] = map[row[i / 2] & 0xf] * scale;
    }
  }
}

namespace quant {

template <class F>
void dispatch(MomentFormat format, F&& f) {
  switch (format) {
    case MomentFormat::dynamic8: return f(std::integral_constant<MomentFormat, MomentFormat::dynamic8>{});
    case MomentFormat::dynamic4: return f(std::integral_constant<MomentFormat, MomentFormat::dynamic4>{});
    case MomentFormat::fp8: return f(std::integral_constant<MomentFormat, MomentFormat::fp8>{});
    case MomentFormat::plain: break;
  }
  TORCH_INTERNAL_ASSERT(false, "a block format was expected");
}

}  // namespace quant

/// `values` (floating, numel a multiple of coding.block) as rows of `coding`'s format: a uint8
/// tensor of shape [numel / block, row_bytes] on the CPU. `is_signed`: exp_avg's map.
inline at::Tensor quantize_blocks(const at::Tensor& values, MomentCoding coding, bool is_signed) {
  MIXPREC_CHECK(coding.quantized() && values.numel() % coding.block == 0, "quantize_blocks: ",
                values.numel(), " values are no whole number of blocks of ", coding.block);
  const auto x = values.detach().to(at::kCPU).to(at::kFloat).contiguous().view({-1});
  const auto blocks = x.numel() / coding.block;
  auto rows = at::empty({blocks, row_bytes(coding.format, coding.block)}, at::kByte);
  const float* in = x.data_ptr<float>();
  auto* out = rows.data_ptr<std::uint8_t>();
  const float* map = quant_map(coding.format, is_signed);
  const auto block = coding.block, stride = rows.size(1);
  quant::dispatch(coding.format, [&](auto format) {
    at::parallel_for(0, blocks, std::max<std::int64_t>(1, kGrainSize / block),
                     [&](std::int64_t b, std::int64_t e) {
                       for (auto r = b; r < e; ++r) {
                         quantize_row<decltype(format)::value>(in + r * block, block, map,
                                                               out + r * stride);
                       }
                     });
  });
  return rows;
}

/// `rows` (quantize_blocks') decoded: a flat fp32 tensor of rows * block values on the CPU.
inline at::Tensor dequantize_blocks(const at::Tensor& rows, MomentCoding coding, bool is_signed) {
  MIXPREC_CHECK(coding.quantized() && rows.scalar_type() == at::kByte && rows.dim() == 2 &&
                    rows.size(1) == row_bytes(coding.format, coding.block),
                "dequantize_blocks: a moment of ", rows.scalar_type(), rows.sizes(), " is no "
                "set of rows of ", row_bytes(coding.format, coding.block), " bytes (blocks of ",
                coding.block, ")");
  const auto r = rows.to(at::kCPU).contiguous();
  const auto blocks = r.size(0);
  auto values = at::empty({blocks * coding.block}, at::kFloat);
  const auto* in = r.data_ptr<std::uint8_t>();
  float* out = values.data_ptr<float>();
  const float* map = quant_map(coding.format, is_signed);
  const auto block = coding.block, stride = r.size(1);
  quant::dispatch(coding.format, [&](auto format) {
    at::parallel_for(0, blocks, std::max<std::int64_t>(1, kGrainSize / block),
                     [&](std::int64_t b, std::int64_t e) {
                       for (auto i = b; i < e; ++i) {
                         dequantize_row<decltype(format)::value>(in + i * stride, block, map,
                                                                 out + i * block);
                       }
                     });
  });
  return values;
}

}  // namespace mixprec::detail
