#pragma once
// MXFP8 (OCP MX 1.0): e4m3 codes with one e8m0 scale, 2^(byte - 127), per 32 consecutive
// values of a row. The cast and the dequantization compute what torchao 0.18's to_mx and
// MXTensor.dequantize compute, op for op, quirks included (tests/test_parity_block.cpp
// compares the bytes): FLOOR's scale from the exponent bits of the block's amax, the data
// divided by max(scale, 2^-126) (a block whose scale byte is 0 was divided by 2^-126, not
// 2^-127), a NaN amax the byte 255 (its block's finite values then 0, NaN stays NaN); RCEIL's
// from ceil(log2(amax / 448)) in fp32 (LibTorch's log2: a scale a few ulps above a power of 2
// may round to it), an inf amax the byte 254 with a factor 2^-127, a zero one the byte 0 with
// a factor 1.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/fp8/block_recipes.hpp>
#include <mixprec/fp8/quantize.hpp>

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

namespace mixprec::detail {

/// x, a contiguous 2-D bf16 or fp32 tensor whose columns are a multiple of 32, in MXFP8: `data`
/// e4m3 [R, C], `scale` the e8m0 bytes (kByte) [R, C / 32], one per 32 values of a row.
inline Fp8Tensor mx_quantize(const at::Tensor& x, MxScale mode) {
  constexpr std::int64_t block = 32;
  MIXPREC_CHECK(x.dim() == 2 && x.size(1) % block == 0, "mixprec: an MXFP8 cast needs a 2-D "
                "tensor whose last dimension is a multiple of 32; got ", x.sizes());
  const auto rows = x.size(0), blocks = x.size(1) / block;
  const auto grouped = x.contiguous().reshape({rows, blocks, block});
  // amax in x's dtype (exact), then fp32, as torchao.
  const auto max_abs = at::amax(grouped.abs(), {-1}, /*keepdim=*/true).to(at::kFloat);
  const auto data = grouped.to(at::kFloat);
  at::Tensor biased, scaled;
  if (mode == MxScale::floor) {
    // 2^(exponent of amax - 8): 8 is e4m3's largest power of 2 (256), clamped to e8m0's range
    // plus one step above, where an inf/NaN amax lands.
    const auto exponent = at::bitwise_and(at::bitwise_right_shift(max_abs.view(at::kInt), 23), 255) - 127;
    biased = (at::clamp(exponent - 8, -127, 128) + 127).to(at::kByte);
    biased = at::where(at::isnan(max_abs), at::Scalar(255), biased);
    const auto scale = at::bitwise_left_shift(biased.to(at::kInt), 23).view(at::kFloat)
                           .clamp_min(std::ldexp(1.0, -126));
    scaled = (data / scale).clamp(-448.0, 448.0);
  } else {
    const auto descale = max_abs / 448.0;
    const auto exponents =
        (at::clamp(at::ceil(at::log2(descale)), -127, 127) + 127).to(at::kByte);
    biased = at::where(at::isnan(descale), at::Scalar(255),
                       at::where(at::isinf(descale), at::Scalar(254), exponents));
    // The factor that maps the block onto e4m3: 2^(127 - byte); NaN stays NaN.
    const auto factor = at::where(
        biased == 255, descale,
        at::where(biased == 254, at::Scalar(std::ldexp(1.0, -127)),
                  at::where(biased == 0, at::Scalar(1.0), at::exp2(127 - biased.to(at::kFloat)))));
    scaled = (data * factor).clamp(-448.0, 448.0);
  }
  return {scaled.to(float8_e4m3).reshape({rows, blocks * block}), biased.reshape({rows, blocks})};
}

/// The values of an MXFP8 operand in `dtype` (torchao's emulated products use the operands'
/// own dtype, bf16): the codes in dtype times 2^(byte - 127) in dtype (NaN for the byte 255).
inline at::Tensor mx_dequantize(const Fp8Tensor& q, c10::ScalarType dtype) {
  const auto offset = q.scale.to(at::kShort) - 127;
  auto factor = at::pow(at::full_like(offset, 2.0, at::kFloat), offset);
  factor = at::where(q.scale != 255, factor, at::Scalar(std::nan("")));
  const auto values = q.data.to(dtype).reshape({-1, 32}) * factor.reshape({-1, 1}).to(dtype);
  return values.reshape(q.data.sizes());
}

}  // namespace mixprec::detail
