#pragma once
/// Per-module precision: a PrecisionMap names modules by path and gives them a precision other
/// than the policy's (fp32 inside a MixedO2 model, say); apply_precision_map<P> assigns it before
/// the Trainer is built, keeping every parameter and buffer name.
///
///   struct Net : torch::nn::Module {
///     torch::nn::Linear fc{64, 64};
///     torch::nn::LayerNorm norm{torch::nn::LayerNormOptions({64})};   // a norm layer: as it is
///     mixprec::nn::Mappable<torch::nn::Linear> head{64, 10};          // anything else: wrapped
///     ...
///   };
///   auto model = std::make_shared<Net>();
///   mixprec::apply_precision_map<mixprec::MixedO2<at::BFloat16>>(
///       model, mixprec::PrecisionMap().keep_fp32("norm").keep_fp32("head"));
///   mixprec::Trainer<mixprec::MixedO2<at::BFloat16>> trainer(model, optimizer);
///
/// LibTorch modules have no forward hooks, and a model's forward calls its members directly, so
/// a module whose inputs must change dtype has to be declared as mixprec::nn::Mappable<M> (the
/// same parameters, state_dict keys and forward as M). Norm layers need no wrapper under
/// MixedO2/PureHalf: BatchNorm always, LayerNorm and GroupNorm where mixed_dtype_norms (LibTorch
/// 2.x), take Low input with fp32 weights. A module the map cannot change, and a rule that
/// decides no module (a typo, or shadowed by an earlier rule), are Errors that name them, before
/// anything changes.

#include <mixprec/core/autocast.hpp>
#include <mixprec/core/compat.hpp>
#include <mixprec/core/concepts.hpp>
#include <mixprec/precision/model_cast.hpp>
#include <mixprec/nn/module_patterns.hpp>
#include <mixprec/precision/own_outputs.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/policy.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <initializer_list>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec {

/// What a module computes in, whatever its policy gives the rest of the model.
enum class Precision {
  fp32,  ///< fp32 parameters and compute; autocast off inside it under MixedO1
  low,   ///< the policy's low dtype (fp32 under FullPrecision); autocast on under MixedO1
  fp8,   ///< under MixedFP8 (fp8.hpp): its mixprec::nn::Float8Linear layers compute their matrix
         ///< products in fp8, the rest in bf16: what MixedFP8 gives the whole model by default
};

inline std::ostream& operator<<(std::ostream& stream, Precision precision) {
  return stream << (precision == Precision::fp32  ? "fp32"
                    : precision == Precision::low ? "low"
                                                  : "fp8");
}

/// Where the output of a module whose precision differs from its surroundings goes.
enum class Output {
  surroundings,  ///< cast to its surroundings' dtype (its parent's: the policy's Low under
                 ///< MixedO2/PureHalf; under MixedO1 the dtype its input came in): the code around
                 ///< it does not change
  own,           ///< left in the module's own dtype: for values the surroundings' dtype cannot
                 ///< hold (fp16 beyond 65504), which the next module must then read in fp32 too
};

/// One rule of a PrecisionMap.
struct PrecisionRule {
  std::string pattern;  ///< a module path of named_modules(); `*` any characters but '.', `**` any
  Precision precision;
  Output output = Output::surroundings;
};

/// Ordered rules from module-path patterns to precisions. A module takes the precision of the
/// first rule that matches its path (that rule decides it), else its parent's; the model's root
/// takes its policy's. apply_precision_map refuses a rule that decides no module: one that
/// matches none, or one shadowed by earlier rules that decide everything it matches.
class PrecisionMap {
 public:
  PrecisionMap() = default;
  PrecisionMap(std::initializer_list<PrecisionRule> rules) : rules_(rules) {}

  /// Appends a rule (it decides only the modules no earlier rule matches).
  PrecisionMap& add(std::string pattern, Precision precision, Output output = Output::surroundings) {
    rules_.push_back({std::move(pattern), precision, output});
    return *this;
  }
  PrecisionMap& keep_fp32(std::string pattern, Output output = Output::surroundings) {
    return add(std::move(pattern), Precision::fp32, output);
  }

  const std::vector<PrecisionRule>& rules() const noexcept { return rules_; }
  bool empty() const noexcept { return rules_.empty(); }

  /// The first rule that matches `path`, or nullptr.
  const PrecisionRule* match(std::string_view path) const;

 private:
  std::vector<PrecisionRule> rules_;
};

