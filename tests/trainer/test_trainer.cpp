// Trainer<P>: casting and master weights per policy, skipping, accumulation, exact dyadic
// updates, norm layers, bad input, checkpoints.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>

namespace test_trainer {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

// MixedO2<BFloat16> with dynamic scaling, as a user would derive it.
struct ScaledO2 : mp::MixedO2<at::BFloat16> {
  static constexpr std::string_view name = "ScaledO2";
  using scaler_type = mp::GradScaler;
};

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    norm = register_module("norm", torch::nn::BatchNorm1d(32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
    drop = register_module("drop", torch::nn::Dropout(0.1));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc2->forward(drop->forward(torch::relu(norm->forward(fc1->forward(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  torch::nn::Dropout drop{nullptr};
};

struct Task {
  at::Tensor x, y;
  explicit Task(std::int64_t n = 256) {
    torch::manual_seed(1);
    x = torch::randn({n, 16});
    y = (x.slice(1, 0, 4).argmax(1));  // a learnable rule
  }
};

template <class P>
auto loss_of(mp::Trainer<P>& trainer, const std::shared_ptr<Net>& net, const at::Tensor& x,
             const at::Tensor& y) {
  return [&trainer, net, x, y] {
    return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(x)), y);
  };
}

}  // namespace

TEST_CASE_TEMPLATE("every policy trains: the loss goes down, dtypes are as the policy says", P,
                   mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   mp::PureHalf<at::BFloat16>, ScaledO2) {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  mp::Trainer<P> trainer(net, adam);
  const Task task;

  const auto w = net->fc1->weight;
  const auto bn = net->norm->weight;
  if constexpr (P::cast_model) {
    CHECK(w.scalar_type() == at::kBFloat16);
    CHECK(bn.scalar_type() == (P::keep_batch_norm_fp32 ? at::kFloat : at::kBFloat16));
    CHECK(net->norm->running_mean.scalar_type() == (P::keep_batch_norm_fp32 ? at::kFloat : at::kBFloat16));
  } else {
    CHECK(w.scalar_type() == at::kFloat);
  }
  CHECK(trainer.master_weights().size() == (P::master_weights ? net->parameters().size() : 0U));
  for (const auto& m : trainer.master_weights()) CHECK(m.scalar_type() == at::kFloat);

  double first = 0, last = 0;
  for (int epoch = 0; epoch < 30; ++epoch) {
    for (std::int64_t b = 0; b < 256; b += 64) {
      auto x = task.x.slice(0, b, b + 64), y = task.y.slice(0, b, b + 64);
      const auto report = trainer.step(loss_of(trainer, net, x, y));
      CHECK(report.status == mp::StepStatus::stepped);
      CHECK(report.loss.scalar_type() == at::kFloat);
      if (epoch == 0 && b == 0) first = report.loss.template item<double>();
      last = report.loss.template item<double>();
    }
  }
  CHECK(last < 0.5 * first);
  CHECK(trainer.stats().steps == 120);
  CHECK(trainer.stats().skipped_steps == 0);

  const auto logits = trainer.evaluate([&] { return net->forward(trainer.cast_input(task.x)); });
  CHECK_FALSE(logits.requires_grad());
  CHECK(net->is_training());  // evaluate restored the mode
  const auto accuracy = (logits.argmax(1) == task.y).to(at::kFloat).mean().template item<double>();
  CHECK(accuracy > 0.8);
  CHECK(logits.scalar_type() == (P::cast_model ? at::kBFloat16 : P::autocast ? at::kBFloat16 : at::kFloat));
}

TEST_CASE_TEMPLATE("inf or NaN in the loss skips the step and touches nothing", P, mp::FullPrecision,
                   mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   mp::PureHalf<at::BFloat16>, ScaledO2) {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  std::vector<mp::StepStatus> seen;
  mp::Trainer<P> trainer(net, adam, mp::TrainerOptions().on_step([&](const mp::StepReport& r) {
    seen.push_back(r.status);
  }));
  const Task task;
  auto x = task.x.slice(0, 0, 64), y = task.y.slice(0, 0, 64);
  REQUIRE(trainer.step(loss_of(trainer, net, x, y)).stepped());
  const auto params = test::snapshot(net->parameters());
  const auto masters = test::snapshot(trainer.master_weights());
  const auto moments = test::adam_moments(adam);
  const double scale = trainer.stats().scale;
  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    const auto report = trainer.step([&] {
      return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(x)), y) * bad;
    });
    CHECK(report.status == mp::StepStatus::skipped);
  }
  CHECK(test::identical(test::snapshot(net->parameters()), params));
  CHECK(test::identical(test::snapshot(trainer.master_weights()), masters));
  CHECK(test::adam_moments(adam) == moments);
  CHECK(trainer.stats().skipped_steps == 2);
  CHECK(trainer.stats().scale == (std::is_same_v<P, ScaledO2> ? scale / 4 : 1.0));
  CHECK(seen == std::vector<mp::StepStatus>{mp::StepStatus::stepped, mp::StepStatus::skipped,
                                            mp::StepStatus::skipped});
  // And training goes on normally afterwards.
  CHECK(trainer.step(loss_of(trainer, net, x, y)).stepped());
}

TEST_CASE("k accumulated micro-batches equal one k-times larger batch") {
  const Task task;
  auto make = [] {
    torch::manual_seed(3);
    return torch::nn::Sequential(torch::nn::Linear(16, 8), torch::nn::Tanh(), torch::nn::Linear(8, 4));
  };
  auto accumulated = make();
  auto whole = make();
  torch::optim::SGD opt_a(accumulated->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt_w(whole->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::FullPrecision> ta(accumulated, opt_a, mp::TrainerOptions().accumulation_steps(4));
  mp::Trainer<mp::FullPrecision> tw(whole, opt_w);
  for (int step = 0; step < 3; ++step) {
    for (std::int64_t k = 0; k < 4; ++k) {
      const auto b = step * 64 + k * 16;
      const auto r = ta.step([&] {
        return torch::nn::functional::cross_entropy(accumulated->forward(task.x.slice(0, b, b + 16)),
                                                    task.y.slice(0, b, b + 16));
      });
      CHECK(r.status == (k < 3 ? mp::StepStatus::accumulating : mp::StepStatus::stepped));
    }
    tw.step([&] {
      return torch::nn::functional::cross_entropy(whole->forward(task.x.slice(0, step * 64, step * 64 + 64)),
                                                  task.y.slice(0, step * 64, step * 64 + 64));
    });
  }
  CHECK(test::max_abs_diff(accumulated->parameters(), whole->parameters()) < 1e-6);
  CHECK(ta.stats().steps == 3);
  CHECK(ta.stats().micro_batches == 12);
}

TEST_CASE("dyadic arithmetic: fp32 masters keep the updates that bf16 weights round away") {
  // w = 1, loss = w * 2, SGD lr 2^-10: each step subtracts 2^-9 exactly. 1 - 2^-9 is a tie
  // between two bf16 values and rounds to 1: without masters the weight never moves.
  auto run = [](auto policy_tag, int steps) {
    using P = decltype(policy_tag);
    auto lin = torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false));
    torch::NoGradGuard{}, lin->weight.data().fill_(1.0);
    torch::optim::SGD sgd(lin->parameters(), torch::optim::SGDOptions(1.0 / 1024));
    mp::Trainer<P> trainer(lin, sgd);
    const auto x = torch::full({1, 1}, 2.0);
    for (int i = 0; i < steps; ++i) {
      trainer.step([&] { return lin->forward(trainer.cast_input(x)).sum(); });
    }
    return std::make_pair(lin->weight.to(at::kDouble).item<double>(),
                          P::master_weights ? trainer.master_weights()[0].template item<double>() : 0.0);
  };
  const auto [o2_model_1, o2_master_1] = run(mp::MixedO2<at::BFloat16>{}, 1);
  CHECK(o2_master_1 == 1.0 - std::ldexp(1.0, -9));
  CHECK(o2_model_1 == 1.0);  // the tie rounds to even
  const auto [o2_model_2, o2_master_2] = run(mp::MixedO2<at::BFloat16>{}, 2);
  CHECK(o2_master_2 == 1.0 - std::ldexp(1.0, -8));
  CHECK(o2_model_2 == 1.0 - std::ldexp(1.0, -8));  // now representable: the model follows
  const auto [o3_model, unused] = run(mp::PureHalf<at::BFloat16>{}, 8);
  CHECK(o3_model == 1.0);  // eight updates lost
  const auto [o0_model, unused0] = run(mp::FullPrecision{}, 8);
  CHECK(o0_model == 1.0 - 8 * std::ldexp(1.0, -9));
}

TEST_CASE("Trainer<FullPrecision> computes exactly what the hand-written loop does") {
  const Task task;
  auto make = [] {
    torch::manual_seed(4);
    return torch::nn::Sequential(torch::nn::Linear(16, 8), torch::nn::ReLU(), torch::nn::Linear(8, 4));
  };
  auto by_hand = make();
  auto by_trainer = make();
  torch::optim::Adam opt_h(by_hand->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam opt_t(by_trainer->parameters(), torch::optim::AdamOptions(1e-2));
  mp::Trainer<mp::FullPrecision> trainer(by_trainer, opt_t);
  for (std::int64_t b = 0; b < 256; b += 32) {
    auto x = task.x.slice(0, b, b + 32), y = task.y.slice(0, b, b + 32);
    opt_h.zero_grad();
    torch::nn::functional::cross_entropy(by_hand->forward(x), y).backward();
    opt_h.step();
    trainer.step([&] { return torch::nn::functional::cross_entropy(by_trainer->forward(x), y); });
  }
  CHECK(test::identical(by_hand->parameters(), by_trainer->parameters()));
}

TEST_CASE("several models and losses with one optimizer") {
  torch::manual_seed(6);
  auto encoder = torch::nn::Linear(16, 8);
  auto head_a = torch::nn::Linear(8, 4);
  auto head_b = torch::nn::Linear(8, 1);
  auto all = std::make_shared<torch::nn::Module>();
  all->register_module("encoder", encoder);
  all->register_module("head_a", head_a);
  all->register_module("head_b", head_b);
  torch::optim::SGD sgd(all->parameters(), torch::optim::SGDOptions(0.05));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(all, sgd, mp::TrainerOptions().max_grad_norm(5.0));
  const Task task;
  double first = 0, last = 0;
  for (int i = 0; i < 60; ++i) {
    auto x = task.x.slice(0, (i % 4) * 64, (i % 4) * 64 + 64), y = task.y.slice(0, (i % 4) * 64, (i % 4) * 64 + 64);
    const auto r = trainer.step([&] {
      auto h = torch::relu(encoder->forward(trainer.cast_input(x)));
      auto classification = torch::nn::functional::cross_entropy(head_a->forward(h), y);
      auto regression = torch::mse_loss(head_b->forward(h).squeeze(1).to(at::kFloat), y.to(at::kFloat));
      return classification + 0.1 * regression;
    });
    REQUIRE(r.stepped());
    REQUIRE(r.grad_norm.has_value());
    if (i == 0) first = r.loss.item<double>();
    last = r.loss.item<double>();
  }
  CHECK(last < first);
}

TEST_CASE("norm layers under MixedO2: BatchNorm stays fp32, LayerNorm and GroupNorm run in bf16") {
  torch::manual_seed(8);
  auto model = torch::nn::Sequential(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1)), torch::nn::BatchNorm2d(4),
      torch::nn::GroupNorm(2, 4), torch::nn::Flatten(), torch::nn::Linear(4 * 6 * 6, 8),
      torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})), torch::nn::BatchNorm1d(8),
      torch::nn::Linear(8, 3));
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, sgd);
  for (const auto& item : model->named_parameters()) {
    const bool batch_norm = item.key().rfind("1.", 0) == 0 || item.key().rfind("6.", 0) == 0;
    CAPTURE(item.key());
    CHECK(item.value().scalar_type() == (batch_norm ? at::kFloat : at::kBFloat16));
  }
  const auto x = torch::randn({5, 2, 6, 6});
  const auto y = torch::tensor({0, 1, 2, 0, 1}, at::kLong);
  const auto before = test::snapshot(trainer.master_weights());
  const auto report = trainer.step([&] {
    return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
  });
  CHECK(report.stepped());
  const auto after = trainer.master_weights();
  for (std::size_t i = 0; i < after.size(); ++i) CHECK_FALSE(after[i].equal(before[i]));
}

