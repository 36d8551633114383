#pragma once
// Half-precision training cases that hold on any device with fp16 math: CUDA (tests/test_cuda.cpp)
// and, from LibTorch 2.4 on, the CPU (tests/scaling/test_half.cpp). Real fp16 forward and backward passes,
// no synthetic gradients.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

namespace test {

namespace mp = mixprec;

inline torch::nn::Sequential half_mlp(torch::Device device) {
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                                     torch::nn::BatchNorm1d(64), torch::nn::Linear(64, 4));
  model->to(device);
  return model;
}

/// The dtype policy P gives the model's Linear weights: fp32 for O1, Low for O2/O3.
template <class P>
constexpr at::ScalarType weight_dtype = P::cast_model ? P::low_dtype : at::kFloat;

/// 200 steps of a small classifier: the loss halves, every weight stays finite, and the forward
/// pass really computes in the policy's precision (logits in Low, the weights as P casts them).
template <class P>
void trains_end_to_end(torch::Device device, mp::TrainerOptions options = {}) {
  auto model = half_mlp(device);
  // Adam's state is in Low without masters: fp16 needs an eps it can represent (Trainer refuses
  // the default 1e-8, which is 0 in fp16).
  constexpr bool fp16_state = P::cast_model && !P::master_weights && P::low_dtype == at::kHalf;
  torch::optim::Adam adam(model->parameters(),
                          torch::optim::AdamOptions(1e-2).eps(fp16_state ? 1e-4 : 1e-8));
  mp::Trainer<P> trainer(model, adam, options);
  auto* first_linear = model[0]->template as<torch::nn::Linear>();
  REQUIRE(first_linear != nullptr);
  CHECK(first_linear->weight.scalar_type() == weight_dtype<P>);
  torch::manual_seed(1);
  const auto x = torch::randn({256, 32}, device);
  const auto y = x.slice(1, 0, 4).argmax(1);
  double first = 0, last = 0;
  int stepped = 0;
  at::ScalarType logits_dtype = at::kDouble;
  for (int i = 0; i < 200; ++i) {
    const auto r = trainer.step([&] {
      const auto logits = model->forward(trainer.cast_input(x));
      logits_dtype = logits.scalar_type();
      return torch::nn::functional::cross_entropy(logits, y);
    });
    stepped += r.stepped() ? 1 : 0;
    if (i == 0) first = r.loss.template item<double>();
    last = r.loss.template item<double>();
  }
  CHECK(logits_dtype == P::low_dtype);  // autocast (O1) or the cast model (O2/O3) engaged
  CHECK(stepped >= 190 / options.accumulation_steps());  // 200 micro-batches
  CHECK(last < 0.5 * first);
  CHECK(first_linear->weight.scalar_type() == weight_dtype<P>);
  for (const auto& p : model->parameters()) CHECK(at::isfinite(p).all().template item<bool>());
}

/// A huge initial scale overflows fp16 for real: the scaler backs off through skipped steps, and a
/// skipped step leaves every parameter bitwise as it was, until the scale works.
template <class P>
void backs_off_from_real_overflow(torch::Device device) {
  auto model = half_mlp(device);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01));
  const double init = std::ldexp(1.0, 40);
  mp::Trainer<P> trainer(model, sgd,
                         mp::TrainerOptions().scaler(mp::GradScalerOptions().init_scale(init)));
  torch::manual_seed(2);
  const auto x = torch::randn({64, 32}, device);
  const auto y = torch::zeros({64}, torch::dtype(torch::kLong).device(device));
  int skipped = 0, stepped = 0;
  double expected_scale = init;
  for (int i = 0; i < 40; ++i) {
    const auto before = snapshot(model->parameters());
    const auto masters_before = snapshot(trainer.master_weights());
    const auto r = trainer.step([&] {
      return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
    });
    CHECK(r.scale == expected_scale);
    if (r.status == mp::StepStatus::skipped) {
      ++skipped;
      expected_scale *= 0.5;
      // BatchNorm's running statistics move in every forward pass; the trained tensors do not.
      CHECK(identical(snapshot(model->parameters()), before));
      CHECK(identical(snapshot(trainer.master_weights()), masters_before));
    } else {
      ++stepped;
    }
    CHECK(trainer.stats().scale == expected_scale);
  }
  CHECK(skipped >= 10);  // 2^40 * (backward of fp16 logits) overflows for many halvings
  CHECK(stepped >= 10);
  CHECK(trainer.stats().skipped_steps == skipped);
  for (const auto& p : model->parameters()) CHECK(at::isfinite(p).all().template item<bool>());
}