/// A module whose precision differs from its policy's, as apply_precision_map assigned it.
struct ModulePrecision {
  std::string name;  ///< its named_modules() path
  Precision precision;
  c10::ScalarType dtype;  ///< what it computes in
};

namespace detail {

// A mapped module's forward: `compute` (the module's own) with its inputs cast to the
// region's dtype (or autocast switched), and its output cast back to its surroundings'.
template <class Compute>
at::Tensor forward_in_region(const MappableBase::Region& region, const at::Tensor& input,
                             Compute&& compute) {
  if (!region.active) return compute(input);
  std::optional<AutocastGuard> guard;
  if (region.autocast) guard.emplace(input.device().type(), region.autocast_dtype, *region.autocast);
  const bool floating = input.defined() && at::isFloatingType(input.scalar_type());
  auto out = compute(floating && region.cast_inputs ? input.to(region.dtype) : input);
  if (!out.defined() || !at::isFloatingType(out.scalar_type())) return out;
  if (region.cast_output) {
    const auto target = region.output_dtype.value_or(floating ? input.scalar_type()
                                                              : out.scalar_type());
    if (out.scalar_type() != target) out = out.to(target);
  } else if (region.output_dtype && out.scalar_type() != *region.output_dtype) {
    // Output::own: whatever reads it must take this dtype (own_outputs.hpp).
    OwnOutputWatch::handed_out(region.path, out.scalar_type(), *region.output_dtype);
  }
  return out;
}

}  // namespace detail

inline const PrecisionRule* PrecisionMap::match(std::string_view path) const {
  for (const auto& rule : rules_) {
    if (detail::glob_match(rule.pattern, path)) return &rule;
  }
  return nullptr;
}

namespace nn {

/// Module M (a torch::nn holder such as torch::nn::Linear) with the same parameters, buffers,
/// submodules, state_dict keys and forward, whose precision a PrecisionMap can set: its floating
/// inputs are cast to its dtype and its output to its surroundings' (MixedO2, PureHalf), or
/// autocast is turned off or on inside it (MixedO1). Unmapped, it computes as M, and the
/// Trainer treats it as M (a Mappable BatchNorm stays fp32 under MixedO2).
template <class M>
class MappableImpl : public torch::nn::Module, public mixprec::detail::MappableBase {
 public:
  template <class... Args>
    requires std::constructible_from<M, Args...>
  explicit MappableImpl(Args&&... args) : inner_(std::forward<Args>(args)...) {
    // M's own tensors and submodules under their own names: the paths do not change.
    for (auto& item : inner_->named_parameters(/*recurse=*/false)) {
      register_parameter(item.key(), item.value(), item.value().requires_grad());
    }
    for (auto& item : inner_->named_buffers(/*recurse=*/false)) {
      register_buffer(item.key(), item.value());
    }
    for (auto& item : inner_->named_children()) register_module(item.key(), item.value());
    mixprec::detail::unit_built(*this, *this);  // a mixprec::ShardedBuild takes it from here
  }

  /// M's forward, in the precision of its region when a map gave it one. One tensor in and out
  /// (a Linear, a norm layer, a convolution, a block of the user's), so that it also fits in a
  /// torch::nn::Sequential.
  at::Tensor forward(const at::Tensor& input) {
    return run_hooked([&] {
      return mixprec::detail::forward_in_region(
          region_, input, [this](const at::Tensor& x) { return inner_->forward(x); });
    });
  }

  const torch::nn::Module& wrapped() const override { return *inner_; }

  /// Train or eval mode for the wrapper and M (which is not one of its children).
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    inner_->train(on);
  }

  /// The wrapped module.
  M& inner() noexcept { return inner_; }
  const M& inner() const noexcept { return inner_; }

  void pretty_print(std::ostream& stream) const override {
    stream << "mixprec::nn::Mappable(";
    inner_->pretty_print(stream);
    stream << ")";
  }

 private:
  M inner_;
};

/// The holder of MappableImpl<M>, as TORCH_MODULE makes for LibTorch's modules:
/// `mixprec::nn::Mappable<torch::nn::Linear> head{64, 10};`.
template <class M>
class Mappable : public torch::nn::ModuleHolder<MappableImpl<M>> {
 public:
  using torch::nn::ModuleHolder<MappableImpl<M>>::ModuleHolder;
};

}  // namespace nn