TEST_CASE("bad input is a mixprec::Error that leaves model and optimizer untouched") {
  torch::manual_seed(9);
  auto net = std::make_shared<Net>();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  const auto original = test::snapshot(net->parameters());
  using O2 = mp::Trainer<mp::MixedO2<at::BFloat16>>;

  CHECK_THROWS_WITH_AS(O2(net, adam, mp::TrainerOptions().accumulation_steps(0)),
                       doctest::Contains("accumulation_steps"), mp::Error);
  CHECK_THROWS_WITH_AS(O2(net, adam, mp::TrainerOptions().max_grad_norm(0.0)),
                       doctest::Contains("max_grad_norm"), mp::Error);
  CHECK_THROWS_WITH_AS(O2(net, adam, mp::TrainerOptions().max_grad_norm(-1.0)),
                       doctest::Contains("max_grad_norm"), mp::Error);
  CHECK_THROWS_WITH_AS(O2(net, adam, mp::TrainerOptions().scaler(mp::GradScalerOptions())),
                       doctest::Contains("NoScaler"), mp::Error);
  CHECK_THROWS_WITH_AS(O2(std::make_shared<torch::nn::Module>(), adam),
                       doctest::Contains("no parameters"), mp::Error);
  auto stranger = torch::zeros({3}, torch::requires_grad());
  torch::optim::SGD foreign({stranger}, torch::optim::SGDOptions(0.1));
  CHECK_THROWS_WITH_AS(O2(net, foreign), doctest::Contains("not a parameter of the model"), mp::Error);
  {
    auto other = std::make_shared<Net>();
    torch::optim::Adam used(other->parameters(), torch::optim::AdamOptions(1e-2));
    torch::nn::functional::cross_entropy(other->forward(torch::randn({4, 16})),
                                         torch::zeros({4}, at::kLong)).backward();
    used.step();
    const auto other_params = test::snapshot(other->parameters());
    CHECK_THROWS_WITH_AS(O2(other, used), doctest::Contains("already has state"), mp::Error);
    CHECK(test::identical(test::snapshot(other->parameters()), other_params));
  }
  {
    auto cast = std::make_shared<Net>();
    cast->to(at::kBFloat16);
    torch::optim::SGD sgd(cast->parameters(), torch::optim::SGDOptions(0.1));
    CHECK_THROWS_WITH_AS(O2(cast, sgd), doctest::Contains("expects an fp32 model"), mp::Error);
  }
  CHECK(test::identical(test::snapshot(net->parameters()), original));
  CHECK(net->fc1->weight.scalar_type() == at::kFloat);

  O2 trainer(net, adam);
  const auto x = torch::randn({8, 16});
  const auto y = torch::zeros({8}, at::kLong);
  REQUIRE(trainer.step(loss_of(trainer, net, x, y)).stepped());
  const auto params = test::snapshot(net->parameters());
  const auto masters = test::snapshot(trainer.master_weights());
  const auto moments = test::adam_moments(adam);
  CHECK_THROWS_WITH_AS(trainer.step([&] { return net->forward(trainer.cast_input(x)); }),
                       doctest::Contains("scalar loss"), mp::Error);
  CHECK_THROWS_WITH_AS(trainer.step([] { return at::Tensor(); }), doctest::Contains("undefined"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(trainer.step([] { return torch::ones({}, at::kLong); }),
                       doctest::Contains("floating-point"), mp::Error);
  CHECK_THROWS_WITH_AS(trainer.step([] { return torch::ones({}); }),
                       doctest::Contains("does not require grad"), mp::Error);
  CHECK(test::identical(test::snapshot(net->parameters()), params));
  CHECK(test::identical(test::snapshot(trainer.master_weights()), masters));
  CHECK(test::adam_moments(adam) == moments);
  CHECK(trainer.stats().micro_batches == 1);
  CHECK(trainer.step(loss_of(trainer, net, x, y)).stepped());
}

namespace {

template <class P>
struct Run {
  std::shared_ptr<Net> net;
  torch::optim::Adam adam;
  mp::Trainer<P> trainer;
  static mp::TrainerOptions options() {
    auto o = mp::TrainerOptions().accumulation_steps(2).max_grad_norm(1.0);
    // A short growth interval, so that the scale and its tracker change before the save.
    if constexpr (std::is_same_v<typename P::scaler_type, mp::GradScaler>) {
      o.scaler(mp::GradScalerOptions().growth_interval(2));
    }
    return o;
  }
  explicit Run(std::uint64_t seed)
      : net((torch::manual_seed(seed), std::make_shared<Net>())),
        adam(net->parameters(), torch::optim::AdamOptions(1e-2)),
        trainer(net, adam, options()) {}
  // Micro-batch 2 is poisoned with NaN: one skipped step (and a back-off) before the save.
  void train(int micro_batches, const Task& task, int offset) {
    for (int i = offset; i < offset + micro_batches; ++i) {
      const auto b = (i % 8) * 32;
      const auto x = task.x.slice(0, b, b + 32), y = task.y.slice(0, b, b + 32);
      trainer.step([&, i] {
        auto loss = torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(x)), y);
        return i == 2 ? loss * std::numeric_limits<float>::quiet_NaN() : loss;
      });
    }
  }
};

}  // namespace

