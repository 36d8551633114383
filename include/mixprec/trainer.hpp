#pragma once
/// Trainer<P>: the training step of a precision policy, with loss scaling, fp32 master weights,
/// accumulation, fused clipping and checkpoints.
///
///   auto model = std::make_shared<Net>();
///   torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
///   mixprec::Trainer<mixprec::MixedO2<at::BFloat16>> trainer(
///       model, optimizer, mixprec::TrainerOptions().max_grad_norm(1.0));
///   for (auto& [x, y] : batches) {
///     auto report = trainer.step([&] {
///       return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
///     });
///     if (report.status == mixprec::StepStatus::skipped) log("inf/NaN: step skipped");
///   }
///   auto logits = trainer.evaluate([&] { return model->forward(trainer.cast_input(x_test)); });
///   trainer.save("run.ckpt");

#include <mixprec/autocast.hpp>
#include <mixprec/capabilities.hpp>
#include <mixprec/concepts.hpp>
#include <mixprec/detail/checkpoint_file.hpp>
#include <mixprec/detail/model_cast.hpp>
#include <mixprec/diagnostics.hpp>
#include <mixprec/distributed.hpp>
#include <mixprec/error.hpp>
#include <mixprec/fused_adam.hpp>
#include <mixprec/master_weights.hpp>
#include <mixprec/nn.hpp>
#include <mixprec/policy.hpp>
#include <mixprec/scaler.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Type.h>
#include <torch/arg.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/serialize.h>
#include <torch/ordered_dict.h>
#include <torch/serialize/archive.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <unordered_set>
#include <utility>
#include <vector>

namespace mixprec {

/// What a Trainer::step call did.
enum class StepStatus {
  stepped,       ///< the optimizer stepped
  skipped,       ///< inf or NaN in the loss or gradients: no update, the scale backed off
  accumulating,  ///< a micro-batch was added; the optimizer steps after accumulation_steps
};

/// "stepped", "skipped" or "accumulating", for logs.
inline std::ostream& operator<<(std::ostream& out, StepStatus status) {
  switch (status) {
    case StepStatus::stepped: return out << "stepped";
    case StepStatus::skipped: return out << "skipped";
    case StepStatus::accumulating: return out << "accumulating";
  }
  return out << "StepStatus(" << static_cast<int>(status) << ")";
}

/// The result of one Trainer::step call.
struct StepReport {
  StepStatus status = StepStatus::accumulating;
  at::Tensor loss;                   ///< the micro-batch loss, fp32, detached, unscaled
  double scale = 1.0;                ///< the loss scale this step used
  std::optional<double> grad_norm;   ///< total gradient norm, when clipping (max_grad_norm)
  std::int64_t step = 0;             ///< optimizer steps so far (taken or skipped)
  /// On a skipped step: where the inf/NaN was (the loss, which parameters' gradients).
  std::optional<Overflow> overflow;
  /// With TrainerOptions::find_non_finite_op: the first op of this micro-batch's forward pass
  /// whose output held inf/NaN, if one did.
  std::optional<NonFiniteOp> non_finite_op;
  /// With TrainerOptions::gradient_stats, on the steps it counts: fp16's view of the gradients.
  std::optional<GradientStats> gradient_stats;
  bool stepped() const noexcept { return status == StepStatus::stepped; }
};

/// Counters of a Trainer.
struct TrainerStats {
  std::int64_t steps = 0;          ///< optimizer steps taken or skipped
  std::int64_t skipped_steps = 0;  ///< of which skipped for inf/NaN
  std::int64_t micro_batches = 0;  ///< step() calls
  double scale = 1.0;              ///< the current loss scale
  /// The latest TrainerOptions::gradient_stats counted, if any.
  std::optional<GradientStats> gradient_stats;
};

/// Settings of a Trainer.
struct TrainerOptions {
  /// Micro-batches per optimizer step; their gradients are averaged.
  TORCH_ARG(std::int64_t, accumulation_steps) = 1;
  /// Clip the total L2 norm of the unscaled gradients to this value.
  TORCH_ARG(std::optional<double>, max_grad_norm) = std::nullopt;
  /// Options of the policy's scaler; an error for a policy whose scaler is NoScaler.
  TORCH_ARG(std::optional<GradScalerOptions>, scaler) = std::nullopt;
  /// Called after every step() with its report: steps, skips and accumulation alike.
  TORCH_ARG(std::function<void(const StepReport&)>, on_step) = nullptr;
  /// Steps a torch::optim::Adam or AdamW through ATen's fused kernel, with the unscale (and the
  /// clip factor) folded into it: one pass over the parameters instead of about ten. Needs
  /// LibTorch >= 2.4 and fp32 optimizer parameters (every policy but PureHalf); results equal
  /// the unfused step's up to rounding (docs/guide.md, "Fused Adam").
  TORCH_ARG(bool, fused_optimizer) = false;
  /// Data-parallel training over a c10d process group (docs/distributed.md): gradients are
  /// averaged across ranks before unscaling, every rank steps or skips alike, rank 0 writes
  /// the checkpoints. Every rank must construct its Trainer and call step/save/load alike.
  TORCH_ARG(std::optional<DistributedOptions>, distributed) = std::nullopt;
  /// Debugging: watch every op of each forward pass (loss_fn) and report the first whose output
  /// held inf/NaN in StepReport::non_finite_op. Slow: it reads every op's output (on a device,
  /// a synchronisation per op); docs/diagnostics.md.
  TORCH_ARG(bool, find_non_finite_op) = false;
  /// Every N optimizer steps, count per parameter (or module prefix) how many gradient elements
  /// fp16 would flush to zero or overflow at the loss scale: StepReport::gradient_stats and
  /// TrainerStats::gradient_stats. One extra read of the gradients on those steps only.
  TORCH_ARG(GradientStatsOptions, gradient_stats) = {};
  /// Receives the Trainer's warnings (a precision that will be slow on this machine, ...);
  /// unset, they go to LibTorch's warning handler (TORCH_WARN: stderr unless the program set
  /// c10::WarningUtils' handler). mixprec never writes to stdout.
  TORCH_ARG(std::function<void(const std::string&)>, on_warning) = nullptr;
  /// After this many optimizer steps in a row skipped for inf/NaN, step() throws an Error
  /// naming where the last one was (its StepReport::overflow), after reporting that step.
  /// A run whose loss scale only halves (a NaN in the data, a diverged model) is not training.
  /// 64 halvings take the default initial scale 2^16 to 2^-48, far below where any gradient
  /// survives; a healthy run skips a few steps in a row at most (log2(init_scale / the scale it
  /// needs) at the start, one at a time later). 0: no limit.
  TORCH_ARG(std::int64_t, max_consecutive_skips) = 64;
};

namespace detail {

/// The optimizer's C++ type, as checkpoints record it: "torch::optim::AdamW".
inline std::string optimizer_type(const torch::optim::Optimizer& optimizer) {
  return c10::demangle(typeid(optimizer).name());
}

/// Adam's or AdamW's amsgrad option; nullopt for the other optimizers.
inline std::optional<bool> amsgrad_of(const torch::optim::OptimizerOptions& options) {
  if (const auto* adam = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
    return adam->amsgrad();
  }
  if (const auto* adamw = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    return adamw->amsgrad();
  }
  return std::nullopt;
}

/// The CPU random stream of a rank that a checkpoint did not have (a run resumed on more ranks
/// than it was saved with): a generator seeded with splitmix64(d ^ rank), where d is the first
/// 64-bit draw of rank 0's saved stream. Distinct for every rank, the same on every resume.
inline at::Tensor derived_rng_state(const at::Tensor& rank0_state, int rank) {
  auto rank0 = at::make_generator<at::CPUGeneratorImpl>();
  rank0.set_state(rank0_state);
  std::uint64_t z =
      rank0.get<at::CPUGeneratorImpl>()->random64() ^ static_cast<std::uint64_t>(rank);
  z += 0x9e3779b97f4a7c15ULL;  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return at::make_generator<at::CPUGeneratorImpl>(z).get_state();
}

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
              << "gradients with oneDNN's reference loop, measured here at "
              << cpu.fp16_conv_weight_grad_ratio << "x fp32's time (a whole CNN step: about "
              << "37x). Remedy: declare them mixprec::nn::Conv2d and call "
              << "mixprec::nn::fp32_conv_weight_grads(*model) (weight gradients in fp32, about "
              << "fp32's step time), or train in bf16 (" << P::name.substr(0, P::name.find('<'))
              << "<at::BFloat16>), which this CPU computes fast";
      if (options.on_warning()) {
        options.on_warning()(message.str());
      } else {
        TORCH_WARN(message.str());
      }
    }
  }
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

