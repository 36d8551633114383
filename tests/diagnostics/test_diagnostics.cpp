// Precision diagnostics: overflow provenance of skipped steps, the first non-finite op of a
// forward pass, gradient statistics against a hand count.
#include <mixprec/mixprec.hpp>

#include "scaled_policy.hpp"
#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace test_diagnostics {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// A block of two layers, a head, a tied copy of the head's weight and a frozen submodule: the
// shapes of model whose names the diagnostics must get right.
struct Block : torch::nn::Module {
  Block() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 8));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct Net : torch::nn::Module {
  Net() {
    block = register_module("block", std::make_shared<Block>());
    frozen = register_module("frozen", torch::nn::Linear(8, 8));
    head = register_module("head", torch::nn::Linear(8, 3));
    // The head's weight under a second name, listed after its first.
    tie = register_module("tie", std::make_shared<torch::nn::Module>());
    tie->register_parameter("weight", head->weight);
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(block->fc1->forward(x));
    h = torch::relu(block->fc2->forward(h));
    return head->forward(h + frozen->forward(h));
  }
  std::shared_ptr<Block> block;
  torch::nn::Linear frozen{nullptr}, head{nullptr};
  std::shared_ptr<torch::nn::Module> tie;
};

// Replaces the gradient of `p` by `value` everywhere while `armed` is set.
void poison_gradient(at::Tensor& p, const bool& armed, float value) {
  p.register_hook([&armed, value](const at::Tensor& grad) {
    return armed ? at::full_like(grad, value) : grad;
  });
}

template <class P>
void check_provenance(std::int64_t accumulation) {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<P> trainer(net, optimizer, mp::TrainerOptions().accumulation_steps(accumulation));
  const auto x = torch::randn({4, 6});
  const auto y = torch::randint(0, 3, {4});
  auto loss_fn = [&] {
    return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(x)), y);
  };
  bool armed = false;
  poison_gradient(net->block->fc2->weight, armed, std::nanf(""));
  poison_gradient(net->head->weight, armed, kInf);

  for (std::int64_t i = 0; i < accumulation; ++i) {  // a clean step: no provenance
    const auto report = trainer.step(loss_fn);
    CHECK_FALSE(report.overflow.has_value());
  }
  const auto before = test::snapshot(net->parameters());
  mp::StepReport report;
  for (std::int64_t i = 0; i < accumulation; ++i) {
    armed = i + 1 == accumulation;  // the last micro-batch only
    report = trainer.step(loss_fn);
  }
  armed = false;
  REQUIRE(report.status == mp::StepStatus::skipped);
  REQUIRE(report.overflow.has_value());
  CHECK_FALSE(report.overflow->loss);
  CHECK_FALSE(report.overflow->other_rank);
  // Model order, first names: the head's weight is "head.weight", not "tie.weight".
  CHECK(report.overflow->params == std::vector<std::string>{"block.fc2.weight", "head.weight"});
  CHECK(report.overflow->param_count == 2);
  CHECK(test::identical(before, test::snapshot(net->parameters())));
  std::ostringstream text;
  text << *report.overflow;
  CHECK(text.str() == "inf/NaN in the gradients of 2 parameters: block.fc2.weight, head.weight");

  // A NaN loss: the loss, and every trainable parameter's gradient.
  for (std::int64_t i = 0; i < accumulation; ++i) {
    report = trainer.step([&] { return loss_fn() * std::nanf(""); });
  }
  REQUIRE(report.overflow.has_value());
  CHECK(report.overflow->loss);
  CHECK(report.overflow->param_count == 6);  // block (4) and head (2); frozen has no gradient
  text.str("");
  text << *report.overflow;
  CHECK(text.str().starts_with("inf/NaN in the loss and in the gradients of 6 parameters: "
                               "block.fc1.weight, block.fc1.bias"));
  CHECK(trainer.stats().skipped_steps == 2);
}

}  // namespace

