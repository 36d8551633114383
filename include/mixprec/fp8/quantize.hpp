#pragma once
// An operand in fp8 (e4m3 for values, e5m2 for gradients) with its fp32 scale: the scale from an
// amax, the saturating quantization, the dequantization, and the product of two such operands
// (at::_scaled_mm on CUDA where cuBLASLt takes the shapes, torchao's emulation elsewhere).

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/parallel.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <utility>

namespace mixprec {

/// The three operands of a Float8Linear, in the order of Fp8Operands.
enum class Fp8Role { input, weight, grad_output };

/// One operand in fp8: `data` (e4m3 or e5m2) is saturate(x * scale); `scale` fp32, 0-dim
/// (tensorwise) or one per row or column of a 2-D `data` ([rows, 1] or [1, columns]: rowwise).
/// The block-scaled formats (block_recipes.hpp) keep one scale per block: MXFP8 e8m0 bytes,
/// blockwise fp8 the fp32 reciprocal scales, NVFP4 e4m3 scales and packed e2m1 `data`, with
/// one fp32 `tensor_scale` (undefined for the other formats).
struct Fp8Tensor {
  Fp8Tensor() = default;
  Fp8Tensor(at::Tensor codes, at::Tensor scales, at::Tensor one_scale = {})
      : data(std::move(codes)), scale(std::move(scales)), tensor_scale(std::move(one_scale)) {}
  at::Tensor data;
  at::Tensor scale;
  at::Tensor tensor_scale;
};

/// A layer's fp8 operands of one training step (Float8LinearImpl::keep_operands), for checking
/// against another implementation. The forward product's input and weight and grad_input's
/// grad_output; rowwise recipes cast again for the backward products, along the other axis
/// (torchao's names; undefined where a recipe reuses a cast or computes that product in bf16).
struct Fp8Operands {
  Fp8Tensor input, weight, grad_output;
  Fp8Tensor weight_for_grad_input, grad_output_for_grad_weight, input_for_grad_weight;
};

namespace detail {

inline c10::ScalarType fp8_dtype(Fp8Role role) {
  return role == Fp8Role::grad_output ? float8_e5m2 : float8_e4m3;
}
// The largest finite values. By role too, where LibTorch has no fp8 dtypes (advise() watches
// Float8Linear layers under 1.13, whose float8_e4m3 and float8_e5m2 are both Undefined).
inline double fp8_max(c10::ScalarType dtype) { return dtype == float8_e5m2 ? 57344.0 : 448.0; }
inline double fp8_max(Fp8Role role) { return role == Fp8Role::grad_output ? 57344.0 : 448.0; }
inline const char* role_name(Fp8Role role) {
  return role == Fp8Role::input ? "input" : role == Fp8Role::weight ? "weight" : "grad_output";
}

/// fp8_max / amax / 2^margin, computed in fp64 and rounded to fp32 (as torchao), with amax
/// clamped to 1e-12 (an all-zero tensor gets a large finite scale, not inf); `amax` of any shape
/// (one per row for rowwise scaling). `power_of_2` rounds the fp32 scale down to a power of 2 as
/// torchao's round_scales_to_power_of_2 does, exp2(floor(log2(s))) in fp32: a scale a few ulps
/// below a power of 2 (2 at 2^8, 22 at 2^40) becomes that power, as fp32's log2 rounds to the
/// integer, and the saturating cast absorbs the elements that then land just beyond fp8_max.
inline at::Tensor scale_from_amax(const at::Tensor& amax, double max, int margin = 0,
                                  bool power_of_2 = false) {
  auto scale = max / amax.to(at::kDouble).clamp_min(1e-12);
  if (margin != 0) scale = scale / static_cast<double>(std::int64_t{1} << margin);
  scale = scale.to(at::kFloat);
  return power_of_2 ? at::exp2(at::floor(at::log2(scale))) : scale;
}

/// max |x| as a 0-dim fp32 tensor (NaN if x holds one), in one pass over x.
inline at::Tensor abs_max(const at::Tensor& x) {
  const auto [low, high] = at::aminmax(x);
  return at::maximum(low.abs(), high.abs()).to(at::kFloat);
}

/// max |x| along `dim` of a 2-D x, kept as a dimension of 1 ([rows, 1] for dim 1): one amax per
/// row (or column), in x's dtype (exact), as torchao's amax(abs(x), dim, keepdim=True).
inline at::Tensor abs_max(const at::Tensor& x, std::int64_t dim) {
  return at::amax(x.abs(), {dim}, /*keepdim=*/true);
}

/// saturate(x * scale) in fp8 `dtype`: the product in fp32 (a rowwise scale broadcasts),
/// clamped to +-fp8_max (NaN stays NaN), rounded to nearest even.
inline Fp8Tensor quantize(const at::Tensor& x, const at::Tensor& scale, c10::ScalarType dtype) {
  const double max = fp8_max(dtype);
  auto scaled = x.scalar_type() == at::kFloat ? x * scale : x.to(at::kFloat).mul_(scale);
  return {scaled.clamp_(-max, max).to(dtype), scale};
}
inline Fp8Tensor quantize(const at::Tensor& x, const at::Tensor& scale, Fp8Role role) {
  return quantize(x, scale, fp8_dtype(role));
}

/// The operand of the transposed product: data and a rowwise scale transposed together.
inline Fp8Tensor transposed(const Fp8Tensor& x) {
  return {x.data.t(), x.scale.dim() == 2 ? x.scale.t() : x.scale};
}

/// Whether x has one scale per row or column (not one for the whole tensor).
inline bool rowwise_scaled(const Fp8Tensor& x) { return x.scale.dim() == 2; }

/// x8 / scale in fp32, in x8's layout: what torchao's emulation computes (x8.float() / scale,
/// a rowwise scale broadcast over the rows or columns). On the CPU through a table of the 256
/// codes (every code is exact in fp32, so the values are the same): for one scale, each code
/// divided once by it, one read per element, where LibTorch's fp8-to-fp32 conversion and the
/// division took 4x an fp32 product's overhead at 1024^2 (bench_fp8); for rowwise scales, the
/// code's value divided by its row's or column's scale, the same IEEE division as torchao's.
inline at::Tensor dequantize(const Fp8Tensor& x) {
  const auto& data = x.data;
  if (!data.device().is_cpu()) return data.to(at::kFloat) / x.scale;
  if (!data.is_contiguous()) {
    if (data.dim() == 2 && data.t().is_contiguous()) return dequantize(transposed(x)).t();
    return dequantize({data.contiguous(), x.scale});
  }
  const bool rowwise = rowwise_scaled(x);
  // [rows, 1] scales each row, [1, columns] each column (a [1, 1] scale of a [1, n] or [n, 1]
  // tensor either, the same numbers).
  const bool per_row = rowwise && data.dim() == 2 && x.scale.size(0) == data.size(0) &&
                       x.scale.size(1) == 1;
  const bool per_column = rowwise && data.dim() == 2 && x.scale.size(0) == 1 &&
                          x.scale.size(1) == data.size(1);
  MIXPREC_CHECK(x.scale.dim() == 0 || per_row || per_column, "mixprec: an fp8 operand's scale "
                "must be 0-dim, or [rows, 1] or [1, columns] of its 2-D data; got scale ",
                x.scale.sizes(), " for data ", data.sizes());
  const float one_scale = rowwise ? 1.0f : x.scale.item<float>();
  std::array<float, 256> values{};
  for (int code = 0; code < 256; ++code) {
    values[code] = float8_value(data.scalar_type(), static_cast<std::uint8_t>(code)) / one_scale;
  }
  auto out = at::empty(data.sizes(), data.options().dtype(at::kFloat));
  const auto* in = static_cast<const std::uint8_t*>(data.data_ptr());
  auto* result = out.data_ptr<float>();
  if (!rowwise) {
    at::parallel_for(0, data.numel(), 1 << 16, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) result[i] = values[in[i]];
    });
    return out;
  }
  const auto scale = x.scale.to(at::kFloat).contiguous();
  const auto* s = scale.data_ptr<float>();
  const std::int64_t columns = data.size(1);
  const std::int64_t grain = std::max<std::int64_t>(1, (1 << 16) / std::max<std::int64_t>(columns, 1));
  at::parallel_for(0, data.size(0), grain, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const auto* row_in = in + r * columns;
      auto* row_out = result + r * columns;
      if (per_row) {
        const float row_scale = s[r];
        for (std::int64_t c = 0; c < columns; ++c) row_out[c] = values[row_in[c]] / row_scale;
      } else {
        for (std::int64_t c = 0; c < columns; ++c) row_out[c] = values[row_in[c]] / s[c];
      }
    }
  });
  return out;
}