/// A loss so small that its fp16 gradients flush to zero: 2^-26 is below fp16's smallest
/// subnormal (2^-24). Unscaled, the weights never move; with a scale of 2^16 the gradient 2^-10
/// survives the fp16 backward, and the fp32 weight (O1) or master (O2) moves by exactly
/// lr * 2^-26 per step. Dyadic values throughout, so the comparisons are exact.
template <class P>
void rescues_real_underflow(torch::Device device) {
  for (const bool scaled : {false, true}) {
    CAPTURE(scaled);
    auto linear = torch::nn::Linear(torch::nn::LinearOptions(4, 1).bias(false));
    {
      torch::NoGradGuard no_grad;
      linear->weight.fill_(1.0);
    }
    linear->to(device);
    torch::optim::SGD sgd(linear->parameters(), torch::optim::SGDOptions(1024.0));
    auto scaler = scaled ? mp::GradScalerOptions().init_scale(65536.0).growth_interval(1 << 30)
                         : mp::GradScalerOptions().enabled(false);
    mp::Trainer<P> trainer(linear, sgd, mp::TrainerOptions().scaler(scaler));
    const auto x = torch::ones({1, 4}, device);
    for (int step = 1; step <= 3; ++step) {
      const auto r = trainer.step([&] {
        const auto out = linear->forward(trainer.cast_input(x));
        REQUIRE(out.scalar_type() == at::kHalf);  // the backward of this output is fp16
        return out.to(at::kFloat).sum() * std::ldexp(1.0, -26);
      });
      CHECK(r.stepped());
      const auto weights = P::master_weights ? trainer.master_weights().front() : linear->weight;
      REQUIRE(weights.scalar_type() == at::kFloat);
      const double expected = scaled ? 1.0 - step * std::ldexp(1.0, -16) : 1.0;
      CHECK((weights.detach().cpu() == expected).all().template item<bool>());
    }
  }
}

/// growth_interval clean steps grow the scale by growth_factor, on real fp16 gradients.
template <class P>
void grows_after_clean_steps(torch::Device device) {
  auto model = half_mlp(device);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01));
  mp::Trainer<P> trainer(
      model, sgd,
      mp::TrainerOptions().scaler(mp::GradScalerOptions().init_scale(1024).growth_interval(3)));
  torch::manual_seed(4);
  const auto x = torch::randn({64, 32}, device);
  const auto y = x.slice(1, 0, 4).argmax(1);
  for (int i = 0; i < 9; ++i) {
    const auto r = trainer.step([&] {
      return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
    });
    REQUIRE(r.stepped());
    CHECK(r.scale == 1024.0 * std::exp2(i / 3));        // the scale this step used
    CHECK(trainer.stats().scale == 1024.0 * std::exp2((i + 1) / 3));  // after its update
  }
}

/// The scale update never grows the scale to inf, on any device.
inline void never_grows_to_inf(torch::Device device) {
  const double big = std::ldexp(1.0, 127);
  auto w = torch::ones({2}, torch::dtype(torch::kFloat).device(device).requires_grad(true));
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.0));
  mp::GradScaler scaler(mp::GradScalerOptions().init_scale(big).growth_interval(1));
  scaler.scale(w.sum()).backward();
  CHECK(scaler.step(sgd));
  scaler.update();
  CHECK(scaler.get_scale() == big);
  CHECK(scaler.growth_tracker() == 0);
}

}  // namespace test