TEST_CASE_TEMPLATE("a checkpoint resumes bit-identically", P, mp::FullPrecision,
                   mp::MixedO2<at::BFloat16>, ScaledO2) {
  const Task task;
  const auto path = test::temp_path(std::string("resume_") + std::string(P::name) + ".ckpt");
  Run<P> straight(1);
  straight.train(6, task, 0);
  straight.trainer.save(path);
  straight.train(10, task, 6);  // dropout draws from the RNG: its state is in the checkpoint

  Run<P> resumed(2);  // different initial weights: everything must come from the file
  resumed.trainer.load(path);
  CHECK(resumed.trainer.stats().steps == 3);
  CHECK(resumed.trainer.stats().skipped_steps == 1);
  resumed.train(10, task, 6);
  CHECK(test::identical(resumed.net->parameters(), straight.net->parameters()));
  CHECK(test::identical(resumed.trainer.master_weights(), straight.trainer.master_weights()));
  CHECK(test::identical(resumed.net->buffers(), straight.net->buffers()));
  CHECK(resumed.trainer.stats().scale == straight.trainer.stats().scale);
  CHECK(resumed.trainer.stats().steps == straight.trainer.stats().steps);
}

TEST_CASE("bad checkpoints are refused and change nothing") {
  const Task task;
  const auto path = test::temp_path("good.ckpt");
  Run<mp::MixedO2<at::BFloat16>> run(1);
  run.train(4, task, 0);
  run.trainer.save(path);

  Run<mp::MixedO2<at::BFloat16>> target(3);
  target.train(2, task, 0);
  const auto params = test::snapshot(target.net->parameters());
  const auto moments = test::adam_moments(target.adam);
  const auto steps = target.trainer.stats().steps;
  const auto masters = test::snapshot(target.trainer.master_weights());
  const auto buffers = test::snapshot(target.net->buffers());
  auto unchanged = [&] {
    CHECK(test::identical(test::snapshot(target.net->parameters()), params));
    CHECK(test::identical(test::snapshot(target.trainer.master_weights()), masters));
    CHECK(test::identical(test::snapshot(target.net->buffers()), buffers));
    CHECK(test::adam_moments(target.adam) == moments);
    CHECK(target.trainer.stats().steps == steps);
  };

  SUBCASE("truncated") {
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto truncated = test::temp_path("truncated.ckpt");
    std::ofstream(truncated, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
    CHECK_THROWS_WITH_AS(target.trainer.load(truncated), doctest::Contains("cannot read"), mp::Error);
    unchanged();
  }
  SUBCASE("missing") {
    CHECK_THROWS_WITH_AS(target.trainer.load(test::temp_path("nope.ckpt")),
                         doctest::Contains("cannot read"), mp::Error);
    unchanged();
  }
  SUBCASE("another policy") {
    Run<mp::FullPrecision> other(1);
    CHECK_THROWS_WITH_AS(other.trainer.load(path),
                         doctest::Contains("Trainer<MixedO2<BFloat16>>, this is Trainer<FullPrecision>"),
                         mp::Error);
  }
  SUBCASE("another model") {
    auto small = torch::nn::Sequential(torch::nn::Linear(16, 4));
    torch::optim::Adam adam(small->parameters(), torch::optim::AdamOptions(1e-2));
    mp::Trainer<mp::MixedO2<at::BFloat16>> other(small, adam);
    const auto before = test::snapshot(small->parameters());
    CHECK_THROWS_AS(other.load(path), mp::Error);
    CHECK(test::identical(test::snapshot(small->parameters()), before));
  }
  SUBCASE("mid-accumulation saves are refused") {
    target.train(1, task, 0);
    CHECK_THROWS_WITH_AS(target.trainer.save(path), doctest::Contains("middle of an accumulation"),
                         mp::Error);
  }
}

TEST_CASE("MixedO2 pairs master weights by identity: group order, subsets, tied weights") {
  const Task task;
  auto make = [] {
    torch::manual_seed(21);
    return torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::ReLU(),
                                 torch::nn::Linear(16, 16), torch::nn::ReLU(),
                                 torch::nn::Linear(16, 4));
  };
  auto train = [&](torch::nn::Sequential& model, torch::optim::Optimizer& opt) {
    mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, opt);
    for (std::int64_t b = 0; b < 256; b += 32) {
      const auto x = task.x.slice(0, b, b + 32), y = task.y.slice(0, b, b + 32);
      REQUIRE(trainer.step([&] {
        return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
      }).stepped());
    }
    return trainer.master_weights().size();
  };
  SUBCASE("parameter groups in reverse order (equal shapes: a positional pairing would not see it)") {
    auto in_order = make();
    auto reversed = make();
    torch::optim::SGD sgd_in_order(in_order->parameters(), torch::optim::SGDOptions(0.1));
    auto params = reversed->parameters();
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      groups.emplace_back(std::vector<at::Tensor>{*it});
    }
    torch::optim::SGD sgd_reversed(groups, torch::optim::SGDOptions(0.1));
    train(in_order, sgd_in_order);
    train(reversed, sgd_reversed);
    CHECK(test::identical(in_order->parameters(), reversed->parameters()));
  }
  SUBCASE("an optimizer over a subset: frozen layers stay as they were") {
    auto model = make();
    for (auto& p : model[0]->parameters()) p.requires_grad_(false);
    const auto frozen = test::snapshot(model[0]->parameters());
    const auto trained_before = test::snapshot(model[4]->parameters());
    std::vector<at::Tensor> trainable = model[2]->parameters();
    for (auto& p : model[4]->parameters()) trainable.push_back(p);
    torch::optim::SGD sgd(trainable, torch::optim::SGDOptions(0.1));
    CHECK(train(model, sgd) == 4U);
    std::vector<at::Tensor> frozen_now;
    for (auto& p : model[0]->parameters()) frozen_now.push_back(p.to(at::kFloat));
    CHECK(test::max_abs_diff(frozen_now, frozen) <= 1.0 / 128);  // only rounded to bf16
    CHECK_FALSE(test::identical(test::snapshot(model[4]->parameters()), trained_before));
  }
  SUBCASE("tied weights get one master and train") {
    auto shared = torch::nn::Linear(16, 16);
    auto model = torch::nn::Sequential(shared, torch::nn::Tanh(), shared, torch::nn::Tanh(),
                                       torch::nn::Linear(16, 4));
    REQUIRE(model->parameters().size() == 6U);  // LibTorch lists the tied tensors twice
    const auto before = shared->weight.detach().clone();
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
    mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, sgd);
    CHECK(trainer.master_weights().size() == 4U);
    for (std::int64_t b = 0; b < 256; b += 32) {
      const auto x = task.x.slice(0, b, b + 32), y = task.y.slice(0, b, b + 32);
      trainer.step([&] {
        return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
      });
    }
    const auto master = trainer.master_weights()[0];
    CHECK(shared->weight.equal(master.to(at::kBFloat16)));  // the model follows its master
    CHECK((master - before).abs().max().item<double>() > 1e-2);  // and it trained
  }
}