TEST_CASE("a skipped step names the parameters whose gradients held inf/NaN, and the loss") {
  SUBCASE("FullPrecision") { check_provenance<mp::FullPrecision>(1); }
  SUBCASE("MixedO1<BFloat16>") { check_provenance<mp::MixedO1<at::BFloat16>>(1); }
  SUBCASE("MixedO2<BFloat16>") { check_provenance<mp::MixedO2<at::BFloat16>>(1); }
  SUBCASE("MixedO2<BFloat16>, 3 micro-batches") { check_provenance<mp::MixedO2<at::BFloat16>>(3); }
  SUBCASE("PureHalf<BFloat16>") { check_provenance<mp::PureHalf<at::BFloat16>>(1); }
  SUBCASE("MixedO2<BFloat16> with a GradScaler") { check_provenance<test::ScaledO2>(1); }
  SUBCASE("MixedO2<BFloat16> with a GradScaler, 2 micro-batches") {
    check_provenance<test::ScaledO2>(2);
  }
}

TEST_CASE("overflow provenance names the parameters of a param group added after construction") {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  // The head trains from the second step on (progressive unfreezing).
  torch::optim::SGD optimizer(net->block->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(net, optimizer);
  const auto x = torch::randn({4, 6});
  auto loss_fn = [&] { return net->forward(trainer.cast_input(x)).to(at::kFloat).pow(2).mean(); };
  CHECK(trainer.step(loss_fn).stepped());
  optimizer.add_param_group(torch::optim::OptimizerParamGroup(net->head->parameters()));
  bool armed = true;
  poison_gradient(net->head->bias, armed, kInf);
  const auto report = trainer.step(loss_fn);
  REQUIRE(report.overflow.has_value());
  CHECK(report.overflow->params == std::vector<std::string>{"head.bias"});
  CHECK(report.overflow->param_count == 1);
}

TEST_CASE("overflow provenance lists at most max_names parameters and counts them all") {
  torch::nn::Sequential net;
  for (int i = 0; i < 6; ++i) net->push_back(torch::nn::Linear(4, 4));
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::FullPrecision> trainer(net, optimizer,
                                         mp::TrainerOptions().max_grad_norm(1.0));
  const auto report = trainer.step([&] { return net->forward(torch::randn({2, 4})).sum() * kInf; });
  REQUIRE(report.overflow.has_value());
  CHECK(report.overflow->loss);
  CHECK(report.overflow->param_count == 12);
  REQUIRE(report.overflow->params.size() == mp::Overflow::max_names);
  CHECK(report.overflow->params.front() == "0.weight");
  CHECK(report.overflow->params.back() == "3.bias");
  std::ostringstream text;
  text << *report.overflow;
  CHECK(text.str().ends_with("3.weight, 3.bias, ..."));
}

TEST_CASE("overflow provenance: every gradient non-finite and a finite loss reads as the backward pass") {
  torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2));
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::FullPrecision> trainer(net, optimizer);
  const bool armed = true;
  for (auto& p : net->parameters()) poison_gradient(p, armed, kInf);
  const auto report = trainer.step([&] { return net->forward(torch::randn({2, 4})).sum(); });
  REQUIRE(report.overflow.has_value());
  CHECK(report.overflow->checked == 4);
  CHECK(report.overflow->param_count == 4);
  std::ostringstream text;
  text << *report.overflow;
  CHECK(text.str().starts_with("inf/NaN in the gradients of all 4 parameters (an overflow in the "
                               "backward pass"));
  CHECK(text.str().ends_with("0.weight, 0.bias, 1.weight, 1.bias"));
}

