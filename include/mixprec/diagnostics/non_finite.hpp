#pragma once
/// Precision diagnostics: where a skipped step's inf/NaN was (Overflow, in every skipped
/// StepReport), which forward op first produced one (NonFiniteOpFinder, opt-in), and how much of
/// each gradient fp16 would flush to zero or overflow at the loss scale (GradientStats, opt-in,
/// every N steps). docs/diagnostics.md shows them on the demo.
///
///   mixprec::TrainerOptions options;
///   options.find_non_finite_op(true)                                  // debugging: slow
///       .gradient_stats(mixprec::GradientStatsOptions().every(100).group_depth(1));
///   options.on_step([](const mixprec::StepReport& r) {
///     if (r.overflow) std::cerr << "step " << r.step << " skipped: " << *r.overflow << '\n';
///     if (r.non_finite_op) std::cerr << "  first inf/NaN: " << *r.non_finite_op << '\n';
///     if (r.gradient_stats) std::cerr << *r.gradient_stats;
///   });
///   ...
///   { mixprec::NamedScope scope("encoder"); h = encoder->forward(x); }  // names the op's scope

#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <ATen/core/function_schema.h>
#include <ATen/record_function.h>
#include <torch/arg.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec {

/// Where the inf/NaN of a skipped step was. Found by a second pass over the gradients that runs
/// on skipped steps only: clean steps pay nothing for it.
struct Overflow {
  /// At most this many names in `params`.
  static constexpr std::size_t max_names = 8;
  /// The loss was inf or NaN (in one of the micro-batches of the step, or their sum).
  bool loss = false;
  /// The first parameters, in model order and by their names in the model, whose gradients
  /// held inf or NaN; a tensor registered under two names (tied weights) by its first.
  std::vector<std::string> params;
  /// How many parameters' gradients held inf or NaN in all.
  std::int64_t param_count = 0;
  /// How many parameters had gradients to check.
  std::int64_t checked = 0;
  /// Data parallel: neither was found on this rank; another rank's loss was inf/NaN (gradients
  /// are averaged, so another rank's inf/NaN gradient is found on every rank).
  bool other_rank = false;
};

/// "inf/NaN in the loss and in the gradients of 3 parameters: fc.weight, fc.bias, out.weight";
/// "inf/NaN in the gradients of all 8 parameters (...): conv1.weight, ...".
inline std::ostream& operator<<(std::ostream& out, const Overflow& o) {
  out << "inf/NaN";
  if (o.other_rank) return out << " on another rank (its loss)";
  if (o.loss) out << " in the loss";
  if (o.param_count > 0) {
    out << (o.loss ? " and" : "") << " in the gradients of ";
    if (o.param_count == o.checked && o.param_count > 1 && !o.loss) {
      // The usual signature of an activation gradient that overflowed: the backward pass
      // carries it into every layer below.
      out << "all " << o.param_count << " parameters (an overflow in the backward pass reaches "
          << "every layer it passes): ";
    } else {
      out << o.param_count << (o.param_count == 1 ? " parameter: " : " parameters: ");
    }
    for (std::size_t i = 0; i < o.params.size(); ++i) out << (i ? ", " : "") << o.params[i];
    if (static_cast<std::int64_t>(o.params.size()) < o.param_count) out << ", ...";
  }
  if (!o.loss && o.param_count == 0) out << " (not found in the loss or the gradients)";
  return out;
}

/// Settings of the gradient statistics of a Trainer (TrainerOptions::gradient_stats).
struct GradientStatsOptions {
  /// Counted on optimizer steps N, 2N, 3N, ... (StepReport::step) for N = every; 0: never.
  TORCH_ARG(std::int64_t, every) = 0;
  /// 0: one entry per parameter; k > 0: per module prefix of k components ("encoder.layer1"
  /// for k = 2), the parameters' counts summed.
  TORCH_ARG(std::int64_t, group_depth) = 0;
};

