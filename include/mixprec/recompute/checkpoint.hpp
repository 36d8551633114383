#pragma once
/// Activation checkpointing for a block of the user's own code, as Python's
/// torch.utils.checkpoint(fn, *args, use_reentrant=False): the block's activations are not kept
/// for backward but recomputed there, under exactly the state the block first ran in (autocast on
/// every device type, hence the policy's precision, mapped modules and Fp32Regions; the CPU and
/// CUDA random states, hence the same dropout masks; grad mode). A block of modules is better
/// checkpointed as a module (mixprec::nn::Checkpointed, checkpointed.hpp).
///
///   auto y = mixprec::checkpoint(
///       [block = this->block](const at::Tensor& x, const at::Tensor& mask) {
///         return block->forward(x, mask);
///       },
///       x, mask);
///
/// The block runs again inside backward(): capture by value what it uses (a module holder, a
/// tensor, a number), never by reference to locals of a forward that has returned by then; pass
/// every tensor that requires grad as an argument (reading one from outside is an Error). Its
/// parameters need not be passed: those it reaches get their gradients, also when no input
/// requires grad. Buffers it updates in place (BatchNorm's running statistics) are updated
/// again by the recompute unless CheckpointOptions::keep_buffers names their module (the module
/// form always keeps them). The random states are the process's generators: nothing else may
/// draw from them while a recompute runs (another thread's data loader, a second GPU's backward
/// recomputing at the same time), or the masks differ from the first run's. The recompute is
/// checked to take the first run's path (same_run.hpp: the graph it builds, the outputs and
/// parameters, a few output values on the CPU): an Error names the block and what differs.

#include <mixprec/core/error.hpp>
#include <mixprec/core/recompute_state.hpp>
#include <mixprec/recompute/checkpoint_node.hpp>
#include <mixprec/recompute/recorded_state.hpp>
#include <mixprec/recompute/same_run.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/nn/module.h>

#include <concepts>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace mixprec {
namespace detail {

/// The defined buffers of `module` and its submodules: what a recompute must put back.
inline std::vector<at::Tensor> buffers_of(const torch::nn::Module& module) {
  std::vector<at::Tensor> result;
  for (const auto& b : module.buffers()) {
    if (b.defined()) result.push_back(b);
  }
  return result;
}

}  // namespace detail

/// Options of mixprec::checkpoint.
class CheckpointOptions {
 public:
  /// The block's name in the Errors of its recompute (by default, its function's type).
  CheckpointOptions& name(std::string name) {
    name_ = std::make_shared<const std::string>("block '" + std::move(name) + "'");
    return *this;
  }
  const std::shared_ptr<const std::string>& name() const noexcept { return name_; }

  /// Leaves the buffers of `module` and its submodules as the forward pass left them: the
  /// recompute's in-place updates of them (BatchNorm's running statistics) are undone, so that
  /// they are updated once per forward, as without the checkpoint. The recompute also checks
  /// that they are in the modes (train/eval) they were in (where `module` is held by a
  /// shared_ptr, as a holder's is).
  CheckpointOptions& keep_buffers(const torch::nn::Module& module) {
    for (const auto& b : detail::buffers_of(module)) buffers_.push_back(b);
    if (auto held = module.weak_from_this().lock()) modules_.push_back(std::move(held));
    return *this;
  }
  const std::vector<at::Tensor>& buffers() const noexcept { return buffers_; }
  const std::vector<std::shared_ptr<const torch::nn::Module>>& modules() const noexcept {
    return modules_;
  }

 private:
  std::vector<at::Tensor> buffers_;
  std::vector<std::shared_ptr<const torch::nn::Module>> modules_;
  std::shared_ptr<const std::string> name_;
};

namespace detail {

template <class T>
inline constexpr bool is_tensor_vector = std::is_same_v<T, std::vector<at::Tensor>>;

template <class T>
concept OptionalTensor = requires(T& value) {
  { value.has_value() } -> std::convertible_to<bool>;
  { *value } -> std::same_as<at::Tensor&>;
};

// Calls f(tensor) for each tensor an argument holds: a tensor, a vector of them or an optional
// one; any other argument holds none and is passed to the block as it is.
template <class T, class F>
void for_each_tensor(T& value, F& f) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    f(value);
  } else if constexpr (is_tensor_vector<T>) {
    for (auto& t : value) f(t);
  } else if constexpr (OptionalTensor<T>) {
    if (value.has_value()) f(*value);
  }
}

template <class Tuple, class F>
void for_each_tensor_of(Tuple& tuple, F f) {
  std::apply([&](auto&... values) { (for_each_tensor(values, f), ...); }, tuple);
}

template <class T>
inline constexpr bool is_tensor_tuple = false;
template <class... T>
inline constexpr bool is_tensor_tuple<std::tuple<T...>> = (std::is_same_v<T, at::Tensor> && ...);

template <class R>
inline constexpr bool block_result = std::is_same_v<R, at::Tensor> || is_tensor_vector<R> ||
                                     is_tensor_tuple<R>;

// A block's result as a flat list of tensors, and back.
template <class R>
variable_list flatten_result(const R& result) {
  if constexpr (std::is_same_v<R, at::Tensor>) {
    return {result};
  } else if constexpr (is_tensor_vector<R>) {
    return result;
  } else {
    return std::apply([](const auto&... t) { return variable_list{t...}; }, result);
  }
}
template <class R>
void replace_result(R& result, const variable_list& tensors) {
  if constexpr (std::is_same_v<R, at::Tensor>) {
    result = tensors[0];
  } else if constexpr (is_tensor_vector<R>) {
    result = tensors;
  } else {
    std::size_t i = 0;
    std::apply([&](auto&... t) { ((t = tensors[i++]), ...); }, result);
  }
}

