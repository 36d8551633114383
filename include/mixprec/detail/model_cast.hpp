#pragma once
// Casting a model's parameters and buffers to a policy's low dtype, module by module, so that
// BatchNorm can stay fp32 (LibTorch's batch_norm takes bf16/fp16 input with fp32 weights and
// running statistics; layer_norm and group_norm do not on the CPU of LibTorch 1.13).

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>

namespace mixprec::detail {

inline bool is_batch_norm(const torch::nn::Module& module) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module) != nullptr;
}

/// Casts every floating parameter and buffer of `model` to `dtype`, except BatchNorm's when
/// `keep_batch_norm_fp32`. Tensors keep their identity (set_data), so optimizers built on
/// model->parameters() still point at them.
inline void cast_model(torch::nn::Module& model, at::ScalarType dtype, bool keep_batch_norm_fp32) {
  for (const auto& module : model.modules(/*include_self=*/true)) {
    if (keep_batch_norm_fp32 && is_batch_norm(*module)) continue;
    for (auto& item : module->named_parameters(/*recurse=*/false)) {
      auto& p = item.value();
      if (at::isFloatingType(p.scalar_type())) p.set_data(p.data().to(dtype));
    }
    for (auto& item : module->named_buffers(/*recurse=*/false)) {
      auto& b = item.value();
      if (at::isFloatingType(b.scalar_type())) b.set_data(b.data().to(dtype));
    }
  }
}

}  // namespace mixprec::detail
