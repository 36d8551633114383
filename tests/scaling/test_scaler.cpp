// GradScaler, StaticScaler, NoScaler: PyTorch parity (algorithm, errors, state_dict), the one-pass
// unscale on CPU, per-optimizer skipping, fused clipping. Power-of-two scales make scaled and
// unscaled training bit-identical, so most comparisons are exact.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace test_scaler {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// An optimizer over given tensors, for raw unscale tests.
torch::optim::SGD sgd_over(const std::vector<at::Tensor>& params, double lr = 0.1) {
  return torch::optim::SGD(params, torch::optim::SGDOptions(lr));
}

at::Tensor param_with_grad(const at::Tensor& grad) {
  auto p = torch::zeros_like(grad).requires_grad_();
  p.mutable_grad() = grad;
  return p;
}

// Two small linear models with their data: enough to exercise several params and optimizers.
struct Setup {
  torch::nn::Sequential model1{torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 8)};
  torch::nn::Sequential model2{torch::nn::Linear(8, 8)};
  std::vector<std::pair<at::Tensor, at::Tensor>> data;

  explicit Setup(std::uint64_t seed = 7) {
    torch::manual_seed(seed);
    model1 = torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 8));
    model2 = torch::nn::Sequential(torch::nn::Linear(8, 8));
    for (int i = 0; i < 6; ++i) data.emplace_back(torch::randn({4, 8}), torch::randn({4, 8}));
  }
  std::vector<at::Tensor> params() const {
    auto p = model1->parameters();
    for (auto& q : model2->parameters()) p.push_back(q);
    return p;
  }
};

// Every dtype and size: a clean gradient (reference * scale), then the same with inf, -inf or
// NaN at the start, the middle and the end; check(reference, grad, clean) for each.
template <class Check>
void for_each_injection(const std::vector<at::ScalarType>& dtypes,
                        const std::vector<std::int64_t>& sizes, float scale, Check&& check) {
  for (const auto dtype : dtypes) {
    for (const std::int64_t n : sizes) {
      CAPTURE(dtype);
      CAPTURE(n);
      torch::manual_seed(n);
      const auto reference = torch::randn({n}).to(dtype);
      for (const std::int64_t bad_at : {std::int64_t{-1}, std::int64_t{0}, n / 2, n - 1}) {
        for (const float bad_value : {kInf, -kInf, kNaN}) {
          auto grad = (reference * scale).contiguous();
          if (bad_at >= 0) grad[bad_at] = bad_value;
          check(reference, grad, bad_at < 0);
          if (bad_at < 0) break;  // one clean run per size
        }
      }
    }
  }
}

// PyTorch's _run_scaling_case: train with a scaler, inject inf at `skip_iter`; the result must
// equal a NoScaler run with the same injection (both skip that step), bit for bit.
template <class Scaler, class Run>
void check_against_control(Run run, Scaler scaler, int unskipped, int skipped, double init_scale) {
  Setup control_setup, scaled_setup;
  mp::NoScaler control_scaler;
  run(control_setup, control_scaler);
  run(scaled_setup, scaler);
  CHECK(test::identical(control_setup.params(), scaled_setup.params()));
  if (scaler.is_enabled()) {
    CHECK(scaler.get_scale() == init_scale * std::pow(2.0, unskipped) * std::pow(0.5, skipped));
  } else {
    CHECK(scaler.get_scale() == 1.0);
  }
}

mp::GradScaler growth_every_step(bool enabled) {
  return mp::GradScaler(mp::GradScalerOptions().init_scale(128.0).growth_interval(1).enabled(enabled));
}

}  // namespace

TEST_CASE("the scale trace of DESIGN 4 (PyTorch's _amp_update_scale_)") {
  const auto options = mp::GradScalerOptions().init_scale(8).growth_interval(3);
  const int overflow[] = {0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0};
  const float scales[] = {8, 8, 16, 8, 8, 8, 16, 16, 8, 4, 4, 4, 8};
  const int trackers[] = {1, 2, 0, 0, 1, 2, 0, 1, 0, 0, 1, 2, 0};

  SUBCASE("the pure update function") {
    mp::detail::ScaleState s{8.0F, 0, 1};
    for (int i = 0; i < 13; ++i) {
      s = mp::detail::next_scale(s, overflow[i] != 0, options);
      CHECK(s.scale == scales[i]);
      CHECK(s.growth_tracker == trackers[i]);
    }
  }
  SUBCASE("through scale, backward, step and update") {
    auto w = torch::ones({3}, torch::requires_grad());
    auto opt = sgd_over({w}, 0.0);
    mp::GradScaler scaler(options);
    for (int i = 0; i < 13; ++i) {
      opt.zero_grad();
      scaler.scale((w * 2).sum()).backward();
      if (overflow[i]) w.mutable_grad()[1] = kInf;
      CHECK(scaler.step(opt) == (overflow[i] == 0));
      scaler.update();
      CHECK(scaler.get_scale() == scales[i]);
      CHECK(scaler.growth_tracker() == trackers[i]);
    }
    CHECK(scaler.skipped_steps() == 3);
  }
}

TEST_CASE("hysteresis follows Megatron-LM: overflows tolerated until it runs out, refilled on growth") {
  // hysteresis 2, interval 3: the first overflow after a refill costs nothing but the tracker.
  const auto options = mp::GradScalerOptions().init_scale(8).growth_interval(3).hysteresis(2);
  const int overflow[] = {1, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 1};
  const int hysteresis_left[] = {1, 1, 0, -1, -1, -1, 2, 1, 1, 1, 2, 1, 0};
  const float scales[] = {8, 8, 4, 2, 2, 2, 4, 4, 4, 4, 8, 8, 4};
  const int trackers[] = {0, 1, 0, 0, 1, 2, 0, 0, 1, 2, 0, 0, 0};
  mp::detail::ScaleState s{8.0F, 0, 2};
  for (int i = 0; i < 13; ++i) {
    s = mp::detail::next_scale(s, overflow[i] != 0, options);
    CHECK(s.scale == scales[i]);
    CHECK(s.growth_tracker == trackers[i]);
    CHECK(s.hysteresis_tracker == hysteresis_left[i]);
  }
  // The same trace through scale, backward, step and update, with real gradients.
  auto w = torch::ones({3}, torch::requires_grad());
  auto opt = sgd_over({w}, 0.0);
  mp::GradScaler scaler(options);
  for (int i = 0; i < 13; ++i) {
    opt.zero_grad();
    scaler.scale((w * 2).sum()).backward();
    if (overflow[i]) w.mutable_grad()[1] = kNaN;
    CHECK(scaler.step(opt) == (overflow[i] == 0));
    scaler.update();
    CHECK(scaler.get_scale() == scales[i]);
    CHECK(scaler.growth_tracker() == trackers[i]);
    CHECK(scaler.hysteresis_tracker() == hysteresis_left[i]);
  }
  // With hysteresis 1 the same sequence is PyTorch's: every overflow backs off.
  mp::detail::ScaleState p{8.0F, 0, 1};
  const auto pytorch = mp::GradScalerOptions().init_scale(8).growth_interval(3);
  for (int i = 0; i < 13; ++i) p = mp::detail::next_scale(p, overflow[i] != 0, pytorch);
  CHECK(p.scale == 0.5F);
}

