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
#include <mixprec/fp8/layers.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/trainer/trained_tensors.hpp>
#include <mixprec/trainer/setup.hpp>
#include <mixprec/trainer/state.hpp>
#include <mixprec/scaling/unscale.hpp>
#include <mixprec/diagnostics/gradient_stats.hpp>
#include <mixprec/diagnostics/non_finite_op.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/fp8/linear.hpp>
#include <mixprec/optim/fused_adam.hpp>
#include <mixprec/optim/master_weights.hpp>
#include <mixprec/core/policy.hpp>
#include <mixprec/scaling/scalers.hpp>
#include <mixprec/trainer/options.hpp>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>
#include <torch/serialize.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <exception>
#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace mixprec {

/// Trains `model` with `optimizer` under precision policy P (see policy.hpp).
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
  /// Options typed by the policy: what P cannot take does not compile (trainer_options.hpp).
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
        tensors_(*model_, optimizer) {
    detail::Fp8Layers::Found fp8_layers;
    if constexpr (detail::fp8_policy<P>) {
      MIXPREC_CHECK(!P::recipe::delayed || options_.distributed() == nullptr, "Trainer<",
                    P::name, "> with TrainerOptions::distributed: delayed scaling's amax "
                    "histories are per rank and are not reduced across ranks yet; use "
                    "MixedFP8<TensorwiseScaling> for data parallel");
      fp8_layers = detail::Fp8Layers::find(*model_, P::name);  // throws if there are none
    }
    // All checks passed: from here on the model and optimizer change. Data parallel
    // (collective): the same model on every rank, then rank 0's values everywhere, before the
    // masters are made from them.
    if (const auto* distributed = options_.distributed()) {
      data_parallel_ = options_.settings().make_step_group(*model_, optimizer, *distributed);
    }
    tensors_.take(*model_, optimizer,
                  data_parallel_ && data_parallel_->sharded() ? data_parallel_.get() : nullptr);
    if (data_parallel_) tensors_.bind(*data_parallel_, *model_);
    detail::warn_slow_fp16_convolutions<P>(*model_, options_, tensors_.device_types());
    if constexpr (detail::fp8_policy<P>) fp8_.enable<typename P::recipe>(std::move(fp8_layers));
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
    at::NoGradGuard no_grad;
    detail::TrainingModeGuard mode(*model_, /*training=*/false);
    const PolicyAutocast<P> guard(tensors_.device_types());
    // LibTorch's dtype errors explained: a kept fp32 output read by a Low module, else a
    // floating input that did not go through cast_input().
    detail::OwnOutputWatch watch(*model_);
    return detail::run_forward<P>("evaluate()'s forward", [&]() -> decltype(auto) {
      return watch.run(forward);
    });
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
  /// optimizer's order (a param group added later at the end); empty for the other policies,
  /// and where the optimizer state is sharded (each rank holds slices: fp32_state_dict()).
  std::vector<at::Tensor> master_weights() const {
    const auto* masters = tensors_.masters();
    return masters ? masters->masters() : std::vector<at::Tensor>{};
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

  /// Writes model, optimizer (state and param-group options), scaler, master weights, counters
  /// and the RNG states (CPU, and each CUDA device's) to `path` atomically, with a checksum that
  /// load() verifies. Call between optimizer steps, not in the middle of an accumulation.
  /// Data parallel: every rank calls it; rank 0 writes (with every rank's CPU RNG state) and
  /// the others return once it has, with its Error if it failed.
  /// `user` goes into the same file (the epoch, the position in the data: anything an IValue
  /// holds), and load() returns it.
  /// Sharded (DistributedOptions::shard_optimizer_state): the same file as unsharded data
  /// parallel writes, whatever the world size: every rank gathers the optimizer state and the
  /// masters of all ranks first (for the time of the save, the memory of an unsharded run).
  void save(const std::string& path, const UserValues& user = {}) const {
    check_saveable(user);
    const auto rngs = detail::gather_rngs(data_parallel_.get());
    const auto view = consolidated(/*values=*/true, /*state=*/true);
    detail::write_on_rank0(data_parallel_.get(), path, [&] {
      detail::write_state_file(path, [&](auto& archive) { write(archive, rngs, user, view); });
    });
  }

  /// Restores a checkpoint written by save() of a Trainer of the same policy, model and
  /// optimizer: the optimizer's state and param-group options become the saved ones exactly,
  /// and an accumulation in progress is discarded. Anything else (a missing, truncated,
  /// corrupted or foreign file; another model or optimizer) throws mixprec::Error and changes
  /// nothing, but for a param group added since the last step: that is adopted first, as the
  /// next step() would adopt it. Data parallel: every rank loads the file (rank 0's path on a
  /// shared file system); if any rank cannot, every rank throws and none changes. Returns the
  /// user values saved with it (none: empty). Sharded: any checkpoint of the same model and
  /// optimizer, written at any world size, sharded or not; each rank keeps its slices of it.
  UserValues load(const std::string& path) {
    return load_with(path, [&](auto& commit) {
      auto archive = detail::read_state_file(path);
      return load_checked(archive, path, commit);
    });
  }

  /// save() into an archive of the caller's (LibTorch's composition: `torch::save(trainer,
  /// path)` and `archive << trainer` go through here): the same contents, without the atomic
  /// file and its checksum, which the caller's archive does not have. Data parallel: every rank
  /// calls it, and every rank's archive holds all ranks' RNG states.
  void save(torch::serialize::OutputArchive& archive, const UserValues& user = {}) const {
    check_saveable(user);
    const auto rngs = detail::gather_rngs(data_parallel_.get());
    const auto view = consolidated(/*values=*/true, /*state=*/true);
    try {
      write(archive, rngs, user, view);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      detail::fail("cannot write the checkpoint archive: ", detail::message_of(e));
    }
  }

  /// load() from an archive of the caller's (`torch::load(trainer, path)`, `archive >> trainer`).
  UserValues load(torch::serialize::InputArchive& archive) {
    return load_with("the archive", [&](auto& commit) {
      return load_checked(archive, "the archive", commit);
    });
  }

  /// The fp32 weights of the model by state_dict name: the masters under MixedO2 (not their
  /// rounding in the model), the parameters cast to fp32 otherwise, and the buffers (floating
  /// ones in fp32). What an fp32 model for inference or another framework takes.
  /// Sharded: gathered from every rank's masters; collective (every rank calls it).
  torch::OrderedDict<std::string, at::Tensor> fp32_state_dict() const {
    const auto view = consolidated(/*values=*/true, /*state=*/false);
    return detail::fp32_state_dict(*model_, masters_of(view));
  }

  /// Writes fp32_state_dict() to `path` atomically: WeightsFormat::libtorch as Module::save
  /// writes a model, so that `torch::load(fp32_model, path)` reads it into a model of the same
  /// architecture built in fp32; WeightsFormat::pickle as a tuple of (name, tensor) pairs, which
  /// Python reads with `model.load_state_dict(dict(torch.load(path)))`.
  /// Sharded: collective, as fp32_state_dict().
  void save_fp32(const std::string& path, WeightsFormat format = WeightsFormat::libtorch) const {
    check_not_busy("save_fp32");
    const auto view = consolidated(/*values=*/true, /*state=*/false);
    detail::save_fp32(path, format, *model_, masters_of(view));
  }

 private:
  // step() once loss_fn is known to return a loss.
  template <class LossFn>
  StepReport run_step(LossFn& loss_fn) {
    check_not_busy("step");
    const detail::Busy busy(busy_, "step()'s loss_fn");
    ++calls_;  // first: a call that throws counts too (DataParallel::agree_step)
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
    // A param group added, or a new optimizer assigned to the one the Trainer holds, is
    // adopted before the forward pass, which must already see its tensors cast.
    adopt_optimizer_changes();
    // Data parallel, as DDP: rank 0's buffers before the first forward of each step.
    if (pending_ == 0) sync_buffers();
    buffers_synced_ = false;  // this forward may update them (BatchNorm's running statistics)
    // No gradient is visible while loss_fn runs: none after the last optimizer step, the
    // micro-batches' partial sums held aside (a gradient made here is loss_fn's backward()).
    if (pending_ == 0) tensors_.clear_grads(*optimizer_);
    at::Tensor loss;
    std::optional<NonFiniteOp> non_finite_op;
    {
      std::optional<NonFiniteOpFinder> finder;
      if (options_.find_non_finite_op()) finder.emplace();
      const PolicyAutocast<P> guard(tensors_.device_types());
      detail::OwnOutputWatch watch(*model_);
      loss = detail::run_forward<P>("step()'s loss_fn", [&] { return watch.run(loss_fn); });
      if (finder) non_finite_op = finder->first();
    }
    const auto loss32 = detail::checked_loss(loss);
    check_no_backward_in_loss_fn();
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
    report.non_finite_op = std::move(non_finite_op);
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
    if (++pending_ < n) {
      report.step = counters_.steps;
      notify(report);  // on_step may read the partial sums; the optimizer may not
      tensors_.hold_grads(*optimizer_);
      hold_again.dismiss();
      return report;
    }
    hold_again.dismiss();  // from here on an exception leaves the gradients to the next step
    pending_ = 0;
    const auto every = options_.gradient_stats().every();
    if (every > 0 && (counters_.steps + 1) % every == 0) {
      report.gradient_stats = tensors_.gradient_stats(
          *model_, counters_.steps + 1, report.scale, options_.gradient_stats().group_depth(),
          /*in_masters=*/n > 1 || data_parallel_);
      gradient_stats_ = report.gradient_stats;
    }
    detail::UnscalePlan unscale;
    unscale.max_grad_norm(options_.max_grad_norm());
    if (masters && n == 1 && !data_parallel_) {
      unscale.grads_from(masters->grad_sources());  // else in place
    }
    if (data_parallel_) {
      unscale.agree([this](at::Tensor& found) { data_parallel_->agree_step(found, calls_); });
      if (tensors_.sharded()) {
        unscale.collective_on(data_parallel_->device());
        unscale.sum_over_ranks([this](double& sum_of_squares, bool& non_finite) {
          data_parallel_->sum_over_shards(sum_of_squares, non_finite);
        });
      }
    }
    // A NaN loss can have finite gradients. On the CPU the check is a read of one float; on a
    // device it joins the gradients' inf check, without a synchronisation.
    at::Tensor also_check;
    if (!loss_sum_.device().is_cpu() || !std::isfinite(loss_sum_.item<double>())) {
      also_check = loss_sum_;
    }
    // fp8: an inf/NaN amax skips the step (a saturating cast would have hidden an inf).
    if (const auto amaxes = fp8_.pending_amaxes(); amaxes.defined()) {
      also_check = also_check.defined()
                       ? at::cat({also_check.reshape({-1}).to(amaxes.options()), amaxes})
                       : amaxes;
    }
    if (also_check.defined()) unscale.also_check(also_check);
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
      fp8_.finish_step(/*stepped=*/false);
      throw;
    }
    engine_.reset_stages();
    scaler_.update_scale(/*found_inf=*/!stepped);
    fp8_.finish_step(stepped);
    if (stepped) {
      if (masters) masters->copy_to_model();
      // Sharded: each rank stepped its slices; every rank's model gets all of them. A peer lost
      // here leaves this rank's slices stepped and its model not: restore from a checkpoint.
      if (tensors_.sharded()) data_parallel_->gather_parameters();
      // The weights changed: casts cached by an enclosing autocast scope are stale now.
      at::autocast::clear_cache();
    }
    ++counters_.steps;
    consecutive_skips_ = stepped ? 0 : consecutive_skips_ + 1;
    if (!stepped) {
      ++counters_.skipped_steps;
      report.overflow = tensors_.find_overflow(*model_, losses, data_parallel_ != nullptr);
    }
    report.status = stepped ? StepStatus::stepped : StepStatus::skipped;
    report.step = counters_.steps;
    notify(report);  // on_step may read the gradients
    // None stays for an optimizer.step() of the user's to apply a second time (the habit of
    // Python's `scaler.step(opt); opt.step()`): PyTorch's zero_grad() after the step.
    tensors_.clear_grads(*optimizer_);
    detail::check_consecutive_skips(options_.max_consecutive_skips(), consecutive_skips_,
                                    report, scaler_.get_scale());
    return report;
  }


  // Sharded: the optimizer and masters of an unsharded trainer (detail::consolidate); else none.
  std::optional<detail::ConsolidatedState> consolidated(bool values, bool state) const {
    if (!tensors_.sharded()) return std::nullopt;
    return detail::consolidate(*data_parallel_, *optimizer_, P::master_weights, values, state);
  }

  const MasterWeights* masters_of(const std::optional<detail::ConsolidatedState>& view) const {
    return view ? view->masters_or_null() : tensors_.masters();
  }

  detail::CheckpointParts parts(const std::optional<detail::ConsolidatedState>& view) const {
    return {detail::policy_identity<P>(), *model_, view ? *view->optimizer : *optimizer_,
            masters_of(view), data_parallel_.get(), options_.fused_optimizer()};
  }

  void check_saveable(const UserValues& user) const {
    check_not_busy("save");
    MIXPREC_CHECK(pending_ == 0, "save() in the middle of an accumulation (", pending_, " of ",
                  options_.accumulation_steps(), " micro-batches): save after a step");
    detail::check_user_values(user);
  }

  void write(torch::serialize::OutputArchive& archive, const detail::RankRngs& rngs,
             const UserValues& user,
             const std::optional<detail::ConsolidatedState>& view) const {
    detail::write_state(archive, parts(view), counters_, c10::IValue(scaler_.state_dict()),
                             rngs, user);
    if constexpr (detail::fp8_policy<P>) archive.write("mixprec.fp8", c10::IValue(fp8_.state_dict()));
  }

  // load(path) and load(archive): a param group added since the last step (or a new optimizer)
  // is adopted first, as step() would (the checkpoint of a run that had adopted it holds its
  // masters and state, which must not be dropped); then the data-parallel vote around
  // `load_checked_with(commit)`.
  template <class Load>
  UserValues load_with(const std::string& source, Load&& load_checked_with) {
    check_not_busy("load");
    adopt_optimizer_changes();
    return detail::voted_load(data_parallel_.get(), source, [&](auto& commit) {
      return detail::checked_or_error(source, [&] { return load_checked_with(commit); });
    });
  }

  // Reads and checks everything (the scaler's state too, in a scaler of its own) before
  // commit(); then changes the trainer.
  template <class Commit>
  UserValues load_checked(torch::serialize::InputArchive& archive, const std::string& source,
                          Commit& commit) {
    auto view = consolidated(/*values=*/false, /*state=*/false);
    auto loaded = detail::read_state(archive, source, parts(view));
    auto scaler = detail::make_scaler<P>(options_);
    scaler.load_state_dict(loaded.scaler_state.toGenericDict());
    std::vector<std::pair<at::Tensor*, at::Tensor>> fp8_state;
    if constexpr (detail::fp8_policy<P>) {
      c10::IValue saved;
      archive.try_read("mixprec.fp8", saved);
      fp8_state = fp8_.check_state(saved, source, /*recipe_recorded=*/loaded.policy_settings);
    }
    commit();  // every rank has read and checked all of it
    if (view) {  // sharded: read into the full view, then each rank takes its slices
      detail::apply_state(loaded, *view->optimizer);
      data_parallel_->scatter_state(*view->optimizer);
    } else {
      detail::apply_state(loaded, *optimizer_);
    }
    detail::Fp8Layers::apply_state(fp8_state);
    fp8_.finish_step(/*stepped=*/false);  // an accumulation's amaxes belong to another run
    scaler_ = std::move(scaler);
    counters_ = loaded.counters;
    // Micro-batches accumulated before the load belong to another run: forget their losses
    // (a NaN among them would skip the next step) and gradients.
    pending_ = 0;
    loss_sum_ = at::Tensor();
    last_graph_ = at::Tensor();
    consecutive_skips_ = 0;
    buffers_synced_ = false;
    calls_ = counters_.micro_batches;  // the same on every rank that loaded this checkpoint
    tensors_.clear_grads(*optimizer_);
    return std::move(loaded.user);
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
                  "optimizer steps");
    tensors_.adopt(*model_, *optimizer_);
    if (data_parallel_) tensors_.bind(*data_parallel_, *model_);  // the new masters' averages
  }

  // After loss_fn: with every gradient cleared or held aside before it ran, a model tensor
  // with a gradient now means that loss_fn ran a backward pass itself, which the Trainer's own
  // (scaled) one would add to, or fail on ("backward through the graph a second time").
  void check_no_backward_in_loss_fn() {
    const auto name = tensors_.first_with_grad(*model_);
    if (name.empty()) return;
    tensors_.clear_model_grads();  // the partial sums of earlier micro-batches stay held
    detail::fail("loss_fn ran a backward pass itself (parameter '", name, "' has a gradient "
                 "after it): return the loss and let the Trainer run backward(), which scales "
                 "it for ", P::name, ", accumulates and steps. Nothing was stepped");
  }

  void notify(const StepReport& report) const {
    if (options_.on_step()) options_.on_step()(report);
  }

  std::shared_ptr<torch::nn::Module> model_;
  torch::optim::Optimizer* optimizer_;
  TrainerOptions options_;
  scaler_type scaler_;
  detail::TrainedTensors<P> tensors_;
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

