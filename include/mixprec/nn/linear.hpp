#pragma once
/// mixprec::nn::Linear, a drop-in module: torch::nn::Linear computed as PyTorch's F.linear
/// (at::linear). LibTorch's C++ Linear applies its bias as a second op on inputs of more than 2 dimensions (a matmul, then
/// `output += bias`): outside autocast's op list, so under MixedO1 an fp32 bias is added into a
/// bf16/fp16 product, rounded twice, in a mixed-dtype pass that is slow on the CPU, and the rows
/// of a 3-D batch differ from the same rows as a 2-D batch. at::linear folds the bias into the
/// product, as Python does, so a model ported from Python computes what Python computes:
///
///   mixprec::nn::Linear dense{384, 1536};  // was torch::nn::Linear: same parameters and keys
///

#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <vector>

namespace mixprec::nn {

namespace detail {

/// What apply_lora (lora/apply_lora.hpp) attaches to a Linear: its forward in place of
/// F.linear, and whether it stores the frozen base in a dtype of its own (bf16, fp16, fp8),
/// which no cast of the model may change.
class LinearAdapter {
 public:
  virtual ~LinearAdapter() = default;
  virtual at::Tensor forward(const at::Tensor& input, const at::Tensor& weight,
                             const at::Tensor& bias) = 0;
  /// The layer's own tensors (weight, bias, scale) whose dtype the adapter fixed; none when the
  /// base is kept as it was.
  virtual std::vector<at::Tensor> fixed_tensors() const = 0;
};

/// An Error naming `module` and both widths unless `input`'s last dimension is the layer's.
inline void check_linear_input(const char* module, const at::Tensor& input,
                               const at::Tensor& weight) {
  MIXPREC_CHECK(input.dim() >= 1 && input.size(-1) == weight.size(1), module, "(",
                weight.size(1), ", ", weight.size(0), "): the input of shape ", input.sizes(),
                " must have ", weight.size(1), " features in its last dimension; reshape it, or "
                "build the layer with in_features ", input.dim() >= 1 ? input.size(-1) : 0);
}

/// The input checked, then F.linear: the forward of nn::Linear, and of nn::Float8Linear where
/// it does not compute in fp8.
inline at::Tensor linear(const char* module, const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& bias) {
  check_linear_input(module, input, weight);
  return at::linear(input, weight, bias);
}

}  // namespace detail

/// torch::nn::Linear with the same parameters, init and state_dict keys whose forward is
/// at::linear, PyTorch's F.linear: the bias folded into the product for inputs of any rank, and
/// under autocast cast with the weight (see the top of this header). On 2-D inputs outside
/// autocast both compute the same addmm. An input whose last dimension is not in_features is
/// an Error that says so.
class LinearImpl : public torch::nn::LinearImpl {
 public:
  using torch::nn::LinearImpl::LinearImpl;
  at::Tensor forward(const at::Tensor& input) {
    if (adapter) return adapter->forward(input, weight, bias);
    return detail::linear("mixprec::nn::Linear", input, weight, bias);
  }
  /// The LoRA adapter that mixprec::apply_lora attached (lora.hpp); null: none.
  std::shared_ptr<detail::LinearAdapter> adapter;
};
TORCH_MODULE(Linear);

namespace detail {

/// The tensors of `model` whose dtype an adapter fixed (a frozen base stored in bf16 or fp8):
/// a cast of the model leaves them, a Trainer takes them as they are and never trains them.
inline std::vector<at::Tensor> fixed_dtype_tensors(const torch::nn::Module& model) {
  std::vector<at::Tensor> fixed;
  for (const auto& module : model.modules(/*include_self=*/true)) {
    const auto* linear = dynamic_cast<const LinearImpl*>(module.get());
    if (linear == nullptr || !linear->adapter) continue;
    for (const auto& t : linear->adapter->fixed_tensors()) fixed.push_back(t);
  }
  return fixed;
}

}  // namespace detail

}  // namespace mixprec::nn