/// Trains `model` with `optimizer` under precision policy P (see policy.hpp).
/// The user's own values saved in a Trainer's checkpoint (the epoch, the position in the data),
/// by name: anything an IValue holds (ints, doubles, bools, strings, tensors, lists of them).
using UserValues = std::map<std::string, c10::IValue>;

/// The file formats of Trainer::save_fp32.
enum class WeightsFormat {
  libtorch,  ///< Module::save's archive: torch::load(fp32_model, path) in C++
  pickle,    ///< pickled (name, tensor) pairs: dict(torch.load(path)) in Python
};

template <class P>
class Trainer {
  static_assert(require_policy<P>);
  static_assert(LossScaler<typename P::scaler_type>,
                "mixprec: the policy's scaler_type must satisfy mixprec::LossScaler: "
                "get_scale(), update_scale(bool found_inf), state_dict() and "
                "load_state_dict(dict), movable (mixprec/concepts.hpp)");

 public:
  using policy = P;
  using scaler_type = typename P::scaler_type;

  /// Casts the model as P says and, for MixedO2, rebinds the optimizer to fp32 master weights.
  /// The model must be fp32, trained by no other live Trainer, and the optimizer built on its
  /// parameters (each in one group; a tensor listed twice in a group is kept once), before any
  /// step. Param groups added later are adopted at the next step.
  Trainer(std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer,
          TrainerOptions options = {})
      : model_(std::move(model)),
        optimizer_(&optimizer),
        options_(std::move(options)),
        scaler_(detail::make_scaler<P>(options_)) {
    MIXPREC_CHECK(model_ != nullptr, "Trainer got a null model");
    detail::check_half_math<P>(*model_);
    detail::check_supported_optimizer(optimizer);
    detail::check_optimizer_constants<P>(optimizer);
    MIXPREC_CHECK(options_.accumulation_steps() >= 1,
                  "TrainerOptions::accumulation_steps must be >= 1, got ",
                  options_.accumulation_steps());
    MIXPREC_CHECK(options_.max_consecutive_skips() >= 0,
                  "TrainerOptions::max_consecutive_skips must be >= 0 (0: no limit), got ",
                  options_.max_consecutive_skips());
    MIXPREC_CHECK(options_.gradient_stats().every() >= 0 &&
                      options_.gradient_stats().group_depth() >= 0,
                  "GradientStatsOptions: every and group_depth must be >= 0 (every 0: off; "
                  "group_depth 0: per parameter), got every ", options_.gradient_stats().every(),
                  ", group_depth ", options_.gradient_stats().group_depth());
    if (options_.max_grad_norm()) {
      const double norm = *options_.max_grad_norm();
      MIXPREC_CHECK(norm > 0 && std::isfinite(norm),
                    "TrainerOptions::max_grad_norm must be finite and > 0, got ", norm);
    }
    const auto named = model_->named_parameters();
    MIXPREC_CHECK(named.size() > 0, "the model has no parameters: nothing to train");
    // Each tensor once (tied weights are listed once per name). Claimed before the dtype check:
    // a model that a live O2/O3 Trainer has cast is that Trainer's, not a Low model of the user's.
    const auto params = detail::unique_tensors(model_->parameters());
    auto claim = detail::ModelClaim::acquire(params, P::name);
    for (const auto& item : named) {
      const auto dtype = item.value().scalar_type();
      MIXPREC_CHECK(!at::isFloatingType(dtype) || dtype == at::kFloat, "parameter '", item.key(),
                    "' is ", dtype, ", but Trainer<", P::name, "> expects an fp32 model and "
                    "casts it itself: build the model in fp32 (drop the ->to(", dtype, "))");
      const auto device = item.value().device();
      MIXPREC_CHECK(device.is_cpu() || device.is_cuda(), "parameter '", item.key(), "' is on ",
                    device, ", but Trainer<", P::name, "> trains CPU and CUDA tensors (autocast "
                    "and the loss scaler know no other device): move the model with "
                    "->to(torch::kCPU) or ->to(torch::kCUDA)");
    }
    if (options_.fused_optimizer()) {
      check_fused_adam(optimizer);
      MIXPREC_CHECK(!P::cast_model || P::master_weights, "TrainerOptions::fused_optimizer: ",
                    P::name, " keeps the optimizer's parameters in ", c10::toString(P::low_dtype),
                    ", where ATen's fused Adam would divide by the loss scale in that dtype "
                    "(65536 is inf in fp16); use MixedO2 (fp32 masters) or the unfused step");
    }
    if constexpr (P::master_weights) {
      MasterWeights::check_rebindable(params, optimizer);
      detail::check_dense_gradients(*model_, detail::optimizer_tensors(optimizer), P::name);
    } else {
      MasterWeights::check_params_of(params, optimizer);
    }
    device_types_ = autocast_device_types(params);
    // All checks passed: from here on the model and optimizer change.
    claim_ = std::move(claim);
    params_ = params;
    // Collective: the same model on every rank, then rank 0's values everywhere (before the
    // masters are made from them).
    if (options_.distributed()) {
      data_parallel_ = std::make_unique<DataParallel>(*model_, *options_.distributed());
    }
    if constexpr (P::cast_model) {
      std::vector<at::Tensor> fp32_values;
      if constexpr (P::master_weights) {
        for (const auto& p : params) fp32_values.push_back(p.detach().clone());
      }
      detail::cast_model(*model_, P::low_dtype, P::keep_norm_fp32);
      if constexpr (P::master_weights) masters_.emplace(params, fp32_values, optimizer);
    }
    detail::dedupe_param_groups(optimizer);  // the optimizer steps each tensor once
    // Adagrad's state, made by its constructor, fits the cast tensors (the masters' in bind).
    if constexpr (!P::master_weights) detail::fit_construction_state(optimizer);
    group_sizes_ = detail::group_sizes(optimizer);
    if (data_parallel_) bind_data_parallel();
    detail::warn_slow_fp16_convolutions<P>(*model_, options_, device_types_);
  }

