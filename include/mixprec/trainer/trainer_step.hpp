#pragma once
// Trainer<P>'s step, stage by stage (declared in trainer.hpp, which includes this header at its
// end): start the micro-batch, run the forward and the backward; on the last micro-batch, the
// optimizer step (unscale, check, clip, step or skip) and what follows it (the scale, on_step,
// the schedule). Functions of the policy alone, not of the caller's loss_fn: compiled once per
// policy, in the companion where it is linked (precompiled.hpp).

#include <mixprec/trainer/trainer.hpp>

#include <ATen/ATen.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace mixprec {

// One micro-batch: start it, run the forward, run the backward; every accumulation_steps-th,
// the optimizer step.
template <class P>
StepReport Trainer<P>::run_step(detail::LossFnRef loss_fn) {
  check_not_busy("step");
  schedule_.check_untouched();
  const detail::Busy busy(busy_, "step()'s loss_fn");
  start_micro_batch();
  const auto forward = detail::forward_pass<P>(*model_, tensors_.device_types(),
                                               options_.find_non_finite_op(), loss_fn);
  detail::check_no_backward_in(*model_, tensors_, P::name);
  // The last step's graph (its saved tensors freed by backward) lives until this forward has
  // run, as the `loss` variable of a hand-written loop keeps it: the parameters' gradient
  // accumulators are then reused instead of made anew each step.
  last_graph_ = forward.loss;
  if (backward_step_) return step_in_backward(forward);
  // The partial sums go back where the backward pass adds to them; should anything below
  // throw, they are held aside again, as between any two calls.
  tensors_.release_grads();
  detail::OnUnwind hold_again([this] { tensors_.hold_grads(*optimizer_); });
  auto report = backward_micro_batch(forward);
  if (pending_ < options_.accumulation_steps()) {
    report.step = counters_.steps;
    // Held before on_step: an optimizer.zero_grad() or step() there finds no partial sum.
    tensors_.hold_grads(*optimizer_);
    hold_again.dismiss();
    notify(report);
    return report;
  }
  hold_again.dismiss();  // from here on an exception leaves the gradients to the next step
  optimizer_step(report);
  return report;
}

// Before the forward pass: the scale, the optimizer's changes, the schedule, the buffers.
template <class P>
void Trainer<P>::start_micro_batch() {
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
}

// The scaled backward pass of one micro-batch, its gradients reduced (data parallel, last
// micro-batch) or summed where the next ones add to them.
template <class P>
StepReport Trainer<P>::backward_micro_batch(const detail::ForwardResult& forward) {
  const auto& loss32 = forward.loss;
  const auto n = options_.accumulation_steps();
  const auto to_backprop = n > 1 ? loss32 / static_cast<double>(n) : loss32;
  StepReport report;
  report.scale = engine_.get_scale();
  report.lr = schedule_.lr(*optimizer_);
  report.non_finite_op = forward.non_finite_op;
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
  return report;
}

// The last micro-batch's: statistics, the optimizer step (or its skip), the scale's update,
// on_step, the schedule.
template <class P>
void Trainer<P>::optimizer_step(StepReport& report) {
  pending_ = 0;
  auto* const masters = tensors_.masters();
  const auto every = options_.gradient_stats().every();
  if (every > 0 && (counters_.steps + 1) % every == 0) {
    report.gradient_stats = detail::gradient_stats(
        *model_, masters, counters_.steps + 1, report.scale,
        options_.gradient_stats().group_depth(),
        /*in_masters=*/options_.accumulation_steps() > 1 || data_parallel_);
    gradient_stats_ = report.gradient_stats;
  }
  const auto losses = std::move(loss_sum_);
  loss_sum_ = at::Tensor();
  // Lean storage: fp32 masters and moments from here to the end of the optimizer step; or,
  // fused on the CPU (a block format's moments: always), one pass over what it keeps, lean
  // masters reading the model's gradients in place.
  const bool one_pass = detail::one_pass_step<P>(options_.fused_optimizer(), tensors_.cpu_only());
  const detail::LeanStep<P> lean(masters, *optimizer_, /*inflate=*/!one_pass,
                                 data_parallel_.get());
  const auto done = take_step(masters, losses, one_pass);
  const bool stepped = done.stepped;
  report.grad_norm = done.grad_norm;
  scaler_.update_scale(/*found_inf=*/!stepped);
  fp8_.finish_step(stepped);
  if (stepped) detail::after_step_taken(masters, data_parallel_.get());
  ++counters_.steps;
  consecutive_skips_ = stepped ? 0 : consecutive_skips_ + 1;
  if (!stepped) {
    ++counters_.skipped_steps;
    report.overflow = detail::find_overflow(*model_, masters, losses, data_parallel_ != nullptr);
  }
  report.status = stepped ? StepStatus::stepped : StepStatus::skipped;
  report.step = counters_.steps;
  after_step(report, done.grad_divisor);
}

