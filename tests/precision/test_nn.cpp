// mixprec::nn::Linear: torch::nn::Linear whose forward is F.linear's. mixprec::nn::Conv2d:
// torch::nn::Conv2d's parameters and forward, bit for bit, and with
// fp32_weight_grad its fp16 weight gradient computed in fp32: checked against an fp64 reference
// and against LibTorch's own fp16 gradient, under MixedO2/PureHalf (fp16 tensors) and MixedO1
// (autocast); the Trainer's warning on a CPU whose fp16 weight gradients are slow. Then
// per-module precision (precision_map.hpp): nn::Mappable, PrecisionMap, apply_precision_map.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace test_nn {  // one namespace a file: unity groups (tests/CMakeLists.txt)

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

namespace {
template <class Holder>
constexpr const char* linear_name = "mixprec::nn::Linear";
template <>
constexpr const char* linear_name<mp::nn::Float8Linear> = "mixprec::nn::Float8Linear";
}  // namespace

// Float8Linear where it does not compute in fp8 (no Trainer<MixedFP8>): the same.
TEST_CASE_TEMPLATE("nn::Linear is torch::nn::Linear with F.linear's forward: a row's output does "
                   "not depend on the input's rank, under autocast too", Holder, mp::nn::Linear,
                   mp::nn::Float8Linear) {
  torch::manual_seed(5);
  torch::nn::Linear plain(torch::nn::LinearOptions(6, 5));
  torch::manual_seed(5);
  Holder ours(6, 5);
  CHECK(test::identical({plain->weight, plain->bias}, {ours->weight, ours->bias}));
  std::vector<std::string> a, b;
  for (const auto& item : plain->named_parameters()) a.push_back(item.key());
  for (const auto& item : ours->named_parameters()) b.push_back(item.key());
  CHECK(a == b);
  CHECK(ours->template as<torch::nn::LinearImpl>() != nullptr);
  const auto x = torch::randn({3, 4, 6});
  // 2-D and fp32: the same addmm as torch::nn::Linear.
  CHECK(at::equal(ours(x[0]), plain(x[0])));
  // Rows of a 3-D batch give what the same rows give as a 2-D batch (torch::nn::Linear adds
  // its bias in a second op there), in fp32 and under autocast bf16, values and gradients.
  for (const bool autocast : {false, true}) {
    INFO("autocast bf16: ", autocast);
    mp::AutocastGuard guard(c10::DeviceType::CPU, at::kBFloat16, autocast);
    const auto leaf3 = x.clone().requires_grad_();
    const auto leaf2 = x.reshape({12, 6}).clone().requires_grad_();
    const auto probe = torch::randn({12, 5});
    ours->zero_grad();
    const auto y3 = ours(leaf3);
    (y3.reshape({12, 5}).to(at::kFloat) * probe).sum().backward();
    const auto w3 = ours->weight.grad().clone(), b3 = ours->bias.grad().clone();
    ours->zero_grad();
    const auto y2 = ours(leaf2);
    (y2.to(at::kFloat) * probe).sum().backward();
    CHECK(y3.scalar_type() == (autocast ? at::kBFloat16 : at::kFloat));
    CHECK(at::equal(y3.reshape({12, 5}), y2));
    CHECK(at::equal(leaf3.grad().reshape({12, 6}), leaf2.grad()));
    CHECK(at::allclose(w3, ours->weight.grad(), 1e-6, 1e-6));
    CHECK(at::allclose(b3, ours->bias.grad(), 1e-6, 1e-6));
    // And what F.linear computes: the bias added inside the product, one rounding.
    CHECK(at::equal(y3, at::linear(x, ours->weight, ours->bias)));
  }
  // An input of the wrong width is an Error naming both widths, and nothing changes.
  const auto before = ours->weight.clone();
  const auto expected = std::string(linear_name<Holder>) +
                        "(6, 5): the input of shape [3, 4, 7] must have 6 features in its last "
                        "dimension";
  CHECK_THROWS_WITH_AS(ours(torch::randn({3, 4, 7})), doctest::Contains(expected.c_str()),
                       mp::Error);
  CHECK_THROWS_AS(ours(torch::tensor(1.0F)), mp::Error);
  CHECK(at::equal(ours->weight, before));
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

// ---------------------------------------------------------------------------------------------
// Optional inputs are undefined tensors (STYLE.md): each layer with code of its own runs without
// bias, with a trained or a frozen bias, with a frozen weight, with an input that needs no
// gradient (a network's first layer), and in evaluation (grad mode off): every way an undefined
// tensor or gradient flows into or out of its autograd Function. Under each policy, against the
// plain LibTorch module in fp32 holding the values the policy computes with.

namespace {

enum class Bias { none, trained, frozen };

struct Inputs {
  Bias bias;
  bool weight_grad, input_grad, grad_mode;
};

std::string describe(const Inputs& in) {
  std::ostringstream text;
  text << (in.bias == Bias::none ? "no bias" : in.bias == Bias::trained ? "trained bias" : "frozen bias")
       << (in.weight_grad ? ", trained weight" : ", frozen weight")
       << (in.input_grad ? ", input needs a gradient" : ", input needs none")
       << (in.grad_mode ? "" : ", grad mode off");
  return text.str();
}

std::vector<Inputs> every_inputs() {
  std::vector<Inputs> all;
  for (const auto bias : {Bias::none, Bias::trained, Bias::frozen}) {
    for (const bool weight_grad : {true, false}) {
      for (const bool input_grad : {true, false}) all.push_back({bias, weight_grad, input_grad, true});
    }
  }
  all.push_back({Bias::none, true, true, false});
  all.push_back({Bias::trained, true, true, false});
  return all;
}

// How far a layer's result or gradient computed in `dtype` may be from the fp32 reference,
// relative to the reference's largest value: one ulp of a 16-bit result (twice its rounding), or
// 16 of fp32's (another order of accumulation).
double tolerance_of(at::ScalarType dtype) {
  if (dtype == at::kHalf) return kHalfEps;
  if (dtype == at::kBFloat16) return 1.0 / 128;
  return 16.0 / (1 << 23);
}

// The largest relative difference of each quantity over the cases of one policy.
struct Worst {
  double output = 0, input = 0, weight = 0, bias = 0;
};

// One forward and backward of `ours` as P runs it (cast to its dtype, or under its autocast) and
// of `plain`, the LibTorch module in fp32, on the same values. Checks the output, the gradient of
// every tensor that needs one, and no gradient for those that need none; returns the output.
template <class P, class Ours, class Plain>
at::Tensor check_inputs(Ours ours, Plain plain, const Inputs& in, const at::Tensor& x,
                  const at::Tensor& probe, Worst& worst) {
  constexpr auto low = P::low_dtype;
  const double tolerance = tolerance_of(low);
  if constexpr (P::cast_model) mp::detail::cast_model(*ours, low, P::keep_batch_norm_fp32, P::name);
  // What P computes with: its dtype's rounding (autocast's cast under MixedO1).
  const auto rounded = [](const at::Tensor& t) { return t.detach().to(low).to(at::kFloat); };
  plain->weight.set_data(rounded(ours->weight));
  ours->weight.requires_grad_(in.weight_grad);
  plain->weight.requires_grad_(in.weight_grad);
  if (in.bias != Bias::none) {
    plain->bias.set_data(rounded(ours->bias));
    ours->bias.requires_grad_(in.bias == Bias::trained);
    plain->bias.requires_grad_(in.bias == Bias::trained);
  }
  const auto input = x.to(mp::compute_dtype<P>).clone().requires_grad_(in.input_grad);
  const auto reference_input = rounded(x).clone().requires_grad_(in.input_grad);
  at::Tensor out, expected;
  {
    const torch::AutoGradMode grad_mode(in.grad_mode);
    {
      const auto guard = mp::autocast<P>(torch::kCPU);
      out = ours->forward(input);
    }
    expected = plain->forward(reference_input);
  }
  CHECK(out.scalar_type() == low);
  const double output_diff = relative(out, expected);
  worst.output = std::max(worst.output, output_diff);
  CHECK(output_diff <= tolerance);
  const bool any_grad = in.input_grad || in.weight_grad || in.bias == Bias::trained;
  CHECK(out.requires_grad() == (in.grad_mode && any_grad));
  if (!out.requires_grad()) return out;
  (out.to(at::kFloat) * probe).sum().backward();
  (expected * probe).sum().backward();
  const auto check_grad = [&](const at::Tensor& t, const at::Tensor& reference, double& largest) {
    if (!reference.requires_grad()) {
      CHECK_FALSE(t.grad().defined());
      return;
    }
    REQUIRE(t.grad().defined());
    CHECK(t.grad().scalar_type() == t.scalar_type());
    const double diff = relative(t.grad(), reference.grad());
    largest = std::max(largest, diff);
    CHECK(diff <= tolerance);
  };
  check_grad(input, reference_input, worst.input);
  check_grad(ours->weight, plain->weight, worst.weight);
  if (in.bias != Bias::none) check_grad(ours->bias, plain->bias, worst.bias);
  return out;
}

template <class P>
void print_worst(std::string_view what, const Worst& worst) {
  MESSAGE(what << " under " << P::name << ", largest difference from fp32's (relative to its "
          "largest value): output " << worst.output << "; gradients: input " << worst.input
          << ", weight " << worst.weight << ", bias " << worst.bias << " (tolerance "
          << tolerance_of(P::low_dtype) << ")");
}

// mixprec::nn::Conv2d with fp32_weight_grad on against torch::nn::Conv2d in fp32, every Inputs.
template <class P>
void conv_optional_inputs() {
  torch::manual_seed(21);
  const auto x = torch::randn({4, 3, 12, 12});
  const auto probe = torch::randn({4, 6, 12, 12});
  Worst worst;
  for (const auto& in : every_inputs()) {
    INFO(describe(in));
    torch::manual_seed(22);
    mp::nn::Conv2d ours(conv_options(false).bias(in.bias != Bias::none));
    ours->fp32_weight_grad(true);
    const auto out = check_inputs<P>(
        ours, torch::nn::Conv2d(conv_options(false).bias(in.bias != Bias::none)), in, x, probe,
        worst);
    // The node under test: fp16's convolution is the custom one, the others are LibTorch's.
    if (out.requires_grad()) {
      const bool custom = out.grad_fn()->name().find("Fp32WeightGradConv2d") != std::string::npos;
      CHECK(custom == (P::low_dtype == at::kHalf));
    }
  }
  print_worst<P>("mixprec::nn::Conv2d(fp32_weight_grad)", worst);
}

// mixprec::nn::Linear and Float8Linear (outside MixedFP8) against torch::nn::Linear in fp32.
template <class P>
void linear_optional_inputs() {
  torch::manual_seed(23);
  const auto x = torch::randn({2, 4, 6});
  const auto probe = torch::randn({2, 4, 5});
  const auto each = [&](auto holder, std::string_view name) {
    using Holder = decltype(holder);
    Worst worst;
    for (const auto& in : every_inputs()) {
      INFO(name, ": ", describe(in));
      const auto options = torch::nn::LinearOptions(6, 5).bias(in.bias != Bias::none);
      torch::manual_seed(24);
      check_inputs<P>(Holder(options), torch::nn::Linear(options), in, x, probe, worst);
    }
    print_worst<P>(name, worst);
  };
  each(mp::nn::Linear{nullptr}, "mixprec::nn::Linear");
  each(mp::nn::Float8Linear{nullptr}, "mixprec::nn::Float8Linear");
}

// ResNet's basic block: bias-free convolutions, each before a BatchNorm, and a skip connection.
// Without `affine`, the BatchNorms have no weight or bias either (undefined tensors too).
struct ResidualNet : torch::nn::Module {
  static torch::nn::Conv2dOptions conv(std::int64_t in, std::int64_t out) {
    return torch::nn::Conv2dOptions(in, out, 3).padding(1).bias(false);
  }
  explicit ResidualNet(bool affine) {
    const auto norm = torch::nn::BatchNorm2dOptions(8).affine(affine);
    stem = register_module("stem", mp::nn::Conv2d(conv(1, 8)));
    bn0 = register_module("bn0", torch::nn::BatchNorm2d(norm));
    conv1 = register_module("conv1", mp::nn::Conv2d(conv(8, 8)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(norm));
    conv2 = register_module("conv2", mp::nn::Conv2d(conv(8, 8)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(norm));
    fc = register_module("fc", torch::nn::Linear(8, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto h = torch::relu(bn0(stem(x)));
    const auto block = bn2(conv2(torch::relu(bn1(conv1(h)))));
    return fc(torch::relu(h + block).mean({2, 3}));
  }
  mp::nn::Conv2d stem{nullptr}, conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn0{nullptr}, bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc{nullptr};
};

// The losses of 20 steps of a Trainer<P> on ResidualNet, with the fp32 weight gradients or not.
template <class P>
std::vector<double> train_residual(bool remedy, bool affine) {
  torch::manual_seed(25);
  auto model = std::make_shared<ResidualNet>(affine);
  CHECK(mp::nn::fp32_conv_weight_grads(*model, remedy) == 3);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  mp::Trainer<P> trainer(model, sgd);
  torch::manual_seed(26);
  const auto x = torch::randn({16, 1, 8, 8});
  const auto y = torch::randint(0, 3, {16});
  std::vector<double> losses;
  for (int i = 0; i < 20; ++i) {
    const auto report = trainer.step([&] {
      return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)).to(at::kFloat), y);
    });
    losses.push_back(report.loss.template item<double>());
  }
  return losses;
}

}  // namespace

TEST_CASE_TEMPLATE("nn::Conv2d with fp32 weight gradients, without bias or with frozen tensors, "
                   "under each fp16 policy: output and every gradient as fp32's torch::nn::Conv2d" *
                       doctest::skip(!mp::cpu_half_math),
                   P, mp::MixedO1<at::Half>, mp::MixedO2<at::Half>, mp::PureHalf<at::Half>) {
  conv_optional_inputs<P>();
}

TEST_CASE_TEMPLATE("nn::Conv2d with fp32 weight gradients, without bias or with frozen tensors, "
                   "under the other policies (torch::nn::Conv2d's path)",
                   P, mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   mp::PureHalf<at::BFloat16>) {
  conv_optional_inputs<P>();
}

TEST_CASE_TEMPLATE("nn::Linear and nn::Float8Linear without bias or with frozen tensors, under "
                   "each fp16 policy, as fp32's torch::nn::Linear" * doctest::skip(!mp::cpu_half_math),
                   P, mp::MixedO1<at::Half>, mp::MixedO2<at::Half>, mp::PureHalf<at::Half>) {
  linear_optional_inputs<P>();
}

TEST_CASE_TEMPLATE("nn::Linear and nn::Float8Linear without bias or with frozen tensors, under "
                   "the other policies, as fp32's torch::nn::Linear",
                   P, mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   mp::PureHalf<at::BFloat16>) {
  linear_optional_inputs<P>();
}

TEST_CASE_TEMPLATE("a ResNet block (bias-free convolutions before BatchNorm) trains with fp32 "
                   "conv weight gradients under each fp16 policy as with LibTorch's" *
                       doctest::skip(!mp::cpu_half_math),
                   P, mp::MixedO1<at::Half>, mp::MixedO2<at::Half>, mp::PureHalf<at::Half>) {
  for (const bool affine : {true, false}) {
    const auto plain = train_residual<P>(false, affine), ours = train_residual<P>(true, affine);
    double worst = 0;
    for (std::size_t i = 0; i < plain.size(); ++i) worst = std::max(worst, std::abs(plain[i] - ours[i]));
    const std::string norms = affine ? "" : ", BatchNorm without affine";
    MESSAGE(P::name << norms << ": loss " << ours.front()
            << " -> " << ours.back() << "; largest difference from LibTorch's fp16 weight "
            << "gradients over 20 steps: " << worst);
    CHECK(ours.back() < ours.front() * 0.7);  // it learns
    CHECK(worst < 0.02);                      // and follows the fp16 run within its rounding
  }
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

// ---------------------------------------------------------------------------------------------
// Per-module precision (precision_map.hpp): mixprec::nn::Mappable, PrecisionMap and
// apply_precision_map, with the models users build: a transformer-style block with its norms and
// classifier kept fp32, a CNN with BatchNorm and GroupNorm, tied weights, a frozen module.

namespace {

// A small encoder layer and a classifier: embedding, attention-like mixing, LayerNorms, a head.
struct Encoder : torch::nn::Module {
  torch::nn::Linear inp{16, 32};
  mp::nn::Mappable<torch::nn::Linear> proj{32, 32};
  torch::nn::LayerNorm norm1{torch::nn::LayerNormOptions({32})};
  torch::nn::Sequential ffn{mp::nn::Mappable<torch::nn::Linear>(32, 64), torch::nn::ReLU(),
                            torch::nn::Linear(64, 32)};
  torch::nn::LayerNorm norm2{torch::nn::LayerNormOptions({32})};
  mp::nn::Mappable<torch::nn::Linear> head{32, 5};
  Encoder() {
    register_module("inp", inp);
    register_module("proj", proj);
    register_module("norm1", norm1);
    register_module("ffn", ffn);
    register_module("norm2", norm2);
    register_module("head", head);
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(inp->forward(x));
    h = norm1->forward(h + torch::tanh(proj->forward(h)));
    h = norm2->forward(h + ffn->forward(h));
    return head->forward(h);
  }
};

// Inputs and targets whose values bf16 holds exactly, so that casting them loses nothing.
std::pair<at::Tensor, at::Tensor> encoder_batch(std::int64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({8, 16}).to(at::kBFloat16).to(at::kFloat),
          torch::randint(0, 5, {8}, at::kLong)};
}

template <class P>
std::vector<double> train_encoder(const std::shared_ptr<Encoder>& model, int steps,
                                  std::vector<at::Tensor>* final_params = nullptr) {
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  mp::Trainer<P> trainer(model, optimizer);
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) {
    const auto [x, y] = encoder_batch(100 + i % 2);  // two batches: the loss can fall
    const auto report = trainer.step([&, &x = x, &y = y] {
      return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
    });
    CHECK(report.status == mp::StepStatus::stepped);
    losses.push_back(report.loss.template item<double>());
  }
  if (final_params != nullptr) {
    for (const auto& p : model->parameters()) final_params->push_back(p.detach().to(at::kFloat));
  }
  return losses;
}

std::shared_ptr<Encoder> encoder(std::uint64_t seed = 5) {
  torch::manual_seed(seed);
  return std::make_shared<Encoder>();
}

std::vector<std::string> keys(const torch::nn::Module& module) {
  std::vector<std::string> result;
  for (const auto& item : module.named_parameters()) result.push_back(item.key());
  for (const auto& item : module.named_buffers()) result.push_back(item.key());
  return result;
}

}  // namespace

TEST_CASE("PrecisionMap patterns: `*` within a name, `**` across dots, the first rule decides") {
  const auto map = mp::PrecisionMap()
                       .keep_fp32("encoder.*.norm*")
                       .add("encoder.**", mp::Precision::low)
                       .keep_fp32("head");
  const auto precision = [&](const std::string& path) {
    const auto* rule = map.match(path);
    return rule == nullptr ? std::string("none") : rule->pattern;
  };
  CHECK(precision("encoder.0.norm1") == "encoder.*.norm*");
  CHECK(precision("encoder.11.norm") == "encoder.*.norm*");
  CHECK(precision("encoder.0.attn.norm") == "encoder.**");  // `*` stops at a dot
  CHECK(precision("encoder.0.ffn") == "encoder.**");
  CHECK(precision("head") == "head");
  CHECK(precision("head.0") == "none");  // a rule names a module, its children inherit
  CHECK(precision("decoder.0.norm1") == "none");
}

TEST_CASE("nn::Mappable is its module: the same parameters, names, state_dict and forward") {
  torch::manual_seed(3);
  torch::nn::Linear plain(7, 3);
  torch::manual_seed(3);
  mp::nn::Mappable<torch::nn::Linear> mapped(7, 3);
  CHECK(keys(*plain) == keys(*mapped));
  CHECK(mapped->parameters().size() == 2);
  CHECK(mapped->named_parameters()["weight"].is_same(mapped->inner()->weight));
  CHECK(test::identical(plain->weight, mapped->named_parameters()["weight"]));
  const auto x = torch::randn({4, 7});
  CHECK(test::identical(plain->forward(x), mapped->forward(x)));
  // A checkpoint of one loads into the other, by name.
  std::stringstream stream;
  torch::save(plain, stream);
  torch::nn::Linear loaded_plain(7, 3);
  mp::nn::Mappable<torch::nn::Linear> loaded(7, 3);
  torch::load(loaded, stream);
  CHECK(test::identical(loaded->inner()->weight, plain->weight));
  // Inside a Sequential, and its mode reaches the wrapped module.
  torch::nn::Sequential seq(mp::nn::Mappable<torch::nn::Dropout>(0.5));
  seq->eval();
  const auto ones = torch::ones({100});
  CHECK(test::identical(seq->forward(ones), ones));  // eval: dropout is the identity
  seq->train();
  CHECK_FALSE(test::identical(seq->forward(ones), ones));
}

TEST_CASE("MixedO2<BFloat16> with norms and classifier kept fp32: dtypes, masters and training") {
  auto model = encoder();
  const auto names_before = keys(*model);
  auto map = mp::PrecisionMap().keep_fp32("norm*").keep_fp32("head");
  if (!mp::mixed_dtype_norms) {
    // LibTorch 1.13: LayerNorm cannot take bf16 input with fp32 weights; the map says so.
    CHECK_THROWS_WITH_AS(mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, map),
                         doctest::Contains("LibTorch 1.13's LayerNorm and GroupNorm refuse"),
                         mp::Error);
    map = mp::PrecisionMap().keep_fp32("head");
  }
  const auto changed = mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, map);
  std::vector<std::string> changed_names;
  for (const auto& m : changed) {
    changed_names.push_back(m.name);
    CHECK(m.dtype == at::kFloat);
  }
  CHECK(changed_names == (mp::mixed_dtype_norms
                              ? std::vector<std::string>{"norm1", "norm2", "head"}
                              : std::vector<std::string>{"head"}));
  std::vector<at::Tensor> params;
  const auto losses = train_encoder<mp::MixedO2<at::BFloat16>>(model, 30, &params);
  CHECK(keys(*model) == names_before);  // state_dict names unchanged
  const auto named = model->named_parameters();
  CHECK(named["inp.weight"].scalar_type() == at::kBFloat16);
  CHECK(named["ffn.0.weight"].scalar_type() == at::kBFloat16);
  CHECK(named["norm1.weight"].scalar_type() == (mp::mixed_dtype_norms ? at::kFloat : at::kBFloat16));
  CHECK(named["head.weight"].scalar_type() == at::kFloat);
  CHECK(named["head.bias"].scalar_type() == at::kFloat);
  {  // The head computes in fp32 and hands the model's output back in its compute dtype.
    at::NoGradGuard no_grad;
    CHECK(model->forward(torch::randn({2, 16}).to(at::kBFloat16)).scalar_type() == at::kBFloat16);
  }
  // It trains as the fp32 model does, within bf16's rounding of the other layers.
  const auto reference = train_encoder<mp::FullPrecision>(encoder(), 30);
  double largest = 0.0;
  for (std::size_t i = 0; i < losses.size(); ++i) {
    largest = std::max(largest, std::abs(losses[i] - reference[i]));
  }
  MESSAGE("MixedO2<BFloat16> with fp32 norms and head vs FullPrecision, 30 AdamW steps: largest "
          "loss difference ", largest, " (first loss ", reference.front(), ", last ",
          reference.back(), ")");
  CHECK(largest < 0.02);  // measured 0.006: bf16 rounding of the other layers
  CHECK(losses[losses.size() - 2] < losses.front() - 0.3);  // the same batch, 28 steps later
}