TEST_CASE("a NaN loss with finite gradients is skipped too") {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(net, sgd);
  const Task task;
  const auto x = task.x.slice(0, 0, 32), y = task.y.slice(0, 0, 32);
  const auto before = test::snapshot(net->parameters());
  const auto report = trainer.step([&] {
    const auto nan = torch::full({}, std::numeric_limits<float>::quiet_NaN());  // no grad
    return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(x)), y) + nan;
  });
  CHECK(report.status == mp::StepStatus::skipped);
  CHECK(test::identical(test::snapshot(net->parameters()), before));
}

TEST_CASE("MixedO2 accumulates micro-batch gradients in fp32, not in bf16") {
  // Micro-batch gradients 1, 2^-9, 2^-9, 2^-9: summed in bf16 each 2^-9 is a tie that rounds
  // back to 1; summed in fp32 the total is exact. Averaged over 4 (exact), lr 1.
  auto lin = torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false));
  {
    torch::NoGradGuard no_grad;
    lin->weight.fill_(1.0);
  }
  torch::optim::SGD sgd(lin->parameters(), torch::optim::SGDOptions(1.0));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(lin, sgd, mp::TrainerOptions().accumulation_steps(4));
  const double inputs[] = {1.0, std::ldexp(1.0, -9), std::ldexp(1.0, -9), std::ldexp(1.0, -9)};
  for (const double input : inputs) {
    const auto x = torch::full({1, 1}, input);
    trainer.step([&] { return lin->forward(trainer.cast_input(x)).sum(); });
  }
  const double expected = 1.0 - (1.0 + 3 * std::ldexp(1.0, -9)) / 4;
  CHECK(trainer.master_weights()[0].item<double>() == expected);
}

// A gradient hook may return its gradient in any dense layout: here the same values with
// strides [1, 1] for a parameter of shape [1, D] (strides [D, 1]), which autograd keeps, since
// a size-1 dimension's stride is free. The master's gradient has strides [D, 1]: the same
// elements in the same order, so the unscale into the masters must treat them as one layout.
struct ScoreVector : torch::nn::Module {
  explicit ScoreVector(bool hooked) {
    torch::manual_seed(11);
    w = register_parameter("w", torch::randn({1, 8}));
    if (hooked) {
      w.register_hook([](const at::Tensor& grad) { return grad.reshape({8, 1}).t(); });
    }
  }
  at::Tensor forward(const at::Tensor& x) { return at::matmul(x, w.t()); }
  at::Tensor w;
};

TEST_CASE("MixedO2: a gradient whose strides differ from its master's in a size-1 dimension") {
  torch::manual_seed(12);
  const auto x = torch::randn({16, 8}), y = torch::randn({16, 1});
  {  // The layout this case is about, in this LibTorch (else it would test nothing).
    ScoreVector hooked(true);
    hooked.forward(x).sum().backward();
    INFO("gradient strides ", hooked.w.grad().strides(), ", parameter ", hooked.w.strides());
    REQUIRE(hooked.w.grad().strides() != hooked.w.strides());
  }
  std::vector<at::Tensor> masters;
  for (const bool hooked : {true, false}) {
    auto model = std::make_shared<ScoreVector>(hooked);
    torch::optim::SGD optimizer(model->parameters(), 0.05);
    mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, optimizer);
    for (int step = 0; step < 3; ++step) {
      const auto report = trainer.step([&] {
        return (model->forward(trainer.cast_input(x)).to(at::kFloat) - y).square().mean();
      });
      REQUIRE(report.stepped());
    }
    masters.push_back(trainer.master_weights().at(0).clone());
  }
  MESSAGE("largest difference of the masters, hooked vs not: "
          << (masters[0] - masters[1]).abs().max().item<double>());
  CHECK(masters[0].equal(masters[1]));
  CHECK_FALSE(masters[0].equal(ScoreVector(false).w));  // they moved
}

TEST_CASE("MixedO1 inside an enclosing autocast scope sees each step's new weights") {
  // torch::mm on a raw parameter: autocast caches its bf16 cast while any autocast scope is open.
  struct MatMul : torch::nn::Module {
    MatMul() { w = register_parameter("w", torch::full({2, 2}, 0.5)); }
    at::Tensor forward(const at::Tensor& x) { return torch::mm(x, w); }
    at::Tensor w;
  };
  auto losses = [](bool enclosing) {
    auto model = std::make_shared<MatMul>();
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.5));
    mp::Trainer<mp::MixedO1<at::BFloat16>> trainer(model, sgd);
    std::optional<mp::AutocastGuard> outer;
    if (enclosing) outer.emplace(torch::kCPU, at::kBFloat16);
    const auto x = torch::ones({2, 2});
    std::vector<double> result;
    for (int i = 0; i < 4; ++i) {
      result.push_back(trainer.step([&] { return model->forward(x).pow(2).mean(); }).loss.item<double>());
    }
    return result;
  };
  const auto plain = losses(false);
  CHECK(plain[3] < plain[0]);
  CHECK(losses(true) == plain);
}

namespace {

// MixedO2<BFloat16> with a fixed loss scale, as a user would derive it.
struct StaticO2 : mp::MixedO2<at::BFloat16> {
  static constexpr std::string_view name = "StaticO2";
  using scaler_type = mp::StaticScaler;
};

}  // namespace

