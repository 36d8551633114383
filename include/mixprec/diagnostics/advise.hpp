#pragma once
/// mixprec::advise: a few fp32 steps of the user's own loss function, watched op by op, and what
/// they say about each precision: which layers fp16 and bf16 can hold, the loss scales at which
/// fp16 keeps the gradients, which layers to keep in fp32, and the policy to start with.
///
///   auto advice = mixprec::advise(model, [&] { return loss_of(model, next_batch()); });
///   std::cout << advice;                           // the table, the verdicts, the reasons
///   advice.require<mixprec::MixedO2<at::Half>>();  // an Error naming the layers fp16 breaks
///
/// advise() changes nothing: parameters, gradients, buffers (BatchNorm's running statistics)
/// and the RNG states are as they were. The model must still be fp32 (call it before a Trainer
/// casts the model). Layers are the modules whose parameters an op reads (at::linear reading
/// fc.weight is layer "fc"); an op that reads none is named by the user's NamedScope around it,
/// or else by itself ("aten::softmax"). docs/diagnostics.md explains the thresholds.

#include <mixprec/core/autocast.hpp>
#include <mixprec/core/capabilities.hpp>
#include <mixprec/core/concepts.hpp>
#include <mixprec/core/compat.hpp>
#include <mixprec/core/rng_states.hpp>
#include <mixprec/diagnostics/non_finite.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/fp8/linear.hpp>
#include <mixprec/nn/conv.hpp>
#include <mixprec/core/policy.hpp>
#include <mixprec/precision/precision_map.hpp>
#include <mixprec/scaling/scalers.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/arg.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iomanip>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace mixprec {

/// Settings of advise().
struct AdviseOptions {
  /// loss_fn calls, each a forward and a backward pass in fp32 (no optimizer step).
  TORCH_ARG(std::int64_t, steps) = 3;
  /// A layer is fp16-safe when its largest activation times this stays within fp16's 65504
  /// (room for the weights to grow), and the loss scales offered keep its largest gradient
  /// times this within it (room for the partial sums of the gradients' reductions).
  TORCH_ARG(double, headroom) = 8.0;
  /// The fraction of a layer's nonzero activations, or gradient elements, that may fall below
  /// fp16's smallest subnormal (2^-24, scaled by the loss scale for gradients) and be lost.
  TORCH_ARG(double, underflow_tolerance) = 1e-3;
  /// The fraction of an fp8 operand's nonzero elements (a Float8Linear's input, weight or
  /// output gradient) that may round to 0 under tensorwise scaling, where its largest |x| maps
  /// to e4m3's 448 (e5m2's 57344 for gradients): below 2^-10 (2^-17) after scaling.
  TORCH_ARG(double, fp8_underflow_tolerance) = 1e-2;
};

/// What the fp32 steps showed of one fp8 operand of a Float8Linear, under tensorwise scaling.
struct Fp8OperandAdvice {
  double amax = 0.0;       ///< the largest |x|, which the scale maps to the format's max
  double flushed = 0.0;    ///< fraction of its nonzero elements that would round to 0
  double subnormal = 0.0;  ///< fraction that would be subnormal (fewer than 3 or 2 mantissa bits)
};

/// Whether MixedFP8 can hold one mixprec::nn::Float8Linear.
struct Fp8LayerAdvice {
  std::string name;  ///< its named_modules() path
  Fp8OperandAdvice input, weight, grad_output;  ///< e4m3, e4m3, e5m2
  bool fp8 = true;   ///< no operand loses more than AdviseOptions::fp8_underflow_tolerance to 0
  std::string reason;  ///< why not, when not
};

/// What the fp32 steps showed of one layer.
struct LayerAdvice {
  std::string name;                 ///< module path ("block.fc2"), NamedScope, or op name
  std::int64_t activations = 0;     ///< output elements seen (all steps)
  double activation_max = 0.0;      ///< the largest |output|
  double activation_tiny = 0.0;     ///< fraction of nonzero outputs below 2^-24 (0 in fp16)
  std::int64_t gradients = 0;       ///< gradient elements of its parameters (all steps)
  double gradient_max = 0.0;        ///< the largest |gradient| of its parameters
  double gradient_min = 0.0;        ///< the smallest nonzero |gradient| (0: none)
  /// log2 of the loss scales at which fp16 holds its gradients: the largest without overflow,
  /// the smallest that keeps all but underflow_tolerance of them (no gradients: no bounds).
  std::optional<int> scale_log2_min, scale_log2_max;
  bool non_finite = false;          ///< the fp32 run itself produced inf/NaN here
  bool fp16 = true;                 ///< fp16 holds its activations and gradients
  bool bf16 = true;                 ///< bf16 holds its activations
  bool fp16_outputs = true;         ///< fp16 holds its activations (fp16 may still fail on gradients)
  bool module = false;              ///< a module of the model (its name a named_modules() path)
  std::string fp16_reason, bf16_reason;  ///< why not, when not
};

