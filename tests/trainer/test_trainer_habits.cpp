// A Python user's habits, each a test case (STYLE.md): a new optimizer assigned to the Trainer's
// optimizer variable, `opt.step()` after the framework's step, `backward()` inside the loss
// function, inputs not cast, a second Trainer on a model the first one cast. Each works as in
// Python or is an Error that names the fix.
#include <mixprec/mixprec.hpp>

#include "scaled_policy.hpp"
#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace test_trainer_habits {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

using test::ScaledO2;

// No BatchNorm or dropout: a refused call's forward pass then changes nothing either.
struct Mlp : torch::nn::Module {
  Mlp() {
    fc1 = register_module("fc1", torch::nn::Linear(12, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// Mlp with a head that a precision map can keep in fp32.
struct MappedMlp : torch::nn::Module {
  MappedMlp() {
    fc1 = register_module("fc1", torch::nn::Linear(12, 16));
    fc2 = register_module("fc2", mp::nn::Mappable<torch::nn::Linear>(16, 3));
  }
  torch::nn::Linear fc1{nullptr};
  mp::nn::Mappable<torch::nn::Linear> fc2{nullptr};
};

struct Data {
  at::Tensor x, y;
  Data() {
    torch::manual_seed(7);
    x = torch::randn({64, 12});
    y = x.slice(1, 0, 3).argmax(1);
  }
  at::Tensor xs(std::int64_t i) const { return x.slice(0, 16 * (i % 4), 16 * (i % 4 + 1)); }
  at::Tensor ys(std::int64_t i) const { return y.slice(0, 16 * (i % 4), 16 * (i % 4 + 1)); }
};

// A model, an AdamW and a Trainer<P> over them, from one seed.
template <class P>
struct Run {
  std::shared_ptr<Mlp> net;
  torch::optim::AdamW opt;
  mp::Trainer<P> trainer;
  Data data;
  explicit Run(mp::TrainerOptions options = {}, double lr = 1e-2)
      : net((torch::manual_seed(3), std::make_shared<Mlp>())),
        opt(net->parameters(), torch::optim::AdamWOptions(lr)),
        trainer(net, opt, std::move(options)) {}
  mp::StepReport step(std::int64_t i) {
    return trainer.step([&, i] {
      return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(data.xs(i))),
                                                  data.ys(i));
    });
  }
  // What the run trains: the model's tensors and, under MixedO2, the masters.
  std::vector<at::Tensor> state() const {
    auto tensors = test::snapshot(net->parameters());
    for (const auto& m : test::snapshot(trainer.master_weights())) tensors.push_back(m);
    return tensors;
  }
};

}  // namespace

TEST_CASE_TEMPLATE("a new optimizer assigned to the Trainer's is adopted: it trains as the old one reset would" *
                       doctest::skip(!test::optimizers_assignable), P, mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   mp::PureHalf<at::BFloat16>, ScaledO2) {
  // The habit: `opt = AdamW(model.parameters(), lr=...)` to change the learning rate or reset
  // the optimizer. Its reference: the same run with the old optimizer's state cleared and its
  // lr set in place, which the Trainer has always stepped correctly.
  Run<P> assigned, reset;
  for (std::int64_t i = 0; i < 3; ++i) {
    REQUIRE(assigned.step(i).stepped());
    REQUIRE(reset.step(i).stepped());
  }
  const auto before = assigned.state();
  test::assign_new(assigned.opt, assigned.net->parameters(), torch::optim::AdamWOptions(3e-2));
  reset.opt.state().clear();
  static_cast<torch::optim::AdamWOptions&>(reset.opt.param_groups()[0].options()).lr(3e-2);
  for (std::int64_t i = 3; i < 8; ++i) {
    REQUIRE(assigned.step(i).stepped());
    REQUIRE(reset.step(i).stepped());
  }
  INFO("largest difference ", test::max_abs_diff(assigned.state(), reset.state()));
  CHECK(test::identical(assigned.state(), reset.state()));
  CHECK_FALSE(test::identical(assigned.state(), before));  // it trained
  if constexpr (P::master_weights) {
    // The optimizer steps the fp32 masters, never the bf16 model.
    for (const auto& group : assigned.opt.param_groups()) {
      for (const auto& p : group.params()) CHECK(p.scalar_type() == at::kFloat);
    }
  }
}

TEST_CASE("a new optimizer keeps the run's fp32 masters, not the model's bf16 rounding of them" *
          doctest::skip(!test::optimizers_assignable)) {
  Run<mp::MixedO2<at::BFloat16>> run;
  for (std::int64_t i = 0; i < 3; ++i) REQUIRE(run.step(i).stepped());
  const auto masters = test::snapshot(run.trainer.master_weights());
  test::assign_new(run.opt, run.net->parameters(), torch::optim::AdamWOptions(0.0));  // lr 0
  REQUIRE(run.step(3).stepped());
  CHECK(test::identical(test::snapshot(run.trainer.master_weights()), masters));
}

TEST_CASE("a new optimizer that stepped the model itself, or holds other tensors, is an Error that changes nothing" *
          doctest::skip(!test::optimizers_assignable)) {
  Run<mp::MixedO2<at::BFloat16>> run;
  REQUIRE(run.step(0).stepped());
  const auto before = run.state();
  SUBCASE("it has state for the bf16 model") {
    test::assign_new(run.opt, run.net->parameters(), torch::optim::AdamWOptions(1e-2));
    run.net->forward(run.trainer.cast_input(run.data.xs(0))).sum().backward();
    run.opt.step();  // steps the bf16 weights: the state is theirs now
    const auto stepped = run.state();
    CHECK_THROWS_WITH_AS(run.step(1), doctest::Contains("has state for it"), mp::Error);
    CHECK(test::identical(run.state(), stepped));
  }
  SUBCASE("it holds a tensor that is not the model's") {
    auto stranger = torch::zeros({3}, torch::requires_grad());
    test::assign_new(run.opt, std::vector<at::Tensor>{stranger}, torch::optim::AdamWOptions(1e-2));
    CHECK_THROWS_WITH_AS(run.step(1), doctest::Contains("not a parameter of the model"), mp::Error);
    CHECK(test::identical(run.state(), before));
  }
  SUBCASE("in the middle of an accumulation") {
    Run<mp::MixedO2<at::BFloat16>> acc(mp::TrainerOptions().accumulation_steps(2));
    REQUIRE(acc.step(0).status == mp::StepStatus::accumulating);
    const auto held = acc.state();
    test::assign_new(acc.opt, acc.net->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int attempt = 0; attempt < 2; ++attempt) {  // the same Error until the way out is taken
      CHECK_THROWS_WITH_AS(acc.step(1), doctest::Contains("trainer.drop_accumulation()"), mp::Error);
      CHECK(test::identical(acc.state(), held));
    }
  }
}

TEST_CASE("the way out of a new optimizer assigned mid-accumulation: drop_accumulation(), then "
          "the run goes on as if the dropped micro-batch had not been" *
          doctest::skip(!test::optimizers_assignable)) {
  // Before the fix every later step() repeated the Error ("changed in the middle of an
  // accumulation"), with no way on short of load(). The reference: a run that assigned the new
  // optimizer before that micro-batch.
  const auto options = mp::TrainerOptions().accumulation_steps(2);
  Run<mp::MixedO2<at::BFloat16>> acc(options), reference(options);
  for (std::int64_t i = 0; i < 2; ++i) {
    REQUIRE(acc.step(i).stepped() == (i == 1));
    REQUIRE(reference.step(i).stepped() == (i == 1));
  }
  REQUIRE(acc.step(2).status == mp::StepStatus::accumulating);
  test::assign_new(acc.opt, acc.net->parameters(), torch::optim::AdamWOptions(3e-2));
  CHECK_THROWS_AS(acc.step(3), mp::Error);
  CHECK(acc.trainer.drop_accumulation() == 1);
  CHECK(acc.trainer.drop_accumulation() == 0);  // nothing left to drop
  test::assign_new(reference.opt, reference.net->parameters(), torch::optim::AdamWOptions(3e-2));
  for (std::int64_t i = 3; i < 7; ++i) {
    const auto report = acc.step(i);
    CHECK(report.micro_batch == (i % 2 == 1 ? 1 : 2));
    CHECK(report.status == reference.step(i).status);
  }
  INFO("largest difference ", test::max_abs_diff(acc.state(), reference.state()));
  CHECK(test::identical(acc.state(), reference.state()));
  CHECK(acc.trainer.stats().steps == reference.trainer.stats().steps);
}

TEST_CASE_TEMPLATE("optimizer.zero_grad() inside on_step changes nothing, while accumulating too",
                   P, mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   mp::PureHalf<at::BFloat16>, ScaledO2) {
  // docs/migrating.md: a leftover zero_grad() changes nothing. Before the fix, inside on_step
  // of an accumulating micro-batch it dropped the partial sums (FullPrecision, 3 steps of 2:
  // the weights 0.057 away from the clean run's).
  const auto options = mp::TrainerOptions().accumulation_steps(2);
  Run<P>* self = nullptr;
  Run<P> zeroing(mp::TrainerOptions(options).on_step([&](const mp::StepReport&) {
    self->opt.zero_grad();
  }));
  self = &zeroing;
  Run<P> clean(options);
  for (std::int64_t i = 0; i < 6; ++i) {
    REQUIRE(zeroing.step(i).status == clean.step(i).status);
  }
  INFO("largest difference ", test::max_abs_diff(zeroing.state(), clean.state()));
  CHECK(test::identical(zeroing.state(), clean.state()));
}

TEST_CASE("PureHalf<Half>: a new optimizer's eps is checked as the first one's" *
          doctest::skip(!mp::cpu_half_math)) {
  auto net = (torch::manual_seed(3), std::make_shared<Mlp>());
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-3).eps(1e-4));
  mp::Trainer<mp::PureHalf<at::Half>> trainer(net, opt);
  const Data data;
  const auto step = [&] {
    return trainer.step([&] {
      return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(data.xs(0))),
                                                  data.ys(0));
    });
  };
  REQUIRE(step().stepped());
  const auto before = test::snapshot(net->parameters());
  test::assign_new(opt, net->parameters(), torch::optim::AdamWOptions(1e-3));  // eps 1e-8
  CHECK_THROWS_WITH_AS(step(), doctest::Contains("is 0 in fp16"), mp::Error);
  CHECK(test::identical(test::snapshot(net->parameters()), before));
}

