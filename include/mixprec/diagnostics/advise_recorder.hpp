#pragma once
// What advise()'s fp32 steps record: per layer, the outputs of the ops that read its parameters
// (LayerRecorder, an op observer) and the magnitudes of its parameters' gradients
// (GradientRecord, with the loss scales at which fp16 holds them). A layer is a module path
// (module_path); advise_verdicts.hpp judges what is recorded here.

#include <mixprec/diagnostics/gradient_values.hpp>
#include <mixprec/diagnostics/op_observer.hpp>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// The module path of a parameter's name ("block.fc1" of "block.fc1.weight"); "(model)" for
/// a parameter of the model itself.
inline std::string module_path(const std::string& name) {
  const auto last = name.rfind('.');
  return last == std::string::npos ? std::string("(model)") : name.substr(0, last);
}

constexpr double kHalfMax = 65504.0;
constexpr double kHalfTiny = 5.9604644775390625e-08;  // 2^-24, fp16's smallest subnormal
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

}  // namespace mixprec::detail