/// The gradient elements of a parameter (or a module prefix) as fp16 would hold them at the
/// step's loss scale, counted on the scaled gradients before unscaling.
struct GradientRange {
  std::string name;            ///< the parameter's name, or the module prefix
  std::int64_t elements = 0;   ///< gradient elements counted
  std::int64_t zeros = 0;      ///< exactly 0 (under a Half policy, fp16's flushed values are here)
  std::int64_t underflow = 0;  ///< not 0, but 0 in fp16 (|g * scale| <= 2^-25)
  std::int64_t subnormal = 0;  ///< fp16 subnormal: kept with fewer bits (2^-25 < |g*s| < 2^-14)
  std::int64_t overflow = 0;   ///< inf in fp16 (|g * scale| >= 65520), or inf/NaN already
  double max_abs = 0.0;        ///< the largest |gradient|, unscaled (inf/NaN: not finite)

  double fraction(std::int64_t count) const {
    return elements == 0 ? 0.0 : static_cast<double>(count) / static_cast<double>(elements);
  }
  double zero_fraction() const { return fraction(zeros); }
  double underflow_fraction() const { return fraction(underflow); }
  double subnormal_fraction() const { return fraction(subnormal); }
  double overflow_fraction() const { return fraction(overflow); }
};

/// The gradient statistics of one optimizer step.
struct GradientStats {
  std::int64_t step = 0;  ///< the optimizer step (1-based, as StepReport::step)
  double scale = 1.0;     ///< the loss scale of the gradients counted
  std::vector<GradientRange> entries;  ///< in model order
};

/// A table: name, elements, then the fractions in percent.
inline std::ostream& operator<<(std::ostream& out, const GradientStats& stats) {
  std::ostringstream text;
  text << "gradients at step " << stats.step << ", loss scale " << stats.scale
       << " (% of elements; underflow/overflow: as fp16 would hold them):\n";
  std::size_t width = 4;
  for (const auto& e : stats.entries) width = std::max(width, e.name.size());
  text << "  " << std::left << std::setw(static_cast<int>(width)) << "name" << std::right
       << std::setw(11) << "elements" << std::setw(9) << "zero" << std::setw(11) << "underflow"
       << std::setw(11) << "subnormal" << std::setw(10) << "overflow" << std::setw(12)
       << "max |g|" << '\n';
  for (const auto& e : stats.entries) {
    text << "  " << std::left << std::setw(static_cast<int>(width)) << e.name << std::right
         << std::setw(11) << e.elements << std::fixed << std::setprecision(3) << std::setw(9)
         << 100 * e.zero_fraction() << std::setw(11) << 100 * e.underflow_fraction()
         << std::setw(11) << 100 * e.subnormal_fraction() << std::setw(10)
         << 100 * e.overflow_fraction() << std::defaultfloat << std::setprecision(4)
         << std::setw(12) << e.max_abs << '\n';
  }
  return out << text.str();
}

