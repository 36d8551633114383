#pragma once
/// Which forward op first produced an inf/NaN: NonFiniteOpFinder (opt-in, for debugging:
/// TrainerOptions::find_non_finite_op), what it reports (NonFiniteOp, TensorSummary) and their
/// messages. docs/diagnostics.md has its cost.

#include <mixprec/diagnostics/op_observer.hpp>

#include <ATen/ATen.h>
#include <ATen/core/function_schema.h>
#include <ATen/record_function.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace mixprec {

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
