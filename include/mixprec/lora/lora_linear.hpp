#pragma once
// What apply_lora attaches to a mixprec::nn::Linear: the adapter's forward, PEFT's
// `result = base(x) + lora_B(lora_A(dropout(x))) * scaling` op for op (so that it computes
// PEFT's bits where the base does), and the frozen base stored in a dtype of its own (bf16,
// fp16, or e4m3 with fp32 scales), dequantized for each matrix product by an autograd Function
// that keeps no copy of it for backward.

#include <mixprec/core/autograd_function.hpp>
#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/nn/linear.hpp>

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace mixprec {

/// How apply_lora keeps the frozen weight and bias of the layers it adapts.
enum class LoraBase {
  as_is,           ///< as the model has them: a Trainer casts them with the model (to the Low
                   ///< dtype under MixedO2 and PureHalf), as any frozen tensor
  bf16,            ///< stored in bf16 from now on, under every policy
  fp16,            ///< stored in fp16 from now on (LibTorch >= 2.4 computes it on the CPU)
  fp8_rowwise,     ///< e4m3 with an fp32 scale per output row (amax / 448), the bias in bf16
  fp8_tensorwise,  ///< e4m3 with one fp32 scale for the whole weight, the bias in bf16
};

/// The settings of apply_lora, PEFT's LoraConfig by other names: LoraOptions().rank(16).alpha(32).
struct LoraOptions {
  /// r: the adapters' inner width; at most min(in_features, out_features) of each layer.
  TORCH_ARG(std::int64_t, rank) = 8;
  /// lora_alpha: the adapters' output is scaled by alpha / rank (alpha / sqrt(rank) with
  /// use_rslora); not 0.
  TORCH_ARG(double, alpha) = 8;
  /// lora_dropout: the probability of dropping an input element of the adapter (not the base).
  TORCH_ARG(double, dropout) = 0.0;
  /// use_rslora: scale by alpha / sqrt(rank).
  TORCH_ARG(bool, use_rslora) = false;
  /// A's Kaiming-uniform values from a generator seeded so (drawn as PEFT draws them after
  /// torch.manual_seed(seed)); unset: from LibTorch's default generator, as PEFT does.
  TORCH_ARG(std::optional<std::uint64_t>, seed) = std::nullopt;
  /// How the adapted layers keep their frozen weights.
  TORCH_ARG(LoraBase, base) = LoraBase::as_is;
  /// Module-path patterns whose parameters stay trainable (PEFT's modules_to_save: a new
  /// classification head, say); every other parameter but the adapters' is frozen.
  TORCH_ARG(std::vector<std::string>, trainable) = {};
};

namespace detail {

inline const char* lora_base_name(LoraBase base) {
  switch (base) {
    case LoraBase::as_is: return "as_is";
    case LoraBase::bf16: return "bf16";
    case LoraBase::fp16: return "fp16";
    case LoraBase::fp8_rowwise: return "fp8_rowwise";
    case LoraBase::fp8_tensorwise: return "fp8_tensorwise";
  }
  return "?";
}

inline bool lora_base_fp8(LoraBase base) {
  return base == LoraBase::fp8_rowwise || base == LoraBase::fp8_tensorwise;
}

/// The largest e4m3 value: a weight's amax maps to it.
inline constexpr double kE4m3Max = 448.0;

/// `weight` (fp32 or Low) as e4m3 with its fp32 scale: per output row ([out, 1]) or for the
/// tensor ([]). A row of zeros gets scale 1.
inline std::pair<at::Tensor, at::Tensor> quantize_e4m3(const at::Tensor& weight, bool rowwise) {
  const auto w = weight.detach().to(at::kFloat);
  auto amax = rowwise ? w.abs().amax({1}, /*keepdim=*/true) : w.abs().max();
  const auto scale = at::where(amax > 0, amax / kE4m3Max, at::ones_like(amax));
  // fp8 arithmetic has no CPU kernels: the division and the clamp in fp32, then one cast.
  const auto q = (w / scale).clamp(-kE4m3Max, kE4m3Max).to(float8_e4m3);
  return {q, scale};
}

/// A stored base weight as `dtype`: e4m3 codes times their scales (in fp32, then rounded once),
/// or a Low weight cast.
inline at::Tensor dequantize(const at::Tensor& weight, const at::Tensor& scale,
                             c10::ScalarType dtype) {
  if (!scale.defined()) return weight.to(dtype);
  return (weight.to(at::kFloat) * scale).to(dtype);
}

/// y = x W^T + b with W (and b) stored in another dtype than the one the product is computed
/// in: dequantized for the forward, and again for backward's input gradient, so that the graph
/// keeps the stored tensor and no copy of it (autograd would keep the dequantized copy of
/// at::linear's weight until backward: a second base in bf16). W and b need no gradient.
struct FrozenBaseLinear : AutogradFunction<FrozenBaseLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& scale_argument,
                            const at::Tensor& bias_argument, c10::ScalarType dtype) {
    const auto scale = given(scale_argument);
    const auto bias = given(bias_argument);
    // Kept as values, not saved variables: frozen tensors that nothing changes in place
    // (merging is refused for fp8, and for a Low base it happens outside a step).
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dtype"] = static_cast<std::int64_t>(dtype);
    ctx->saved_data["input_dtype"] = static_cast<std::int64_t>(input.scalar_type());
    return at::linear(input.to(dtype), dequantize(weight, scale, dtype),
                      bias.defined() ? bias.to(dtype) : bias);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    const auto input_dtype = static_cast<c10::ScalarType>(ctx->saved_data["input_dtype"].toInt());
    const auto weight = ctx->saved_data["weight"].toTensor();
    const auto& scale_value = ctx->saved_data["scale"];
    const auto scale = scale_value.isTensor() ? scale_value.toTensor() : at::Tensor();
    at::Tensor grad_input;
    if (grads[0].defined()) {
      grad_input = at::matmul(grads[0].to(dtype), dequantize(weight, scale, dtype)).to(input_dtype);
    }
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

/// The dtype a linear layer computes `input` in: autocast's where it is on for the input's
/// device, else the input's own.
inline c10::ScalarType compute_dtype(const at::Tensor& input) {
  const auto device = input.device().type();
  if ((device == c10::DeviceType::CPU || device == c10::DeviceType::CUDA) &&
      at::isFloatingType(input.scalar_type())) {
    const auto state = get_autocast_state(device);
    if (state.enabled) return state.dtype;
  }
  return input.scalar_type();
}

/// lora_A or lora_B: a module with one parameter, "weight" ([rank, in] or [out, rank]), as
/// PEFT's bias-free nn.Linear has it. Not a torch::nn::Linear, whose construction would draw
/// its own initial values from the default generator, which PEFT's sequence does not have here.
class LoraMatrix : public torch::nn::Module {
 public:
  explicit LoraMatrix(const at::Tensor& values) {
    weight = register_parameter("weight", values, /*requires_grad=*/true);
  }
  void pretty_print(std::ostream& stream) const override {
    stream << "mixprec::LoraMatrix(" << weight.size(1) << ", " << weight.size(0) << ")";
  }
  at::Tensor weight;
};

/// A LoRA adapter on one mixprec::nn::Linear (`owner`, which holds lora_A and lora_B as
/// children, and whose train/eval mode switches the dropout).
class LoraAdapter final : public nn::detail::LinearAdapter {
 public:
  LoraAdapter(const torch::nn::Module& owner, std::shared_ptr<LoraMatrix> lora_a,
              std::shared_ptr<LoraMatrix> lora_b,
              double scaling, double dropout, LoraBase base, at::Tensor weight, at::Tensor bias,
              at::Tensor scale)
      : owner_(&owner), lora_a_(std::move(lora_a)), lora_b_(std::move(lora_b)), scaling_(scaling),
        dropout_(dropout), base_(base), weight_(std::move(weight)), bias_(std::move(bias)),
        scale_(std::move(scale)) {}

  at::Tensor forward(const at::Tensor& input, const at::Tensor& weight,
                     const at::Tensor& bias) override {
    nn::detail::check_linear_input("mixprec::nn::Linear with LoRA", input, weight);
    auto result = base_forward(input, weight, bias);
    if (merged_) return result;
    const auto result_dtype = result.scalar_type();
    const auto& a = lora_a_->weight;
    const auto x = input.scalar_type() == a.scalar_type() ? input : input.to(a.scalar_type());
    const auto dropped = dropout_ > 0 ? at::dropout(x, dropout_, owner_->is_training()) : x;
    result = result + at::linear(at::linear(dropped, a), lora_b_->weight) * scaling_;
    return result.to(result_dtype);
  }

  std::vector<at::Tensor> fixed_tensors() const override {
    if (base_ == LoraBase::as_is) return {};
    std::vector<at::Tensor> fixed{weight_};
    if (bias_.defined()) fixed.push_back(bias_);
    if (scale_.defined()) fixed.push_back(scale_);
    return fixed;
  }

  const LoraMatrix& lora_a() const noexcept { return *lora_a_; }
  const LoraMatrix& lora_b() const noexcept { return *lora_b_; }
  double scaling() const noexcept { return scaling_; }
  double dropout() const noexcept { return dropout_; }
  LoraBase base() const noexcept { return base_; }
  /// The fp8 base's scales ([out, 1] or []); undefined for the others.
  const at::Tensor& scale() const noexcept { return scale_; }
  /// Whether the adapter is folded into the base weight (merge_lora), and computes nothing.
  bool merged() const noexcept { return merged_; }
  void set_merged(bool merged) noexcept { merged_ = merged; }

  /// The adapter's update of the weight, scaling * B A, in fp32.
  at::Tensor delta_weight() const {
    return at::matmul(lora_b_->weight.detach().to(at::kFloat), lora_a_->weight.detach().to(at::kFloat)) *
           scaling_;
  }

 private:
  at::Tensor base_forward(const at::Tensor& input, const at::Tensor& weight,
                          const at::Tensor& bias) const {
    if (base_ == LoraBase::as_is) return at::linear(input, weight, bias);
    const auto dtype = compute_dtype(input);
    // A Low base in the dtype of the product: at::linear as it is (autocast casts the input).
    if (!scale_.defined() && weight.scalar_type() == dtype) return at::linear(input, weight, bias);
    return FrozenBaseLinear::apply(input, weight, scale_, bias, dtype);
  }

  const torch::nn::Module* owner_;
  std::shared_ptr<LoraMatrix> lora_a_, lora_b_;
  double scaling_, dropout_;
  LoraBase base_;
  at::Tensor weight_, bias_, scale_;  // the layer's own (for fixed_tensors)
  bool merged_ = false;
};

}  // namespace detail
}  // namespace mixprec
