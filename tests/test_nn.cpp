// mixprec::nn::Conv2d: torch::nn::Conv2d's parameters and forward, bit for bit, and with
// fp32_weight_grad its fp16 weight gradient computed in fp32: checked against an fp64 reference
// and against LibTorch's own fp16 gradient, under MixedO2/PureHalf (fp16 tensors) and MixedO1
// (autocast); the Trainer's warning on a CPU whose fp16 weight gradients are slow.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <sstream>
#include <string>
#include <vector>

namespace mp = mixprec;

namespace {

struct Grads {
  at::Tensor output, input, weight, bias;
};

// One forward and backward of `conv` on `x` with the loss sum(output * probe).
template <class Conv>
Grads run(Conv& conv, const at::Tensor& x, const at::Tensor& probe) {
  auto input = x.detach().clone().requires_grad_(true);
  for (auto& p : conv->parameters()) p.mutable_grad() = at::Tensor();
  const auto out = conv->forward(input);
  (out.to(at::kFloat) * probe).sum().backward();
  return {out.detach(), input.grad(), conv->weight.grad(), conv->bias.grad()};
}

// Largest |a - b| relative to the largest |b|, in fp64.
double relative(const at::Tensor& a, const at::Tensor& b) {
  const auto bd = b.to(at::kDouble);
  return (a.to(at::kDouble) - bd).abs().max().item<double>() / bd.abs().max().item<double>();
}

const double kHalfEps = 1.0 / 1024;  // fp16's machine epsilon, 2^-10

torch::nn::Conv2dOptions conv_options(bool reflect) {
  auto o = torch::nn::Conv2dOptions(3, 6, 3).padding(1);
  if (reflect) o.padding_mode(torch::kReflect);
  return o;
}

struct Cnn : torch::nn::Module {
  Cnn() {
    conv1 = register_module("conv1", mp::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)));
    conv2 = register_module("conv2", mp::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3).padding(1)));
    fc = register_module("fc", torch::nn::Linear(4 * 8 * 8, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc->forward(torch::relu(conv2->forward(torch::relu(conv1->forward(x)))).flatten(1));
  }
  mp::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc{nullptr};
};

}  // namespace

TEST_CASE("nn::Conv2d is torch::nn::Conv2d: same initialisation, state_dict keys and forward") {
  torch::manual_seed(3);
  torch::nn::Conv2d plain(conv_options(false));
  torch::manual_seed(3);
  mp::nn::Conv2d ours(conv_options(false));
  CHECK(test::identical({plain->weight, plain->bias}, {ours->weight, ours->bias}));
  std::vector<std::string> a, b;
  for (const auto& item : plain->named_parameters()) a.push_back(item.key());
  for (const auto& item : ours->named_parameters()) b.push_back(item.key());
  CHECK(a == b);
  CHECK(ours->as<torch::nn::Conv2dImpl>() != nullptr);  // code that asks for a Conv2d finds one
  CHECK_FALSE(ours->fp32_weight_grad());
  torch::manual_seed(4);
  const auto x = torch::randn({2, 3, 8, 8});
  const auto probe = torch::randn({2, 6, 8, 8});
  const auto p = run(plain, x, probe);
  const auto o = run(ours, x, probe);
  CHECK(test::identical({p.output, p.input, p.weight, p.bias}, {o.output, o.input, o.weight, o.bias}));
  // fp32 and bf16 take torch's path even when the option is on: their weight gradients are fast.
  ours->fp32_weight_grad(true);
  const auto o2 = run(ours, x, probe);
  CHECK(test::identical({p.output, p.weight}, {o2.output, o2.weight}));
}

TEST_CASE("nn::Conv2d with fp32 weight gradients: fp16 forward and input gradient as LibTorch's, "
          "weight gradient within fp16 rounding of fp64" *
          doctest::skip(!mp::cpu_half_math)) {
  for (const bool reflect : {false, true}) {
    CAPTURE(reflect);
    torch::manual_seed(5);
    torch::nn::Conv2d plain(conv_options(reflect));
    plain->to(at::kHalf);
    mp::nn::Conv2d ours(conv_options(reflect));
    ours->to(at::kHalf);
    ours->weight.set_data(plain->weight.data().clone());
    ours->bias.set_data(plain->bias.data().clone());
    ours->fp32_weight_grad(true);
    torch::nn::Conv2d exact(conv_options(reflect));  // the fp64 reference on the same values
    exact->to(at::kDouble);
    exact->weight.set_data(plain->weight.data().to(at::kDouble));
    exact->bias.set_data(plain->bias.data().to(at::kDouble));

    torch::manual_seed(6);
    const auto x = torch::randn({4, 3, 12, 12}).to(at::kHalf);
    const auto probe = torch::randn({4, 6, 12, 12});
    const auto p = run(plain, x, probe);
    const auto o = run(ours, x, probe);
    const auto e = run(exact, x.to(at::kDouble), probe.to(at::kDouble));
    CHECK(o.weight.scalar_type() == at::kHalf);
    CHECK(o.bias.scalar_type() == at::kHalf);
    CHECK(test::identical({p.output}, {o.output}));
    const double input_diff = relative(o.input, p.input);
    const double ours_w = relative(o.weight, e.weight), plain_w = relative(p.weight, e.weight);
    const double ours_b = relative(o.bias, e.bias);
    MESSAGE("input gradient vs LibTorch's fp16: " << input_diff << "; weight gradient vs fp64: "
            << ours_w << " (LibTorch's fp16: " << plain_w << "); bias: " << ours_b);
    CHECK(input_diff <= kHalfEps);
    CHECK(ours_w <= kHalfEps);
    CHECK(ours_b <= kHalfEps);
    CHECK(ours_w <= plain_w + kHalfEps / 2);  // never worse than LibTorch's own beyond rounding
  }
}