namespace detail {

/// The module prefix of `depth` components of a parameter's name; depth 0: the name itself.
inline std::string name_prefix(const std::string& name, std::int64_t depth) {
  if (depth <= 0) return name;
  const auto last = name.rfind('.');
  if (last == std::string::npos) return "(model)";  // a parameter of the model itself
  std::size_t end = 0;
  for (std::int64_t k = 0; k < depth; ++k) {
    const auto dot = name.find('.', end == 0 ? 0 : end + 1);
    if (dot == std::string::npos || dot > last) return name.substr(0, last);
    end = dot;
  }
  return name.substr(0, end);
}

/// The module path of a parameter's name ("block.fc1" of "block.fc1.weight"); "(model)" for
/// a parameter of the model itself.
inline std::string module_path(const std::string& name) {
  const auto last = name.rfind('.');
  return last == std::string::npos ? std::string("(model)") : name.substr(0, last);
}

/// The values of a gradient that can be read: a sparse gradient's values.
inline at::Tensor readable(const at::Tensor& grad) {
  return grad.is_sparse() ? grad._values() : grad;
}

/// One flag per tensor, read back together: whether it holds inf or NaN. One synchronisation.
inline std::vector<bool> non_finite_flags(const std::vector<at::Tensor>& tensors) {
  std::vector<bool> result(tensors.size(), false);
  if (tensors.empty()) return result;
  std::vector<at::Tensor> flags;
  flags.reserve(tensors.size());
  for (const auto& t : tensors) {
    const auto values = readable(t);
    flags.push_back(values.numel() == 0 ? at::zeros({}, values.options().dtype(at::kBool))
                                        : at::isfinite(values).logical_not().any());
  }
  const auto host = at::stack(flags).to(at::kCPU);
  const auto* data = host.data_ptr<bool>();
  for (std::size_t i = 0; i < tensors.size(); ++i) result[i] = data[i];
  return result;
}

/// Counts of GradientRange for each tensor (scaled gradients, `scale` their loss scale), read
/// back together: one synchronisation.
inline std::vector<GradientRange> gradient_ranges(const std::vector<at::Tensor>& grads,
                                                  double scale) {
  // fp16's thresholds on the fp32 value (round to nearest even): 2^-25 ties to 0, 65520 to inf.
  constexpr double flush = 2.98023223876953125e-08;  // 2^-25
  constexpr double min_normal = 6.103515625e-05;     // 2^-14
  constexpr double to_inf = 65520.0;
  std::vector<at::Tensor> counts, maxima;
  for (const auto& grad : grads) {
    const auto values = readable(grad);
    if (values.numel() == 0) {
      counts.push_back(at::zeros({4}, values.options().dtype(at::kLong)));
      maxima.push_back(at::zeros({}, values.options().dtype(at::kDouble)));
      continue;
    }
    const auto a = values.to(at::kFloat).abs();
    const auto nan = at::isnan(a);
    counts.push_back(at::stack({a.eq(0).sum(), (a.gt(0) & a.le(flush)).sum(),
                                (a.gt(flush) & a.lt(min_normal)).sum(),
                                (a.ge(to_inf) | nan).sum()}));
    // NaN wins over the maximum: a NaN gradient's max_abs is NaN.
    maxima.push_back(at::where(nan.any(), at::full({}, std::nan(""), a.options()), a.max())
                         .to(at::kDouble));
  }
  std::vector<GradientRange> result(grads.size());
  if (grads.empty()) return result;
  const auto c = at::stack(counts).to(at::kCPU);
  const auto m = at::stack(maxima).to(at::kCPU);
  const auto* cd = c.data_ptr<std::int64_t>();
  const auto* md = m.data_ptr<double>();
  for (std::size_t i = 0; i < grads.size(); ++i) {
    auto& r = result[i];
    r.elements = readable(grads[i]).numel();
    r.zeros = cd[4 * i];
    r.underflow = cd[4 * i + 1];
    r.subnormal = cd[4 * i + 2];
    r.overflow = cd[4 * i + 3];
    r.max_abs = md[i] / scale;
  }
  return result;
}

/// Sums ranges of the same name (module prefixes), keeping the order of first appearance.
inline std::vector<GradientRange> merge_ranges(std::vector<GradientRange> ranges) {
  std::vector<GradientRange> merged;
  std::unordered_map<std::string, std::size_t> index;
  for (auto& r : ranges) {
    const auto [it, inserted] = index.try_emplace(r.name, merged.size());
    if (inserted) {
      merged.push_back(std::move(r));
      continue;
    }
    auto& m = merged[it->second];
    m.elements += r.elements;
    m.zeros += r.zeros;
    m.underflow += r.underflow;
    m.subnormal += r.subnormal;
    m.overflow += r.overflow;
    m.max_abs = std::isnan(m.max_abs) || std::isnan(r.max_abs) ? std::nan("")
                                                               : std::max(m.max_abs, r.max_abs);
  }
  return merged;
}

/// Calls on_start/on_end of the one observer active on this thread for each ATen op (and each
/// user scope) that starts and ends on it, through LibTorch's RecordFunction callbacks, with the
/// op's inputs and outputs. Its own reads of tensors are not observed.
class OpObserver {
 public:
  OpObserver(const OpObserver&) = delete;
  OpObserver& operator=(const OpObserver&) = delete;

