// TrainerOptions::step_in_backward: each trained tensor stepped inside the backward pass as its
// gradient is complete, and the gradient freed. The same updates as the ordinary step, bit for
// bit, for each policy it takes; one gradient alive at a time; what it cannot keep is an Error
// before anything changes; a non-finite loss skips the step whole, a non-finite gradient stops it
// with an Error naming the tensor. Python's optimizer-in-backward recipe: tests/test_parity.cpp.
#include <mixprec/mixprec.hpp>

#include "../support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace test_backward_step {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

// A trunk and two heads, the second used on even steps only (a tensor without a gradient is
// not stepped); wide enough that the block formats quantize every weight (>= 4096 elements).
struct Wide : torch::nn::Module {
  Wide() {
    trunk = register_module("trunk", torch::nn::Linear(64, 128));
    a = register_module("a", torch::nn::Linear(128, 32));
    b = register_module("b", torch::nn::Linear(128, 32));
  }
  at::Tensor forward(const at::Tensor& x, bool use_b) {
    const auto h = torch::gelu(trunk->forward(x));
    return use_b ? a->forward(h) + b->forward(h) : a->forward(h);
  }
  torch::nn::Linear trunk{nullptr}, a{nullptr}, b{nullptr};
};

std::shared_ptr<Wide> wide_model(std::uint64_t seed) {
  torch::manual_seed(seed);
  return std::make_shared<Wide>();
}

std::vector<at::Tensor> values_of(const torch::nn::Module& model) {
  std::vector<at::Tensor> values;
  for (const auto& p : model.parameters()) values.push_back(p.detach().clone());
  return values;
}

// Trains a fresh model (seed 3) for `steps` AdamW steps, `in_backward` or not; returns the
// parameters after each step.
template <class P>
std::vector<std::vector<at::Tensor>> train(bool in_backward, mp::TrainerOptions options,
                                           std::int64_t steps = 4) {
  auto model = wide_model(3);
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  mp::Trainer<P> trainer(model, adamw, options.step_in_backward(in_backward));
  torch::manual_seed(5);
  const auto x = torch::randn({steps, 16, 64});
  const auto y = torch::randint(0, 32, {steps, 16});
  std::vector<std::vector<at::Tensor>> after;
  for (std::int64_t step = 0; step < steps; ++step) {
    const auto report = trainer.step([&] {
      const auto logits = model->forward(trainer.cast_input(x[step]), step % 2 == 0);
      return torch::nn::functional::cross_entropy(logits.to(at::kFloat), y[step]);
    });
    REQUIRE(report.stepped());
    after.push_back(values_of(*model));
  }
  return after;
}

template <class P>
void check_same_as_ordinary(mp::TrainerOptions options = {}) {
  CAPTURE(P::name);
  CAPTURE(options.fused_optimizer());
  const auto ordinary = train<P>(false, options);
  const auto in_backward = train<P>(true, options);
  REQUIRE(ordinary.size() == in_backward.size());
  double largest = 0;
  for (std::size_t step = 0; step < ordinary.size(); ++step) {
    for (std::size_t i = 0; i < ordinary[step].size(); ++i) {
      const auto& a = ordinary[step][i];
      const auto& b = in_backward[step][i];
      largest = std::max(largest, (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().template item<double>());
      CHECK(at::equal(a, b));
    }
  }
  // Training moved the weights: the comparison is not of two untouched models.
  CHECK_FALSE(at::equal(ordinary.front()[0], ordinary.back()[0]));
  const std::string name = std::string(P::name) + (options.fused_optimizer() ? ", fused" : "");
  MESSAGE(name, ": in the backward pass vs "
          "the ordinary step, ", ordinary.size(), " steps, largest difference ", largest);
}

using Stochastic = mp::PureHalf<at::BFloat16, mp::StochasticRounding<>>;
using Remainder = mp::MixedO2<at::BFloat16, mp::RemainderMasters<>>;
using NarrowRemainder = mp::MixedO2<at::BFloat16, mp::RemainderMasters<at::BFloat16>>;
using Q8Remainder = mp::MixedO2<at::BFloat16, mp::RemainderMasters<mp::Moments8bit<>>>;
using Q8Stochastic = mp::PureHalf<at::BFloat16, mp::StochasticRounding<mp::Moments8bit<>>>;
using Q8Masters = mp::MixedO2<at::BFloat16, mp::Fp32Masters<mp::Moments8bit<>>>;

constexpr bool kNoHooks = !mp::post_accumulate_grad_hooks;

}  // namespace

