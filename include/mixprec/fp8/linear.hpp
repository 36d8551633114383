#pragma once
/// mixprec::nn::Float8Linear and the autograd Function of its three fp8 products (the recipes and
/// the MixedFP8 policy are recipes.hpp, the quantization quantize.hpp; the top of recipes.hpp
/// says what fp8 training computes):
///
///   struct Block : torch::nn::Module {
///     mixprec::nn::Float8Linear fc1{512, 2048}, fc2{2048, 512};
///     ...
///   };
///
/// The matrix products: on CUDA, at::_scaled_mm where every dimension is a multiple of 16
/// (cuBLASLt's rule; rowwise scales where the device's _scaled_mm takes them); elsewhere, and
/// on the CPU, emulated as torchao's emulate=True does (the fp8 operands dequantized to fp32, an
/// fp32 matrix product, one rounding): bit for bit torchao's on the CPU. LibTorch's own CPU
/// _scaled_mm is never used: it goes to a oneDNN path that took ~12,000x fp32's time on a Xeon
/// (docs/fp8.md).

#include <mixprec/core/compat.hpp>
#include <mixprec/fp8/block_linear.hpp>
#include <mixprec/fp8/layer_state.hpp>
#include <mixprec/fp8/quantize.hpp>
#include <mixprec/fp8/recipes.hpp>
#include <mixprec/fp8/rowwise.hpp>
#include <mixprec/fp8/watch.hpp>
#include <mixprec/core/autograd_function.hpp>
#include <mixprec/core/parallel.hpp>
#include <mixprec/precision/model_cast.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/recompute_state.hpp>
#include <mixprec/nn/linear.hpp>
#include <mixprec/core/policy.hpp>
#include <mixprec/precision/precision_map.hpp>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <utility>

namespace mixprec {

namespace detail {

/// The fp8 matrix products of a linear layer under the tensorwise and delayed recipes, with their
/// backward (see the top of the header; the rowwise recipes' are rowwise.hpp's).
struct Fp8LinearFunction : public AutogradFunction<Fp8LinearFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const c10::intrusive_ptr<Fp8LayerState>& state) {
    const auto in_features = weight.size(1);
    const auto x = input.reshape({-1, in_features});
    auto qx = state->cast(Fp8Role::input, x);
    auto qw = state->cast(Fp8Role::weight, weight);
    auto out = fp8_mm(qx, {qw.data.t(), qw.scale}, input.scalar_type());
    ctx->save_for_backward({qx.data, qx.scale, qw.data, qw.scale});
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    ctx->saved_data["input_sizes"] = input.sizes().vec();
    ctx->saved_data["input_dtype"] = static_cast<std::int64_t>(input.scalar_type());
    ctx->saved_data["weight_dtype"] = static_cast<std::int64_t>(weight.scalar_type());
    auto sizes = input.sizes().vec();
    sizes.back() = weight.size(0);
    return out.reshape(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Fp8Tensor qx{saved[0], saved[1]}, qw{saved[2], saved[3]};
    auto state = c10::static_intrusive_pointer_cast<Fp8LayerState>(
        ctx->saved_data["state"].toCapsule());
    const auto out_features = qw.data.size(0);
    const auto g = grads[0].reshape({-1, out_features});
    const auto qg = state->cast(Fp8Role::grad_output, g);
    at::Tensor grad_input, grad_weight;
    if (ctx->needs_input_grad(0)) {
      const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["input_dtype"].toInt());
      grad_input = fp8_mm(qg, qw, dtype).reshape(ctx->saved_data["input_sizes"].toIntVector());
    }
    if (ctx->needs_input_grad(1)) {
      const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
      grad_weight = fp8_mm({qg.data.t(), qg.scale}, qx, dtype);
    }
    return {grad_input, grad_weight, at::Tensor()};
  }
};

}  // namespace detail

namespace nn {

/// A mixprec::nn::Linear (torch::nn::Linear's parameters, initialization and state_dict keys;
/// F.linear) that computes in fp8 under a Trainer<MixedFP8<...>>, and as mixprec::nn::Linear
/// under every other policy. A checkpoint of either loads into the other. An input of the wrong
/// width is an Error. apply_lora adapts it as it adapts a mixprec::nn::Linear; an adapted layer
/// then never computes in fp8 (a MixedFP8 Trainer refuses it unless a precision map keeps it
/// out of fp8: LoRA's frozen base in fp8 is LoraBase::fp8_rowwise).
class Float8LinearImpl : public LinearImpl, public mixprec::detail::MappableBase {
 public:
  Float8LinearImpl(std::int64_t in_features, std::int64_t out_features)
      : LinearImpl(in_features, out_features) {}
  explicit Float8LinearImpl(const torch::nn::LinearOptions& linear_options)
      : LinearImpl(linear_options) {}

