#pragma once
/// mixprec::nn::Conv2d, a drop-in module: the parameters, state_dict keys and forward of
/// torch::nn::Conv2d, plus a precision setting that a LibTorch module cannot take from outside
/// (LibTorch modules have no forward hooks, and a model's forward calls its members' forward()
/// directly). mixprec::nn::Linear is in linear.hpp.
///
/// mixprec::nn::Conv2d: fp32_weight_grad(true) computes an fp16 convolution's weight and bias
/// gradients in fp32 (rounded once to fp16), leaving its forward and input gradient in fp16. On a
/// CPU with AVX512-FP16 but no AMX-FP16 (a Sapphire Rapids Xeon), LibTorch's fp16 weight gradient
/// is oneDNN's reference loop, 114-385x fp32's time (mixprec::cpu_capabilities() tells):
///
///   struct Net : torch::nn::Module {
///     mixprec::nn::Conv2d conv{torch::nn::Conv2dOptions(1, 16, 3).padding(1)};  // was torch::nn
///     ...
///   };
///   mixprec::nn::fp32_conv_weight_grads(*model);  // every mixprec::nn::Conv2d of the model

#include <mixprec/core/autocast.hpp>
#include <mixprec/core/autograd_function.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/nn/functional/padding.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <cstdint>
#include <optional>
#include <variant>
#include <string>
#include <vector>