TEST_CASE("min_scale and max_scale bound the scale; it never grows to inf") {
  SUBCASE("bounds") {
    const auto options =
        mp::GradScalerOptions().init_scale(4).growth_interval(1).min_scale(2).max_scale(8);
    mp::detail::ScaleState s{4.0F, 0, 1};
    s = mp::detail::next_scale(s, true, options);
    s = mp::detail::next_scale(s, true, options);
    CHECK(s.scale == 2.0F);
    for (int i = 0; i < 5; ++i) s = mp::detail::next_scale(s, false, options);
    CHECK(s.scale == 8.0F);
  }
  SUBCASE("bounds through update(), with real gradients") {
    auto w = torch::ones({3}, torch::requires_grad());
    auto opt = sgd_over({w}, 0.0);
    mp::GradScaler scaler(
        mp::GradScalerOptions().init_scale(4).growth_interval(1).min_scale(2).max_scale(8));
    const int overflow[] = {1, 1, 1, 0, 0, 0, 0, 1};
    const double scales[] = {2, 2, 2, 4, 8, 8, 8, 4};
    for (int i = 0; i < 8; ++i) {
      opt.zero_grad();
      scaler.scale(w.sum()).backward();
      if (overflow[i]) w.mutable_grad()[0] = kInf;
      CHECK(scaler.step(opt) == (overflow[i] == 0));
      scaler.update();
      CHECK(scaler.get_scale() == scales[i]);
    }
  }
  SUBCASE("will not overflow: 2^127 * 2 is inf in fp32, so the scale stays") {
    const double big = std::ldexp(1.0, 127);
    auto w = torch::ones({2}, torch::requires_grad());
    auto opt = sgd_over({w}, 0.0);
    mp::GradScaler scaler(mp::GradScalerOptions().init_scale(big).growth_interval(1));
    scaler.scale(w.sum()).backward();
    CHECK(scaler.step(opt));
    scaler.update();
    CHECK(scaler.get_scale() == big);
    CHECK(scaler.growth_tracker() == 0);
  }
}

TEST_CASE("raw unscale: values, strides, slices, inf/NaN anywhere, sizes around the grain") {
  const float scale = 4.0F;  // exact in every dtype
  for_each_injection({at::kFloat, at::kBFloat16, at::kDouble},
                     {1, 7, 32767, 32768, 32769, 65535, 65536, 65537, 200003}, scale,
                     [&](const at::Tensor& reference, const at::Tensor& grad, bool clean) {
    auto p = param_with_grad(grad);
    auto opt = sgd_over({p});
    mp::GradScaler scaler(mp::GradScalerOptions().init_scale(scale));
    (void)scaler.scale(torch::zeros({}));
    scaler.unscale_(opt);
    const bool stepped = scaler.step(opt);
    CHECK(stepped == clean);
    if (clean) {
      CHECK(p.grad().equal(reference));
      CHECK(p.grad().scalar_type() == reference.scalar_type());
    }
  });
}

TEST_CASE("the finiteness-only pass (NoScaler, no clipping): inf/NaN anywhere, every dtype, views") {
  // Without a scale or clipping the gradients are only read: a bit comparison, no sum of squares.
  const auto dtypes = mp::cpu_half_math ? std::vector<at::ScalarType>{at::kFloat, at::kBFloat16,
                                                                      at::kDouble, at::kHalf}
                                        : std::vector<at::ScalarType>{at::kFloat, at::kBFloat16,
                                                                      at::kDouble};
  for_each_injection(dtypes, {1, 15, 17, 32767, 32769, 65537}, 1.0F,
                     [](const at::Tensor&, const at::Tensor& grad, bool clean) {
    // The largest finite value of each dtype is finite: only inf and NaN count.
    if (clean && grad.numel() > 2) {
      const auto dtype = grad.scalar_type();
      grad[1] = dtype == at::kDouble ? std::numeric_limits<double>::max()
                                     : mp::ops::max_value_of_dtype(dtype);
      grad[2] = -grad[1];
    }
    auto p = param_with_grad(grad);
    auto opt = sgd_over({p});
    mp::NoScaler scaler;
    scaler.unscale_(opt);
    CHECK(scaler.step(opt) == clean);
  });
  SUBCASE("a transposed and a sliced gradient") {
    auto base = torch::randn({64, 48});
    auto transposed = param_with_grad(base.t());
    auto sliced_grad = torch::randn({64, 96});
    auto sliced = param_with_grad(sliced_grad.narrow(1, 0, 48));
    sliced_grad[63][47] = kNaN;  // inside the slice, in the last row
    auto opt = sgd_over({transposed, sliced});
    mp::NoScaler scaler;
    scaler.unscale_(opt);
    CHECK_FALSE(scaler.step(opt));
    scaler.update();
    sliced_grad[63][47] = 0.0F;
    sliced_grad[0][50] = kInf;  // outside the slice: not a gradient value
    scaler.unscale_(opt);
    CHECK(scaler.step(opt));
  }
}

TEST_CASE("the float finiteness pass finds inf and NaN at every position of its unrolled loops") {
  // The vector loops take 8 vectors per iteration, then single vectors, then single values:
  // every size up to past 2 x 8 x 16 floats and every position in them covers each part.
  for (std::int64_t n = 1; n <= 300; n += (n < 140 ? 1 : 7)) {
    auto grad = torch::randn({n}) * 1e30;  // large finite values stay finite
    grad[0] = std::numeric_limits<float>::max();
    CAPTURE(n);
    CHECK_FALSE(mp::detail::non_finite_cpu(grad));
    for (std::int64_t at = 0; at < n; ++at) {
      const float saved = grad[at].item<float>();
      for (const float bad : {kInf, -kInf, kNaN}) {
        grad[at] = bad;
        if (!mp::detail::non_finite_cpu(grad)) FAIL_CHECK("missed ", bad, " at ", at, " of ", n);
      }
      grad[at] = saved;
    }
  }
  // From an unaligned start (a slice of a larger buffer), as a parameter's view can be.
  auto buffer = torch::zeros({203});
  buffer[202] = kNaN;
  CHECK(mp::detail::non_finite_cpu(buffer.narrow(0, 3, 200)));
  CHECK_FALSE(mp::detail::non_finite_cpu(buffer.narrow(0, 3, 199)));
}

TEST_CASE("the de-duplication of the optimizer's tensors follows changes between iterations") {
  // The unscale pass keeps its index of each tensor's first listing while the optimizer lists
  // the same tensors; a tensor swapped in a group, of the same count, is seen.
  auto a = param_with_grad(torch::ones({3}));
  auto b = param_with_grad(torch::ones({3}));
  auto c = param_with_grad(torch::ones({3}));
  torch::optim::SGD opt(std::vector<torch::optim::OptimizerParamGroup>{
      torch::optim::OptimizerParamGroup({a, b}), torch::optim::OptimizerParamGroup({c})},
                        torch::optim::SGDOptions(0.1));
  mp::GradScaler scaler(mp::GradScalerOptions().init_scale(2.0));
  (void)scaler.scale(torch::zeros({}));
  scaler.unscale_(opt);
  CHECK(a.grad().equal(torch::full({3}, 0.5)));
  CHECK(scaler.step(opt));
  scaler.update();
  // c is now in both groups: refused, as on the first iteration it would have been.
  opt.param_groups()[0].params()[1] = c;
  (void)scaler.scale(torch::zeros({}));
  CHECK_THROWS_WITH_AS(scaler.unscale_(opt), doctest::Contains("is in param groups 0 and 1"),
                       mp::Error);
  scaler.reset_stages();
  // Listed twice in one group, it is unscaled once.
  opt.param_groups()[0].params()[1] = a;
  a.mutable_grad() = torch::full({3}, 4.0);
  scaler.unscale_(opt);
  CHECK(a.grad().equal(torch::full({3}, 2.0)));
}