/// The result of advise().
struct Advice {
  std::int64_t steps = 0;           ///< the fp32 steps run
  c10::DeviceType device = c10::DeviceType::CPU;
  std::vector<LayerAdvice> layers;  ///< in the order the forward pass first used them
  bool fp32_finite = true;          ///< no inf/NaN in the fp32 run itself
  bool fp16_safe = true;            ///< every layer fits fp16, and one loss scale fits them all
  bool bf16_safe = true;            ///< every layer fits bf16
  /// The loss scales (powers of 2) at which fp16 holds every layer's gradients; both 0 if none.
  double init_scale_min = 0.0, init_scale_max = 0.0;
  /// PyTorch's 65536 moved into [init_scale_min, init_scale_max]; 0 when that is empty.
  double init_scale = 0.0;
  std::string recommended;          ///< a policy type, e.g. "MixedO2<BFloat16>"
  std::vector<std::string> reasons; ///< why that policy, and what to watch
  /// On a CPU whose fp16 convolution weight gradients are oneDNN's reference loop
  /// (CpuCapabilities::fp16_conv_weight_grad_slow): the model's convolutions that would take it.
  std::vector<std::string> slow_fp16_convolutions;
  /// The model's mixprec::nn::Float8Linear layers (those that ran), and whether fp8 holds each.
  std::vector<Fp8LayerAdvice> fp8_layers;

  /// The PrecisionMap (for MixedFP8) that keeps in bf16 the Float8Linear layers fp8 cannot hold.
  PrecisionMap fp8_precision_map() const {
    PrecisionMap map;
    for (const auto& layer : fp8_layers) {
      if (!layer.fp8) map.add(layer.name, Precision::low);
    }
    return map;
  }

  /// The layers to keep in fp32 to train in `low` (at::kHalf or at::kBFloat16).
  std::vector<std::string> keep_fp32(c10::ScalarType low) const {
    std::vector<std::string> result;
    for (const auto& layer : layers) {
      if (low == c10::ScalarType::Half ? !layer.fp16 : !layer.bf16) result.push_back(layer.name);
    }
    return result;
  }

  /// The PrecisionMap that keeps in fp32 the modules `low` (at::kHalf or at::kBFloat16) cannot
  /// hold. A module whose outputs `low` cannot hold keeps them in fp32 (Output::own), and the
  /// next module the forward pass used reads them in fp32 too and hands its own back in `low`
  /// (it is taken as their reader: check it for a model whose data flow branches). Op names,
  /// NamedScopes and the model's own parameters ("(model)") are not submodules and are left out.
  /// Apply it to a model whose modules it names are mixprec::nn::Mappable (apply_precision_map
  /// says which are not).
  PrecisionMap precision_map(c10::ScalarType low) const {
    PrecisionMap map;
    bool reads_fp32 = false;  // the previous module left its outputs in fp32
    for (const auto& layer : layers) {
      if (!layer.module || layer.name.empty() || layer.name.front() == '(') continue;
      const bool half = low == c10::ScalarType::Half;
      const bool holds = half ? layer.fp16 : layer.bf16;
      // bf16 fails on outputs alone (beyond its range, or inf/NaN already in fp32).
      const bool outputs_fit = half ? layer.fp16_outputs && !layer.non_finite : layer.bf16;
      if (!holds || reads_fp32) {
        map.keep_fp32(layer.name, outputs_fit ? Output::surroundings : Output::own);
      }
      reads_fp32 = !outputs_fit;
    }
    return map;
  }

  /// Whether the fp32 steps allow policy P as it is (no layer kept in fp32): its low dtype must
  /// hold every layer; for Half, a scaler must exist whose scale fits the gradients (for a
  /// policy without a dynamic scaler, scale 1).
  template <class P>
  bool accepts() const {
    return reason_against<P>().empty();
  }

  /// An Error unless accepts<P>(), saying which layers break and what to use instead.
  template <class P>
  void require() const {
    const auto why = reason_against<P>();
    MIXPREC_CHECK(why.empty(), "advise(): ", P::name, " is not safe for this model: ", why,
                  ". Recommended: ", recommended, " (", reasons.empty() ? "" : reasons.front(),
                  ")");
  }

 private:
  template <class P>
  std::string reason_against() const {
    static_assert(require_policy<P>);
    std::ostringstream why;
    if (!fp32_finite) {
      why << "the fp32 run itself produced inf/NaN";
      return why.str();
    }
    if constexpr (P::low_dtype == c10::ScalarType::Float) {
      return "";
    } else {
      constexpr bool half = P::low_dtype == c10::ScalarType::Half;
      const auto keep = keep_fp32(P::low_dtype);
      if (!keep.empty()) {
        why << "layer" << (keep.size() == 1 ? " " : "s ");
        for (std::size_t i = 0; i < keep.size(); ++i) {
          const auto& layer = *std::find_if(layers.begin(), layers.end(),
                                            [&](const LayerAdvice& l) { return l.name == keep[i]; });
          why << (i ? "; " : "") << "'" << layer.name << "' ("
              << (half ? layer.fp16_reason : layer.bf16_reason) << ")";
        }
        return why.str();
      }
      if constexpr (half) {
        if (init_scale_max == 0) {
          why << "no loss scale keeps every layer's gradients within fp16";
        } else if (std::is_same_v<typename P::scaler_type, NoScaler> &&
                   (init_scale_min > 1 || init_scale_max < 1)) {
          why << "it does not scale the loss, but fp16 holds the gradients at loss scales "
              << init_scale_min << " to " << init_scale_max << " only";
        }
      }
      return why.str();
    }
  }
};