namespace {

// A layer whose fp32 output is finite but exceeds `Low`'s range: x * w with |x|, |w| large.
struct Overflowing : torch::nn::Module {
  explicit Overflowing(double magnitude) {
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 8));
    out = register_module("out", torch::nn::Linear(8, 2));
    torch::NoGradGuard no_grad;
    fc1->weight.fill_(1.0 / 4);
    fc1->bias.fill_(magnitude);  // fc1's outputs are about `magnitude`: finite in Low
    fc2->weight.fill_(magnitude);  // fc2's are magnitude^2 * 8: beyond Low's range
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h;
    {
      mp::NamedScope scope("fc1");
      h = fc1->forward(x);
    }
    {
      mp::NamedScope scope("fc2");
      h = fc2->forward(h);
    }
    mp::NamedScope scope("out");
    return out->forward(h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, out{nullptr};
};

template <class P>
void check_first_op(double magnitude) {
  auto net = std::make_shared<Overflowing>(magnitude);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
  mp::Trainer<P> trainer(net, optimizer, mp::TrainerOptions().find_non_finite_op(true));
  const auto x = torch::ones({3, 4});
  const auto report = trainer.step([&] { return net->forward(trainer.cast_input(x)).sum(); });
  REQUIRE(report.non_finite_op.has_value());
  const auto& op = *report.non_finite_op;
  CHECK(op.scope() == "fc2");
  CHECK(op.scopes == std::vector<std::string>{"fc2"});
  // The matmul of fc2's linear: where inf first appeared, not a later op that carried it.
  const bool matmul = op.op == "aten::addmm" || op.op == "aten::linear" || op.op == "aten::mm";
  CHECK_MESSAGE(matmul, op.op);
  REQUIRE_FALSE(op.outputs.empty());
  CHECK(op.outputs.front().non_finite > 0);
  CHECK(op.outputs.front().dtype == P::low_dtype);
  CHECK(report.status == mp::StepStatus::skipped);  // and the step did not go through
  std::ostringstream text;
  text << op;
  CHECK(text.str().find("scope 'fc2'") != std::string::npos);
  // Every output element overflowed: no range to print. Autocast's redispatch of the op to
  // itself is not an enclosing op.
  CHECK(text.str().find("] all inf/NaN; inputs") != std::string::npos);
#ifdef NDEBUG
  // Its inputs were finite, fc1's outputs about `magnitude` among them.
  CHECK(op.known_inputs);
  REQUIRE_FALSE(op.inputs.empty());
  double largest = 0;
  for (const auto& input : op.inputs) {
    CHECK(input.non_finite == 0);
    CHECK(input.dtype == P::low_dtype);
    largest = std::max(largest, input.max);
  }
  CHECK(largest >= 0.99 * magnitude);
#else
  // A build without NDEBUG (the sanitizer presets) does not read RecordFunction's inputs.
  CHECK_FALSE(op.known_inputs);
  CHECK(op.inputs.empty());
  CHECK(text.str().find("inputs unknown (build with -DNDEBUG to see them)") != std::string::npos);
#endif
  CHECK(std::find(op.within.begin(), op.within.end(), op.op) == op.within.end());
  MESSAGE(P::name << ": " << text.str());  // quoted in docs/diagnostics.md
}

}  // namespace

TEST_CASE("the first op whose output overflowed is named, with its scope and input ranges") {
  if constexpr (mp::cpu_half_math) {
    SUBCASE("MixedO2<Half>: 300 * 300 * 8 is beyond fp16's 65504") {
      check_first_op<mp::MixedO2<at::Half>>(300);
    }
    SUBCASE("MixedO1<Half>") { check_first_op<mp::MixedO1<at::Half>>(300); }
  }
  SUBCASE("MixedO2<BFloat16>: 1e20 * 1e20 * 8 is beyond bf16's 3.4e38") {
    check_first_op<mp::MixedO2<at::BFloat16>>(1e20);
  }
}

