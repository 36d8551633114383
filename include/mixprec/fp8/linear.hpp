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
/// (cuBLASLt's rule); elsewhere, and on the CPU, emulated as torchao's emulate=True does (the fp8
/// operands dequantized to fp32, an fp32 matrix product, one rounding): bit for bit torchao's on
/// the CPU. LibTorch's own CPU _scaled_mm is never used: it goes to a oneDNN path that took
/// ~12,000x fp32's time on a Xeon (docs/fp8.md).

#include <mixprec/core/compat.hpp>
#include <mixprec/fp8/quantize.hpp>
#include <mixprec/fp8/recipes.hpp>
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
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec {

namespace detail {

/// The fp8 state of one Float8Linear under one Trainer: per operand, the amax of the step in
/// progress and, for delayed scaling, the amax history and the scale it gives.
class Fp8LayerState : public torch::CustomClassHolder {
 public:
  struct Slot {
    at::Tensor pending;  // this step's amax (max over its micro-batches); undefined: none yet
    at::Tensor history;  // delayed: [History] fp32, newest first
    at::Tensor scale;    // delayed: the scale this step uses
  };

  Fp8LayerState(bool delayed, int history, int margin) : delayed_(delayed), margin_(margin) {
    for (auto& slot : slots_) {
      if (delayed_) {
        slot.history = at::zeros({history}, at::kFloat);
        slot.scale = at::ones({}, at::kFloat);
      }
    }
  }

  /// Whether the forward pass about to run records its amaxes: one with grad (a training
  /// step's); backward always does.
  void set_recording(bool on) noexcept { recording_ = on; }

  /// x in fp8 for `role`, its amax counted toward this step's where recorded.
  Fp8Tensor cast(Fp8Role role, const at::Tensor& x) {
    auto& slot = slots_[static_cast<int>(role)];
    const bool record = recording_ || role == Fp8Role::grad_output;
    at::Tensor scale;
    if (!delayed_ || record) {
      const auto amax = abs_max(x);
      if (record) slot.pending = slot.pending.defined() ? at::maximum(slot.pending, amax) : amax;
      if (!delayed_) scale = scale_from_amax(amax, fp8_max(role));
    }
    if (delayed_) {
      if (slot.scale.device() != x.device()) move_to(x.device());
      scale = slot.scale;
    }
    auto result = quantize(x, scale, role);
    if (keep_operands_ && !kept_[static_cast<int>(role)]) {
      kept_[static_cast<int>(role)] = true;
      auto& kept = role == Fp8Role::input    ? operands_.input
                   : role == Fp8Role::weight ? operands_.weight
                                             : operands_.grad_output;
      kept = {result.data.clone(), result.scale.clone()};
    }
    return result;
  }

  /// This step's amaxes (undefined if no fp8 product ran).
  at::Tensor pending_amaxes() const {
    std::vector<at::Tensor> amaxes;
    for (const auto& slot : slots_) {
      if (slot.pending.defined()) amaxes.push_back(slot.pending.reshape({1}));
    }
    return amaxes.empty() ? at::Tensor() : at::cat(amaxes);
  }

  /// After the optimizer step: a step taken puts its amaxes into the histories and updates the
  /// scales (delayed); a skipped one drops them.
  void finish_step(bool stepped) {
    for (auto& slot : slots_) {
      if (delayed_ && stepped && slot.pending.defined()) {
        slot.history = at::roll(slot.history, 1);
        slot.history[0].copy_(slot.pending);
        const auto amax = slot.history.max();
        slot.scale = at::where(amax > 0, scale_from_amax(amax, fp8_max(role_of(slot)), margin_),
                               slot.scale);
      }
      slot.pending = at::Tensor();
    }
  }

  bool delayed() const noexcept { return delayed_; }
  int margin() const noexcept { return margin_; }
  const Slot& slot(Fp8Role role) const { return slots_[static_cast<int>(role)]; }
  Slot& slot(Fp8Role role) { return slots_[static_cast<int>(role)]; }

  void keep_operands() {
    keep_operands_ = true;
    kept_ = {};
  }
  const Fp8Operands& operands() const noexcept { return operands_; }

 private:
  Fp8Role role_of(const Slot& slot) const {
    return static_cast<Fp8Role>(&slot - slots_.data());
  }
  void move_to(c10::Device device) {
    for (auto& slot : slots_) {
      slot.history = slot.history.to(device);
      slot.scale = slot.scale.to(device);
    }
  }

  bool delayed_;
  int margin_;
  bool recording_ = false;
  std::array<Slot, 3> slots_;
  bool keep_operands_ = false;
  std::array<bool, 3> kept_{};
  Fp8Operands operands_;
};

/// The fp8 matrix products of a linear layer, with their backward (see the top of the header).
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

/// What advise() sees of the Float8Linear layers in its fp32 steps: each operand's range against
/// its fp8 format under tensorwise scaling (its amax mapped to the format's max).
class Fp8Watch {
 public:
  struct Operand {
    double amax = 0;            // the largest |x| seen
    std::int64_t nonzero = 0;   // nonzero elements seen
    std::int64_t flushed = 0;   // of which would round to 0 in fp8 after scaling
    std::int64_t subnormal = 0; // of which would be subnormal (fewer mantissa bits)
  };
  using Operands = std::array<Operand, 3>;

  void add(const void* layer, Fp8Role role, const at::Tensor& x) {
    const at::NoGradGuard no_grad;
    const auto magnitude = x.detach().abs().to(at::kFloat);
    const double amax = magnitude.max().item<double>();
    if (!std::isfinite(amax)) return;  // advise() reports inf/NaN itself
    // Smallest subnormal and normal magnitudes: e4m3 2^-9 and 2^-6, e5m2 2^-16 and 2^-14.
    const bool e5m2 = role == Fp8Role::grad_output;
    const double tiny = std::ldexp(1.0, e5m2 ? -16 : -9), normal = std::ldexp(1.0, e5m2 ? -14 : -6);
    const double scale = amax > 0 ? fp8_max(role) / amax : 0.0;
    const auto nonzero = magnitude > 0;
    std::lock_guard<std::mutex> lock(mutex_);
    auto& o = layers_[layer][static_cast<int>(role)];
    o.amax = std::max(o.amax, amax);
    o.nonzero += nonzero.sum().item<std::int64_t>();
    o.flushed += (nonzero & (magnitude * scale < tiny / 2)).sum().item<std::int64_t>();
    o.subnormal += (nonzero & (magnitude * scale < normal)).sum().item<std::int64_t>();
  }

  const Operands* find(const void* layer) const {
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
  std::unordered_map<const void*, Operands> layers_;
};

}  // namespace detail

namespace nn {

/// torch::nn::Linear (the same parameters, initialization and state_dict keys) that computes in
/// fp8 under a Trainer<MixedFP8<...>>, and as mixprec::nn::Linear (F.linear) under every other
/// policy. A checkpoint of either loads into the other. An input of the wrong width is an Error.
class Float8LinearImpl : public torch::nn::LinearImpl, public mixprec::detail::MappableBase {
 public:
  Float8LinearImpl(std::int64_t in_features, std::int64_t out_features)
      : torch::nn::LinearImpl(in_features, out_features) {}
  explicit Float8LinearImpl(const torch::nn::LinearOptions& linear_options)
      : torch::nn::LinearImpl(linear_options) {}

  at::Tensor forward(const at::Tensor& input) {
    return mixprec::detail::forward_in_region(region_, input, [this](const at::Tensor& x) {
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
      auto out = mixprec::detail::Fp8LinearFunction::apply(x, weight, fp8_);
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
