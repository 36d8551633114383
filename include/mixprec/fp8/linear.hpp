#pragma once
/// FP8 training: MixedFP8<Recipe> is MixedO2<BFloat16> whose mixprec::nn::Float8Linear layers
/// compute their three matrix products in float8, each operand with its own fp32 scale:
///
///   forward      output      = input (e4m3)       @ weight^T (e4m3)
///   backward     grad_input  = grad_output (e5m2) @ weight   (e4m3)
///                grad_weight = grad_output^T (e5m2) @ input  (e4m3)
///
/// e4m3 (max 448, 3 mantissa bits) for values, e5m2 (max 57344, 2 bits) for gradients, as
/// torchao and Transformer Engine do. An operand x goes to fp8 as saturate(x * scale), with
/// scale = fp8_max / amax; the product undoes both scales in fp32 and is rounded once to the
/// output dtype (bf16), the bias added after. The rest of the model computes in bf16, with fp32
/// master weights and no loss scaler (the per-tensor scales do its job). Declare the linear
/// layers that should run in fp8 as mixprec::nn::Float8Linear (torch::nn::Linear's parameters,
/// initialization and state_dict keys; under other policies it computes as mixprec::nn::Linear):
///
///   struct Block : torch::nn::Module {
///     mixprec::nn::Float8Linear fc1{512, 2048}, fc2{2048, 512};
///     ...
///   };
///   mixprec::Trainer<mixprec::MixedFP8<>> trainer(model, optimizer);            // tensorwise
///   mixprec::Trainer<mixprec::MixedFP8<mixprec::DelayedScaling<>>> delayed(...);  // TE's recipe
///
/// A precision map keeps chosen layers out of fp8 (`.add("head", Precision::low)`: bf16), as
/// torchao's module_filter_fn does. docs/fp8.md has the formats, recipes and numerics.
///
/// The matrix products: on CUDA, at::_scaled_mm where every dimension is a multiple of 16
/// (cuBLASLt's rule); elsewhere, and on the CPU, emulated as torchao's emulate=True does (the fp8
/// operands dequantized to fp32, an fp32 matrix product, one rounding): bit for bit torchao's on
/// the CPU. LibTorch's own CPU _scaled_mm is never used: it goes to a oneDNN path that took
/// ~12,000x fp32's time on a Xeon (docs/fp8.md).

#include <mixprec/core/compat.hpp>
#include <mixprec/core/autograd_function.hpp>
#include <mixprec/precision/model_cast.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/nn/conv.hpp>
#include <mixprec/core/policy.hpp>
#include <mixprec/precision/precision_map.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
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

/// Dynamic tensorwise scaling (torchao's default): each operand's scale from its own amax, at
/// each use. Nothing to keep between steps; an outlier in a tensor coarsens that tensor only.
struct TensorwiseScaling {
  static constexpr bool delayed = false;
  static constexpr int history = 0;
  static constexpr int margin = 0;
  static constexpr std::string_view policy_name = "MixedFP8<TensorwiseScaling>";
};

/// Delayed scaling (Transformer Engine's DelayedScaling, amax_compute_algo "max"): each operand
/// of each layer keeps the amaxes of its last `History` optimizer steps; a step uses the scale
/// fp8_max / max(history) / 2^Margin computed after the step before (1 until a nonzero amax was
/// seen), so values beyond the history's range saturate at fp8_max. An inf/NaN amax skips the
/// step, and the history does not take it.
template <int History = 16, int Margin = 0>
struct DelayedScaling {
  static_assert(History >= 1, "mixprec: DelayedScaling's History must be at least 1");
  static_assert(Margin >= 0 && Margin < 64, "mixprec: DelayedScaling's Margin must be in [0, 64)");
  static constexpr bool delayed = true;
  static constexpr int history = History;
  static constexpr int margin = Margin;
  static constexpr std::string_view policy_name = "MixedFP8<DelayedScaling>";
};

namespace detail {
template <class R>
inline constexpr bool fp8_recipe = requires {
  typename std::bool_constant<R::delayed>;
  typename std::integral_constant<int, R::history>;
  typename std::integral_constant<int, R::margin>;
};
}  // namespace detail

/// MixedO2<BFloat16> with its Float8Linear layers in fp8 (see the top of this header).
/// Needs LibTorch >= 2.5 (has_fp8): under 1.13 naming it fails to compile.
template <class Recipe = TensorwiseScaling>
struct MixedFP8 : MixedO2<at::BFloat16> {
  static_assert(has_fp8 || detail::dependent_false<Recipe>,
                "mixprec: MixedFP8 needs LibTorch >= 2.5 (the float8 dtypes and at::_scaled_mm); "
                "this LibTorch is older: use mixprec::MixedO2<at::BFloat16>");
  static_assert(detail::fp8_recipe<Recipe>,
                "mixprec: MixedFP8's recipe must be mixprec::TensorwiseScaling or "
                "mixprec::DelayedScaling<History, Margin>");
  static constexpr std::string_view name = Recipe::policy_name;
  using recipe = Recipe;  // MixedO2<BFloat16>'s settings otherwise (its scaler: NoScaler)
};

/// The three operands of a Float8Linear, in the order of Fp8Operands.
enum class Fp8Role { input, weight, grad_output };