TEST_CASE("step_in_backward: the ordinary step's updates, bit for bit, per policy" *
          doctest::skip(kNoHooks)) {
  check_same_as_ordinary<mp::FullPrecision>();
  check_same_as_ordinary<mp::MixedO1<at::BFloat16>>();
  check_same_as_ordinary<mp::MixedO2<at::BFloat16>>();
  check_same_as_ordinary<mp::PureHalf<at::BFloat16>>();
  check_same_as_ordinary<Stochastic>(mp::TrainerOptions().fused_optimizer(true));
  check_same_as_ordinary<Remainder>(mp::TrainerOptions().fused_optimizer(true));
  check_same_as_ordinary<NarrowRemainder>(mp::TrainerOptions().fused_optimizer(true));
  check_same_as_ordinary<Q8Remainder>();
  check_same_as_ordinary<Q8Stochastic>();
  check_same_as_ordinary<Q8Masters>();
  if (mp::fused_adam_available) {
    check_same_as_ordinary<mp::FullPrecision>(mp::TrainerOptions().fused_optimizer(true));
    check_same_as_ordinary<mp::MixedO2<at::BFloat16>>(mp::TrainerOptions().fused_optimizer(true));
  }
}

TEST_CASE("step_in_backward: one gradient alive at a time, none after the step" *
          doctest::skip(kNoHooks)) {
  for (const bool in_backward : {false, true}) {
    CAPTURE(in_backward);
    auto model = wide_model(3);
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
    mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(
        model, adamw, mp::TrainerOptions().step_in_backward(in_backward));
    // As each gradient arrives (before it is accumulated): how many others exist, in the
    // model's tensors and in the masters.
    std::int64_t most = 0;
    const auto params = model->parameters();
    std::vector<at::Tensor> watched = params;
    for (const auto& m : trainer.master_weights()) watched.push_back(m);
    for (const auto& p : params) {
      p.register_hook([&](const at::Tensor& g) {
        std::int64_t alive = 0;
        for (const auto& t : watched) alive += t.grad().defined() ? 1 : 0;
        most = std::max(most, alive);
        return g;
      });
    }
    const auto x = torch::randn({8, 64});
    const auto y = torch::randint(0, 32, {8});
    for (int step = 0; step < 2; ++step) {
      CHECK(trainer.step([&] {
        return torch::nn::functional::cross_entropy(
            model->forward(trainer.cast_input(x), true).to(at::kFloat), y);
      }).stepped());
      for (const auto& t : watched) CHECK_FALSE(t.grad().defined());
    }
    if (in_backward) {
      CHECK(most == 0);
    } else {
      CHECK(most >= 4);  // the ordinary step: the gradients pile up until the step
    }
  }
}

TEST_CASE("step_in_backward: a non-finite loss skips the step whole" * doctest::skip(kNoHooks)) {
  auto model = wide_model(3);
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, adamw,
                                                 mp::TrainerOptions().step_in_backward(true));
  const auto before = values_of(*model);
  const auto x = torch::randn({8, 64});
  const auto report = trainer.step([&] {
    return model->forward(trainer.cast_input(x), true).to(at::kFloat).sum() *
           std::numeric_limits<float>::infinity();
  });
  CHECK(report.status == mp::StepStatus::skipped);
  CHECK(trainer.stats().skipped_steps == 1);
  const auto after = values_of(*model);
  for (std::size_t i = 0; i < before.size(); ++i) CHECK(at::equal(before[i], after[i]));
  for (const auto& p : model->parameters()) CHECK_FALSE(p.grad().defined());
}

