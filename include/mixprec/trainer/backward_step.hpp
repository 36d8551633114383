#pragma once
// The optimizer step inside the backward pass (TrainerOptions::step_in_backward): a hook on each
// trained leaf of the model, run by autograd right after that leaf's gradient is accumulated
// (LibTorch's post-accumulate-grad hook, Python's register_post_accumulate_grad_hook), hands the
// leaf to the Trainer, which checks and steps what it trains and frees the gradient there and
// then. The hooks act only while the Trainer's own backward pass runs (armed); any other
// backward pass over the model accumulates gradients as usual. Not a template: the policy's
// part is the callable the Trainer arms them with (trainer_step.hpp).

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <c10/util/FunctionRef.h>
#if MIXPREC_TORCH_AT_LEAST(2, 1)
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#endif

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mixprec::detail {

class BackwardStep {
 public:
  /// Steps the leaf's trained tensor with its gradient and frees the gradient; false where the
  /// gradient held inf/NaN (nothing stepped).
  using StepOne = c10::function_ref<bool(const at::Tensor&)>;

  BackwardStep() = default;
  BackwardStep(const BackwardStep&) = delete;
  BackwardStep& operator=(const BackwardStep&) = delete;
  ~BackwardStep() { remove(); }

  /// Hooks `leaves` (name, tensor: the model parameters the optimizer trains, directly or
  /// through a master), and only them: hooks of an earlier call on tensors no longer listed
  /// are removed. An Error, before any hook is set, where a leaf carries another hook.
  void install(std::vector<std::pair<std::string, at::Tensor>> leaves) {
#if MIXPREC_TORCH_AT_LEAST(2, 1)
    for (const auto& [name, t] : leaves) {
      const auto& hook = torch::autograd::impl::post_acc_grad_hooks(t);
      MIXPREC_CHECK(hook == nullptr || dynamic_cast<const Hook*>(hook.get()) != nullptr,
                    "TrainerOptions::step_in_backward: the parameter '", name, "' carries a "
                    "post-accumulate-grad hook of another owner, which this option would "
                    "replace; remove it, or turn step_in_backward off");
    }
    remove();
    for (const auto& [name, t] : leaves) {
      torch::autograd::impl::set_post_acc_grad_hooks(t, std::make_unique<Hook>(state_, name));
    }
    leaves_ = std::move(leaves);
#else
    MIXPREC_CHECK(leaves.empty(), "TrainerOptions::step_in_backward needs LibTorch >= 2.1 "
                  "(post-accumulate-grad hooks); this is LibTorch ", torch_version);
#endif
  }

  /// While the returned guard lives, each hooked leaf whose gradient is accumulated goes to
  /// `step`: until one of them holds inf/NaN or `step` throws, after which the remaining
  /// leaves' gradients are freed unstepped.
  [[nodiscard]] auto arm(StepOne step) {
    state_->step.emplace(step);
    state_->failed.clear();
    state_->error = nullptr;
    state_->stepped = 0;
    struct Armed {
      explicit Armed(State* s) : state(s) {}
      Armed(const Armed&) = delete;
      Armed& operator=(const Armed&) = delete;
      ~Armed() { state->step.reset(); }
      State* state;
    };
    return Armed(state_.get());
  }

  /// After the armed backward pass: rethrows what a step threw, or an Error where a gradient
  /// held inf/NaN (`step`: the optimizer step's number, for the message).
  void finish(std::int64_t step) const {
    if (state_->error) std::rethrow_exception(state_->error);
    MIXPREC_CHECK(state_->failed.empty(), "TrainerOptions::step_in_backward: at optimizer "
                  "step ", step, " the gradient of '", state_->failed, "' holds inf/NaN while "
                  "the loss is finite. The step was taken inside the backward pass: the ",
                  state_->stepped, " tensor(s) whose gradients came before it were updated, it "
                  "and the rest were not. Restore the last checkpoint; the ordinary step "
                  "(step_in_backward off) skips such a step whole");
  }

  /// The tensors stepped by the last armed backward pass.
  std::int64_t stepped() const noexcept { return state_->stepped; }

 private:
  struct State {
    std::optional<StepOne> step;  // armed: the Trainer's step of one leaf
    std::string failed;           // the first leaf whose gradient was not finite
    std::exception_ptr error;     // what a step threw
    std::int64_t stepped = 0;
  };

#if MIXPREC_TORCH_AT_LEAST(2, 1)
  struct Hook final : torch::autograd::PostAccumulateGradHook {
    Hook(std::shared_ptr<State> state, std::string name)
        : state_(std::move(state)), name_(std::move(name)) {}
    void operator()(const torch::autograd::Variable& tensor) override {
      auto& s = *state_;
      if (!s.step) return;  // not the Trainer's backward pass
      if (!s.failed.empty() || s.error) {
        tensor.mutable_grad().reset();
        return;
      }
      try {
        if ((*s.step)(tensor)) {
          ++s.stepped;
        } else {
          s.failed = name_;
        }
      } catch (...) {  // autograd would turn it into a c10::Error: kept, rethrown as it was
        s.error = std::current_exception();
        tensor.mutable_grad().reset();
      }
    }
    std::shared_ptr<State> state_;
    std::string name_;
  };
#endif

  void remove() noexcept {
#if MIXPREC_TORCH_AT_LEAST(2, 1)
    for (const auto& leaf : leaves_) {
      const auto& hook = torch::autograd::impl::post_acc_grad_hooks(leaf.second);
      if (dynamic_cast<const Hook*>(hook.get()) != nullptr) {
        torch::autograd::impl::set_post_acc_grad_hooks(leaf.second, nullptr);
      }
    }
#endif
    leaves_.clear();
  }

  std::shared_ptr<State> state_ = std::make_shared<State>();
  std::vector<std::pair<std::string, at::Tensor>> leaves_;
};

}  // namespace mixprec::detail
