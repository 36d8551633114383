#pragma once
/// Activation checkpointing by module: a module declared as mixprec::nn::Checkpointed<M> (the
/// same parameters, buffers, submodules, state_dict keys and forward as M) keeps none of its
/// activations for backward once apply_checkpointing names it, as transformers'
/// gradient_checkpointing_enable() does for every layer of an encoder:
///
///   struct Encoder : torch::nn::Module {
///     torch::nn::ModuleList layer;  // of mixprec::nn::Checkpointed<Layer>
///     ...
///   };
///   mixprec::apply_checkpointing(model, {"encoder.layer.*"});
///   mixprec::Trainer<mixprec::MixedO2<at::BFloat16>> trainer(model, optimizer);
///
/// LibTorch modules have no forward hooks, so the module must be declared as the wrapper (as for
/// a precision map's mixprec::nn::Mappable); until a pattern names it, it computes as M. The
/// recompute replays its first forward exactly (checkpoint.hpp) and leaves its buffers as that
/// forward left them (BatchNorm's running statistics are updated once). A Checkpointed module
/// whose forward takes and returns one tensor can also be given a precision by a map.

#include <mixprec/core/error.hpp>
#include <mixprec/nn/module_patterns.hpp>
#include <mixprec/precision/model_cast.hpp>
#include <mixprec/precision/precision_map.hpp>
#include <mixprec/recompute/checkpoint.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <concepts>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mixprec {
namespace detail {

/// The base of every mixprec::nn::Checkpointed: whether its forward is checkpointed, and its
/// name in the Errors of a recompute.
class CheckpointedBase : public virtual HookedModule {
 public:
  ~CheckpointedBase() override = default;
  /// Whether its forward keeps no activations (set by apply_checkpointing).
  bool checkpointing() const noexcept { return checkpointing_; }
  void set_checkpointing(bool on) noexcept { checkpointing_ = on; }
  /// Its path in the model (apply_checkpointing sets it), for the Errors of its recompute.
  void set_path(const std::string& path) {
    name_ = std::make_shared<const std::string>("module '" + path + "' (" + type_name() + ")");
  }

 protected:
  /// "module 'encoder.layer.0' (mixprec::nn::Checkpointed<Layer>)", or without the path.
  const std::shared_ptr<const std::string>& block_name() const noexcept { return name_; }
  void set_type_name() { name_ = std::make_shared<const std::string>("module " + type_name()); }
  virtual std::string type_name() const = 0;

 private:
  bool checkpointing_ = false;
  std::shared_ptr<const std::string> name_;
};

/// A module whose forward takes one tensor and returns one (a Linear, a norm layer, a
/// Sequential, a block of the user's): its Checkpointed wrapper has a forward of one tensor that
/// is no template, so that a ModuleHolder can call it and a Sequential hold it, and it can take
/// a precision region.
template <class Impl>
concept OneTensorForward = requires(Impl& module, const at::Tensor& x) {
  { module.forward(x) } -> std::same_as<at::Tensor>;
};

// The forward of Checkpointed<M>: M's own where it takes one tensor (a non-template, so that
// torch::nn::Sequential can hold the wrapper; a precision map can give it a region); any
// arguments otherwise.
template <class Derived, class Impl, bool = OneTensorForward<Impl>>
class CheckpointedForward {
 public:
  template <class... Args>
  auto forward(Args&&... args) {
    return static_cast<Derived&>(*this).run(
        [](Impl& module, auto&&... a) { return module.forward(a...); }, std::forward<Args>(args)...);
  }
};

template <class Derived, class Impl>
class CheckpointedForward<Derived, Impl, true> : public MappableBase {
 public:
  at::Tensor forward(const at::Tensor& input) {
    return run_hooked([&] { return checkpointed_forward(input); });
  }

  const torch::nn::Module& wrapped() const override {
    return unwrapped(*static_cast<const Derived&>(*this).inner());
  }