TEST_CASE_TEMPLATE("optimizer.step() after trainer.step() applies nothing a second time", P,
                   mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   mp::PureHalf<at::BFloat16>, ScaledO2) {
  // The habit of Python's `scaler.step(opt); scaler.update()` followed by `opt.step()`, and of
  // an `opt.zero_grad()` left between micro-batches. The reference: the same run without the
  // stray calls, bit for bit, also while accumulating.
  for (const std::int64_t accumulation : {1, 2}) {
    CAPTURE(accumulation);
    const auto options = mp::TrainerOptions().accumulation_steps(accumulation);
    Run<P> stray(options), clean(options);
    bool read_in_on_step = false;
    Run<P> observed(mp::TrainerOptions(options).on_step([&](const mp::StepReport& report) {
      if (!report.stepped()) return;
      // Diagnostics that read the gradients do so here, before they are cleared, by the
      // model's names (under MixedO2 the masters', which hold the step's gradient).
      const auto grads = observed.trainer.gradients();
      bool all = grads.size() == observed.net->named_parameters().size();
      for (const auto& item : grads) all = all && item.value().value.defined();
      read_in_on_step = all;
    }));
    for (std::int64_t i = 0; i < 6; ++i) {
      const auto report = stray.step(i);
      REQUIRE(report.status != mp::StepStatus::skipped);
      REQUIRE(clean.step(i).status == report.status);
      observed.step(i);
      const auto before = stray.state();
      stray.opt.step();
      stray.opt.zero_grad();  // between micro-batches it finds no gradient either
      INFO("micro-batch ", i, ", largest change ", test::max_abs_diff(stray.state(), before));
      CHECK(test::identical(stray.state(), before));
    }
    CHECK(test::identical(stray.state(), clean.state()));
    CHECK(read_in_on_step);
  }
}

