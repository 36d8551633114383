#pragma once
// The checks a Trainer makes before it changes anything (options, model, optimizer, the
// machine), the scaler it builds from its options, and the training-mode guard of evaluate().

#include <mixprec/core/capabilities.hpp>
#include <mixprec/precision/model_cast.hpp>
#include <mixprec/optim/sharded_state.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/optim/fused_adam.hpp>
#include <mixprec/optim/master_weights.hpp>
#include <mixprec/nn/conv.hpp>
#include <mixprec/scaling/scalers.hpp>
#include <mixprec/trainer/lean_step.hpp>
#include <mixprec/trainer/options.hpp>

#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>

#include <atomic>
#include <cctype>
#include <cmath>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace mixprec {

namespace detail {

// The policy's scaler: from TrainerOptions::scaler where that is set, else default-constructed.
template <class P>
typename P::scaler_type make_scaler(const TrainerOptions& options) {
  using Scaler = typename P::scaler_type;
  if constexpr (std::is_same_v<Scaler, NoScaler>) {
    MIXPREC_CHECK(!options.scaler(), "TrainerOptions::scaler is set but ", P::name,
                  " does not scale the loss (its scaler_type is NoScaler); derive a policy "
                  "with `using scaler_type = mixprec::GradScaler;` to use one");
    return Scaler();
  } else if constexpr (std::is_constructible_v<Scaler, const GradScalerOptions&>) {
    return Scaler(options.scaler().value_or(GradScalerOptions()));
  } else {
    static_assert(std::is_default_constructible_v<Scaler>, "mixprec: the policy's scaler_type "
                  "needs a default constructor or one taking mixprec::GradScalerOptions");
    MIXPREC_CHECK(!options.scaler(), "TrainerOptions::scaler is set but ", P::name, "'s "
                  "scaler_type has no constructor taking GradScalerOptions: configure it in its "
                  "default constructor, or give it one");
    return Scaler();
  }
}

// TrainerOptions' values, before anything changes.
inline void check_options(const TrainerOptions& options) {
  MIXPREC_CHECK(options.accumulation_steps() >= 1,
                "TrainerOptions::accumulation_steps must be >= 1, got ",
                options.accumulation_steps());
  MIXPREC_CHECK(options.max_consecutive_skips() >= 0,
                "TrainerOptions::max_consecutive_skips must be >= 0 (0: no limit), got ",
                options.max_consecutive_skips());
  MIXPREC_CHECK(options.gradient_stats().every() >= 0 &&
                    options.gradient_stats().group_depth() >= 0,
                "GradientStatsOptions: every and group_depth must be >= 0 (every 0: off; "
                "group_depth 0: per parameter), got every ", options.gradient_stats().every(),
                ", group_depth ", options.gradient_stats().group_depth());
  if (options.max_grad_norm()) {
    const double norm = *options.max_grad_norm();
    MIXPREC_CHECK(norm > 0 && std::isfinite(norm),
                  "TrainerOptions::max_grad_norm must be finite and > 0, got ", norm);
  }
}

// TrainerOptions::fused_optimizer: an Adam or AdamW whose parameters are fp32.
template <class P>
void check_fused(const TrainerOptions& options, const torch::optim::Optimizer& optimizer) {
  if (!options.fused_optimizer()) return;
  if constexpr (lean_pass_storage<P> || quantized_moments<P>) {
    // On the CPU mixprec's own one-pass kernel (optim/lean_adam.hpp, quantized_adam.hpp) steps
    // Adam and AdamW; elsewhere ATen's fused kernel, between the inflated masters.
    bool cpu = true;
    for (const auto& t : optimizer_tensors(optimizer)) cpu = cpu && t.device().is_cpu();
    if (cpu) {
      MIXPREC_CHECK(adam_kind(optimizer).has_value(), "TrainerOptions::fused_optimizer under ",
                    P::name, " steps Adam or AdamW in one pass over the lean state, so the "
                    "optimizer must be exactly torch::optim::Adam or AdamW (a subclass could "
                    "override step()); got ", c10::demangle(typeid(optimizer).name()),
                    ": turn fused_optimizer off");
      return;
    }
  }
  check_fused_adam(optimizer);
  MIXPREC_CHECK(!P::cast_model || P::master_weights, "TrainerOptions::fused_optimizer: ",
                P::name, " keeps the optimizer's parameters in ", c10::toString(P::low_dtype),
                ", where ATen's fused Adam would divide by the loss scale in that dtype "
                "(65536 is inf in fp16); use MixedO2 (fp32 masters) or the unfused step");
}

// Before anything is cast: a Half policy on a CPU model needs a LibTorch that computes fp16 there.
template <class P>
void check_half_math(const torch::nn::Module& model) {
  if constexpr (P::low_dtype == c10::ScalarType::Half && !cpu_half_math) {
    for (const auto& p : model.parameters()) {
      MIXPREC_CHECK(!p.device().is_cpu(), "Trainer<", P::name, ">: LibTorch ", torch_version,
                    " has no fp16 math on the CPU (matmul, conv, softmax, Adam throw for Half): "
                    "use ", P::name.substr(0, P::name.find('<')), "<at::BFloat16> on the CPU, "
                    "Half on a CUDA device, or LibTorch >= 2.4");
    }
  }
}

// PureHalf<Half> keeps the optimizer state in fp16, where Adam's default eps (1e-8) is 0: once a
// squared gradient underflows, the update divides by zero and the weights turn inf/NaN although
// no gradient did. An eps fp16 can hold avoids that; refuse the others before anything changes.
template <class P>
void check_optimizer_constants(const torch::optim::Optimizer& optimizer) {
  if constexpr (P::cast_model && !P::master_weights && P::low_dtype == c10::ScalarType::Half) {
    for (const auto& group : optimizer.param_groups()) {
      const auto* options = &group.options();
      std::optional<double> eps;
      if (const auto* adam = dynamic_cast<const torch::optim::AdamOptions*>(options)) {
        eps = adam->eps();
      } else if (const auto* adamw = dynamic_cast<const torch::optim::AdamWOptions*>(options)) {
        eps = adamw->eps();
      } else if (const auto* rmsprop = dynamic_cast<const torch::optim::RMSpropOptions*>(options)) {
        eps = rmsprop->eps();
      } else if (const auto* adagrad = dynamic_cast<const torch::optim::AdagradOptions*>(options)) {
        eps = adagrad->eps();
      }
      MIXPREC_CHECK(!eps || static_cast<float>(c10::Half(static_cast<float>(*eps))) > 0.0F,
                    "Trainer<", P::name, ">: the optimizer's eps ", eps.value_or(0.0),
                    " is 0 in fp16, where ", P::name, " keeps the optimizer state: the first "
                    "squared gradient that underflows divides by zero and turns the weights "
                    "inf/NaN. Set eps >= 1e-4 (e.g. AdamOptions(lr).eps(1e-4)), or use "
                    "MixedO2<at::Half> (fp32 master weights and optimizer state)");
    }
  }
}

// The model and optimizer a Trainer<P> can take, before anything changes: a model, fp16 math
// where P needs it, an optimizer mixprec knows, constants P's dtype can hold.
template <class P>
std::shared_ptr<torch::nn::Module> checked_model(std::shared_ptr<torch::nn::Module> model,
                                                 const torch::optim::Optimizer& optimizer) {
  MIXPREC_CHECK(model != nullptr, "Trainer got a null model");
  check_precision_map(*model, P::name);
  check_half_math<P>(*model);
  check_supported_optimizer(optimizer);
  check_optimizer_constants<P>(optimizer);
  return model;
}

// TrainerOptions::step_in_backward: what needs every gradient before the first update is an
// Error, as is a LibTorch without post-accumulate-grad hooks. (Under a lean storage the one-pass
// step on the CPU is checked once the Trainer knows where its tensors are.)
template <class P>
void check_step_in_backward(const TrainerOptions& options) {
  if (!options.step_in_backward()) return;
  const char* const off = ", or turn step_in_backward off";
  MIXPREC_CHECK(post_accumulate_grad_hooks, "TrainerOptions::step_in_backward needs LibTorch "
                ">= 2.1 (autograd's post-accumulate-grad hooks); this is LibTorch ",
                torch_version, ": turn step_in_backward off");
  MIXPREC_CHECK(options.accumulation_steps() == 1, "TrainerOptions::step_in_backward with "
                "accumulation_steps ", options.accumulation_steps(), ": each tensor is stepped "
                "as its gradient is complete, so there is nothing to accumulate into; use "
                "accumulation_steps 1", off);
  MIXPREC_CHECK(!options.max_grad_norm(), "TrainerOptions::step_in_backward with max_grad_norm: "
                "clipping by the global norm needs every gradient before the first update; "
                "drop max_grad_norm, or keep it with the ordinary step (step_in_backward off: "
                "the backward pass, then the clipped step)");
  MIXPREC_CHECK((std::is_same_v<typename P::scaler_type, NoScaler>), "TrainerOptions::"
                "step_in_backward under Trainer<", P::name, ">, which scales its loss: an "
                "overflow found in one tensor's gradient must skip the whole step, which the "
                "tensors stepped before it have taken; use a policy that scales no loss (fp32, "
                "bf16)", off);
  MIXPREC_CHECK(options.distributed() == nullptr, "TrainerOptions::step_in_backward with "
                "TrainerOptions::distributed: not supported yet (the gradients are averaged "
                "across ranks after the backward pass)", off);
  MIXPREC_CHECK(options.gradient_stats().every() == 0, "TrainerOptions::step_in_backward with "
                "gradient_stats: the gradients are freed as they are stepped; turn "
                "gradient_stats off", off);
  MIXPREC_CHECK(!fp8_policy<P>, "TrainerOptions::step_in_backward under Trainer<", P::name,
                ">: fp8's scaling state is checked for inf/NaN with the whole step's gradients",
                off);
}

template <class P>
TrainerOptions checked_options(TrainerOptions options, const torch::optim::Optimizer& optimizer) {
  check_options(options);
  check_step_in_backward<P>(options);
  check_fused<P>(options, optimizer);
  if constexpr (lean_state<P>) check_lean_optimizer<P>(optimizer);
  if (options.settings().shard_optimizer_state) {
    check_shardable(optimizer);
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        // (Held in shards: laid out from its pieces, into storage of its own.)
        MIXPREC_CHECK(p.is_contiguous() || HeldShards::is_placeholder(p),
                      "DistributedOptions::shard_optimizer_state: a parameter "
                      "of shape ", p.sizes(), " and strides ", p.strides(), " is not contiguous "
                      "(the ranks' slices are ranges of its elements in memory order); make it "
                      "contiguous before building the Trainer");
      }
    }
    MIXPREC_CHECK(options.gradient_stats().every() == 0, "TrainerOptions::gradient_stats with "
                  "DistributedOptions::shard_optimizer_state: each rank holds the averaged "
                  "gradients of its slice only; turn one of them off");
  }
  return options;
}