TEST_CASE("nn::Conv2d with fp32 weight gradients under autocast (MixedO1<Half>)" *
          doctest::skip(!mp::cpu_half_math)) {
  torch::manual_seed(7);
  torch::nn::Conv2d plain(conv_options(false));
  mp::nn::Conv2d ours(conv_options(false));
  ours->weight.set_data(plain->weight.data().clone());
  ours->bias.set_data(plain->bias.data().clone());
  ours->fp32_weight_grad(true);
  const auto x = torch::randn({4, 3, 10, 10});
  const auto probe = torch::randn({4, 6, 10, 10});
  Grads p, o;
  {
    auto guard = mp::autocast<mp::MixedO1<at::Half>>(torch::kCPU);
    p = run(plain, x, probe);
    o = run(ours, x, probe);
  }
  CHECK(o.output.scalar_type() == at::kHalf);
  CHECK(o.weight.scalar_type() == at::kFloat);  // the fp32 parameter's gradient
  CHECK(o.input.scalar_type() == at::kFloat);
  CHECK(test::identical({p.output}, {o.output}));
  CHECK(relative(o.weight, p.weight) <= kHalfEps);
  CHECK(relative(o.input, p.input) <= kHalfEps);
}

TEST_CASE("a Trainer<MixedO2<Half>> trains a CNN with fp32 conv weight gradients as with fp16's" *
          doctest::skip(!mp::cpu_half_math)) {
  auto train = [](bool remedy) {
    torch::manual_seed(8);
    auto model = std::make_shared<Cnn>();
    CHECK(mp::nn::fp32_conv_weight_grads(*model, remedy) == 2);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    mp::Trainer<mp::MixedO2<at::Half>> trainer(model, sgd);
    torch::manual_seed(9);
    const auto x = torch::randn({16, 1, 8, 8});
    const auto y = torch::randint(0, 3, {16});
    std::vector<double> losses;
    for (int i = 0; i < 20; ++i) {
      auto report = trainer.step([&] {
        return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
      });
      losses.push_back(report.loss.item<double>());
    }
    return losses;
  };
  const auto plain = train(false), ours = train(true);
  double worst = 0;
  for (std::size_t i = 0; i < plain.size(); ++i) worst = std::max(worst, std::abs(plain[i] - ours[i]));
  MESSAGE("largest loss difference over 20 steps: " << worst);
  CHECK(ours.back() < ours.front() * 0.7);  // it learns
  CHECK(worst < 0.02);                      // and follows the fp16 run within its rounding
}

TEST_CASE("the Trainer warns once, through on_warning, of slow fp16 convolutions on such a CPU") {
  auto& override_caps = mp::detail::cpu_capabilities_override();
  mp::CpuCapabilities slow;
  slow.model = "Test Xeon";
  slow.avx512f = slow.avx512_fp16 = slow.amx_bf16 = true;
  slow.fp16_conv_weight_grad_slow = true;
  slow.fp16_conv_weight_grad_ratio = 200;
  override_caps = slow;
  std::vector<std::string> warnings;
  auto options = mp::TrainerOptions().on_warning([&](const std::string& w) { warnings.push_back(w); });
  auto build = [&](auto policy, bool remedy) {
    using P = decltype(policy);
    torch::manual_seed(10);
    auto model = std::make_shared<Cnn>();
    mp::nn::fp32_conv_weight_grads(*model, remedy);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05));
    mp::detail::slow_convolutions_warned() = false;
    if constexpr (P::low_dtype != at::kHalf || mp::cpu_half_math) {
      mp::Trainer<P> trainer(model, sgd, options);
    }
  };
  build(mp::MixedO2<at::BFloat16>{}, false);  // bf16 is fast on such a CPU
  CHECK(warnings.empty());
  build(mp::MixedO2<at::Half>{}, true);  // every convolution already computes in fp32
  CHECK(warnings.empty());
  if (mp::cpu_half_math) {
    build(mp::MixedO2<at::Half>{}, false);
    REQUIRE(warnings.size() == 1);
    CHECK(warnings[0].find("2 convolutions (conv1, conv2)") != std::string::npos);
    CHECK(warnings[0].find("Test Xeon") != std::string::npos);
    CHECK(warnings[0].find("mixprec::nn::fp32_conv_weight_grads") != std::string::npos);
    CHECK(warnings[0].find("MixedO2<at::BFloat16>") != std::string::npos);
    // Once per process: a second Trainer says nothing.
    torch::manual_seed(11);
    auto model = std::make_shared<Cnn>();
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05));
    mp::Trainer<mp::MixedO1<at::Half>> again(model, sgd, options);
    CHECK(warnings.size() == 1);
    // advise() gives the same reason.
    const auto x = torch::randn({4, 1, 8, 8});
    const auto y = torch::randint(0, 3, {4});
    torch::manual_seed(12);
    auto fresh = std::make_shared<Cnn>();
    const auto advice = mp::advise(fresh, [&] {
      return torch::nn::functional::cross_entropy(fresh->forward(x), y);
    });
    CHECK(advice.slow_fp16_convolutions == std::vector<std::string>{"conv1", "conv2"});
    std::ostringstream text;
    text << advice;
    CHECK(text.str().find("oneDNN's reference loop") != std::string::npos);
  }
  override_caps.reset();
  mp::detail::slow_convolutions_warned() = false;
}