TEST_CASE_TEMPLATE("loss_fn that runs backward() itself is an Error, even where the second backward would succeed",
                   P, mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   ScaledO2) {
  Run<P> run(mp::TrainerOptions().accumulation_steps(2));
  REQUIRE(run.step(0).status == mp::StepStatus::accumulating);
  const auto before = run.state();
  for (const bool retain : {false, true}) {
    CAPTURE(retain);
    // retain_graph: the Trainer's own backward would succeed and add the gradients twice.
    CHECK_THROWS_WITH_AS(run.trainer.step([&] {
      auto loss = torch::nn::functional::cross_entropy(
          run.net->forward(run.trainer.cast_input(run.data.xs(1))), run.data.ys(1));
      loss.backward({}, /*retain_graph=*/retain);
      return loss;
    }), doctest::Contains("loss_fn ran a backward pass itself"), mp::Error);
    CHECK(test::identical(run.state(), before));
  }
  // The accumulation goes on as if the bad calls had not been made.
  Run<P> clean(mp::TrainerOptions().accumulation_steps(2));
  REQUIRE(clean.step(0).status == mp::StepStatus::accumulating);
  REQUIRE(run.step(1).stepped());
  REQUIRE(clean.step(1).stepped());
  CHECK(test::identical(run.state(), clean.state()));
}