TEST_CASE("a module mapped to fp32 around the whole network trains MixedO2<BFloat16> bit for bit "
          "as FullPrecision") {
  // With fp32 inputs and every parameter in one fp32 region whose output stays fp32, each
  // parameter is its own master: the step is FullPrecision's, the loss scaler and master
  // bookkeeping included.
  const auto make = [] {
    torch::manual_seed(11);
    return torch::nn::Sequential(mp::nn::Mappable<torch::nn::Sequential>(
        torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::LayerNorm(
            torch::nn::LayerNormOptions({32})), torch::nn::Linear(32, 5)));
  };
  const auto run = [](auto policy, torch::nn::Sequential model, bool map) {
    using P = decltype(policy);
    if (map) mp::apply_precision_map<P>(model, mp::PrecisionMap().keep_fp32("0", mp::Output::own));
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    mp::Trainer<P> trainer(model, optimizer);
    std::vector<at::Tensor> losses;
    for (int i = 0; i < 6; ++i) {
      const auto [x, y] = encoder_batch(200 + i);
      losses.push_back(trainer.step([&, &x = x, &y = y] {
        return torch::nn::functional::cross_entropy(model->forward(x), y);
      }).loss);
    }
    auto params = test::snapshot(model->parameters());
    params.insert(params.end(), losses.begin(), losses.end());
    return params;
  };
  const auto reference = run(mp::FullPrecision{}, make(), false);
  const auto mapped = run(mp::MixedO2<at::BFloat16>{}, make(), true);
  MESSAGE("largest difference of parameters and losses: ", test::max_abs_diff(mapped, reference));
  CHECK(test::identical(mapped, reference));
}