TEST_CASE("Trainer<P>::Options: TrainerOptions' settings, typed by the policy, converted whole") {
  // What P cannot take does not compile (tests/compile_fail/options_*.cpp); what it can is
  // passed on to the Trainer unchanged, every setting of it.
  int steps_seen = 0;
  auto typed = mp::Trainer<StaticO2>::Options()
                   .accumulation_steps(2)
                   .max_grad_norm(3.0)
                   .scaler(mp::GradScalerOptions().init_scale(512))
                   .on_step([&](const mp::StepReport&) { ++steps_seen; })
                   .find_non_finite_op(true)
                   .gradient_stats(mp::GradientStatsOptions().every(5).group_depth(1))
                   .max_consecutive_skips(7);
  const mp::TrainerOptions plain(typed);
  CHECK(plain.accumulation_steps() == 2);
  CHECK(plain.max_grad_norm() == 3.0);
  REQUIRE(plain.scaler().has_value());
  CHECK(plain.scaler()->init_scale() == 512);
  CHECK(plain.find_non_finite_op());
  CHECK(plain.gradient_stats().every() == 5);
  CHECK(plain.gradient_stats().group_depth() == 1);
  CHECK(plain.max_consecutive_skips() == 7);
  CHECK_FALSE(plain.fused_optimizer());
  const Task task;
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  mp::Trainer<StaticO2> trainer(net, adam, typed);
  CHECK(trainer.scaler().get_scale() == 512);
  CHECK(trainer.options().accumulation_steps() == 2);
  const auto x = task.x.slice(0, 0, 32), y = task.y.slice(0, 0, 32);
  CHECK(trainer.step(loss_of(trainer, net, x, y)).status == mp::StepStatus::accumulating);
  CHECK(trainer.step(loss_of(trainer, net, x, y)).status == mp::StepStatus::stepped);
  CHECK(steps_seen == 2);
  // A ModuleHolder takes them too.
  torch::nn::Sequential seq(torch::nn::Linear(16, 4));
  torch::optim::SGD sgd(seq->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::FullPrecision> holder(seq, sgd,
                                        mp::Trainer<mp::FullPrecision>::Options().accumulation_steps(3));
  CHECK(holder.options().accumulation_steps() == 3);
}

TEST_CASE("a StaticScaler policy trains bit-identically to the unscaled one and checkpoints its scale") {
  const Task task;
  torch::manual_seed(0);
  auto scaled_net = std::make_shared<Net>();
  torch::manual_seed(0);
  auto plain_net = std::make_shared<Net>();
  torch::optim::Adam scaled_adam(scaled_net->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam plain_adam(plain_net->parameters(), torch::optim::AdamOptions(1e-2));
  const auto options = mp::TrainerOptions().scaler(mp::GradScalerOptions().init_scale(1024));
  mp::Trainer<StaticO2> scaled(scaled_net, scaled_adam, options);
  mp::Trainer<mp::MixedO2<at::BFloat16>> plain(plain_net, plain_adam);
  // A power-of-two scale is exact in bf16: scaled and unscaled training agree bit for bit.
  for (int i = 0; i < 8; ++i) {
    const auto x = task.x.slice(0, i * 32, i * 32 + 32), y = task.y.slice(0, i * 32, i * 32 + 32);
    torch::manual_seed(100 + static_cast<std::uint64_t>(i));  // the same dropout masks
    const auto a = scaled.step(loss_of(scaled, scaled_net, x, y));
    torch::manual_seed(100 + static_cast<std::uint64_t>(i));
    const auto b = plain.step(loss_of(plain, plain_net, x, y));
    CHECK(a.stepped());
    CHECK(a.scale == 1024.0);
    CHECK(a.loss.item<double>() == b.loss.item<double>());
  }
  CHECK(test::identical(scaled_net->parameters(), plain_net->parameters()));
  CHECK(test::identical(scaled.master_weights(), plain.master_weights()));
  // A NaN loss is skipped; a static scale does not back off.
  const auto x = task.x.slice(0, 0, 32), y = task.y.slice(0, 0, 32);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(scaled.step([&] { return loss_of(scaled, scaled_net, x, y)() * nan; }).status ==
        mp::StepStatus::skipped);
  CHECK(scaled.scaler().get_scale() == 1024.0);
  // The scale set by hand survives a checkpoint into a trainer built with another one.
  scaled.scaler().update(2048);
  const auto path = test::temp_path("static_scaler.ckpt");
  scaled.save(path);
  torch::manual_seed(1);
  auto other_net = std::make_shared<Net>();
  torch::optim::Adam other_adam(other_net->parameters(), torch::optim::AdamOptions(1e-2));
  mp::Trainer<StaticO2> other(other_net, other_adam, options);
  CHECK(other.scaler().get_scale() == 1024.0);
  other.load(path);
  CHECK(other.scaler().get_scale() == 2048.0);
  CHECK(test::identical(other.master_weights(), scaled.master_weights()));
  // Options a StaticScaler would ignore are refused when the Trainer builds it.
  auto fresh_net = std::make_shared<Net>();
  torch::optim::Adam fresh_adam(fresh_net->parameters(), torch::optim::AdamOptions(1e-2));
  CHECK_THROWS_WITH_AS(
      mp::Trainer<StaticO2>(fresh_net, fresh_adam,
                            mp::TrainerOptions().scaler(mp::GradScalerOptions().growth_interval(10))),
      doctest::Contains("StaticScaler keeps its scale fixed"), mp::Error);
}

namespace {

// A scaler written against the LossScaler concept alone, as a user would: a fixed scale that
// halves at each overflow, its state in two keys. Nothing of mixprec's scalers is reused.
struct HalvingScaler {
  double scale = 1024.0;
  std::int64_t overflows = 0;
  double get_scale() const { return scale; }
  void update_scale(bool found_inf) {
    if (!found_inf) return;
    scale /= 2;
    ++overflows;
  }
  c10::impl::GenericDict state_dict() const {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    dict.insert("scale", scale);
    dict.insert("overflows", overflows);
    return dict;
  }
  void load_state_dict(const c10::impl::GenericDict& dict) {
    MIXPREC_CHECK(dict.contains("scale") && dict.contains("overflows"), "HalvingScaler's state "
                  "needs 'scale' and 'overflows'");
    scale = dict.at("scale").toDouble();
    overflows = dict.at("overflows").toInt();
  }
};
static_assert(mp::LossScaler<HalvingScaler>);

struct HalvingO2 : mp::MixedO2<at::BFloat16> {
  static constexpr std::string_view name = "HalvingO2";
  using scaler_type = HalvingScaler;
};

}  // namespace

TEST_CASE("a user-written LossScaler: trains as StaticScaler does, halves on overflow, checkpoints") {
  const Task task;
  torch::manual_seed(0);
  auto user_net = std::make_shared<Net>();
  torch::manual_seed(0);
  auto static_net = std::make_shared<Net>();
  torch::optim::Adam user_adam(user_net->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam static_adam(static_net->parameters(), torch::optim::AdamOptions(1e-2));
  mp::Trainer<HalvingO2> user(user_net, user_adam, mp::TrainerOptions().max_grad_norm(1.0));
  mp::Trainer<StaticO2> fixed(static_net, static_adam, mp::TrainerOptions().max_grad_norm(1.0).scaler(
                                                            mp::GradScalerOptions().init_scale(1024)));
  auto step_both = [&](int i, float factor) {
    const auto x = task.x.slice(0, i * 32, i * 32 + 32), y = task.y.slice(0, i * 32, i * 32 + 32);
    torch::manual_seed(100 + static_cast<std::uint64_t>(i));  // the same dropout masks
    const auto a = user.step([&] { return loss_of(user, user_net, x, y)() * factor; });
    torch::manual_seed(100 + static_cast<std::uint64_t>(i));
    const auto b = fixed.step([&] { return loss_of(fixed, static_net, x, y)() * factor; });
    CHECK(a.status == b.status);
    return a;
  };
  for (int i = 0; i < 3; ++i) CHECK(step_both(i, 1.0F).scale == 1024.0);
  CHECK(test::identical(user_net->parameters(), static_net->parameters()));
  CHECK(test::identical(user.master_weights(), fixed.master_weights()));
  // An overflow: both skip; this scaler halves, the static one keeps its scale.
  const auto before = test::snapshot(user_net->parameters());
  CHECK(step_both(3, std::numeric_limits<float>::infinity()).status == mp::StepStatus::skipped);
  CHECK(test::identical(test::snapshot(user_net->parameters()), before));
  CHECK(user.scaler().get_scale() == 512.0);
  CHECK(user.scaler().overflows == 1);
  CHECK(user.stats().scale == 512.0);
  CHECK(user.stats().skipped_steps == 1);
  // At 512 (a power of two, exact in bf16) it still trains as the fixed scale does.
  const auto report = step_both(4, 1.0F);
  CHECK(report.scale == 512.0);
  CHECK(test::identical(user_net->parameters(), static_net->parameters()));
  // Its state goes into the checkpoint and back.
  const auto path = test::temp_path("halving_scaler.ckpt");
  user.save(path);
  torch::manual_seed(1);
  auto other_net = std::make_shared<Net>();
  torch::optim::Adam other_adam(other_net->parameters(), torch::optim::AdamOptions(1e-2));
  mp::Trainer<HalvingO2> other(other_net, other_adam, mp::TrainerOptions().max_grad_norm(1.0));
  other.load(path);
  CHECK(other.scaler().get_scale() == 512.0);
  CHECK(other.scaler().overflows == 1);
  CHECK(test::identical(other.master_weights(), user.master_weights()));

  SUBCASE("a scale that is not a positive normal fp32 value: an Error, before the forward pass") {
    for (const double bad : {0.0, -2.0, static_cast<double>(std::numeric_limits<float>::infinity()),
                             1e-45, 1e40}) {
      CAPTURE(bad);
      user.scaler().scale = bad;
      const auto params = test::snapshot(user_net->parameters());
      const auto buffers = test::snapshot(user_net->buffers());
      const auto stats = user.stats();
      bool ran = false;
      CHECK_THROWS_WITH_AS(user.step([&] {
                             ran = true;
                             return loss_of(user, user_net, task.x, task.y)();
                           }),
                           doctest::Contains("the scaler's get_scale() must be a positive normal"),
                           mp::Error);
      CHECK_FALSE(ran);
      CHECK(test::identical(test::snapshot(user_net->parameters()), params));
      CHECK(test::identical(test::snapshot(user_net->buffers()), buffers));
      CHECK(user.stats().steps == stats.steps);
    }
    user.scaler().scale = 256.0;  // usable again
    CHECK(user.step(loss_of(user, user_net, task.x, task.y)).scale == 256.0);
  }
  SUBCASE("a scale changed between the micro-batches of one step: an Error") {
    auto fresh_net = std::make_shared<Net>();
    torch::optim::Adam fresh_adam(fresh_net->parameters(), torch::optim::AdamOptions(1e-2));
    mp::Trainer<HalvingO2> accumulating(fresh_net, fresh_adam,
                                        mp::TrainerOptions().accumulation_steps(2));
    // A scale that fp32 rounds (1000.1 is 1000.0999755859375 there) is the same one at every
    // micro-batch of a step.
    accumulating.scaler().scale = 1000.1;
    for (int k = 0; k < 2; ++k) {
      CHECK(accumulating.step(loss_of(accumulating, fresh_net, task.x, task.y)).scale ==
            static_cast<double>(static_cast<float>(1000.1)));
    }
    CHECK(accumulating.stats().steps == 1);
    CHECK(accumulating.step(loss_of(accumulating, fresh_net, task.x, task.y)).status ==
          mp::StepStatus::accumulating);
    accumulating.scaler().scale = 64.0;
    CHECK_THROWS_WITH_AS(accumulating.step(loss_of(accumulating, fresh_net, task.x, task.y)),
                         doctest::Contains("between micro-batches of one step"), mp::Error);
  }
  SUBCASE("TrainerOptions::scaler for a scaler that takes no GradScalerOptions: an Error") {
    auto fresh_net = std::make_shared<Net>();
    torch::optim::Adam fresh_adam(fresh_net->parameters(), torch::optim::AdamOptions(1e-2));
    CHECK_THROWS_WITH_AS(mp::Trainer<HalvingO2>(fresh_net, fresh_adam,
                                                mp::TrainerOptions().scaler(mp::GradScalerOptions())),
                         doctest::Contains("has no constructor taking GradScalerOptions"),
                         mp::Error);
  }
}

namespace {

using test::Branchy;

// Trains 4 steps with head b in step 0 only; checks after each later step that b did not move
// and holds no gradient (model and master), while the trunk did move.
template <class P>
void unused_head_stays(const mp::TrainerOptions& options) {
  torch::manual_seed(3);
  auto net = std::make_shared<Branchy>();
  torch::optim::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.5));
  mp::Trainer<P> trainer(net, adamw, options);
  const Task task;
  const auto n = options.accumulation_steps();
  for (int step = 0; step < 4; ++step) {
    const auto before_b = test::snapshot(net->b->parameters());
    const auto before_trunk = test::snapshot(net->trunk->parameters());
    for (std::int64_t k = 0; k < n; ++k) {
      const auto x = task.x.slice(0, 32 * (step * n + k), 32 * (step * n + k + 1));
      const auto y = task.y.slice(0, 32 * (step * n + k), 32 * (step * n + k + 1));
      REQUIRE(trainer.step([&] {
        return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(x), step == 0), y);
      }).status != mp::StepStatus::skipped);
    }
    CHECK_FALSE(test::identical(test::snapshot(net->trunk->parameters()), before_trunk));
    if (step == 0) {
      CHECK_FALSE(test::identical(test::snapshot(net->b->parameters()), before_b));
      continue;
    }
    CAPTURE(step);
    CHECK(test::identical(test::snapshot(net->b->parameters()), before_b));
    for (const auto& p : net->b->parameters()) CHECK_FALSE(p.grad().defined());
    const auto masters = trainer.master_weights();  // optimizer order: trunk, a, b
    for (std::size_t i = masters.size() >= 2 ? masters.size() - 2 : 0; i < masters.size(); ++i) {
      CHECK_FALSE(masters[i].grad().defined());
    }
  }
}

}  // namespace