namespace detail {

constexpr double kHalfMax = 65504.0;
constexpr double kHalfTiny = 5.9604644775390625e-08;  // 2^-24, fp16's smallest subnormal
constexpr double kBFloat16Max = 3.3895313892515355e38;
constexpr int kExponentMin = -160;  // histogram bins of floor(log2|g|); fp32 spans -149 to 127
constexpr int kExponentBins = 300;

// Watches the ops of the loss function: each outermost op's outputs, by layer.
class LayerRecorder : OpObserver {
 public:
  LayerRecorder(std::unordered_map<const void*, std::string> layer_of,
                const std::vector<at::Tensor>& params)
      : layer_of_(std::move(layer_of)) {
    for (const auto& p : params) {
      storage_of_.insert(p.storage().unsafeGetStorageImpl());
      layer_of_storage_.try_emplace(p.storage().unsafeGetStorageImpl(),
                                    layer_of_.at(p.unsafeGetTensorImpl()));
    }
  }

  struct Activations {
    std::int64_t elements = 0, nonzero = 0, tiny = 0;
    double max = 0.0;
    bool non_finite = false;
  };
  /// In order of first appearance.
  std::vector<std::pair<std::string, Activations>> layers;

 private:
  // Each running op: whether it is outermost, and the layer whose parameters it read.
  struct Running {
    bool outermost = false;
    bool known_inputs = true;
    std::string layer;
  };

  void on_start(const at::RecordFunction& fn) override {
    if (fn.scope() == at::RecordScope::USER_SCOPE) {
      scopes_.emplace_back(fn.name());
      return;
    }
    Running op;
    op.outermost = depth_++ == 0;
    if (op.outermost) {
      const auto inputs = inputs_of(fn);
      op.known_inputs = inputs.has_value();
      for (const auto& t : inputs.value_or(std::vector<at::Tensor>{})) {
        // The parameter itself, or a view of it (F::linear's weight.t() on 3-d input).
        if (const auto it = layer_of_.find(t.unsafeGetTensorImpl()); it != layer_of_.end()) {
          op.layer = it->second;
          break;
        }
        const auto view = layer_of_storage_.find(t.storage().unsafeGetStorageImpl());
        if (view != layer_of_storage_.end()) {
          op.layer = view->second;
          break;
        }
      }
    }
    running_.push_back(std::move(op));
  }

  void on_end(const at::RecordFunction& fn) override {
    if (fn.scope() == at::RecordScope::USER_SCOPE) {
      if (!scopes_.empty()) scopes_.pop_back();
      return;
    }
    if (running_.empty()) return;
    --depth_;
    auto op = std::move(running_.back());
    running_.pop_back();
    if (!op.outermost || allocates_only(fn.name())) return;
    auto outputs = float_tensors(fn.outputs());
    // A parameter's view (F::linear's weight.t()) is a weight, not an activation.
    std::erase_if(outputs, [&](const at::Tensor& t) {
      return storage_of_.count(t.storage().unsafeGetStorageImpl()) > 0;
    });
    if (outputs.empty()) return;
    // Without the inputs (see inputs_of): a parameter the output was computed from directly.
    if (op.layer.empty() && !op.known_inputs) op.layer = layer_in_graph(outputs);
    if (op.layer.empty()) {
      // An op of the model's computation that reads no parameter: its output requires grad.
      // (The data's own ops, such as making the batch, do not.)
      const bool model_op = std::any_of(outputs.begin(), outputs.end(),
                                        [](const at::Tensor& t) { return t.requires_grad(); });
      if (!model_op) return;
      op.layer = scopes_.empty() ? std::string(fn.name()) : scopes_.back();
    }
    auto& a = slot(op.layer);
    quietly([&] {
      for (const auto& t : outputs) {
        const auto v = t.detach().to(at::kFloat).abs();
        const auto finite = at::isfinite(v);
        const auto kept = at::where(finite, v, at::zeros({}, v.options()));
        const auto nonzero = kept.gt(0);
        const auto stats = at::stack({nonzero.sum().to(at::kDouble),
                                      (nonzero & kept.lt(kHalfTiny)).sum().to(at::kDouble),
                                      kept.max().to(at::kDouble),
                                      finite.logical_not().any().to(at::kDouble)})
                               .to(at::kCPU);
        const auto* s = stats.data_ptr<double>();
        a.elements += v.numel();
        a.nonzero += static_cast<std::int64_t>(s[0]);
        a.tiny += static_cast<std::int64_t>(s[1]);
        a.max = std::max(a.max, s[2]);
        a.non_finite = a.non_finite || s[3] != 0;
      }
    });
  }

