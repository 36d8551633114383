#pragma once
/// Watching the ATen ops of this thread: detail::OpObserver (one RecordFunction observer per
/// thread, the base of NonFiniteOpFinder and of advise()'s recorder, with the reads of an op's
/// tensors they share) and NamedScope, which names a scope of the user's code for both.

#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mixprec {

namespace detail {

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

}  // namespace mixprec
