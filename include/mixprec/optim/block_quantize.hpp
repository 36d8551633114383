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
// The search is done by a table of the thresholds where the code changes (make_coder), found
// with the search itself: the same codes, a few compares instead of ten dependent loads.
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
#include <utility>
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

/// One map, with what codes a value in it fast (quant::map_code's codes, from a table).
struct MapCoder {
  const float* values = nullptr;  // the map's 2^bits values, in order
  // base[b]: the code of the least non-NaN float whose top 16 bits are b; up[k]: the least float
  // whose code is k or more (k >= 1; up[0], and past the last code: +inf, never reached).
  std::vector<std::uint8_t> base;
  std::vector<float> up;
  int extra = 0;  // the most codes above its base that one group of 2^16 floats reaches
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


// fp32 -> float8_e4m3fn bits as torch 2.13's x.to(torch.float8_e4m3fn) converts on the CPU
// (measured under every capability): to nearest, ties to even; beyond 448, inf included,
// saturated to 448; NaN to NaN (0x7f), each with x's sign. Below 2^-6 (the smallest normal)
// the value is added to 2^14, where fp32's last bit is e4m3's subnormal step 2^-9: the sum's
// low bits are the code, rounded by the add. Every case computed, then selected: the loop
// over a block vectorises.
MIXPREC_ALWAYS_INLINE inline std::uint8_t to_e4m3fn(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = (bits >> 24) & 0x80U;
  const std::uint32_t a = bits & 0x7fffffffU;
  constexpr std::uint32_t kDenorm = 141U << 23;  // 2^14
  const std::uint32_t small =
      std::bit_cast<std::uint32_t>(std::bit_cast<float>(a) + std::bit_cast<float>(kDenorm)) - kDenorm;
  const std::uint32_t normal =
      (a + (static_cast<std::uint32_t>(7 - 127) << 23) + 0x7ffffU + ((a >> 20) & 1U)) >> 20;
  std::uint32_t code = a < 0x3c800000U ? small : normal;  // below 2^-6: subnormal
  code = a >= 0x43e00000U ? 0x7eU : code;                 // 448 and beyond (inf too)
  code = a > 0x7f800000U ? 0x7fU : code;                  // NaN
  return static_cast<std::uint8_t>((code & 0x7fU) | sign);
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


// The search as a table: the codes are monotone in the value, so the code of y is the number of
// thresholds up[k] <= y (NaN: 0). The floats that share their top 16 bits (a 2^-7 relative
// range) cross few thresholds: the code is base[top bits] plus one compare per threshold such a
// group can hold (`extra`: 1 for torchao's maps, 2 compares made). Each threshold is found
// by bisection over the ordered floats with map_code itself, so the table's codes are its codes.
template <int Bits>
MapCoder make_coder(const float* values) {
  constexpr int codes = 1 << Bits;
  MapCoder c;
  c.values = values;
  // The non-NaN floats as ordered integers: -inf ... -0, +0 ... +inf.
  const auto key_of = [](float f) {
    const auto b = std::bit_cast<std::uint32_t>(f);
    return static_cast<std::int64_t>((b & 0x80000000U) != 0 ? 0x7fffffffU - (b & 0x7fffffffU)
                                                             : 0x80000000U + b);
  };
  const auto float_of = [](std::int64_t key) {
    const auto k = static_cast<std::uint32_t>(key);
    return std::bit_cast<float>(k >= 0x80000000U ? k - 0x80000000U
                                                 : 0x80000000U | (0x7fffffffU - k));
  };
  const auto lowest = key_of(-std::numeric_limits<float>::infinity());
  const auto highest = key_of(std::numeric_limits<float>::infinity());
  c.up.assign(static_cast<std::size_t>(codes + 2), std::numeric_limits<float>::infinity());
  for (int k = 1; k < codes; ++k) {
    if (map_code<Bits>(float_of(lowest), values) >= k) {
      c.up[static_cast<std::size_t>(k)] = float_of(lowest);
      continue;
    }
    auto lo = lowest, hi = highest;  // code(lo) < k <= code(hi): the threshold is in (lo, hi]
    while (hi - lo > 1) {
      const auto mid = lo + (hi - lo) / 2;
      (map_code<Bits>(float_of(mid), values) >= k ? hi : lo) = mid;
    }
    c.up[static_cast<std::size_t>(k)] = float_of(hi);
  }
  c.base.resize(std::size_t{1} << 16);
  for (std::uint32_t top = 0; top < (1U << 16); ++top) {
    // The group's least and greatest non-NaN values (the groups of +-inf hold NaNs too; a group
    // of NaNs alone codes nothing but 0, which table_code gives NaN anyway).
    float least = std::bit_cast<float>(top << 16);
    float most = std::bit_cast<float>((top << 16) | 0xffffU);
    if ((top & 0x8000U) != 0) std::swap(least, most);
    if (std::isnan(least) && std::isnan(most)) continue;
    if (std::isnan(least)) least = -std::numeric_limits<float>::infinity();
    if (std::isnan(most)) most = std::numeric_limits<float>::infinity();
    const int low = map_code<Bits>(least, values), high = map_code<Bits>(most, values);
    c.base[top] = static_cast<std::uint8_t>(low);
    c.extra = std::max(c.extra, high - low);
  }
  TORCH_INTERNAL_ASSERT(c.extra <= 2, "mixprec: a quantization map too dense for its table");
  return c;
}

// The code of y in `coder`'s map: map_code's, from the table.
MIXPREC_ALWAYS_INLINE inline std::uint8_t table_code(float y, const MapCoder& coder) {
  const int base = coder.base[std::bit_cast<std::uint32_t>(y) >> 16];
  const float* up = coder.up.data() + base;
  const int code = base + (y >= up[1] ? 1 : 0) + (y >= up[2] ? 1 : 0);
  return static_cast<std::uint8_t>(y == y ? code : 0);
}

}  // namespace quant

/// The maps and their coders, made once per process (at::linspace: see the top of this file).
struct QuantCoders {
  QuantMaps maps;
  MapCoder signed8, unsigned8, signed4, unsigned4;
};

inline const QuantCoders& quant_coders() {
  static const QuantCoders coders = [] {
    QuantCoders c;
    auto& m = c.maps;
    m.signed8 = quant::dynamic_map<256>(true, 7, 8);
    m.unsigned8 = quant::dynamic_map<256>(false, 7, 8);
    m.signed4 = quant::dynamic_map<16>(true, 3, 4);
    const auto steps = at::linspace(0, 1, 17, at::kFloat).contiguous();
    std::copy(steps.data_ptr<float>() + 1, steps.data_ptr<float>() + 17, m.unsigned4.begin());
    c.signed8 = quant::make_coder<8>(m.signed8.data());
    c.unsigned8 = quant::make_coder<8>(m.unsigned8.data());
    c.signed4 = quant::make_coder<4>(m.signed4.data());
    c.unsigned4 = quant::make_coder<4>(m.unsigned4.data());
    return c;
  }();
  return coders;
}

/// The maps (torchao's values).
inline const QuantMaps& quant_maps() { return quant_coders().maps; }

/// The coder of `format`'s map for exp_avg (`is_signed`) or exp_avg_sq; null for fp8, which
/// has none.
inline const MapCoder* quant_map(MomentFormat format, bool is_signed) {
  const auto& c = quant_coders();
  switch (format) {
    case MomentFormat::dynamic8: return is_signed ? &c.signed8 : &c.unsigned8;
    case MomentFormat::dynamic4: return is_signed ? &c.signed4 : &c.unsigned4;
    default: return nullptr;
  }
}

/// Block `x` (`block` fp32 values) coded into `row` (row_bytes(format, block) bytes); `map`:
/// quant_map(format, signed).
template <MomentFormat Format>
MIXPREC_ALWAYS_INLINE inline void quantize_row(const float* x, std::int64_t block,
                                               const MapCoder* map, std::uint8_t* row) {
  const float absmax = quant::block_absmax(x, block);
  const float scale = Format == MomentFormat::fp8 ? absmax / 448.0F : absmax;
  // x / scale in a loop of its own (it vectorises; the table's lookups do not), 256 at a time.
  constexpr std::int64_t kPart = 256;
  float y[kPart];
  for (std::int64_t from = 0; from < block; from += kPart) {
    const auto n = std::min(kPart, block - from);
    for (std::int64_t i = 0; i < n; ++i) y[i] = x[from + i] / scale;
    if constexpr (Format == MomentFormat::fp8) {
      for (std::int64_t i = 0; i < n; ++i) row[from + i] = quant::to_e4m3fn(y[i]);
    } else if constexpr (Format == MomentFormat::dynamic8) {
      for (std::int64_t i = 0; i < n; ++i) row[from + i] = quant::table_code(y[i], *map);
    } else {  // blocks and parts are even
      for (std::int64_t i = 0; i < n; i += 2) {
        const auto hi = quant::table_code(y[i], *map);
        const auto lo = quant::table_code(y[i + 1], *map);
        row[(from + i) / 2] = static_cast<std::uint8_t>((hi << 4) | lo);
      }
    }
  }
  std::memcpy(row + code_bytes(Format, block), &scale, sizeof(float));
}

/// `row` decoded into `out` (`block` fp32 values).
template <MomentFormat Format>
MIXPREC_ALWAYS_INLINE inline void dequantize_row(const std::uint8_t* row, std::int64_t block,
                                                 const MapCoder* map, float* out) {
  float scale;
  std::memcpy(&scale, row + code_bytes(Format, block), sizeof(float));
  if constexpr (Format == MomentFormat::fp8) {
    const float* values = quant::e4m3fn_values().data();
    for (std::int64_t i = 0; i < block; ++i) out[i] = values[row[i]] * scale;
  } else if constexpr (Format == MomentFormat::dynamic8) {
    const float* values = map->values;
    for (std::int64_t i = 0; i < block; ++i) out[i] = values[row[i]] * scale;
  } else {
    const float* values = map->values;
    for (std::int64_t i = 0; i < block; i += 2) {
      out[i] = values[row[i / 2] >> 4] * scale;
      out[i + 1] = values[row[i / 2] & 0xf] * scale;
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
  const auto* map = quant_map(coding.format, is_signed);
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
  const auto* map = quant_map(coding.format, is_signed);
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
