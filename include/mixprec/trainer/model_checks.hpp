#pragma once
// What a Trainer<P> takes: each parameter's dtype and device, at construction and for the
// tensors a param group adds later. fp32, or, under PureHalf, already in its Low dtype where the
// policy would cast it (takes_low_model). Checks only: an Error says what to change.

#include <mixprec/core/error.hpp>
#include <mixprec/core/state_storage.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/nn/linear.hpp>
#include <mixprec/precision/model_cast.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <string>
#include <vector>

namespace mixprec::detail {

/// PureHalf takes a model built in its Low dtype as well as an fp32 one: its Low weights are all
/// it keeps (stochastic rounding keeps nothing more), so the cast's result and a model cast
/// before it are the same state. MixedO2's masters would start from the rounded values.
template <class P>
inline constexpr bool takes_low_model =
    P::cast_model && (storage_of<P>::masters == MasterStorage::none ||
                      storage_of<P>::masters == MasterStorage::stochastic);

template <class P>
void check_parameter_device(const std::string& name, const c10::Device& device) {
  MIXPREC_CHECK(device.is_cpu() || device.is_cuda(), "parameter '", name, "' is on ", device,
                ", but Trainer<", P::name, "> trains CPU and CUDA tensors (autocast and the "
                "loss scaler know no other device): move the model with ->to(torch::kCPU) or "
                "->to(torch::kCUDA)");
}

/// Every parameter of `model` is fp32 (or P's Low dtype, as takes_low_model says) and on the
/// CPU or a CUDA device.
template <class P>
void check_model_dtypes(const torch::nn::Module& model) {
  const auto kept_fp32 = identities(parameters_kept_fp32(model, P::keep_batch_norm_fp32));
  // A frozen LoRA base stored in bf16, fp16 or fp8 is taken as it is (never trained or cast).
  const auto fixed = identities(nn::detail::fixed_dtype_tensors(model));
  for (const auto& item : model.named_parameters()) {
    const auto dtype = item.value().scalar_type();
    if (fixed.count(item.value().unsafeGetTensorImpl()) == 1) {
      check_parameter_device<P>(item.key(), item.value().device());
      continue;
    }
    if constexpr (takes_low_model<P>) {
      // PureHalf: a model built in its Low dtype (Python's model.to(torch.bfloat16)) is what
      // the cast would make of it, where the policy casts it.
      if (dtype == P::low_dtype) {
        MIXPREC_CHECK(kept_fp32.count(item.value().unsafeGetTensorImpl()) == 0, "parameter '",
                      item.key(), "' is ", dtype, ", but its module trains in fp32 under "
                      "Trainer<", P::name, "> (the precision map keeps it so): build that "
                      "module in fp32, or leave it out of the map");
        check_parameter_device<P>(item.key(), item.value().device());
        continue;
      }
    }
    if (at::isFloatingType(dtype) && dtype != at::kFloat) {
      if (const auto cast_by = CastRecord::policy_of(item.value())) {
        fail("parameter '", item.key(), "' is ", dtype, " because an earlier Trainer<",
             *cast_by, "> cast this model (a Trainer casts its model in place, and it stays "
             "cast after that Trainer is gone). Keep training with one Trainer (assign a new "
             "optimizer to its optimizer to change the learning rate or reset the state: it "
             "adopts it), or give the new Trainer an fp32 model: keep the first Trainer's "
             "fp32_state_dict() (its exact fp32 weights) before it goes, and load it into "
             "the model after model->to(torch::kFloat)");
      }
      fail("parameter '", item.key(), "' is ", dtype, ", but Trainer<", P::name, "> expects "
           "an fp32 model and casts it itself: build the model in fp32 (drop the ->to(",
           dtype, "))");
    }
    check_parameter_device<P>(item.key(), item.value().device());
  }
}

/// No tensor of `optimizer` is a frozen LoRA base stored in a dtype of its own (bf16, fp8): it
/// would get fp32 masters and moments, or be stepped in fp8.
inline void check_fixed_untrained(const torch::nn::Module& model,
                                  const std::vector<at::Tensor>& trained) {
  const auto fixed = identities(nn::detail::fixed_dtype_tensors(model));
  if (fixed.empty()) return;
  for (const auto& item : model.named_parameters()) {
    if (fixed.count(item.value().unsafeGetTensorImpl()) == 0) continue;
    for (const auto& t : trained) {
      MIXPREC_CHECK(!t.is_same(item.value()), "the optimizer holds '", item.key(), "', the "
                    "frozen base of a LoRA layer stored in ", item.value().scalar_type(),
                    ", which is not trained: build the optimizer on "
                    "mixprec::trainable_parameters(model) (the adapters and the modules left "
                    "trainable)");
    }
  }
}

/// The model tensors a param group added after construction: fp32, or P's Low dtype.
template <class P>
void check_added_dtypes(const std::vector<at::Tensor>& fresh) {
  for (const auto& p : fresh) {
    const auto dtype = p.scalar_type();
    MIXPREC_CHECK(dtype == at::kFloat || (P::cast_model && dtype == P::low_dtype), "the "
                  "optimizer holds a ", dtype, " tensor of shape ", p.sizes(), ", but Trainer<",
                  P::name, "> trains fp32 tensors and casts them itself: register it in fp32");
  }
}

}  // namespace mixprec::detail