 protected:
  OpObserver() {
    MIXPREC_CHECK(current() == nullptr, "a mixprec op observer (NonFiniteOpFinder, "
                  "TrainerOptions::find_non_finite_op or advise()) is already active on this "
                  "thread: they do not nest");
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&OpObserver::start, &OpObserver::end)
            .needsInputs(true)
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}));
    current() = this;
  }
  virtual ~OpObserver() {
    at::removeCallback(handle_);
    current() = nullptr;
  }

  virtual void on_start(const at::RecordFunction& fn) = 0;
  virtual void on_end(const at::RecordFunction& fn) = 0;

  /// Runs `f` unobserved: the observer's own ATen calls must not be seen by it.
  template <class F>
  void quietly(F&& f) {
    struct Busy {
      bool& flag;
      explicit Busy(bool& b) : flag(b) { flag = true; }
      ~Busy() { flag = false; }
    } busy(busy_);
    at::RecordFunctionGuard off(/*is_enabled=*/false);
    f();
  }

  /// Ops whose outputs are uninitialised memory when they end: their values mean nothing.
  static bool allocates_only(std::string_view op) {
    return op.starts_with("aten::empty") || op.starts_with("aten::new_empty") ||
           op == "aten::resize_" || op == "aten::resize_as_" || op == "aten::set_" ||
           op == "aten::_empty_affine_quantized" || op == "aten::_empty_per_channel_affine_quantized";
  }

  /// An op's floating-point inputs, in a start callback; nullopt in a program built without
  /// NDEBUG. There RecordFunction::inputs() checks a flag that only LibTorch's own debug builds
  /// have (1.13 and 2.x alike): against a release LibTorch it would read a byte of padding, so
  /// it is not called. The finder then reports the inputs as unknown; advise() finds the layers
  /// through the autograd graph.
  static std::optional<std::vector<at::Tensor>> inputs_of(const at::RecordFunction& fn) {
#ifdef NDEBUG
    return float_tensors(fn.inputs());
#else
    (void)fn;
    return std::nullopt;
#endif
  }

  /// The floating-point tensors of an op's inputs or outputs (tensor lists flattened).
  template <class Values>  // RecordFunction's inputs() (an ArrayRef) or outputs() (a vector)
  static std::vector<at::Tensor> float_tensors(const Values& values) {
    std::vector<at::Tensor> result;
    for (const auto& v : values) add_float_tensors(v, result);
    return result;
  }
  static void add_float_tensors(const c10::IValue& v, std::vector<at::Tensor>& result) {
    auto add = [&](const at::Tensor& t) {
      if (t.defined() && !t.is_sparse() && t.layout() == c10::kStrided &&
          at::isFloatingType(t.scalar_type()) && t.numel() > 0 && t.device().type() != c10::kMeta) {
        result.push_back(t);
      }
    };
    if (v.isTensor()) {
      add(v.toTensor());
    } else if (v.isTensorList()) {
      for (const auto& t : v.toTensorVector()) add(t);
    }
  }

 private:
  static OpObserver*& current() {
    thread_local OpObserver* observer = nullptr;
    return observer;
  }
  static std::unique_ptr<at::ObserverContext> start(const at::RecordFunction& fn) {
    if (auto* self = current(); self != nullptr && !self->busy_) self->on_start(fn);
    return nullptr;
  }
  static void end(const at::RecordFunction& fn, at::ObserverContext*) {
    if (auto* self = current(); self != nullptr && !self->busy_) self->on_end(fn);
  }

  at::CallbackHandle handle_ = 0;
  bool busy_ = false;
};

}  // namespace detail

/// Names a scope of the user's code for the diagnostics (and for LibTorch's profiler): a
/// RecordFunction of scope USER_SCOPE, as Python's torch.profiler.record_function and
/// RECORD_USER_SCOPE make. Costs nothing when nothing observes.
class NamedScope {
 public:
  explicit NamedScope(std::string name) : record_(at::RecordScope::USER_SCOPE) {
    record_.before(std::move(name));
  }
  NamedScope(const NamedScope&) = delete;
  NamedScope& operator=(const NamedScope&) = delete;

