#pragma once
// Outputs a module keeps in its own dtype (Output::own): an fp32 region's output handed to
// surroundings that compute in Low (MixedO2, PureHalf). Every LibTorch module with parameters
// refuses an input of another dtype than its parameters (Linear, the convolutions, LayerNorm,
// GroupNorm, BatchNorm, PReLU, Bilinear, the RNNs, MultiheadAttention; LibTorch 1.13 and 2.13
// alike, tests/precision/test_nn.cpp), so whatever reads such an output must compute in fp32 too. Where
// the model says what reads it (the next modules of a torch::nn::Sequential), apply_precision_map
// checks it; elsewhere the model's forward decides, and OwnOutputWatch, around the Trainer's
// forward passes, turns LibTorch's dtype error into an Error that names both modules.

#include <mixprec/precision/model_cast.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// The holder a user declares for `module`: torch::nn::LinearImpl's is torch::nn::Linear.
inline std::string holder_name(const torch::nn::Module& module) {
  auto name = module.name();
  if (name.size() > 4 && name.ends_with("Impl")) name.resize(name.size() - 4);
  return name;
}

/// What to do about module `reader`, which computes in `surroundings` and reads the output in
/// `own` that `producer` keeps with Output::own.
inline std::string own_output_fix(const std::string& reader, const torch::nn::Module& module,
                                  const std::string& producer, c10::ScalarType own,
                                  c10::ScalarType surroundings) {
  const auto& wrapped = unwrapped(module);
  const bool mappable = &wrapped != &module;
  const auto rule = own == c10::ScalarType::Float
                        ? "keep_fp32(\"" + reader + "\")"
                        : "add(\"" + reader + "\", mixprec::Precision::low)";
  return "map '" + reader + "' to " + c10::toString(own) + " as well (" +
         (mappable ? std::string() : "declare it as mixprec::nn::Mappable<" +
                                         holder_name(wrapped) + ">, ") +
         "add " + rule + " to the map: it then reads " + c10::toString(own) + " and hands " +
         c10::toString(surroundings) + " on), or let '" + producer + "' hand its output to its "
         "surroundings (Output::surroundings)";
}

/// What apply_precision_map makes of a module, for following a kept output through a Sequential.
struct MappedModule {
  c10::ScalarType dtype = c10::ScalarType::Float;  // what the map says it computes in
  bool region = false;      // a Mappable whose dtype differs from its parent's: casts its inputs
  bool own_output = false;  // ... and keeps its output in its dtype
};