  // The layer of a parameter whose gradient accumulator is an input of an output's grad_fn,
  // directly or through a view or cast of it (F::linear's weight.t()); "" if none.
  static bool view_or_cast(const torch::autograd::Node& node) {
    const auto name = node.name();
    for (const char* prefix : {"TBackward", "TransposeBackward", "PermuteBackward", "ViewBackward",
                               "UnsafeViewBackward", "ReshapeAliasBackward", "ExpandBackward",
                               "ToCopyBackward", "AliasBackward", "UnsqueezeBackward",
                               "SqueezeBackward"}) {
      if (name.rfind(prefix, 0) == 0) return true;
    }
    return false;
  }
  std::string layer_in_graph(const std::vector<at::Tensor>& outputs) const {
    for (const auto& t : outputs) {
      const auto grad_fn = t.grad_fn();
      if (!grad_fn) continue;
      for (const auto& edge : grad_fn->next_edges()) {
        auto* node = edge.function.get();
        for (int hop = 0; node != nullptr && hop < 2; ++hop) {
          if (const auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
            const auto it = layer_of_.find(acc->variable.unsafeGetTensorImpl());
            if (it != layer_of_.end()) return it->second;
            break;
          }
          if (!view_or_cast(*node) || node->next_edges().empty()) break;
          node = node->next_edges().front().function.get();
        }
      }
    }
    return {};
  }

  Activations& slot(const std::string& layer) {
    for (auto& [name, a] : layers) {
      if (name == layer) return a;
    }
    layers.emplace_back(layer, Activations{});
    return layers.back().second;
  }

  std::unordered_map<const void*, std::string> layer_of_;
  std::unordered_set<const void*> storage_of_;  // the parameters' storages
  std::unordered_map<const void*, std::string> layer_of_storage_;  // their layers
  std::vector<std::string> scopes_;
  std::vector<Running> running_;
  std::int64_t depth_ = 0;
};

// A layer's gradient magnitudes: the largest, the smallest nonzero, and a histogram of
// floor(log2|g|) over the nonzero elements.
struct GradientRecord {
  std::int64_t elements = 0;
  double max = 0.0;
  double min = std::numeric_limits<double>::infinity();
  bool non_finite = false;
  std::vector<std::int64_t> histogram = std::vector<std::int64_t>(kExponentBins, 0);

  void add(const at::Tensor& grad) {
    const auto v = readable(grad).detach().to(at::kFloat).abs().flatten();
    elements += v.numel();
    if (v.numel() == 0) return;
    const auto finite = at::isfinite(v);
    if (!finite.all().item<bool>()) non_finite = true;
    const auto nonzero = v.masked_select(finite & v.gt(0));
    if (nonzero.numel() == 0) return;
    max = std::max(max, nonzero.max().item<double>());
    min = std::min(min, nonzero.min().item<double>());
    const auto exponents = at::floor(at::log2(nonzero.to(at::kDouble)))
                               .clamp(kExponentMin, kExponentMin + kExponentBins - 1)
                               .to(at::kLong) - kExponentMin;
    const auto counts = at::bincount(exponents.to(at::kCPU), {}, kExponentBins);
    const auto* c = counts.data_ptr<std::int64_t>();
    for (int b = 0; b < kExponentBins; ++b) histogram[b] += c[b];
  }

  // The log2 of the smallest scale at which at most `tolerance` of the nonzero elements fall
  // below 2^-24: element in bin e scaled by 2^k is below it iff e + k + 1 <= -24.
  std::optional<int> scale_log2_min(double tolerance) const {
    std::int64_t nonzero = 0;
    for (const auto c : histogram) nonzero += c;
    if (nonzero == 0) return std::nullopt;
    const auto allowed = static_cast<std::int64_t>(tolerance * static_cast<double>(nonzero));
    std::int64_t below = 0;  // elements in bins up to b
    for (int b = 0; b < kExponentBins; ++b) {
      // With k = -25 - e_b, exactly the bins up to b are lost; the smallest k for which the
      // lost ones stay within `allowed` is one past the last bin that breaks it.
      below += histogram[b];
      if (below > allowed) return -25 - (b + kExponentMin) + 1;
    }
    return std::nullopt;
  }