 private:
  at::Tensor checkpointed_forward(const at::Tensor& input) {
    auto& self = static_cast<Derived&>(*this);
    const auto inner = self.inner().ptr();  // shared: the recompute may outlive this call
    if (!self.checkpointing()) {
      return forward_in_region(region_, input, [&](const at::Tensor& x) { return inner->forward(x); });
    }
    // The region inside the checkpoint: the input is kept in its surroundings' dtype, the casts
    // are recomputed with the rest.
    auto compute = [inner, region = region_](const at::Tensor& x) {
      return forward_in_region(region, x, [&](const at::Tensor& y) { return inner->forward(y); });
    };
    return checkpoint_block(self.block_context(), std::move(compute), input);
  }
};

}  // namespace detail

namespace nn {

/// Module M (a torch::nn holder such as torch::nn::Linear, or one of the user's) with the same
/// parameters, buffers, submodules, state_dict keys and forward, whose forward apply_checkpointing
/// can checkpoint (see the top of this header). run(f, args...) checkpoints f(module, args...)
/// likewise: for an M whose forward is a template (`layer->run([](auto& m, auto& x) { return
/// m.template forward<P>(x); }, x)`).
template <class M>
class CheckpointedImpl
    : public torch::nn::Module,
      public mixprec::detail::CheckpointedBase,
      public mixprec::detail::CheckpointedForward<
          CheckpointedImpl<M>, std::remove_reference_t<decltype(*std::declval<M&>())>> {
 public:
  using Impl = std::remove_reference_t<decltype(*std::declval<M&>())>;

  template <class... Args>
    requires std::constructible_from<M, Args...>
  explicit CheckpointedImpl(Args&&... args) : inner_(std::forward<Args>(args)...) {
    MIXPREC_CHECK(dynamic_cast<const mixprec::detail::MappableBase*>(inner_.get()) == nullptr,
                  "mixprec::nn::Checkpointed<", inner_->name(), ">: the module is a mixprec "
                  "wrapper already (Mappable, Float8Linear), which a precision map or an fp8 "
                  "Trainer must find at its own path: declare it as it is and checkpoint the "
                  "block around it, or declare Checkpointed<M> (a map can give it a precision)");
    // M's own tensors and submodules under their own names: the paths do not change.
    for (auto& item : inner_->named_parameters(/*recurse=*/false)) {
      register_parameter(item.key(), item.value(), item.value().requires_grad());
    }
    for (auto& item : inner_->named_buffers(/*recurse=*/false)) {
      register_buffer(item.key(), item.value());
    }
    for (auto& item : inner_->named_children()) register_module(item.key(), item.value());
    set_type_name();
    mixprec::detail::unit_built(*this, *this);  // a mixprec::ShardedBuild takes it from here
  }

  /// f(module, args...) (module: M's Impl&), checkpointed while checkpointing() is on: none
  /// of its activations kept for backward, its buffers updated once. Capture by value in f.
  template <class F, class... Args>
  auto run(F&& f, Args&&... args) {
    using Result = decltype(f(*inner_, std::forward<Args>(args)...));
    if constexpr (std::is_same_v<Result, at::Tensor>) {
      // A sharded unit's weights whole around it (nn/unit_hooks.hpp).
      return run_hooked([&] { return run_block(std::forward<F>(f), std::forward<Args>(args)...); });
    } else {
      MIXPREC_CHECK(!has_unit_hooks(), "mixprec::nn::Checkpointed<", inner_->name(), ">::run(): "
                    "a unit of DistributedOptions::shard_parameters must return one tensor, "
                    "after which its weights are released; return the others from another "
                    "module, or keep this one out of the unit patterns");
      return run_block(std::forward<F>(f), std::forward<Args>(args)...);
    }
  }

  /// Train or eval mode for the wrapper and M (which is not one of its children).
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    inner_->train(on);
  }

 private:
  template <class F, class... Args>
  auto run_block(F&& f, Args&&... args) {
    if (!checkpointing()) return f(*inner_, std::forward<Args>(args)...);
    auto block = [inner = inner_.ptr(), f = std::decay_t<F>(std::forward<F>(f))](auto&&... a) mutable {
      return f(*inner, a...);
    };
    return mixprec::detail::checkpoint_block(block_context(), std::move(block),
                                             std::forward<Args>(args)...);
  }

