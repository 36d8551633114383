#pragma once
// The learning-rate schedule a Trainer drives (TrainerOptions::lr_scheduler, lr_lambda): advanced
// once per optimizer step, taken or skipped, as `scheduler.step()` after `scaler.update()` in
// Python's AMP loop; its state in the checkpoint; the lr each StepReport carries.
//
// Python's schedulers make one step in their constructor (last_epoch -1 -> 0); LibTorch's do not,
// so a LibTorch StepLR stepped once per optimizer step decays one step later than Python's. The
// Trainer makes that initial step for a scheduler that has not stepped yet: then the lr of
// optimizer step k is Python's for every LRScheduler whose get_lrs() reads its step count as
// Python's get_lr() reads last_epoch (StepLR does).
//
// A Python scheduler belongs to the optimizer it was built on. A new optimizer assigned to the
// Trainer's (new options for every param group) brings its own lrs, and the schedule goes on
// from them at the Trainer's step, as a Python scheduler built on the new optimizer with
// last_epoch at that step would: lr_lambda takes them as its base lrs (lr = new lr * f(k));
// a LibTorch scheduler makes this step's step again, on them (StepLR: the new lr, decayed where
// k is a boundary). A param group added later brings its lr too: lr_lambda's base for it; a
// scheduler must return an lr for it from its next step on (Python's scheduler step() raises
// where it does not, after optimizer.step(), as LibTorch's throws c10::Error): the Trainer asks
// for that step's lrs before the first micro-batch after the group arrived, and a scheduler
// that returns too few (one that keeps base lrs of its own) is an Error before anything changes.

#include <mixprec/core/error.hpp>
#include <mixprec/trainer/options.hpp>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mixprec::detail {

// LibTorch's LRScheduler keeps its step count and its reading of the optimizer's lrs protected.
// A pointer to member formed in a derived class reaches them on any LRScheduler (access is
// checked where the pointer is formed, and a derived class may form it); never instantiated.
struct LrSchedulerAccess : torch::optim::LRScheduler {
  static auto& count(torch::optim::LRScheduler& scheduler) {
    return scheduler.*(&LrSchedulerAccess::step_count_);
  }
  static std::vector<double> current_lrs(const torch::optim::LRScheduler& scheduler) {
    return (scheduler.*(&LrSchedulerAccess::get_current_lrs))();
  }
  // The lrs its next step() would set (a virtual call; step() itself also counts).
  static std::vector<double> next_lrs(torch::optim::LRScheduler& scheduler) {
    return (scheduler.*(&LrSchedulerAccess::get_lrs))();
  }
};

// Each param group's lr (LibTorch's OptimizerOptions::get_lr; every built-in optimizer has it).
inline std::vector<double> group_lrs(const torch::optim::Optimizer& optimizer) {
  std::vector<double> lrs;
  for (const auto& group : optimizer.param_groups()) lrs.push_back(group.options().get_lr());
  return lrs;
}

inline void set_group_lrs(torch::optim::Optimizer& optimizer, const std::vector<double>& lrs) {
  auto& groups = optimizer.param_groups();
  for (std::size_t g = 0; g < groups.size() && g < lrs.size(); ++g) {
    groups[g].options().set_lr(lrs[g]);
  }
}