// The user's block and its arguments, kept for the recompute.
template <class Fn, class... Args>
class Block {
 public:
  using Result = std::invoke_result_t<Fn&, Args&...>;

  template <class F, class... A>
  explicit Block(F&& fn, A&&... args)
      : fn_(std::forward<F>(fn)), args_(std::forward<A>(args)...) {}

  /// The tensors among the arguments, in order.
  variable_list tensors() {
    variable_list result;
    auto add = [&](at::Tensor& t) { result.push_back(t); };
    for_each_tensor_of(args_, add);
    return result;
  }

  /// The block on the arguments with their tensors replaced by `tensors`.
  Result operator()(const variable_list& tensors) {
    auto args = args_;
    std::size_t i = 0;
    auto take = [&](at::Tensor& t) { t = tensors[i++]; };
    for_each_tensor_of(args, take);
    return std::apply(fn_, args);
  }

 private:
  Fn fn_;
  std::tuple<Args...> args_;
};

/// What a checkpoint knows of its block beside the function: the buffers to put back after the
/// recompute, its name for Errors, and the modules whose modes the recompute checks (a
/// Checkpointed module's, those of keep_buffers).
struct BlockContext {
  std::vector<at::Tensor> buffers;
  std::shared_ptr<const std::string> name;
  std::vector<std::shared_ptr<const torch::nn::Module>> modules;
};

template <class Fn, class... Args>
auto checkpoint_block(const BlockContext& context, Fn&& fn, Args&&... args) {
  using B = Block<std::decay_t<Fn>, std::decay_t<Args>...>;
  using Result = typename B::Result;
  static_assert(block_result<Result>, "mixprec::checkpoint: the block must return an at::Tensor, "
                "a std::vector<at::Tensor> or a std::tuple of at::Tensor");
  if (!at::GradMode::is_enabled() || c10::InferenceMode::is_enabled()) {
    // Nothing is kept for backward without grad: the block runs as it is.
    return Result(std::invoke(fn, std::forward<Args>(args)...));
  }
  auto block = std::make_shared<B>(std::forward<Fn>(fn), std::forward<Args>(args)...);
  auto originals = block->tensors();
  auto grad = requiring_grad(originals);
  std::vector<std::int64_t> versions;
  for (const auto& t : originals) versions.push_back(t.defined() ? t._version() : 0);
  auto state = RecordedState::capture();
  auto modes = ModuleModes::of(context.modules);

  Result result;
  variable_list outputs;
  edge_list leaves;
  RunRecord first;
  {
    const CheckpointPassGuard pass(CheckpointPass::forward);
    const FreshCastCache cache;
    const BlockSpan span;
    auto inputs = BlockInputs::alias(originals, grad);
    result = (*block)(inputs.tensors);
    outputs = flatten_result(result);
    for (std::size_t i = 0; i < originals.size(); ++i) {
      MIXPREC_CHECK(!originals[i].defined() || originals[i]._version() == versions[i],
                    "the checkpointed block modifies its input ", i, " (shape ",
                    originals[i].sizes(), ") in place: the recompute in backward would start "
                    "from the modified values. Modify a copy inside the block (x = x.clone()), "
                    "or modify it before the block");
    }
    leaves = reached_leaves(outputs, inputs, span, first.graph);
  }
  const auto kept = requiring_grad_only(outputs);
  // No output requires grad: nothing flows back, nothing to recompute.
  if (kept.empty()) return result;
  for (const auto& out : kept) first.outputs.push_back(TensorMeta::of(out));
  first.sample = OutputSample::of(kept);
  first.versions = leaf_versions(leaves);
  // Every buffer named, not only those whose version moved: BatchNorm's kernels update the
  // running statistics in place without bumping their version counter (only
  // num_batches_tracked's += 1 does), so the version cannot tell which ones the block updates.
  auto function = [block](const variable_list& tensors) { return flatten_result((*block)(tensors)); };
  auto node = make_autograd_node<CheckpointNode>(
      std::move(function), originals, std::move(versions), std::move(grad), std::move(state),
      std::move(leaves), std::move(first), context.buffers,
      BlockName{context.name, &typeid(std::decay_t<Fn>)}, std::move(modes));
  // The outputs, without the first run's graph (its saved activations go with it), as the
  // node's: each output that requires grad is one of its inputs, in order.
  const AutogradNodePtr as_node = node;
  for (auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    out = out.detach();
    torch::autograd::set_history(out, as_node);
  }
  replace_result(result, outputs);
  return result;
}

}  // namespace detail

/// Runs fn(args...) keeping none of its activations for backward: backward recomputes them by
/// running fn again on the same arguments under the same autocast, random and grad state (see
/// the top of this header). Returns what fn returns: an at::Tensor, a std::vector or a
/// std::tuple of them. Tensor arguments (also in a std::vector or std::optional) are the
/// block's inputs; the others are passed as they are. Without grad mode it just runs fn.
template <class Fn, class... Args>
  requires std::invocable<std::decay_t<Fn>&, std::decay_t<Args>&...>
auto checkpoint(Fn&& fn, Args&&... args) {
  return detail::checkpoint_block(detail::BlockContext{}, std::forward<Fn>(fn),
                                  std::forward<Args>(args)...);
}

/// As above, with options (the modules whose buffers the recompute must not update again, the
/// block's name).
template <class Fn, class... Args>
  requires std::invocable<std::decay_t<Fn>&, std::decay_t<Args>&...>
auto checkpoint(const CheckpointOptions& options, Fn&& fn, Args&&... args) {
  const detail::BlockContext context{options.buffers(), options.name(), options.modules()};
  return detail::checkpoint_block(context, std::forward<Fn>(fn), std::forward<Args>(args)...);
}

}  // namespace mixprec