TEST_CASE("a CNN with BatchNorm and GroupNorm kept fp32 under MixedO2<BFloat16>, a frozen mapped head") {
  torch::manual_seed(2);
  torch::nn::Sequential model(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)), torch::nn::BatchNorm2d(4),
      torch::nn::ReLU(), torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3).padding(1)),
      torch::nn::GroupNorm(2, 4), torch::nn::ReLU(), torch::nn::Flatten(),
      mp::nn::Mappable<torch::nn::Linear>(4 * 8 * 8, 3));
  const auto map = mp::PrecisionMap().keep_fp32("1").keep_fp32("4").keep_fp32("7");
  if (!mp::mixed_dtype_norms) {
    CHECK_THROWS_WITH_AS(mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, map),
                         doctest::Contains("module '4' (torch::nn::GroupNormImpl)"), mp::Error);
    return;  // LibTorch 1.13: GroupNorm cannot take bf16 input with fp32 weights
  }
  mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, map);
  auto head = model[7];
  for (auto& p : head->parameters()) p.requires_grad_(false);  // frozen: never changes
  const auto head_before = test::snapshot(head->parameters());
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, optimizer);
  const auto named = model->named_parameters();
  CHECK(named["0.weight"].scalar_type() == at::kBFloat16);
  CHECK(named["1.weight"].scalar_type() == at::kFloat);
  CHECK(named["4.weight"].scalar_type() == at::kFloat);
  CHECK(named["7.weight"].scalar_type() == at::kFloat);
  CHECK(model->named_buffers()["1.running_mean"].scalar_type() == at::kFloat);
  const auto first_conv = named["0.weight"].detach().clone();
  torch::manual_seed(9);
  const auto x = torch::randn({16, 1, 8, 8});
  const auto y = torch::randint(0, 3, {16}, at::kLong);
  double first = 0.0, last = 0.0;
  for (int i = 0; i < 20; ++i) {
    const auto report = trainer.step([&] {
      return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
    });
    CHECK(report.status == mp::StepStatus::stepped);
    (i == 0 ? first : last) = report.loss.item<double>();
  }
  CHECK(last < first);
  CHECK(test::identical(test::snapshot(head->parameters()), head_before));
  CHECK_FALSE(test::identical(named["0.weight"], first_conv));
}