TEST_CASE("raw unscale of transposed, sliced and many tensors of mixed dtypes") {
  torch::manual_seed(3);
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> expected;
  std::vector<std::vector<std::int64_t>> strides;
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kDouble};
  for (int i = 0; i < 120; ++i) {  // more than 110 tensors, as PyTorch's test
    auto base = torch::randn({37, 19}).to(dtypes[i % 3]);
    at::Tensor grad;
    if (i % 4 == 1) {
      grad = (base * 8).t();  // transposed: dense, not contiguous
    } else if (i % 4 == 2) {
      grad = (base * 8).slice(1, 2, 17, 3);  // sliced: gaps between elements
    } else {
      grad = base * 8;
    }
    expected.push_back(grad.detach().clone() / 8);
    strides.push_back(grad.strides().vec());
    params.push_back(param_with_grad(grad));
  }
  auto no_grad_param = torch::ones({3}, torch::requires_grad());  // no grad: skipped
  params.push_back(no_grad_param);
  auto opt = sgd_over(params);
  mp::GradScaler scaler(mp::GradScalerOptions().init_scale(8));
  (void)scaler.scale(torch::zeros({}));
  scaler.unscale_(opt);
  for (std::size_t i = 0; i < expected.size(); ++i) {
    CHECK(params[i].grad().equal(expected[i]));
    CHECK(params[i].grad().strides().vec() == strides[i]);  // the same view, written in place
  }
  CHECK_FALSE(no_grad_param.grad().defined());

  SUBCASE("an inf in a sliced view's gap is not part of the gradient") {
    auto storage = torch::ones({4, 4}) * 8;
    storage[0][1] = kInf;
    auto p = param_with_grad(storage.slice(1, 0, 4, 2));  // columns 0 and 2
    auto opt2 = sgd_over({p});
    mp::GradScaler s2(mp::GradScalerOptions().init_scale(8));
    (void)s2.scale(torch::zeros({}));
    CHECK(s2.step(opt2));
  }
}

TEST_CASE("fp16 gradients: refused in place unless allowed; overflow on unscale detected") {
  const auto grad = torch::full({4}, 8.0, torch::kHalf);
  SUBCASE("refused by default, with nothing changed") {
    auto p = param_with_grad(grad.clone());
    auto opt = sgd_over({p});
    mp::GradScaler scaler;
    (void)scaler.scale(torch::zeros({}));
    CHECK_THROWS_WITH_AS(scaler.unscale_(opt), doctest::Contains("allow_fp16_grads"), mp::Error);
    CHECK(p.grad().equal(grad));
    CHECK_THROWS_AS(scaler.step(opt), mp::Error);  // step unscales first: same refusal
    CHECK(p.equal(torch::zeros({4}, torch::kHalf)));
  }
  SUBCASE("allowed: exact for a dyadic scale") {
    auto p = param_with_grad(grad.clone());
    auto opt = sgd_over({p});
    mp::GradScaler scaler(mp::GradScalerOptions().init_scale(1024).allow_fp16_grads(true));
    (void)scaler.scale(torch::zeros({}));
    CHECK(scaler.step(opt));
    CHECK(p.grad().equal(torch::full({4}, 8.0 / 1024, torch::kHalf)));
  }
  SUBCASE("unscaling by a scale below 1 can overflow fp16: that step is skipped") {
    auto p = param_with_grad(torch::full({4}, 60000.0, torch::kHalf));
    auto opt = sgd_over({p});
    mp::GradScaler scaler(mp::GradScalerOptions().init_scale(0.5).min_scale(0.5).allow_fp16_grads(true));
    (void)scaler.scale(torch::zeros({}));
    CHECK_FALSE(scaler.step(opt));
    CHECK(p.equal(torch::zeros({4}, torch::kHalf)));
  }
  SUBCASE("NoScaler only checks fp16 gradients") {
    auto p = param_with_grad(grad.clone());
    auto opt = sgd_over({p});
    mp::NoScaler scaler;
    CHECK(scaler.step(opt));
    CHECK(p.grad().equal(grad));
  }
}

TEST_CASE("misuse is a mixprec::Error that changes nothing") {
  auto w = torch::ones({3}, torch::requires_grad());
  auto opt = sgd_over({w});
  mp::GradScaler scaler(mp::GradScalerOptions().init_scale(4));

  CHECK_THROWS_WITH_AS(scaler.unscale_(opt), doctest::Contains("before scale(loss)"), mp::Error);
  scaler.scale(w.sum()).backward();
  const auto grad = w.grad().clone();
  scaler.unscale_(opt);
  const auto unscaled = w.grad().clone();
  CHECK(unscaled.equal(grad / 4));
  CHECK_THROWS_WITH_AS(scaler.unscale_(opt), doctest::Contains("already been called"), mp::Error);
  CHECK(w.grad().equal(unscaled));  // not unscaled twice
  CHECK(scaler.step(opt));
  CHECK_THROWS_WITH_AS(scaler.step(opt), doctest::Contains("already been called"), mp::Error);
  CHECK_THROWS_WITH_AS(scaler.unscale_(opt), doctest::Contains("after step()"), mp::Error);
  const auto after_one_step = w.detach().clone();
  scaler.update();
  CHECK(w.equal(after_one_step));
  CHECK_THROWS_WITH_AS(scaler.update(), doctest::Contains("no inf checks"), mp::Error);
  CHECK(scaler.get_scale() == 4.0);

  SUBCASE("step without any gradient") {
    auto v = torch::ones({2}, torch::requires_grad());
    auto opt2 = sgd_over({v});
    (void)scaler.scale(v.sum());
    CHECK_THROWS_WITH_AS(scaler.step(opt2), doctest::Contains("no gradients"), mp::Error);
    // The failed step recorded nothing: after a backward the iteration goes on normally.
    scaler.scale(v.sum()).backward();
    CHECK(scaler.step(opt2));
  }
  SUBCASE("scale of nothing, or of an integer tensor") {
    CHECK_THROWS_AS(scaler.scale(at::Tensor()), mp::Error);
    CHECK_THROWS_WITH_AS(scaler.scale(torch::ones({}, torch::kLong)),
                         doctest::Contains("floating-point loss"), mp::Error);
  }
  SUBCASE("clipping to a bad norm") {
    scaler.scale(w.sum()).backward();
    CHECK_THROWS_AS(scaler.unscale_(opt, mp::UnscaleOptions().max_grad_norm(0.0)), mp::Error);
    CHECK_THROWS_AS(scaler.unscale_(opt, mp::UnscaleOptions().max_grad_norm(-1.0)), mp::Error);
    scaler.unscale_(opt);  // the failed calls recorded nothing
  }
}

TEST_CASE("invalid options are refused") {
  using O = mp::GradScalerOptions;
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().growth_factor(1.0)), doctest::Contains("growth_factor"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().growth_factor(0.5)), doctest::Contains("growth_factor"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().backoff_factor(1.0)), doctest::Contains("backoff_factor"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().backoff_factor(0.0)), doctest::Contains("backoff_factor"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().growth_interval(0)), doctest::Contains("growth_interval"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().init_scale(0.0)), doctest::Contains("init_scale"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().init_scale(kInf)), doctest::Contains("init_scale"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().init_scale(kNaN)), doctest::Contains("init_scale"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().hysteresis(0)), doctest::Contains("hysteresis"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().min_scale(10).init_scale(4)), doctest::Contains("min_scale"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().max_scale(2).init_scale(4)), doctest::Contains("max_scale"), mp::Error);
  CHECK_THROWS_AS(mp::StaticScaler(0.0), mp::Error);
  CHECK_THROWS_AS(mp::NoScaler().update(2.0), mp::Error);
}