TEST_CASE_TEMPLATE("an input not passed through cast_input is an Error naming cast_input, in step() and evaluate()",
                   P, mp::MixedO2<at::BFloat16>, mp::PureHalf<at::BFloat16>) {
  torch::manual_seed(5);
  auto conv = torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3)),
                                    torch::nn::Flatten(), torch::nn::Linear(4 * 4 * 4, 2));
  torch::optim::SGD sgd(conv->parameters(), 0.1);
  mp::Trainer<P> trainer(conv, sgd);
  const auto x = torch::randn({2, 3, 6, 6});
  const auto before = test::snapshot(conv->parameters());
  CHECK_THROWS_WITH_AS(trainer.step([&] { return conv->forward(x).sum(); }),
                       doctest::Contains("trainer.cast_input(x)"), mp::Error);
  CHECK_THROWS_WITH_AS(trainer.evaluate([&] { return conv->forward(x); }),
                       doctest::Contains("trainer.cast_input(x)"), mp::Error);
  CHECK(test::identical(test::snapshot(conv->parameters()), before));
  Run<P> run;
  CHECK_THROWS_WITH_AS(run.trainer.step([&] { return run.net->forward(run.data.xs(0)).sum(); }),
                       doctest::Contains("two dtypes (fp32 and BFloat16?)"), mp::Error);
  CHECK(run.step(0).stepped());  // with cast_input it trains
}

TEST_CASE("a second Trainer on a model an earlier Trainer cast says so, not 'drop the ->to()'") {
  auto net = (torch::manual_seed(3), std::make_shared<Mlp>());
  {
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    mp::Trainer<mp::MixedO2<at::BFloat16>> first(net, opt);
  }
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  CHECK_THROWS_WITH_AS((mp::Trainer<mp::MixedO2<at::BFloat16>>(net, opt)),
                       doctest::Contains("an earlier Trainer<MixedO2<BFloat16>> cast this model"),
                       mp::Error);
  // A model the user cast is still told to drop the cast.
  auto own = std::make_shared<Mlp>();
  own->to(at::kBFloat16);
  torch::optim::AdamW own_opt(own->parameters(), torch::optim::AdamWOptions(1e-2));
  CHECK_THROWS_WITH_AS((mp::Trainer<mp::MixedO2<at::BFloat16>>(own, own_opt)),
                       doctest::Contains("drop the ->to(BFloat16)"), mp::Error);
}

namespace {
struct MyAdamW : torch::optim::AdamW {
  using torch::optim::AdamW::AdamW;
};
}  // namespace

namespace {

// The pure-bf16 habit: cast the model, then build the optimizer (torchao's bf16 AdamW wants it
// so). PureHalf keeps nothing but the Low weights, so both starts are the same state.
template <class P>
void check_takes_low_model() {
  auto train = [](bool built_low) {
    auto net = (torch::manual_seed(3), std::make_shared<Mlp>());
    if (built_low) net->to(P::low_dtype);
    // eps 1e-4: PureHalf<Half> keeps AdamW's state in fp16, where 1e-8 is 0 (an Error).
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2).eps(1e-4));
    mp::Trainer<P> trainer(net, opt);
    Data data;
    const auto first = test::snapshot(net->parameters());
    std::int64_t stepped = 0;
    for (std::int64_t i = 0; i < 6; ++i) {
      stepped += trainer.step([&] {
        return torch::nn::functional::cross_entropy(
            net->forward(trainer.cast_input(data.xs(i))).to(torch::kFloat), data.ys(i));
      }).stepped();
    }
    return std::make_tuple(test::snapshot(net->parameters()), stepped, first);
  };
  const auto [cast, cast_steps, cast_first] = train(false);
  const auto [low, low_steps, low_first] = train(true);
  INFO("largest difference ", test::max_abs_diff(low, cast), "; steps applied ", low_steps, " and ",
       cast_steps);
  CHECK(test::identical(low, cast));
  CHECK(low_steps == cast_steps);
  CHECK(low_steps > 0);
  CHECK_FALSE(test::identical(low, low_first));  // it trained
  CHECK(low[0].scalar_type() == P::low_dtype);
}

}  // namespace