// Whether the warning below was given in this process (tests reset it).
inline std::atomic<bool>& slow_convolutions_warned() {
  static std::atomic<bool> warned{false};
  return warned;
}

// Once per process: a Half policy training convolutions on a CPU where LibTorch computes their
// fp16 weight gradient with oneDNN's reference loop (capabilities.hpp).
template <class P>
void warn_slow_fp16_convolutions(const torch::nn::Module& model, const TrainerOptions& options,
                                 const std::vector<c10::DeviceType>& devices) {
  if constexpr (P::low_dtype == c10::ScalarType::Half) {
    bool on_cpu = false;
    for (const auto device : devices) on_cpu = on_cpu || device == c10::DeviceType::CPU;
    if (!on_cpu) return;
    const auto& cpu = cpu_capabilities();
    if (!cpu.fp16_conv_weight_grad_slow) return;
    const auto convolutions = nn::detail::fp16_weight_grad_convolutions(model);
    if (convolutions.empty()) return;
    if (slow_convolutions_warned().exchange(true)) return;
    {
      std::ostringstream message;
      message << "mixprec: Trainer<" << P::name << "> trains " << convolutions.size()
              << " convolution" << (convolutions.size() == 1 ? "" : "s") << " (";
      for (std::size_t i = 0; i < convolutions.size() && i < 4; ++i) {
        message << (i ? ", " : "") << (convolutions[i].empty() ? "the model" : convolutions[i]);
      }
      message << (convolutions.size() > 4 ? ", ..." : "") << ") in fp16 on " << cpu.model
              << ", which has AVX512-FP16 but no AMX-FP16: LibTorch computes their weight "
              << "gradients with oneDNN's reference loop, " << fp16_conv_cost(cpu)
              << " (a whole CNN step: about 37x). Remedy: declare them mixprec::nn::Conv2d and "
              << "call mixprec::nn::fp32_conv_weight_grads(*model) (weight gradients in fp32, "
              << "about fp32's step time), or train in bf16 (" << P::name.substr(0, P::name.find('<'))
              << "<at::BFloat16>), which this CPU computes fast";
      if (options.on_warning()) {
        options.on_warning()(message.str());
      } else {
        TORCH_WARN(message.str());
      }
    }
  }
}

