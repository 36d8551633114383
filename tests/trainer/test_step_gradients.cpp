// What on_step sees of a step's gradients (Trainer::gradients(), trainer/step_gradients.hpp):
// under every policy, with accumulation, clipping and the fused steps, the gradient each model
// parameter was stepped with, unscaled, by its name, as Python's `p.grad` after
// `scaler.step(opt)`. The reference: the fp32 gradient of the same micro-batches at the same
// weights, averaged and clipped by the coefficient the step reported, from a plain LibTorch
// backward pass on an fp32 copy of the model. Data parallel's cases are in
// tests/distributed/test_distributed.cpp ("on_step_gradients").
#include <mixprec/mixprec.hpp>

#include "scaled_policy.hpp"
#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace test_step_gradients {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

using test::ScaledO2;

// The three kinds of model the gradients are read from: an MLP, a small convolutional net with
// BatchNorm (which MixedO2 keeps in fp32: its own master), an encoder block (LayerNorm,
// attention, GELU MLP).
struct GradMlp : torch::nn::Module {
  GradMlp() {
    fc1 = register_module("fc1", torch::nn::Linear(12, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  static at::Tensor input(torch::Generator& gen) { return torch::randn({8, 12}, gen); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct GradConvNet : torch::nn::Module {
  GradConvNet() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3)));
    norm = register_module("norm", torch::nn::BatchNorm2d(4));
    head = register_module("head", torch::nn::Linear(4 * 4 * 4, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    return head->forward(torch::relu(norm->forward(conv->forward(x))).flatten(1));
  }
  static at::Tensor input(torch::Generator& gen) { return torch::randn({8, 3, 6, 6}, gen); }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d norm{nullptr};
  torch::nn::Linear head{nullptr};
};

struct GradEncoder : torch::nn::Module {
  GradEncoder() {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    qkv = register_module("qkv", torch::nn::Linear(8, 24));
    proj = register_module("proj", torch::nn::Linear(8, 8));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    up = register_module("up", torch::nn::Linear(8, 16));
    down = register_module("down", torch::nn::Linear(16, 8));
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto parts = qkv->forward(ln1->forward(x)).chunk(3, -1);
    const auto scores = torch::matmul(parts[0], parts[1].transpose(1, 2)) / std::sqrt(8.0);
    auto h = x + proj->forward(torch::matmul(torch::softmax(scores, -1), parts[2]));
    h = h + down->forward(torch::gelu(up->forward(ln2->forward(h))));
    return head->forward(h.mean(1));
  }
  static at::Tensor input(torch::Generator& gen) { return torch::randn({8, 5, 8}, gen); }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, up{nullptr}, down{nullptr}, head{nullptr};
};

// The MLP with fp8 Linears (MixedFP8 computes them in fp8; elsewhere they are Linears).
struct GradFp8Mlp : torch::nn::Module {
  GradFp8Mlp() {
    fc1 = register_module("fc1", mp::nn::Float8Linear(12, 16));
    fc2 = register_module("fc2", mp::nn::Float8Linear(16, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  static at::Tensor input(torch::Generator& gen) { return torch::randn({8, 12}, gen); }
  mp::nn::Float8Linear fc1{nullptr}, fc2{nullptr};
};

// How a run is set up.
struct GradConfig {
  std::int64_t accumulation = 1;
  std::optional<double> clip;  // small enough to clip: the coefficient shows
  bool fused = false;
};

template <class P>
constexpr bool fused_ok = mp::fused_adam_available && (!P::cast_model || P::master_weights);

// The dtype of what P steps: fp32 masters under MixedO2, the Low weights under PureHalf.
template <class P>
constexpr at::ScalarType stepped_dtype = P::cast_model && !P::master_weights ? P::low_dtype
                                                                             : at::kFloat;

// A tolerance by how P computes, for the whole gradient (all tensors together): fp32 to its
// rounding, fp16 and bf16 by their precision (the forward and backward in Low round activations
// and products). A tensor's own gradient may differ more where BatchNorm's backward cancels (a
// conv weight before it: 0.12 under bf16 and fp16 autocast here), so per tensor the bound is
// looser; a scale left in (1024, 65536), an average missed (2) or a clip missed (> 2) are far
// outside either.
template <class P>
double tolerance() {
  if constexpr (std::is_same_v<P, mp::FullPrecision>) {
    return 1e-5;
  } else {
    return P::low_dtype == at::kHalf ? 0.02 : 0.1;
  }
}
template <class P>
double tensor_tolerance() {
  return std::is_same_v<P, mp::FullPrecision> ? 1e-5 : 0.3;
}

// The reference: the fp32 gradient of `xs` at the model's current weights (fp32 values of the
// weights P computes with), averaged over the micro-batches; by name.
template <class Model>
std::map<std::string, at::Tensor> reference_gradients(const Model& model,
                                                      const std::vector<at::Tensor>& xs,
                                                      const std::vector<at::Tensor>& ys) {
  auto copy = std::make_shared<Model>();
  {
    torch::NoGradGuard no_grad;
    for (auto& item : copy->named_parameters()) {
      item.value().copy_(model.named_parameters()[item.key()].to(at::kFloat));
    }
    for (auto& item : copy->named_buffers()) {
      item.value().copy_(model.named_buffers()[item.key()].to(item.value().scalar_type()));
    }
  }
  for (std::size_t i = 0; i < xs.size(); ++i) {
    (torch::nn::functional::cross_entropy(copy->forward(xs[i]), ys[i]) /
     static_cast<double>(xs.size())).backward();
  }
  std::map<std::string, at::Tensor> grads;
  for (const auto& item : copy->named_parameters()) {
    if (item.value().grad().defined()) grads[item.key()] = item.value().grad();
  }
  return grads;
}

double total_norm(const std::map<std::string, at::Tensor>& grads) {
  double sum = 0;
  for (const auto& [name, g] : grads) sum += g.pow(2).sum().item<double>();
  return std::sqrt(sum);
}

// Trains 2 optimizer steps of `config` under P and checks, in each step-ending on_step, what
// gradients() gives against the reference. Returns the largest relative difference seen.
template <class P, class Model>
double check_gradients(const GradConfig& config, double tol = tolerance<P>(),
                       double tensor_tol = tensor_tolerance<P>()) {
  CAPTURE(P::name);
  CAPTURE(config.accumulation);
  CAPTURE(config.clip.has_value());
  CAPTURE(config.fused);
  auto model = (torch::manual_seed(4), std::make_shared<Model>());
  // eps 1e-4: PureHalf<Half> keeps AdamW's state in fp16, where 1e-8 is 0 (an Error).
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-3).eps(1e-4));
  auto gen = at::detail::createCPUGenerator(11);
  std::map<std::string, at::Tensor> reference;
  double worst = 0;
  int read = 0;
  mp::Trainer<P>* trainer_seen = nullptr;
  auto options = mp::TrainerOptions().accumulation_steps(config.accumulation).max_grad_norm(config.clip);
  if (config.fused) options.fused_optimizer(true);
  if constexpr (!std::is_same_v<typename P::scaler_type, mp::NoScaler>) {
    // fp16: 2^10 keeps the scaled gradients finite; bf16 (ScaledO2): PyTorch's 2^16.
    options.scaler(mp::GradScalerOptions().init_scale(P::low_dtype == at::kHalf ? 1024.0 : 65536.0));
  }
  options.on_step([&](const mp::StepReport& report) {
    auto& trainer = *trainer_seen;
    if (report.status == mp::StepStatus::accumulating) {
      CHECK_THROWS_WITH_AS(trainer.gradients(), doctest::Contains("no step's gradient yet"),
                           mp::Error);
      return;
    }
    REQUIRE(report.stepped());
    const auto grads = trainer.gradients();
    const double norm = total_norm(reference);
    double coefficient = 1.0;
    if (config.clip) {
      REQUIRE(report.grad_norm.has_value());
      CHECK(std::abs(*report.grad_norm - norm) <= tol * norm);
      coefficient = std::min(1.0, *config.clip / (*report.grad_norm + 1e-6));
      CHECK(coefficient < 0.5);  // the clip shows
    }
    CHECK(grads.size() == reference.size());
    double sum_diff = 0, sum_want = 0;
    for (const auto& [name, expected] : reference) {
      CAPTURE(name);
      const auto* got = grads.find(name);
      REQUIRE(got != nullptr);
      CHECK_FALSE(got->part);
      CHECK(got->value.scalar_type() ==
            (model->named_parameters()[name].scalar_type() == at::kFloat ? at::kFloat
                                                                         : stepped_dtype<P>));
      const auto want = expected * coefficient;
      const double diff = (got->value.to(at::kFloat) - want).norm().template item<double>();
      const double want_norm = want.norm().template item<double>();
      sum_diff += diff * diff;
      sum_want += want_norm * want_norm;
      // Relative to the tensor, with a floor of the whole gradient's size for the tensors whose
      // gradient is near 0 (a bias behind a BatchNorm).
      CHECK(diff / std::max(want_norm, 0.05 * norm * coefficient) <= tensor_tol);
      // The model's own .grad() is the step's gradient or none: none where a master was stepped
      // (not its scaled Low stand-in), and where the step divided as it read (the one-pass
      // lean step, clipping or scaling); the same values where the tensor was stepped as is.
      const at::Tensor param = model->named_parameters()[name];  // a copy: the dict is a temporary
      const at::Tensor own = param.grad();
      if (own.defined()) CHECK(test::identical(own.to(got->value.scalar_type()), got->value));
      if (P::master_weights && param.scalar_type() != at::kFloat) CHECK_FALSE(own.defined());
      if (!P::master_weights) CHECK(own.defined());
    }
    const double rel = std::sqrt(sum_diff / sum_want);
    worst = std::max(worst, rel);
    CHECK(rel <= tol);
    ++read;
  });
  mp::Trainer<P> trainer(model, adamw, options);
  trainer_seen = &trainer;
  for (int step = 0; step < 2; ++step) {
    std::vector<at::Tensor> xs, ys;
    for (std::int64_t i = 0; i < config.accumulation; ++i) {
      xs.push_back(Model::input(gen));
      ys.push_back(torch::randint(0, 3, {8}, gen, at::kLong));
    }
    reference = reference_gradients(*model, xs, ys);
    for (std::size_t i = 0; i < xs.size(); ++i) {
      trainer.step([&] {
        return torch::nn::functional::cross_entropy(
            model->forward(trainer.cast_input(xs[i])).to(at::kFloat), ys[i]);
      });
    }
  }
  CHECK(read == 2);
  // After step() returns the gradients are none: reading them is an Error.
  CHECK_THROWS_WITH_AS(trainer.gradients(), doctest::Contains("after step() returns"), mp::Error);
  return worst;
}

template <class P>
void check_policy() {
  double worst = 0;
  for (const std::int64_t accumulation : {1, 2}) {
    for (const bool clip : {false, true}) {
      for (const bool fused : {false, true}) {
        if (fused && !fused_ok<P>) continue;
        const GradConfig config{accumulation, clip ? std::optional<double>(0.05) : std::nullopt,
                                fused};
        worst = std::max(worst, check_gradients<P, GradMlp>(config));
        worst = std::max(worst, check_gradients<P, GradConvNet>(config));
        worst = std::max(worst, check_gradients<P, GradEncoder>(config));
      }
    }
  }
  MESSAGE(P::name, ": on_step's gradients() against the fp32 reference, largest relative "
          "difference ", worst, " (tolerance ", tolerance<P>(), ")");
}

}  // namespace

TEST_CASE_TEMPLATE("on_step's gradients(): the unscaled gradient each parameter was stepped "
                   "with, by name, under every policy (accumulation 1 and 2, clipping, fused)",
                   P, mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   ScaledO2, mp::PureHalf<at::BFloat16>,
                   mp::MixedO2<at::BFloat16, mp::RemainderMasters<>>,
                   mp::PureHalf<at::BFloat16, mp::StochasticRounding<>>) {
  check_policy<P>();
}

TEST_CASE_TEMPLATE("on_step's gradients() under the fp16 policies (loss-scaled)" *
                       doctest::skip(!mp::cpu_half_math),
                   P, mp::MixedO1<at::Half>, mp::MixedO2<at::Half>, mp::PureHalf<at::Half>) {
  check_policy<P>();
}

TEST_CASE("on_step's gradients() under MixedFP8 (tensorwise)" * doctest::skip(!mp::has_fp8)) {
  test::with_fp8([](auto recipe) {
    using P = mp::MixedFP8<decltype(recipe)>;
    // fp8 rounds the Linears' operands to 3 mantissa bits (e4m3; 2 for e5m2's gradients).
    double worst = 0;
    for (const std::int64_t accumulation : {1, 2}) {
      for (const bool clip : {false, true}) {
        const GradConfig config{accumulation, clip ? std::optional<double>(0.05) : std::nullopt,
                                false};
        worst = std::max(worst, check_gradients<P, GradFp8Mlp>(config, 0.15, 0.3));
      }
    }
    MESSAGE(P::name, ": largest relative difference ", worst);
  });
}

namespace {

// Two heads on one input: the loss of `b` is poisoned (times inf) on a step's last micro-batch,
// so that the step is skipped with `a`'s gradients finite.
struct TwoHeads : torch::nn::Module {
  TwoHeads() {
    a = register_module("a", torch::nn::Linear(12, 3));
    b = register_module("b", torch::nn::Linear(12, 3));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

template <class P>
void check_skipped(const GradConfig& config) {
  CAPTURE(P::name);
  CAPTURE(config.accumulation);
  CAPTURE(config.clip.has_value());
  CAPTURE(config.fused);
  auto model = (torch::manual_seed(4), std::make_shared<TwoHeads>());
  auto reference = std::make_shared<TwoHeads>();
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-3).eps(1e-4));
  auto options = mp::TrainerOptions().accumulation_steps(config.accumulation).max_grad_norm(config.clip);
  if (config.fused) options.fused_optimizer(true);
  if constexpr (!std::is_same_v<typename P::scaler_type, mp::NoScaler>) {
    options.scaler(mp::GradScalerOptions().init_scale(P::low_dtype == at::kHalf ? 1024.0 : 65536.0));
  }
  mp::Trainer<P>* trainer_seen = nullptr;
  int skipped = 0;
  options.on_step([&](const mp::StepReport& report) {
    if (report.status != mp::StepStatus::skipped) return;
    ++skipped;
    const auto grads = trainer_seen->gradients();
    // The head whose loss was inf: its gradient holds inf/NaN, as the step found.
    CHECK_FALSE(at::isfinite(grads["b.weight"].value).all().template item<bool>());
    // The other: unscaled (and not clipped: a skipped step applies no coefficient).
    for (const auto* name : {"a.weight", "a.bias"}) {
      CAPTURE(name);
      const auto& want = reference->named_parameters()[name].grad();
      const auto got = grads[name].value.to(at::kFloat);
      const double rel = (got - want).norm().template item<double>() / want.norm().template item<double>();
      CHECK(rel <= tolerance<P>());
    }
  });
  mp::Trainer<P> trainer(model, adamw, options);
  trainer_seen = &trainer;
  auto gen = at::detail::createCPUGenerator(5);
  {
    torch::NoGradGuard no_grad;
    for (auto& item : reference->named_parameters()) {
      item.value().copy_(model->named_parameters()[item.key()].to(at::kFloat));
    }
  }
  for (std::int64_t i = 0; i < config.accumulation; ++i) {
    const auto x = torch::randn({8, 12}, gen);
    const auto y = torch::randint(0, 3, {8}, gen, at::kLong);
    const bool poisoned = i + 1 == config.accumulation;
    (torch::nn::functional::cross_entropy(reference->a->forward(x), y) /
     static_cast<double>(config.accumulation)).backward();
    trainer.step([&] {
      const auto xs = trainer.cast_input(x);
      const auto loss = torch::nn::functional::cross_entropy(model->a->forward(xs).to(at::kFloat), y);
      const auto other = model->b->forward(xs).to(at::kFloat).sum() * 1e-3;
      return loss + (poisoned ? other * std::numeric_limits<double>::infinity() : other);
    });
  }
  CHECK(skipped == 1);
}

}  // namespace

TEST_CASE_TEMPLATE("on a skipped step, gradients() gives the gradients unscaled, inf/NaN where "
                   "the step found them", P, mp::FullPrecision, ScaledO2,
                   mp::MixedO2<at::BFloat16, mp::RemainderMasters<>>) {
  for (const std::int64_t accumulation : {1, 2}) {
    for (const bool clip : {false, true}) {
      for (const bool fused : {false, true}) {
        if (fused && !fused_ok<P>) continue;
        check_skipped<P>({accumulation, clip ? std::optional<double>(0.05) : std::nullopt, fused});
      }
    }
  }
}

TEST_CASE_TEMPLATE("... and under the fp16 policies" * doctest::skip(!mp::cpu_half_math), P,
                   mp::MixedO1<at::Half>, mp::MixedO2<at::Half>) {
  for (const std::int64_t accumulation : {1, 2}) {
    for (const bool clip : {false, true}) {
      for (const bool fused : {false, true}) {
        if (fused && !fused_ok<P>) continue;
        check_skipped<P>({accumulation, clip ? std::optional<double>(0.05) : std::nullopt, fused});
      }
    }
  }
}

}  // namespace test_step_gradients