TEST_CASE_TEMPLATE("PureHalf takes a model built in its Low dtype (model.to(torch.bfloat16)) as the fp32 one it casts",
                   P, mp::PureHalf<at::BFloat16>, mp::PureHalf<at::BFloat16, mp::StochasticRounding<>>) {
  check_takes_low_model<P>();
}

TEST_CASE("PureHalf<Half> takes a model built in fp16 as the fp32 one it casts" *
          doctest::skip(!mp::cpu_half_math)) {
  check_takes_low_model<mp::PureHalf<at::Half>>();
}

TEST_CASE("cast_floating casts as Python's model.to(torch.bfloat16): integer buffers stay, identities are kept") {
  torch::nn::Sequential net(torch::nn::Embedding(10, 4), torch::nn::BatchNorm1d(4));
  net->register_buffer("position_ids", torch::arange(6));
  const auto weight = net[0]->as<torch::nn::Embedding>()->weight;
  const auto tracked = net[1]->as<torch::nn::BatchNorm1d>()->num_batches_tracked;
  mp::cast_floating(*net, at::kBFloat16);
  CHECK(weight.scalar_type() == at::kBFloat16);  // the same tensor, cast in place
  CHECK(net[1]->as<torch::nn::BatchNorm1d>()->running_mean.scalar_type() == at::kBFloat16);
  CHECK(tracked.scalar_type() == at::kLong);
  CHECK(net->named_buffers()["position_ids"].scalar_type() == at::kLong);
  // LibTorch's own to(dtype), for contrast: the integer buffers too.
  net->to(at::kBFloat16);
  CHECK(net->named_buffers()["position_ids"].scalar_type() == at::kBFloat16);
  CHECK_THROWS_WITH_AS(mp::cast_floating(*net, at::kLong), doctest::Contains("not a floating-point"),
                       mp::Error);
}

TEST_CASE("a Low model PureHalf cannot take is an Error that changes nothing: another Low dtype, a module mapped to fp32") {
  auto half = std::make_shared<Mlp>();
  half->to(at::kHalf);
  torch::optim::AdamW half_opt(half->parameters(), torch::optim::AdamWOptions(1e-2));
  CHECK_THROWS_WITH_AS((mp::Trainer<mp::PureHalf<at::BFloat16>>(half, half_opt)),
                       doctest::Contains("expects an fp32 model"), mp::Error);
  // MixedO2 would make its masters from the rounded values: still refused (test_trainer.cpp).
  auto mapped = std::make_shared<MappedMlp>();
  mapped->to(at::kBFloat16);
  mp::apply_precision_map<mp::PureHalf<at::BFloat16>>(mapped, mp::PrecisionMap().keep_fp32("fc2"));
  const auto before = test::snapshot(mapped->parameters());
  torch::optim::AdamW opt(mapped->parameters(), torch::optim::AdamWOptions(1e-2));
  CHECK_THROWS_WITH_AS((mp::Trainer<mp::PureHalf<at::BFloat16>>(mapped, opt)),
                       doctest::Contains("parameter 'fc2.weight' is BFloat16, but its module "
                                         "trains in fp32"), mp::Error);
  CHECK(test::identical(test::snapshot(mapped->parameters()), before));
  CHECK(mapped->fc2->inner()->weight.scalar_type() == at::kBFloat16);
  // Built in fp32 where the map says, the rest in bf16: taken.
  mapped->fc2->to(at::kFloat);
  mp::Trainer<mp::PureHalf<at::BFloat16>> trainer(mapped, opt);
  CHECK(mapped->fc1->weight.scalar_type() == at::kBFloat16);
  CHECK(mapped->fc2->inner()->weight.scalar_type() == at::kFloat);
}

TEST_CASE("the fused-optimizer Error names the optimizer's type readably" *
          doctest::skip(!mp::fused_adam_available)) {
  auto net = std::make_shared<Mlp>();
  MyAdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  std::string message;
  try {
    mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(net, opt,
                                                    mp::TrainerOptions().fused_optimizer(true));
  } catch (const mp::Error& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(message.find("(anonymous namespace)::MyAdamW") != std::string::npos);
  CHECK(message.find("7MyAdamW") == std::string::npos);  // not the mangled N12_GLOBAL__N_17MyAdamWE
}

}  // namespace test_trainer_habits