TEST_CASE_TEMPLATE("a parameter a step did not reach keeps no gradient and does not move (AdamW)", P,
                   mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   mp::PureHalf<at::BFloat16>, ScaledO2) {
  SUBCASE("one micro-batch per step") { unused_head_stays<P>(mp::TrainerOptions()); }
  SUBCASE("accumulation") { unused_head_stays<P>(mp::TrainerOptions().accumulation_steps(2)); }
  SUBCASE("clipping") { unused_head_stays<P>(mp::TrainerOptions().max_grad_norm(0.5)); }
}

TEST_CASE_TEMPLATE("a parameter a step did not reach does not move: the fused AdamW step" * doctest::skip(!mp::fused_adam_available), P,
                   mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   ScaledO2) {
  unused_head_stays<P>(mp::TrainerOptions().fused_optimizer(true));
}

TEST_CASE("max_consecutive_skips: an Error after K skipped steps in a row, naming the inf/NaN") {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  std::int64_t reported = 0;
  mp::Trainer<ScaledO2> trainer(net, sgd, mp::TrainerOptions().max_consecutive_skips(3).on_step(
                                              [&](const mp::StepReport&) { ++reported; }));
  const Task task;
  const auto x = task.x.slice(0, 0, 32), y = task.y.slice(0, 0, 32);
  const auto nan_loss = [&] {
    return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(x)), y) *
           std::numeric_limits<float>::quiet_NaN();
  };
  // Two skips, a step: the count starts again.
  CHECK(trainer.step(nan_loss).status == mp::StepStatus::skipped);
  CHECK(trainer.step(nan_loss).status == mp::StepStatus::skipped);
  CHECK(trainer.step(loss_of(trainer, net, x, y)).stepped());
  CHECK(trainer.step(nan_loss).status == mp::StepStatus::skipped);
  CHECK(trainer.step(nan_loss).status == mp::StepStatus::skipped);
  std::string message;
  try {
    trainer.step(nan_loss);
  } catch (const mp::Error& e) {
    message = e.what();
  }
  MESSAGE(message);
  CHECK(message.find("the last 3 optimizer steps") != std::string::npos);
  CHECK(message.find("in the loss") != std::string::npos);
  CHECK(message.find("max_consecutive_skips") != std::string::npos);
  CHECK(reported == 6);  // the third skip was reported before the Error
  CHECK(trainer.stats().skipped_steps == 5);

  SUBCASE("0: no limit") {
    auto net2 = std::make_shared<Net>();
    torch::optim::SGD sgd2(net2->parameters(), torch::optim::SGDOptions(0.1));
    mp::Trainer<ScaledO2> unlimited(net2, sgd2, mp::TrainerOptions().max_consecutive_skips(0));
    for (int k = 0; k < 70; ++k) {
      CHECK(unlimited.step([&] {
        return torch::nn::functional::cross_entropy(net2->forward(unlimited.cast_input(x)), y) *
               std::numeric_limits<float>::quiet_NaN();
      }).status == mp::StepStatus::skipped);
    }
  }
}

