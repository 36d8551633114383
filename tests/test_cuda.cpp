// CUDA: Half policies end to end, the fused ATen kernels against the CPU path, real overflows.
// The device-independent cases live in device_cases.hpp; tests/scaling/test_half.cpp runs them on the CPU.
// Built as mixprec_cuda_tests; ctest's cuda_tests runs it with --require-cuda, which reports
// "not run" without a GPU. scripts/gpu-check runs it on a GPU machine.
#include <mixprec/mixprec.hpp>
#include <mixprec/distributed/process_group.hpp>

#include "device_cases.hpp"
#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <unistd.h>

namespace mp = mixprec;

namespace {

// The fp8 operands of one Trainer<P> step of a Float8Linear(in, 32) on CUDA whose input needs a
// gradient too. 64 -> 32: every dimension a multiple of 16 (cuBLASLt's _scaled_mm); 20 -> 32:
// not (the emulated product, on the GPU).
template <class P>
mp::Fp8Operands fp8_step_on_cuda(std::int64_t in) {
  CAPTURE(in);
  torch::manual_seed(3);
  auto layer = mp::nn::Float8Linear(in, 32);
  layer->to(torch::kCUDA);
  torch::optim::SGD sgd(layer->parameters(), torch::optim::SGDOptions(0.01));
  mp::Trainer<P> trainer(layer, sgd);
  layer->keep_operands();
  const auto x = torch::randn({48, in}, torch::kCUDA).requires_grad_();
  const auto report = trainer.step([&] {
    return layer(trainer.cast_input(x)).to(at::kFloat).pow(2).mean();
  });
  CHECK(report.stepped());
  return layer->last_operands();
}

[[maybe_unused]] mp::Fp8Tensor on_cpu(const mp::Fp8Tensor& t) { return {t.data.cpu(), t.scale.cpu()}; }

}  // namespace