  // The buffers to put back, the name and the modes of M, for a checkpoint of its forward.
  mixprec::detail::BlockContext block_context() const {
    return {mixprec::detail::buffers_of(*inner_), block_name(), {inner_.ptr()}};
  }
  std::string type_name() const override {
    return "mixprec::nn::Checkpointed<" + mixprec::detail::holder_name(*inner_) + ">";
  }
  friend class mixprec::detail::CheckpointedForward<CheckpointedImpl<M>, Impl>;

 public:

  /// The wrapped module.
  M& inner() noexcept { return inner_; }
  const M& inner() const noexcept { return inner_; }

  void pretty_print(std::ostream& stream) const override {
    stream << "mixprec::nn::Checkpointed(";
    inner_->pretty_print(stream);
    stream << (checkpointing() ? ", checkpointing)" : ")");
  }

 private:
  M inner_;
};

/// The holder of CheckpointedImpl<M>, as TORCH_MODULE makes for LibTorch's modules:
/// `mixprec::nn::Checkpointed<BertLayer> layer{config};`.
template <class M>
class Checkpointed : public torch::nn::ModuleHolder<CheckpointedImpl<M>> {
 public:
  using torch::nn::ModuleHolder<CheckpointedImpl<M>>::ModuleHolder;
};

}  // namespace nn

/// Checkpoints the forward of every module of `model` that `patterns` name (module paths of
/// named_modules(), `*` within one name, `**` across dots: "encoder.layer.*"); returns their
/// paths. Each named module must be declared as mixprec::nn::Checkpointed<M>. Errors, before
/// anything changes: a pattern that matches no module (naming the closest), one that every
/// module it matches an earlier pattern takes already (shadowed), a module that is not a
/// Checkpointed. Applying it again adds modules; checkpoints may nest.
inline std::vector<std::string> apply_checkpointing(const std::shared_ptr<torch::nn::Module>& model,
                                                    const std::vector<std::string>& patterns) {
  MIXPREC_CHECK(model != nullptr, "apply_checkpointing got a null model");
  MIXPREC_CHECK(!patterns.empty(), "apply_checkpointing got no patterns: name the modules to "
                "checkpoint, e.g. {\"encoder.layer.*\"}");
  const auto named = model->named_modules("", /*include_self=*/false);
  std::vector<std::string> paths;
  for (const auto& item : named) paths.push_back(item.key());
  const auto decided = detail::decide_paths(patterns, paths, [&](std::size_t i) {
    return "checkpointing pattern '" + patterns[i] + "'";
  });
  std::vector<detail::CheckpointedBase*> selected;
  std::vector<std::string> names;
  for (std::size_t i = 0; i < named.size(); ++i) {
    if (!decided[i]) continue;
    auto* module = dynamic_cast<detail::CheckpointedBase*>(named[i].value().get());
    MIXPREC_CHECK(module != nullptr, "checkpointing pattern '", patterns[*decided[i]],
                  "' names module '", paths[i], "' (", named[i].value()->name(), "), which is "
                  "not declared as mixprec::nn::Checkpointed<",
                  detail::holder_name(detail::unwrapped(*named[i].value())), ">: LibTorch "
                  "modules have no forward hooks, so only that wrapper (the same parameters, "
                  "state_dict keys and forward) can drop its activations. Declare it so, or "
                  "narrow the pattern (`*` stops at dots); nothing was changed");
    selected.push_back(module);
    names.push_back(paths[i]);
  }
  for (std::size_t i = 0; i < selected.size(); ++i) {
    selected[i]->set_checkpointing(true);
    selected[i]->set_path(names[i]);
  }
  return names;
}

/// For a ModuleHolder such as torch::nn::Sequential.
template <class Impl>
std::vector<std::string> apply_checkpointing(torch::nn::ModuleHolder<Impl>& model,
                                             const std::vector<std::string>& patterns) {
  return apply_checkpointing(std::static_pointer_cast<torch::nn::Module>(model.ptr()), patterns);
}

}  // namespace mixprec