TEST_CASE("MixedO1<BFloat16>: autocast is off inside a module mapped to fp32") {
  // (No LayerNorm here: LibTorch 1.13's CPU autocast hands it bf16 input with fp32 weights.)
  torch::manual_seed(4);
  torch::nn::Sequential model(torch::nn::Linear(16, 32), torch::nn::ReLU(),
                              mp::nn::Mappable<torch::nn::Linear>(32, 5));
  mp::apply_precision_map<mp::MixedO1<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("2"));
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  mp::Trainer<mp::MixedO1<at::BFloat16>> trainer(model, optimizer);
  auto* head = model[2]->as<mp::nn::MappableImpl<torch::nn::Linear>>();
  REQUIRE(head != nullptr);
  const auto h = torch::randn({8, 32}).to(at::kBFloat16);  // as an autocast layer hands it on
  const auto w = head->inner()->weight, b = head->inner()->bias;
  trainer.evaluate([&] {
    const auto out = head->forward(h);
    CHECK(out.scalar_type() == at::kBFloat16);  // back in the dtype it came in
    at::Tensor fp32;
    {
      mp::AutocastGuard off(c10::DeviceType::CPU, at::kBFloat16, /*enabled=*/false);
      fp32 = at::linear(h.to(at::kFloat), w, b);
    }
    CHECK(test::identical(out, fp32.to(at::kBFloat16)));
    // The same Linear unmapped, under the same autocast, computes in bf16.
    CHECK(head->inner()->forward(h.to(at::kFloat)).scalar_type() == at::kBFloat16);
    return out;
  });
  const auto [x, y] = encoder_batch(1);
  CHECK(trainer.step([&, &x = x, &y = y] {
    return torch::nn::functional::cross_entropy(model->forward(x), y);
  }).status == mp::StepStatus::stepped);
}