TEST_SUITE("cuda") {
  TEST_CASE("Half policies train end to end on CUDA") {
    SUBCASE("MixedO1<Half>: autocast") { test::trains_end_to_end<mp::MixedO1<at::Half>>(torch::kCUDA); }
    SUBCASE("MixedO2<Half>: fp32 masters") { test::trains_end_to_end<mp::MixedO2<at::Half>>(torch::kCUDA); }
    SUBCASE("PureHalf<Half>") { test::trains_end_to_end<mp::PureHalf<at::Half>>(torch::kCUDA); }
    SUBCASE("MixedO1<BFloat16>") { test::trains_end_to_end<mp::MixedO1<at::BFloat16>>(torch::kCUDA); }
    SUBCASE("MixedO2<Half> with accumulation and clipping") {
      test::trains_end_to_end<mp::MixedO2<at::Half>>(
          torch::kCUDA, mp::TrainerOptions().accumulation_steps(2).max_grad_norm(1.0));
    }
  }

  TEST_CASE("MixedFP8 on CUDA: at::_scaled_mm's products against the emulated ones" *
            doctest::skip(!mp::has_fp8)) {
    test::with_fp8([](auto recipe) {
      for (const std::int64_t in : {64, 20}) {
        const auto ops = fp8_step_on_cuda<mp::MixedFP8<decltype(recipe)>>(in);
        // The same fp8 operands through the CPU's emulation.
        const auto emulated = mp::detail::fp8_mm(on_cpu(ops.input), on_cpu(mp::detail::transposed(ops.weight)),
                                                 at::kFloat);
        const auto on_gpu = mp::detail::fp8_mm(ops.input, mp::detail::transposed(ops.weight), at::kFloat).cpu();
        const double diff = (on_gpu.to(at::kDouble) - emulated.to(at::kDouble)).abs().max().template item<double>();
        const double largest = emulated.abs().max().template item<double>();
        MESSAGE("in " << in << ": fp8 product on the GPU vs emulated on the CPU: largest difference "
                << diff << " of " << largest);
        CHECK(diff <= largest * 1e-5);  // the scales applied after the fp32 sum instead of before
      }
    });
  }

  TEST_CASE("MixedFP8's rowwise recipes on CUDA: at::_scaled_mm with rowwise scales against the "
            "emulated products" * doctest::skip(!mp::has_fp8)) {
    test::with_fp8_recipes<mp::RowwiseScaling, mp::RowwiseScalingWithGwHp>([](auto... recipes) {
      const auto run = [](auto recipe) {
        using P = mp::MixedFP8<decltype(recipe)>;
        for (const std::int64_t in : {64, 20}) {
          CAPTURE(P::name);
          const auto ops = fp8_step_on_cuda<P>(in);
          // Each product on the GPU against the same fp8 operands through the CPU's emulation:
          // the scales are powers of 2, so the two differ in the sum's order and width alone.
          const auto compare = [&](const char* product, const mp::Fp8Tensor& a, const mp::Fp8Tensor& b,
                                   bool fast_accum) {
            const auto on_gpu = mp::detail::fp8_mm(a, b, at::kBFloat16, fast_accum).cpu().to(at::kDouble);
            const auto emulated = mp::detail::fp8_mm(on_cpu(a), on_cpu(b), at::kBFloat16).to(at::kDouble);
            const double diff = (on_gpu - emulated).abs().max().template item<double>();
            const double largest = emulated.abs().max().template item<double>();
            MESSAGE(P::name << ", in " << in << ", " << product << ": on the GPU vs emulated, largest "
                    "difference " << diff << " of " << largest << " (rowwise _scaled_mm state "
                    << mp::detail::rowwise_scaled_mm_state(0).load() << ")");
            CHECK(diff <= largest / 128);  // one bf16 ulp of the largest
          };
          compare("output", ops.input, mp::detail::transposed(ops.weight), true);
          compare("grad_input", ops.grad_output, ops.weight_for_grad_input, false);
          if (ops.grad_output_for_grad_weight.data.defined()) {
            compare("grad_weight", mp::detail::transposed(ops.grad_output_for_grad_weight),
                    ops.input_for_grad_weight, false);
          }
        }
      };
      (run(recipes), ...);
    });
  }

  TEST_CASE("real fp16 overflow, underflow and growth on CUDA") {
    test::backs_off_from_real_overflow<mp::MixedO1<at::Half>>(torch::kCUDA);
    test::backs_off_from_real_overflow<mp::MixedO2<at::Half>>(torch::kCUDA);
    test::rescues_real_underflow<mp::MixedO1<at::Half>>(torch::kCUDA);
    test::rescues_real_underflow<mp::MixedO2<at::Half>>(torch::kCUDA);
    test::grows_after_clean_steps<mp::MixedO1<at::Half>>(torch::kCUDA);
  }

  TEST_CASE("the fused CUDA unscale equals the CPU path, inf/NaN included") {
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      for (const bool poison : {false, true}) {
        torch::manual_seed(3);
        std::vector<at::Tensor> cpu_params, cuda_params, expected;
        for (int i = 0; i < 12; ++i) {
          auto g = (torch::randn({1000 + 37 * i}) * 1024).to(dtype);
          if (poison && i == 7) g[5] = std::numeric_limits<float>::infinity();
          expected.push_back(g / 1024);  // exact: a power of two
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
        const bool cpu_stepped = cpu_scaler.step(cpu_opt);
        CHECK(cpu_stepped == !poison);
        CHECK(cuda_scaler.step(cuda_opt) == cpu_stepped);
        for (std::size_t i = 0; i < cpu_params.size(); ++i) {
          CHECK(cuda_params[i].grad().scalar_type() == dtype);
          if (poison) {
            CHECK(cpu_params[i].eq(0).all().item<bool>());  // skipped: never updated
            CHECK(cuda_params[i].eq(0).all().item<bool>());
          } else {
            CHECK(cpu_params[i].grad().equal(expected[i]));
            CHECK(cuda_params[i].grad().cpu().equal(expected[i]));
            // The unscaled gradients are equal; SGD's update is LibTorch's kernel on each
            // device, which rounds bf16 differently (seen on an H200): within one bf16 ulp.
            const auto cpu_p = cpu_params[i].to(at::kFloat);
            const auto cuda_p = cuda_params[i].cpu().to(at::kFloat);
            const double ulps = dtype == at::kFloat ? 0.0 : std::ldexp(1.0, -7);
            const auto diff = (cpu_p - cuda_p).abs();
            if (!diff.le(cpu_p.abs() * ulps).all().item<bool>()) {
              MESSAGE(c10::toString(dtype), " parameter ", i, ": largest difference CPU vs CUDA ",
                      diff.max().item<double>());
            }
            CHECK(diff.le(cpu_p.abs() * ulps).all().item<bool>());
          }
        }
        cpu_scaler.update();
        cuda_scaler.update();
        CHECK(cpu_scaler.get_scale() == (poison ? 512.0 : 1024.0));
        CHECK(cuda_scaler.get_scale() == cpu_scaler.get_scale());
      }
    }
  }

  TEST_CASE("the fused CUDA scale update never grows to inf") { test::never_grows_to_inf(torch::kCUDA); }

  TEST_CASE("a checkpoint restores the CUDA RNG: dropout masks repeat after load") {
    auto net = torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::Dropout(0.5));
    net->to(torch::kCUDA);
    torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
    mp::Trainer<mp::MixedO2<at::Half>> trainer(net, adam);
    const auto path = std::string(MIXPREC_TEST_TMPDIR) + "/cuda_rng.ckpt";
    trainer.save(path);
    const auto first = torch::rand({64}, torch::kCUDA);
    trainer.load(path);
    const auto again = torch::rand({64}, torch::kCUDA);
    CHECK(first.equal(again));
    CHECK_FALSE(torch::rand({64}, torch::kCUDA).equal(first));
  }

  TEST_CASE("fused AdamW on CUDA: the unscale folded in, steps and skips as the unfused path") {
    std::vector<int> skips;
    std::vector<at::Tensor> finals;
    for (const bool fused : {false, true}) {
      torch::manual_seed(2);
      auto net = torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
      net->to(torch::kCUDA);
      torch::optim::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(1e-2));
      mp::Trainer<mp::MixedO2<at::Half>> trainer(
          net, adamw, mp::TrainerOptions().fused_optimizer(fused).max_grad_norm(1.0).scaler(
                          mp::GradScalerOptions().init_scale(std::ldexp(1.0, 30))));
      const auto x = torch::randn({32, 16}, torch::kCUDA);
      int skipped = 0;
      for (int step = 0; step < 20; ++step) {
        const auto report = trainer.step([&] {
          return net->forward(trainer.cast_input(x)).to(at::kFloat).square().mean();
        });
        skipped += report.status == mp::StepStatus::skipped;
      }
      CHECK(skipped >= 2);  // 2^30 overflows fp16 gradients at first
      CHECK(trainer.master_weights().front().device().is_cuda());
      CHECK(trainer.master_weights().front().isfinite().all().item<bool>());
      skips.push_back(skipped);
      finals.push_back(trainer.master_weights().front().cpu());
    }
    CHECK(skips[0] == skips[1]);
    CHECK(finals[0].allclose(finals[1], 1e-4, 1e-5));
  }

  TEST_CASE("a CPU+CUDA model under MixedO1 computes in bf16 on both devices") {
    struct Split : torch::nn::Module {
      Split() {
        front = register_module("front", torch::nn::Linear(8, 8));
        back = register_module("back", torch::nn::Linear(8, 4));
        back->to(torch::kCUDA);
      }
      torch::nn::Linear front{nullptr}, back{nullptr};
    };
    auto net = std::make_shared<Split>();
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    mp::Trainer<mp::MixedO1<at::BFloat16>> trainer(net, sgd);
    const auto x = torch::randn({4, 8});
    at::ScalarType front_dtype = at::kFloat, back_dtype = at::kFloat;
    REQUIRE(trainer.step([&] {
      const auto h = net->front->forward(x);
      const auto y = net->back->forward(h.to(torch::kCUDA));
      front_dtype = h.scalar_type();
      back_dtype = y.scalar_type();
      return y.to(at::kFloat).square().mean();
    }).stepped());
    CHECK(front_dtype == at::kBFloat16);
    CHECK(back_dtype == at::kBFloat16);  // before: fp32, autocast engaged on the CPU only
  }

  // One GPU, one rank: NCCL allows one rank per device, so this checks the device path of the
  // data-parallel Trainer (buckets, agreement, gathers on CUDA tensors), not the averaging.
  TEST_CASE("data parallel over NCCL on CUDA: one rank steps and skips as without a group" *
            doctest::skip(!mp::nccl_available)) {
    const auto dir = std::filesystem::path(MIXPREC_TEST_TMPDIR) / ("nccl_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    auto store = c10::make_intrusive<c10d::FileStore>((dir / "store").string(), 1);
    auto group = mp::nccl_group(store, 0, 1, std::chrono::seconds(60));
    std::vector<std::vector<at::Tensor>> finals;
    std::vector<std::vector<bool>> stepped;
    for (const bool distributed : {false, true}) {
      torch::manual_seed(2);
      auto net = torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::BatchNorm1d(16),
                                       torch::nn::Linear(16, 4));
      net->to(torch::kCUDA);
      torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
      auto options = mp::TrainerOptions().max_grad_norm(1.0).scaler(
          mp::GradScalerOptions().init_scale(std::ldexp(1.0, 30)));
      if (distributed) options.distributed(mp::DistributedOptions(group));
      mp::Trainer<mp::MixedO2<at::Half>> trainer(net, sgd, options);
      const auto x = torch::randn({32, 16}, torch::kCUDA);
      std::vector<bool> history;
      for (int step = 0; step < 12; ++step) {
        history.push_back(trainer.step([&] {
          return net->forward(trainer.cast_input(x)).to(at::kFloat).square().mean();
        }).stepped());
      }
      trainer.save((dir / "nccl.ckpt").string());
      trainer.load((dir / "nccl.ckpt").string());
      stepped.push_back(history);
      std::vector<at::Tensor> values;
      for (const auto& m : trainer.master_weights()) values.push_back(m.cpu());
      finals.push_back(values);
    }
    CHECK(stepped[0] == stepped[1]);
    CHECK(std::count(stepped[1].begin(), stepped[1].end(), false) >= 2);  // 2^30 overflows fp16
    for (std::size_t i = 0; i < finals[0].size(); ++i) CHECK(torch::equal(finals[0][i], finals[1][i]));
  }
}
