// The learning-rate schedule a Trainer drives (TrainerOptions::lr_scheduler, lr_lambda;
// trainer/schedule.hpp): once per optimizer step, skipped ones included, from Python's first
// step; in the checkpoint; the lr in StepReport; and the mistakes around it. Parity with
// Python's StepLR and LambdaLR + GradScaler is in tests/test_parity.cpp.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace test_schedule {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct Mlp : torch::nn::Module {
  Mlp() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// A model and an SGD over two param groups (fc1 at lr 0.1, fc2 at 0.04), from one seed.
struct Setup {
  std::shared_ptr<Mlp> net;
  torch::optim::SGD sgd;
  at::Tensor x, y;
  static std::vector<torch::optim::OptimizerParamGroup> groups(Mlp& net) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(net.fc1->parameters(),
                   std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.1)));
    g.emplace_back(net.fc2->parameters(),
                   std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.04)));
    return g;
  }
  Setup()
      : net((torch::manual_seed(5), std::make_shared<Mlp>())),
        sgd(groups(*net), torch::optim::SGDOptions(0.1)),
        x(torch::randn({32, 8})),
        y(torch::randint(0, 3, {32}, at::kLong)) {}
};

// One micro-batch; `poisoned`: the loss is inf, so the optimizer step it ends is skipped.
template <class P>
mp::StepReport micro(mp::Trainer<P>& trainer, Setup& s, std::int64_t i, bool poisoned = false) {
  return trainer.step([&] {
    const auto rows = s.x.slice(0, 8 * (i % 4), 8 * (i % 4 + 1));
    auto loss = torch::nn::functional::cross_entropy(s.net->forward(rows),
                                                     s.y.slice(0, 8 * (i % 4), 8 * (i % 4 + 1)));
    return poisoned ? loss * kInf : loss;
  });
}

std::vector<double> lrs_of(const torch::optim::Optimizer& optimizer) {
  std::vector<double> lrs;
  for (const auto& g : optimizer.param_groups()) lrs.push_back(g.options().get_lr());
  return lrs;
}

// Python's StepLR (chainable form, as torch 2.x computes it): the lr of optimizer step k,
// by repeated multiplication.
double step_lr(double base, std::int64_t k, std::int64_t step_size, double gamma) {
  double lr = base;
  for (std::int64_t e = 1; e <= k; ++e) {
    if (e % step_size == 0) lr *= gamma;
  }
  return lr;
}

double warmup(std::int64_t k) {
  return k < 3 ? static_cast<double>(k + 1) / 4 : std::pow(0.75, static_cast<double>(k - 3));
}

// A scheduler of the user's: sets `lr` from its step count on, NaN from step `bad_from`.
struct BadScheduler : torch::optim::LRScheduler {
  BadScheduler(torch::optim::Optimizer& optimizer, unsigned bad_from)
      : LRScheduler(optimizer), bad_from_(bad_from) {}
  std::vector<double> get_lrs() override {
    auto lrs = get_current_lrs();
    if (step_count_ >= bad_from_) lrs.assign(lrs.size(), kNaN);
    return lrs;
  }
  unsigned bad_from_;
};

std::string temp(const std::string& name) {
  return (std::filesystem::path(MIXPREC_TEST_TMPDIR) / name).string();
}

}  // namespace