TEST_CASE("NonFiniteOpFinder: the origin, not the ops that carry it; nothing on a clean pass") {
  const auto x = torch::full({4}, 1e30F);
  {
    mp::NonFiniteOpFinder finder;
    auto y = torch::ones({4}) + 1;
    auto z = x * x;            // inf: 1e60 in fp32
    auto w = torch::exp(z) + y;
    CHECK(w.isinf().all().item<bool>());
    REQUIRE(finder.first().has_value());
    CHECK(finder.first()->op == "aten::mul");
    CHECK(finder.first()->scopes.empty());
#ifdef NDEBUG
    REQUIRE(finder.first()->inputs.size() == 2);
    CHECK(finder.first()->inputs[0].max == doctest::Approx(1e30));
#else
    CHECK_FALSE(finder.first()->known_inputs);  // see check_first_op
#endif
    CHECK(finder.first()->outputs[0].non_finite == 4);
  }
  {
    // A real model's forward and backward allocate (empty, resize) and pass buffers not yet
    // written through views (1.13's mm resolves the conjugate of its `out` first): uninitialised
    // memory is never reported. The allocator fills it with NaN, so that this is not chance.
    const test::NanFilledAllocations nan_filled;
    torch::manual_seed(1);
    torch::nn::Sequential model(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)),
                                torch::nn::BatchNorm2d(4), torch::nn::ReLU(),
                                torch::nn::Flatten(), torch::nn::Linear(4 * 6 * 6, 3),
                                torch::nn::Linear(3, 3));
    mp::NonFiniteOpFinder finder;
    auto out = model->forward(torch::randn({2, 1, 8, 8}));
    torch::nn::functional::cross_entropy(out, torch::tensor({0, 2})).backward();
    if (finder.first()) MESSAGE("reported: " << *finder.first());
    CHECK_FALSE(finder.first().has_value());
  }
  {
    // An inf made before the finder, seen through views inside it: the views did not make it.
    const auto made = torch::full({2, 3}, kInf);
    mp::NonFiniteOpFinder finder;
    auto seen = made.t().unsqueeze(0).expand({2, 3, 2}).resolve_conj().select(0, 1).unsqueeze(2);
    if (finder.first()) MESSAGE("reported: " << *finder.first());
    CHECK_FALSE(finder.first().has_value());
    // An op that writes is still found, in place too.
    auto copy = torch::zeros({2, 3});
    copy.mul_(made);
    REQUIRE(finder.first().has_value());
    CHECK(finder.first()->op == "aten::mul_");
    CHECK(finder.first()->in_place == finder.first()->known_inputs);  // unknown: see above
    CHECK(seen.isinf().all().item<bool>());  // (watched, but only the first op is kept)
  }
  {
    mp::NonFiniteOpFinder finder;
    CHECK_THROWS_WITH_AS(mp::NonFiniteOpFinder(),
                         doctest::Contains("already active on this thread"), mp::Error);
  }
  mp::NonFiniteOpFinder again;  // the thread is free once the first is gone
  CHECK_FALSE(again.first().has_value());
}