/// One operand in fp8: `data` (e4m3 or e5m2) is saturate(x * scale); `scale` a 0-dim fp32.
struct Fp8Tensor {
  at::Tensor data;
  at::Tensor scale;
};

/// A layer's fp8 operands of one training step (Float8LinearImpl::keep_operands), for checking
/// against another implementation.
struct Fp8Operands {
  Fp8Tensor input, weight, grad_output;
};

namespace detail {

inline c10::ScalarType fp8_dtype(Fp8Role role) {
  return role == Fp8Role::grad_output ? float8_e5m2 : float8_e4m3;
}
inline double fp8_max(Fp8Role role) { return role == Fp8Role::grad_output ? 57344.0 : 448.0; }
inline const char* role_name(Fp8Role role) {
  return role == Fp8Role::input ? "input" : role == Fp8Role::weight ? "weight" : "grad_output";
}

/// fp8_max / amax / 2^margin, computed in fp64 and rounded to fp32 (as torchao), with amax
/// clamped to 1e-12 (an all-zero tensor gets a large finite scale, not inf).
inline at::Tensor scale_from_amax(const at::Tensor& amax, double max, int margin = 0) {
  auto scale = max / amax.to(at::kDouble).clamp_min(1e-12);
  if (margin != 0) scale = scale / static_cast<double>(std::int64_t{1} << margin);
  return scale.to(at::kFloat);
}

/// max |x| as a 0-dim fp32 tensor (NaN if x holds one), in one pass over x.
inline at::Tensor abs_max(const at::Tensor& x) {
  const auto [low, high] = at::aminmax(x);
  return at::maximum(low.abs(), high.abs()).to(at::kFloat);
}

/// saturate(x * scale) in fp8: the product in fp32, clamped to +-fp8_max (NaN stays NaN), rounded
/// to nearest even.
inline Fp8Tensor quantize(const at::Tensor& x, const at::Tensor& scale, Fp8Role role) {
  const double max = fp8_max(role);
  auto scaled = x.scalar_type() == at::kFloat ? x * scale : x.to(at::kFloat).mul_(scale);
  return {scaled.clamp_(-max, max).to(fp8_dtype(role)), scale};
}

/// x8 / scale in fp32, in x8's layout: what torchao's emulation computes (x8.float() / scale). On
/// the CPU through a table of the 256 codes, each divided once by the scale (every code is exact
/// in fp32, so the values are the same): one read per element, where LibTorch's fp8-to-fp32
/// conversion and the division took 4x an fp32 product's overhead at 1024^2 (bench_fp8).
inline at::Tensor dequantize(const Fp8Tensor& x) {
  const auto& data = x.data;
  if (!data.device().is_cpu()) return data.to(at::kFloat) / x.scale;
  if (!data.is_contiguous()) {
    if (data.dim() == 2 && data.t().is_contiguous()) return dequantize({data.t(), x.scale}).t();
    return dequantize({data.contiguous(), x.scale});
  }
  std::array<float, 256> values{};
  const float scale = x.scale.item<float>();
  for (int code = 0; code < 256; ++code) {
    values[code] = float8_value(data.scalar_type(), static_cast<std::uint8_t>(code)) / scale;
  }
  auto out = at::empty(data.sizes(), data.options().dtype(at::kFloat));
  const auto* in = static_cast<const std::uint8_t*>(data.data_ptr());
  auto* result = out.data_ptr<float>();
  at::parallel_for(0, data.numel(), 1 << 16, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) result[i] = values[in[i]];
  });
  return out;
}

/// a @ b / (scale_a * scale_b) in out_dtype, for a [M, K] and b [K, N] in any layout.
inline at::Tensor fp8_mm(const Fp8Tensor& a, const Fp8Tensor& b, c10::ScalarType out_dtype) {
  const bool aligned = a.data.size(0) % 16 == 0 && a.data.size(1) % 16 == 0 &&
                       b.data.size(1) % 16 == 0;
  if (a.data.is_cuda() && aligned) {
    // cuBLASLt: the first operand row-major, the second column-major.
    const auto row_major = a.data.is_contiguous() ? a.data : a.data.contiguous();
    const auto column_major = b.data.t().is_contiguous() ? b.data : b.data.t().contiguous().t();
    return scaled_mm(row_major, column_major, a.scale.reciprocal(), b.scale.reciprocal(), out_dtype);
  }
  // Emulated as torchao's emulate=True and LibTorch's CPU _scaled_mm without oneDNN do: the
  // operands dequantized to fp32 (x8 / scale, one rounding each), an fp32 product, one rounding
  // to out_dtype. _scaled_mm on a GPU applies the scales after the fp32 sum instead: the
  // difference is the rounding of the dequantized operands, 2^-24 relative.
  return at::mm(dequantize(a), dequantize(b)).to(out_dtype);
}

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
      fp8_->set_recording(at::GradMode::is_enabled());  // Function::apply turns grad off
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
  void watch_fp8(mixprec::detail::Fp8Watch& watch, const at::Tensor& input, at::Tensor& out) {
    if (!at::isFloatingType(input.scalar_type())) return;
    watch.add(this, Fp8Role::input, input);
    watch.add(this, Fp8Role::weight, weight);
    if (out.requires_grad()) {
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