TEST_CASE("Fp32Region: autocast off and fp32 inside a block of the user's own code") {
  mp::AutocastGuard autocast(c10::DeviceType::CPU, at::kBFloat16);
  torch::manual_seed(6);
  const auto a = torch::randn({4, 4}).to(at::kBFloat16);
  CHECK(at::mm(a.to(at::kFloat), a.to(at::kFloat)).scalar_type() == at::kBFloat16);  // autocast
  {
    mp::Fp32Region fp32;
    const auto inside = at::mm(fp32.in(a), fp32.in(a));
    CHECK(inside.scalar_type() == at::kFloat);
    at::Tensor reference;
    {
      mp::AutocastGuard off(c10::DeviceType::CPU, at::kBFloat16, /*enabled=*/false);
      reference = at::mm(a.to(at::kFloat), a.to(at::kFloat));
    }
    CHECK(test::identical(inside, reference));
    CHECK(fp32.out(inside).scalar_type() == at::kBFloat16);
  }
  // Autocast is back on after the region.
  CHECK(at::mm(a.to(at::kFloat), a.to(at::kFloat)).scalar_type() == at::kBFloat16);
}

TEST_CASE("apply_precision_map refuses what it cannot do, naming the module, and changes nothing") {
  SUBCASE("a rule that matches nothing names the closest modules") {
    auto model = encoder();
    CHECK_THROWS_WITH_AS(
        mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("haed")),
        doctest::Contains("rule 'haed' (fp32) matches no module of the model; the closest "
                          "names: 'head'"), mp::Error);
    // Nothing changed: a corrected map applies.
    CHECK(mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("head"))
              .size() == 1);
  }
  SUBCASE("a plain module whose inputs would need a cast") {
    auto model = encoder();
    CHECK_THROWS_WITH_AS(
        mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("inp")),
        doctest::Contains("module 'inp' (torch::nn::LinearImpl) is mapped to Float inside "
                          "BFloat16 computation under MixedO2<BFloat16>, but LibTorch modules "
                          "have no forward hooks"), mp::Error);
    CHECK_THROWS_WITH_AS(
        mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("ffn")),
        doctest::Contains("mixprec::nn::Mappable<torch::nn::Sequential>"), mp::Error);
    // Under MixedO1 a norm layer too: only a Mappable turns autocast off.
    CHECK_THROWS_WITH_AS(
        mp::apply_precision_map<mp::MixedO1<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("norm1")),
        doctest::Contains("module 'norm1'"), mp::Error);
    // A Mappable inside a Sequential is a fine place to change precision.
    CHECK(mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("ffn.0"))
              .size() == 1);
  }
  SUBCASE("a model mapped twice, or after its Trainer was built") {
    auto model = encoder();
    mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("head"));
    CHECK_THROWS_WITH_AS(
        mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("norm1")),
        doctest::Contains("this model, or a part of it, has a precision map already"), mp::Error);
    auto other = encoder();
    torch::optim::SGD optimizer(other->parameters(), torch::optim::SGDOptions(0.1));
    mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(other, optimizer);
    const auto before = test::snapshot(other->parameters());
    CHECK_THROWS_WITH_AS(
        mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(other, mp::PrecisionMap().keep_fp32("head")),
        doctest::Contains("a Trainer trains this model already"), mp::Error);
    CHECK(test::identical(test::snapshot(other->parameters()), before));
  }
  SUBCASE("a tensor tied between an fp32 module and a Low one") {
    // A module of the model's own holds the head's weight too (tied), and the map leaves it bf16.
    struct Tied : torch::nn::Module {
      explicit Tied(const at::Tensor& weight) { register_parameter("weight", weight); }
    };
    auto model = encoder();
    model->register_module("tied", std::make_shared<Tied>(model->head->inner()->weight));
    CHECK_THROWS_WITH_AS(
        mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("head")),
        doctest::Contains("'tied.weight' is the same tensor as 'head.weight' (tied)"), mp::Error);
    // The head under a second name is one module: one precision.
    model->register_module("alias", model->head);
    CHECK_THROWS_WITH_AS(
        mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("head")),
        doctest::Contains("module 'alias' is module 'head' registered under a second name"),
        mp::Error);
  }
}

TEST_CASE("a module mapped to fp16 on a CPU without fp16 math (LibTorch 1.13) is an Error naming it" *
          doctest::skip(mp::cpu_half_math)) {
  auto model = encoder();
  CHECK_THROWS_WITH_AS(
      mp::apply_precision_map<mp::MixedO2<at::Half>>(model, mp::PrecisionMap().keep_fp32("head")),
      doctest::Contains("module 'inp' computes in Half under MixedO2<Half>"), mp::Error);
  // Nothing changed: the model can still be mapped under a bf16 policy.
  CHECK(mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("head"))
            .size() == 1);
}