  // The log2 of the largest scale at which max * scale * headroom stays within fp16: the
  // gradients' own reductions (a bias's sum over the batch) pass through larger partial sums.
  std::optional<int> scale_log2_max(double headroom) const {
    if (max == 0) return std::nullopt;
    return static_cast<int>(std::floor(std::log2(kHalfMax / (max * headroom))));
  }
};

inline std::string power_of_two(int k) {
  std::ostringstream out;
  out << "2^" << k;
  return out.str();
}

inline std::string short_number(double x) {
  std::ostringstream out;
  out << std::setprecision(3) << x;
  return out.str();
}

inline void decide(Advice& advice) {
  // One scale for all layers: the largest of their minima, the smallest of their maxima.
  std::optional<int> lo, hi;
  for (const auto& layer : advice.layers) {
    if (layer.scale_log2_min) lo = std::max(lo.value_or(*layer.scale_log2_min), *layer.scale_log2_min);
    if (layer.scale_log2_max) hi = std::min(hi.value_or(*layer.scale_log2_max), *layer.scale_log2_max);
  }
  // fp32's scale must stay a normal number; GradScaler's default starts at 2^16.
  const int low = std::max(lo.value_or(-20), -100);
  const int high = std::min(hi.value_or(40), 100);
  if (low <= high) {
    advice.init_scale_min = std::ldexp(1.0, low);
    advice.init_scale_max = std::ldexp(1.0, high);
    advice.init_scale = std::clamp(65536.0, advice.init_scale_min, advice.init_scale_max);
  }
  for (const auto& layer : advice.layers) {
    advice.fp32_finite = advice.fp32_finite && !layer.non_finite;
    advice.fp16_safe = advice.fp16_safe && layer.fp16;
    advice.bf16_safe = advice.bf16_safe && layer.bf16;
  }
  advice.fp16_safe = advice.fp16_safe && advice.fp32_finite && low <= high;
  advice.bf16_safe = advice.bf16_safe && advice.fp32_finite;
  const auto keep16 = advice.keep_fp32(c10::ScalarType::Half);
  auto list = [](const std::vector<std::string>& names) {
    std::string text;
    for (std::size_t i = 0; i < names.size(); ++i) text += (i ? ", " : "") + names[i];
    return text;
  };
  auto& why = advice.reasons;
  if (!advice.fp32_finite) {
    advice.recommended = std::string(FullPrecision::name);
    std::vector<std::string> bad;
    for (const auto& layer : advice.layers) {
      if (layer.non_finite) bad.push_back(layer.name);
    }
    why.push_back("the fp32 run itself produced inf/NaN (in " + list(bad) +
                  "): no lower precision can help; fix the model, its initialisation or the data");
    return;
  }
  if (!advice.bf16_safe) {
    advice.recommended = std::string(FullPrecision::name);
    why.push_back("activations beyond bf16's range (3.4e38) in " +
                  list(advice.keep_fp32(c10::ScalarType::BFloat16)) +
                  ": only fp32 holds them (or MixedO1<BFloat16> with those layers outside "
                  "autocast)");
    return;
  }
  const bool half_is_fast = advice.device == c10::DeviceType::CUDA;
  if (advice.fp16_safe && half_is_fast) {
    advice.recommended = std::string(MixedO2<at::Half>::name);
    why.push_back("every layer's activations and gradients fit fp16, with a loss scale from " +
                  power_of_two(low) + " to " + power_of_two(high) + " (init_scale " +
                  short_number(advice.init_scale) + "); fp16 keeps 3 more mantissa bits than bf16");
    why.push_back("MixedO2<BFloat16> needs no loss scaling, if the GPU has bf16 (Ampere or later)");
    return;
  }
  advice.recommended = std::string(MixedO2<at::BFloat16>::name);
  if (advice.fp16_safe) {
    why.push_back("bf16 holds every layer; on the CPU bf16 is computed natively and fp16 is not "
                  "(fp16 would also fit, with a loss scale from " + power_of_two(low) + " to " +
                  power_of_two(high) + ")");
    return;
  }
  if (!keep16.empty()) {
    why.push_back("fp16 cannot hold " + list(keep16) + "; bf16 has fp32's range and needs no "
                  "loss scaling");
  } else {
    why.push_back("no single loss scale keeps every layer's gradients within fp16 (from " +
                  power_of_two(lo.value_or(0)) + " up, to at most " + power_of_two(hi.value_or(0)) +
                  "); bf16 has fp32's range and needs no loss scaling");
  }
  why.push_back("to use fp16 anyway: MixedO1<Half> with " +
                (keep16.empty() ? std::string("a loss scale per layer group") : list(keep16)) +
                " outside autocast (mixprec::AutocastGuard(device, at::kHalf, false))");
}

// Restores the model's parameters' gradients, its buffers and the RNG states on exit.
class AdviseStateGuard {
 public:
  explicit AdviseStateGuard(torch::nn::Module& model) {
    for (auto& p : model.parameters()) {
      grads_.emplace_back(p, p.grad().defined() ? p.grad().detach().clone() : at::Tensor());
    }
    for (auto& b : model.buffers()) buffers_.emplace_back(b, b.detach().clone());
  }
  ~AdviseStateGuard() {
    at::NoGradGuard no_grad;
    for (auto& [p, grad] : grads_) p.mutable_grad() = grad;
    for (auto& [b, value] : buffers_) b.copy_(value);
    rngs_.restore();
  }
  AdviseStateGuard(const AdviseStateGuard&) = delete;
  AdviseStateGuard& operator=(const AdviseStateGuard&) = delete;

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> grads_, buffers_;
  RngStates rngs_ = RngStates::capture();
};

}  // namespace detail