/// Whether this CUDA device's at::_scaled_mm takes rowwise scales (0 not asked yet, 1 yes, -1
/// no). LibTorch has no query for it that compiles without CUDA's headers (the kernel wants a
/// recent compute capability, and which one changes between versions), so the kernel itself is
/// asked, once per device: a refusal is a fact of the device and the build, never a timing.
inline std::atomic<int>& rowwise_scaled_mm_state(c10::DeviceIndex device) {
  static std::array<std::atomic<int>, 64> states{};
  return states[static_cast<std::size_t>(std::clamp<int>(device, 0, 63))];
}

/// a @ b / (scale_a * scale_b) in out_dtype, for a [M, K] and b [K, N] in any layout, each
/// scaled tensorwise (0-dim) or rowwise along K (a: [M, 1], b: [1, N]; a tensorwise scale
/// beside a rowwise one is broadcast). `fast_accum`: on CUDA, the rowwise product with
/// _scaled_mm's fast accumulation, as torchao computes the forward product.
inline at::Tensor fp8_mm(const Fp8Tensor& a, const Fp8Tensor& b, c10::ScalarType out_dtype,
                         bool fast_accum = false) {
  const bool aligned = a.data.size(0) % 16 == 0 && a.data.size(1) % 16 == 0 &&
                       b.data.size(1) % 16 == 0;
  const bool rowwise = rowwise_scaled(a) || rowwise_scaled(b);
  // Rowwise scales: _scaled_mm returns bf16 only.
  if (a.data.is_cuda() && aligned && (!rowwise || out_dtype == at::kBFloat16)) {
    // cuBLASLt: the first operand row-major, the second column-major.
    const auto row_major = a.data.is_contiguous() ? a.data : a.data.contiguous();
    const auto column_major = b.data.t().is_contiguous() ? b.data : b.data.t().contiguous().t();
    if (!rowwise) {
      return scaled_mm(row_major, column_major, a.scale.reciprocal(), b.scale.reciprocal(), out_dtype);
    }
    const auto m = a.data.size(0), n = b.data.size(1);
    const auto inverse_a = a.scale.reciprocal().expand({m, 1}).contiguous();
    const auto inverse_b = b.scale.reciprocal().expand({1, n}).contiguous();
    if (!fast_accum) {
      // As torchao: without fast accumulation the rowwise kernel is slow, so the tensorwise one
      // with unit scales, then both scales on the bf16 result (powers of 2 under the rowwise
      // recipes: exact).
      const auto one = at::ones({}, a.scale.options());
      return scaled_mm(row_major, column_major, one, one, out_dtype).mul_(inverse_a * inverse_b);
    }
    auto& state = rowwise_scaled_mm_state(a.data.device().index());
    if (state.load() >= 0) {
      try {
        auto out = scaled_mm(row_major, column_major, inverse_a, inverse_b, out_dtype, true);
        state.store(1);
        return out;
      } catch (const c10::OutOfMemoryError&) {
        throw;
      } catch (const c10::Error&) {
        if (state.load() == 1) throw;  // it worked before: a real error
        state.store(-1);  // this device has no rowwise kernel: the emulation from now on
      }
    }
  }
  // Emulated as torchao's emulate=True and LibTorch's CPU _scaled_mm without oneDNN do: the
  // operands dequantized to fp32 (x8 / scale, one rounding each, none for a power-of-2 scale),
  // an fp32 product, one rounding to out_dtype. _scaled_mm on a GPU applies the scales after
  // the fp32 sum instead, which it adds in its own order (with fast accumulation, in fewer
  // bits): close to the emulation's below the output's rounding, not bit for bit.
  return at::mm(dequantize(a), dequantize(b)).to(out_dtype);
}

}  // namespace detail
}  // namespace mixprec