// Whether the warning below was given in this process (tests reset it).
inline std::atomic<bool>& slow_bf16_warned() {
  static std::atomic<bool> warned{false};
  return warned;
}

// Once per process: a policy computing in bf16 on a CPU without bf16 hardware that LibTorch
// uses (CpuCapabilities::bf16_slow), where bf16 costs time instead of saving it.
template <class P>
void warn_slow_bf16(const TrainerOptions& options, const std::vector<c10::DeviceType>& devices) {
  if constexpr (P::low_dtype == c10::ScalarType::BFloat16) {
    bool on_cpu = false;
    for (const auto device : devices) on_cpu = on_cpu || device == c10::DeviceType::CPU;
    if (!on_cpu) return;
    const auto& cpu = cpu_capabilities();
    if (!cpu.bf16_slow) return;
    if (slow_bf16_warned().exchange(true)) return;
    std::ostringstream message;
    message << "mixprec: Trainer<" << P::name << "> computes in bf16 on the CPU, and "
            << slow_bf16_reason(cpu) << ". bf16 still halves the memory of what it stores in "
            << "bf16; for speed on this CPU train in FullPrecision";
    if (options.on_warning()) {
      options.on_warning()(message.str());
    } else {
      TORCH_WARN(message.str());
    }
  }
}