TEST_CASE("max_consecutive_skips < 0 is an Error before anything changes") {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  const auto before = test::snapshot(net->parameters());
  CHECK_THROWS_WITH_AS(mp::Trainer<ScaledO2>(net, sgd, mp::TrainerOptions().max_consecutive_skips(-1)),
                       doctest::Contains("max_consecutive_skips must be >= 0"), mp::Error);
  CHECK(test::identical(test::snapshot(net->parameters()), before));
}

TEST_CASE_TEMPLATE("a Trainer call from inside loss_fn or evaluate's forward: an Error, nothing changed", P,
                   mp::FullPrecision, mp::MixedO2<at::BFloat16>, ScaledO2) {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  mp::Trainer<P> trainer(net, adam);
  const Task task;
  const auto x = task.x.slice(0, 0, 32), y = task.y.slice(0, 0, 32);
  REQUIRE(trainer.step(loss_of(trainer, net, x, y)).stepped());
  const auto checkpoint = test::temp_path("reentrant.ckpt");
  trainer.save(checkpoint);
  const auto params = test::snapshot(net->parameters());
  const auto masters = test::snapshot(trainer.master_weights());
  const auto moments = test::adam_moments(adam);
  const auto stats = trainer.stats();
  const std::map<std::string, std::function<void()>> inner{
      {"step", [&] { trainer.step(loss_of(trainer, net, x, y)); }},
      {"save", [&] { trainer.save(checkpoint); }},
      {"load", [&] { trainer.load(checkpoint); }},
      {"evaluate", [&] { trainer.evaluate([&] { return net->forward(trainer.cast_input(x)); }); }},
  };
  for (const auto& [name, call] : inner) {
    CAPTURE(name);
    CHECK_THROWS_WITH_AS(trainer.step([&] {
                           auto loss = loss_of(trainer, net, x, y)();
                           call();
                           return loss;
                         }),
                         doctest::Contains("called from inside step()'s loss_fn"), mp::Error);
    CHECK_THROWS_WITH_AS(trainer.evaluate([&] {
                           call();
                           return net->forward(trainer.cast_input(x));
                         }),
                         doctest::Contains("called from inside evaluate()'s forward"), mp::Error);
    CHECK(test::identical(test::snapshot(net->parameters()), params));
    CHECK(test::identical(test::snapshot(trainer.master_weights()), masters));
    CHECK(test::adam_moments(adam) == moments);
    CHECK(trainer.stats().steps == stats.steps);
    CHECK(trainer.stats().micro_batches == stats.micro_batches);
  }
  // And the Trainer works normally afterwards.
  CHECK(trainer.step(loss_of(trainer, net, x, y)).stepped());
}

namespace {

void clear_grads(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) t.mutable_grad().reset();
}

// Every torch::optim optimizer the Trainer drives, with options that exercise its state.
enum class Algorithm { sgd, adam, adamw, adagrad, rmsprop };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Algorithm algorithm,
                                                        const std::vector<at::Tensor>& params) {
  namespace optim = torch::optim;
  switch (algorithm) {
    case Algorithm::sgd:
      return std::make_unique<optim::SGD>(params, optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3));
    case Algorithm::adam:
      return std::make_unique<optim::Adam>(params, optim::AdamOptions(1e-2).weight_decay(1e-3));
    case Algorithm::adamw:
      return std::make_unique<optim::AdamW>(params, optim::AdamWOptions(1e-2).weight_decay(0.1));
    case Algorithm::adagrad:
      return std::make_unique<optim::Adagrad>(
          params, optim::AdagradOptions(0.05).initial_accumulator_value(0.1).lr_decay(1e-3));
    case Algorithm::rmsprop:
      return std::make_unique<optim::RMSprop>(params, optim::RMSpropOptions(1e-2).momentum(0.5));
  }
  return nullptr;
}

// Trainer<P> against the loop a user writes for P by hand with the same optimizer: the model cast
// to P's low dtype (O2, O3), fp32 masters that the optimizer updates and the model copies (O2),
// autocast around the forward (O1). Bitwise after 6 steps.
template <class P>
void trains_as_the_hand_loop(Algorithm algorithm) {
  const Task task;
  auto make = [] {
    torch::manual_seed(4);
    return torch::nn::Sequential(torch::nn::Linear(16, 8), torch::nn::ReLU(), torch::nn::Linear(8, 4));
  };
  auto hand = make();
  auto net = make();
  std::vector<at::Tensor> masters;
  if constexpr (P::master_weights) {
    for (const auto& p : hand->parameters()) masters.push_back(p.detach().clone().requires_grad_());
  }
  if constexpr (P::cast_model) hand->to(P::low_dtype);  // no norm layers: all of it
  const auto hand_params = hand->parameters();
  auto by_hand = make_optimizer(algorithm, P::master_weights ? masters : hand_params);
  auto by_trainer = make_optimizer(algorithm, net->parameters());
  mp::Trainer<P> trainer(net, *by_trainer);
  for (std::int64_t b = 0; b < 6 * 32; b += 32) {
    const auto x = task.x.slice(0, b, b + 32), y = task.y.slice(0, b, b + 32);
    clear_grads(hand_params);
    clear_grads(masters);
    at::Tensor loss;
    {
      std::optional<mp::AutocastGuard> guard;
      if constexpr (P::autocast) guard.emplace(c10::DeviceType::CPU, P::low_dtype);
      loss = torch::nn::functional::cross_entropy(
          hand->forward(P::cast_model ? x.to(P::low_dtype) : x), y);
    }
    loss.to(at::kFloat).backward();
    if constexpr (P::master_weights) {
      for (std::size_t i = 0; i < masters.size(); ++i) {
        masters[i].mutable_grad() = hand_params[i].grad().to(at::kFloat);
      }
    }
    by_hand->step();
    if constexpr (P::master_weights) {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < masters.size(); ++i) hand_params[i].copy_(masters[i]);
    }
    REQUIRE(trainer.step([&] {
      return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(x)), y);
    }).stepped());
  }
  MESSAGE(P::name, ": largest difference to the hand loop ",
          test::max_abs_diff(hand->parameters(), net->parameters()));
  CHECK(test::identical(hand->parameters(), net->parameters()));
  if constexpr (P::master_weights) CHECK(test::identical(masters, trainer.master_weights()));
}

}  // namespace

