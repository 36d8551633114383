// ATen's own AMP kernels against mixprec's CPU path: _amp_foreach_non_finite_check_and_unscale_
// against the one-pass unscale (detail/unscale.hpp), _amp_update_scale_ against GradScaler's
// update. ATen has them on the CPU from LibTorch 2.3; mixprec keeps its own pass there (as fast
// or faster: docs/benchmarks.md), so these tests pin that both compute the same.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>

namespace mp = mixprec;

namespace {

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.clone());
  return out;
}

/// mixprec's CPU pass over the tensors, in place; true when any result is non-finite.
bool mixprec_unscale(const std::vector<at::Tensor>& grads, float inv) {
  std::vector<mp::detail::GradPair> pairs;
  for (const auto& g : grads) pairs.push_back({g, g});
  auto found = at::zeros({}, at::kFloat);
  mp::detail::unscale_pairs_(pairs, inv, found);
  return found.item<float>() != 0.0F;
}

/// Equal bit for bit, NaN positions compared as NaN (their payload may differ).
bool same_values(const at::Tensor& a, const at::Tensor& b) {
  const auto a32 = a.to(at::kFloat), b32 = b.to(at::kFloat);
  const auto nan = a32.isnan();
  return nan.equal(b32.isnan()) && a32.masked_fill(nan, 0).equal(b32.masked_fill(nan, 0));
}

}  // namespace

#if MIXPREC_TORCH_AT_LEAST(2, 3)
namespace {
/// Gradients of several sizes (a vector tail, one element, more than one parallel chunk).
std::vector<at::Tensor> make_grads(at::ScalarType dtype, int poison) {
  torch::manual_seed(21);
  std::vector<at::Tensor> grads;
  for (const std::int64_t n : {1, 31, 1000, (1 << 16) + 7}) grads.push_back((torch::randn({n}) * 1000).to(dtype));
  if (poison == 1) grads[2][17] = std::numeric_limits<float>::infinity();
  if (poison == 2) grads[3][40000] = std::numeric_limits<float>::quiet_NaN();
  return grads;
}

}  // namespace
#endif

TEST_SUITE("amp kernels") {
#if MIXPREC_TORCH_AT_LEAST(2, 3)
  TEST_CASE("ATen's CPU unscale kernel and mixprec's pass: the same gradients and the same found_inf") {
    for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      // A power of two (exact), 1/3 (rounded: the same rounding is required), 1 (ATen's shortcut).
      for (const float inv : {1.0F / 1024, static_cast<float>(1.0 / 3.0), 1.0F}) {
        for (const int poison : {0, 1, 2}) {
          CAPTURE(dtype);
          CAPTURE(inv);
          CAPTURE(poison);
          auto aten = make_grads(dtype, poison);
          auto ours = clones(aten);
          auto found = at::zeros({}, at::kFloat);
          at::_amp_foreach_non_finite_check_and_unscale_(aten, found, at::full({}, inv, at::kFloat));
          const bool ours_found = mixprec_unscale(ours, inv);
          CHECK((found.item<float>() != 0.0F) == (poison != 0));
          CHECK(ours_found == (poison != 0));
          for (std::size_t i = 0; i < aten.size(); ++i) CHECK(same_values(aten[i], ours[i]));
        }
      }
    }
  }

  TEST_CASE("where they differ: ATen checks its inputs, mixprec what it writes (fp16 overflowing after unscaling)") {
    // A scale below 1 (after many backoffs) multiplies: 40000 * 2 is inf in fp16.
    auto aten = std::vector<at::Tensor>{torch::full({8}, 40000.0, at::kHalf)};
    auto ours = clones(aten);
    auto found = at::zeros({}, at::kFloat);
    at::_amp_foreach_non_finite_check_and_unscale_(aten, found, at::full({}, 2.0F, at::kFloat));
    CHECK(found.item<float>() == 0.0F);     // the kernel saw finite inputs
    CHECK(aten[0].isinf().all().item<bool>());  // and wrote inf
    CHECK(mixprec_unscale(ours, 2.0F));     // mixprec flags the step
    CHECK(same_values(aten[0], ours[0]));
  }

  TEST_CASE("_amp_update_scale_ and GradScaler::update follow the same trajectory, bit for bit") {
    std::mt19937 rng(7);
    for (const double init : {65536.0, 3.0, std::ldexp(1.0, 126)}) {
      for (const std::int64_t interval : {1, 3, 50}) {
        CAPTURE(init);
        CAPTURE(interval);
        auto scale = at::full({}, init, at::kFloat);
        auto tracker = at::zeros({}, at::kInt);
        auto p = torch::zeros({4}).requires_grad_();
        torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.0));
        mp::GradScaler scaler(mp::GradScalerOptions().init_scale(init).growth_interval(interval)
                                  .growth_factor(2.0).backoff_factor(0.25));
        for (int step = 0; step < 300; ++step) {
          const bool overflow = rng() % 7 == 0;
          (void)scaler.scale(torch::zeros({}));
          p.mutable_grad() = torch::ones({4});
          if (overflow) p.mutable_grad()[1] = std::numeric_limits<float>::infinity();
          CHECK(scaler.step(sgd) == !overflow);
          scaler.update();
          at::_amp_update_scale_(scale, tracker, at::full({}, overflow ? 1.0F : 0.0F), 2.0, 0.25,
                                 interval);
          REQUIRE(scaler.get_scale() == static_cast<double>(scale.item<float>()));
          REQUIRE(scaler.growth_tracker() == tracker.item<std::int32_t>());
        }
      }
    }
  }
#else
  TEST_CASE("LibTorch < 2.3 has no CPU kernel for ATen's unscale: mixprec's pass is the CPU path") {
    std::vector<at::Tensor> grads{torch::ones({4})};
    auto found = at::zeros({}, at::kFloat);
    CHECK_THROWS_AS(at::_amp_foreach_non_finite_check_and_unscale_(grads, found, at::ones({})),
                    c10::Error);
    auto ours = clones(grads);
    CHECK_FALSE(mixprec_unscale(ours, 0.5F));
    CHECK(same_values(ours[0], torch::full({4}, 0.5)));
  }
#endif
}