 private:
  at::RecordFunction record_;
};

/// A tensor an op read or wrote: dtype, shape and the range of its finite values.
struct TensorSummary {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<std::int64_t> sizes;
  double min = 0.0;             ///< the smallest finite value (0 when there is none)
  double max = 0.0;             ///< the largest finite value (0 when there is none)
  std::int64_t non_finite = 0;  ///< inf and NaN elements
};

/// "Half[8, 4] in [-3, 900]", "Half[8, 16] in [-1e+03, 6e+04], 12 inf/NaN", "Half[3, 8] all
/// inf/NaN".
inline std::ostream& operator<<(std::ostream& out, const TensorSummary& t) {
  out << c10::toString(t.dtype) << '[';
  std::int64_t elements = 1;
  for (std::size_t i = 0; i < t.sizes.size(); ++i) {
    out << (i ? ", " : "") << t.sizes[i];
    elements *= t.sizes[i];
  }
  out << ']';
  if (t.non_finite > 0 && t.non_finite == elements) return out << " all inf/NaN";
  out << " in [" << t.min << ", " << t.max << ']';
  if (t.non_finite > 0) out << ", " << t.non_finite << " inf/NaN";
  return out;
}

/// The first op of a forward pass whose output held inf or NaN.
struct NonFiniteOp {
  std::string op;                    ///< the operator, e.g. "aten::addmm"
  std::vector<std::string> within;   ///< the ops it ran inside, outermost first ("aten::linear")
  std::vector<std::string> scopes;   ///< the user's NamedScopes around it, outermost first
  std::vector<TensorSummary> inputs;   ///< its floating-point inputs (after it ran, for in-place ops)
  std::vector<TensorSummary> outputs;  ///< its floating-point outputs
  bool in_place = false;             ///< an output is one of its inputs
  /// false: LibTorch did not give the inputs (a program built without NDEBUG against a release
  /// LibTorch, whose RecordFunction asserts then); `inputs` is empty.
  bool known_inputs = true;
  /// The innermost user scope around the op, "" if none.
  std::string scope() const { return scopes.empty() ? std::string() : scopes.back(); }
};

/// "aten::addmm in aten::linear, scope 'net.fc2': outputs Half[4, 8] in [...], 32 inf/NaN;
/// inputs ...".
inline std::ostream& operator<<(std::ostream& out, const NonFiniteOp& op) {
  out << op.op;
  for (auto it = op.within.rbegin(); it != op.within.rend(); ++it) out << " in " << *it;
  if (!op.scopes.empty()) {
    out << ", scope '";
    for (std::size_t i = 0; i < op.scopes.size(); ++i) out << (i ? "/" : "") << op.scopes[i];
    out << '\'';
  }
  out << (op.in_place ? " (in place)" : "") << ": output";
  for (std::size_t i = 0; i < op.outputs.size(); ++i) out << (i ? ", " : " ") << op.outputs[i];
  out << "; input" << (op.inputs.size() == 1 ? "" : "s");
  if (!op.known_inputs) return out << " unknown (build with -DNDEBUG to see them)";
  if (op.inputs.empty()) out << " none";
  for (std::size_t i = 0; i < op.inputs.size(); ++i) out << (i ? ", " : " ") << op.inputs[i];
  return out;
}

/// While alive, watches every ATen op that runs on this thread and records the first whose
/// output holds inf or NaN: its name, the ops and user scopes (NamedScope) around it, and its
/// inputs' and outputs' ranges. For debugging: it reads every op's outputs, which on a device
/// is a synchronisation per op (docs/diagnostics.md has the cost). One per thread at a time.
class NonFiniteOpFinder : detail::OpObserver {
 public:
  NonFiniteOpFinder() = default;

  /// The first op found, if any.
  const std::optional<NonFiniteOp>& first() const noexcept { return first_; }

