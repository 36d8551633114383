#pragma once
// NVFP4: e2m1 codes (4 bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; two per byte, the
// even element in the low half), an e4m3 scale per 16 consecutive values of a row and one fp32
// scale per tensor, amax / (448 * 6). The cast is torchao 0.18's nvfp4_quantize with a tensor
// scale (the one its emulated NVFP4Tensor casts with), op for op, its e2m1 rounding (to
// nearest, ties to even, saturating; a NaN becomes the code 3 or 11) written out on the bits
// as torchao's encoder does. Three parts of NVIDIA's recipe (arXiv 2509.25149) that torchao
// has only as Triton kernels are defined here with the same scale arithmetic:
//   - 16x16 weight tiles: the tile's amax in place of each 1x16 block's, so the transposed
//     weight (grad_input's operand) has the same codes, transposed;
//   - stochastic rounding: a scaled value v between two neighbouring e2m1 values lo < |v| < hi
//     rounds to hi with probability (|v| - lo) / (hi - lo), which is exact in fp32, against a
//     24-bit uniform number: hash32(i ^ key) >> 8 for element i of the row-major tensor, the key
//     of a layer's draw from TrainerOptions::rounding_seed (optim/lean_kernels.hpp's hash);
//   - the random Hadamard transform: each 16 consecutive values (along the rows that the weight
//     gradient sums over) times R = diag(signs) H16 / 4 in an fp32 product, rounded to bf16 (as
//     a GPU's bf16 product writes it), the signs a hash of the seed and the layer.
// One deviation: a tensor whose amax / 2688 is 0 in fp32 (all zeros) gets the tensor scale 1,
// as Transformer Engine's and torchao's Triton kernels do; torchao's emulated cast divides by
// that 0 and returns NaN codes.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/parallel.hpp>
#include <mixprec/fp8/quantize.hpp>
#include <mixprec/optim/lean_kernels.hpp>

#include <ATen/ATen.h>

#include <array>
#include <bit>
#include <cstdint>