// Whether the optimizer's options implement get_lr() (a custom OptimizerOptions may not: its
// StepReport::lr is NaN, and it takes no schedule).
inline bool reads_lr(const torch::optim::Optimizer& optimizer) {
  if (optimizer.param_groups().empty()) return false;
  try {
    (void)optimizer.param_groups().front().options().get_lr();
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

/// A checkpoint's schedule state, read and checked; applied by LrSchedule::apply.
struct ScheduleState {
  std::int64_t count = 0;        // the LRScheduler's step count
  std::vector<double> base_lrs;  // lr_lambda: each group's lr at the start
};

class LrSchedule {
 public:
  /// Checks the options against the optimizer; changes nothing.
  LrSchedule(const TrainerOptions& options, torch::optim::Optimizer& optimizer)
      : scheduler_(options.lr_scheduler()),
        factor_(options.lr_lambda()),
        on_warning_(options.on_warning()),
        accumulation_steps_(options.accumulation_steps()),
        reads_lr_(reads_lr(optimizer)) {
    MIXPREC_CHECK(!(scheduler_ && factor_), "TrainerOptions: lr_scheduler and lr_lambda are "
                  "both set; the Trainer drives one schedule: set one of them");
    if (!active()) return;
    MIXPREC_CHECK(reads_lr_, "TrainerOptions::", kind(), ": the optimizer's options have no "
                  "get_lr() (a custom OptimizerOptions must override get_lr and set_lr to take "
                  "a schedule)");
    if (scheduler_) {
      check_scheduler_of(optimizer);
      // The first step start() makes, checked before the Trainer changes the model.
      if (LrSchedulerAccess::count(*scheduler_) == 0) {
        first_lrs_ = LrSchedulerAccess::next_lrs(*scheduler_);
        check_count(first_lrs_, optimizer);
        for (std::size_t g = 0; g < first_lrs_.size(); ++g) {
          MIXPREC_CHECK(std::isfinite(first_lrs_[g]) && first_lrs_[g] >= 0,
                        "TrainerOptions::lr_scheduler: its first step (the one Python's "
                        "constructor makes) sets param group ", g, "'s lr to ", first_lrs_[g],
                        ": the lr must be finite and >= 0");
        }
      }
    }
    if (factor_) checked_factor(0, /*group=*/0, optimizer.param_groups().front().options().get_lr());
  }

  bool active() const noexcept { return scheduler_ || factor_; }

  /// The constructor's part of Python's scheduler (last_epoch -1 -> 0): a LibTorch scheduler
  /// that has not stepped makes its first step; lr_lambda sets each group's lr to base * f(0).
  void start(torch::optim::Optimizer& optimizer) {
    options_of_ = options_ids(optimizer);
    if (scheduler_) {
      // LRScheduler::step() is get_lrs(), set them, count: with the lrs the constructor
      // checked, so that a get_lrs() with state of its own runs once for this step.
      if (LrSchedulerAccess::count(*scheduler_) == 0) {
        set_group_lrs(optimizer, first_lrs_);
        ++LrSchedulerAccess::count(*scheduler_);
      }
      scheduled_groups_ = optimizer.param_groups().size();
      expected_count_ = LrSchedulerAccess::count(*scheduler_);
    } else if (factor_) {
      base_lrs_ = group_lrs(optimizer);
      apply_factor(optimizer, 0);
    }
  }

  /// The lr of the optimizer's first param group: the one its next update uses. NaN where the
  /// options have no get_lr().
  double lr(const torch::optim::Optimizer& optimizer) const {
    return reads_lr_ ? optimizer.param_groups().front().options().get_lr()
                     : std::numeric_limits<double>::quiet_NaN();
  }

  /// Before a step() or save() changes anything: a scheduler the Trainer drives was not
  /// stepped by the user too (the habit of Python's loop, which would advance it twice).
  void check_untouched() const {
    if (!scheduler_) return;
    const auto count = static_cast<std::int64_t>(LrSchedulerAccess::count(*scheduler_));
    MIXPREC_CHECK(count == expected_count_, "the learning-rate scheduler of "
                  "TrainerOptions::lr_scheduler was stepped outside the Trainer (its step count "
                  "is ", count, ", the Trainer left it at ", expected_count_, "): the Trainer "
                  "steps it once per optimizer step; remove your scheduler->step() call. "
                  "Nothing was changed");
  }

  /// Each micro-batch, before its forward pass (`steps`: optimizer steps so far): param groups
  /// with new options (a new optimizer, a group added; adopted by the Trainer) bring their
  /// lrs (follow_new_options). And an lr that changes between the micro-batches of one optimizer
  /// step means a schedule stepped per trainer.step() call, which with accumulation advances
  /// accumulation_steps times per optimizer step: warned once.
  void before_micro_batch(torch::optim::Optimizer& optimizer, std::int64_t pending,
                          std::int64_t steps) {
    const bool renewed = follow_new_options(optimizer, steps);
    // A group count the scheduler has not stepped for: its next lrs, asked now (once: its step
    // uses them), before the forward pass.
    if (scheduler_ && !next_lrs_ && optimizer.param_groups().size() != scheduled_groups_) {
      auto lrs = LrSchedulerAccess::next_lrs(*scheduler_);
      check_count(lrs, optimizer);
      next_lrs_ = std::move(lrs);
    }
    if (warned_ || accumulation_steps_ <= 1 || !reads_lr_) return;
    if (pending == 0 || renewed) {  // new options explain a new lr
      lrs_at_first_ = group_lrs(optimizer);
      return;
    }
    if (group_lrs(optimizer) == lrs_at_first_) return;
    warned_ = true;
    const std::string message =
        "mixprec: the optimizer's learning rate changed between micro-batches of one optimizer "
        "step (accumulation_steps " + std::to_string(accumulation_steps_) + "): a scheduler "
        "stepped after every trainer.step() call advances that many times per optimizer step. "
        "Give it to TrainerOptions::lr_scheduler (or use lr_lambda): the Trainer steps it once "
        "per optimizer step, as Python's loop does";
    if (on_warning_) {
      on_warning_(message);
    } else {
      TORCH_WARN(message);
    }
  }

  /// After optimizer step `steps` (1-based, taken or skipped): the lr of step `steps` + 1.
  void advance(torch::optim::Optimizer& optimizer, std::int64_t steps) {
    if (scheduler_) {
      step_scheduler(optimizer, steps);
      expected_count_ = LrSchedulerAccess::count(*scheduler_);
    } else if (factor_) {
      apply_factor(optimizer, steps);
    }
  }

  void write(torch::serialize::OutputArchive& archive) const {
    if (!active()) return;
    archive.write("lr_schedule.kind", c10::IValue(std::string(kind())));
    archive.write("lr_schedule.count", at::tensor({expected_count_}, at::kLong));
    archive.write("lr_schedule.base_lrs", at::tensor(base_lrs_, at::kDouble));
  }

  /// The checkpoint's schedule state, checked against this Trainer's; changes nothing.
  ScheduleState read(torch::serialize::InputArchive& archive, const std::string& path) const {
    c10::IValue saved_kind;
    const bool saved = archive.try_read("lr_schedule.kind", saved_kind);
    MIXPREC_CHECK(saved || !active(), "checkpoint '", path, "' holds no learning-rate "
                  "schedule, this Trainer has TrainerOptions::", kind(), ": it would restart "
                  "the schedule at step 0. Resume with the options the checkpoint was written "
                  "with (no schedule)");
    ScheduleState state;
    if (!saved) return state;
    MIXPREC_CHECK(saved_kind.isString(), "'", path, "' holds a damaged learning-rate schedule");
    MIXPREC_CHECK(active(), "checkpoint '", path, "' was written with a learning-rate schedule "
                  "(TrainerOptions::", saved_kind.toStringRef(), "), this Trainer has none: "
                  "its lr would stay where the checkpoint left it. Give it the same schedule");
    MIXPREC_CHECK(saved_kind.toStringRef() == kind(), "checkpoint '", path, "' was written "
                  "with TrainerOptions::", saved_kind.toStringRef(), ", this Trainer has ",
                  kind(), ": give it the same kind of schedule");
    at::Tensor count, base_lrs;
    MIXPREC_CHECK(archive.try_read("lr_schedule.count", count) &&
                      archive.try_read("lr_schedule.base_lrs", base_lrs) &&
                      count.scalar_type() == at::kLong && count.numel() == 1 &&
                      count.item<std::int64_t>() >= 0 &&
                      base_lrs.scalar_type() == at::kDouble && base_lrs.dim() == 1,
                  "'", path, "' holds a damaged learning-rate schedule");
    state.count = count.item<std::int64_t>();
    const auto* begin = base_lrs.data_ptr<double>();
    state.base_lrs.assign(begin, begin + base_lrs.numel());
    return state;
  }

  /// After the optimizer's options (and so its lrs) were restored: new objects, not new lrs.
  void apply(const ScheduleState& state, const torch::optim::Optimizer& optimizer) {
    options_of_ = options_ids(optimizer);
    if (scheduler_) {
      using Count = std::remove_reference_t<decltype(LrSchedulerAccess::count(*scheduler_))>;
      LrSchedulerAccess::count(*scheduler_) = static_cast<Count>(state.count);
      expected_count_ = state.count;
      next_lrs_.reset();  // asked at another count
    } else if (factor_) {
      base_lrs_ = state.base_lrs;
    }
    lrs_at_first_.clear();
  }

 private:
  const char* kind() const { return scheduler_ ? "lr_scheduler" : "lr_lambda"; }

  // The scheduler sets the lrs of the optimizer it was built on: refuse another one's. A NaN
  // in this optimizer's first lr (put back at once) shows whether the scheduler reads it.
  void check_scheduler_of(torch::optim::Optimizer& optimizer) const {
    auto& options = optimizer.param_groups().front().options();
    const double lr = options.get_lr();
    options.set_lr(std::numeric_limits<double>::quiet_NaN());
    std::vector<double> seen;
    try {
      seen = LrSchedulerAccess::current_lrs(*scheduler_);
    } catch (...) {
      options.set_lr(lr);
      throw;
    }
    options.set_lr(lr);
    MIXPREC_CHECK(seen.size() == optimizer.param_groups().size() && std::isnan(seen.front()),
                  "TrainerOptions::lr_scheduler: the scheduler was built on another optimizer "
                  "than the Trainer's; build it on the optimizer you pass to the Trainer");
  }

  // Whether a param group keeps its options object when the optimizer's vector of groups grows
  // (LibTorch 2.x moves the groups). LibTorch 1.13's groups have no move constructor: the copy
  // clones their options, and add_param_group gives every earlier group a new one; its
  // optimizers cannot be assigned either, so there the groups beyond the known ones are new.
  static constexpr bool groups_keep_options =
      std::is_nothrow_move_constructible_v<torch::optim::OptimizerParamGroup>;

  static std::vector<const void*> options_ids(const torch::optim::Optimizer& optimizer) {
    std::vector<const void*> ids;
    for (const auto& group : optimizer.param_groups()) ids.push_back(&group.options());
    return ids;
  }

  // The param groups whose options object the schedule has not seen (the file comment): their
  // lrs are where the schedule goes on from. Nothing changes unless all of it can be done.
  // Whether any group was new.
  bool follow_new_options(torch::optim::Optimizer& optimizer, std::int64_t steps) {
    const auto ids = options_ids(optimizer);
    std::vector<std::size_t> fresh;
    for (std::size_t g = 0; g < ids.size(); ++g) {
      if (g >= options_of_.size() || (groups_keep_options && ids[g] != options_of_[g])) {
        fresh.push_back(g);
      }
    }
    if (fresh.empty()) return false;
    if (factor_) {
      const auto current = group_lrs(optimizer);
      auto bases = base_lrs_;
      bases.resize(current.size());
      auto lrs = current;
      for (const auto g : fresh) {
        bases[g] = current[g];
        lrs[g] = checked_factor(steps, g, bases[g]);
      }
      set_group_lrs(optimizer, lrs);
      base_lrs_ = std::move(bases);
    } else if (scheduler_ && fresh.size() == ids.size()) {
      auto& count = LrSchedulerAccess::count(*scheduler_);
      next_lrs_.reset();  // asked of the old optimizer's lrs
      --count;  // a new optimizer: this step's step again, on its lrs
      try {
        step_scheduler(optimizer, steps);
      } catch (...) {
        ++count;
        throw;
      }
    }
    options_of_ = ids;
    return true;
  }

  double checked_factor(std::int64_t step, std::size_t group, double base) const {
    const double factor = factor_(step);
    const double lr = base * factor;
    MIXPREC_CHECK(std::isfinite(lr) && lr >= 0, "TrainerOptions::lr_lambda(", step, ") "
                  "returned ", factor, ", which makes param group ", group, "'s lr ", lr,
                  " (base ", base, "): the lr must be finite and >= 0");
    return lr;
  }

  // Python's LambdaLR: each group's lr is its base lr times f(step). A group added since (a
  // late param group, e.g. inside on_step) takes its lr as it joins as its base (Python's
  // LambdaLR ignores it).
  void apply_factor(torch::optim::Optimizer& optimizer, std::int64_t step) {
    follow_new_options(optimizer, step);
    const auto current = group_lrs(optimizer);
    std::vector<double> lrs;
    for (std::size_t g = 0; g < current.size(); ++g) {
      lrs.push_back(checked_factor(step, g, base_lrs_[g]));
    }
    set_group_lrs(optimizer, lrs);
  }

  // One lr per param group, or an Error that says which scheduler does not give them.
  static void check_count(const std::vector<double>& lrs, const torch::optim::Optimizer& optimizer) {
    MIXPREC_CHECK(lrs.size() == optimizer.param_groups().size(), "TrainerOptions::lr_scheduler: "
                  "its get_lrs() returns ", lrs.size(), " lrs for the optimizer's ",
                  optimizer.param_groups().size(), " param groups (a scheduler that keeps an "
                  "lr of its own per group, and a group added since?): give it one lr per group "
                  "(extend what it keeps when you add the group, or compute them from "
                  "get_current_lrs()). Nothing was changed");
  }

  // LRScheduler::step() (get_lrs(), set them, count), with the lrs checked before they are
  // set: one that is not finite and >= 0 would turn the next update into inf/NaN, too few for
  // the groups throws c10::Error in LibTorch's step() (a group added inside on_step: the Error
  // comes here, after the step). get_lrs() runs once per step: its lrs asked before the forward
  // pass (before_micro_batch) are this step's.
  void step_scheduler(torch::optim::Optimizer& optimizer, std::int64_t steps) {
    const auto before = group_lrs(optimizer);
    const auto lrs = next_lrs_ ? std::move(*next_lrs_) : LrSchedulerAccess::next_lrs(*scheduler_);
    next_lrs_.reset();
    check_count(lrs, optimizer);
    for (std::size_t g = 0; g < lrs.size(); ++g) {
      if (std::isfinite(lrs[g]) && lrs[g] >= 0) continue;
      fail("TrainerOptions::lr_scheduler set param group ", g, "'s lr to ", lrs[g],
           " after optimizer step ", steps, ": the lr must be finite and >= 0. The lr stays ",
           before[g], " (optimizer step ", steps, " was taken or skipped as on_step reported)");
    }
    set_group_lrs(optimizer, lrs);
    ++LrSchedulerAccess::count(*scheduler_);
    scheduled_groups_ = lrs.size();
  }

  std::shared_ptr<torch::optim::LRScheduler> scheduler_;
  std::vector<double> first_lrs_;  // the lrs of its first step, checked by the constructor
  std::optional<std::vector<double>> next_lrs_;  // the next step's, asked before it (rare)
  std::size_t scheduled_groups_ = 0;  // the param groups its last step set
  std::function<double(std::int64_t)> factor_;
  std::function<void(const std::string&)> on_warning_;
  std::int64_t accumulation_steps_ = 1;
  bool reads_lr_ = false;
  std::int64_t expected_count_ = 0;  // the scheduler's count as the Trainer left it
  std::vector<double> base_lrs_;     // lr_lambda: each group's lr at the start
  std::vector<double> lrs_at_first_; // the lrs at this step's first micro-batch
  std::vector<const void*> options_of_;  // each group's options object, as last followed
  bool warned_ = false;
};

}  // namespace mixprec::detail