TEST_CASE("lr_scheduler: LibTorch's StepLR advances once per optimizer step, skipped ones too, "
          "with Python's lrs") {
  Setup s;
  auto scheduler = std::make_shared<torch::optim::StepLR>(s.sgd, 3, 0.5);
  mp::Trainer<mp::FullPrecision> trainer(
      s.net, s.sgd, mp::TrainerOptions().accumulation_steps(2).lr_scheduler(scheduler));
  for (std::int64_t k = 0; k < 10; ++k) {
    CAPTURE(k);
    const std::vector<double> expected = {step_lr(0.1, k, 3, 0.5), step_lr(0.04, k, 3, 0.5)};
    CHECK(lrs_of(s.sgd) == expected);  // each group, exactly
    const auto first = micro(trainer, s, 2 * k);
    const auto last = micro(trainer, s, 2 * k + 1, /*poisoned=*/k == 4);
    CHECK(first.status == mp::StepStatus::accumulating);
    CHECK(first.lr == expected[0]);  // while accumulating: the lr the step will use
    CHECK(last.lr == expected[0]);   // the lr it used (or would have, skipped)
    CHECK(last.status == (k == 4 ? mp::StepStatus::skipped : mp::StepStatus::stepped));
  }
  CHECK(lrs_of(s.sgd)[0] == step_lr(0.1, 10, 3, 0.5));
  CHECK(trainer.stats().skipped_steps == 1);

  // What the Trainer's first step is for: LibTorch's StepLR stepped by hand once per optimizer
  // step decays one step later than Python's (its first step() does not count).
  Setup hand;
  torch::optim::StepLR by_hand(hand.sgd, 3, 0.5);
  for (int k = 0; k < 3; ++k) by_hand.step();
  CHECK(lrs_of(hand.sgd)[0] == 0.1);  // Python's StepLR: 0.05 after 3 steps
}

TEST_CASE("lr_lambda: Python's LambdaLR, base lr times f(step) per group") {
  Setup s;
  mp::Trainer<mp::FullPrecision> trainer(s.net, s.sgd, mp::TrainerOptions().lr_lambda(warmup));
  CHECK(lrs_of(s.sgd) == std::vector<double>{0.1 * warmup(0), 0.04 * warmup(0)});  // at once
  for (std::int64_t k = 0; k < 8; ++k) {
    CAPTURE(k);
    CHECK(lrs_of(s.sgd)[0] == 0.1 * warmup(k));
    CHECK(lrs_of(s.sgd)[1] == 0.04 * warmup(k));
    const auto report = micro(trainer, s, k, /*poisoned=*/k == 2);
    CHECK(report.lr == 0.1 * warmup(k));
    CHECK(report.step == k + 1);
  }
}

TEST_CASE("lr_lambda: a param group added later joins the schedule at the step it joins") {
  // Added after 2 steps, where warmup is 0.75, not 1: a base taken from fc1's scheduled lr
  // (LibTorch 1.13's add_param_group gives fc1's group a new options object) would show.
  Setup s;  // the model; an SGD over fc1 alone, fc2 added after 2 steps (unfrozen)
  torch::optim::SGD sgd(s.net->fc1->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::FullPrecision> trainer(s.net, sgd, mp::TrainerOptions().lr_lambda(warmup));
  for (std::int64_t k = 0; k < 2; ++k) micro(trainer, s, k);
  sgd.add_param_group(torch::optim::OptimizerParamGroup(
      s.net->fc2->parameters(),
      std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.2))));
  for (std::int64_t k = 2; k < 6; ++k) {
    CAPTURE(k);
    std::vector<double> during;  // the lrs optimizer step k uses, read in its forward pass
    trainer.step([&] {
      during = lrs_of(sgd);
      return torch::nn::functional::cross_entropy(s.net->forward(s.x), s.y);
    });
    // Its lr as it joined (0.2) is its base; Python's LambdaLR would leave it at 0.2.
    CHECK(during == std::vector<double>{0.1 * warmup(k), 0.2 * warmup(k)});
  }
}