 private:
  // An op's inputs are only valid while its start callbacks run (LibTorch boxes them for the
  // call and frees them before the op ends): they are held, as tensors, until it ends.
  struct Running {
    std::string name;
    std::vector<at::Tensor> inputs;
    bool known_inputs;
  };

  void on_start(const at::RecordFunction& fn) override {
    if (fn.scope() == at::RecordScope::USER_SCOPE) {
      scopes_.emplace_back(fn.name());
      return;
    }
    Running op{fn.name(), {}, true};
    if (!first_) {
      auto inputs = inputs_of(fn);
      op.known_inputs = inputs.has_value();
      if (inputs) op.inputs = std::move(*inputs);
    }
    ops_.push_back(std::move(op));
  }

  void on_end(const at::RecordFunction& fn) override {
    if (fn.scope() == at::RecordScope::USER_SCOPE) {
      if (!scopes_.empty()) scopes_.pop_back();
      return;
    }
    if (ops_.empty()) return;
    const auto op = std::move(ops_.back());
    ops_.pop_back();
    if (first_ || allocates_only(op.name)) return;
    const auto outputs = float_tensors(fn.outputs());
    if (outputs.empty()) return;
    quietly([&] {
      bool bad = false;
      for (const auto& t : outputs) bad = bad || !at::isfinite(t).all().template item<bool>();
      if (!bad || only_passed_through(fn)) return;
      NonFiniteOp found;
      found.op = op.name;
      // Outermost first; an op that calls itself again (autocast's kernel casts the inputs and
      // redispatches) is named once.
      for (std::size_t i = 0; i < ops_.size(); ++i) {
        const auto& inner = i + 1 < ops_.size() ? ops_[i + 1].name : op.name;
        if (ops_[i].name != inner) found.within.push_back(ops_[i].name);
      }
      found.scopes = scopes_;
      found.known_inputs = op.known_inputs;
      for (const auto& t : op.inputs) found.inputs.push_back(summary(t));
      for (const auto& t : outputs) {
        found.outputs.push_back(summary(t));
        for (const auto& in : op.inputs) found.in_place = found.in_place || t.is_same(in);
      }
      first_ = std::move(found);
    });
  }

  // Whether every output that holds inf/NaN is, by the op's schema, an input seen through a
  // view the op does not write (`Tensor(a)`: resolve_conj, view, expand, ...). Such an output
  // holds its input's values: the inf/NaN began elsewhere, or is the uninitialised memory of a
  // buffer not yet written (LibTorch 1.13's mm resolves the conjugate of its `out` before it
  // computes). So the op is not the one to report. False for an op with no schema.
  static bool only_passed_through(const at::RecordFunction& fn) {
    const auto schema = fn.operator_schema();
    if (!schema) return false;
    const auto& returns = schema->returns();
    const auto& values = fn.outputs();
    for (std::size_t i = 0; i < values.size(); ++i) {
      const auto* alias = i < returns.size() ? returns[i].alias_info() : nullptr;
      if (alias != nullptr && !alias->isWrite()) continue;
      std::vector<at::Tensor> made;
      add_float_tensors(values[i], made);
      for (const auto& t : made) {
        if (!at::isfinite(t).all().template item<bool>()) return false;
      }
    }
    return true;
  }

  static TensorSummary summary(const at::Tensor& t) {
    TensorSummary s;
    s.dtype = t.scalar_type();
    s.sizes = t.sizes().vec();
    const auto values = t.detach().to(at::kFloat);
    const auto finite = at::isfinite(values);
    s.non_finite = values.numel() - finite.sum().item<std::int64_t>();
    if (s.non_finite < values.numel()) {
      const auto kept = values.masked_select(finite);
      s.min = kept.min().item<double>();
      s.max = kept.max().item<double>();
    }
    return s;
  }

  std::vector<Running> ops_;         // the ops running now, outermost first
  std::vector<std::string> scopes_;  // the user scopes open now, outermost first
  std::optional<NonFiniteOp> first_;
};

}  // namespace mixprec