/// Follows the output that `producer` (a path of `model`) keeps in `own` through the Sequentials
/// around it, whose modules compute in `surroundings`: an Error, naming both, at the first module
/// that cannot read it. Stops where a module hands `surroundings` on, at the model's output,
/// and where a module with a forward of the user's takes it (that forward decides what reads
/// it; OwnOutputWatch reports it then). `mapped(path)` is what the map made of a module.
template <class Mapped>
void check_own_output_readers(const torch::nn::Module& model, const std::string& producer,
                              c10::ScalarType own, c10::ScalarType surroundings, Mapped&& mapped,
                              bool keep_batch_norm_fp32, bool mixed_dtype_norms,
                              std::string_view policy) {
  std::unordered_map<std::string, const torch::nn::Module*> modules;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    modules.emplace(item.key(), item.value().get());
  }
  const auto join = [](const std::string& parent, const std::string& key) {
    return parent.empty() ? key : parent + "." + key;
  };
  const auto floating_tensors = [](const torch::nn::Module& m) {
    for (const auto& p : m.parameters()) {
      if (at::isFloatingType(p.scalar_type())) return true;
    }
    for (const auto& b : m.buffers()) {
      if (at::isFloatingType(b.scalar_type())) return true;
    }
    return false;
  };
  // What leaves a module that `own` enters: still `own`, or settled (handed on in
  // `surroundings`, or into a forward of the user's).
  enum class Flow { onward, settled };
  std::function<Flow(const std::string&)> through;
  // `own` entering the children of a Sequential from index `first` on.
  const auto along = [&](const std::string& parent, const torch::nn::Module& sequential,
                         std::size_t first) {
    const auto children = sequential.named_children();
    for (std::size_t i = first; i < children.size(); ++i) {
      if (through(join(parent, children[i].key())) == Flow::settled) return Flow::settled;
    }
    return Flow::onward;
  };
  through = [&](const std::string& path) -> Flow {
    const auto& module = *modules.at(path);
    const MappedModule m = mapped(path);
    if (m.region) return m.own_output ? Flow::onward : Flow::settled;  // it casts its inputs
    const auto& wrapped = unwrapped(module);
    if (dynamic_cast<const torch::nn::SequentialImpl*>(&wrapped) != nullptr) {
      return along(path, module, 0);
    }
    if (!floating_tensors(module)) return Flow::onward;  // an activation, dropout, a reshape
    if (!module.children().empty()) return Flow::settled;  // its forward decides
    const bool batch_norm = is_batch_norm(module);
    const auto parameters = keep_batch_norm_fp32 && batch_norm ? c10::ScalarType::Float : m.dtype;
    // Its output takes its input's dtype: `own` flows on.
    if (parameters == own) return Flow::onward;
    if (parameters == c10::ScalarType::Float &&
        (batch_norm || (mixed_dtype_norms && is_layer_or_group_norm(module)))) {
      return Flow::onward;  // a norm layer with fp32 parameters takes Low input
    }
    fail("module '", path, "' (", wrapped.name(), ") computes in ", c10::toString(parameters),
         " under ", policy, " and reads, through the Sequential around it, the ",
         c10::toString(own), " output that module '", producer, "' keeps (Output::own); "
         "LibTorch's modules refuse an input of another dtype than their parameters: ",
         own_output_fix(path, module, producer, own, surroundings), "; nothing was changed");
  };
  std::string at = producer;
  for (;;) {
    const auto dot = at.rfind('.');
    const auto parent = dot == std::string::npos ? std::string() : at.substr(0, dot);
    const auto& parent_module = parent.empty() ? model : *modules.at(parent);
    if (dynamic_cast<const torch::nn::SequentialImpl*>(&unwrapped(parent_module)) == nullptr) {
      return;  // the user's forward decides what reads it
    }
    const auto key = at.substr(dot == std::string::npos ? 0 : dot + 1);
    const auto children = parent_module.named_children();
    std::size_t index = 0;
    while (index < children.size() && children[index].key() != key) ++index;
    if (along(parent, parent_module, index + 1) == Flow::settled || parent.empty()) return;
    if (mapped(parent).region) return;  // the Sequential's own region casts its output
    at = parent;
  }
}

/// Watches the Trainer's forward passes: once a region hands fp32 outputs to Low surroundings
/// (handed_out), the ops that read fp32 and Low tensors together are noted as they start, and a
/// LibTorch error thrown inside one becomes an Error naming the region, the module whose Low
/// parameter the op read, and the fix. Costs nothing until a region hands fp32 out.
class OwnOutputWatch {
 public:
  explicit OwnOutputWatch(const torch::nn::Module& model) : model_(model), previous_(current()) {
    current() = this;
  }
  OwnOutputWatch(const OwnOutputWatch&) = delete;
  OwnOutputWatch& operator=(const OwnOutputWatch&) = delete;
  ~OwnOutputWatch() {
    if (handle_ != 0) at::removeCallback(handle_);
    current() = previous_;
  }

  /// f(), with a LibTorch error it throws after a region handed fp32 out explained.
  template <class F>
  decltype(auto) run(F&& f) {
    try {
      return std::forward<F>(f)();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      if (producer_.empty()) throw;
      explain(e);  // throws an Error, unless the failing op read no fp32 together with Low
      throw;
    }
  }

  /// From a region's forward: module `path` handed an output in `own` to `surroundings`.
  static void handed_out(const std::string& path, c10::ScalarType own, c10::ScalarType surroundings) {
    auto* watch = current();
    if (watch == nullptr) return;
    watch->producer_ = path;
    watch->own_ = own;
    watch->low_ = surroundings;
    if (watch->handle_ == 0) {
      watch->handle_ = at::addThreadLocalCallback(
          at::RecordFunctionCallback(&OwnOutputWatch::start, &OwnOutputWatch::end)
              .needsInputs(true)
              .scopes({at::RecordScope::FUNCTION}));
    }
  }

 private:
  // An op that read `own` and `low` tensors together, kept until it ends normally.
  struct Reading {
    std::string op;
    std::vector<const void*> low_storages;
  };
  struct Context : at::ObserverContext {
    std::size_t index;
    explicit Context(std::size_t i) : index(i) {}
  };

  static OwnOutputWatch*& current() {
    thread_local OwnOutputWatch* watch = nullptr;
    return watch;
  }

