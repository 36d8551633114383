#pragma once
// The matrix products of a Float8Linear under the block-scaled recipes (block_recipes.hpp:
// MXFP8Scaling, BlockwiseFP8Scaling, NVFP4Scaling), with their backward. Each product casts
// its two operands with blocks along its inner dimension, each operand stored "K-major" (that
// dimension last, contiguous; block_mm.hpp multiplies a @ b^T). In mixprec's layout (input
// x [M, in], weight W [out, in], grad_output g [M, out]):
//
//   output      = x @ W^T       x along in,  W along in      (NVFP4: W in 16x16 tiles)
//   grad_input  = g @ W         g along out, W^T along out   (NVFP4: g rounded stochastically)
//   grad_weight = g^T @ x       g^T along M, x^T along M     (NVFP4: both times a random
//                                                            Hadamard matrix first; g^T
//                                                            rounded stochastically)
//
// The layer keeps its bf16 input and weight for the backward pass and casts them again, as
// torchao's MXFP8 and blockwise layers do; a recast of the weight gives the forward's bytes
// (the 128x128 and 16x16 tiles of W^T are those of W, transposed).

#include <mixprec/core/autograd_function.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/fp8/block_mm.hpp>
#include <mixprec/fp8/layer_state.hpp>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>

#include <cstdint>

namespace mixprec::detail {

/// A block-scaled cast of `x` (2-D, contiguous) for `cast`, K-major: its blocks along its
/// last dimension (`tiles`: 128x128 or 16x16 tiles of a weight). `rounding`: NVFP4's.
inline Fp8Tensor block_cast(Fp8LayerState& state, Fp8Cast cast, const at::Tensor& x,
                            bool tiles = false, Nvfp4Rounding rounding = {}) {
  const auto& s = state.settings();
  switch (s.block) {
    case BlockFormat::mxfp8: return state.keep(cast, mx_quantize(x, s.mx_scale));
    case BlockFormat::blockwise_fp8:
      return state.keep(cast, tiles ? blockwise_quantize_128x128(x) : blockwise_quantize_1x128(x));
    case BlockFormat::nvfp4: return state.keep(cast, nvfp4_quantize(x, tiles, rounding));
    default: fail("mixprec: block_cast: not a block-scaled recipe");
  }
}

/// An operand along its rows (the product's inner dimension is x's first): x^T, K-major. The
/// blockwise recipe casts it as torchao does, 128x1 blocks of x, then transposes.
inline Fp8Tensor block_cast_rows(Fp8LayerState& state, Fp8Cast cast, const at::Tensor& x,
                                 Nvfp4Rounding rounding = {}) {
  const auto& s = state.settings();
  if (s.block == BlockFormat::blockwise_fp8 && cast == Fp8Cast::input_for_grad_weight) {
    const auto q = blockwise_quantize_128x1(x);
    return state.keep(cast, {q.data.t().contiguous(), q.scale.t().contiguous()});
  }
  auto t = x.t().contiguous();
  if (s.block == BlockFormat::nvfp4 && s.hadamard) {
    t = hadamard_rows(t, random_hadamard16(state.hadamard_key()));
  }
  return block_cast(state, cast, t, /*tiles=*/false, rounding);
}

struct Fp8BlockLinearFunction : public AutogradFunction<Fp8BlockLinearFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight,
                            const c10::intrusive_ptr<Fp8LayerState>& state) {
    const auto& s = state->settings();
    const auto x = input.reshape({-1, weight.size(1)}).contiguous();
    const auto w = weight.contiguous();
    state->note_amax(Fp8Cast::input, abs_max(x));
    state->note_amax(Fp8Cast::weight, abs_max(w));
    const auto qx = block_cast(*state, Fp8Cast::input, x);
    const auto qw = block_cast(*state, Fp8Cast::weight, w, /*tiles=*/tiled_weight(s));
    auto out = block_mm(qx, qw, s.block, input.scalar_type());
    ctx->save_for_backward({input, weight});
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    auto sizes = input.sizes().vec();
    sizes.back() = weight.size(0);
    return out.reshape(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& input = saved[0];
    const auto& weight = saved[1];
    auto state = c10::static_intrusive_pointer_cast<Fp8LayerState>(
        ctx->saved_data["state"].toCapsule());
    const auto& s = state->settings();
    const auto g = grads[0].reshape({-1, weight.size(0)}).contiguous();
    state->note_amax(Fp8Cast::grad_output, abs_max(g));
    const bool stochastic = s.block == BlockFormat::nvfp4 && s.stochastic_gradients;
    at::Tensor grad_input, grad_weight;
    if (ctx->needs_input_grad(0)) {
      const auto qg = block_cast(*state, Fp8Cast::grad_output, g, /*tiles=*/false,
                                 {stochastic, state->rounding_key(0)});
      const auto qw = block_cast(*state, Fp8Cast::weight_for_grad_input,
                                 weight.t().contiguous(), /*tiles=*/tiled_weight(s));
      grad_input = block_mm(qg, qw, s.block, input.scalar_type()).reshape(input.sizes());
    }
    if (ctx->needs_input_grad(1)) {
      const auto x = input.reshape({-1, weight.size(1)});
      if (s.weight_grad_fp8) {
        const auto qg = block_cast_rows(*state, Fp8Cast::grad_output_for_grad_weight, g,
                                        {stochastic, state->rounding_key(1)});
        const auto qx = block_cast_rows(*state, Fp8Cast::input_for_grad_weight, x.contiguous());
        grad_weight = block_mm(qg, qx, s.block, weight.scalar_type());
      } else {
        grad_weight = at::mm(g.t(), x).to(weight.scalar_type());  // torchao's wgrad_with_hp
      }
    }
    if (s.block == BlockFormat::nvfp4) state->advance_rounding();
    return {grad_input, grad_weight, at::Tensor()};
  }

 private:
  static bool tiled_weight(const Fp8Settings& s) {
    return s.block == BlockFormat::blockwise_fp8 ||
           (s.block == BlockFormat::nvfp4 && s.two_dim_weights);
  }
};

}  // namespace mixprec::detail
