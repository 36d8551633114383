#pragma once
// The matrix products of a Float8Linear under the rowwise recipes (RowwiseScaling and
// RowwiseScalingWithGwHp of recipes.hpp: torchao's "rowwise" and "rowwise_with_gw_hp"), with
// their backward. Each fp8 operand has one scale per row along its product's inner dimension,
// so a tensor used by two products is cast twice, once along each axis: the layer keeps its bf16
// input and weight for the backward pass, not fp8 copies. In mixprec's layout (input [M, in],
// weight [out, in], grad_output [M, out]):
//
//   output      = input @ weight^T        input per row, weight per row
//   grad_input  = grad_output @ weight    grad_output per row, weight per column (..._WithGwHp:
//                                         one scale for the whole weight)
//   grad_weight = grad_output^T @ input   both per column (..._WithGwHp: bf16, no fp8)
//
// The scales are powers of 2 and every operand e4m3. The operands' layouts are torchao's, so
// that the emulated products are its products bit for bit (tests/test_parity.cpp).

#include <mixprec/core/autograd_function.hpp>
#include <mixprec/fp8/layer_state.hpp>
#include <mixprec/fp8/quantize.hpp>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>

#include <cstdint>
#include <optional>

namespace mixprec::detail {

struct Fp8RowwiseLinearFunction : public AutogradFunction<Fp8RowwiseLinearFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight,
                            const c10::intrusive_ptr<Fp8LayerState>& state) {
    const auto x = input.reshape({-1, weight.size(1)});
    const auto qx = state->cast_rowwise(Fp8Cast::input, x, 1);
    const auto qw = state->cast_rowwise(Fp8Cast::weight, weight, 1);  // one scale per output
    // torchao runs the forward product with _scaled_mm's fast accumulation (on CUDA).
    auto out = fp8_mm(qx, transposed(qw), input.scalar_type(), /*fast_accum=*/true);
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
    const bool fp8_weight_grad = state->settings().weight_grad_fp8;
    const auto g = grads[0].reshape({-1, weight.size(0)});
    at::Tensor grad_input, grad_weight;
    if (ctx->needs_input_grad(0)) {
      const auto qg = state->cast_rowwise(Fp8Cast::grad_output, g, 1);
      // The inner dimension of this product is the weight's rows: one scale per column.
      const auto weight_dim = fp8_weight_grad ? std::optional<std::int64_t>(0) : std::nullopt;
      const auto qw = state->cast_rowwise(Fp8Cast::weight_for_grad_input, weight, weight_dim);
      grad_input = fp8_mm(qg, qw, input.scalar_type()).reshape(input.sizes());
    }
    if (ctx->needs_input_grad(1)) {
      const auto x = input.reshape({-1, weight.size(1)});
      if (fp8_weight_grad) {
        const auto qg = state->cast_rowwise(Fp8Cast::grad_output_for_grad_weight, g, 0);
        const auto qx = state->cast_rowwise(Fp8Cast::input_for_grad_weight, x, 0);
        grad_weight = fp8_mm(transposed(qg), qx, weight.scalar_type());
      } else {
        grad_weight = at::mm(g.t(), x).to(weight.scalar_type());
      }
    }
    return {grad_input, grad_weight, at::Tensor()};
  }
};

}  // namespace mixprec::detail