/// Runs `loss_fn` (the forward pass, returning the scalar loss, as for Trainer::step)
/// options.steps() times in fp32, backpropagates each loss, and judges each precision from
/// what the layers' activations and gradients reached. Changes nothing of the model.
template <class LossFn>
Advice advise(torch::nn::Module& model, LossFn&& loss_fn, const AdviseOptions& options = {}) {
  MIXPREC_CHECK(options.steps() >= 1, "AdviseOptions::steps must be >= 1, got ", options.steps());
  MIXPREC_CHECK(options.headroom() >= 1 && std::isfinite(options.headroom()),
                "AdviseOptions::headroom must be finite and >= 1, got ", options.headroom());
  MIXPREC_CHECK(options.underflow_tolerance() >= 0 && options.underflow_tolerance() < 1,
                "AdviseOptions::underflow_tolerance must be in [0, 1), got ",
                options.underflow_tolerance());
  MIXPREC_CHECK(options.fp8_underflow_tolerance() >= 0 && options.fp8_underflow_tolerance() < 1,
                "AdviseOptions::fp8_underflow_tolerance must be in [0, 1), got ",
                options.fp8_underflow_tolerance());
  const auto named = model.named_parameters();
  MIXPREC_CHECK(named.size() > 0, "advise(): the model has no parameters");
  // Each tensor's layer: the module path of its first name.
  std::unordered_map<const void*, std::string> layer_of;
  std::vector<std::pair<std::string, at::Tensor>> params;  // each tensor once
  for (const auto& item : named) {
    const auto dtype = item.value().scalar_type();
    MIXPREC_CHECK(!at::isFloatingType(dtype) || dtype == at::kFloat, "advise(): parameter '",
                  item.key(), "' is ", dtype, "; advise() measures the fp32 model: call it before "
                  "a Trainer casts the model, on a model built in fp32");
    const auto layer = detail::module_path(item.key());
    if (layer_of.try_emplace(item.value().unsafeGetTensorImpl(), layer).second) {
      params.emplace_back(layer, item.value());
    }
  }
  const auto device = params.front().second.device().type();

  std::unordered_map<std::string, detail::GradientRecord> gradients;
  std::vector<std::pair<std::string, detail::LayerRecorder::Activations>> activations;
  const auto fp8_watch = std::make_shared<detail::Fp8Watch>();
  {
    struct WatchFp8 {  // the Float8Linear layers report their operands while it is set
      explicit WatchFp8(std::shared_ptr<detail::Fp8Watch> watch) {
        detail::Fp8Watch::current() = std::move(watch);
      }
      ~WatchFp8() { detail::Fp8Watch::current().reset(); }
      WatchFp8(const WatchFp8&) = delete;
      WatchFp8& operator=(const WatchFp8&) = delete;
    } watching(fp8_watch);
    detail::AdviseStateGuard restore(model);
    std::vector<at::Tensor> tensors;
    for (const auto& [layer, p] : params) tensors.push_back(p);
    detail::LayerRecorder recorder(layer_of, tensors);
    for (std::int64_t step = 0; step < options.steps(); ++step) {
      for (auto& [layer, p] : params) {
        if (p.grad().defined()) p.mutable_grad() = at::Tensor();
      }
      at::Tensor loss;
      {
        auto guard = autocast<FullPrecision>(device);
        loss = std::invoke(loss_fn);
      }
      MIXPREC_CHECK(loss.defined() && loss.numel() == 1 && loss.requires_grad(),
                    "advise(): loss_fn must return a scalar loss computed from the model (got ",
                    loss.defined() ? loss.sizes() : at::IntArrayRef{}, ")");
      {
        // The backward pass is not watched: only the parameters' gradients are read.
        at::RecordFunctionGuard off(false);
        loss.backward();
      }
      at::RecordFunctionGuard off(false);  // the reads of the gradients are not the model's
      for (auto& [layer, p] : params) {
        if (p.grad().defined()) gradients[layer].add(p.grad());
      }
    }
    activations = std::move(recorder.layers);
  }

  Advice advice;
  advice.steps = options.steps();
  advice.device = device;
  const double fp16_limit = detail::kHalfMax / options.headroom();
  auto layer_slot = [&](const std::string& name) -> LayerAdvice& {
    for (auto& l : advice.layers) {
      if (l.name == name) return l;
    }
    advice.layers.push_back(LayerAdvice{});
    advice.layers.back().name = name;
    return advice.layers.back();
  };
  for (const auto& [name, a] : activations) {
    auto& layer = layer_slot(name);
    layer.activations = a.elements;
    layer.activation_max = a.max;
    layer.activation_tiny = a.nonzero == 0 ? 0.0 : static_cast<double>(a.tiny) / static_cast<double>(a.nonzero);
    layer.non_finite = a.non_finite;
  }
  for (const auto& [name, p] : params) {  // layers whose parameters no op read keep their place
    (void)p;
    if (gradients.count(name)) (void)layer_slot(name);
  }
  for (auto& layer : advice.layers) {
    layer.module = std::any_of(params.begin(), params.end(),
                               [&](const auto& param) { return param.first == layer.name; });
  }
  for (auto& layer : advice.layers) {
    auto& l = layer;
    if (l.non_finite) {
      l.fp16 = l.bf16 = false;
      l.fp16_reason = l.bf16_reason = "inf/NaN already in fp32";
      continue;
    }
    if (l.activation_max >= detail::kBFloat16Max) {
      l.bf16 = false;
      l.bf16_reason = "|x| reaches " + detail::short_number(l.activation_max) + ", beyond bf16's 3.4e38";
    }
    if (l.activation_max > fp16_limit) {
      l.fp16 = l.fp16_outputs = false;
      l.fp16_reason = "|x| reaches " + detail::short_number(l.activation_max) + ", beyond fp16's " +
                      "65504" + (options.headroom() > 1 ? " / headroom " + detail::short_number(options.headroom()) : "");
    } else if (l.activation_tiny > options.underflow_tolerance()) {
      l.fp16 = l.fp16_outputs = false;
      l.fp16_reason = detail::short_number(100 * l.activation_tiny) +
                      "% of its nonzero outputs are below fp16's 2^-24 and would be 0";
    }
    const auto it = gradients.find(l.name);
    if (it == gradients.end()) continue;
    const auto& g = it->second;
    l.gradients = g.elements;
    l.gradient_max = g.max;
    l.gradient_min = std::isfinite(g.min) ? g.min : 0.0;
    if (g.non_finite) {
      l.non_finite = true;
      l.fp16 = l.bf16 = false;
      l.fp16_reason = l.bf16_reason = "inf/NaN gradients already in fp32";
      continue;
    }
    l.scale_log2_min = g.scale_log2_min(options.underflow_tolerance());
    l.scale_log2_max = g.scale_log2_max(options.headroom());
    if (l.fp16 && l.scale_log2_min && l.scale_log2_max && *l.scale_log2_min > *l.scale_log2_max) {
      l.fp16 = false;
      l.fp16_reason = "no loss scale fits its gradients: from " + detail::short_number(l.gradient_min) +
                      " to " + detail::short_number(l.gradient_max) + " is more than fp16 spans";
    }
  }
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const auto* operands = fp8_watch->find(item.value().get());
    if (operands == nullptr) continue;
    Fp8LayerAdvice layer;
    layer.name = item.key().empty() ? "(model)" : item.key();
    const auto fill = [&](Fp8OperandAdvice& out, Fp8Role role, const char* what, const char* format) {
      const auto& o = (*operands)[static_cast<int>(role)];
      out.amax = o.amax;
      const auto nonzero = static_cast<double>(std::max<std::int64_t>(o.nonzero, 1));
      out.flushed = static_cast<double>(o.flushed) / nonzero;
      out.subnormal = static_cast<double>(o.subnormal) / nonzero;
      if (layer.fp8 && out.flushed > options.fp8_underflow_tolerance()) {
        layer.fp8 = false;
        layer.reason = detail::short_number(100 * out.flushed) + "% of its nonzero " + what +
                       " would round to 0 in " + format + " (their largest, " +
                       detail::short_number(o.amax) + ", sets the scale)";
      }
    };
    fill(layer.input, Fp8Role::input, "inputs", "e4m3");
    fill(layer.weight, Fp8Role::weight, "weights", "e4m3");
    fill(layer.grad_output, Fp8Role::grad_output, "output gradients", "e5m2");
    advice.fp8_layers.push_back(std::move(layer));
  }
  if (advice.device == c10::DeviceType::CPU && cpu_capabilities().fp16_conv_weight_grad_slow) {
    advice.slow_fp16_convolutions = nn::detail::fp16_weight_grad_convolutions(model);
  }
  detail::decide(advice);
  if (!advice.slow_fp16_convolutions.empty()) {
    const auto& cpu = cpu_capabilities();
    std::string names;
    for (const auto& name : advice.slow_fp16_convolutions) names += (names.empty() ? "" : ", ") + name;
    advice.reasons.push_back(
        "fp16 on this CPU (" + cpu.model + ": AVX512-FP16 without AMX-FP16): LibTorch computes "
        "the weight gradients of fp16 convolutions (" + names + ") with oneDNN's reference loop, " +
        detail::fp16_conv_cost(cpu) + "; under a Half "
        "policy declare them mixprec::nn::Conv2d and call mixprec::nn::fp32_conv_weight_grads");
  }
  return advice;
}

