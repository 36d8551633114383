// mixprec::advise: per-layer verdicts from fp32 steps, the loss-scale range, the recommended
// policy, that the model is left as it was, and its precision map trained under MixedO2<Half>.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

namespace test_advise {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

// fc1 -> BatchNorm -> relu -> big -> out. `big` multiplies by `gain` and `out` divides by it:
// fp32 is fine whatever the gain; fp16 is not once big's outputs pass 65504.
struct Engineered : torch::nn::Module {
  explicit Engineered(double gain) {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    norm = register_module("norm", torch::nn::BatchNorm1d(8));
    big = register_module("big", torch::nn::Linear(8, 8));
    out = register_module("out", torch::nn::Linear(8, 3));
    torch::NoGradGuard no_grad;
    big->weight.mul_(gain);
    big->bias.mul_(gain);
    out->weight.div_(gain);
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(norm->forward(fc1->forward(x)));
    h = big->forward(h);
    mp::NamedScope scope("head");
    return out->forward(h) * 2;  // the multiplication reads no parameter: named by the scope
  }
  torch::nn::Linear fc1{nullptr}, big{nullptr}, out{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};

const mp::LayerAdvice& layer(const mp::Advice& advice, const std::string& name) {
  for (const auto& l : advice.layers) {
    if (l.name == name) return l;
  }
  FAIL("no layer " << name);
  return advice.layers.front();
}

std::vector<std::string> names(const mp::Advice& advice) {
  std::vector<std::string> result;
  for (const auto& l : advice.layers) result.push_back(l.name);
  return result;
}

struct Batch {
  at::Tensor x, y;
};

Batch batch(std::int64_t i) {
  torch::manual_seed(100 + static_cast<std::uint64_t>(i));
  return {torch::randn({16, 6}), torch::randint(0, 3, {16})};
}

}  // namespace

TEST_CASE("advise: a layer beyond fp16's range is kept in fp32, and Half is refused for bf16") {
  torch::manual_seed(0);
  auto model = std::make_shared<Engineered>(1e5);
  std::int64_t calls = 0;
  auto loss_fn = [&] {
    const auto b = batch(calls++);
    return torch::nn::functional::cross_entropy(model->forward(b.x), b.y);
  };
  const auto advice = mp::advise(model, loss_fn);
  CHECK(calls == 3);
  CHECK(advice.steps == 3);
  // The batch's own ops (randn) are not the model's; the loss is.
  CHECK(names(advice) == std::vector<std::string>{"fc1", "norm", "aten::relu", "big", "out", "head",
                                                  "aten::cross_entropy_loss"});
  const auto big = layer(advice, "big");  // a copy: GCC 13 suspects a dangling reference
  CHECK_FALSE(big.fp16);
  CHECK(big.bf16);
  CHECK(big.activation_max > 65504);
  CHECK(big.fp16_reason.find("beyond fp16's 65504") != std::string::npos);
  CHECK(layer(advice, "fc1").fp16);
  CHECK(layer(advice, "norm").fp16);
  CHECK(layer(advice, "head").activation_max > 0);   // out's output times 2
  CHECK(layer(advice, "out").activation_max < 1e3);  // back in range
  CHECK(advice.keep_fp32(at::kHalf) == std::vector<std::string>{"big"});
  CHECK(advice.keep_fp32(at::kBFloat16).empty());
  CHECK(advice.fp32_finite);
  CHECK_FALSE(advice.fp16_safe);
  CHECK(advice.bf16_safe);
  CHECK(advice.recommended == "MixedO2<BFloat16>");
  CHECK_FALSE(advice.accepts<mp::MixedO2<at::Half>>());
  CHECK_FALSE(advice.accepts<mp::MixedO1<at::Half>>());
  CHECK_FALSE(advice.accepts<mp::PureHalf<at::Half>>());
  CHECK(advice.accepts<mp::MixedO2<at::BFloat16>>());
  CHECK(advice.accepts<mp::FullPrecision>());
  CHECK_THROWS_WITH_AS(advice.require<mp::MixedO2<at::Half>>(),
                       doctest::Contains("MixedO2<Half> is not safe for this model: layer 'big'"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(advice.require<mp::MixedO2<at::Half>>(),
                       doctest::Contains("Recommended: MixedO2<BFloat16>"), mp::Error);
  advice.require<mp::MixedO2<at::BFloat16>>();
  std::ostringstream text;
  text << advice;
  CHECK(text.str().find("keep big in fp32 under fp16") != std::string::npos);
  CHECK(text.str().find("recommended: MixedO2<BFloat16>") != std::string::npos);
}

TEST_CASE("advise: a model that fits fp16, the loss-scale range it reports, nothing changed") {
  torch::manual_seed(1);
  auto model = std::make_shared<Engineered>(1.0);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  const auto first = batch(0);
  auto loss_fn = [&] { return torch::nn::functional::cross_entropy(model->forward(first.x), first.y); };
  loss_fn().backward();  // gradients the user has: advise() must leave them
  std::vector<at::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
  const auto params = test::snapshot(model->parameters());
  const auto buffers = test::snapshot(model->buffers());
  torch::manual_seed(7);
  const auto expected_random = torch::rand({4});
  torch::manual_seed(7);

  const auto advice = mp::advise(model, loss_fn, mp::AdviseOptions().steps(2));
  CHECK(torch::equal(torch::rand({4}), expected_random));  // the RNG is where it was
  CHECK(test::identical(params, test::snapshot(model->parameters())));
  CHECK(test::identical(buffers, test::snapshot(model->buffers())));  // BatchNorm's statistics
  std::vector<at::Tensor> after;
  for (const auto& p : model->parameters()) after.push_back(p.grad());
  CHECK(test::identical(grads, after));

  CHECK(advice.fp16_safe);
  CHECK(advice.bf16_safe);
  CHECK(advice.keep_fp32(at::kHalf).empty());
  CHECK(advice.accepts<mp::MixedO2<at::Half>>());
  CHECK(advice.recommended == "MixedO2<BFloat16>");  // on the CPU
  REQUIRE(advice.init_scale_max > 0);
  CHECK(advice.init_scale_min <= advice.init_scale);
  CHECK(advice.init_scale <= advice.init_scale_max);
  CHECK(std::exp2(std::round(std::log2(advice.init_scale_max))) == advice.init_scale_max);
  // The upper bound is the largest power of two at which the largest gradient stays in fp16.
  double gmax = 0;
  for (const auto& l : advice.layers) gmax = std::max(gmax, l.gradient_max);
  CHECK(gmax * advice.init_scale_max * 8 <= 65504);  // headroom 8
  CHECK(gmax * advice.init_scale_max * 16 > 65504);

  if constexpr (mp::cpu_half_math) {
    // What the range says, in fp16: the same step at init_scale_max goes through; at 16 times
    // that, past the headroom of 8, the largest gradient itself overflows and the step is
    // skipped.
    for (const double factor : {1.0, 16.0}) {
      CAPTURE(factor);
      auto copy = std::make_shared<Engineered>(1.0);
      {
        torch::NoGradGuard no_grad;
        auto from = model->parameters();
        auto to = copy->parameters();
        for (std::size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
      }
      torch::optim::SGD sgd(copy->parameters(), torch::optim::SGDOptions(0.1));
      mp::Trainer<mp::MixedO2<at::Half>> trainer(
          copy, sgd,
          mp::TrainerOptions().scaler(mp::GradScalerOptions().init_scale(advice.init_scale_max * factor)));
      const auto report = trainer.step([&] {
        return torch::nn::functional::cross_entropy(copy->forward(trainer.cast_input(first.x)), first.y);
      });
      CHECK(report.stepped() == (factor == 1.0));
    }
  }
}

TEST_CASE("advise: activations that fp16 flushes to zero, and an fp32 run that is not finite") {
  SUBCASE("tiny outputs") {
    torch::manual_seed(2);
    auto model = std::make_shared<Engineered>(1e-9);  // big's outputs are about 1e-9
    const auto b = batch(0);
    const auto advice = mp::advise(model, [&] {
      return torch::nn::functional::cross_entropy(model->forward(b.x), b.y);
    });
    const auto big = layer(advice, "big");  // a copy: GCC 13 suspects a dangling reference
    CHECK_FALSE(big.fp16);
    CHECK(big.fp16_reason.find("below fp16's 2^-24") != std::string::npos);
    CHECK(big.activation_tiny > 0.5);
    CHECK(big.bf16);
    CHECK(advice.recommended == "MixedO2<BFloat16>");
  }
  SUBCASE("inf in fp32") {
    torch::manual_seed(3);
    auto model = std::make_shared<Engineered>(1e30);  // big's outputs are about 1e30
    {
      torch::NoGradGuard no_grad;
      model->out->weight.fill_(1e10);  // 8 * 1e30 * 1e10 is inf in fp32
    }
    const auto b = batch(0);
    const auto advice = mp::advise(model, [&] {
      return torch::nn::functional::cross_entropy(model->forward(b.x), b.y);
    });
    CHECK_FALSE(advice.fp32_finite);
    CHECK(advice.recommended == "FullPrecision");
    CHECK_FALSE(advice.accepts<mp::MixedO2<at::BFloat16>>());
    CHECK_FALSE(advice.accepts<mp::FullPrecision>());
    CHECK(advice.reasons.front().find("fp32 run itself produced inf/NaN") != std::string::npos);
  }
}

TEST_CASE("advise: bad input is an Error that leaves the model as it was") {
  torch::manual_seed(4);
  auto model = std::make_shared<Engineered>(1.0);
  const auto b = batch(0);
  auto loss_fn = [&] { return torch::nn::functional::cross_entropy(model->forward(b.x), b.y); };
  const auto params = test::snapshot(model->parameters());
  const auto buffers = test::snapshot(model->buffers());
  CHECK_THROWS_WITH_AS(mp::advise(model, loss_fn, mp::AdviseOptions().steps(0)),
                       doctest::Contains("steps must be >= 1"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::advise(model, loss_fn, mp::AdviseOptions().headroom(0.5)),
                       doctest::Contains("headroom must be finite and >= 1"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::advise(model, loss_fn, mp::AdviseOptions().underflow_tolerance(1.0)),
                       doctest::Contains("underflow_tolerance must be in [0, 1)"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::advise(model, [&] { return model->forward(b.x); }),
                       doctest::Contains("must return a scalar loss"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::advise(model, [&] { return loss_fn().detach(); }),
                       doctest::Contains("must return a scalar loss"), mp::Error);
  {
    mp::NonFiniteOpFinder finder;
    CHECK_THROWS_WITH_AS(mp::advise(model, loss_fn), doctest::Contains("already active"),
                         mp::Error);
  }
  CHECK(test::identical(params, test::snapshot(model->parameters())));
  CHECK(test::identical(buffers, test::snapshot(model->buffers())));
  for (const auto& p : model->parameters()) CHECK_FALSE(p.grad().defined());
  CHECK_THROWS_WITH_AS(mp::advise(std::shared_ptr<torch::nn::Module>(), loss_fn),
                       doctest::Contains("null model"), mp::Error);
  // After a Trainer has cast the model, it is not the fp32 model any more.
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, optimizer);
  CHECK_THROWS_WITH_AS(mp::advise(model, loss_fn), doctest::Contains("call it before a Trainer"),
                       mp::Error);
}

namespace {

// The engineered model with the modules a precision map may change declared Mappable: the same
// initialisation, parameter names and forward as Engineered.
struct MappableEngineered : torch::nn::Module {
  explicit MappableEngineered(double gain) {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    norm = register_module("norm", torch::nn::BatchNorm1d(8));
    big = register_module("big", mp::nn::Mappable<torch::nn::Linear>(8, 8));
    out = register_module("out", mp::nn::Mappable<torch::nn::Linear>(8, 3));
    torch::NoGradGuard no_grad;
    big->inner()->weight.mul_(gain);
    big->inner()->bias.mul_(gain);
    out->inner()->weight.div_(gain);
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(norm->forward(fc1->forward(x)));
    h = big->forward(h);
    mp::NamedScope scope("head");
    return out->forward(h) * 2;
  }
  torch::nn::Linear fc1{nullptr};
  mp::nn::Mappable<torch::nn::Linear> big{nullptr}, out{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};

struct Run {
  std::vector<double> losses;  // of the steps taken
  std::vector<std::int64_t> stepped;  // their batches
  int skipped = 0;
};

template <class P>
Run train_engineered(const mp::PrecisionMap* map, double init_scale,
                     const std::vector<std::int64_t>& batches) {
  torch::manual_seed(0);
  auto model = std::make_shared<MappableEngineered>(1e5);
  // out's weights are 1e5 times smaller than usual and its gradients 1e5 times larger: no one
  // learning rate trains it and the rest alike. Frozen, it keeps the range it was built for.
  for (auto& p : model->out->parameters()) p.requires_grad_(false);
  if (map != nullptr) mp::apply_precision_map<P>(model, *map);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  auto options = mp::TrainerOptions().max_consecutive_skips(0);
  if constexpr (std::is_same_v<typename P::scaler_type, mp::GradScaler>) {
    options.scaler(mp::GradScalerOptions().init_scale(init_scale));
  }
  mp::Trainer<P> trainer(model, optimizer, options);
  Run run;
  for (const auto i : batches) {
    const auto b = batch(i);
    const auto report = trainer.step([&] {
      return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(b.x)), b.y);
    });
    if (report.status == mp::StepStatus::skipped) {
      ++run.skipped;
    } else {
      run.losses.push_back(report.loss.template item<double>());
      run.stepped.push_back(i);
    }
  }
  return run;
}

}  // namespace

TEST_CASE("advise -> precision map -> train: MixedO2<Half> skips every step of the engineered "
          "model, and trains it as FullPrecision with advise's map" *
          doctest::skip(!mp::cpu_half_math)) {
  torch::manual_seed(0);
  auto probe = std::make_shared<MappableEngineered>(1e5);
  const auto advice = mp::advise(probe, [&] {
    const auto b = batch(0);
    return torch::nn::functional::cross_entropy(probe->forward(b.x), b.y);
  });
  CHECK(advice.keep_fp32(at::kHalf) == std::vector<std::string>{"big"});
  const auto map = advice.precision_map(at::kHalf);
  // big's outputs (about 1e5) stay fp32 into out, its reader, which hands fp16-sized values on.
  REQUIRE(map.rules().size() == 2);
  CHECK(map.rules()[0].pattern == "big");
  CHECK(map.rules()[0].output == mp::Output::own);
  CHECK(map.rules()[1].pattern == "out");
  CHECK(map.rules()[1].output == mp::Output::surroundings);
  CHECK(advice.precision_map(at::kBFloat16).empty());  // bf16 holds it all

  constexpr int steps = 40;
  constexpr double init_scale = 65536.0;  // PyTorch's
  std::vector<std::int64_t> batches(steps);
  for (int i = 0; i < steps; ++i) batches[static_cast<std::size_t>(i)] = i % 4;
  const auto unmapped = train_engineered<mp::MixedO2<at::Half>>(nullptr, init_scale, batches);
  CHECK(unmapped.skipped == steps);  // big's fp16 outputs overflow, whatever the loss scale
  const auto mapped = train_engineered<mp::MixedO2<at::Half>>(&map, init_scale, batches);
  // The first steps back the scale off (fp16 gradients at big's input), as GradScaler does;
  // the fp32 reference trains on the batches of the steps taken.
  CHECK(mapped.skipped < steps / 3);
  const auto reference = train_engineered<mp::FullPrecision>(nullptr, 0.0, mapped.stepped);
  REQUIRE(mapped.losses.size() == reference.losses.size());
  REQUIRE(mapped.losses.size() > 4);
  double largest = 0.0;
  for (std::size_t i = 0; i < mapped.losses.size(); ++i) {
    largest = std::max(largest, std::abs(mapped.losses[i] - reference.losses[i]));
  }
  MESSAGE("MixedO2<Half> with advise's map vs FullPrecision, ", steps, " Adam steps: largest loss "
          "difference ", largest, " (losses ", reference.losses.front(), " to ",
          reference.losses.back(), "); skipped: ", mapped.skipped, " of ", steps, " (unmapped: ",
          unmapped.skipped, ")");
  CHECK(largest < 0.02);
  // It trains: the last loss on the batch of its first step is lower.
  std::size_t last = 0;
  for (std::size_t i = 0; i < mapped.stepped.size(); ++i) {
    if (mapped.stepped[i] == mapped.stepped.front()) last = i;
  }
  REQUIRE(last > 0);
  CHECK(mapped.losses[last] < mapped.losses.front());
}

}  // namespace test_advise