  /// For a ModuleHolder such as torch::nn::Sequential.
  template <class Impl>
  Trainer(torch::nn::ModuleHolder<Impl>& model, torch::optim::Optimizer& optimizer,
          TrainerOptions options = {})
      : Trainer(std::static_pointer_cast<torch::nn::Module>(model.ptr()), optimizer,
                std::move(options)) {}

  /// One micro-batch: runs loss_fn (the forward pass, returning a scalar loss) under the
  /// policy's autocast, backpropagates the scaled loss, and every accumulation_steps calls
  /// unscales, clips, steps (or skips on inf/NaN) and updates the scale.
  template <class LossFn>
  StepReport step(LossFn&& loss_fn) {
    check_not_busy("step");
    const Busy busy(busy_, "step()'s loss_fn");
    ++calls_;  // first: a call that throws counts too (see agree_across_ranks)
    // The scaler's scale for this step, checked before anything changes (the forward pass
    // included); the micro-batches of one step share it, as their gradients add up.
    if (pending_ == 0) {
      engine_.use_scale(scaler_.get_scale());
    } else {
      // Compared as the fp32 values the step uses: a scale like 1000.1 is not an fp32 number.
      MIXPREC_CHECK(static_cast<float>(scaler_.get_scale()) ==
                        static_cast<float>(engine_.get_scale()), "the "
                    "scaler's scale changed from ", engine_.get_scale(), " to ",
                    scaler_.get_scale(), " between micro-batches of one step: set it between "
                    "optimizer steps");
    }
    // Comparing the groups' sizes is cheap; a group added since is adopted before the forward
    // pass, which must already see its tensors cast.
    if (!detail::same_group_sizes(*optimizer_, group_sizes_)) adopt_param_groups();
    // Data parallel, as DDP: rank 0's buffers before the first forward of each step.
    if (pending_ == 0) sync_buffers();
    buffers_synced_ = false;  // this forward may update them (BatchNorm's running statistics)
    at::Tensor loss;
    std::optional<NonFiniteOp> non_finite_op;
    {
      std::optional<NonFiniteOpFinder> finder;
      if (options_.find_non_finite_op()) finder.emplace();
      const PolicyAutocast<P> guard(device_types_);
      loss = std::invoke(std::forward<LossFn>(loss_fn));
      if (finder) non_finite_op = finder->first();
    }
    MIXPREC_CHECK(loss.defined(), "loss_fn returned an undefined tensor: return the loss");
    MIXPREC_CHECK(loss.numel() == 1, "loss_fn must return a scalar loss, got shape ",
                  loss.sizes(), ": reduce it, e.g. with .mean()");
    MIXPREC_CHECK(at::isFloatingType(loss.scalar_type()), "loss_fn must return a floating-point "
                  "loss, got ", loss.scalar_type());
    MIXPREC_CHECK(loss.requires_grad(), "the loss does not require grad: compute it from the "
                  "model's output inside loss_fn, not under NoGradGuard");
    if (pending_ == 0) zero_grads();
    // fp32 before scaling: a bf16/fp16 loss times 65536 loses digits or overflows.
    const auto loss32 = loss.scalar_type() == at::kFloat && loss.dim() == 0
                            ? loss
                            : loss.to(at::kFloat).reshape({});
    const auto n = options_.accumulation_steps();
    const auto to_backprop = n > 1 ? loss32 / static_cast<double>(n) : loss32;
    StepReport report;
    report.scale = engine_.get_scale();
    report.non_finite_op = std::move(non_finite_op);
    // Data parallel: gradients travel during the backward pass of the last micro-batch only.
    const bool reduce = data_parallel_ && pending_ + 1 == n;
    if (data_parallel_) {
      if (reduce && trainable_changed()) bind_data_parallel();
      data_parallel_->prepare(reduce);
    }
    engine_.scale(to_backprop).backward();
    // The averages land in the holders' gradients: under MixedO2 the fp32 masters', which
    // then hold the accumulated micro-batches too.
    if (reduce) data_parallel_->finish();
    // Micro-batch gradients sum in the fp32 master gradients, not in the Low model gradients.
    if (masters_ && n > 1 && !reduce) masters_->accumulate_grads();
    report.loss = loss32.detach();
    loss_sum_ = loss_sum_.defined() ? loss_sum_ + report.loss : report.loss;
    ++stats_.micro_batches;
    if (++pending_ < n) {
      report.step = stats_.steps;
      notify(report);
      return report;
    }
    pending_ = 0;
    const auto every = options_.gradient_stats().every();
    if (every > 0 && (stats_.steps + 1) % every == 0) {
      report.gradient_stats = gradient_stats(stats_.steps + 1, report.scale);
      stats_.gradient_stats = report.gradient_stats;
    }
    detail::UnscalePlan unscale;
    unscale.max_grad_norm(options_.max_grad_norm());
    if (masters_ && n == 1 && !data_parallel_) {
      unscale.grads_from(masters_->grad_sources());  // else in place
    }
    if (data_parallel_) unscale.agree([this](at::Tensor& found) { agree_across_ranks(found); });
    // A NaN loss can have finite gradients. On the CPU the check is a read of one float; on a
    // device it joins the gradients' inf check, without a synchronisation.
    if (!loss_sum_.device().is_cpu() || !std::isfinite(loss_sum_.item<double>())) {
      unscale.also_check(loss_sum_);
    }
    const auto losses = std::move(loss_sum_);
    loss_sum_ = at::Tensor();
    bool stepped = false;
    try {
      if (options_.fused_optimizer()) {
        const auto result = engine_.step_fused(*optimizer_, unscale, [this](const at::Tensor& scale) {
          fused_adam_step(*optimizer_, scale);
        });
        report.grad_norm = result.grad_norm;
        stepped = result.stepped;
      } else {
        report.grad_norm = engine_.unscale_planned(*optimizer_, unscale);
        stepped = engine_.step(*optimizer_);
      }
    } catch (...) {
      engine_.reset_stages();  // leave the step usable for the next one
      throw;
    }
    engine_.reset_stages();
    scaler_.update_scale(/*found_inf=*/!stepped);
    if (stepped) {
      if (masters_) masters_->copy_to_model();
      // The weights changed: casts cached by an enclosing autocast scope are stale now.
      at::autocast::clear_cache();
    }
    ++stats_.steps;
    consecutive_skips_ = stepped ? 0 : consecutive_skips_ + 1;
    if (!stepped) {
      ++stats_.skipped_steps;
      report.overflow = find_overflow(losses);
    }
    report.status = stepped ? StepStatus::stepped : StepStatus::skipped;
    report.step = stats_.steps;
    notify(report);
    const auto limit = options_.max_consecutive_skips();
    if (limit > 0 && consecutive_skips_ >= limit) {
      std::ostringstream where;
      where << *report.overflow;
      detail::fail("the last ", consecutive_skips_, " optimizer steps (to step ", stats_.steps,
                   ") were all skipped, the last for ", where.str(), "; the loss scale is down "
                   "to ", scaler_.get_scale(), ": the run is not training. Find the inf/NaN "
                   "(TrainerOptions::find_non_finite_op names the first op that made one), or "
                   "allow more with TrainerOptions::max_consecutive_skips (0: no limit)");
    }
    return report;
  }