namespace mixprec::detail {

inline constexpr std::int64_t nvfp4_block = 16;
/// The magnitudes of the e2m1 codes 0 to 7 (bit 3 is the sign).
inline constexpr std::array<float, 8> e2m1_values{0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

/// v in e2m1, to nearest (ties to even), saturating at 6, on v's bits as torchao's
/// _f32_to_floatx_unpacked computes it (a NaN included).
inline std::uint8_t e2m1_nearest(float v) {
  const auto bits = std::bit_cast<std::uint32_t>(v);
  const std::uint32_t sign = bits & 0x80000000U;
  const std::uint32_t magnitude_bits = bits ^ sign;
  const float magnitude = std::bit_cast<float>(magnitude_bits);
  std::uint8_t code;
  if (magnitude >= 6.0f) {
    code = 7;
  } else if (magnitude < 1.0f) {
    // Below the smallest normal (1): adding 2^22 (whose ulp is e2m1's subnormal step, 0.5)
    // rounds to that step and leaves the count of steps in the low bits.
    constexpr std::int32_t denormal_bits = 149 << 23;  // 2^22 as fp32
    const float shifted = magnitude + std::bit_cast<float>(denormal_bits);
    code = static_cast<std::uint8_t>(std::bit_cast<std::int32_t>(shifted) - denormal_bits);
  } else {
    // Rebias the exponent (127 -> 1) and round the 22 dropped bits to nearest even.
    auto normal = static_cast<std::int32_t>(magnitude_bits);
    const std::int32_t odd = (normal >> 22) & 1;
    normal += -(126 << 23) + ((1 << 21) - 1);
    normal += odd;
    code = static_cast<std::uint8_t>(normal >> 22);
  }
  return static_cast<std::uint8_t>(code | ((sign >> 28) & 8U));
}

/// v in e2m1, rounded up in magnitude with probability (|v| - lo) / (hi - lo), where lo <= |v|
/// < hi are neighbouring e2m1 values, `noise` a uniform 32-bit number (its top 24 bits used).
/// v must be clamped to [-6, 6]; a NaN rounds as e2m1_nearest does.
inline std::uint8_t e2m1_stochastic(float v, std::uint32_t noise) {
  if (v != v) return e2m1_nearest(v);
  const auto sign = static_cast<std::uint8_t>((std::bit_cast<std::uint32_t>(v) >> 28) & 8U);
  const float magnitude = v < 0 ? -v : v;
  std::uint8_t low = 0;
  while (low < 7 && e2m1_values[low + 1] <= magnitude) ++low;
  if (low == 7 || magnitude == e2m1_values[low]) return static_cast<std::uint8_t>(sign | low);
  // Both exact in fp32: a difference within one binade pair, a division by a power of 2.
  const float up = (magnitude - e2m1_values[low]) / (e2m1_values[low + 1] - e2m1_values[low]);
  const float uniform = static_cast<float>(noise >> 8) * 0x1p-24f;
  return static_cast<std::uint8_t>(sign | (uniform < up ? low + 1 : low));
}

/// How an NVFP4 cast rounds its values: to nearest, or stochastically with a key (the noise of
/// element i is hash32(i ^ key)).
struct Nvfp4Rounding {
  bool stochastic = false;
  std::uint32_t key = 0;
};

/// The fp32 tensor scale of a tensor whose amax (any float dtype, 0-dim) is given:
/// amax / (448 * 6), 1 where that is 0.
inline at::Tensor nvfp4_tensor_scale(const at::Tensor& amax) {
  const auto scale = amax.to(at::kFloat) / (448.0 * 6.0);
  return at::where(scale == 0, at::Scalar(1.0), scale);
}

/// x [R, C] (bf16 or fp32, C a multiple of 16; R too for `tiles`) in NVFP4: `data` the packed
/// codes (kByte) [R, C / 2], `scale` e4m3 [R, C / 16] (one per 16 values of a row; under
/// `tiles` each 16x16 tile's scale, repeated on its 16 rows), `tensor_scale` fp32 0-dim.
inline Fp8Tensor nvfp4_quantize(const at::Tensor& x, bool tiles, Nvfp4Rounding rounding = {}) {
  MIXPREC_CHECK(x.dim() == 2 && x.size(1) % nvfp4_block == 0 &&
                    (!tiles || x.size(0) % nvfp4_block == 0),
                "mixprec: an NVFP4 cast needs a 2-D tensor whose last dimension (and, with 16x16 "
                "tiles, first dimension) is a multiple of 16; got ", x.sizes());
  const auto rows = x.size(0), columns = x.size(1), blocks = columns / nvfp4_block;
  const auto tensor_scale = nvfp4_tensor_scale(x.abs().max());
  const auto data = x.to(at::kFloat).reshape({rows, blocks, nvfp4_block});
  auto max_abs = at::amax(data.abs(), {-1});  // [rows, blocks]
  if (tiles) {
    max_abs = at::amax(data.abs().reshape({rows / nvfp4_block, nvfp4_block, blocks, nvfp4_block}),
                       {1, 3})
                  .repeat_interleave(nvfp4_block, 0);
  }
  const auto block_scale = max_abs / 6.0;
  const auto codes_scale = at::clamp(block_scale / tensor_scale, 0.015625, 448.0).to(float8_e4m3);
  const auto factor = (tensor_scale.reciprocal() * 1.0) / codes_scale.to(at::kFloat);
  // The rounding runs on the CPU (a GPU's tensors go there and back: the emulation's cost).
  const auto scaled = (data * factor.unsqueeze(-1)).clamp(-6.0, 6.0).cpu().contiguous();
  auto packed = at::empty({rows, columns / 2}, scaled.options().dtype(at::kByte));
  const auto* in = scaled.data_ptr<float>();
  auto* out = packed.data_ptr<std::uint8_t>();
  at::parallel_for(0, rows * columns / 2, 1 << 14, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t j = begin; j < end; ++j) {
      const auto even = 2 * j, odd = 2 * j + 1;
      std::uint8_t low, high;
      if (rounding.stochastic) {
        low = e2m1_stochastic(in[even], hash32(static_cast<std::uint32_t>(even) ^ rounding.key));
        high = e2m1_stochastic(in[odd], hash32(static_cast<std::uint32_t>(odd) ^ rounding.key));
      } else {
        low = e2m1_nearest(in[even]);
        high = e2m1_nearest(in[odd]);
      }
      out[j] = static_cast<std::uint8_t>(low | (high << 4));
    }
  });
  return {packed.to(x.device()), codes_scale, tensor_scale};
}