namespace detail {

// How torch::load/save's arguments name what they read or write: a path, or a stream.
template <class First, class... Rest>
std::string archive_source(const First& first, const Rest&...) {
  if constexpr (std::is_convertible_v<const First&, std::string_view>) {
    return "'" + std::string(std::string_view(first)) + "'";
  } else {
    return "the stream";
  }
}

// Runs LibTorch's archive I/O; what it throws about the user's file becomes a mixprec::Error.
template <class Io>
void archive_io(const char* call, bool reading, const std::string& source, Io&& io) {
  try {
    io();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(call, ": cannot ", reading ? "read " : "write ", source, " as a Trainer "
         "archive (missing, truncated or corrupt file, or no space): ", message_of(e),
         "; nothing was changed");
  }
}

}  // namespace detail
}  // namespace mixprec

namespace torch {

/// `torch::load(trainer, path)`: LibTorch's, with a file it cannot read (missing, truncated,
/// corrupt) a mixprec::Error as Trainer::load(path) gives, the trainer unchanged. More
/// specialised than LibTorch's template, so overload resolution picks it for a Trainer.
template <class P, class... LoadFromArgs>
void load(mixprec::Trainer<P>& trainer, LoadFromArgs&&... args) {
  serialize::InputArchive archive;
  mixprec::detail::archive_io("torch::load(trainer, ...)", /*reading=*/true,
                              mixprec::detail::archive_source(args...),
                              [&] { archive.load_from(std::forward<LoadFromArgs>(args)...); });
  archive >> trainer;
}

/// `torch::save(trainer, path)`: LibTorch's, with a failed write a mixprec::Error.
template <class P, class... SaveToArgs>
void save(const mixprec::Trainer<P>& trainer, SaveToArgs&&... args) {
  serialize::OutputArchive archive(std::make_shared<jit::CompilationUnit>());
  archive << trainer;
  mixprec::detail::archive_io("torch::save(trainer, ...)", /*reading=*/false,
                              mixprec::detail::archive_source(args...),
                              [&] { archive.save_to(std::forward<SaveToArgs>(args)...); });
}

}  // namespace torch