  /// Runs `forward` with every module in eval mode, without grad, in the policy's precision;
  /// then restores each module's own mode. Data parallel: the first evaluate() after a step
  /// copies rank 0's buffers to every rank first (as DDP does before an evaluation forward), so
  /// that every rank evaluates with the same BatchNorm statistics; call it on every rank.
  template <class Forward>
  auto evaluate(Forward&& forward) {
    check_not_busy("evaluate");
    const Busy busy(busy_, "evaluate()'s forward");
    sync_buffers();
    at::NoGradGuard no_grad;
    detail::TrainingModeGuard mode(*model_, /*training=*/false);
    const PolicyAutocast<P> guard(device_types_);
    return std::invoke(std::forward<Forward>(forward));
  }

  /// A batch in the policy's compute dtype: Low for MixedO2/PureHalf; unchanged for O0/O1 and
  /// for integer tensors (token ids, labels).
  at::Tensor cast_input(const at::Tensor& x) const {
    if constexpr (!P::cast_model) {
      return x;
    } else {
      return x.defined() && at::isFloatingType(x.scalar_type()) ? x.to(P::low_dtype) : x;
    }
  }

  scaler_type& scaler() noexcept { return scaler_; }
  const scaler_type& scaler() const noexcept { return scaler_; }
  torch::nn::Module& model() noexcept { return *model_; }
  torch::optim::Optimizer& optimizer() noexcept { return *optimizer_; }
  const TrainerOptions& options() const noexcept { return options_; }

  /// The fp32 master weights (MixedO2), one per model tensor the optimizer holds, in the
  /// optimizer's order (a param group added later at the end); empty for the other policies.
  std::vector<at::Tensor> master_weights() const {
    return masters_ ? masters_->masters() : std::vector<at::Tensor>{};
  }

  TrainerStats stats() const {
    auto s = stats_;
    s.scale = scaler_.get_scale();
    return s;
  }