// TrainerOptions::step_in_backward: the backward pass steps each trained tensor as soon as its
// gradient is complete (step_leaf, called by BackwardStep's hooks); what follows is the ordinary
// step's end. A loss that is inf/NaN skips the step whole, before any gradient exists.
template <class P>
StepReport Trainer<P>::step_in_backward(const detail::ForwardResult& forward) {
  StepReport report;
  report.scale = engine_.get_scale();
  report.lr = schedule_.lr(*optimizer_);
  report.non_finite_op = forward.non_finite_op;
  report.loss = forward.loss.detach();
  // Read once: each tensor's step then checks this host copy, not the device's loss again.
  const auto host_loss = report.loss.to(at::kCPU);
  const bool finite = std::isfinite(host_loss.template item<double>());
  if (finite) {
    backward_step_->install(trained_leaves());
    try {
      {
        const auto armed = backward_step_->arm(
            [this, &host_loss](const at::Tensor& leaf) { return step_leaf(leaf, host_loss); });
        engine_.scale(forward.loss).backward();
      }
      backward_step_->finish(counters_.steps + 1);
    } catch (...) {
      tensors_.clear_grads(*optimizer_);
      throw;
    }
    // A lean storage's round is counted, as after the ordinary step (stochastic rounding's
    // bits depend on it); fp32 masters were rounded into the model tensor by tensor.
    if constexpr (detail::lean_pass_storage<P>) {
      if (auto* const masters = tensors_.masters()) masters->copy_to_model();
    }
    at::autocast::clear_cache();  // autocast's casts of the old weights
  }
  ++counters_.micro_batches;
  report.micro_batch = 1;
  scaler_.update_scale(/*found_inf=*/!finite);
  ++counters_.steps;
  consecutive_skips_ = finite ? 0 : consecutive_skips_ + 1;
  if (!finite) ++counters_.skipped_steps;
  report.status = finite ? StepStatus::stepped : StepStatus::skipped;
  report.step = counters_.steps;
  after_step(report, 1.0);
  return report;
}

// One tensor's step inside the backward pass: the ordinary step's passes over the one gradient
// that exists now (every other is none), the master written into the model, the gradients freed.
// False where the gradient held inf/NaN: nothing stepped.
template <class P>
bool Trainer<P>::step_leaf(const at::Tensor& leaf, const at::Tensor& loss) {
  auto* const masters = tensors_.masters();
  const auto master = masters != nullptr ? masters->master_of(leaf) : at::Tensor();
  const bool one_pass = detail::one_pass_step<P>(options_.fused_optimizer(), tensors_.cpu_only());
  const auto done = take_step(masters, loss, one_pass);
  const at::NoGradGuard no_grad;
  // fp32 masters (MixedO2's): rounded into the model; lean ones updated it in place.
  if (done.stepped && master.defined() && !master.is_same(leaf) &&
      !detail::lean_pass_storage<P>) {
    leaf.copy_(master);
  }
  leaf.mutable_grad().reset();
  if (master.defined()) master.mutable_grad().reset();
  return done.stepped;
}

// The model parameters the optimizer trains, directly or through a master, each once.
template <class P>
std::vector<std::pair<std::string, at::Tensor>> Trainer<P>::trained_leaves() const {
  const auto trained = detail::identities(detail::optimizer_tensors(*optimizer_));
  const auto* const masters = tensors_.masters();
  std::vector<std::pair<std::string, at::Tensor>> leaves;
  for (const auto& [name, p] : detail::unique_named(model_->named_parameters())) {
    if (!p.requires_grad()) continue;
    auto holder = masters != nullptr ? masters->master_of(p) : at::Tensor();
    if (!holder.defined()) holder = p;
    if (trained.count(detail::id_of(holder)) != 0) leaves.emplace_back(name, p);
  }
  return leaves;
}

// Unscale, check, clip and step (or skip), with the lean storage's values made for it: in one
// pass over what the storage keeps where `one_pass`.
template <class P>
detail::OptimizerStep Trainer<P>::take_step(MasterWeights* masters, const at::Tensor& losses,
                                            bool one_pass) {
  const auto n = options_.accumulation_steps();
  const bool model_grads = one_pass && detail::lean_pass_storage<P>;
  if (model_grads && n == 1 && !data_parallel_) masters->alias_grads();
  const auto plan = detail::plan_unscale(options_, model_grads ? nullptr : masters, n,
                                         data_parallel_.get(), calls_, losses,
                                         fp8_.pending_amaxes());
  try {
    return detail::take_optimizer_step(
        engine_, *optimizer_, plan, options_.fused_optimizer(),
        one_pass ? detail::one_pass_step_of<P>(*optimizer_, masters, data_parallel_.get())
                 : detail::OnePassStep());
  } catch (...) {
    fp8_.finish_step(/*stepped=*/false);
    throw;
  }
}

// After the optimizer step: on_step, with the gradients it was taken with; then none left
// for a second update, and the schedule's next lr.
template <class P>
void Trainer<P>::after_step(const StepReport& report, double grad_divisor) {
  {
    // on_step reads the gradients the step used (gradients()); a model tensor stepped through
    // another tensor (a master, a piece) shows none of its own. The step is taken: an on_step
    // that throws (a failed metrics push, a log that cannot be written) leaves no gradient
    // for a second update, nor the schedule a step behind.
    detail::OnUnwind finish_anyway([this] { finish_step_quietly(); });
    tensors_.clear_stand_in_grads();
    gradients_.open(*optimizer_, grad_divisor);
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
}

}  // namespace mixprec