// Runs `action` when the scope is left by an exception, unless dismissed.
template <class Action>
class OnUnwind {
 public:
  explicit OnUnwind(Action action) : action_(std::move(action)) {}
  ~OnUnwind() {
    if (armed_ && std::uncaught_exceptions() > uncaught_) action_();
  }
  OnUnwind(const OnUnwind&) = delete;
  OnUnwind& operator=(const OnUnwind&) = delete;
  void dismiss() noexcept { armed_ = false; }

 private:
  Action action_;
  int uncaught_ = std::uncaught_exceptions();
  bool armed_ = true;
};

// What is running the user's code (step()'s loss_fn, evaluate()'s forward), if anything: a
// Trainer call from inside it would step, save or load in the middle of a step.
struct Busy {
  Busy(const char*& slot, const char* what) : slot_(slot) { slot_ = what; }
  ~Busy() { slot_ = nullptr; }
  Busy(const Busy&) = delete;
  Busy& operator=(const Busy&) = delete;
  const char*& slot_;
};

// TrainerOptions::max_consecutive_skips: after `limit` skipped steps in a row (the last one
// reported), the run is not training.
inline void check_consecutive_skips(std::int64_t limit, std::int64_t skips,
                                    const StepReport& report, double scale) {
  if (limit <= 0 || skips < limit) return;
  std::ostringstream where;
  where << *report.overflow;
  fail("the last ", skips, " optimizer steps (to step ", report.step, ") were all skipped, the "
       "last for ", where.str(), "; the loss scale is down to ", scale, ": the run is not "
       "training. Find the inf/NaN (TrainerOptions::find_non_finite_op names the first op that "
       "made one), or allow more with TrainerOptions::max_consecutive_skips (0: no limit)");
}

// Sets a module and all its submodules to train or eval mode; on scope exit restores each
// module's own mode, so that a BatchNorm the user froze with eval() stays frozen.
class TrainingModeGuard {
 public:
  TrainingModeGuard(torch::nn::Module& module, bool training)
      : module_(module), was_training_(module.is_training()), submodules_(module.modules(false)) {
    for (const auto& m : submodules_) submodule_was_training_.push_back(m->is_training());
    module_.train(training);
  }
  ~TrainingModeGuard() {
    // train() is recursive; submodules are listed parents first, so each call is corrected
    // by those of the descendants that follow it.
    if (module_.is_training() != was_training_) module_.train(was_training_);
    for (std::size_t i = 0; i < submodules_.size(); ++i) {
      const bool was = submodule_was_training_[i];
      if (submodules_[i]->is_training() != was) submodules_[i]->train(was);
    }
  }
  TrainingModeGuard(const TrainingModeGuard&) = delete;
  TrainingModeGuard& operator=(const TrainingModeGuard&) = delete;

 private:
  torch::nn::Module& module_;
  bool was_training_;
  std::vector<std::shared_ptr<torch::nn::Module>> submodules_;  // pre-order
  std::vector<bool> submodule_was_training_;
};

}  // namespace detail

}  // namespace mixprec