TEST_CASE("regression: scales are validated as the fp32 values they are stored as") {
  using O = mp::GradScalerOptions;
  using doctest::Contains;
  // 1e39 is finite as a double but inf in fp32; 1e-46 is 0 in fp32, and a subnormal scale has
  // an infinite inverse: each would have wrecked every later step.
  for (const double bad : {1e39, 1e-46, 1e-40, -1.0}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(mp::GradScaler(O().init_scale(bad)),
                         Contains("init_scale must be a positive normal fp32 value"), mp::Error);
    CHECK_THROWS_WITH_AS(mp::StaticScaler{bad}, Contains("positive normal fp32 value"), mp::Error);
    mp::GradScaler scaler(O().init_scale(8));
    CHECK_THROWS_WITH_AS(scaler.update(bad), Contains("update(new_scale) must be a positive normal"),
                         mp::Error);
    CHECK(scaler.get_scale() == 8.0);
    mp::StaticScaler fixed(8.0);
    CHECK_THROWS_WITH_AS(fixed.update(bad), Contains("positive normal fp32"), mp::Error);
    CHECK(fixed.get_scale() == 8.0);
  }
  // fp32's largest and smallest normal values are fine.
  CHECK(mp::GradScaler(O().init_scale(3.4028234663852886e38)).get_scale() == 3.4028234663852886e38);
  CHECK(mp::GradScaler(O().init_scale(std::ldexp(1.0, -126))).get_scale() == std::ldexp(1.0, -126));
  // A scale that is not an fp32 value is rounded once, before and after the first scale().
  mp::GradScaler tenth(O().init_scale(0.1));
  CHECK(tenth.get_scale() == static_cast<double>(0.1F));
  (void)tenth.scale(torch::ones({}));
  CHECK(tenth.get_scale() == static_cast<double>(0.1F));
  // The bounds: 0 / +inf (no bound) or normal fp32 values.
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().min_scale(1e-46)), Contains("min_scale must be 0 or"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().min_scale(1e-40)), Contains("min_scale must be 0 or"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().max_scale(1e39)), Contains("max_scale must be +infinity"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(mp::GradScaler(O().min_scale(kNaN)), Contains("min_scale"), mp::Error);
  // Bounds are compared in fp32: float(0.1) is above 0.1, and that is the bound applied.
  CHECK_NOTHROW(mp::GradScaler(O().init_scale(static_cast<double>(0.1F)).max_scale(0.1)));
}