/// Gives the modules of `model` the precisions `map` names, for a Trainer<P> built after it:
/// under MixedO2/PureHalf their parameters stay fp32 when the Trainer casts the model (fp32
/// parameters are their own masters), under MixedO1 autocast is off inside them. Returns the
/// modules whose precision now differs from P's. Errors, before anything changes: a rule that
/// matches no module (naming the closest), a rule shadowed by earlier ones (naming them), a
/// module whose inputs would need a cast it cannot take (not a Mappable or a norm layer that
/// takes them), an output kept with Output::own that the next module of a Sequential cannot
/// read (naming both; where the model's own forward decides, the Trainer's first forward pass
/// names them), a model mapped before or already trained by a Trainer.
template <class P>
std::vector<ModulePrecision> apply_precision_map(const std::shared_ptr<torch::nn::Module>& model,
                                                 const PrecisionMap& map) {
  static_assert(require_policy<P>);
  MIXPREC_CHECK(model != nullptr, "apply_precision_map got a null model");
  auto& registry = detail::PrecisionRegistry::instance();
  for (const auto& module : model->modules(/*include_self=*/true)) {
    MIXPREC_CHECK(!registry.mapped_policy(*module) && !registry.kept_fp32(*module),
                  "apply_precision_map: this model, or a part of it, has a precision map "
                  "already; put every rule into one map and apply it once, to a fresh model");
  }
  MIXPREC_CHECK(!detail::ModelClaim::any_claimed(detail::unique_tensors(model->parameters())),
                "apply_precision_map: a Trainer trains this model already and has cast it; "
                "apply the map before constructing the Trainer");
  const auto named = model->named_modules("", /*include_self=*/false);
  std::vector<std::string> names, patterns;
  for (const auto& item : named) names.push_back(item.key());
  for (const auto& rule : map.rules()) patterns.push_back(rule.pattern);
  // The rule that decides each module; every rule must decide one (not a typo, not shadowed).
  const auto decided = detail::decide_paths(patterns, names, [&](std::size_t i) {
    const auto& rule = map.rules()[i];
    std::ostringstream text;
    text << "precision map rule '" << rule.pattern << "' (" << rule.precision
         << (rule.output == Output::own ? ", Output::own" : "") << ")";
    return text.str();
  });

  for (const auto& rule : map.rules()) {
    MIXPREC_CHECK(rule.precision != Precision::fp8 || detail::fp8_policy<P>, "precision map "
                  "rule '", rule.pattern, "' asks for fp8, which only an fp8 policy computes: "
                  "apply the map for mixprec::MixedFP8 (and train with Trainer<MixedFP8>), not ",
                  P::name);
  }
  const auto dtype_of = [](Precision precision) {
    return precision == Precision::fp32 ? c10::ScalarType::Float : P::low_dtype;
  };
  // P's own: Low under O1-O3 (autocast's dtype under O1), fp32 under FullPrecision.
  const auto policy_dtype = P::cast_model || P::autocast ? P::low_dtype : c10::ScalarType::Float;
  std::unordered_map<std::string, c10::ScalarType> dtypes{{"", policy_dtype}};
  // Under an fp8 policy: whether the Float8Linear layers of each module compute in fp8.
  std::unordered_map<std::string, bool> fp8{{"", detail::fp8_policy<P>}};
  std::vector<std::pair<detail::MappableBase*, bool>> fp8_layers;
  std::vector<ModulePrecision> changed;
  struct RegionRoot {
    std::string name;
    std::shared_ptr<torch::nn::Module> module;
    detail::MappableBase* mappable;
    c10::ScalarType dtype;
    c10::ScalarType parent;
    Output output;
  };
  std::vector<RegionRoot> roots;
  std::vector<std::shared_ptr<torch::nn::Module>> kept_fp32;
  // A module registered under two names is one module: one precision, one output.
  struct Seen {
    std::string name;
    c10::ScalarType dtype;
    std::optional<Output> output;
  };
  std::unordered_map<const torch::nn::Module*, Seen> seen;
  for (std::size_t index = 0; index < named.size(); ++index) {  // parents before their children
    const auto& item = named[index];
    const auto& name = item.key();
    const auto dot = name.rfind('.');
    const auto parent_name = dot == std::string::npos ? std::string() : name.substr(0, dot);
    const auto parent = dtypes.at(parent_name);
    const auto* rule = decided[index] ? &map.rules()[*decided[index]] : nullptr;
    const auto dtype = rule != nullptr ? dtype_of(rule->precision) : parent;
    dtypes[name] = dtype;
    const bool in_fp8 = rule != nullptr ? rule->precision == Precision::fp8 : fp8.at(parent_name);
    fp8[name] = in_fp8;
    auto* const as_mappable = dynamic_cast<detail::MappableBase*>(item.value().get());
    const bool fp8_capable = as_mappable != nullptr && as_mappable->fp8_capable();
    if (rule != nullptr && rule->precision == Precision::fp8 && !fp8_capable) {
      const bool linear = dynamic_cast<const torch::nn::LinearImpl*>(
                              &detail::unwrapped(*item.value())) != nullptr;
      detail::fail("precision map rule '", rule->pattern, "' asks for fp8 in module '", name,
                   "' (", item.value()->name(), "), but only a linear layer declared as "
                   "mixprec::nn::Float8Linear computes in fp8", linear ? ": declare it as "
                   "mixprec::nn::Float8Linear (the same parameters, state_dict keys and "
                   "forward)" : "; map only such layers to fp8", "; nothing was changed");
    }
    if (fp8_capable) fp8_layers.emplace_back(as_mappable, in_fp8);
    const std::optional<Output> output =
        dtype != parent ? std::optional<Output>(rule->output) : std::nullopt;
    const auto [first, inserted] = seen.try_emplace(item.value().get(), Seen{name, dtype, output});
    MIXPREC_CHECK(inserted || (first->second.dtype == dtype && first->second.output == output),
                  "module '", name, "' is module '", first->second.name, "' registered under a "
                  "second name, and the precision map gives the two names different precisions "
                  "(or outputs); one module computes one way: map both names alike; nothing was "
                  "changed");
    if (dtype != policy_dtype) {
      changed.push_back({name, dtype == c10::ScalarType::Float ? Precision::fp32 : Precision::low,
                         dtype});
    } else if (detail::fp8_policy<P> && fp8_capable && !in_fp8) {
      changed.push_back({name, Precision::low, dtype});  // a Float8Linear kept in bf16
    }
    if constexpr (P::low_dtype == c10::ScalarType::Half && !cpu_half_math) {
      for (const auto& p : item.value()->parameters(/*recurse=*/false)) {
        MIXPREC_CHECK(dtype != c10::ScalarType::Half || !p.device().is_cpu(), "module '", name,
                      "' computes in Half under ", P::name, ", which LibTorch ", torch_version,
                      " cannot do on the CPU (its matmul, conv and softmax throw for Half): keep "
                      "it fp32, use BFloat16, or LibTorch >= 2.4; nothing was changed");
      }
    }
    if (P::cast_model && dtype == c10::ScalarType::Float) kept_fp32.push_back(item.value());
    if (dtype == parent) continue;
    // Where the precision changes, something must change the inputs' dtype (or autocast).
    auto* const mappable = as_mappable;
    const auto& module = *item.value();
    const bool plain_norm = P::cast_model && dtype == c10::ScalarType::Float &&
                            rule->output == Output::surroundings &&  // its kernel's output dtype
                            module.children().empty() &&
                            (detail::is_batch_norm(module) ||
                             (mixed_dtype_norms && detail::is_layer_or_group_norm(module)));
    if (mappable == nullptr && !plain_norm) {
      const bool old_norm = P::cast_model && detail::is_layer_or_group_norm(module);
      detail::fail("module '", name, "' (", module.name(), ") is mapped to ",
                   c10::toString(dtype), " inside ", c10::toString(parent), " computation under ",
                   P::name, ", but LibTorch modules have no forward hooks: nothing can change its "
                   "inputs' dtype", old_norm ? " (LibTorch 1.13's LayerNorm and GroupNorm refuse "
                   "Low inputs with fp32 weights)" : "", ". Declare it in the model as "
                   "mixprec::nn::Mappable<", detail::holder_name(module), "> (the same parameter "
                   "names and forward), or map a Mappable module around it; nothing was changed");
    }
    // (A precision that differs from the parent's comes from a rule of this module's own.)
    if (mappable != nullptr) {
      roots.push_back({name, item.value(), mappable, dtype, parent, rule->output});
    }
  }

  if constexpr (P::cast_model) {
    // A tensor registered both in a module kept fp32 and in one cast to Low (tied weights)
    // cannot be both.
    const auto own_tensors = [](const torch::nn::Module& module, const std::string& prefix) {
      std::vector<std::pair<std::string, const void*>> result;
      const auto path = [&](const std::string& key) { return prefix.empty() ? key : prefix + "." + key; };
      for (const auto& item : module.named_parameters(/*recurse=*/false)) {
        result.emplace_back(path(item.key()), item.value().unsafeGetTensorImpl());
      }
      for (const auto& item : module.named_buffers(/*recurse=*/false)) {
        if (at::isFloatingType(item.value().scalar_type())) {
          result.emplace_back(path(item.key()), item.value().unsafeGetTensorImpl());
        }
      }
      return result;
    };
    std::unordered_map<const void*, std::string> kept;
    for (const auto& item : named) {
      if (dtypes.at(item.key()) != c10::ScalarType::Float) continue;
      for (const auto& [path, impl] : own_tensors(*item.value(), item.key())) kept.emplace(impl, path);
    }
    const auto check_cast = [&](const torch::nn::Module& module, const std::string& name) {
      for (const auto& [path, impl] : own_tensors(module, name)) {
        const auto it = kept.find(impl);
        MIXPREC_CHECK(it == kept.end(), "'", path, "' is the same tensor as '", it->second,
                      "' (tied), which the precision map keeps fp32 while '", path, "' is cast "
                      "to ", c10::toString(P::low_dtype), ": map both modules to one precision; "
                      "nothing was changed");
      }
    };
    if (policy_dtype != c10::ScalarType::Float) check_cast(*model, "");
    for (const auto& item : named) {
      if (dtypes.at(item.key()) != c10::ScalarType::Float) check_cast(*item.value(), item.key());
    }
    // An output kept in its own dtype must reach a module that takes it, where the model says
    // which module that is (a Sequential's next); elsewhere the forward pass tells (the
    // Trainer's OwnOutputWatch).
    std::unordered_map<std::string, detail::MappedModule> mapped;
    for (const auto& root : roots) {
      mapped[root.name] = {root.dtype, true, root.output == Output::own};
    }
    const auto mapped_of = [&](const std::string& path) {
      const auto it = mapped.find(path);
      return it != mapped.end() ? it->second : detail::MappedModule{dtypes.at(path)};
    };
    for (const auto& root : roots) {
      if (root.output != Output::own) continue;
      detail::check_own_output_readers(*model, root.name, root.dtype, root.parent, mapped_of,
                                       P::keep_batch_norm_fp32, mixed_dtype_norms, P::name);
    }
  }

  // All checks passed.
  for (const auto& root : roots) {
    detail::MappableBase::Region region;
    region.active = true;
    region.path = root.name;
    region.dtype = root.dtype;
    region.cast_output = root.output == Output::surroundings;
    if constexpr (P::cast_model) {
      region.cast_inputs = true;
      region.output_dtype = root.parent;  // even when its input arrived in its own dtype
    } else if constexpr (P::autocast) {
      // fp32: autocast off and fp32 inputs; low: autocast on, as everywhere else in the model.
      region.cast_inputs = root.dtype == c10::ScalarType::Float;
      region.autocast = root.dtype != c10::ScalarType::Float;
      region.autocast_dtype = P::low_dtype;
    }
    root.mappable->set_region(region);
  }
  for (const auto& [layer, allowed] : fp8_layers) layer->allow_fp8(allowed);
  for (const auto& module : kept_fp32) registry.keep_fp32(module);
  registry.mark_mapped(model, P::name);
  return changed;
}

