#pragma once
// What advise() sees of the Float8Linear layers in its fp32 steps: each operand's range against
// the casts of every recipe (the block-scaled ones' along the last dimension), counted as the
// layers run (diagnostics/advise_verdicts.hpp judges them). It needs no fp8 dtype: advise()
// watches these layers under LibTorch 1.13 too.

#include <mixprec/fp8/quantize.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace mixprec::detail {

// Layers are keyed by their torch::nn::Module address, the one named_modules() gives: in
// LibTorch 1.13 Module is a virtual base of Linear, at another address than the layer's own.
class Fp8Watch {
 public:
  struct Operand {
    double amax = 0;             // the largest |x| seen
    std::int64_t nonzero = 0;    // nonzero elements seen
    // Tensorwise scaling (its amax mapped to the format's max): of the nonzero elements, those
    // that would round to 0, and those that would be subnormal (fewer mantissa bits).
    std::int64_t flushed = 0;
    std::int64_t subnormal = 0;
    // The rowwise recipes' casts (e4m3, power-of-2 scales): those that would round to 0 with
    // one scale per row (along the last dimension), per column (along the others), and with
    // one for the whole tensor.
    std::int64_t flushed_rows = 0;
    std::int64_t flushed_columns = 0;
    std::int64_t flushed_power_of_2 = 0;
    // The block-scaled recipes' casts along the last dimension (block_recipes.hpp): those that
    // would round to 0 with MXFP8's power-of-2 scale per 32, blockwise fp8's 448 / amax per
    // 128, NVFP4's amax / 6 per 16 (-1: the last dimension is no multiple of the block).
    std::int64_t flushed_mxfp8 = 0;
    std::int64_t flushed_blockwise = 0;
    std::int64_t flushed_nvfp4 = 0;
  };
  using Operands = std::array<Operand, 3>;

  void add(const torch::nn::Module* layer, Fp8Role role, const at::Tensor& x) {
    const at::NoGradGuard no_grad;
    const auto magnitude = x.detach().abs().to(at::kFloat);
    const double amax = magnitude.max().item<double>();
    if (!std::isfinite(amax)) return;  // advise() reports inf/NaN itself
    // Smallest subnormal and normal magnitudes: e4m3 2^-9 and 2^-6, e5m2 2^-16 and 2^-14; half
    // the smallest subnormal, and all below, rounds to 0 (to the even code).
    const bool e5m2 = role == Fp8Role::grad_output;
    const double tiny = std::ldexp(1.0, e5m2 ? -16 : -9), normal = std::ldexp(1.0, e5m2 ? -14 : -6);
    const double scale = amax > 0 ? fp8_max(role) / amax : 0.0;
    const auto nonzero = magnitude > 0;
    const auto rows = magnitude.reshape({-1, magnitude.size(-1)});
    const auto nonzero_rows = nonzero.reshape(rows.sizes());
    const auto flushed_e4m3 = [&](const at::Tensor& amaxes) {
      const auto scales = scale_from_amax(amaxes, 448.0, 0, /*power_of_2=*/true);
      return (nonzero_rows & (rows * scales <= std::ldexp(1.0, -10))).sum().item<std::int64_t>();
    };
    const auto flushed_rows = flushed_e4m3(rows.amax({1}, /*keepdim=*/true));
    const auto flushed_columns = flushed_e4m3(rows.amax({0}, /*keepdim=*/true));
    const auto flushed_power_of_2 = flushed_e4m3(rows.max());
    // Per block along the last dimension: the nonzero elements at or below `threshold(amax)`.
    const auto columns = rows.size(1);
    const auto flushed_blocks = [&](std::int64_t block, const auto& threshold) -> std::int64_t {
      if (columns % block != 0) return -1;
      const auto blocks = rows.reshape({rows.size(0), columns / block, block});
      const at::Tensor limit = threshold(blocks.amax({2}, /*keepdim=*/true));
      const at::Tensor flushed = nonzero_rows.reshape(blocks.sizes()) & (blocks <= limit);
      return flushed.sum().item<std::int64_t>();
    };
    // MXFP8 (FLOOR): scale 2^(floor(log2 amax) - 8), e4m3's half smallest subnormal 2^-10.
    const auto flushed_mxfp8 = flushed_blocks(32, [](const at::Tensor& block_amax) {
      return at::exp2(at::floor(at::log2(block_amax)) - 18.0);
    });
    const auto flushed_blockwise = flushed_blocks(128, [](const at::Tensor& block_amax) {
      return block_amax * (std::ldexp(1.0, -10) / 448.0);
    });
    // NVFP4: amax maps to 6; below a quarter of e2m1's smallest step (0.5) rounds to 0.
    const auto flushed_nvfp4 = flushed_blocks(16, [](const at::Tensor& block_amax) {
      return block_amax / 24.0;
    });
    std::lock_guard<std::mutex> lock(mutex_);
    auto& o = layers_[layer][static_cast<int>(role)];
    o.amax = std::max(o.amax, amax);
    o.nonzero += nonzero.sum().item<std::int64_t>();
    o.flushed += (nonzero & (magnitude * scale <= tiny / 2)).sum().item<std::int64_t>();
    o.subnormal += (nonzero & (magnitude * scale < normal)).sum().item<std::int64_t>();
    o.flushed_rows += flushed_rows;
    o.flushed_columns += flushed_columns;
    o.flushed_power_of_2 += flushed_power_of_2;
    const auto count = [](std::int64_t& total, std::int64_t n) { total = total < 0 || n < 0 ? -1 : total + n; };
    count(o.flushed_mxfp8, flushed_mxfp8);
    count(o.flushed_blockwise, flushed_blockwise);
    count(o.flushed_nvfp4, flushed_nvfp4);
  }

  const Operands* find(const torch::nn::Module* layer) const {
    const auto it = layers_.find(layer);
    return it == layers_.end() ? nullptr : &it->second;
  }

  /// The watch of advise() running on this thread, if any.
  static std::shared_ptr<Fp8Watch>& current() {
    thread_local std::shared_ptr<Fp8Watch> watch;
    return watch;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, Operands> layers_;
};

}  // namespace mixprec::detail