TEST_CASE("the map and the Trainer agree: another policy, or a map of a part, is an Error") {
  auto model = encoder();
  mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("head"));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  CHECK_THROWS_WITH_AS((mp::Trainer<mp::MixedO1<at::BFloat16>>(model, optimizer)),
                       doctest::Contains("the model's precision map was applied for "
                                         "MixedO2<BFloat16>"), mp::Error);
  // A map applied to a submodule, then a Trainer on the whole model.
  torch::manual_seed(3);
  torch::nn::Sequential outer(torch::nn::Linear(16, 16),
                              mp::nn::Mappable<torch::nn::Sequential>(
                                  mp::nn::Mappable<torch::nn::Linear>(16, 4)));
  mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(outer[1], mp::PrecisionMap().keep_fp32("0"));
  torch::optim::SGD outer_optimizer(outer->parameters(), torch::optim::SGDOptions(0.1));
  CHECK_THROWS_WITH_AS((mp::Trainer<mp::MixedO2<at::BFloat16>>(outer, outer_optimizer)),
                       doctest::Contains("apply the map to the model the Trainer trains"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(
      mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(outer, mp::PrecisionMap().keep_fp32("0")),
      doctest::Contains("this model, or a part of it, has a precision map already"), mp::Error);
}

TEST_CASE("one module under two names with different precisions is an Error (MixedO1)") {
  torch::manual_seed(3);
  mp::nn::Mappable<torch::nn::Linear> shared(8, 8);
  torch::nn::Sequential model(shared, torch::nn::ReLU(), shared);
  CHECK_THROWS_WITH_AS(
      mp::apply_precision_map<mp::MixedO1<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("0")),
      doctest::Contains("module '2' is module '0' registered under a second name"), mp::Error);
  CHECK(mp::apply_precision_map<mp::MixedO1<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("0")
                                                                        .keep_fp32("2"))
            .size() == 2);
}

TEST_CASE("an unmapped Mappable is its module to the Trainer: a Mappable BatchNorm stays fp32") {
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(8, 8),
                              mp::nn::Mappable<torch::nn::BatchNorm1d>(8), torch::nn::Linear(8, 2));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, optimizer);
  CHECK(model->named_parameters()["1.weight"].scalar_type() == at::kFloat);
  CHECK(model->named_buffers()["1.running_mean"].scalar_type() == at::kFloat);
  CHECK(model->named_parameters()["0.weight"].scalar_type() == at::kBFloat16);
  const auto x = torch::randn({4, 8});
  CHECK(trainer.step([&] { return model->forward(trainer.cast_input(x)).to(at::kFloat).pow(2).mean(); })
            .status == mp::StepStatus::stepped);
}

TEST_CASE("outputs kept fp32 for their reader, which hands bf16 on to the next layer") {
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), mp::nn::Mappable<torch::nn::Linear>(16, 16),
                              mp::nn::Mappable<torch::nn::Linear>(16, 16), torch::nn::Linear(16, 2));
  mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(
      model, mp::PrecisionMap().keep_fp32("1", mp::Output::own).keep_fp32("2"));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, optimizer);
  const auto x = torch::randn({4, 8}).to(at::kBFloat16);
  trainer.evaluate([&] {
    const auto h = model[0]->as<torch::nn::Linear>()->forward(x);
    const auto kept = model[1]->as<mp::nn::MappableImpl<torch::nn::Linear>>()->forward(h);
    CHECK(kept.scalar_type() == at::kFloat);  // its own dtype
    const auto read = model[2]->as<mp::nn::MappableImpl<torch::nn::Linear>>()->forward(kept);
    CHECK(read.scalar_type() == at::kBFloat16);  // fp32 in, the surroundings' bf16 out
    CHECK(model->forward(x).scalar_type() == at::kBFloat16);
    return read;
  });
  CHECK(trainer.step([&] { return model->forward(trainer.cast_input(x)).to(at::kFloat).pow(2).mean(); })
            .status == mp::StepStatus::stepped);
}

TEST_CASE("tied weights inside one module mapped to fp32 stay one fp32 tensor, trained once") {
  torch::manual_seed(8);
  torch::nn::Linear shared(8, 8);  // one Linear used twice: tied as LibTorch ties them
  torch::nn::Sequential inner(shared, torch::nn::Tanh(), shared);
  torch::nn::Sequential model(torch::nn::Linear(8, 8),
                              mp::nn::Mappable<torch::nn::Sequential>(inner),
                              torch::nn::Linear(8, 2));
  CHECK(model->named_parameters()["1.0.weight"].is_same(model->named_parameters()["1.2.weight"]));
  mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("1"));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  at::Tensor grad;  // the step's gradient, read in on_step (the Trainer clears it after)
  const auto tied = model->named_parameters()["1.0.weight"];
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(
      model, optimizer, mp::TrainerOptions().on_step([&](const mp::StepReport&) {
        if (tied.grad().defined()) grad = tied.grad().clone();
      }));
  CHECK(tied.scalar_type() == at::kFloat);
  CHECK(tied.is_same(model->named_parameters()["1.2.weight"]));
  CHECK(model->named_parameters()["0.weight"].scalar_type() == at::kBFloat16);
  const auto before = tied.detach().clone();
  torch::manual_seed(1);
  const auto x = torch::randn({4, 8});
  const auto y = torch::randint(0, 2, {4}, at::kLong);
  // One SGD step moves the tied tensor by lr times the sum of both uses' gradients, once.
  const auto report = trainer.step([&] {
    return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
  });
  CHECK(report.status == mp::StepStatus::stepped);
  REQUIRE(grad.defined());
  CHECK(torch::allclose(tied.detach(), before - 0.1 * grad, 1e-6, 1e-7));  // not 2x: once
}

TEST_CASE("a mapped model's checkpoint resumes bit for bit under MixedO2<BFloat16>") {
  const auto path = std::string(MIXPREC_TEST_TMPDIR) + "/mapped_encoder.ckpt";
  const auto map = mp::PrecisionMap().keep_fp32("proj").keep_fp32("head");
  const auto steps = [](mp::Trainer<mp::MixedO2<at::BFloat16>>& trainer, Encoder& model, int from,
                        int to) {
    for (int i = from; i < to; ++i) {
      const auto [x, y] = encoder_batch(300 + i);
      (void)trainer.step([&, &x = x, &y = y] {
        return torch::nn::functional::cross_entropy(model.forward(trainer.cast_input(x)), y);
      });
    }
  };
  auto model = encoder(5);
  mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, map);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, optimizer);
  steps(trainer, *model, 0, 3);
  trainer.save(path);
  steps(trainer, *model, 3, 6);

  auto resumed = encoder(77);  // other initial values: all of them come from the checkpoint
  mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(resumed, map);
  torch::optim::AdamW resumed_optimizer(resumed->parameters(), torch::optim::AdamWOptions(1e-2));
  mp::Trainer<mp::MixedO2<at::BFloat16>> resumed_trainer(resumed, resumed_optimizer);
  resumed_trainer.load(path);
  CHECK(resumed->named_parameters()["head.weight"].scalar_type() == at::kFloat);
  steps(resumed_trainer, *resumed, 3, 6);
  CHECK(test::identical(test::snapshot(resumed->parameters()), test::snapshot(model->parameters())));
  CHECK(test::identical(resumed_trainer.master_weights(), trainer.master_weights()));
}