/// For a ModuleHolder such as torch::nn::Sequential.
template <class P, class Impl>
std::vector<ModulePrecision> apply_precision_map(torch::nn::ModuleHolder<Impl>& model,
                                                 const PrecisionMap& map) {
  return apply_precision_map<P>(std::static_pointer_cast<torch::nn::Module>(model.ptr()), map);
}

/// fp32 inside a block of the user's own forward code, where no module boundary fits: autocast
/// is off for the scope on the CPU and CUDA (MixedO1), in() casts a tensor to fp32, out() casts
/// a result back to the dtype of the first floating tensor in() saw.
///
///   mixprec::Fp32Region fp32;
///   auto scores = fp32.out(at::softmax(fp32.in(logits), -1));
class Fp32Region {
 public:
  Fp32Region()
      : cpu_(c10::DeviceType::CPU, c10::ScalarType::BFloat16, /*enabled=*/false),
        cuda_(c10::DeviceType::CUDA, c10::ScalarType::Half, /*enabled=*/false) {}

  at::Tensor in(const at::Tensor& x) {
    if (!x.defined() || !at::isFloatingType(x.scalar_type())) return x;
    if (!dtype_) dtype_ = x.scalar_type();
    return x.to(c10::ScalarType::Float);
  }

  at::Tensor out(const at::Tensor& y) const {
    if (!dtype_ || !y.defined() || !at::isFloatingType(y.scalar_type())) return y;
    return y.to(*dtype_);
  }

 private:
  AutocastGuard cpu_, cuda_;
  std::optional<c10::ScalarType> dtype_;
};

}  // namespace mixprec
