#pragma once
/// The base of mixprec's custom autograd Functions (and how it makes graph nodes of its own):
/// how an optional tensor input (the bias of a bias-free layer) that is undefined reaches
/// forward() and backward().
///
/// LibTorch's Function::apply reads the device of every tensor argument, so an undefined one
/// throws "tensor does not have a device", with or without grad mode. LibTorch's own remedy,
/// an optional<Tensor> argument, leaves an absent one out of the node's inputs: needs_input_grad
/// then counts only the present ones, and every later input's index shifts by one. Here an
/// undefined tensor travels instead as one placeholder that needs no gradient, so that:
/// - forward() sees it again as undefined through given(t), and saves or passes that;
/// - backward() finds needs_input_grad(i) false at its index (the others keep theirs), and
///   returns an undefined gradient there, as for any input that needs none.

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace mixprec::detail {

/// How an autograd graph holds its nodes: std::shared_ptr in LibTorch 1.13, c10::intrusive_ptr
/// in 2.13 (what an Edge holds, set_history takes and Engine::execute follows).
using AutogradNodePtr = decltype(torch::autograd::Edge::function);

/// A new autograd node of type T (a torch::autograd::Node of mixprec's own, for a graph built
/// by hand), owned as the graph owns its nodes.
template <class T, class... Args>
auto make_autograd_node(Args&&... args) {
  if constexpr (std::is_same_v<AutogradNodePtr, std::shared_ptr<torch::autograd::Node>>) {
    // As LibTorch 1.13 makes its own: deleteNode frees a long chain without deep recursion
    // (found by argument-dependent lookup: 2.13, which discards this branch, has none).
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...), [](T* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

/// What an undefined tensor argument of a Function becomes: a tensor of no elements that needs
/// no gradient, and is never handed out.
inline const at::Tensor& absent_tensor() {
  // Never destroyed: at exit its destructor could run after LibTorch's statics that it needs.
  // Made outside inference mode, where its first use may happen: an ordinary tensor.
  static const at::Tensor* const absent = [] {
    const c10::InferenceMode normal(false);
    return new at::Tensor(at::empty({0}));
  }();
  return *absent;
}

/// In a Function's forward(): an optional tensor argument as the caller had it, undefined where
/// it was undefined.
inline at::Tensor given(const at::Tensor& argument) {
  return argument.is_same(absent_tensor()) ? at::Tensor() : argument;
}

/// A Function argument as it goes to torch::autograd::Function::apply: an undefined tensor as
/// absent_tensor(), everything else unchanged.
inline const at::Tensor& function_argument(const at::Tensor& tensor) {
  return tensor.defined() ? tensor : absent_tensor();
}
template <class A>
  requires(!std::is_base_of_v<at::TensorBase, std::remove_cvref_t<A>>)
A&& function_argument(A&& argument) {
  return std::forward<A>(argument);
}

/// torch::autograd::Function<T> whose apply() takes undefined tensors (see the top of this
/// header). Every custom Function of mixprec derives from it.
template <class T>
struct AutogradFunction : torch::autograd::Function<T> {
  template <class... Args>
  static auto apply(Args&&... args) {
    return torch::autograd::Function<T>::apply(function_argument(std::forward<Args>(args))...);
  }
};

}  // namespace mixprec::detail