TEST_CASE_TEMPLATE("every torch::optim optimizer trains under every policy as in the hand-written loop",
                   P, mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   mp::PureHalf<at::BFloat16>) {
  SUBCASE("SGD with momentum") { trains_as_the_hand_loop<P>(Algorithm::sgd); }
  SUBCASE("Adam") { trains_as_the_hand_loop<P>(Algorithm::adam); }
  SUBCASE("AdamW") { trains_as_the_hand_loop<P>(Algorithm::adamw); }
  SUBCASE("Adagrad (its state made by its constructor)") { trains_as_the_hand_loop<P>(Algorithm::adagrad); }
  SUBCASE("RMSprop") { trains_as_the_hand_loop<P>(Algorithm::rmsprop); }
}

TEST_CASE("Adagrad: a param group added later gets its state, as its constructor would make it") {
  const Task task;
  torch::manual_seed(5);
  auto net = std::make_shared<Net>();
  torch::optim::Adagrad adagrad(net->fc1->parameters(),
                                torch::optim::AdagradOptions(0.05).initial_accumulator_value(0.25));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(net, adagrad);
  const auto x = task.x.slice(0, 0, 32), y = task.y.slice(0, 0, 32);
  REQUIRE(trainer.step(loss_of(trainer, net, x, y)).stepped());
  auto late = net->fc2->parameters();
  adagrad.add_param_group(torch::optim::OptimizerParamGroup(
      late, std::make_unique<torch::optim::AdagradOptions>(
                torch::optim::AdagradOptions(0.05).initial_accumulator_value(0.5))));
  const auto before = test::snapshot(net->fc2->parameters());
  REQUIRE(trainer.step(loss_of(trainer, net, x, y)).stepped());  // LibTorch alone would fail here
  CHECK_FALSE(test::identical(test::snapshot(net->fc2->parameters()), before));
  const auto& group = adagrad.param_groups().back();
  for (const auto& p : group.params()) {
    CHECK(p.scalar_type() == at::kFloat);  // the master, not the bf16 model tensor
    const auto& state = static_cast<const torch::optim::AdagradParamState&>(
        *adagrad.state().at(mp::detail::state_key<decltype(adagrad.state())>(p)));
    CHECK(state.step() == 1);
    CHECK(state.sum().scalar_type() == at::kFloat);
    CHECK(state.sum().min().item<double>() >= 0.5);  // the group's initial_accumulator_value
  }
}

TEST_CASE("a sparse Embedding with Adagrad under MixedO2: the Error says sparse, not 'has stepped'") {
  torch::nn::Sequential net(torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true)),
                            torch::nn::Linear(4, 2));
  torch::optim::Adagrad adagrad(net->parameters(), torch::optim::AdagradOptions(0.1));
  const auto params = test::snapshot(net->parameters());
  CHECK_THROWS_WITH_AS(mp::Trainer<mp::MixedO2<at::BFloat16>>(net, adagrad),
                       doctest::Contains("sparse"), mp::Error);
  CHECK(test::identical(test::snapshot(net->parameters()), params));
  // FullPrecision trains it: Adagrad takes sparse gradients.
  mp::Trainer<mp::FullPrecision> trainer(net, adagrad);
  const auto ids = torch::tensor({1, 2, 3}, torch::kLong);
  REQUIRE(trainer.step([&] { return net->forward(ids).pow(2).mean(); }).stepped());
  CHECK_FALSE(test::identical(test::snapshot(net->parameters()), params));
}

TEST_CASE("a model with parameters on a device autocast does not know: an Error naming it, nothing changed") {
  struct Split : torch::nn::Module {
    Split() {
      front = register_module("front", torch::nn::Linear(4, 4));
      back = register_parameter("back", torch::zeros({4, 2}, torch::Device(torch::kMeta)));
    }
    torch::nn::Linear front{nullptr};
    at::Tensor back;
  };
  auto net = std::make_shared<Split>();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  const auto cpu_part = test::snapshot(net->front->parameters());
  CHECK_THROWS_WITH_AS(mp::Trainer<mp::MixedO2<at::BFloat16>>(net, sgd),
                       doctest::Contains("parameter 'back' is on meta"), mp::Error);
  CHECK(test::identical(test::snapshot(net->front->parameters()), cpu_part));  // not cast
  const auto held = sgd.param_groups()[0].params();  // not rebound to masters
  const auto own = net->parameters();
  REQUIRE(held.size() == own.size());
  for (std::size_t i = 0; i < held.size(); ++i) CHECK(held[i].is_same(own[i]));
  CHECK_THROWS_WITH_AS(mp::autocast_device_types(net->parameters()),
                       doctest::Contains("on the meta device"), mp::Error);
}

TEST_CASE("a CPU+CUDA model gets its policy's autocast on both device types") {
  // The Trainer engages autocast on every device type of the model's parameters, not on the
  // first parameter's only (tests/test_cuda.cpp trains such a model on a GPU).
  torch::nn::Linear cpu_only(4, 4);
  CHECK(mp::autocast_device_types(cpu_only->parameters()) ==
        std::vector<c10::DeviceType>{c10::DeviceType::CPU});
  const std::vector<c10::DeviceType> both{c10::DeviceType::CPU, c10::DeviceType::CUDA};
  auto enabled = [](c10::DeviceType type) {
    return mp::detail::get_autocast_state(type).enabled;
  };
  {
    const mp::PolicyAutocast<mp::MixedO1<at::BFloat16>> on(both);
    CHECK(enabled(c10::DeviceType::CPU));
    CHECK(enabled(c10::DeviceType::CUDA));
    CHECK(mp::detail::get_autocast_state(c10::DeviceType::CUDA).dtype == at::kBFloat16);
    {
      const mp::PolicyAutocast<mp::MixedO2<at::BFloat16>> off(both);  // an outer scope cannot lower O2
      CHECK_FALSE(enabled(c10::DeviceType::CPU));
      CHECK_FALSE(enabled(c10::DeviceType::CUDA));
    }
    CHECK(enabled(c10::DeviceType::CPU));
    CHECK(enabled(c10::DeviceType::CUDA));
  }
  CHECK_FALSE(enabled(c10::DeviceType::CPU));
  CHECK_FALSE(enabled(c10::DeviceType::CUDA));
}

TEST_CASE_TEMPLATE("cast_input: floating batches to compute_dtype<P> under O2/O3, unchanged under O0/O1",
                   P, mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   mp::PureHalf<at::BFloat16>) {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<P> trainer(net, sgd);
  for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
    CAPTURE(std::string(c10::toString(dtype)));
    const auto x = torch::ones({2, 16}, dtype);
    CHECK(trainer.cast_input(x).scalar_type() == (P::cast_model ? mp::compute_dtype<P> : dtype));
  }
  CHECK(trainer.cast_input(torch::ones({2}, torch::kLong)).scalar_type() == torch::kLong);
}

}  // namespace test_trainer