TEST_CASE("a precision map rule shadowed by earlier ones is an Error naming it and them") {
  SUBCASE("`**` first: a later rule for one module decides nothing") {
    auto model = encoder();
    const auto before = test::snapshot(model->parameters());
    CHECK_THROWS_WITH_AS(
        mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(
            model, mp::PrecisionMap().add("**", mp::Precision::low).keep_fp32("head")),
        doctest::Contains("precision map rule 'head' (fp32) decides no module: every module it "
                          "matches ('head') is decided by the earlier precision map rule '**' "
                          "(low)"),
        mp::Error);
    // Nothing changed: in the other order, the same two rules each decide a module.
    const auto changed = mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(
        model, mp::PrecisionMap().keep_fp32("head").add("**", mp::Precision::low));
    REQUIRE(changed.size() == 1);
    CHECK(changed[0].name == "head");
    CHECK(test::identical(test::snapshot(model->parameters()), before));
  }
  SUBCASE("the same pattern twice, and a pattern shadowed by two rules") {
    auto model = encoder();
    CHECK_THROWS_WITH_AS(
        mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(
            model, mp::PrecisionMap().keep_fp32("head", mp::Output::own).keep_fp32("head")),
        doctest::Contains("rule 'head' (fp32) decides no module: every module it matches "
                          "('head') is decided by the earlier precision map rule 'head' (fp32, "
                          "Output::own)"),
        mp::Error);
    CHECK_THROWS_WITH_AS(
        mp::apply_precision_map<mp::FullPrecision>(
            model, mp::PrecisionMap().keep_fp32("norm1").keep_fp32("norm2").keep_fp32("norm*")),
        doctest::Contains("rule 'norm*' (fp32) decides no module: every module it matches "
                          "('norm1', 'norm2') is decided by the earlier precision map rule "
                          "'norm1' (fp32) and precision map rule 'norm2' (fp32)"),
        mp::Error);
  }
  SUBCASE("a rule for a child of a module another rule decides is not shadowed") {
    // `0.2` is no match of `0`: the child is decided by its own rule (here to the precision it
    // would inherit), as `0.*` would decide all four children.
    torch::nn::Sequential model(mp::nn::Mappable<torch::nn::Sequential>(
        torch::nn::Linear(16, 32), torch::nn::ReLU(),
        torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})), torch::nn::Linear(32, 5)));
    const auto changed = mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(
        model, mp::PrecisionMap().keep_fp32("0", mp::Output::own).keep_fp32("0.2"));
    CHECK(changed.size() == 5);  // `0` and its four children
  }
}

TEST_CASE("the pattern rules are a piece of their own: another wrapper kind's rules, same Errors") {
  // What activation checkpointing or sharded units will call, with their own names for rules.
  const std::vector<std::string> paths{"blocks", "blocks.0", "blocks.0.attn", "blocks.1", "head"};
  const auto describe = [](std::size_t i) { return "checkpoint rule " + std::to_string(i); };
  std::vector<int> decided;  // the rule of each path, -1 for none
  for (const auto rule : mp::detail::decide_paths({"blocks.*", "head", "**"}, paths, describe)) {
    decided.push_back(rule ? static_cast<int>(*rule) : -1);
  }
  CHECK(decided == std::vector<int>{2, 0, 2, 0, 1});
  CHECK_THROWS_WITH_AS(mp::detail::decide_paths({"blocks.*", "blocks.1"}, paths, describe),
                       doctest::Contains("checkpoint rule 1 decides no module: every module it "
                                         "matches ('blocks.1') is decided by the earlier "
                                         "checkpoint rule 0"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(mp::detail::decide_paths({"blocks.2"}, paths, describe),
                       doctest::Contains("checkpoint rule 0 matches no module of the model; the "
                                         "closest names: 'blocks.0', 'blocks.1'"),
                       mp::Error);
}

TEST_CASE("LibTorch's modules with parameters refuse an input of another dtype (1.13 and 2.x)") {
  // What the checks of Output::own rely on: a module whose parameters are bf16 cannot read an
  // fp32 output kept by its neighbour, whatever its kind; a norm layer with fp32 parameters
  // reads bf16 (BatchNorm always, LayerNorm and GroupNorm where mixed_dtype_norms).
  torch::manual_seed(0);
  torch::nn::Linear linear(8, 8);
  torch::nn::Conv1d conv(torch::nn::Conv1dOptions(8, 8, 3));
  torch::nn::LayerNorm layer_norm(torch::nn::LayerNormOptions({8}));
  torch::nn::GroupNorm group_norm(2, 8);
  torch::nn::BatchNorm1d batch_norm(8);
  torch::nn::PReLU prelu;
  torch::nn::MultiheadAttention attention(8, 2);
  const auto fp32_into_bf16 = [](auto module, const at::Tensor& x) {
    module->to(at::kBFloat16);
    CHECK_THROWS_AS(module->forward(x), c10::Error);
  };
  fp32_into_bf16(linear, torch::randn({4, 8}));
  fp32_into_bf16(conv, torch::randn({2, 8, 6}));
  fp32_into_bf16(layer_norm, torch::randn({4, 8}));
  fp32_into_bf16(group_norm, torch::randn({2, 8, 5}));
  fp32_into_bf16(batch_norm, torch::randn({4, 8}));
  fp32_into_bf16(prelu, torch::randn({4, 8}));
  attention->to(at::kBFloat16);
  const auto q = torch::randn({3, 2, 8});
  CHECK_THROWS_AS(attention->forward(q, q, q), c10::Error);
  // fp32 parameters, bf16 input.
  const auto x = torch::randn({4, 8}).to(at::kBFloat16);
  batch_norm->to(at::kFloat);
  CHECK(batch_norm->forward(x).scalar_type() == at::kBFloat16);
  layer_norm->to(at::kFloat);
  if (mp::mixed_dtype_norms) {
    CHECK(layer_norm->forward(x).scalar_type() == at::kBFloat16);
  } else {
    CHECK_THROWS_AS(layer_norm->forward(x), c10::Error);
  }
}

TEST_CASE("an output kept fp32 read by a Low module of a Sequential: an Error at the map, naming both") {
  const auto make = [](torch::nn::AnyModule third) {
    torch::manual_seed(3);
    return torch::nn::Sequential(torch::nn::Linear(8, 16), mp::nn::Mappable<torch::nn::Linear>(16, 16),
                                 std::move(third), torch::nn::Linear(16, 2));
  };
  const auto own = mp::PrecisionMap().keep_fp32("1", mp::Output::own);
  SUBCASE("a plain LayerNorm reads it") {
    auto model = make(torch::nn::AnyModule(torch::nn::LayerNorm(torch::nn::LayerNormOptions({16}))));
    const auto before = test::snapshot(model->parameters());
    CHECK_THROWS_WITH_AS(mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, own),
                         doctest::Contains("module '2' (torch::nn::LayerNormImpl) computes in "
                                           "BFloat16 under MixedO2<BFloat16> and reads, through "
                                           "the Sequential around it, the Float output that "
                                           "module '1' keeps (Output::own)"),
                         mp::Error);
    CHECK_THROWS_WITH_AS(mp::apply_precision_map<mp::PureHalf<at::BFloat16>>(model, own),
                         doctest::Contains("declare it as mixprec::nn::Mappable<torch::nn::"
                                           "LayerNorm>, add keep_fp32(\"2\") to the map"),
                         mp::Error);
    // Nothing changed: the map applies without Output::own, and the model trains.
    mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap().keep_fp32("1"));
    CHECK(test::identical(test::snapshot(model->parameters()), before));
  }
  SUBCASE("through an activation and a BatchNorm kept fp32, to a Linear") {
    // ReLU passes fp32 on; BatchNorm's parameters stay fp32 under MixedO2, and its output takes
    // its input's dtype: the Linear after them reads fp32.
    torch::manual_seed(3);
    torch::nn::Sequential model(torch::nn::Linear(8, 16), mp::nn::Mappable<torch::nn::Linear>(16, 16),
                                torch::nn::ReLU(), torch::nn::BatchNorm1d(16),
                                torch::nn::Linear(16, 2));
    CHECK_THROWS_WITH_AS(mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, own),
                         doctest::Contains("module '4' (torch::nn::LinearImpl) computes in "
                                           "BFloat16"),
                         mp::Error);
  }
  SUBCASE("out of a nested Sequential, into the next module of the outer one") {
    torch::manual_seed(3);
    torch::nn::Sequential model(
        mp::nn::Mappable<torch::nn::Sequential>(torch::nn::Linear(8, 16),
                                                mp::nn::Mappable<torch::nn::Linear>(16, 16)),
        torch::nn::Linear(16, 2));
    CHECK_THROWS_WITH_AS(
        mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(
            model, mp::PrecisionMap().keep_fp32("0.1", mp::Output::own)),
        doctest::Contains("module '1' (torch::nn::LinearImpl) computes in BFloat16 under "
                          "MixedO2<BFloat16> and reads, through the Sequential around it, the "
                          "Float output that module '0.1' keeps"),
        mp::Error);
  }
  SUBCASE("read by a Mappable kept fp32, or by nothing, it is fine") {
    auto model = make(torch::nn::AnyModule(mp::nn::Mappable<torch::nn::Linear>(16, 16)));
    CHECK(mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(model, mp::PrecisionMap()
              .keep_fp32("1", mp::Output::own).keep_fp32("2")).size() == 2);
    torch::manual_seed(3);
    torch::nn::Sequential last(torch::nn::Linear(8, 16), mp::nn::Mappable<torch::nn::Linear>(16, 2));
    CHECK(mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(last, own).size() == 1);
    // Under MixedO1 autocast casts what the next module reads: nothing to check.
    auto o1 = make(torch::nn::AnyModule(torch::nn::LayerNorm(torch::nn::LayerNormOptions({16}))));
    CHECK(mp::apply_precision_map<mp::MixedO1<at::BFloat16>>(o1, own).size() == 1);
  }
}

