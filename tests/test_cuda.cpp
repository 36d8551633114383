// CUDA: Half policies end to end, the fused ATen kernels against the CPU path, real overflows.
// Built as mixprec_cuda_tests; ctest's cuda_tests runs it with --require-cuda, which reports
// "not run" without a GPU. scripts/gpu-check runs it on a GPU machine.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <limits>

namespace mp = mixprec;

namespace {

torch::nn::Sequential cuda_mlp() {
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                                     torch::nn::BatchNorm1d(64), torch::nn::Linear(64, 4));
  model->to(torch::kCUDA);
  return model;
}

template <class P>
void trains_on_cuda(mp::TrainerOptions options = {}) {
  auto model = cuda_mlp();
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  mp::Trainer<P> trainer(model, adam, options);
  torch::manual_seed(1);
  const auto x = torch::randn({256, 32}, torch::kCUDA);
  const auto y = x.slice(1, 0, 4).argmax(1);
  double first = 0, last = 0;
  int stepped = 0;
  for (int i = 0; i < 200; ++i) {
    const auto r = trainer.step([&] {
      return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
    });
    stepped += r.stepped() ? 1 : 0;
    if (i == 0) first = r.loss.template item<double>();
    last = r.loss.template item<double>();
  }
  CHECK(stepped >= 190);
  CHECK(last < 0.5 * first);
  for (const auto& p : model->parameters()) CHECK(at::isfinite(p).all().template item<bool>());
}

}  // namespace

TEST_SUITE("cuda") {
  TEST_CASE("Half policies train end to end on CUDA") {
    SUBCASE("MixedO1<Half>: autocast") { trains_on_cuda<mp::MixedO1<at::Half>>(); }
    SUBCASE("MixedO2<Half>: fp32 masters") { trains_on_cuda<mp::MixedO2<at::Half>>(); }
    SUBCASE("PureHalf<Half>") { trains_on_cuda<mp::PureHalf<at::Half>>(); }
    SUBCASE("MixedO1<BFloat16>") { trains_on_cuda<mp::MixedO1<at::BFloat16>>(); }
    SUBCASE("MixedO2<Half> with accumulation and clipping") {
      trains_on_cuda<mp::MixedO2<at::Half>>(
          mp::TrainerOptions().accumulation_steps(2).max_grad_norm(1.0));
    }
  }

  TEST_CASE("real overflows: a huge initial scale backs off until steps succeed") {
    auto model = cuda_mlp();
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01));
    mp::Trainer<mp::MixedO1<at::Half>> trainer(
        model, sgd, mp::TrainerOptions().scaler(mp::GradScalerOptions().init_scale(std::ldexp(1.0, 40))));
    const auto x = torch::randn({64, 32}, torch::kCUDA);
    const auto y = torch::zeros({64}, torch::dtype(torch::kLong).device(torch::kCUDA));
    int skipped = 0;
    for (int i = 0; i < 40; ++i) {
      const auto r = trainer.step([&] {
        return torch::nn::functional::cross_entropy(model->forward(x), y);
      });
      skipped += r.status == mp::StepStatus::skipped ? 1 : 0;
    }
    CHECK(skipped >= 1);
    CHECK(trainer.stats().skipped_steps == skipped);
    CHECK(trainer.stats().scale < std::ldexp(1.0, 40));
    for (const auto& p : model->parameters()) CHECK(at::isfinite(p).all().item<bool>());
  }

  TEST_CASE("the fused CUDA unscale equals the CPU path, inf/NaN included") {
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      for (const bool poison : {false, true}) {
        torch::manual_seed(3);
        std::vector<at::Tensor> cpu_params, cuda_params;
        for (int i = 0; i < 12; ++i) {
          auto g = (torch::randn({1000 + 37 * i}) * 1024).to(dtype);
          if (poison && i == 7) g[5] = std::numeric_limits<float>::infinity();
          auto p = torch::zeros_like(g).requires_grad_();
          p.mutable_grad() = g.clone();
          cpu_params.push_back(p);
          auto q = torch::zeros_like(g, torch::kCUDA).requires_grad_();
          q.mutable_grad() = g.to(torch::kCUDA);
          cuda_params.push_back(q);
        }
        torch::optim::SGD cpu_opt(cpu_params, torch::optim::SGDOptions(0.1));
        torch::optim::SGD cuda_opt(cuda_params, torch::optim::SGDOptions(0.1));
        mp::GradScaler cpu_scaler(mp::GradScalerOptions().init_scale(1024));
        mp::GradScaler cuda_scaler(mp::GradScalerOptions().init_scale(1024));
        (void)cpu_scaler.scale(torch::zeros({}));
        (void)cuda_scaler.scale(torch::zeros({}, torch::kCUDA));
        CHECK(cpu_scaler.step(cpu_opt) == cuda_scaler.step(cuda_opt));
        if (!poison) {
          for (std::size_t i = 0; i < cpu_params.size(); ++i) {
            CHECK(cpu_params[i].grad().equal(cuda_params[i].grad().cpu()));
            CHECK(cpu_params[i].equal(cuda_params[i].cpu()));
          }
        }
        cpu_scaler.update();
        cuda_scaler.update();
        CHECK(cpu_scaler.get_scale() == cuda_scaler.get_scale());
      }
    }
  }

  TEST_CASE("the fused CUDA scale update never grows to inf") {
    const double big = std::ldexp(1.0, 127);
    auto w = torch::ones({2}, torch::dtype(torch::kFloat).device(torch::kCUDA).requires_grad(true));
    torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.0));
    mp::GradScaler scaler(mp::GradScalerOptions().init_scale(big).growth_interval(1));
    scaler.scale(w.sum()).backward();
    CHECK(scaler.step(sgd));
    scaler.update();
    CHECK(scaler.get_scale() == big);
    CHECK(scaler.growth_tracker() == 0);
  }
}