TEST_CASE("update(new_scale) sets the scale within the bounds and leaves the tracker alone") {
  auto w = torch::ones({2}, torch::requires_grad());
  auto opt = sgd_over({w}, 0.0);
  mp::GradScaler scaler(mp::GradScalerOptions().init_scale(64).growth_interval(4).min_scale(2).max_scale(
      1024));
  scaler.update(16);  // before the first scale(): the first scaled loss uses it
  CHECK(scaler.get_scale() == 16.0);
  for (int i = 0; i < 2; ++i) {
    opt.zero_grad();
    const auto scaled = scaler.scale(w.sum());
    CHECK(scaled.item<double>() == 2.0 * 16.0);
    scaled.backward();
    CHECK(scaler.step(opt));
    scaler.update();
  }
  CHECK(scaler.growth_tracker() == 2);
  scaler.update(32);
  CHECK(scaler.get_scale() == 32.0);
  CHECK(scaler.growth_tracker() == 2);  // as PyTorch: only the scale changes
  // Outside [min_scale, max_scale]: refused, nothing changed.
  CHECK_THROWS_WITH_AS(scaler.update(1.0), doctest::Contains("outside [min_scale, max_scale]"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(scaler.update(2048.0), doctest::Contains("outside [min_scale, max_scale]"),
                       mp::Error);
  CHECK(scaler.get_scale() == 32.0);
  // update(new_scale) ends the iteration: the inf checks recorded so far are dropped.
  opt.zero_grad();
  scaler.scale(w.sum()).backward();
  scaler.unscale_(opt);
  CHECK(w.grad().equal(torch::ones({2})));
  scaler.update(8);
  CHECK_THROWS_WITH_AS(scaler.update(), doctest::Contains("no inf checks"), mp::Error);
  opt.zero_grad();
  scaler.scale(w.sum()).backward();
  CHECK(w.grad().equal(torch::full({2}, 8.0)));
  CHECK(scaler.step(opt));
  scaler.update();
  CHECK(scaler.get_scale() == 8.0);
  CHECK(scaler.growth_tracker() == 3);

  SUBCASE("StaticScaler: update() keeps the scale, update(new_scale) sets it") {
    mp::StaticScaler fixed(4.0);
    for (const double next : {4.0, 0.5}) {
      opt.zero_grad();
      fixed.scale(w.sum()).backward();
      w.mutable_grad()[0] = kInf;
      CHECK_FALSE(fixed.step(opt));
      fixed.update();
      CHECK(fixed.get_scale() == 4.0);  // no backoff, whatever happened
      fixed.update(next);
      CHECK(fixed.get_scale() == next);
      fixed.update(4.0);
    }
    CHECK(fixed.skipped_steps() == 2);
  }
}

namespace {

// One iteration of a GradScaler with real gradients; `overflow` puts an inf into them.
struct ScalerRun {
  at::Tensor w = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD opt = sgd_over({w}, 0.0);
  void iterate(mp::GradScaler& scaler, bool overflow) {
    opt.zero_grad();
    scaler.scale(w.sum()).backward();
    if (overflow) w.mutable_grad()[0] = kInf;
    (void)scaler.step(opt);
    scaler.update();
  }
};

// Saves `scaler`, loads the dict into a fresh scaler with `options`, then runs both through
// the same overflow pattern: the states must agree at every step.
void check_round_trip(mp::GradScaler& scaler, const mp::GradScalerOptions& options) {
  mp::GradScaler restored(options);
  REQUIRE_NOTHROW(restored.load_state_dict(scaler.state_dict()));
  ScalerRun a, b;
  for (const bool overflow : {false, true, false, false, true, true, false, false, false}) {
    CHECK(restored.get_scale() == scaler.get_scale());
    CHECK(restored.growth_tracker() == scaler.growth_tracker());
    CHECK(restored.hysteresis_tracker() == scaler.hysteresis_tracker());
    a.iterate(scaler, overflow);
    b.iterate(restored, overflow);
  }
  CHECK(restored.get_scale() == scaler.get_scale());
}

}  // namespace

TEST_CASE("regression: every state the scaler reaches saves and loads") {
  ScalerRun run;
  SUBCASE("clamped at min_scale: float(1e-4) is below 1e-4") {
    const auto options = mp::GradScalerOptions().init_scale(1).min_scale(1e-4);
    mp::GradScaler scaler(options);
    for (int i = 0; i < 20; ++i) run.iterate(scaler, true);
    CHECK(scaler.get_scale() == static_cast<double>(1e-4F));
    CHECK(scaler.get_scale() < 1e-4);
    check_round_trip(scaler, options);
  }
  SUBCASE("clamped at max_scale: float(0.3) is above 0.3") {
    const auto options = mp::GradScalerOptions().init_scale(0.25).growth_interval(1).max_scale(0.3);
    mp::GradScaler scaler(options);
    for (int i = 0; i < 3; ++i) run.iterate(scaler, false);
    CHECK(scaler.get_scale() == static_cast<double>(0.3F));
    CHECK(scaler.get_scale() > 0.3);
    check_round_trip(scaler, options);
  }
  SUBCASE("underflowed through the subnormals to 0, as PyTorch's does") {
    const auto options = mp::GradScalerOptions().init_scale(std::ldexp(1.0, -120));
    mp::GradScaler scaler(options);
    for (int i = 0; i < 20; ++i) run.iterate(scaler, true);
    CHECK(scaler.get_scale() == std::ldexp(1.0, -140));  // subnormal: loads too
    check_round_trip(scaler, options);
    for (int i = 0; i < 10; ++i) run.iterate(scaler, true);
    CHECK(scaler.get_scale() == 0.0);
    check_round_trip(scaler, options);
    // A Python GradScaler's dict with scale 0 loads too.
    auto dict = scaler.state_dict();
    CHECK(dict.erase("hysteresis") == 1);
    CHECK(dict.erase("_hysteresis_tracker") == 1);
    mp::GradScaler from_python;
    from_python.load_state_dict(dict);
    CHECK(from_python.get_scale() == 0.0);
  }
  SUBCASE("hysteresis mid-count, and run out (negative)") {
    const auto options = mp::GradScalerOptions().init_scale(64).hysteresis(3);
    mp::GradScaler scaler(options);
    run.iterate(scaler, true);
    CHECK(scaler.hysteresis_tracker() == 2);
    CHECK(scaler.state_dict().at("_hysteresis_tracker").toInt() == 2);
    CHECK(scaler.get_scale() == 64.0);
    check_round_trip(scaler, options);
    mp::GradScaler exhausted(options);
    for (int i = 0; i < 4; ++i) run.iterate(exhausted, true);
    CHECK(exhausted.hysteresis_tracker() == -1);
    CHECK(exhausted.get_scale() == 16.0);
    check_round_trip(exhausted, options);
  }
  SUBCASE("growth tracker mid-count") {
    const auto options = mp::GradScalerOptions().init_scale(64).growth_interval(5);
    mp::GradScaler scaler(options);
    for (int i = 0; i < 3; ++i) run.iterate(scaler, false);
    CHECK(scaler.growth_tracker() == 3);
    check_round_trip(scaler, options);
  }
}

TEST_CASE("load_state_dict refuses scales the scaler cannot hold, and changes nothing") {
  mp::GradScaler source(mp::GradScalerOptions().init_scale(64));
  const auto dict = source.state_dict();
  using doctest::Contains;
  for (const double bad : {-1.0, 1e39, 1e-46, static_cast<double>(kInf), static_cast<double>(kNaN)}) {
    CAPTURE(bad);
    auto d = dict.copy();
    d.insert_or_assign("scale", bad);
    mp::GradScaler target(mp::GradScalerOptions().init_scale(8).growth_interval(7));
    CHECK_THROWS_WITH_AS(target.load_state_dict(d), Contains("finite fp32 value >= 0"), mp::Error);
    CHECK(target.get_scale() == 8.0);
    CHECK(target.options().growth_interval() == 7);
  }
  // This scaler's own bounds apply to a saved scale.
  mp::GradScaler bounded(mp::GradScalerOptions().init_scale(8).min_scale(4).max_scale(16));
  for (const double outside : {2.0, 32.0}) {
    auto d = dict.copy();
    d.insert_or_assign("scale", outside);
    const auto message = "the state dict's scale " + std::to_string(static_cast<int>(outside));
    CHECK_THROWS_WITH_AS(bounded.load_state_dict(d), Contains(message.c_str()), mp::Error);
    CHECK(bounded.get_scale() == 8.0);
  }
  // A whole-number scale saved as an integer (hand-written Python dicts) loads.
  auto integral = dict.copy();
  integral.insert_or_assign("scale", std::int64_t{128});
  mp::GradScaler target;
  target.load_state_dict(integral);
  CHECK(target.get_scale() == 128.0);
}

TEST_CASE("StaticScaler: state_dict round trip, integer scales, options it would ignore") {
  mp::StaticScaler scaler(256.0);
  const auto dict = scaler.state_dict();
  CHECK(dict.size() == 1);
  CHECK(dict.at("scale").toDouble() == 256.0);
  mp::StaticScaler restored;
  restored.load_state_dict(dict);
  CHECK(restored.get_scale() == 256.0);
  // Regression: an integer scale, which GradScaler accepts, was refused.
  c10::impl::GenericDict integral(c10::StringType::get(), c10::AnyType::get());
  integral.insert("scale", std::int64_t{512});
  restored.load_state_dict(integral);
  CHECK(restored.get_scale() == 512.0);
  // A GradScaler's state dict gives its current scale.
  restored.load_state_dict(mp::GradScaler(mp::GradScalerOptions().init_scale(32)).state_dict());
  CHECK(restored.get_scale() == 32.0);
  // Bad dicts: an Error, nothing changed.
  using doctest::Contains;
  c10::impl::GenericDict bad(c10::StringType::get(), c10::AnyType::get());
  CHECK_THROWS_WITH_AS(restored.load_state_dict(bad), Contains("lacks the key 'scale'"), mp::Error);
  bad.insert("scale", std::string("big"));
  CHECK_THROWS_WITH_AS(restored.load_state_dict(bad), Contains("must be a number"), mp::Error);
  for (const double value : {0.0, 1e39, -4.0}) {
    bad.insert_or_assign("scale", value);
    CHECK_THROWS_WITH_AS(restored.load_state_dict(bad), Contains("positive normal fp32 value"),
                         mp::Error);
  }
  CHECK(restored.get_scale() == 32.0);
  // From GradScalerOptions (as the Trainer builds it): init_scale is the scale; the dynamic
  // settings it would silently ignore are refused.
  CHECK(mp::StaticScaler(mp::GradScalerOptions().init_scale(64)).get_scale() == 64.0);
  using O = mp::GradScalerOptions;
  for (const auto& options : {O().growth_interval(10), O().growth_factor(4), O().backoff_factor(0.25),
                              O().hysteresis(2), O().min_scale(1), O().max_scale(1e6),
                              O().enabled(false)}) {
    CHECK_THROWS_WITH_AS(mp::StaticScaler{options}, Contains("StaticScaler keeps its scale fixed"),
                         mp::Error);
  }
}

TEST_CASE("the Trainer's also_check: inf or NaN in it skips the step, finite gradients or not") {
  // detail::StepEngine is the Trainer's gradient pass; also_check carries the loss.
  auto w = torch::ones({3}, torch::requires_grad());
  auto opt = sgd_over({w}, 1.0);
  mp::detail::StepEngine engine(/*allow_fp16=*/false);
  engine.use_scale(4.0);
  const auto iterate = [&](const at::Tensor& also_check) {
    opt.zero_grad();
    engine.scale(w.sum()).backward();
    engine.unscale_planned(opt, mp::detail::UnscalePlan().also_check(also_check));
    CHECK(w.grad().equal(torch::ones({3})));  // unscaled either way
    const bool stepped = engine.step(opt);
    engine.reset_stages();
    return stepped;
  };
  CHECK(iterate(torch::tensor({1.0F, 2.0F})));
  CHECK(w.equal(torch::zeros({3})));
  for (const float bad : {kNaN, kInf, -kInf}) {
    CAPTURE(bad);
    const auto before = w.detach().clone();
    CHECK_FALSE(iterate(torch::tensor({1.0F, bad, 3.0F})));  // a NaN loss, finite gradients
    CHECK(w.equal(before));
  }
  CHECK(engine.skipped_steps() == 3);
  CHECK(iterate(torch::full({2, 2}, 3.0, torch::kBFloat16)));  // any dtype and shape
  CHECK_FALSE(iterate(torch::full({2, 2}, kInf, torch::kBFloat16)));
  CHECK(iterate(at::Tensor()));  // undefined: nothing more to check
  SUBCASE("scale 1 and clipping keep the check") {
    mp::detail::StepEngine none(/*allow_fp16=*/false);
    none.use_scale(1.0);
    opt.zero_grad();
    none.scale(w.sum()).backward();
    CHECK(none.unscale_planned(opt, mp::detail::UnscalePlan().max_grad_norm(1.0).also_check(
                                        torch::scalar_tensor(kNaN))).has_value());
    CHECK_FALSE(none.step(opt));
  }
  SUBCASE("a scale that is not a positive normal fp32 value is an Error, the scale kept") {
    for (const double bad : {0.0, -1.0, static_cast<double>(kInf), static_cast<double>(kNaN),
                             1e-40, 1e39}) {
      CAPTURE(bad);
      CHECK_THROWS_WITH_AS(engine.use_scale(bad), doctest::Contains("the scaler's get_scale()"),
                           mp::Error);
      CHECK(engine.get_scale() == 4.0);
    }
  }
}

namespace {

// An SGD whose next step throws once, as a failing user optimizer or a device error would.
struct FlakySGD : torch::optim::SGD {
  using torch::optim::SGD::SGD;
  bool fail_next = false;
  at::Tensor step(LossClosure closure = nullptr) override {
    if (fail_next) {
      fail_next = false;
      throw std::runtime_error("flaky optimizer");
    }
    return torch::optim::SGD::step(std::move(closure));
  }
};

// MixedO1<BFloat16> with dynamic scaling, so that the scaler has real stages to reset.
struct ScaledO1 : mp::MixedO1<at::BFloat16> {
  static constexpr std::string_view name = "ScaledO1";
  using scaler_type = mp::GradScaler;
};

}  // namespace

TEST_CASE("reset_stages: an exception inside a step leaves the scaler usable") {
  SUBCASE("by hand") {
    auto w = torch::ones({3}, torch::requires_grad());
    FlakySGD opt({w}, torch::optim::SGDOptions(0.5));
    mp::GradScaler scaler(mp::GradScalerOptions().init_scale(4));
    scaler.scale(w.sum()).backward();
    opt.fail_next = true;
    CHECK_THROWS_WITH_AS(scaler.step(opt), "flaky optimizer", std::runtime_error);
    opt.zero_grad();
    scaler.scale(w.sum()).backward();
    // The failed iteration's records are still there: this unscale_ would be a second one.
    CHECK_THROWS_WITH_AS(scaler.unscale_(opt), doctest::Contains("already been called"), mp::Error);
    scaler.reset_stages();
    CHECK(scaler.step(opt));
    scaler.update();
    CHECK(w.equal(torch::full({3}, 0.5)));
    CHECK(scaler.get_scale() == 4.0);
  }
  SUBCASE("the Trainer resets them when a step throws") {
    torch::manual_seed(3);
    torch::nn::Linear net(4, 1);
    FlakySGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    mp::Trainer<ScaledO1> trainer(net, opt);
    const auto x = torch::randn({8, 4});
    const auto loss = [&] { return net->forward(x).pow(2).mean(); };
    const auto before = test::snapshot(net->parameters());
    opt.fail_next = true;
    CHECK_THROWS_WITH_AS(trainer.step(loss), "flaky optimizer", std::runtime_error);
    CHECK(test::identical(test::snapshot(net->parameters()), before));
    const auto report = trainer.step(loss);
    CHECK(report.stepped());
    CHECK(report.scale == 65536.0);
    CHECK_FALSE(test::identical(test::snapshot(net->parameters()), before));
  }
}

TEST_CASE("training with a scaler equals training without, skipped steps included") {
  // PyTorch's test_grad_scaling_* pattern: SGD with momentum on two models, an inf injected at
  // iteration 3, the scale checked against 128 * 2^unskipped * 0.5^skipped.
  auto run = [](Setup& s, auto& scaler) {
    torch::optim::SGD opt(s.params(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (std::size_t i = 0; i < s.data.size(); ++i) {
      opt.zero_grad();
      const auto& [x, y] = s.data[i];
      auto loss = torch::mse_loss(s.model2->forward(s.model1->forward(x)), y);
      scaler.scale(loss).backward();
      if (i == 3) s.model1->parameters()[0].mutable_grad()[0][0] = kInf;
      scaler.step(opt);
      scaler.update();
    }
  };
  check_against_control(run, growth_every_step(true), 5, 1, 128.0);
  check_against_control(run, growth_every_step(false), 5, 1, 128.0);
  check_against_control(run, mp::StaticScaler(64.0), 0, 0, 64.0);
}

TEST_CASE("a skipped step leaves parameters and optimizer state untouched") {
  Setup s;
  torch::optim::Adam opt(s.params(), torch::optim::AdamOptions(1e-2));
  mp::GradScaler scaler;
  auto loss_of = [&](int i) {
    return torch::mse_loss(s.model1->forward(s.data[i].first), s.data[i].second);
  };
  scaler.scale(loss_of(0)).backward();
  REQUIRE(scaler.step(opt));
  scaler.update();
  const auto params = test::snapshot(s.params());
  const auto moments = test::adam_moments(opt);
  REQUIRE(moments.steps.size() == 4);
  opt.zero_grad();
  scaler.scale(loss_of(1) * std::numeric_limits<float>::quiet_NaN()).backward();
  CHECK_FALSE(scaler.step(opt));
  scaler.update();
  CHECK(test::identical(s.params(), params));
  CHECK(test::adam_moments(opt) == moments);
  CHECK(scaler.get_scale() == 32768.0);
  CHECK(scaler.skipped_steps() == 1);
}

TEST_CASE("several models, optimizers and losses: only the optimizer with inf skips") {
  // PyTorch's test_grad_scaling_multiple: two losses, two optimizers, one scaler.
  auto run = [](Setup& s, auto& scaler, int inf_in) {
    torch::optim::SGD opt1(s.model1->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD opt2(s.model2->parameters(), torch::optim::SGDOptions(0.1));
    std::vector<bool> stepped;
    for (std::size_t i = 0; i < s.data.size(); ++i) {
      opt1.zero_grad();
      opt2.zero_grad();
      const auto& [x, y] = s.data[i];
      auto out1 = s.model1->forward(x);
      auto out2 = s.model2->forward(x);
      auto loss0 = torch::mse_loss(0.3 * out1 + 0.7 * out2, y);
      auto loss1 = torch::mse_loss(0.6 * out1 - 0.4 * out2, y);
      scaler.scale(loss0).backward(/*gradient=*/{}, /*retain_graph=*/true);
      scaler.scale(loss1).backward();
      if (i == 3) {
        auto p = (inf_in == 1 ? s.model1 : s.model2)->parameters()[0];
        p.mutable_grad()[0][0] = kInf;
      }
      scaler.unscale_(opt1);  // one optimizer unscaled explicitly, the other by step()
      stepped.push_back(scaler.step(opt1));
      stepped.push_back(scaler.step(opt2));
      scaler.update();
    }
    return stepped;
  };
  for (const int inf_in : {1, 2}) {
    Setup control_setup, scaled_setup;
    mp::NoScaler control;
    auto scaler = growth_every_step(true);
    run(control_setup, control, inf_in);
    const auto stepped = run(scaled_setup, scaler, inf_in);
    CHECK(test::identical(control_setup.params(), scaled_setup.params()));
    CHECK(stepped[6] == (inf_in != 1));  // iteration 3: only the optimizer with the inf skips
    CHECK(stepped[7] == (inf_in != 2));
    CHECK(scaler.get_scale() == 128.0 * 32.0 * 0.5);  // one backoff for the whole iteration
    CHECK(scaler.skipped_steps() == 1);
  }
}

TEST_CASE("gradient accumulation over scaled micro-batches equals unscaled accumulation") {
  auto run = [](Setup& s, auto& scaler) {
    torch::optim::SGD opt(s.params(), torch::optim::SGDOptions(0.1));
    for (std::size_t i = 0; i < s.data.size(); i += 2) {
      opt.zero_grad();
      for (std::size_t j = i; j < i + 2; ++j) {
        const auto& [x, y] = s.data[j];
        scaler.scale(torch::mse_loss(s.model2->forward(s.model1->forward(x)), y) / 2).backward();
      }
      scaler.step(opt);
      scaler.update();
    }
  };
  check_against_control(run, growth_every_step(true), 3, 0, 128.0);
  check_against_control(run, growth_every_step(false), 3, 0, 128.0);
}

TEST_CASE("a gradient penalty through autograd::grad of the scaled loss") {
  // PyTorch's test_grad_scaling_penalty: grads of the scaled loss are unscaled by hand before
  // the penalty is formed; the penalised loss is scaled again.
  auto run = [](Setup& s, auto& scaler) {
    torch::optim::SGD opt(s.params(), torch::optim::SGDOptions(0.05));
    for (const auto& [x, y] : s.data) {
      opt.zero_grad();
      auto loss = torch::mse_loss(s.model2->forward(s.model1->forward(x)), y);
      auto params = s.params();
      auto grads = torch::autograd::grad({scaler.scale(loss)}, params, {}, true, true);
      const double inv = 1.0 / scaler.get_scale();
      at::Tensor penalty = torch::zeros({});
      for (auto& g : grads) penalty = penalty + (g * inv).pow(2).sum();
      scaler.scale(loss + penalty.sqrt()).backward();
      scaler.step(opt);
      scaler.update();
    }
  };
  check_against_control(run, growth_every_step(true), 6, 0, 128.0);
  check_against_control(run, growth_every_step(false), 6, 0, 128.0);
}

TEST_CASE("fused clipping equals PyTorch's recipe: unscale_, then clip_grad_norm_") {
  for (const double max_norm : {0.05, 1e6}) {  // clipping active, then inactive
    CAPTURE(max_norm);
    Setup fused_setup, recipe_setup;
    torch::optim::SGD fused_opt(fused_setup.params(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD recipe_opt(recipe_setup.params(), torch::optim::SGDOptions(0.1));
    mp::GradScaler fused_scaler(mp::GradScalerOptions().init_scale(1000.0));  // not a power of 2
    mp::GradScaler recipe_scaler(mp::GradScalerOptions().init_scale(1000.0));
    for (const auto& [x, y] : fused_setup.data) {
      fused_opt.zero_grad();
      recipe_opt.zero_grad();
      fused_scaler.scale(torch::mse_loss(fused_setup.model1->forward(x), y)).backward();
      recipe_scaler.scale(torch::mse_loss(recipe_setup.model1->forward(x), y)).backward();
      const auto norm = fused_scaler.unscale_(fused_opt, mp::UnscaleOptions().max_grad_norm(max_norm));
      recipe_scaler.unscale_(recipe_opt);
      const auto recipe_norm =
          torch::nn::utils::clip_grad_norm_(recipe_setup.model1->parameters(), max_norm);
      REQUIRE(norm.has_value());
      CHECK(*norm == doctest::Approx(recipe_norm).epsilon(1e-6));
      std::vector<at::Tensor> fused_grads, recipe_grads;
      for (auto& p : fused_setup.model1->parameters()) fused_grads.push_back(p.grad());
      for (auto& p : recipe_setup.model1->parameters()) recipe_grads.push_back(p.grad());
      CHECK(test::max_abs_diff(fused_grads, recipe_grads) <= 1e-6 * std::max(1.0, recipe_norm));
      fused_scaler.step(fused_opt);
      recipe_scaler.step(recipe_opt);
      fused_scaler.update();
      recipe_scaler.update();
    }
  }
  SUBCASE("inf gradients: the norm is inf and the step skipped") {
    auto p = param_with_grad(torch::tensor({3.0F, kInf}));
    auto opt = sgd_over({p});
    mp::GradScaler scaler(mp::GradScalerOptions().init_scale(2));
    (void)scaler.scale(torch::zeros({}));
    CHECK(std::isinf(*scaler.unscale_(opt, mp::UnscaleOptions().max_grad_norm(1.0))));
    CHECK_FALSE(scaler.step(opt));
  }
  SUBCASE("NoScaler clips too, without scaling") {
    auto p = param_with_grad(torch::tensor({3.0F, 4.0F}));
    auto opt = sgd_over({p});
    mp::NoScaler scaler;
    CHECK(*scaler.unscale_(opt, mp::UnscaleOptions().max_grad_norm(1.0)) == doctest::Approx(5.0));
    CHECK(p.grad()[0].item<float>() == doctest::Approx(0.6).epsilon(1e-6));
  }
}

TEST_CASE("the Trainer's grads_from: model gradients unscaled into master gradients in one pass") {
  torch::manual_seed(5);
  auto model_param = torch::randn({64, 33}).to(torch::kBFloat16).requires_grad_();
  model_param.mutable_grad() = (torch::randn({64, 33}) * 256).to(torch::kBFloat16);
  auto master = model_param.detach().to(torch::kFloat).requires_grad_();
  auto opt = sgd_over({master});
  mp::detail::StepEngine scaler(/*allow_fp16=*/false);
  scaler.use_scale(256);
  (void)scaler.scale(torch::zeros({}));
  scaler.unscale_planned(opt, mp::detail::UnscalePlan().grads_from({model_param}));
  CHECK(master.grad().scalar_type() == torch::kFloat);
  CHECK(master.grad().equal(model_param.grad().to(torch::kFloat) / 256));

  SUBCASE("mismatched lists are refused before anything changes") {
    mp::detail::StepEngine s2(/*allow_fp16=*/false);
    s2.use_scale(256);
    (void)s2.scale(torch::zeros({}));
    auto other = torch::zeros({3}, torch::requires_grad());
    other.mutable_grad() = torch::ones({3});
    CHECK_THROWS_WITH_AS(s2.unscale_planned(opt, mp::detail::UnscalePlan().grads_from({model_param, other})),
                         doctest::Contains("grads_from has 2"), mp::Error);
    CHECK_THROWS_WITH_AS(s2.unscale_planned(opt, mp::detail::UnscalePlan().grads_from({other})),
                         doctest::Contains("shape"), mp::Error);
  }
}

TEST_CASE("sparse gradients are unscaled through their values") {
  torch::manual_seed(11);
  torch::nn::Embedding embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true));
  torch::optim::SGD opt(embedding->parameters(), torch::optim::SGDOptions(0.1));
  mp::GradScaler scaler(mp::GradScalerOptions().init_scale(16));
  const auto ids = torch::tensor({1, 3, 3, 7}, torch::kLong);
  scaler.scale(embedding->forward(ids).sum()).backward();
  REQUIRE(embedding->weight.grad().is_sparse());
  scaler.unscale_(opt);
  CHECK(embedding->weight.grad().to_dense().equal(
      torch::zeros({10, 4}).index_add_(0, ids, torch::ones({4, 4}))));
  const auto before = embedding->weight.detach().clone();
  CHECK(scaler.step(opt));
  CHECK_FALSE(embedding->weight.equal(before));
}

TEST_CASE("state_dict: PyTorch's keys, round trip, validation, disabled scaler") {
  mp::GradScaler scaler(mp::GradScalerOptions().init_scale(64).growth_interval(5).hysteresis(2));
  auto w = torch::ones({2}, torch::requires_grad());
  auto opt = sgd_over({w}, 0.0);
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    scaler.scale(w.sum()).backward();
    scaler.step(opt);
    scaler.update();
  }
  const auto dict = scaler.state_dict();
  CHECK(dict.at("scale").toDouble() == 64.0);
  CHECK(dict.at("growth_factor").toDouble() == 2.0);
  CHECK(dict.at("backoff_factor").toDouble() == 0.5);
  CHECK(dict.at("growth_interval").toInt() == 5);
  CHECK(dict.at("_growth_tracker").toInt() == 3);
  CHECK(dict.at("hysteresis").toInt() == 2);

  mp::GradScaler restored;
  restored.load_state_dict(dict);
  CHECK(restored.get_scale() == 64.0);
  CHECK(restored.growth_tracker() == 3);
  CHECK(restored.options().growth_interval() == 5);
  // Two more clean steps reach the growth interval in both.
  for (auto* s : {&scaler, &restored}) {
    for (int i = 0; i < 2; ++i) {
      opt.zero_grad();
      s->scale(w.sum()).backward();
      s->step(opt);
      s->update();
    }
  }
  CHECK(restored.get_scale() == 128.0);
  CHECK(scaler.get_scale() == 128.0);

  SUBCASE("bad dicts are refused and change nothing") {
    mp::GradScaler target(mp::GradScalerOptions().init_scale(8));
    CHECK_THROWS_WITH_AS(target.load_state_dict(mp::NoScaler().state_dict()),
                         doctest::Contains("empty state dict"), mp::Error);
    auto bad = dict.copy();
    bad.insert_or_assign("growth_factor", 0.5);
    CHECK_THROWS_WITH_AS(target.load_state_dict(bad), doctest::Contains("growth_factor"), mp::Error);
    auto missing = dict.copy();
    CHECK(missing.erase("_growth_tracker") == 1);
    CHECK_THROWS_WITH_AS(target.load_state_dict(missing), doctest::Contains("_growth_tracker"), mp::Error);
    auto wrong_type = dict.copy();
    wrong_type.insert_or_assign("growth_interval", 2.5);
    CHECK_THROWS_WITH_AS(target.load_state_dict(wrong_type), doctest::Contains("integer"), mp::Error);
    CHECK(target.get_scale() == 8.0);
    CHECK(target.options().growth_interval() == 2000);
  }
  SUBCASE("a disabled scaler saves nothing and loads nothing, as in PyTorch") {
    mp::GradScaler disabled(mp::GradScalerOptions().enabled(false));
    CHECK(disabled.state_dict().empty());
    disabled.load_state_dict(dict);
    CHECK(disabled.get_scale() == 1.0);
  }
}

namespace {

int system_python(const std::string& code) {
  const auto script = test::temp_path("interop.py");
  std::ofstream(script) << code;
  return std::system((std::string(MIXPREC_SYSTEM_PYTHON) + " " + script).c_str());
}

}  // namespace

TEST_CASE("state_dict interop with Python: torch::pickle_save -> torch.load, torch.save -> pickle_load") {
  mp::GradScaler scaler(mp::GradScalerOptions().init_scale(512).growth_interval(100));
  const auto bytes = torch::pickle_save(c10::IValue(scaler.state_dict()));
  const auto from_cpp = test::temp_path("scaler_from_cpp.pt");
  std::ofstream(from_cpp, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  const auto from_python = test::temp_path("scaler_from_python.pt");
  std::remove(from_python.c_str());
  // The dict a Python GradScaler.state_dict() returns (1.13 has no CPU GradScaler to call).
  const int rc = system_python(
      "import torch\n"
      "d = torch.load('" + from_cpp + "', weights_only=False)  # 2.6+ defaults to True\n"
      "assert d['scale'] == 512.0 and d['growth_interval'] == 100, d\n"
      "assert d['growth_factor'] == 2.0 and d['backoff_factor'] == 0.5 and d['_growth_tracker'] == 0, d\n"
      "torch.save({'scale': 2048.0, 'growth_factor': 4.0, 'backoff_factor': 0.25,\n"
      "            'growth_interval': 10, '_growth_tracker': 7}, '" + from_python + "')\n");
  REQUIRE(rc == 0);
  std::ifstream in(from_python, std::ios::binary);
  const std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE_FALSE(data.empty());
  const auto loaded = torch::pickle_load(data);
  REQUIRE(loaded.isGenericDict());
  mp::GradScaler restored;
  restored.load_state_dict(loaded.toGenericDict());
  CHECK(restored.get_scale() == 2048.0);
  CHECK(restored.growth_tracker() == 7);
  CHECK(restored.options().growth_factor() == 4.0);
  CHECK(restored.options().backoff_factor() == 0.25);
  CHECK(restored.options().hysteresis() == 1);
}

TEST_CASE("an fp16 sparse gradient is coalesced into the parameter before unscaling") {
  torch::manual_seed(12);
  torch::nn::Embedding embedding(torch::nn::EmbeddingOptions(6, 2).sparse(true));
  embedding->to(torch::kHalf);
  torch::optim::SGD opt(embedding->parameters(), torch::optim::SGDOptions(0.1));
  mp::GradScaler scaler(mp::GradScalerOptions().init_scale(16).allow_fp16_grads(true));
  const auto ids = torch::tensor({2, 2, 2, 5}, torch::kLong);  // duplicates: uncoalesced grad
  scaler.scale(embedding->forward(ids).sum().to(torch::kFloat)).backward();
  REQUIRE_FALSE(embedding->weight.grad().is_coalesced());
  scaler.unscale_(opt);
  const auto& grad = embedding->weight.grad();
  CHECK(grad.is_coalesced());
  const auto expected = torch::zeros({6, 2}).index_add_(0, ids, torch::ones({4, 2}));
  CHECK(grad.to_dense().to(torch::kFloat).equal(expected));
}

TEST_CASE("fused clipping coalesces sparse gradients: repeated indices count once") {
  torch::nn::Embedding embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true));
  torch::optim::SGD opt(embedding->parameters(), torch::optim::SGDOptions(0.1));
  mp::GradScaler scaler(mp::GradScalerOptions().init_scale(2));
  scaler.scale(embedding->forward(torch::tensor({3, 3, 3, 3}, torch::kLong)).sum()).backward();
  // Row 3 gets a gradient of 4 in each of its 4 entries: norm sqrt(4 * 16) = 8.
  const auto norm = scaler.unscale_(opt, mp::UnscaleOptions().max_grad_norm(1.0));
  CHECK(*norm == doctest::Approx(8.0));
  CHECK(embedding->weight.grad().to_dense().norm().item<double>() == doctest::Approx(1.0).epsilon(1e-5));
}

TEST_CASE("scalers are move-only: a copy would share the scale") {
  static_assert(!std::is_copy_constructible_v<mp::GradScaler>);
  static_assert(!std::is_copy_assignable_v<mp::StaticScaler>);
  static_assert(std::is_move_constructible_v<mp::GradScaler> && std::is_move_assignable_v<mp::NoScaler>);
  mp::GradScaler a(mp::GradScalerOptions().init_scale(8));
  (void)a.scale(torch::ones({}));
  mp::GradScaler b = std::move(a);
  CHECK(b.get_scale() == 8.0);
}

TEST_CASE("an expanded (self-overlapping) gradient is refused before anything is unscaled") {
  auto p1 = param_with_grad(torch::full({4}, 8.0));
  auto p2 = param_with_grad(torch::ones({1}).expand({4}));
  auto opt = sgd_over({p1, p2});
  mp::GradScaler scaler(mp::GradScalerOptions().init_scale(2));
  (void)scaler.scale(torch::zeros({}));
  CHECK_THROWS_WITH_AS(scaler.unscale_(opt), doctest::Contains("expanded view"), mp::Error);
  CHECK(p1.grad().equal(torch::full({4}, 8.0)));
  p2.mutable_grad() = p2.grad().contiguous();
  scaler.unscale_(opt);
  CHECK(p1.grad().equal(torch::full({4}, 4.0)));  // unscaled once
}

}  // namespace test_scaler
