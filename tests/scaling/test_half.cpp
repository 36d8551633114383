// Half policies on the CPU. LibTorch 2.x computes fp16 there, so dynamic loss scaling runs end to
// end with real overflows and underflows (the cases shared with the CUDA suite, device_cases.hpp).
// LibTorch 1.13 has no CPU fp16 math: there every Half policy is a clear Error, raised before the
// model or the optimizer is touched.
#include <mixprec/mixprec.hpp>

#include "device_cases.hpp"
#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

namespace test_half {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

// Each case runs where it can and is reported as skipped where it cannot (doctest's skip
// decorator): the fp16 cases under LibTorch 1.13, the 1.13 refusal under 2.x.
namespace {
const auto needs_half_math = doctest::skip(!mp::cpu_half_math);
const auto needs_no_half_math = doctest::skip(mp::cpu_half_math);
}  // namespace

TEST_CASE_TEMPLATE("Half policies train end to end on the CPU" * needs_half_math, P, mp::MixedO1<at::Half>,
                   mp::MixedO2<at::Half>, mp::PureHalf<at::Half>) {
  test::trains_end_to_end<P>(torch::kCPU);
}

TEST_CASE("MixedO2<Half> on the CPU with accumulation and clipping" * needs_half_math) {
  test::trains_end_to_end<mp::MixedO2<at::Half>>(
      torch::kCPU, mp::TrainerOptions().accumulation_steps(2).max_grad_norm(1.0));
}

TEST_CASE_TEMPLATE("real fp16 overflow on the CPU: backs off through skipped steps" * needs_half_math, P,
                   mp::MixedO1<at::Half>, mp::MixedO2<at::Half>) {
  test::backs_off_from_real_overflow<P>(torch::kCPU);
}

TEST_CASE_TEMPLATE("real fp16 underflow on the CPU: lost unscaled, rescued by the scaler" * needs_half_math, P,
                   mp::MixedO1<at::Half>, mp::MixedO2<at::Half>) {
  test::rescues_real_underflow<P>(torch::kCPU);
}

TEST_CASE("PureHalf<Half> refuses an optimizer eps that is 0 in fp16, before anything changes" * needs_half_math) {
  // Adam's default 1e-8 rounds to 0 in fp16: reproduce the corruption it causes by hand first.
  CHECK(static_cast<float>(c10::Half(1e-8F)) == 0.0F);
  for (const double eps : {1e-8, 1e-10}) {
    CAPTURE(eps);
    auto model = test::half_mlp(torch::kCPU);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2).eps(eps));
    const auto before = test::snapshot(model->parameters());
    CHECK_THROWS_WITH_AS(mp::Trainer<mp::PureHalf<at::Half>>(model, adam),
                         doctest::Contains("is 0 in fp16"), mp::Error);
    CHECK(test::identical(test::snapshot(model->parameters()), before));
  }
  auto model = test::half_mlp(torch::kCPU);
  torch::optim::RMSprop rmsprop(model->parameters(), torch::optim::RMSpropOptions(1e-3));
  CHECK_THROWS_AS(mp::Trainer<mp::PureHalf<at::Half>>(model, rmsprop), mp::Error);
  // An eps fp16 holds is accepted, and so is the default under fp32 masters or bf16.
  torch::optim::Adam ok(model->parameters(), torch::optim::AdamOptions(1e-2).eps(1e-4));
  CHECK_NOTHROW(mp::Trainer<mp::PureHalf<at::Half>>(model, ok));
  // A late param group is checked too, at the step that adopts it.
  {
    auto late = torch::nn::Linear(4, 2);
    torch::optim::Adam adam(std::vector<at::Tensor>{late->weight},
                            torch::optim::AdamOptions(1e-2).eps(1e-4));
    mp::Trainer<mp::PureHalf<at::Half>> trainer(late, adam);
    // Not eps 1e-8: LibTorch 2.x replaces a late group's options that equal AdamOptions'
    // defaults by the optimizer's own.
    adam.add_param_group(torch::optim::OptimizerParamGroup(
        {late->bias}, std::make_unique<torch::optim::AdamOptions>(
                          torch::optim::AdamOptions(1e-2).eps(1e-10))));
    const auto x = torch::ones({1, 4}, torch::kHalf);
    CHECK_THROWS_WITH_AS(trainer.step([&] { return late->forward(x).sum(); }),
                         doctest::Contains("is 0 in fp16"), mp::Error);
  }
  auto other = test::half_mlp(torch::kCPU);
  torch::optim::Adam masters(other->parameters(), torch::optim::AdamOptions(1e-2));
  CHECK_NOTHROW(mp::Trainer<mp::MixedO2<at::Half>>(other, masters));
}

TEST_CASE("the scale grows after growth_interval clean fp16 steps on the CPU" * needs_half_math) {
  test::grows_after_clean_steps<mp::MixedO1<at::Half>>(torch::kCPU);
}

TEST_CASE_TEMPLATE("Half policies on a CPU without fp16 math: an Error before anything changes" *
                       needs_no_half_math, P,
                   mp::MixedO1<at::Half>, mp::MixedO2<at::Half>, mp::PureHalf<at::Half>) {
  auto model = test::half_mlp(torch::kCPU);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  const auto before = test::snapshot(model->parameters());
  CHECK_THROWS_WITH_AS(mp::Trainer<P>(model, sgd), doctest::Contains("no fp16 math on the CPU"),
                       mp::Error);
  CHECK(test::identical(test::snapshot(model->parameters()), before));  // dtypes included
  CHECK(sgd.param_groups().front().params().front().is_same(model->parameters().front()));
}

TEST_CASE("the scale update never grows to inf on the CPU") { test::never_grows_to_inf(torch::kCPU); }

}  // namespace test_half