  at::Tensor forward(const at::Tensor& input) {
    return mixprec::detail::forward_in_region(region_, input, [this](const at::Tensor& x) {
      // Both at once cannot happen: the Trainer refuses adapted layers in fp8, apply_lora a
      // model a Trainer trains.
      MIXPREC_CHECK(!(fp8_ && adapter), "mixprec::nn::Float8Linear: a layer in fp8 with a LoRA "
                    "adapter (mixprec bug: please report)");
      if (adapter) return adapter->forward(x, weight, bias);
      if (!fp8_ || !at::isFloatingType(x.scalar_type())) {
        // As mixprec::nn::Linear: F.linear, not torch::nn::Linear's product and separate add.
        auto out = mixprec::nn::detail::linear("mixprec::nn::Float8Linear", x, weight, bias);
        if (const auto& watch = mixprec::detail::Fp8Watch::current()) watch_fp8(*watch, x, out);
        return out;
      }
      mixprec::nn::detail::check_linear_input("mixprec::nn::Float8Linear", x, weight);
      // Function::apply turns grad off. A checkpoint's recompute replays a forward that has
      // recorded its amaxes already: delayed scaling's histories take each step's once.
      fp8_->set_recording(at::GradMode::is_enabled() && !mixprec::detail::recomputing());
      at::Tensor out;
      if (fp8_->settings().block != BlockFormat::none) {
        check_block_input(x);
        out = mixprec::detail::Fp8BlockLinearFunction::apply(x, weight, fp8_);
      } else {
        out = fp8_->settings().rowwise
                  ? mixprec::detail::Fp8RowwiseLinearFunction::apply(x, weight, fp8_)
                  : mixprec::detail::Fp8LinearFunction::apply(x, weight, fp8_);
      }
      return bias.defined() ? out + bias.to(out.scalar_type()) : out;
    });
  }

  /// Whether its matrix products run in fp8 now (a Trainer<MixedFP8> trains it).
  bool computes_fp8() const noexcept { return static_cast<bool>(fp8_); }

  /// Keeps copies of the fp8 operands (data and scales) of the next forward and backward pass,
  /// returned by last_operands(): for comparing with another implementation. Needs fp8 on.
  void keep_operands() {
    MIXPREC_CHECK(fp8_, "Float8Linear::keep_operands(): this layer does not compute in fp8 "
                  "(no Trainer<MixedFP8> trains it, or a precision map keeps it out of fp8)");
    fp8_->keep_operands();
  }
  const Fp8Operands& last_operands() const {
    MIXPREC_CHECK(fp8_, "Float8Linear::last_operands(): this layer does not compute in fp8");
    return fp8_->operands();
  }

  const torch::nn::Module& wrapped() const override { return *this; }
  bool fp8_capable() const override { return true; }

  void pretty_print(std::ostream& stream) const override {
    stream << "mixprec::nn::Float8Linear(in_features=" << options.in_features()
           << ", out_features=" << options.out_features() << ", bias=" << options.bias()
           << (fp8_ ? ", fp8" : "") << ")";
  }

  /// The Trainer's: the state of its fp8 products (null: off).
  void set_fp8_state(c10::intrusive_ptr<mixprec::detail::Fp8LayerState> state) {
    fp8_ = std::move(state);
  }
  const c10::intrusive_ptr<mixprec::detail::Fp8LayerState>& fp8_state() const noexcept {
    return fp8_;
  }

 private:
  // The block-scaled recipes cast the layer's own dtype (bf16 under MixedFP8; torchao's casts
  // take bf16 or fp32), and the weight gradient sums over the input's rows in blocks: a
  // training step's rows must fill them (torchao's casts assert the same).
  void check_block_input(const at::Tensor& x) const {
    const auto& s = fp8_->settings();
    MIXPREC_CHECK(x.scalar_type() == weight.scalar_type(), "mixprec::nn::Float8Linear",
                  mixprec::detail::block_format_name(s.block), ": got a ", x.scalar_type(),
                  " input for a ", weight.scalar_type(), " weight; the block casts take the "
                  "layer's dtype: pass trainer.cast_input(x), or keep the layer out of fp8 "
                  "with a precision map");
    const auto rows = x.numel() / std::max<std::int64_t>(x.size(-1), 1);
    const bool weight_grad = at::GradMode::is_enabled() && weight.requires_grad();
    MIXPREC_CHECK(!weight_grad || rows % s.block_size == 0,
                  "mixprec::nn::Float8Linear", mixprec::detail::block_format_name(s.block),
                  ": a training step's input has ", rows, " rows (all dimensions but the last), "
                  "not a multiple of ", s.block_size, ": the weight gradient sums over the rows "
                  "in blocks of ", s.block_size, ". Make the batch (tokens per step) a multiple "
                  "of ", s.block_size, ", or keep this layer in bf16 with a precision map");
  }

  // Under advise(): the operands' ranges, for its fp8 verdict.
  // In a checkpointed block, each operand once: input and weight in the forward pass, the
  // gradient in the recompute's backward (the first run's graph is dropped unused).
  void watch_fp8(mixprec::detail::Fp8Watch& watch, const at::Tensor& input, at::Tensor& out) {
    if (!at::isFloatingType(input.scalar_type())) return;
    const auto pass = mixprec::detail::checkpoint_pass();
    if (pass != mixprec::detail::CheckpointPass::recompute) {
      watch.add(this, Fp8Role::input, input);
      watch.add(this, Fp8Role::weight, weight);
    }
    if (out.requires_grad() && pass != mixprec::detail::CheckpointPass::forward) {
      auto keep = mixprec::detail::Fp8Watch::current();  // alive as long as the graph
      out.register_hook([keep, self = this](const at::Tensor& grad) {
        keep->add(self, Fp8Role::grad_output, grad);
      });
    }
  }

  c10::intrusive_ptr<mixprec::detail::Fp8LayerState> fp8_;
};

/// The holder of Float8LinearImpl: `mixprec::nn::Float8Linear fc{512, 2048};`.
TORCH_MODULE(Float8Linear);

}  // namespace nn
}  // namespace mixprec