TEST_CASE("step_in_backward: a non-finite gradient under a finite loss is an Error naming the "
          "tensor" * doctest::skip(kNoHooks)) {
  auto model = wide_model(3);
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
  mp::Trainer<mp::FullPrecision> trainer(model, adamw, mp::TrainerOptions().step_in_backward(true));
  const auto trunk_before = model->trunk->weight.detach().clone();
  const auto head_before = model->a->weight.detach().clone();
  const auto x = torch::randn({8, 64});
  // d sqrt(u)/du is inf at u = 0, and du/d(trunk.weight) is 0: its gradient is NaN, the loss 0
  // plus a finite term. The head's gradient arrives first (the backward pass runs from the loss).
  auto step = [&] {
    return trainer.step([&] {
      const auto head = model->forward(x, false).sum();
      return head * 1e-3 + torch::sqrt((model->trunk->weight * 0).sum());
    });
  };
  CHECK_THROWS_WITH_AS(step(), doctest::Contains("'trunk.weight' holds inf/NaN"), mp::Error);
  CHECK(at::equal(model->trunk->weight, trunk_before));   // not stepped
  CHECK_FALSE(at::equal(model->a->weight, head_before));  // stepped before it
  CHECK(trainer.stats().steps == 0);
  for (const auto& p : model->parameters()) CHECK_FALSE(p.grad().defined());
}

TEST_CASE("step_in_backward: what it cannot keep is an Error, nothing changed") {
  const auto refused = [](auto policy, mp::TrainerOptions options, const char* says) {
    using P = decltype(policy);
    CAPTURE(says);
    auto model = wide_model(3);
    const auto before = values_of(*model);
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
    CHECK_THROWS_WITH_AS(mp::Trainer<P>(model, adamw, options.step_in_backward(true)),
                         doctest::Contains(mp::post_accumulate_grad_hooks ? says : "2.1"),
                         mp::Error);
    const auto after = values_of(*model);
    for (std::size_t i = 0; i < before.size(); ++i) CHECK(at::equal(before[i], after[i]));
    CHECK(adamw.state().empty());
  };
  refused(mp::FullPrecision{}, mp::TrainerOptions().max_grad_norm(1.0), "max_grad_norm");
  refused(mp::FullPrecision{}, mp::TrainerOptions().accumulation_steps(2), "accumulation_steps 2");
  refused(mp::FullPrecision{}, mp::TrainerOptions().gradient_stats(mp::GradientStatsOptions().every(1)),
          "gradient_stats");
  // (Before LibTorch 2.4 a Half policy refuses a CPU model before it reads its options.)
  if (mp::cpu_half_math) refused(mp::MixedO2<at::Half>{}, mp::TrainerOptions(), "scales its loss");
  refused(Stochastic{}, mp::TrainerOptions(), "fused_optimizer(true)");
}

TEST_CASE("step_in_backward: on_step's gradients() are an Error, the report is the step's" *
          doctest::skip(kNoHooks)) {
  auto model = wide_model(3);
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
  std::unique_ptr<mp::Trainer<mp::FullPrecision>> trainer;
  bool threw = false;
  std::int64_t reported = 0;
  trainer = std::make_unique<mp::Trainer<mp::FullPrecision>>(
      model, adamw, mp::TrainerOptions().step_in_backward(true).on_step([&](const mp::StepReport& r) {
        reported = r.step;
        try {
          (void)trainer->gradients();
        } catch (const mp::Error& e) {
          threw = std::string(e.what()).find("step_in_backward") != std::string::npos;
        }
      }));
  const auto x = torch::randn({8, 64});
  const auto report = trainer->step([&] { return model->forward(x, true).pow(2).mean(); });
  CHECK(report.stepped());
  CHECK(report.step == 1);
  CHECK(reported == 1);
  CHECK(threw);
  // A backward pass of the user's own, outside step(), accumulates as usual (the hooks are armed
  // by the Trainer's only).
  model->forward(x, true).sum().backward();
  for (const auto& p : model->parameters()) CHECK(p.grad().defined());
}

}  // namespace test_backward_step