TEST_CASE("an output kept fp32 read by a Low module in the user's forward: an Error in the first "
          "step, naming both") {
  // The Encoder's forward reads proj's output through `h + tanh(proj(h))` (fp32 by type
  // promotion) in norm1, a plain LayerNorm in bf16: only the forward pass says so.
  auto model = encoder();
  mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(
      model, mp::PrecisionMap().keep_fp32("proj", mp::Output::own));
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, optimizer);
  const auto before = test::snapshot(trainer.master_weights());
  const auto [x, y] = encoder_batch(1);
  const auto loss = [&, &x = x, &y = y] {
    return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
  };
#ifdef NDEBUG
  CHECK_THROWS_WITH_AS(trainer.step(loss),
                       doctest::Contains("module 'norm1' (torch::nn::LayerNormImpl) computes in "
                                         "BFloat16 and reads the Float output that module "
                                         "'proj' keeps with Output::own"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(trainer.evaluate([&, &x = x] { return model->forward(trainer.cast_input(x)); }),
                       doctest::Contains("declare it as mixprec::nn::Mappable<torch::nn::"
                                         "LayerNorm>, add keep_fp32(\"norm1\") to the map"),
                       mp::Error);
#else
  // A build without NDEBUG cannot see the ops' inputs (diagnostics.hpp): the region only.
  CHECK_THROWS_WITH_AS(trainer.step(loss),
                       doctest::Contains("the forward pass failed after module 'proj' handed its "
                                         "Float output (Output::own) to BFloat16 computation"),
                       mp::Error);
#endif
  CHECK(test::identical(test::snapshot(trainer.master_weights()), before));
  CHECK(trainer.stats().steps == 0);
}

TEST_CASE("the forward-pass check follows a kept output to whatever reads it" *
          doctest::skip(!mp::mixed_dtype_norms)) {
  // norm1 kept fp32 reads proj's fp32 output (a plain norm layer on LibTorch 2.x), but its own
  // output stays fp32 too, and the next Low module to read it, ffn.0, is the one named.
  auto model = encoder();
  mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(
      model, mp::PrecisionMap().keep_fp32("proj", mp::Output::own).keep_fp32("norm1"));
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, optimizer);
  const auto [x, y] = encoder_batch(1);
  const auto step = [&, &x = x, &y = y] {
    return trainer.step([&] {
      return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
    });
  };
#ifdef NDEBUG
  CHECK_THROWS_WITH_AS(step(), doctest::Contains("module 'ffn.0' (torch::nn::LinearImpl) computes "
                                                 "in BFloat16 and reads the Float output that "
                                                 "module 'proj' keeps"),
                       mp::Error);
#else
  CHECK_THROWS_AS(step(), mp::Error);
#endif
  // Following the fixes the Errors name, module by module, down to the head, whose output goes
  // back to bf16: the step runs.
  auto fixed = encoder();
  mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(
      fixed, mp::PrecisionMap().keep_fp32("proj", mp::Output::own).keep_fp32("norm1")
                 .keep_fp32("ffn.0").keep_fp32("norm2").keep_fp32("head"));
  CHECK(train_encoder<mp::MixedO2<at::BFloat16>>(fixed, 2).size() == 2);
}

TEST_CASE("the forward-pass check: code of the user's own, and errors that are no dtype mix") {
  // `big` keeps its output fp32; the forward multiplies it with a bf16 activation, or fails
  // for another reason after it.
  struct Net : torch::nn::Module {
    mp::nn::Mappable<torch::nn::Linear> big{8, 8};
    torch::nn::Linear out{8, 8};
    bool mix = true;
    Net() {
      register_module("big", big);
      register_module("out", out);
    }
    at::Tensor forward(const at::Tensor& x) {
      const auto h = out->forward(x);
      const auto kept = big->forward(x);
      if (mix) return at::mm(kept, h.t());
      return at::mm(h, torch::ones({3, 3}, h.options()));  // a shape error, bf16 alone
    }
  };
  torch::manual_seed(0);
  auto model = std::make_shared<Net>();
  mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(
      model, mp::PrecisionMap().keep_fp32("big", mp::Output::own));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, optimizer);
  const auto x = torch::randn({4, 8});
  const auto loss = [&] { return model->forward(trainer.cast_input(x)).to(at::kFloat).sum(); };
#ifdef NDEBUG
  CHECK_THROWS_WITH_AS(trainer.step(loss),
                       doctest::Contains("which read the Float output that module 'big' keeps "
                                         "(Output::own) together with a BFloat16 tensor that no "
                                         "submodule holds (code of your own)"),
                       mp::Error);
  model->mix = false;  // no op read fp32 and bf16 together: LibTorch's error as it is
  CHECK_THROWS_WITH_AS(trainer.step(loss), doctest::Contains("mat1 and mat2 shapes cannot be "
                                                             "multiplied"), c10::Error);
#else
  CHECK_THROWS_AS(trainer.step(loss), mp::Error);
#endif
}

}  // namespace test_nn