TEST_CASE_TEMPLATE("a checkpoint holds the schedule: the resumed run has the uninterrupted one's lrs "
                   "and weights, bit for bit", Kind, std::true_type, std::false_type) {
  constexpr bool stepper = Kind::value;
  const auto options = [](torch::optim::Optimizer& opt) {
    auto o = mp::TrainerOptions().accumulation_steps(2);
    if (stepper) return o.lr_scheduler(std::make_shared<torch::optim::StepLR>(opt, 2, 0.5));
    return o.lr_lambda(warmup);
  };
  const auto path = temp(stepper ? "schedule_step.ckpt" : "schedule_lambda.ckpt");
  std::vector<std::vector<double>> lrs;
  std::vector<at::Tensor> weights;
  {
    Setup s;
    mp::Trainer<mp::FullPrecision> trainer(s.net, s.sgd, options(s.sgd));
    for (std::int64_t i = 0; i < 16; ++i) {
      if (i == 8) trainer.save(path);
      micro(trainer, s, i, /*poisoned=*/i == 3);
      if (i >= 8 && i % 2 == 1) lrs.push_back(lrs_of(s.sgd));
    }
    weights = test::snapshot(s.net->parameters());
  }
  Setup s;  // a fresh scheduler: the Trainer makes its first step, load() puts its count back
  mp::Trainer<mp::FullPrecision> trainer(s.net, s.sgd, options(s.sgd));
  trainer.load(path);
  for (std::int64_t i = 8; i < 16; ++i) {
    micro(trainer, s, i);
    if (i % 2 == 1) CHECK(lrs_of(s.sgd) == lrs[static_cast<std::size_t>(i - 8) / 2]);
  }
  CHECK(test::identical(test::snapshot(s.net->parameters()), weights));
}

// A scheduler whose get_lrs() keeps state of its own: the next lr of a list, per call.
class ListLR : public torch::optim::LRScheduler {
 public:
  ListLR(torch::optim::Optimizer& optimizer, std::vector<double> lrs)
      : LRScheduler(optimizer), groups_(optimizer.param_groups().size()), lrs_(std::move(lrs)) {}

 private:
  std::vector<double> get_lrs() override {
    const auto lr = lrs_[std::min(next_, lrs_.size() - 1)];
    ++next_;
    return std::vector<double>(groups_, lr);
  }
  std::size_t groups_;
  std::vector<double> lrs_;
  std::size_t next_ = 0;
};

TEST_CASE("a scheduler's get_lrs() runs once per step, the first one (Python's constructor step) too") {
  Setup s;
  const auto scheduler = std::make_shared<ListLR>(s.sgd, std::vector<double>{0.4, 0.2, 0.1, 0.05});
  std::vector<double> lrs;
  mp::Trainer<mp::FullPrecision> trainer(
      s.net, s.sgd,
      mp::TrainerOptions().lr_scheduler(scheduler).on_step(
          [&](const mp::StepReport& r) { lrs.push_back(r.lr); }));
  for (std::int64_t i = 0; i < 3; ++i) micro(trainer, s, i);
  CHECK(lrs == std::vector<double>{0.4, 0.2, 0.1});
  CHECK(lrs_of(s.sgd) == std::vector<double>{0.05, 0.05});
}

