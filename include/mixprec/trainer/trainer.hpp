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
          TrainerOptions options = {})
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
  }

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
      return run_step(loss_fn);
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

  // step() once loss_fn is known to return a loss.
  template <class LossFn>
  StepReport run_step(LossFn& loss_fn) {
    check_not_busy("step");
    schedule_.check_untouched();
    const detail::Busy busy(busy_, "step()'s loss_fn");
    ++calls_;  // first: a call that throws counts too (DataParallel::agree_step)
    // The scaler's scale for this step, checked before anything changes (the forward pass
    // included); the micro-batches of one step share it, as their gradients add up.
    engine_.use_scale(scaler_.get_scale(), /*first_micro_batch=*/pending_ == 0);
    // A param group added, or a new optimizer assigned to the one the Trainer holds, is
    // adopted before the forward pass, which must already see its tensors cast.
    adopt_optimizer_changes();
    schedule_.before_micro_batch(*optimizer_, pending_, counters_.steps);
    // Data parallel, as DDP: rank 0's buffers before the first forward of each step.
    if (pending_ == 0) sync_buffers();
    buffers_synced_ = false;  // this forward may update them (BatchNorm's running statistics)
    // No gradient is visible while loss_fn runs: none after the last optimizer step, the
    // micro-batches' partial sums held aside (a gradient made here is loss_fn's backward()).
    if (pending_ == 0) tensors_.clear_grads(*optimizer_);
    auto forward = detail::forward_pass<P>(*model_, tensors_.device_types(),
                                           options_.find_non_finite_op(), loss_fn);
    const auto loss32 = forward.loss;
    detail::check_no_backward_in(*model_, tensors_, P::name);
    // The last step's graph (its saved tensors freed by backward) lives until this forward has
    // run, as the `loss` variable of a hand-written loop keeps it: the parameters' gradient
    // accumulators are then reused instead of made anew each step.
    last_graph_ = loss32;
    // The partial sums go back where the backward pass adds to them; should anything below
    // throw, they are held aside again, as between any two calls.
    tensors_.release_grads();
    detail::OnUnwind hold_again([this] { tensors_.hold_grads(*optimizer_); });
    const auto n = options_.accumulation_steps();
    const auto to_backprop = n > 1 ? loss32 / static_cast<double>(n) : loss32;
    StepReport report;
    report.scale = engine_.get_scale();
    report.lr = schedule_.lr(*optimizer_);
    report.non_finite_op = std::move(forward.non_finite_op);
    // Data parallel: gradients travel during the backward pass of the last micro-batch only.
    const bool reduce = data_parallel_ && pending_ + 1 == n;
    if (data_parallel_) {
      if (reduce && tensors_.trainable_changed()) tensors_.bind(*data_parallel_, *model_);
      data_parallel_->prepare(reduce, /*first=*/pending_ == 0);
    }
    engine_.scale(to_backprop).backward();
    // The averages land in the holders' gradients: under MixedO2 the fp32 masters', which
    // then hold the accumulated micro-batches too. Sharded: in the pieces' gradients; the
    // micro-batches before the last add up in the buckets.
    if (reduce) {
      data_parallel_->finish();
    } else if (data_parallel_) {
      data_parallel_->accumulate();
    }
    // Micro-batch gradients sum in the fp32 master gradients, not in the Low model gradients.
    auto* const masters = tensors_.masters();
    if (masters && n > 1 && !reduce) masters->accumulate_grads();
    report.loss = loss32.detach();
    loss_sum_ = loss_sum_.defined() ? loss_sum_ + report.loss : report.loss;
    ++counters_.micro_batches;
    report.micro_batch = ++pending_;
    if (pending_ < n) {
      report.step = counters_.steps;
      // Held before on_step: an optimizer.zero_grad() or step() there finds no partial sum.
      tensors_.hold_grads(*optimizer_);
      hold_again.dismiss();
      notify(report);
      return report;
    }
    hold_again.dismiss();  // from here on an exception leaves the gradients to the next step
    pending_ = 0;
    const auto every = options_.gradient_stats().every();
    if (every > 0 && (counters_.steps + 1) % every == 0) {
      report.gradient_stats = detail::gradient_stats(
          *model_, masters, counters_.steps + 1, report.scale,
          options_.gradient_stats().group_depth(),
          /*in_masters=*/n > 1 || data_parallel_);
      gradient_stats_ = report.gradient_stats;
    }
    const auto losses = std::move(loss_sum_);
    loss_sum_ = at::Tensor();
    // Lean storage: fp32 masters and moments from here to the end of the optimizer step; or,
    // fused on the CPU (a block format's moments: always), one pass over what it keeps, lean
    // masters reading the model's gradients in place.
    const bool one_pass = detail::one_pass_step<P>(options_.fused_optimizer(), tensors_.cpu_only());
    const bool model_grads = one_pass && detail::lean_pass_storage<P>;
    const detail::LeanStep<P> lean(masters, *optimizer_, /*inflate=*/!one_pass,
                                   data_parallel_.get());
    if (model_grads && n == 1 && !data_parallel_) masters->alias_grads();
    const auto plan = detail::plan_unscale(options_, model_grads ? nullptr : masters, n,
                                           data_parallel_.get(), calls_, losses,
                                           fp8_.pending_amaxes());
    detail::OptimizerStep done;
    try {
      done = detail::take_optimizer_step(
          engine_, *optimizer_, plan, options_.fused_optimizer(),
          one_pass ? detail::one_pass_step_of<P>(*optimizer_, masters, data_parallel_.get())
                   : detail::OnePassStep());
    } catch (...) {
      fp8_.finish_step(/*stepped=*/false);
      throw;
    }
    const bool stepped = done.stepped;
    report.grad_norm = done.grad_norm;
    scaler_.update_scale(/*found_inf=*/!stepped);
    fp8_.finish_step(stepped);
    if (stepped) detail::after_step_taken(masters, data_parallel_.get());
    ++counters_.steps;
    consecutive_skips_ = stepped ? 0 : consecutive_skips_ + 1;
    if (!stepped) {
      ++counters_.skipped_steps;
      report.overflow =
          detail::find_overflow(*model_, masters, losses, data_parallel_ != nullptr);
    }
    report.status = stepped ? StepStatus::stepped : StepStatus::skipped;
    report.step = counters_.steps;
    {
      // on_step reads the gradients the step used (gradients()); a model tensor stepped through
      // another tensor (a master, a piece) shows none of its own. The step is taken: an on_step
      // that throws (a failed metrics push, a log that cannot be written) leaves no gradient
      // for a second update, nor the schedule a step behind.
      detail::OnUnwind finish_anyway([this] { finish_step_quietly(); });
      tensors_.clear_stand_in_grads();
      gradients_.open(*optimizer_, done.grad_divisor);
      notify(report);
      finish_anyway.dismiss();
      gradients_.close();
    }
    // None stays for an optimizer.step() of the user's to apply a second time (the habit of
    // Python's `scaler.step(opt); opt.step()`): PyTorch's zero_grad() after the step.
    tensors_.clear_grads(*optimizer_);
    schedule_.advance(*optimizer_, counters_.steps);  // last: a bad lr throws after on_step
    detail::check_consecutive_skips(options_.max_consecutive_skips(), consecutive_skips_,
                                    report, scaler_.get_scale());
    return report;
  }


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
};

}  // namespace mixprec
