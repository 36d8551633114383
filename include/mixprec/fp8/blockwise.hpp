#pragma once
// 1x128 / 128x128 blockwise fp8 (DeepSeek-V3's recipe, BlockwiseFP8Scaling): e4m3 codes with
// an fp32 scale fp8_max / amax per block, the amax clamped to 1e-12 and the division done in
// fp64 (as Python's `448.0 / amax` computes it: amax's reciprocal times 448), rounded to fp32.
// The casts are torchao 0.18's reference casts (blockwise_fp8_training/kernels.py, the
// torch_blockwise_* functions its Triton kernels are tested against), op for op; like them,
// each returns the reciprocal scale (1 / scale in fp32), the factor a GPU's block-scaled
// product multiplies by. One quirk kept: the 128x1 cast clamps the amax to 1e-12 in the
// input's dtype before fp64 (bf16's nearest to 1e-12), the others in fp64; they differ only
// for an all-zero block, whose codes are 0 either way.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/fp8/quantize.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

namespace mixprec::detail {

inline constexpr std::int64_t fp8_tile = 128;

// saturate(x * scale) in e4m3: x in its dtype times the fp32 scale (an fp32 product).
inline at::Tensor blockwise_codes(const at::Tensor& x, const at::Tensor& scale) {
  return (x * scale).clamp(-448.0, 448.0).to(float8_e4m3);
}

// An fp64 amax clamped to [1e-12, inf] (an all-zero block gets a large finite scale).
inline at::Tensor clamped(const at::Tensor& amax64) {
  return at::clamp(amax64, 1e-12, std::numeric_limits<double>::infinity());
}

// The fp32 scale 448 / amax of an fp64 amax already clamped.
inline at::Tensor blockwise_scale(const at::Tensor& amax64) {
  return (amax64.reciprocal() * 448.0).to(at::kFloat);
}

/// x [R, C] (C a multiple of 128) with one scale per 128 consecutive values of a row (1x128):
/// `data` e4m3 [R, C], `scale` the fp32 reciprocal scales [R, C / 128].
inline Fp8Tensor blockwise_quantize_1x128(const at::Tensor& x) {
  MIXPREC_CHECK(x.dim() == 2 && x.size(1) % fp8_tile == 0, "mixprec: a 1x128 fp8 cast needs a "
                "2-D tensor whose last dimension is a multiple of 128; got ", x.sizes());
  const auto rows = x.size(0), blocks = x.size(1) / fp8_tile;
  const auto flat = x.contiguous().reshape({-1, fp8_tile});
  const auto amax = clamped(std::get<0>(flat.abs().max(1, /*keepdim=*/true)).to(at::kDouble));
  const auto scale = blockwise_scale(amax);
  return {blockwise_codes(flat, scale).reshape({rows, blocks * fp8_tile}),
          scale.reciprocal().reshape({rows, blocks})};
}

/// x [R, C] (R a multiple of 128) with one scale per 128 consecutive values of a column
/// (128x1): `data` e4m3 [R, C], `scale` the fp32 reciprocal scales [R / 128, C].
inline Fp8Tensor blockwise_quantize_128x1(const at::Tensor& x) {
  MIXPREC_CHECK(x.dim() == 2 && x.size(0) % fp8_tile == 0, "mixprec: a 128x1 fp8 cast needs a "
                "2-D tensor whose first dimension is a multiple of 128; got ", x.sizes());
  const auto blocks = x.size(0) / fp8_tile, columns = x.size(1);
  const auto grouped = x.contiguous().reshape({blocks, fp8_tile, columns});
  const auto amax =
      at::clamp(std::get<0>(grouped.abs().max(1, /*keepdim=*/true)), 1e-12).to(at::kDouble);
  const auto scale = blockwise_scale(amax);  // [blocks, 1, columns]
  return {blockwise_codes(grouped, scale).reshape({blocks * fp8_tile, columns}),
          scale.reciprocal().reshape({blocks, columns})};
}

/// x [R, C] (both multiples of 128) with one scale per 128x128 tile: `data` e4m3 [R, C],
/// `scale` the fp32 reciprocal scales [R / 128, C / 128].
inline Fp8Tensor blockwise_quantize_128x128(const at::Tensor& x) {
  MIXPREC_CHECK(x.dim() == 2 && x.size(0) % fp8_tile == 0 && x.size(1) % fp8_tile == 0,
                "mixprec: a 128x128 fp8 cast needs a 2-D tensor whose dimensions are multiples "
                "of 128; got ", x.sizes());
  const auto tiles_r = x.size(0) / fp8_tile, tiles_c = x.size(1) / fp8_tile;
  const auto tiles = x.contiguous()
                         .reshape({tiles_r, fp8_tile, tiles_c, fp8_tile})
                         .permute({0, 2, 1, 3})
                         .reshape({-1, fp8_tile * fp8_tile});
  const auto amax = clamped(std::get<0>(tiles.abs().max(1)).unsqueeze(1).to(at::kDouble));
  const auto scale = blockwise_scale(amax);
  const auto codes = blockwise_codes(tiles, scale)
                         .reshape({tiles_r, tiles_c, fp8_tile, fp8_tile})
                         .permute({0, 2, 1, 3})
                         .reshape({x.size(0), x.size(1)});
  return {codes, scale.reciprocal().reshape({tiles_r, tiles_c})};
}

/// The fp32 values of a blockwise operand: each code times its block's reciprocal scale (one
/// rounding), for a scale per 1x128 block ([R, C/128]), 128x1 block ([R/128, C]) or 128x128
/// tile ([R/128, C/128]), told apart by the scale's shape.
inline at::Tensor blockwise_dequantize(const Fp8Tensor& q) {
  const auto rows = q.data.size(0), columns = q.data.size(1);
  const auto values = q.data.to(at::kFloat);
  const auto sr = q.scale.size(0), sc = q.scale.size(1);
  at::Tensor factor;
  if (sr == rows && sc * fp8_tile == columns) {
    factor = q.scale.repeat_interleave(fp8_tile, 1);
  } else if (sr * fp8_tile == rows && sc == columns) {
    factor = q.scale.repeat_interleave(fp8_tile, 0);
  } else {
    MIXPREC_CHECK(sr * fp8_tile == rows && sc * fp8_tile == columns, "mixprec: a blockwise fp8 "
                  "operand's scale ", q.scale.sizes(), " fits no block of its data ", q.data.sizes());
    factor = q.scale.repeat_interleave(fp8_tile, 0).repeat_interleave(fp8_tile, 1);
  }
  return values * factor;
}

}  // namespace mixprec::detail