TEST_CASE("a scheduler the Trainer drives and the user steps too is an Error that changes nothing") {
  Setup s;
  auto scheduler = std::make_shared<torch::optim::StepLR>(s.sgd, 1, 0.5);
  mp::Trainer<mp::FullPrecision> trainer(s.net, s.sgd, mp::TrainerOptions().lr_scheduler(scheduler));
  micro(trainer, s, 0);
  scheduler->step();  // Python's habit: scheduler.step() after the step
  const auto weights = test::snapshot(s.net->parameters());
  const auto lrs = lrs_of(s.sgd);
  const auto steps = trainer.stats().steps;
  CHECK_THROWS_WITH_AS(micro(trainer, s, 1), doctest::Contains("remove your scheduler->step()"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(trainer.save(temp("schedule_touched.ckpt")),
                       doctest::Contains("stepped outside the Trainer"), mp::Error);
  CHECK(test::identical(test::snapshot(s.net->parameters()), weights));
  CHECK(lrs_of(s.sgd) == lrs);
  CHECK(trainer.stats().steps == steps);
}

TEST_CASE("an lr that is not finite and >= 0 is an Error; the lr stays the last valid one") {
  SUBCASE("lr_scheduler") {
    Setup s;
    auto scheduler = std::make_shared<BadScheduler>(s.sgd, 2);
    std::int64_t reported = 0;
    mp::Trainer<mp::FullPrecision> trainer(
        s.net, s.sgd,
        mp::TrainerOptions().lr_scheduler(scheduler).on_step(
            [&](const mp::StepReport& r) { reported = r.step; }));
    micro(trainer, s, 0);
    CHECK_THROWS_WITH_AS(micro(trainer, s, 1), doctest::Contains("param group 0's lr to nan"),
                         mp::Error);
    CHECK(lrs_of(s.sgd) == std::vector<double>{0.1, 0.04});
    CHECK(reported == 2);  // the step that ended was done, and on_step had its report
    CHECK(trainer.stats().steps == 2);
  }
  SUBCASE("lr_lambda") {
    Setup s;
    mp::Trainer<mp::FullPrecision> trainer(
        s.net, s.sgd, mp::TrainerOptions().lr_lambda([](std::int64_t k) { return 1.0 - 0.5 * static_cast<double>(k); }));
    micro(trainer, s, 0);
    micro(trainer, s, 1);
    const auto lrs = lrs_of(s.sgd);
    CHECK_THROWS_WITH_AS(micro(trainer, s, 2), doctest::Contains("lr_lambda(3) returned -0.5"),
                         mp::Error);
    CHECK(lrs_of(s.sgd) == lrs);
  }
}

TEST_CASE("a schedule stepped per trainer.step() call outside the Trainer, with accumulation, is "
          "warned about once") {
  Setup s;
  std::vector<std::string> warnings;
  torch::optim::StepLR by_hand(s.sgd, 2, 0.5);
  mp::Trainer<mp::FullPrecision> trainer(
      s.net, s.sgd,
      mp::TrainerOptions().accumulation_steps(2).on_warning(
          [&](const std::string& w) { warnings.push_back(w); }));
  for (std::int64_t i = 0; i < 12; ++i) {
    micro(trainer, s, i);
    by_hand.step();  // the trap: accumulation_steps times per optimizer step
  }
  REQUIRE(warnings.size() == 1U);
  CHECK(warnings[0].find("TrainerOptions::lr_scheduler") != std::string::npos);
}

TEST_CASE("checkpoints and schedules must match: each mismatch is an Error that changes nothing") {
  const auto with_lambda = temp("schedule_lambda_only.ckpt");
  const auto without = temp("schedule_none.ckpt");
  {
    Setup s;
    mp::Trainer<mp::FullPrecision> a(s.net, s.sgd, mp::TrainerOptions().lr_lambda(warmup));
    micro(a, s, 0);
    a.save(with_lambda);
  }
  {
    Setup s;
    mp::Trainer<mp::FullPrecision> b(s.net, s.sgd);
    micro(b, s, 0);
    b.save(without);
  }
  struct Case {
    const char* name;
    const std::string* path;
    int kind;  // 0: none, 1: lr_scheduler, 2: lr_lambda
    const char* excerpt;
  };
  const Case cases[] = {
      {"no schedule into lr_lambda", &without, 2, "holds no learning-rate schedule"},
      {"lr_lambda into no schedule", &with_lambda, 0, "this Trainer has none"},
      {"lr_lambda into lr_scheduler", &with_lambda, 1, "give it the same kind of schedule"},
  };
  for (const auto& c : cases) {
    SUBCASE(c.name) {
      Setup s;
      auto options = mp::TrainerOptions();
      if (c.kind == 1) options.lr_scheduler(std::make_shared<torch::optim::StepLR>(s.sgd, 2, 0.5));
      if (c.kind == 2) options.lr_lambda(warmup);
      mp::Trainer<mp::FullPrecision> trainer(s.net, s.sgd, options);
      micro(trainer, s, 0);
      const auto weights = test::snapshot(s.net->parameters());
      const auto lrs = lrs_of(s.sgd);
      CHECK_THROWS_WITH_AS(trainer.load(*c.path), doctest::Contains(c.excerpt), mp::Error);
      CHECK(test::identical(test::snapshot(s.net->parameters()), weights));
      CHECK(lrs_of(s.sgd) == lrs);
      CHECK(trainer.stats().steps == 1);
      micro(trainer, s, 1);  // and the run goes on
    }
  }
}

namespace {

// An optimizer whose options have no get_lr(): it takes no schedule, and reports lr NaN.
struct PlainOptions : torch::optim::OptimizerCloneableOptions<PlainOptions> {};
struct PlainSgd : torch::optim::Optimizer {
  explicit PlainSgd(std::vector<at::Tensor> params)
      : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                  std::make_unique<PlainOptions>()) {}
  at::Tensor step(LossClosure = nullptr) override {
    torch::NoGradGuard no_grad;
    for (auto& p : param_groups()[0].params()) {
      if (p.grad().defined()) p.sub_(p.grad() * 0.1);
    }
    return {};
  }
};

}  // namespace

TEST_CASE("an optimizer without get_lr(): StepReport::lr is NaN, and a schedule is an Error") {
  Setup s;
  PlainSgd plain(s.net->parameters());
  CHECK_THROWS_WITH_AS(mp::Trainer<mp::FullPrecision>(s.net, plain,
                                                      mp::TrainerOptions().lr_lambda(warmup)),
                       doctest::Contains("have no get_lr()"), mp::Error);
  mp::Trainer<mp::FullPrecision> trainer(s.net, plain);
  CHECK(std::isnan(micro(trainer, s, 0).lr));
}

namespace {

// `opt = SGD(groups, defaults)`, Python's way to change the lr, where LibTorch compiles it
// (1.13's optimizers are not move-assignable: the callers are skipped there).
template <class Opt>
void assign_groups(Opt& opt, std::vector<torch::optim::OptimizerParamGroup> groups) {
  if constexpr (std::is_move_assignable_v<Opt>) {
    opt = Opt(std::move(groups), torch::optim::SGDOptions(0.3));
  }
}

// Python's StepLR built on a new optimizer before optimizer step `from` (last_epoch from - 1,
// each group's initial_lr its lr): its constructor's step is step `from`'s, then one per step.
double step_lr_from(double lr, std::int64_t from, std::int64_t k, std::int64_t step_size,
                    double gamma) {
  for (std::int64_t e = from; e <= k; ++e) {
    if (e % step_size == 0) lr *= gamma;
  }
  return lr;
}

// A scheduler of the user's that keeps each group's lr at its construction as its base, as
// Python's LambdaLR does: base * 0.5^(steps / 2).
struct HalvingFromBase : torch::optim::LRScheduler {
  explicit HalvingFromBase(torch::optim::Optimizer& optimizer)
      : LRScheduler(optimizer), base_(get_current_lrs()) {}
  std::vector<double> get_lrs() override {
    std::vector<double> lrs;
    for (const double b : base_) lrs.push_back(b * std::ldexp(1.0, -static_cast<int>(step_count_ / 2)));
    return lrs;
  }
  std::vector<double> base_;
};

}  // namespace

TEST_CASE_TEMPLATE("a new optimizer brings its lrs: lr_lambda and StepLR go on from them at the "
                   "Trainer's step, as Python's schedulers built on it there" *
                       doctest::skip(!test::optimizers_assignable),
                   P, mp::FullPrecision, mp::MixedO2<at::BFloat16>) {
  // guide.md's way to change the lr: `opt = SGD(...)`. The reference: Python's LambdaLR and
  // StepLR built on the new optimizer with last_epoch = k - 1 (it arrives before optimizer step
  // k = 6, a StepLR boundary): 0.3 * f(k) for LambdaLR (0.1265625 at k = 6), 0.3 decayed at
  // the boundaries from k on for StepLR (0.15 at 6, 7, 8; 0.075 at 9). Before the fix the
  // lambda went back to the old base (0.0316 at step 7), StepLR missed step 6's decay (0.3).
  for (const bool lambda : {true, false}) {
    CAPTURE(lambda);
    Setup s;
    auto options = mp::TrainerOptions();
    if (lambda) {
      options.lr_lambda(warmup);
    } else {
      options.lr_scheduler(std::make_shared<torch::optim::StepLR>(s.sgd, 3, 0.5));
    }
    mp::Trainer<P> trainer(s.net, s.sgd, options);
    for (std::int64_t k = 0; k < 10; ++k) {
      CAPTURE(k);
      if (k == 6) {
        std::vector<torch::optim::OptimizerParamGroup> groups;
        groups.emplace_back(s.net->fc1->parameters(),
                            std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.3)));
        groups.emplace_back(s.net->fc2->parameters(),
                            std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.08)));
        assign_groups(s.sgd, std::move(groups));
      }
      const auto expected = [&](double first, double now) {
        if (lambda) return (k < 6 ? first : now) * warmup(k);
        return k < 6 ? step_lr(first, k, 3, 0.5) : step_lr_from(now, 6, k, 3, 0.5);
      };
      std::vector<double> during;  // the lrs optimizer step k uses, read in its forward pass
      const auto report = trainer.step([&] {
        during = lrs_of(s.sgd);
        return torch::nn::functional::cross_entropy(s.net->forward(trainer.cast_input(s.x)), s.y);
      });
      CHECK(during == std::vector<double>{expected(0.1, 0.3), expected(0.04, 0.08)});
      CHECK(report.lr == expected(0.1, 0.3));
    }
  }
}