  static std::unique_ptr<at::ObserverContext> start(const at::RecordFunction& fn) {
    auto* watch = current();
    if (watch == nullptr) return nullptr;
#ifdef NDEBUG
    bool own = false;
    std::vector<const void*> low;
    const auto look = [&](const at::Tensor& t) {
      if (!t.defined() || !at::isFloatingType(t.scalar_type())) return;
      if (t.scalar_type() == watch->own_) own = true;
      if (t.scalar_type() == watch->low_ && t.has_storage()) {
        low.push_back(t.storage().unsafeGetStorageImpl());
      }
    };
    for (const auto& value : fn.inputs()) {
      if (value.isTensor()) {
        look(value.toTensor());
      } else if (value.isTensorList()) {
        for (const auto& t : value.toTensorVector()) look(t);
      }
    }
    if (!own || low.empty()) return nullptr;
    watch->readings_.push_back({fn.name(), std::move(low)});
    return std::make_unique<Context>(watch->readings_.size() - 1);
#else
    // A program built without NDEBUG must not call RecordFunction::inputs() against a release
    // LibTorch (OpObserver::inputs_of, diagnostics/op_observer.hpp): the op that failed stays unknown.
    (void)fn;
    watch->inputs_known_ = false;
    return nullptr;
#endif
  }

  // Ops end in the reverse order they started: one that ends drops itself and those it ran.
  // One that ends while an exception unwinds is the one that threw (or encloses it): it stays.
  static void end(const at::RecordFunction&, at::ObserverContext* context) {
    auto* watch = current();
    if (watch == nullptr || context == nullptr || std::uncaught_exceptions() > 0) return;
    const auto index = static_cast<Context*>(context)->index;
    if (index < watch->readings_.size()) watch->readings_.resize(index);
  }

  [[noreturn]] void fail_with(const std::string& reader, const torch::nn::Module* module,
                              const std::string& op, const std::exception& e) const {
    const auto low = c10::toString(low_);
    if (module == nullptr) {
      fail("the forward pass failed in ", op, ", which read the ", c10::toString(own_),
           " output that module '", producer_, "' keeps (Output::own) together with a ", low,
           " tensor that no submodule holds (code of your own): cast one of them, or let '",
           producer_, "' hand its output to its surroundings (Output::surroundings). LibTorch: ",
           message_of(e));
    }
    fail("module '", reader, "' (", unwrapped(*module).name(), ") computes in ", low,
         " and reads the ", c10::toString(own_), " output that module '", producer_,
         "' keeps with Output::own: LibTorch's ", op, " refuses the mix. Fix: ",
         own_output_fix(reader, *module, producer_, own_, low_), ". LibTorch: ", message_of(e));
  }

  void explain(const std::exception& e) const {
    if (!inputs_known_) {
      fail("the forward pass failed after module '", producer_, "' handed its ",
           c10::toString(own_), " output (Output::own) to ", c10::toString(low_), " computation; "
           "if LibTorch's message below is about dtypes, a module that reads that output "
           "computes in ", c10::toString(low_), ": map it to ", c10::toString(own_), " as well (a "
           "mixprec::nn::Mappable, with a rule of its own), or let '", producer_, "' hand its "
           "output to its surroundings (Output::surroundings). (A build with -DNDEBUG names the "
           "module.) LibTorch: ", message_of(e));
    }
    if (readings_.empty()) return;  // not a dtype mix: LibTorch's error as it is
    const Reading* failed = &readings_.back();  // the innermost
    const std::unordered_set<const void*> storages(failed->low_storages.begin(),
                                                   failed->low_storages.end());
    for (const auto& item : model_.named_modules("", /*include_self=*/false)) {
      for (const auto& p : item.value()->parameters(/*recurse=*/false)) {
        if (p.has_storage() && storages.count(p.storage().unsafeGetStorageImpl()) != 0) {
          fail_with(item.key(), item.value().get(), failed->op, e);
        }
      }
    }
    fail_with("", nullptr, failed->op, e);
  }

  static std::string message_of(const std::exception& e) {
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    return error ? error->what_without_backtrace() : e.what();
  }

  const torch::nn::Module& model_;
  OwnOutputWatch* previous_;
  at::CallbackHandle handle_ = 0;
  std::string producer_;  // the latest region that handed fp32 out
  c10::ScalarType own_ = c10::ScalarType::Float, low_ = c10::ScalarType::Float;
  std::vector<Reading> readings_;
  bool inputs_known_ = true;
};

}  // namespace mixprec::detail