namespace mixprec::nn {
namespace detail {

// The alternative T of a torch::nn option's variant, or nullptr: LibTorch 1.13's options hold a
// c10::variant, 2.x's a std::variant; argument-dependent lookup finds the get_if of either.
template <class T, class Variant>
const T* variant_get_if(const Variant& v) noexcept {
  using std::get_if;
  return get_if<T>(&v);
}

// A 2-D convolution of same-dtype tensors whose backward computes the input gradient in that
// dtype and the weight and bias gradients in fp32, rounded once to the weight's dtype. The bias
// is optional (undefined: see mixprec/core/autograd_function.hpp); any input may need no
// gradient (a network's first layer, a frozen weight).
struct Fp32WeightGradConv2d : mixprec::detail::AutogradFunction<Fp32WeightGradConv2d> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& bias,
                            std::vector<std::int64_t> stride, std::vector<std::int64_t> padding,
                            std::vector<std::int64_t> dilation, std::int64_t groups) {
    ctx->save_for_backward({input, weight});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["groups"] = groups;
    return at::conv2d(input, weight, mixprec::detail::given(bias), stride, padding, dilation,
                      groups);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& input = saved[0];
    const auto& weight = saved[1];
    const auto stride = ctx->saved_data["stride"].toIntVector();
    const auto padding = ctx->saved_data["padding"].toIntVector();
    const auto dilation = ctx->saved_data["dilation"].toIntVector();
    const auto groups = ctx->saved_data["groups"].toInt();
    const auto grad = grads[0].contiguous();
    const std::vector<std::int64_t> no_output_padding(stride.size(), 0);
    const bool input_grad = ctx->needs_input_grad(0);
    const bool weight_grad = ctx->needs_input_grad(1);
    // False for an absent bias too: it came as a placeholder that needs no gradient.
    const bool bias_grad = ctx->needs_input_grad(2);
    const std::vector<std::int64_t> bias_sizes{weight.size(0)};
    const auto bias_arg =
        bias_grad ? at::OptionalIntArrayRef(bias_sizes) : at::OptionalIntArrayRef();
    at::Tensor grad_input, grad_weight, grad_bias;
    if (input_grad) {
      grad_input = std::get<0>(at::convolution_backward(
          grad, input, weight, at::OptionalIntArrayRef(), stride, padding, dilation, false,
          no_output_padding, groups, {true, false, false}));
    }
    if (weight_grad || bias_grad) {
      auto fp32 = at::convolution_backward(grad.to(at::kFloat), input.to(at::kFloat),
                                           weight.to(at::kFloat), bias_arg, stride, padding,
                                           dilation, false, no_output_padding, groups,
                                           {false, weight_grad, bias_grad});
      if (weight_grad) grad_weight = std::get<1>(fp32).to(weight.scalar_type());
      if (bias_grad) grad_bias = std::get<2>(fp32).to(weight.scalar_type());
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace detail

/// torch::nn::Conv2d with the same parameters and state_dict keys; `fp32_weight_grad(true)`
/// computes the weight and bias gradients of an fp16 convolution in fp32 (see the top of this
/// header). Off by default: then forward() is torch::nn::Conv2d's, bit for bit. bf16 and fp32
/// convolutions always take torch::nn::Conv2d's path (their weight gradients are fast).
class Conv2dImpl : public torch::nn::Conv2dImpl {
 public:
  using torch::nn::Conv2dImpl::Conv2dImpl;

  /// Sets whether fp16 weight gradients are computed in fp32; returns *this.
  Conv2dImpl& fp32_weight_grad(bool on) noexcept {
    fp32_weight_grad_ = on;
    return *this;
  }
  bool fp32_weight_grad() const noexcept { return fp32_weight_grad_; }

  at::Tensor forward(const at::Tensor& input) {
    if (!fp32_weight_grad_) return torch::nn::Conv2dImpl::forward(input);
    // The dtype the convolution computes in: autocast's where it is on (MixedO1), else the
    // input's (MixedO2 and PureHalf cast the model and the batch).
    const auto device = input.device().type();
    auto dtype = input.scalar_type();
    if (device == c10::DeviceType::CPU || device == c10::DeviceType::CUDA) {
      const auto state = mixprec::detail::get_autocast_state(device);
      if (state.enabled && at::isFloatingType(dtype)) dtype = state.dtype;
    }
    if (dtype != at::kHalf) return torch::nn::Conv2dImpl::forward(input);
    auto x = input.to(dtype);
    const auto w = weight.to(dtype);
    const auto b = bias.defined() ? bias.to(dtype) : at::Tensor();
    // Explicit zero padding goes to the convolution; every other padding (the modes reflect,
    // replicate and circular, and "same", which may be uneven) is applied first, as
    // torch::nn::Conv2d does for its modes.
    std::vector<std::int64_t> padding{0, 0};
    const auto* explicit_padding = detail::variant_get_if<torch::ExpandingArray<2>>(options.padding());
    const bool zeros = detail::variant_get_if<torch::enumtype::kZeros>(options.padding_mode()) != nullptr;
    if (zeros && explicit_padding != nullptr) {
      padding = {(**explicit_padding)[0], (**explicit_padding)[1]};
    } else {
      auto pad = torch::nn::functional::PadFuncOptions(_reversed_padding_repeated_twice);
      if (detail::variant_get_if<torch::enumtype::kReflect>(options.padding_mode())) {
        pad.mode(torch::kReflect);
      } else if (detail::variant_get_if<torch::enumtype::kReplicate>(options.padding_mode())) {
        pad.mode(torch::kReplicate);
      } else if (detail::variant_get_if<torch::enumtype::kCircular>(options.padding_mode())) {
        pad.mode(torch::kCircular);
      }
      x = torch::nn::functional::pad(x, pad);
    }
    const std::vector<std::int64_t> stride(options.stride()->begin(), options.stride()->end());
    const std::vector<std::int64_t> dilation(options.dilation()->begin(),
                                             options.dilation()->end());
    // Autocast off inside: the tensors are in their compute dtype already.
    AutocastGuard no_autocast(device == c10::DeviceType::CUDA ? device : c10::DeviceType::CPU,
                              at::kHalf, false);
    return detail::Fp32WeightGradConv2d::apply(x, w, b, stride, padding, dilation,
                                               options.groups());
  }

 private:
  bool fp32_weight_grad_ = false;
};
TORCH_MODULE(Conv2d);

namespace detail {

/// The names of `model`'s convolutions whose fp16 weight gradient LibTorch computes itself (all
/// but the mixprec::nn::Conv2d with fp32_weight_grad on).
inline std::vector<std::string> fp16_weight_grad_convolutions(const torch::nn::Module& model) {
  std::vector<std::string> names;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const auto* m = item.value().get();
    if (const auto* ours = dynamic_cast<const Conv2dImpl*>(m)) {
      if (!ours->fp32_weight_grad()) names.push_back(item.key());
    } else if (dynamic_cast<const torch::nn::Conv1dImpl*>(m) ||
               dynamic_cast<const torch::nn::Conv2dImpl*>(m) ||
               dynamic_cast<const torch::nn::Conv3dImpl*>(m) ||
               dynamic_cast<const torch::nn::ConvTranspose1dImpl*>(m) ||
               dynamic_cast<const torch::nn::ConvTranspose2dImpl*>(m) ||
               dynamic_cast<const torch::nn::ConvTranspose3dImpl*>(m)) {
      names.push_back(item.key());
    }
  }
  return names;
}

}  // namespace detail

/// Turns fp32_weight_grad on for every mixprec::nn::Conv2d of `model`; returns how many.
inline std::size_t fp32_conv_weight_grads(torch::nn::Module& model, bool on = true) {
  std::size_t count = 0;
  for (const auto& module : model.modules(/*include_self=*/true)) {
    if (auto* conv = dynamic_cast<Conv2dImpl*>(module.get())) {
      conv->fp32_weight_grad(on);
      ++count;
    }
  }
  return count;
}

}  // namespace mixprec::nn
