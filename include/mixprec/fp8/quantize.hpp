#pragma once
// An operand in fp8 (e4m3 for values, e5m2 for gradients) with its fp32 scale: the scale from an
// amax, the saturating quantization, the dequantization, and the product of two such operands
// (at::_scaled_mm on CUDA where cuBLASLt takes the shapes, torchao's emulation elsewhere).

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/parallel.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace mixprec {

/// The three operands of a Float8Linear, in the order of Fp8Operands.
enum class Fp8Role { input, weight, grad_output };

/// One operand in fp8: `data` (e4m3 or e5m2) is saturate(x * scale); `scale` a 0-dim fp32.
struct Fp8Tensor {
  at::Tensor data;
  at::Tensor scale;
};

/// A layer's fp8 operands of one training step (Float8LinearImpl::keep_operands), for checking
/// against another implementation.
struct Fp8Operands {
  Fp8Tensor input, weight, grad_output;
};

namespace detail {

inline c10::ScalarType fp8_dtype(Fp8Role role) {
  return role == Fp8Role::grad_output ? float8_e5m2 : float8_e4m3;
}
inline double fp8_max(Fp8Role role) { return role == Fp8Role::grad_output ? 57344.0 : 448.0; }
inline const char* role_name(Fp8Role role) {
  return role == Fp8Role::input ? "input" : role == Fp8Role::weight ? "weight" : "grad_output";
}

/// fp8_max / amax / 2^margin, computed in fp64 and rounded to fp32 (as torchao), with amax
/// clamped to 1e-12 (an all-zero tensor gets a large finite scale, not inf).
inline at::Tensor scale_from_amax(const at::Tensor& amax, double max, int margin = 0) {
  auto scale = max / amax.to(at::kDouble).clamp_min(1e-12);
  if (margin != 0) scale = scale / static_cast<double>(std::int64_t{1} << margin);
  return scale.to(at::kFloat);
}

/// max |x| as a 0-dim fp32 tensor (NaN if x holds one), in one pass over x.
inline at::Tensor abs_max(const at::Tensor& x) {
  const auto [low, high] = at::aminmax(x);
  return at::maximum(low.abs(), high.abs()).to(at::kFloat);
}

/// saturate(x * scale) in fp8: the product in fp32, clamped to +-fp8_max (NaN stays NaN), rounded
/// to nearest even.
inline Fp8Tensor quantize(const at::Tensor& x, const at::Tensor& scale, Fp8Role role) {
  const double max = fp8_max(role);
  auto scaled = x.scalar_type() == at::kFloat ? x * scale : x.to(at::kFloat).mul_(scale);
  return {scaled.clamp_(-max, max).to(fp8_dtype(role)), scale};
}

/// x8 / scale in fp32, in x8's layout: what torchao's emulation computes (x8.float() / scale). On
/// the CPU through a table of the 256 codes, each divided once by the scale (every code is exact
/// in fp32, so the values are the same): one read per element, where LibTorch's fp8-to-fp32
/// conversion and the division took 4x an fp32 product's overhead at 1024^2 (bench_fp8).
inline at::Tensor dequantize(const Fp8Tensor& x) {
  const auto& data = x.data;
  if (!data.device().is_cpu()) return data.to(at::kFloat) / x.scale;
  if (!data.is_contiguous()) {
    if (data.dim() == 2 && data.t().is_contiguous()) return dequantize({data.t(), x.scale}).t();
    return dequantize({data.contiguous(), x.scale});
  }
  std::array<float, 256> values{};
  const float scale = x.scale.item<float>();
  for (int code = 0; code < 256; ++code) {
    values[code] = float8_value(data.scalar_type(), static_cast<std::uint8_t>(code)) / scale;
  }
  auto out = at::empty(data.sizes(), data.options().dtype(at::kFloat));
  const auto* in = static_cast<const std::uint8_t*>(data.data_ptr());
  auto* result = out.data_ptr<float>();
  at::parallel_for(0, data.numel(), 1 << 16, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) result[i] = values[in[i]];
  });
  return out;
}

/// a @ b / (scale_a * scale_b) in out_dtype, for a [M, K] and b [K, N] in any layout.
inline at::Tensor fp8_mm(const Fp8Tensor& a, const Fp8Tensor& b, c10::ScalarType out_dtype) {
  const bool aligned = a.data.size(0) % 16 == 0 && a.data.size(1) % 16 == 0 &&
                       b.data.size(1) % 16 == 0;
  if (a.data.is_cuda() && aligned) {
    // cuBLASLt: the first operand row-major, the second column-major.
    const auto row_major = a.data.is_contiguous() ? a.data : a.data.contiguous();
    const auto column_major = b.data.t().is_contiguous() ? b.data : b.data.t().contiguous().t();
    return scaled_mm(row_major, column_major, a.scale.reciprocal(), b.scale.reciprocal(), out_dtype);
  }
  // Emulated as torchao's emulate=True and LibTorch's CPU _scaled_mm without oneDNN do: the
  // operands dequantized to fp32 (x8 / scale, one rounding each), an fp32 product, one rounding
  // to out_dtype. _scaled_mm on a GPU applies the scales after the fp32 sum instead: the
  // difference is the rounding of the dequantized operands, 2^-24 relative.
  return at::mm(dequantize(a), dequantize(b)).to(out_dtype);
}

}  // namespace detail
}  // namespace mixprec