namespace {

// What fp16 makes of each value, counted one element at a time through c10::Half.
mp::GradientRange hand_count(const at::Tensor& scaled, double scale) {
  mp::GradientRange r;
  const auto values = scaled.to(at::kFloat).contiguous();
  const auto* data = values.data_ptr<float>();
  for (std::int64_t i = 0; i < values.numel(); ++i) {
    const float v = data[i];
    const float h = static_cast<float>(c10::Half(v));
    ++r.elements;
    if (v == 0) ++r.zeros;
    else if (h == 0) ++r.underflow;
    if (std::isnan(v) || std::isinf(h)) ++r.overflow;
    if (h != 0 && std::abs(h) < 6.103515625e-05F) ++r.subnormal;
    r.max_abs = std::isnan(v) || std::isnan(r.max_abs) ? std::nan("")
                                                       : std::max(r.max_abs, std::abs(double(v)));
  }
  r.max_abs /= scale;
  return r;
}

void check_same(const mp::GradientRange& got, const mp::GradientRange& want) {
  CHECK(got.elements == want.elements);
  CHECK(got.zeros == want.zeros);
  CHECK(got.underflow == want.underflow);
  CHECK(got.subnormal == want.subnormal);
  CHECK(got.overflow == want.overflow);
  if (std::isnan(want.max_abs)) {
    CHECK(std::isnan(got.max_abs));
  } else {
    CHECK(got.max_abs == doctest::Approx(want.max_abs).epsilon(1e-6));
  }
}

// Gradient values for every case of the count, around fp16's thresholds.
at::Tensor edge_values(std::int64_t rows, std::int64_t cols) {
  const std::vector<float> edges = {0.0F, 1e-9F, 2.9e-8F, 2.98023223876953125e-08F, 3.0e-8F,
                                    6e-8F, 1e-6F, 3e-5F, 1e-4F, 0.5F, -2.0F, 1000.0F,
                                    65504.0F, 65519.0F, 65520.0F, -1e6F, kInf, std::nanf("")};
  auto values = torch::randn({rows * cols}) * std::pow(10.0F, -4.0F);  // mostly small
  for (std::size_t i = 0; i < edges.size() && static_cast<std::int64_t>(i) < values.numel(); ++i) {
    values[static_cast<std::int64_t>(i)] = edges[i];
  }
  return values.reshape({rows, cols});
}

template <class P>
void check_gradient_stats() {
  torch::manual_seed(2);
  auto net = std::make_shared<Net>();
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
  mp::TrainerOptions options;
  options.gradient_stats(mp::GradientStatsOptions().every(2));
  if constexpr (std::is_same_v<typename P::scaler_type, mp::GradScaler>) {
    options.scaler(mp::GradScalerOptions().init_scale(1024));
  }
  mp::Trainer<P> trainer(net, optimizer, options);
  // The scaled gradient of block.fc1.weight is replaced by known values; the others are real.
  bool armed = true;
  const auto edges = edge_values(8, 6);
  auto& target = net->block->fc1->weight;
  target.register_hook([&](const at::Tensor& grad) {
    return armed ? edges.to(grad.scalar_type()) : grad;
  });
  const auto x = torch::randn({4, 6});
  const auto y = torch::randint(0, 3, {4});
  auto loss_fn = [&] {
    return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(x)), y);
  };
  const auto first = trainer.step(loss_fn);
  CHECK_FALSE(first.gradient_stats.has_value());
  CHECK_FALSE(trainer.stats().gradient_stats.has_value());
  const auto report = trainer.step(loss_fn);  // step 2 is counted
  REQUIRE(report.gradient_stats.has_value());
  const auto& stats = *report.gradient_stats;
  CHECK(stats.step == 2);
  CHECK(stats.scale == report.scale);
  std::vector<std::string> names;
  for (const auto& e : stats.entries) names.push_back(e.name);
  // Model order, each tensor once by its first name, the frozen ones left out.
  CHECK(names == std::vector<std::string>{"block.fc1.weight", "block.fc1.bias", "block.fc2.weight",
                                          "block.fc2.bias", "head.weight", "head.bias"});
  // The hook's values, in the dtype of the gradient it replaced (the model's).
  check_same(stats.entries.front(), hand_count(edges.to(target.scalar_type()), report.scale));
  CHECK(stats.entries.front().overflow >= 3);  // 65520 (fp32), -1e6, inf, NaN
  CHECK(stats.entries.front().underflow > 0);
  CHECK(trainer.stats().gradient_stats.has_value());
  CHECK(trainer.stats().gradient_stats->step == 2);
  // The step held inf/NaN: it was skipped and says where.
  CHECK(report.status == mp::StepStatus::skipped);
  REQUIRE(report.overflow.has_value());
  CHECK(report.overflow->params == std::vector<std::string>{"block.fc1.weight"});

  // Step 3 is not counted, step 4 is: with real gradients, as hooks see them (scaled), the
  // counts of every parameter match a hand count.
  armed = false;
  std::vector<at::Tensor> scaled(6);
  std::vector<at::Tensor> tensors;
  for (const auto& p : {net->block->fc1->weight, net->block->fc1->bias, net->block->fc2->weight,
                        net->block->fc2->bias, net->head->weight, net->head->bias}) {
    tensors.push_back(p);
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].register_hook([&scaled, i](const at::Tensor& grad) {
      scaled[i] = grad.detach().clone();
      return grad;
    });
  }
  CHECK_FALSE(trainer.step(loss_fn).gradient_stats.has_value());
  const auto fourth = trainer.step(loss_fn);
  REQUIRE(fourth.gradient_stats.has_value());
  REQUIRE(fourth.gradient_stats->entries.size() == 6);
  for (std::size_t i = 0; i < 6; ++i) {
    CAPTURE(i);
    check_same(fourth.gradient_stats->entries[i], hand_count(scaled[i], fourth.scale));
  }
}

}  // namespace