/// The e2m1 values of packed codes [R, C / 2] as fp32 [R, C].
inline at::Tensor e2m1_unpack(const at::Tensor& packed) {
  if (!packed.device().is_cpu()) return e2m1_unpack(packed.cpu()).to(packed.device());
  const auto bytes = packed.contiguous();
  auto values = at::empty({bytes.size(0), bytes.size(1) * 2}, bytes.options().dtype(at::kFloat));
  const auto* in = bytes.data_ptr<std::uint8_t>();
  auto* out = values.data_ptr<float>();
  const auto value = [](std::uint8_t code) {
    const float magnitude = e2m1_values[code & 7U];
    return (code & 8U) != 0 ? -magnitude : magnitude;  // code 8 is -0
  };
  at::parallel_for(0, bytes.numel(), 1 << 14, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t j = begin; j < end; ++j) {
      out[2 * j] = value(static_cast<std::uint8_t>(in[j] & 15U));
      out[2 * j + 1] = value(static_cast<std::uint8_t>(in[j] >> 4));
    }
  });
  return values;
}

/// The fp32 values of an NVFP4 operand, as torchao's NVFP4Tensor.dequantize(torch.float32):
/// each code times (tensor scale * its block's e4m3 scale).
inline at::Tensor nvfp4_dequantize(const Fp8Tensor& q) {
  const auto values = e2m1_unpack(q.data);
  const auto rows = values.size(0), blocks = values.size(1) / nvfp4_block;
  const auto factor = q.tensor_scale * q.scale.to(at::kFloat);
  return (values.reshape({rows, blocks, nvfp4_block}) * factor.reshape({rows, blocks, 1}))
      .reshape({rows, blocks * nvfp4_block});
}

/// The random Hadamard matrix of one layer: diag(signs) H / 4 in fp32 [16, 16], H the Sylvester
/// Hadamard matrix of order 16 (H[i][j] = (-1)^popcount(i & j)), sign i negative where bit 31
/// of hash32(i ^ key) is set. R R^T = I, so (a R)(b R)^T = a b^T: the product is unchanged.
inline at::Tensor random_hadamard16(std::uint32_t key) {
  auto matrix = at::empty({16, 16}, at::kFloat);
  auto* m = matrix.data_ptr<float>();
  for (std::uint32_t i = 0; i < 16; ++i) {
    const float sign = (hash32(i ^ key) >> 31) != 0 ? -0.25f : 0.25f;
    for (std::uint32_t j = 0; j < 16; ++j) {
      m[i * 16 + j] = (std::popcount(i & j) % 2 == 0) ? sign : -sign;
    }
  }
  return matrix;
}

/// x [R, C] (C a multiple of 16) with each 16 consecutive values of a row times `hadamard`: an
/// fp32 product, rounded to bf16.
inline at::Tensor hadamard_rows(const at::Tensor& x, const at::Tensor& hadamard) {
  return at::mm(x.contiguous().reshape({-1, 16}).to(at::kFloat), hadamard.to(x.device()))
      .to(at::kBFloat16)
      .reshape(x.sizes());
}

}  // namespace mixprec::detail