TEST_CASE("a scheduler that keeps base lrs of its own, and a param group added later: an Error "
          "before anything changes, until it gives an lr per group") {
  // Python 2.13's scheduler step() raises there (zip(..., strict=True): "zip() argument 2 is
  // shorter than argument 1"), after optimizer.step(). Before the fix every step() after the
  // group arrived took the optimizer step, then threw LibTorch's c10::Error ("Number of
  // learning rates not equal to the number of param groups"), the schedule frozen at 0.05.
  Setup s;
  torch::optim::SGD sgd(s.net->fc1->parameters(), torch::optim::SGDOptions(0.1));
  auto scheduler = std::make_shared<HalvingFromBase>(sgd);
  mp::Trainer<mp::FullPrecision> trainer(s.net, sgd, mp::TrainerOptions().lr_scheduler(scheduler));
  for (std::int64_t k = 0; k < 3; ++k) micro(trainer, s, k);
  sgd.add_param_group(torch::optim::OptimizerParamGroup(
      s.net->fc2->parameters(),
      std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.2))));
  const auto weights = test::snapshot(s.net->parameters());
  const auto lrs = lrs_of(sgd);
  for (int attempt = 0; attempt < 2; ++attempt) {
    CHECK_THROWS_WITH_AS(micro(trainer, s, 3),
                         doctest::Contains("returns 1 lrs for the optimizer's 2 param groups"),
                         mp::Error);
    CHECK(test::identical(test::snapshot(s.net->parameters()), weights));
    CHECK(lrs_of(sgd) == lrs);
    CHECK(trainer.stats().steps == 3);
  }
  scheduler->base_.push_back(0.2);  // the way on the Error names: an lr for the new group
  for (std::int64_t k = 3; k < 8; ++k) {
    CAPTURE(k);
    std::vector<double> during;
    trainer.step([&] {
      during = lrs_of(sgd);
      return torch::nn::functional::cross_entropy(s.net->forward(s.x), s.y);
    });
    const double factor = std::ldexp(1.0, -static_cast<int>(k / 2));
    // Step 3 used the lr the old step set (0.05) and the new group's own; then the schedule.
    CHECK(during == std::vector<double>{0.1 * factor, k == 3 ? 0.2 : 0.2 * factor});
  }
  CHECK_FALSE(test::identical(test::snapshot(s.net->parameters()), weights));  // it trains
}

}  // namespace test_schedule
