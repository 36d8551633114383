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

#include <mixprec/core/autocast.hpp>
#include <mixprec/core/concepts.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/policy.hpp>
#include <mixprec/diagnostics/gradient_stats.hpp>
#include <mixprec/diagnostics/non_finite_op.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/fp8/layers.hpp>
#include <mixprec/precision/own_outputs.hpp>
#include <mixprec/scaling/scalers.hpp>
#include <mixprec/trainer/backward_step.hpp>
#include <mixprec/trainer/checkpoints.hpp>
#include <mixprec/trainer/forward.hpp>
#include <mixprec/trainer/gradient_reports.hpp>
#include <mixprec/trainer/optimizer_step.hpp>
#include <mixprec/trainer/step_engine.hpp>
#include <mixprec/trainer/options.hpp>
#include <mixprec/trainer/schedule.hpp>
#include <mixprec/trainer/setup.hpp>
#include <mixprec/trainer/state_bytes.hpp>
#include <mixprec/trainer/step_gradients.hpp>
#include <mixprec/trainer/trained_tensors.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace mixprec {

/// Trains `model` with `optimizer` under precision policy P (see core/policy.hpp).
template <class P>
class Trainer : public detail::TrainerCheckpoints<P> {
  static_assert(require_policy<P>);
  static_assert(LossScaler<typename P::scaler_type>,
                "mixprec: the policy's scaler_type must satisfy mixprec::LossScaler: "
                "get_scale(), update_scale(bool found_inf), state_dict() and "
                "load_state_dict(dict), movable (mixprec/core/concepts.hpp)");

 public:
  using policy = P;
  using scaler_type = typename P::scaler_type;
  /// Options typed by the policy: what P cannot take does not compile (trainer/options.hpp).
  using Options = BasicTrainerOptions<P>;

  /// Casts the model as P says and, for MixedO2, rebinds the optimizer to fp32 master weights.
  /// The model must be fp32, trained by no other live Trainer, and the optimizer built on its
  /// parameters (each in one group; a tensor listed twice in a group is kept once), before any
  /// step. Param groups added later are adopted at the next step.
  Trainer(std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer,
          TrainerOptions options = {});
  ~Trainer();
  Trainer(Trainer&&) = default;  // as before: deleted where a member cannot move
  Trainer& operator=(Trainer&&) = default;

  /// With the policy's own Options (a template only so that `{}` stays TrainerOptions).
  template <std::same_as<P> Q>
  Trainer(std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer,
          const BasicTrainerOptions<Q>& options)
      : Trainer(std::move(model), optimizer, TrainerOptions(options)) {}

  /// For a ModuleHolder such as torch::nn::Sequential.
  template <class Impl>
  Trainer(torch::nn::ModuleHolder<Impl>& model, torch::optim::Optimizer& optimizer,
          TrainerOptions options = {})
      : Trainer(std::static_pointer_cast<torch::nn::Module>(model.ptr()), optimizer,
                std::move(options)) {}
  template <class Impl, std::same_as<P> Q>
  Trainer(torch::nn::ModuleHolder<Impl>& model, torch::optim::Optimizer& optimizer,
          const BasicTrainerOptions<Q>& options)
      : Trainer(std::static_pointer_cast<torch::nn::Module>(model.ptr()), optimizer,
                TrainerOptions(options)) {}

  /// One micro-batch: runs loss_fn (the forward pass, returning a scalar loss) under the
  /// policy's autocast, backpropagates the scaled loss, and every accumulation_steps calls
  /// unscales, clips, steps (or skips on inf/NaN) and updates the scale.
  template <class LossFn>
  StepReport step(LossFn&& loss_fn) {
    static_assert(detail::returns_loss<LossFn>, "mixprec: Trainer::step(loss_fn): loss_fn must "
                  "take no arguments and return the loss as a tensor (at::Tensor), e.g. "
                  "[&] { return torch::mse_loss(model->forward(x), y); }");
    if constexpr (detail::returns_loss<LossFn>) {
      return run_step([&]() -> at::Tensor { return loss_fn(); });
    } else {
      return {};
    }
  }

