#pragma once
// The product of two block-scaled operands (MXFP8, blockwise fp8, NVFP4), a @ b^T, each operand
// stored with its blocks along its last dimension, the product's inner one ("K-major": a
// [M, K], b [N, K]). On CUDA, at::_scaled_mm_v2 with block scales (cuBLASLt: MXFP8 and NVFP4
// on sm_100, blockwise fp8 on sm_90), asked once per device and format, as quantize.hpp asks
// for rowwise scales: where the kernel refuses, that device's products of that format are
// emulated from then on. The emulation, on every device, is what torchao's does where it has
// one, and the same arithmetic where it has none:
//   MXFP8      both operands dequantized in the output dtype (bf16: code x 2^k is exact), a
//              bf16 matrix product (torchao's KernelPreference.EMULATED);
//   blockwise  both dequantized to fp32 (code x reciprocal scale, one rounding), an fp32
//              product, one rounding to the output dtype (torchao runs it on CUDA only);
//   NVFP4      both dequantized to fp32 as NVFP4Tensor.dequantize(torch.float32) (code x
//              (tensor scale x block scale)), an fp32 product, one rounding (torchao's NVFP4
//              products are CUDA only).

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/fp8/block_recipes.hpp>
#include <mixprec/fp8/blockwise.hpp>
#include <mixprec/fp8/mx.hpp>
#include <mixprec/fp8/nvfp4.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>

namespace mixprec::detail {

/// Whether this CUDA device's _scaled_mm_v2 computes products of `format` (0 not asked yet,
/// 1 yes, -1 no): a fact of the device and the build, asked of the kernel once.
inline std::atomic<int>& block_mm_state(c10::DeviceIndex device, BlockFormat format) {
  static std::array<std::array<std::atomic<int>, 4>, 64> states{};
  return states[static_cast<std::size_t>(std::clamp<int>(device, 0, 63))]
               [static_cast<std::size_t>(format)];
}

/// A [rows, columns] tensor of block scales in the layout cuBLAS reads them in (torchao's
/// to_blocked): padded to 128 rows and 4 columns, then each 128x4 tile as 32x16.
inline at::Tensor swizzled_scales(const at::Tensor& scale) {
  const auto bytes = scale.view(at::kByte);
  const auto rows = bytes.size(0), columns = bytes.size(1);
  const auto row_blocks = (rows + 127) / 128, column_blocks = (columns + 3) / 4;
  auto padded = bytes;
  if (rows != row_blocks * 128 || columns != column_blocks * 4) {
    padded = at::zeros({row_blocks * 128, column_blocks * 4}, bytes.options());
    padded.slice(0, 0, rows).slice(1, 0, columns).copy_(bytes);
  }
  return padded.view({row_blocks, 128, column_blocks, 4})
      .permute({0, 2, 1, 3})
      .reshape({-1, 4, 32, 4})
      .transpose(1, 2)
      .reshape({-1, 32, 16})
      .flatten();
}

// A 1x128 operand's scales as cuBLAS takes them: [rows, blocks], the rows contiguous.
inline at::Tensor outer_major(const at::Tensor& scale) { return scale.t().contiguous().t(); }

/// a @ b^T on CUDA through _scaled_mm_v2 (the ScalingType and SwizzleType numbers of
/// ATen/BlasBackend.h: TensorWise 0, BlockWise1x16 2, BlockWise1x32 3, BlockWise1x128 4,
/// BlockWise128x128 5; SWIZZLE_32_4_4 1).
inline at::Tensor block_mm_cuda(const Fp8Tensor& a, const Fp8Tensor& b, BlockFormat format,
                                c10::ScalarType out_dtype) {
  const auto a_data = a.data.contiguous();
  const auto b_data = b.data.contiguous();
  switch (format) {
    case BlockFormat::mxfp8:
      return block_scaled_mm(a_data, b_data.t(), {swizzled_scales(a.scale).view(float8_e8m0)}, {3},
                             {1}, {swizzled_scales(b.scale).view(float8_e8m0)}, {3}, {1}, out_dtype);
    case BlockFormat::nvfp4:
      return block_scaled_mm(a_data.view(float4_e2m1x2), b_data.view(float4_e2m1x2).t(),
                             {swizzled_scales(a.scale).view(float8_e4m3), a.tensor_scale}, {2, 0},
                             {1, 0},
                             {swizzled_scales(b.scale).view(float8_e4m3), b.tensor_scale}, {2, 0},
                             {1, 0}, out_dtype);
    case BlockFormat::blockwise_fp8: {
      const bool b_tiles = b.scale.size(0) * fp8_tile == b.data.size(0);
      if (!b_tiles) {
        return block_scaled_mm(a_data, b_data.t(), {outer_major(a.scale)}, {4}, {0},
                               {outer_major(b.scale)}, {4}, {0}, out_dtype);
      }
      // 128x128 tiles: [K / 128, N / 128] with K contiguous, K / 128 padded to a multiple of 4.
      const auto k_blocks = b.scale.size(1), padded_blocks = (k_blocks + 3) / 4 * 4;
      auto padded = at::ones({b.scale.size(0), padded_blocks}, b.scale.options());
      padded.slice(1, 0, k_blocks).copy_(b.scale);
      return block_scaled_mm(a_data, b_data.t(), {outer_major(a.scale)}, {4}, {0}, {padded.t()},
                             {5}, {0}, out_dtype);
    }
    default:
      fail("mixprec: block_mm_cuda: not a block format");
  }
}

/// a @ b^T in `out_dtype` for two operands of `format` (see the top of the header).
inline at::Tensor block_mm(const Fp8Tensor& a, const Fp8Tensor& b, BlockFormat format,
                           c10::ScalarType out_dtype) {
  if (has_block_scaled_mm && a.data.is_cuda()) {
    auto& state = block_mm_state(a.data.device().index(), format);
    if (state.load() >= 0) {
      try {
        auto out = block_mm_cuda(a, b, format, out_dtype);
        state.store(1);
        return out;
      } catch (const c10::OutOfMemoryError&) {
        throw;
      } catch (const c10::Error&) {
        if (state.load() == 1) throw;  // it worked before: a real error
        state.store(-1);  // no kernel for this format here: the emulation from now on
      }
    }
  }
  switch (format) {
    case BlockFormat::mxfp8:
      return at::mm(mx_dequantize(a, out_dtype), mx_dequantize(b, out_dtype).t());
    case BlockFormat::blockwise_fp8:
      return at::mm(blockwise_dequantize(a), blockwise_dequantize(b).t()).to(out_dtype);
    case BlockFormat::nvfp4:
      return at::mm(nvfp4_dequantize(a), nvfp4_dequantize(b).t()).to(out_dtype);
    default:
      fail("mixprec: block_mm: not a block format");
  }
}

}  // namespace mixprec::detail
