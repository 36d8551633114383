// AutocastGuard and autocast<P>(): dtypes inside and outside, nesting, exceptions, errors.
#include <mixprec/mixprec.hpp>

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <stdexcept>

namespace test_autocast {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

// Through the guard's own accessors, which hide the API change of LibTorch 2.4.
bool cpu_enabled() { return mp::detail::get_autocast_state(torch::kCPU).enabled; }
at::ScalarType cpu_dtype() { return mp::detail::get_autocast_state(torch::kCPU).dtype; }

at::ScalarType mm_dtype() {
  const auto a = torch::ones({2, 2});
  return torch::mm(a, a).scalar_type();
}

}  // namespace

TEST_CASE("MixedO1<BFloat16> runs matmuls in bf16 inside the guard and fp32 outside") {
  REQUIRE_FALSE(cpu_enabled());
  {
    auto guard = mp::autocast<mp::MixedO1<at::BFloat16>>(torch::kCPU);
    CHECK(cpu_enabled());
    CHECK(mm_dtype() == at::kBFloat16);
    // Ops on CPU autocast's fp32 list run in fp32 under the guard, bf16 input or not.
    const auto a = torch::ones({2, 2}, torch::kBFloat16);
    CHECK(torch::mse_loss(a, a).scalar_type() == at::kFloat);
  }
  CHECK_FALSE(cpu_enabled());
  CHECK(mm_dtype() == at::kFloat);
}

TEST_CASE("policies without autocast switch it off inside their scope") {
  auto outer = mp::autocast<mp::MixedO1<at::BFloat16>>(torch::kCPU);
  REQUIRE(mm_dtype() == at::kBFloat16);
  {
    auto inner = mp::autocast<mp::FullPrecision>(torch::kCPU);
    CHECK(mm_dtype() == at::kFloat);  // FullPrecision means fp32, whatever the caller enabled
  }
  CHECK(mm_dtype() == at::kBFloat16);
}

TEST_CASE("nested guards restore each level's state and dtype") {
  const auto dtype_before = cpu_dtype();
  {
    mp::AutocastGuard outer(torch::kCPU, at::kBFloat16);
    {
      mp::AutocastGuard inner(torch::kCPU, at::kBFloat16, /*enabled=*/false);
      CHECK_FALSE(cpu_enabled());
      {
        mp::AutocastGuard innermost(torch::kCPU, at::kBFloat16);
        CHECK(mm_dtype() == at::kBFloat16);
      }
      CHECK_FALSE(cpu_enabled());
    }
    CHECK(cpu_enabled());
    CHECK(cpu_dtype() == at::kBFloat16);
  }
  CHECK_FALSE(cpu_enabled());
  CHECK(cpu_dtype() == dtype_before);
}

TEST_CASE("the previous state is restored when the scope exits by an exception") {
  CHECK_THROWS_AS(
      [] {
        auto guard = mp::autocast<mp::MixedO1<at::BFloat16>>(torch::kCPU);
        REQUIRE(cpu_enabled());
        throw std::runtime_error("forward pass failed");
      }(),
      std::runtime_error);
  CHECK_FALSE(cpu_enabled());
  CHECK(mm_dtype() == at::kFloat);
  // Nesting went back to zero: a fresh guard is the outermost again and clears the cache.
  CHECK(at::autocast::increment_nesting() == 1);
  CHECK(at::autocast::decrement_nesting() == 0);
}

TEST_CASE("the outermost guard clears the cast cache; inner ones keep it") {
  auto weight = torch::ones({2, 2}, torch::requires_grad());  // cached casts are of leaf tensors
  const auto x = torch::ones({2, 2});
  auto outer = std::make_unique<mp::AutocastGuard>(torch::kCPU, at::kBFloat16);
  {
    mp::AutocastGuard inner(torch::kCPU, at::kBFloat16);
    (void)torch::mm(x, weight);
  }
  // Still cached after the inner guard: the cast copy of `weight` is alive, shared by the cache.
  weight.data().fill_(2.0F);  // the cache does not see in-place edits: that is why it is cleared
  CHECK(torch::mm(x, weight)[0][0].item<float>() == doctest::Approx(2.0));
  outer.reset();
  mp::AutocastGuard again(torch::kCPU, at::kBFloat16);
  CHECK(torch::mm(x, weight)[0][0].item<float>() == doctest::Approx(4.0));
}

TEST_CASE("MixedO1<Half> on the CPU: fp16 matmuls under LibTorch 2.x, a clear Error under 1.13") {
  if constexpr (mp::cpu_half_math) {
    {
      auto guard = mp::autocast<mp::MixedO1<at::Half>>(torch::kCPU);
      CHECK(cpu_dtype() == at::kHalf);
      CHECK(mm_dtype() == at::kHalf);
      const auto a = torch::ones({2, 2}, torch::kHalf);
      CHECK(torch::mse_loss(a, a).scalar_type() == at::kFloat);  // fp32 list, as for bf16
    }
    CHECK_FALSE(cpu_enabled());
    CHECK(mm_dtype() == at::kFloat);
  } else {
    CHECK_THROWS_WITH_AS(static_cast<void>(mp::autocast<mp::MixedO1<at::Half>>(torch::kCPU)),
                         doctest::Contains("supports BFloat16 only"), mp::Error);
    CHECK_FALSE(cpu_enabled());
  }
}

TEST_CASE("bad autocast requests are mixprec::Errors that leave the state alone") {
  CHECK_THROWS_WITH_AS(mp::AutocastGuard(torch::kCPU, at::kDouble),
                       doctest::Contains("Half or BFloat16"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::AutocastGuard(c10::DeviceType::Vulkan, at::kBFloat16),
                       doctest::Contains("CPU and CUDA"), mp::Error);
  CHECK_FALSE(cpu_enabled());
  CHECK(mm_dtype() == at::kFloat);
}

}  // namespace test_autocast