TEST_CASE("gradient statistics equal a hand count of what fp16 would hold") {
  SUBCASE("FullPrecision") { check_gradient_stats<mp::FullPrecision>(); }
  SUBCASE("MixedO1<BFloat16>") { check_gradient_stats<mp::MixedO1<at::BFloat16>>(); }
  SUBCASE("MixedO2<BFloat16> with a GradScaler at 1024") { check_gradient_stats<test::ScaledO2>(); }
  SUBCASE("PureHalf<BFloat16>") { check_gradient_stats<mp::PureHalf<at::BFloat16>>(); }
}

TEST_CASE("gradient statistics per module prefix sum their parameters' counts") {
  torch::manual_seed(3);
  auto net = std::make_shared<Net>();
  // lr 0: every trainer below sees the same gradients.
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.0));
  auto options = [](std::int64_t depth) {
    return mp::TrainerOptions().gradient_stats(mp::GradientStatsOptions().every(1).group_depth(depth));
  };
  const auto x = torch::randn({4, 6});
  auto loss_fn = [&] { return net->forward(x).square().mean(); };
  mp::GradientStats per_param, per_module, per_layer;
  {
    mp::Trainer<mp::FullPrecision> trainer(net, optimizer, options(0));
    per_param = *trainer.step(loss_fn).gradient_stats;
  }
  {
    mp::Trainer<mp::FullPrecision> trainer(net, optimizer, options(1));
    per_module = *trainer.step(loss_fn).gradient_stats;
  }
  {
    mp::Trainer<mp::FullPrecision> trainer(net, optimizer, options(2));
    per_layer = *trainer.step(loss_fn).gradient_stats;
  }
  REQUIRE(per_param.entries.size() == 6);
  REQUIRE(per_module.entries.size() == 2);
  CHECK(per_module.entries[0].name == "block");
  CHECK(per_module.entries[1].name == "head");
  std::int64_t block_elements = 0, block_zeros = 0;
  double block_max = 0;
  for (std::size_t i = 0; i < 4; ++i) {
    block_elements += per_param.entries[i].elements;
    block_zeros += per_param.entries[i].zeros;
    block_max = std::max(block_max, per_param.entries[i].max_abs);
  }
  CHECK(per_module.entries[0].elements == block_elements);
  CHECK(per_module.entries[0].zeros == block_zeros);
  CHECK(per_module.entries[0].max_abs == block_max);
  CHECK(per_module.entries[1].elements == 8 * 3 + 3);
  std::vector<std::string> layers;
  for (const auto& e : per_layer.entries) layers.push_back(e.name);
  CHECK(layers == std::vector<std::string>{"block.fc1", "block.fc2", "head"});
  std::ostringstream text;
  text << per_layer;
  CHECK(text.str().find("block.fc2") != std::string::npos);
  CHECK(mp::detail::name_prefix("weight", 1) == "(model)");
  CHECK(mp::detail::name_prefix("a.b.c.weight", 2) == "a.b");
  CHECK(mp::detail::name_prefix("a.b.c.weight", 5) == "a.b.c");
}

TEST_CASE("GradientStatsOptions out of range are an Error that changes nothing") {
  auto net = std::make_shared<Net>();
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
  const auto before = test::snapshot(net->parameters());
  CHECK_THROWS_WITH_AS(
      mp::Trainer<mp::MixedO2<at::BFloat16>>(
          net, optimizer, mp::TrainerOptions().gradient_stats(mp::GradientStatsOptions().every(-1))),
      doctest::Contains("every and group_depth must be >= 0"), mp::Error);
  CHECK_THROWS_WITH_AS(
      mp::Trainer<mp::MixedO2<at::BFloat16>>(
          net, optimizer,
          mp::TrainerOptions().gradient_stats(mp::GradientStatsOptions().every(1).group_depth(-2))),
      doctest::Contains("group_depth"), mp::Error);
  CHECK(test::identical(before, test::snapshot(net->parameters())));
  // The model is not claimed: a Trainer can still be made.
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(net, optimizer);
  CHECK(trainer.master_weights().size() == 8);
}

}  // namespace test_diagnostics