  /// Writes model, optimizer (state and param-group options), scaler, master weights, counters
  /// and the RNG states (CPU, and each CUDA device's) to `path` atomically, with a checksum that
  /// load() verifies. Call between optimizer steps, not in the middle of an accumulation.
  /// Data parallel: every rank calls it; rank 0 writes (with every rank's CPU RNG state) and
  /// the others return once it has, with its Error if it failed.
  /// `user` goes into the same file (the epoch, the position in the data: anything an IValue
  /// holds), and load() returns it.
  void save(const std::string& path, const UserValues& user = {}) const {
    check_saveable(user);
    const auto [cpu_rngs, cuda_rngs] = gather_rngs();
    if (!data_parallel_) return write(path, cpu_rngs, cuda_rngs, user);
    auto& group = *data_parallel_;
    std::exception_ptr failure;
    if (group.rank() == 0) {
      try {
        write(path, cpu_rngs, cuda_rngs, user);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    const bool failed = group.any(failure != nullptr);
    if (failure) std::rethrow_exception(failure);
    MIXPREC_CHECK(!failed, "rank ", group.rank(), ": rank 0 could not write checkpoint '", path,
                  "' (its Error says why)");
  }

  /// Restores a checkpoint written by save() of a Trainer of the same policy, model and
  /// optimizer: the optimizer's state and param-group options become the saved ones exactly,
  /// and an accumulation in progress is discarded. Anything else (a missing, truncated,
  /// corrupted or foreign file; another model or optimizer) throws mixprec::Error and changes
  /// nothing, but for a param group added since the last step: that is adopted first, as the
  /// next step() would adopt it. Data parallel: every rank loads the file (rank 0's path on a
  /// shared file system); if any rank cannot, every rank throws and none changes. Returns the
  /// user values saved with it (none: empty).
  UserValues load(const std::string& path) {
    return load_with(path, [&](auto& commit) { return load_file(path, commit); });
  }

  /// save() into an archive of the caller's (LibTorch's composition: `torch::save(trainer,
  /// path)` and `archive << trainer` go through here): the same contents, without the atomic
  /// file and its checksum, which the caller's archive does not have. Data parallel: every rank
  /// calls it, and every rank's archive holds all ranks' RNG states.
  void save(torch::serialize::OutputArchive& archive, const UserValues& user = {}) const {
    check_saveable(user);
    const auto [cpu_rngs, cuda_rngs] = gather_rngs();
    try {
      fill(archive, cpu_rngs, cuda_rngs, user);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      detail::fail("cannot write the checkpoint archive: ", detail::message_of(e));
    }
  }

  /// load() from an archive of the caller's (`torch::load(trainer, path)`, `archive >> trainer`).
  UserValues load(torch::serialize::InputArchive& archive) {
    return load_with("the archive", [&](auto& commit) {
      return checked_or_error("the archive",
                              [&] { return load_checked(archive, "the archive", commit); });
    });
  }

  /// The fp32 weights of the model by state_dict name: the masters under MixedO2 (not their
  /// rounding in the model), the parameters cast to fp32 otherwise, and the buffers (floating
  /// ones in fp32). What an fp32 model for inference or another framework takes.
  torch::OrderedDict<std::string, at::Tensor> fp32_state_dict() const {
    torch::OrderedDict<std::string, at::Tensor> result;
    for (const auto& item : model_->named_parameters()) {
      result.insert(item.key(), fp32_of(item.value()));
    }
    for (const auto& item : model_->named_buffers()) {
      result.insert(item.key(), fp32_of(item.value()));
    }
    return result;
  }

  /// Writes fp32_state_dict() to `path` atomically: WeightsFormat::libtorch as Module::save
  /// writes a model, so that `torch::load(fp32_model, path)` reads it into a model of the same
  /// architecture built in fp32; WeightsFormat::pickle as a tuple of (name, tensor) pairs, which
  /// Python reads with `model.load_state_dict(dict(torch.load(path)))`.
  void save_fp32(const std::string& path, WeightsFormat format = WeightsFormat::libtorch) const {
    check_not_busy("save_fp32");
    try {
      detail::AtomicFile file(path);
      if (format == WeightsFormat::pickle) {
        // Pairs in a tuple, not a dict: LibTorch tags a dict's type with a global that
        // Python's torch.load(weights_only=True), its default since 2.6, refuses.
        std::vector<c10::IValue> pairs;
        for (const auto& item : fp32_state_dict()) {
          pairs.emplace_back(
              c10::ivalue::Tuple::create({c10::IValue(item.key()), c10::IValue(item.value())}));
        }
        const auto bytes =
            torch::pickle_save(c10::IValue(c10::ivalue::Tuple::create(std::move(pairs))));
        file.write(bytes.data(), bytes.size());
      } else {
        torch::serialize::OutputArchive archive;
        write_fp32_module(*model_, archive);
        archive.save_to([&](const void* data, std::size_t size) -> std::size_t {
          return file.write(data, size) ? size : 0;
        });
      }
      file.commit();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      detail::fail("cannot write fp32 weights to '", path, "': ", detail::message_of(e));
    }
  }

 private:
  // load(path) and load(archive): the data-parallel vote around `load_checked_with(commit)`.
  template <class Load>
  UserValues load_with(const std::string& source, Load&& load_checked_with) {
    check_not_busy("load");
    // A param group added since the last step is adopted first, as step() would: the checkpoint
    // of a run that had adopted it holds its masters and state, which must not be dropped.
    if (!detail::same_group_sizes(*optimizer_, group_sizes_)) adopt_param_groups();
    bool voted = false;  // data parallel: whether this rank has said if it can load
    auto commit = [&] {
      if (!data_parallel_) return;
      voted = true;
      MIXPREC_CHECK(!data_parallel_->any(false), "rank ", data_parallel_->rank(), ": another "
                    "rank could not load checkpoint '", source, "' (its Error says why); "
                    "nothing was changed on any rank");
    };
    try {
      return load_checked_with(commit);
    } catch (...) {
      if (data_parallel_ && !voted) (void)data_parallel_->any(true);
      throw;
    }
  }

  template <class Commit>
  UserValues load_file(const std::string& path, Commit& commit) {
    const auto bytes = detail::read_checkpoint(path);
    torch::serialize::InputArchive archive;
    try {
      archive.load_from(bytes.data(), bytes.size());
    } catch (const std::exception& e) {
      detail::fail("cannot read checkpoint '", path, "': ", detail::message_of(e));
    }
    return checked_or_error(path, [&] { return load_checked(archive, path, commit); });
  }

  // Whatever LibTorch throws while reading an archive becomes a mixprec::Error naming it.
  template <class Read>
  static UserValues checked_or_error(const std::string& source, Read&& read) {
    try {
      return read();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {  // c10::Error, or torch::jit::ErrorReport, which is not
      detail::fail("checkpoint '", source, "' does not fit this trainer: ",
                   detail::message_of(e));
    }
  }

  void check_saveable(const UserValues& user) const {
    check_not_busy("save");
    MIXPREC_CHECK(pending_ == 0, "save() in the middle of an accumulation (", pending_, " of ",
                  options_.accumulation_steps(), " micro-batches): save after a step");
    for (const auto& [key, value] : user) {
      MIXPREC_CHECK(!key.empty() && !value.isNone(), "save(): user value '", key, "' needs a "
                    "non-empty name and a value (an int, double, bool, string, tensor or a list "
                    "of them)");
    }
  }

  // Data parallel: every rank's CPU RNG state, and CUDA's of its model's device, in rank order
  // (collective); one process: none (fill() reads this process's own).
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> gather_rngs() const {
    if (!data_parallel_) return {};
    auto& group = *data_parallel_;
    auto cpu_rngs = group.all_gather(cpu_rng_state().to(group.device()));
    std::vector<at::Tensor> cuda_rngs;  // each rank's, for the device its model is on
    if (group.device().is_cuda()) {
      auto generator = cuda_generator(static_cast<std::size_t>(group.device().index()));
      at::Tensor state;
      {
        std::lock_guard<std::mutex> lock(generator.mutex());
        state = generator.get_state();
      }
      cuda_rngs = group.all_gather(state.to(group.device()));
    }
    return {std::move(cpu_rngs), std::move(cuda_rngs)};
  }

  at::Tensor fp32_of(const at::Tensor& t) const {
    const auto master = masters_ ? masters_->master_of(t) : at::Tensor();
    const auto& value = master.defined() ? master : t;
    if (!value.is_floating_point()) return value.detach().clone();
    return value.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  }

  // Module::save's layout (own parameters, own buffers, one archive per child), fp32 values.
  void write_fp32_module(const torch::nn::Module& module,
                         torch::serialize::OutputArchive& archive) const {
    for (const auto& item : module.named_parameters(/*recurse=*/false)) {
      archive.write(item.key(), fp32_of(item.value()));
    }
    for (const auto& item : module.named_buffers(/*recurse=*/false)) {
      archive.write(item.key(), fp32_of(item.value()), /*is_buffer=*/true);
    }
    for (const auto& child : module.named_children()) {
      torch::serialize::OutputArchive child_archive;
      write_fp32_module(*child.value(), child_archive);
      archive.write(child.key(), child_archive);
    }
  }

  void write(const std::string& path, const std::vector<at::Tensor>& cpu_rngs,
             const std::vector<at::Tensor>& cuda_rngs, const UserValues& user) const {
    try {
      torch::serialize::OutputArchive archive;
      fill(archive, cpu_rngs, cuda_rngs, user);
      detail::save_checkpoint(archive, path);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      detail::fail("cannot write checkpoint '", path, "': ", detail::message_of(e));
    }
  }

  void fill(torch::serialize::OutputArchive& archive, const std::vector<at::Tensor>& cpu_rngs,
            const std::vector<at::Tensor>& cuda_rngs, const UserValues& user) const {
    archive.write("mixprec.policy", c10::IValue(std::string(P::name)));
    archive.write("mixprec.optimizer", c10::IValue(detail::optimizer_type(*optimizer_)));
    archive.write("mixprec.fused_optimizer", c10::IValue(options_.fused_optimizer()));
    archive.write("mixprec.counters", at::tensor({stats_.steps, stats_.skipped_steps,
                                                  stats_.micro_batches}, at::kLong));
    for (const auto& item : model_->named_parameters()) {
      archive.write("model." + item.key(), item.value().detach());
    }
    for (const auto& item : model_->named_buffers()) {
      archive.write("model." + item.key(), item.value(), /*is_buffer=*/true);
    }
    const auto masters = master_weights();
    for (std::size_t i = 0; i < masters.size(); ++i) {
      archive.write("masters." + std::to_string(i), masters[i].detach());
    }
    torch::serialize::OutputArchive optimizer_archive;
    optimizer_->save(optimizer_archive);
    archive.write("optimizer", optimizer_archive);
    // LibTorch 1.13 does not restore param-group options (a scheduler's lr): record them, and
    // the group sizes, which load() checks before it touches the optimizer.
    torch::serialize::OutputArchive groups_archive;
    std::vector<std::int64_t> group_sizes;
    for (std::size_t g = 0; g < optimizer_->param_groups().size(); ++g) {
      const auto& group = optimizer_->param_groups()[g];
      group_sizes.push_back(static_cast<std::int64_t>(group.params().size()));
      torch::serialize::OutputArchive options_archive;
      group.options().serialize(options_archive);
      groups_archive.write(std::to_string(g), options_archive);
    }
    groups_archive.write("sizes", at::tensor(group_sizes, at::kLong));
    archive.write("optimizer.groups", groups_archive);
    archive.write("scaler", c10::IValue(scaler_.state_dict()));
    archive.write("rng.cpu", cpu_rng_state());
    for (std::size_t r = 1; r < cpu_rngs.size(); ++r) {
      archive.write("rng.cpu.rank" + std::to_string(r), cpu_rngs[r].cpu());
    }
    for (std::size_t r = 1; r < cuda_rngs.size(); ++r) {
      archive.write("rng.cuda.rank" + std::to_string(r), cuda_rngs[r].cpu());
    }
    for (std::size_t d = 0; d < cuda_devices(); ++d) {
      auto generator = cuda_generator(d);
      std::lock_guard<std::mutex> lock(generator.mutex());
      archive.write("rng.cuda." + std::to_string(d), generator.get_state());
    }
    c10::List<std::string> keys;
    for (const auto& [key, value] : user) {
      archive.write("user." + key, value);
      keys.push_back(key);
    }
    archive.write("mixprec.user_keys", c10::IValue(keys));
  }

  // The tensors that hold each model tensor's gradient at the end of the backward pass, still
  // scaled: under MixedO2 with accumulation or data parallel the master's, else the model's own.
  at::Tensor scaled_gradient(const at::Tensor& p) const {
    if (masters_ && (options_.accumulation_steps() > 1 || data_parallel_)) {
      const auto master = masters_->master_of(p);
      if (master.defined()) return master.grad();
    }
    return p.grad();
  }

  // Each model tensor once, by its first name in the model.
  std::vector<std::pair<std::string, at::Tensor>> named_unique_params() const {
    std::vector<std::pair<std::string, at::Tensor>> result;
    std::unordered_set<const void*> seen;
    for (const auto& item : model_->named_parameters()) {
      if (seen.insert(item.value().unsafeGetTensorImpl()).second) {
        result.emplace_back(item.key(), item.value());
      }
    }
    return result;
  }

  GradientStats gradient_stats(std::int64_t step, double scale) const {
    std::vector<std::string> names;
    std::vector<at::Tensor> grads;
    for (const auto& [name, p] : named_unique_params()) {
      const auto grad = scaled_gradient(p);
      if (!grad.defined()) continue;
      names.push_back(detail::name_prefix(name, options_.gradient_stats().group_depth()));
      grads.push_back(grad);
    }
    auto ranges = detail::gradient_ranges(grads, scale);
    for (std::size_t i = 0; i < ranges.size(); ++i) ranges[i].name = std::move(names[i]);
    GradientStats stats;
    stats.step = step;
    stats.scale = scale;
    stats.entries = detail::merge_ranges(std::move(ranges));
    return stats;
  }

  // A skipped step's second pass: which of the loss and the gradients held inf/NaN. After the
  // unscale pass a non-finite gradient is still non-finite, in the model's gradient and, under
  // MixedO2, in the master's: both are read.
  Overflow find_overflow(const at::Tensor& losses) const {
    Overflow overflow;
    overflow.loss = losses.defined() && !std::isfinite(losses.item<double>());
    std::vector<std::string> names;
    std::vector<at::Tensor> grads;
    std::vector<std::size_t> owner;  // index into names of each gradient read
    for (const auto& [name, p] : named_unique_params()) {
      const auto master = masters_ ? masters_->master_of(p) : at::Tensor();
      bool has_grad = false;
      for (const auto& grad : {p.grad(), master.defined() ? master.grad() : at::Tensor()}) {
        if (!grad.defined()) continue;
        owner.push_back(names.size());
        grads.push_back(grad);
        has_grad = true;
      }
      overflow.checked += has_grad ? 1 : 0;
      names.push_back(name);
    }
    const auto flags = detail::non_finite_flags(grads);
    std::vector<bool> bad(names.size(), false);
    for (std::size_t i = 0; i < flags.size(); ++i) bad[owner[i]] = bad[owner[i]] || flags[i];
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (!bad[i]) continue;
      ++overflow.param_count;
      if (overflow.params.size() < Overflow::max_names) overflow.params.push_back(names[i]);
    }
    overflow.other_rank = data_parallel_ && !overflow.loss && overflow.param_count == 0;
    return overflow;
  }

  // What is running the user's code (step()'s loss_fn, evaluate()'s forward), if anything: a
  // Trainer call from inside it would step, save or load in the middle of a step.
  struct Busy {
    Busy(const char*& slot, const char* what) : slot_(slot) { slot_ = what; }
    ~Busy() { slot_ = nullptr; }
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;
    const char*& slot_;
  };
  void check_not_busy(const char* call) const {
    MIXPREC_CHECK(busy_ == nullptr, "Trainer::", call, "() called from inside ", busy_,
                  ", which must only compute (run the model, return the loss or output): call ",
                  call, "() after it returns; nothing was changed");
  }

  // Data parallel: the ranks' step-or-skip agreement, which also compares how many times each
  // rank has called step(), in the same allreduce (MAX over [found_inf, calls, -calls]). A rank
  // that went on after its step() threw is one call ahead: its gradients were averaged with
  // the others' previous step, and every rank gets this Error before anything steps.
  void agree_across_ranks(at::Tensor& found_inf) {
    const auto calls = static_cast<double>(calls_ % (std::int64_t{1} << 24));  // exact in fp32
    auto flags = at::cat({found_inf.reshape({1}).to(at::kFloat),
                          at::tensor({calls, -calls}, at::kFloat).to(found_inf.device())});
    data_parallel_->agree(flags);
    found_inf.copy_(flags.narrow(0, 0, 1).reshape(found_inf.sizes()));
    const auto seen = flags.narrow(0, 1, 2).cpu();
    const double most = seen[0].item<double>(), least = -seen[1].item<double>();
    MIXPREC_CHECK(most == calls && least == calls, "rank ", data_parallel_->rank(), ": the "
                  "ranks are at different steps (this rank's step() call ", calls_, "; the "
                  "ranks' calls, modulo 2^24, range from ", least, " to ", most, "): a rank went "
                  "on after its step() threw, so its gradients were averaged with another "
                  "step's. Every rank must make the same Trainer calls; restart all ranks from "
                  "the last checkpoint");
  }

  // Rank 0's buffers on every rank, unless they are already (nothing ran a forward since).
  void sync_buffers() {
    if (buffers_synced_ || !data_parallel_ || !data_parallel_->options().broadcast_buffers()) {
      return;
    }
    data_parallel_->broadcast_from_rank0(*model_);
    buffers_synced_ = true;
  }

  // PyTorch's zero_grad(set_to_none=True), its default: a tensor the next step does not reach
  // keeps no gradient, and the optimizer skips it (Adam's moments and weight decay do not move
  // it). The model's tensors and, under MixedO2, the masters the optimizer holds.
  void zero_grads() {
    detail::clear_grads(params_);
    if (masters_) {
      for (const auto& group : optimizer_->param_groups()) detail::clear_grads(group.params());
    }
  }

  // A param group added after construction (progressive unfreezing): checked as the
  // constructor checks the optimizer, its fp32 tensors cast per P, masters made from their
  // current values under MixedO2. Nothing changes unless all of it can be done.
  void adopt_param_groups() {
    MIXPREC_CHECK(pending_ == 0, "the optimizer's param groups changed in the middle of an "
                  "accumulation (", pending_, " of ", options_.accumulation_steps(),
                  " micro-batches): add param groups between optimizer steps");
    detail::check_optimizer_constants<P>(*optimizer_);  // a late group's eps, too
    const auto params = detail::unique_tensors(model_->parameters());
    if (masters_) {
      masters_->check_bindable(params, *optimizer_);
    } else {
      MasterWeights::check_params_of(params, *optimizer_);
    }
    const auto fresh = masters_ ? masters_->unbound(*optimizer_)
                                : detail::unique_tensors(detail::optimizer_tensors(*optimizer_));
    for (const auto& p : fresh) {
      const auto dtype = p.scalar_type();
      MIXPREC_CHECK(dtype == at::kFloat || (P::cast_model && dtype == P::low_dtype), "the "
                    "optimizer holds a ", dtype, " tensor of shape ", p.sizes(), ", but Trainer<",
                    P::name, "> trains fp32 tensors and casts them itself: register it in fp32");
    }
    if (masters_) detail::check_dense_gradients(*model_, fresh, P::name);
    auto claim = detail::ModelClaim::acquire(params, P::name, claim_.get());
    auto device_types = autocast_device_types(params);
    // All checks passed.
    claim_ = std::move(claim);
    device_types_ = std::move(device_types);
    std::vector<at::Tensor> fp32_values;
    if (masters_) {
      for (const auto& p : fresh) fp32_values.push_back(p.detach().to(at::kFloat).clone());
    }
    if constexpr (P::cast_model) detail::cast_model(*model_, P::low_dtype, P::keep_norm_fp32, &fresh);
    if (masters_) masters_->bind(fresh, fp32_values, *optimizer_);
    detail::dedupe_param_groups(*optimizer_);
    if (!masters_) detail::fit_construction_state(*optimizer_);  // Adagrad: the new group's state
    params_ = params;
    group_sizes_ = detail::group_sizes(*optimizer_);
    if (data_parallel_) bind_data_parallel();  // the new masters hold the averages
  }

  // Whether a parameter has been frozen or unfrozen since the gradients were bound.
  bool trainable_changed() const {
    std::size_t k = 0;
    for (const auto& p : params_) {
      if (!p.requires_grad()) continue;
      if (k == trainable_.size() || trainable_[k] != p.unsafeGetTensorImpl()) return true;
      ++k;
    }
    return k != trainable_.size();
  }

  // Every trainable model tensor's gradient is averaged into its master's (MixedO2) or its own.
  // First the ranks compare their models tensor by tensor: ranks that froze different tensors
  // of the same shapes would otherwise average one tensor's gradient with another's.
  void bind_data_parallel() {
    data_parallel_->check_same_model(*model_);
    std::vector<at::Tensor> params, holders;
    trainable_.clear();
    for (const auto& p : params_) {
      if (!p.requires_grad()) continue;
      const auto master = masters_ ? masters_->master_of(p) : at::Tensor();
      params.push_back(p);
      holders.push_back(master.defined() ? master : p);
      trainable_.push_back(p.unsafeGetTensorImpl());
    }
    data_parallel_->bind(params, holders);
  }

  void notify(const StepReport& report) const {
    if (options_.on_step()) options_.on_step()(report);
  }

  // CUDA's generators, one per device; none on a machine without CUDA.
  static std::size_t cuda_devices() {
    return torch::cuda::is_available() ? torch::cuda::device_count() : 0;
  }
  static at::Generator cuda_generator(std::size_t device) {
    return at::globalContext().defaultGenerator(
        at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  }

  static at::Tensor cpu_rng_state() {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    return generator.get_state();
  }

  static at::Tensor read_tensor(torch::serialize::InputArchive& archive, const std::string& key,
                                const at::Tensor& like, bool is_buffer) {
    at::Tensor value;
    MIXPREC_CHECK(archive.try_read(key, value, is_buffer), "the checkpoint lacks '", key, "'");
    MIXPREC_CHECK(value.sizes() == like.sizes() && value.scalar_type() == like.scalar_type(),
                  "the checkpoint's '", key, "' is ", value.scalar_type(), value.sizes(),
                  ", the trainer's ", like.scalar_type(), like.sizes());
    return value;
  }

  // Reads everything into temporaries first; assigns only when all of it is there and fits.
  template <class Commit>
  UserValues load_checked(torch::serialize::InputArchive& archive, const std::string& path,
                          Commit& commit) {
    c10::IValue policy_name;
    MIXPREC_CHECK(archive.try_read("mixprec.policy", policy_name) && policy_name.isString(),
                  "'", path, "' is not a mixprec checkpoint (no policy recorded)");
    MIXPREC_CHECK(policy_name.toStringRef() == P::name, "checkpoint '", path, "' was written "
                  "by Trainer<", policy_name.toStringRef(), ">, this is Trainer<", P::name,
                  ">: load it with the same policy");
    // Adam's and AdamW's options and state have the same fields: only the recorded type tells
    // them apart (a checkpoint from before it was recorded loads as it did).
    c10::IValue optimizer_name;
    if (archive.try_read("mixprec.optimizer", optimizer_name)) {
      MIXPREC_CHECK(optimizer_name.isString() &&
                        optimizer_name.toStringRef() == detail::optimizer_type(*optimizer_),
                    "checkpoint '", path, "' was written with a ",
                    optimizer_name.isString() ? optimizer_name.toStringRef() : std::string("?"),
                    " optimizer, this Trainer steps a ", detail::optimizer_type(*optimizer_),
                    ": load it into the same optimizer type");
    }
    at::Tensor counters;
    MIXPREC_CHECK(archive.try_read("mixprec.counters", counters) && counters.numel() == 3 &&
                      counters.scalar_type() == at::kLong,
                  "'", path, "' lacks the step counters");
    std::vector<std::pair<at::Tensor, at::Tensor>> assignments;
    for (const auto& item : model_->named_parameters()) {
      assignments.emplace_back(item.value(),
                               read_tensor(archive, "model." + item.key(), item.value(), false));
    }
    for (const auto& item : model_->named_buffers()) {
      assignments.emplace_back(item.value(),
                               read_tensor(archive, "model." + item.key(), item.value(), true));
    }
    const auto masters = master_weights();
    std::vector<at::Tensor> master_values;
    for (std::size_t i = 0; i < masters.size(); ++i) {
      master_values.push_back(read_tensor(archive, "masters." + std::to_string(i), masters[i], false));
    }
    at::Tensor extra;
    MIXPREC_CHECK(!archive.try_read("masters." + std::to_string(masters.size()), extra), "checkpoint '",
                  path, "' holds more than the ", masters.size(), " master weights of this trainer: "
                  "it was saved with more param groups; add them to the optimizer before load()");
    c10::IValue scaler_state;
    MIXPREC_CHECK(archive.try_read("scaler", scaler_state) && scaler_state.isGenericDict(),
                  "'", path, "' lacks the scaler state");
    at::Tensor rng;
    MIXPREC_CHECK(archive.try_read("rng.cpu", rng), "'", path, "' lacks the RNG state");
    if (data_parallel_ && data_parallel_->rank() > 0) {  // this rank's own, where saved
      at::Tensor own;
      const auto rank = data_parallel_->rank();
      if (archive.try_read("rng.cpu.rank" + std::to_string(rank), own)) {
        rng = own;
      } else {  // resumed on more ranks than saved: a stream of its own, not rank 0's
        try {
          rng = detail::derived_rng_state(rng, rank);
        } catch (const c10::Error&) {
          detail::fail("'", path, "' holds an invalid RNG state");
        }
      }
    }
    try {  // a state of the wrong size would fail only after everything else was loaded
      at::make_generator<at::CPUGeneratorImpl>().set_state(rng);
    } catch (const c10::Error&) {
      detail::fail("'", path, "' holds an invalid RNG state");
    }
    // CUDA's, where both the checkpoint and this machine have the device (a run resumed on a
    // machine without CUDA, or with fewer devices, keeps its own for the rest).
    std::vector<std::pair<std::size_t, at::Tensor>> cuda_rng;
    // Data parallel, rank > 0 on CUDA: its own state for its device instead of rank 0's.
    at::Tensor own_cuda;
    const bool other_rank = data_parallel_ && data_parallel_->rank() > 0;
    if (other_rank && data_parallel_->device().is_cuda() &&
        archive.try_read("rng.cuda.rank" + std::to_string(data_parallel_->rank()), own_cuda)) {
      const auto d = static_cast<std::size_t>(data_parallel_->device().index());
      try {
        cuda_generator(d).clone().set_state(own_cuda);
      } catch (const c10::Error&) {
        detail::fail("'", path, "' holds an invalid CUDA RNG state for rank ",
                     data_parallel_->rank());
      }
      cuda_rng.emplace_back(d, own_cuda);
    }
    for (std::size_t d = 0; d < cuda_devices() && !own_cuda.defined(); ++d) {
      at::Tensor state;
      if (!archive.try_read("rng.cuda." + std::to_string(d), state)) continue;
      try {
        cuda_generator(d).clone().set_state(state);
      } catch (const c10::Error&) {
        detail::fail("'", path, "' holds an invalid CUDA RNG state for device ", d);
      }
      cuda_rng.emplace_back(d, state);
    }
    torch::serialize::InputArchive optimizer_archive, groups_archive;
    at::Tensor saved_sizes;
    MIXPREC_CHECK(archive.try_read("optimizer", optimizer_archive) &&
                      archive.try_read("optimizer.groups", groups_archive) &&
                      groups_archive.try_read("sizes", saved_sizes) &&
                      saved_sizes.scalar_type() == at::kLong && saved_sizes.dim() == 1,
                  "'", path, "' lacks the optimizer state");
    auto& groups = optimizer_->param_groups();
    std::vector<std::int64_t> sizes;
    for (const auto& group : groups) {
      sizes.push_back(static_cast<std::int64_t>(group.params().size()));
    }
    const auto* saved_begin = saved_sizes.data_ptr<std::int64_t>();
    const std::vector<std::int64_t> saved(saved_begin, saved_begin + saved_sizes.numel());
    MIXPREC_CHECK(saved == sizes, "checkpoint '", path, "' holds an optimizer with param groups "
                  "of sizes ", at::IntArrayRef(saved), ", this one has ", at::IntArrayRef(sizes),
                  ": build the optimizer with the same param groups");
    std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> group_options;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      torch::serialize::InputArchive options_archive;
      MIXPREC_CHECK(groups_archive.try_read(std::to_string(g), options_archive), "'", path,
                    "' lacks the options of param group ", g);
      group_options.push_back(groups[g].options().clone());
      try {
        group_options.back()->serialize(options_archive);
      } catch (const std::exception& e) {
        detail::fail("checkpoint '", path, "' holds options of another optimizer type for param "
                     "group ", g, ": ", detail::message_of(e));
      }
      // AMSGrad keeps a state tensor more and steps by another rule: not an option a checkpoint
      // may switch silently.
      const auto saved_amsgrad = detail::amsgrad_of(*group_options.back());
      const auto own_amsgrad = detail::amsgrad_of(groups[g].options());
      MIXPREC_CHECK(saved_amsgrad == own_amsgrad, "checkpoint '", path, "' was written with "
                    "amsgrad(", saved_amsgrad.value_or(false) ? "true" : "false", ") in param group ",
                    g, ", this optimizer has amsgrad(", own_amsgrad.value_or(false) ? "true" : "false",
                    "): build it with the same options");
    }
    auto scaler = detail::make_scaler<P>(options_);  // validates the state before any change
    scaler.load_state_dict(scaler_state.toGenericDict());
    UserValues user;
    c10::IValue user_keys;  // none in a checkpoint written before user values existed
    if (archive.try_read("mixprec.user_keys", user_keys)) {
      MIXPREC_CHECK(user_keys.isList(), "'", path, "' holds a damaged list of user values");
      const auto keys = user_keys.toList();
      for (std::size_t i = 0; i < keys.size(); ++i) {
        const c10::IValue key = keys.get(i);
        MIXPREC_CHECK(key.isString(), "'", path, "' holds a damaged list of user values");
        c10::IValue value;
        MIXPREC_CHECK(archive.try_read("user." + key.toStringRef(), value), "'", path,
                      "' lacks user value '", key.toStringRef(), "'");
        user.emplace(key.toStringRef(), std::move(value));
      }
    }
    commit();  // every rank has read and checked all of it

    // The optimizer loads in place, and LibTorch's load() only adds state: start from none,
    // and put the previous state (the same objects) and options back if it throws.
    std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> previous_options;
    for (const auto& group : groups) previous_options.push_back(group.options().clone());
    auto previous_state = std::move(optimizer_->state());
    optimizer_->state().clear();
    try {
      optimizer_->load(optimizer_archive);
    } catch (...) {
      optimizer_->state() = std::move(previous_state);
      for (std::size_t g = 0; g < groups.size(); ++g) {
        groups[g].set_options(std::move(previous_options[g]));
      }
      throw;
    }
    for (std::size_t g = 0; g < groups.size(); ++g) {
      groups[g].set_options(std::move(group_options[g]));
    }
    at::NoGradGuard no_grad;
    for (auto& [target, value] : assignments) target.copy_(value);
    if (masters_) {
      for (std::size_t i = 0; i < master_values.size(); ++i) masters[i].copy_(master_values[i]);
    }
    scaler_ = std::move(scaler);
    auto generator = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(rng);
    }
    for (const auto& [device, state] : cuda_rng) {
      auto cuda = cuda_generator(device);
      std::lock_guard<std::mutex> lock(cuda.mutex());
      cuda.set_state(state);
    }
    stats_.steps = counters[0].item<std::int64_t>();
    stats_.skipped_steps = counters[1].item<std::int64_t>();
    stats_.micro_batches = counters[2].item<std::int64_t>();
    // Micro-batches accumulated before the load belong to another run: forget their losses
    // (a NaN among them would skip the next step) and gradients.
    pending_ = 0;
    loss_sum_ = at::Tensor();
    consecutive_skips_ = 0;
    buffers_synced_ = false;
    calls_ = stats_.micro_batches;  // the same on every rank that loaded this checkpoint
    zero_grads();
    return user;
  }

  std::shared_ptr<torch::nn::Module> model_;
  std::shared_ptr<detail::ModelClaim> claim_;  // no other Trainer may train model_ meanwhile
  std::vector<at::Tensor> params_;  // model_->parameters(), each tensor once
  std::vector<std::size_t> group_sizes_;  // the optimizer's groups when params_ was made
  torch::optim::Optimizer* optimizer_;
  TrainerOptions options_;
  scaler_type scaler_;
  // The gradient passes, with the scaler's scale; fp16 gradients in place where the model is
  // cast without masters (PureHalf<Half>).
  detail::StepEngine engine_{P::cast_model && !P::master_weights};
  std::optional<MasterWeights> masters_;
  std::vector<c10::DeviceType> device_types_;  // of the parameters: autocast engages on each
  TrainerStats stats_;
  std::unique_ptr<DataParallel> data_parallel_;  // with TrainerOptions::distributed
  const char* busy_ = nullptr;  // Busy: the user code running inside step() or evaluate()
  std::int64_t calls_ = 0;  // step() calls, each rank's own; reset by load()
  std::int64_t consecutive_skips_ = 0;  // optimizer steps skipped since the last one taken
  bool buffers_synced_ = false;  // rank 0's buffers are on every rank, no forward ran since
  std::vector<const void*> trainable_;           // the tensors data_parallel_ reduces
  std::int64_t pending_ = 0;  // micro-batches accumulated since the last optimizer step
  at::Tensor loss_sum_;       // their losses: inf/NaN in any of them skips the step
};

/// `archive << trainer`, and so `torch::save(trainer, path)`: Trainer::save(archive).
template <class P>
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const Trainer<P>& trainer) {
  trainer.save(archive);
  return archive;
}

/// `archive >> trainer`, and so `torch::load(trainer, path)`: Trainer::load(archive).
template <class P>
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           Trainer<P>& trainer) {
  trainer.load(archive);
  return archive;
}

}  // namespace mixprec