  /// Runs `forward` with every module in eval mode, without grad, in the policy's precision;
  /// then restores each module's own mode. Data parallel: the first evaluate() after a step
  /// copies rank 0's buffers to every rank first (as DDP does before an evaluation forward), so
  /// that every rank evaluates with the same BatchNorm statistics; call it on every rank.
  template <class Forward>
  auto evaluate(Forward&& forward) {
    check_not_busy("evaluate");
    const detail::Busy busy(busy_, "evaluate()'s forward");
    sync_buffers();
    return detail::evaluation_pass<P>(*model_, tensors_.device_types(), forward);
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

  /// Inside on_step, on a report that ends an optimizer step (stepped or skipped): the
  /// gradient each model parameter was stepped with, by its name: unscaled, averaged, clipped
  /// where clipping applied, as Python's `p.grad` after `scaler.step(opt)`; under MixedO2 the
  /// fp32 masters' (the model's own .grad() is none there), sharded this rank's part. An Error
  /// elsewhere (trainer/step_gradients.hpp).
  torch::OrderedDict<std::string, StepGradient> gradients() const {
    MIXPREC_CHECK(!backward_step_, "Trainer::gradients() under TrainerOptions::"
                  "step_in_backward: each gradient was freed as soon as its tensor was stepped, "
                  "inside the backward pass; turn step_in_backward off to read them in on_step");
    return gradients_.read(*model_, *optimizer_, tensors_.masters(), data_parallel_.get());
  }

  /// Forgets the micro-batches accumulated since the last optimizer step (their gradients and
  /// losses), as load() does: the next step() starts an optimizer step afresh. The way on where
  /// an accumulation cannot be finished (a new optimizer assigned in its middle). Returns how
  /// many were dropped. Data parallel: call it on every rank.
  std::int64_t drop_accumulation() {
    check_not_busy("drop_accumulation");
    const auto dropped = pending_;
    forget_accumulation();
    return dropped;
  }

  scaler_type& scaler() noexcept { return scaler_; }
  const scaler_type& scaler() const noexcept { return scaler_; }
  torch::nn::Module& model() noexcept { return *model_; }
  torch::optim::Optimizer& optimizer() noexcept { return *optimizer_; }
  const TrainerOptions& options() const noexcept { return options_; }

  /// The fp32 master weights (MixedO2), one per model tensor the optimizer holds, in the
  /// optimizer's order (a param group added later at the end); empty for the other policies,
  /// and where the optimizer state is sharded (each rank holds slices: fp32_state_dict()).
  /// Under a lean storage (RemainderMasters, StochasticRounding) they are values made from
  /// what it keeps, not the tensors the optimizer steps: writing to them changes nothing.
  std::vector<at::Tensor> master_weights() const {
    const auto* masters = tensors_.masters();
    return masters ? masters->master_values() : std::vector<at::Tensor>{};
  }

  /// The bytes of training state held now (weights, gradients, masters, optimizer state),
  /// summed from the tensors: between steps, what a lean storage saves.
  TrainingStateBytes state_bytes() const {
    return detail::state_bytes(*model_, tensors_.masters(), *optimizer_, data_parallel_.get());
  }

  TrainerStats stats() const {
    TrainerStats s;
    s.steps = counters_.steps;
    s.skipped_steps = counters_.skipped_steps;
    s.micro_batches = counters_.micro_batches;
    s.scale = scaler_.get_scale();
    s.gradient_stats = gradient_stats_;
    return s;
  }

 private:
  friend class detail::TrainerCheckpoints<P>;

  // The step, stage by stage (defined below the class: one instantiation per policy, which
  // the compiled companion provides, trainer/precompiled.hpp). loss_fn is type-erased here,
  // so that no stage depends on the caller's lambda.
  StepReport run_step(detail::LossFnRef loss_fn);
  void start_micro_batch();
  StepReport backward_micro_batch(const detail::ForwardResult& forward);
  StepReport step_in_backward(const detail::ForwardResult& forward);
  bool step_leaf(const at::Tensor& leaf, const at::Tensor& loss);
  std::vector<std::pair<std::string, at::Tensor>> trained_leaves() const;
  void optimizer_step(StepReport& report);
  detail::OptimizerStep take_step(MasterWeights* masters, const at::Tensor& losses,
                                  bool one_pass);
  void after_step(const StepReport& report, double grad_divisor);

  // load(): the run goes on from the checkpoint's counters. Micro-batches accumulated before
  // belong to another run: their losses (a NaN among them would skip the next step) and
  // gradients are forgotten.
  void restart_from(const detail::TrainerCounters& counters) {
    counters_ = counters;
    forget_accumulation();
    last_graph_ = at::Tensor();
    consecutive_skips_ = 0;
    buffers_synced_ = false;
    calls_ = counters_.micro_batches;  // the same on every rank that loaded this checkpoint
  }

  // The micro-batches since the last optimizer step, dropped: their losses, their gradients
  // (held or, sharded, in the buckets, which the next first micro-batch overwrites) and fp8's
  // amaxes. StepReport::micro_batch starts at 1 again: on_step's observers reset with it.
  void forget_accumulation() {
    pending_ = 0;
    loss_sum_ = at::Tensor();
    fp8_.finish_step(/*stepped=*/false);
    tensors_.clear_grads(*optimizer_);
  }

  void check_not_busy(const char* call) const {
    MIXPREC_CHECK(busy_ == nullptr, "Trainer::", call, "() called from inside ", busy_,
                  ", which must only compute (run the model, return the loss or output): call ",
                  call, "() after it returns; nothing was changed");
  }

  // Rank 0's buffers on every rank, unless they are already (nothing ran a forward since).
  void sync_buffers() {
    if (buffers_synced_ || !data_parallel_ || !data_parallel_->broadcast_buffers()) {
      return;
    }
    data_parallel_->broadcast_from_rank0(*model_, /*parameters=*/false);
    buffers_synced_ = true;
  }

  // The optimizer's tensors or options as the Trainer bound them, or adopted now (TrainedTensors:
  // adopt): never an optimizer step of tensors the Trainer did not bind.
  void adopt_optimizer_changes() {
    using Change = typename detail::TrainedTensors<P>::Change;
    const auto change = tensors_.binding_change(*optimizer_);
    if (change == Change::none) return;
    if (change == Change::options) {
      tensors_.adopt_options(*optimizer_);
      return;
    }
    MIXPREC_CHECK(pending_ == 0, "the optimizer's tensors changed in the middle of an "
                  "accumulation (", pending_, " of ", options_.accumulation_steps(),
                  " micro-batches): add param groups or assign a new optimizer between "
                  "optimizer steps. Nothing was changed: to go on, drop the accumulated "
                  "micro-batches with trainer.drop_accumulation(), and the next step() adopts "
                  "the optimizer");
    tensors_.adopt(*model_, *optimizer_);
    if (data_parallel_) tensors_.bind(*data_parallel_, *model_);  // the new masters' averages
  }

  void notify(const StepReport& report) const {
    if (options_.on_step()) options_.on_step()(report);
  }
  // The end of a taken step while on_step's exception unwinds: that exception is the one the
  // caller sees (a bad lr stays the old one, schedule.hpp).
  void finish_step_quietly() noexcept {
    gradients_.close();
    try {
      tensors_.clear_grads(*optimizer_);
      schedule_.advance(*optimizer_, counters_.steps);
    } catch (...) {
    }
  }

  std::shared_ptr<torch::nn::Module> model_;
  torch::optim::Optimizer* optimizer_;
  TrainerOptions options_;
  scaler_type scaler_;
  detail::TrainedTensors<P> tensors_;
  detail::StepGradients gradients_;  // what on_step's gradients() reads, while it runs
  detail::LrSchedule schedule_;  // TrainerOptions::lr_scheduler or lr_lambda; else inactive
  std::unique_ptr<detail::StepGroup> data_parallel_;  // with TrainerOptions::distributed
  // The gradient passes, with the scaler's scale; fp16 gradients in place where the model is
  // cast without masters (PureHalf<Half>).
  detail::StepEngine engine_{P::cast_model && !P::master_weights};
  detail::TrainerCounters counters_;
  std::optional<GradientStats> gradient_stats_;  // the latest counted
  const char* busy_ = nullptr;  // detail::Busy: the user code running inside step() or evaluate()
  std::int64_t calls_ = 0;  // step() calls, each rank's own; reset by load()
  std::int64_t consecutive_skips_ = 0;  // optimizer steps skipped since the last one taken
  bool buffers_synced_ = false;  // rank 0's buffers are on every rank, no forward ran since
  std::int64_t pending_ = 0;  // micro-batches accumulated since the last optimizer step
  at::Tensor loss_sum_;       // their losses: inf/NaN in any of them skips the step
  at::Tensor last_graph_;     // the last loss with its graph, until the next forward has run
  detail::Fp8Layers fp8_;     // MixedFP8: the layers in fp8, their scaling state; else empty
  // TrainerOptions::step_in_backward: the hooks that step each tensor in the backward pass.
  std::unique_ptr<detail::BackwardStep> backward_step_;
};

template <class P>
Trainer<P>::Trainer(std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer,
                  TrainerOptions options)
    : model_(detail::checked_model<P>(std::move(model), optimizer)),
      optimizer_(&optimizer),
      options_(detail::checked_options<P>(std::move(options), optimizer)),
      scaler_(detail::make_scaler<P>(options_)),
      tensors_(*model_, optimizer),
      schedule_(options_, optimizer) {
  detail::Fp8Layers::Found fp8_layers;
  if constexpr (detail::fp8_policy<P>) {
    MIXPREC_CHECK(!P::recipe::delayed || options_.distributed() == nullptr, "Trainer<",
                  P::name, "> with TrainerOptions::distributed: delayed scaling's amax "
                  "histories are per rank and are not reduced across ranks yet; use "
                  "MixedFP8<TensorwiseScaling> for data parallel");
    // Throws if there are none, or (block recipes) if a layer's features miss the blocks.
    fp8_layers = detail::Fp8Layers::find<typename P::recipe>(*model_, P::name);
  }
  if constexpr (detail::lean_state<P>) {
    MIXPREC_CHECK(!options_.step_in_backward() ||
                      detail::one_pass_step<P>(options_.fused_optimizer(), tensors_.cpu_only()),
                  "TrainerOptions::step_in_backward under Trainer<", P::name, ">: its lean "
                  "storage steps one tensor at a time in the one-pass step only, which needs "
                  "fused_optimizer(true) and the model on the CPU; set it, or turn "
                  "step_in_backward off");
  }
  // All checks passed: from here on the model and optimizer change. Data parallel
  // (collective): the same model on every rank, then rank 0's values everywhere, before the
  // masters are made from them.
  if (const auto* distributed = options_.distributed()) {
    data_parallel_ = options_.settings().make_step_group(*model_, optimizer, *distributed);
  }
  tensors_.take(*model_, optimizer,
                data_parallel_ && data_parallel_->sharded() ? data_parallel_.get() : nullptr);
  if (auto* lean = tensors_.lean()) lean->set_rounding(options_.rounding_seed(), 0);
  if (data_parallel_) tensors_.bind(*data_parallel_, *model_);
  detail::warn_slow_fp16_convolutions<P>(*model_, options_, tensors_.device_types());
  detail::warn_slow_bf16<P>(options_, tensors_.device_types());
  if constexpr (detail::fp8_policy<P>) {
    fp8_.enable<typename P::recipe>(std::move(fp8_layers), options_.rounding_seed());
  }
  schedule_.start(optimizer);  // Python's scheduler constructor step (schedule.hpp)
  if (options_.step_in_backward()) backward_step_ = std::make_unique<detail::BackwardStep>();
}

template <class P>
Trainer<P>::~Trainer() = default;

}  // namespace mixprec

// The step's stages (defined there), and the compiled companion: the common policies' Trainers
// declared extern where it is linked.
#include <mixprec/trainer/trainer_step.hpp>
#include <mixprec/trainer/precompiled.hpp>