/// advise() for a model held by shared_ptr.
template <class LossFn>
Advice advise(const std::shared_ptr<torch::nn::Module>& model, LossFn&& loss_fn,
              const AdviseOptions& options = {}) {
  MIXPREC_CHECK(model != nullptr, "advise() got a null model");
  return advise(*model, std::forward<LossFn>(loss_fn), options);
}

/// advise() for a ModuleHolder such as torch::nn::Sequential.
template <class Impl, class LossFn>
Advice advise(torch::nn::ModuleHolder<Impl>& model, LossFn&& loss_fn,
              const AdviseOptions& options = {}) {
  return advise(*model.ptr(), std::forward<LossFn>(loss_fn), options);
}

/// The table of layers, the verdicts and the recommendation.
inline std::ostream& operator<<(std::ostream& out, const Advice& advice) {
  std::ostringstream text;
  std::size_t width = 5;
  for (const auto& l : advice.layers) width = std::max(width, l.name.size());
  const int w = static_cast<int>(width);
  text << "mixprec::advise: " << advice.steps << " fp32 step" << (advice.steps == 1 ? "" : "s")
       << " on " << c10::DeviceTypeName(advice.device) << "\n  " << std::left << std::setw(w)
       << "layer" << std::right << std::setw(11) << "max |x|" << std::setw(10) << "x<2^-24"
       << std::setw(11) << "max |g|" << std::setw(11) << "min |g|" << std::setw(17)
       << "fp16 loss scale" << "  fp16  bf16\n";
  for (const auto& l : advice.layers) {
    std::string scales = "-";
    if (l.scale_log2_min || l.scale_log2_max) {
      scales = (l.scale_log2_min ? detail::power_of_two(*l.scale_log2_min) : std::string("any")) +
               ".." + (l.scale_log2_max ? detail::power_of_two(*l.scale_log2_max) : std::string("any"));
    }
    std::ostringstream tiny;
    tiny << std::fixed << std::setprecision(2) << 100 * l.activation_tiny << '%';
    text << "  " << std::left << std::setw(w) << l.name << std::right << std::setw(11)
         << (l.activations ? detail::short_number(l.activation_max) : "-") << std::setw(10)
         << (l.activations ? tiny.str() : "-") << std::setw(11)
         << (l.gradients ? detail::short_number(l.gradient_max) : "-") << std::setw(11)
         << (l.gradients ? detail::short_number(l.gradient_min) : "-") << std::setw(17) << scales
         << "  " << std::left << std::setw(6) << (l.fp16 ? "ok" : "fp32") << std::setw(4)
         << (l.bf16 ? "ok" : "fp32") << std::right << '\n';
  }
  for (const auto& l : advice.layers) {
    if (!l.fp16) text << "  keep " << l.name << " in fp32 under fp16: " << l.fp16_reason << '\n';
    if (!l.bf16) text << "  keep " << l.name << " in fp32 under bf16: " << l.bf16_reason << '\n';
  }
  text << "  fp16: " << (advice.fp16_safe ? "safe" : "not safe");
  if (advice.init_scale_max > 0) {
    text << "; loss scales " << advice.init_scale_min << " to " << advice.init_scale_max
         << " hold the gradients (init_scale " << advice.init_scale << ")";
  }
  text << "\n  bf16: " << (advice.bf16_safe ? "safe" : "not safe") << "\n  recommended: "
       << advice.recommended << '\n';
  for (const auto& reason : advice.reasons) text << "    - " << reason << '\n';
  if (!advice.fp8_layers.empty()) {
    // Per operand: its largest |x| / the % of nonzero elements that round to 0 / that are
    // subnormal, with the largest mapped to the format's max (tensorwise scaling).
    std::size_t fp8_width = 5;
    for (const auto& l : advice.fp8_layers) fp8_width = std::max(fp8_width, l.name.size());
    const int fw = static_cast<int>(fp8_width);
    const auto operand = [](const Fp8OperandAdvice& o) {
      std::ostringstream cell;
      cell << detail::short_number(o.amax) << " " << std::fixed << std::setprecision(2)
           << 100 * o.flushed << "% " << 100 * o.subnormal << "%";
      return cell.str();
    };
    text << "  fp8 (MixedFP8, tensorwise scaling): per operand max |x|, % of nonzero rounding to "
         << "0, % subnormal\n  " << std::left << std::setw(fw) << "layer" << std::setw(24)
         << "  input (e4m3)" << std::setw(24) << "  weight (e4m3)" << std::setw(24)
         << "  grad_output (e5m2)" << "  fp8\n";
    for (const auto& l : advice.fp8_layers) {
      text << "  " << std::setw(fw) << l.name << "  " << std::setw(22) << operand(l.input) << "  "
           << std::setw(22) << operand(l.weight) << "  " << std::setw(22)
           << operand(l.grad_output) << "  " << (l.fp8 ? "ok" : "bf16") << '\n';
    }
    text << std::right;
    for (const auto& l : advice.fp8_layers) {
      if (!l.fp8) text << "  keep " << l.name << " in bf16 under MixedFP8: " << l.reason << '\n';
    }
  }
  return out << text.str();
}

}  // namespace mixprec
