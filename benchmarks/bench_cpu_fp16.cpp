// fp16 on this CPU: the demo CNN's convolutions (forward, input gradient, weight gradient) in fp16
// and bf16 against fp32, and whole training steps of the CNN per policy, with the remedy for
// CPUs whose fp16 weight gradient is oneDNN's reference loop (mixprec::nn::Conv2d's
// fp32_weight_grad) and with channels_last memory. Ratios to fp32, measured side by side.
//
//   ./build/default/benchmarks/bench_cpu_fp16          batch 64, as the demo trains
//   ./build/default/benchmarks/bench_cpu_fp16 --smoke  batch 8, 3 repetitions (ctest)

#include <harness.hpp>
#include "../examples/fashion_mnist/model.hpp"  // the demo's CNN

#include <mixprec/mixprec.hpp>

#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace bench_cpu_fp16 {

namespace {

struct ConvShape {
  const char* name;
  std::int64_t in, out, size;
};

// One convolution's three products in `dtype`, timed separately.
std::vector<bench::Variant> conv_variants(const ConvShape& s, std::int64_t batch, at::ScalarType dtype,
                                          const std::string& tag) {
  auto o = at::TensorOptions(dtype);
  auto x = at::randn({batch, s.in, s.size, s.size}).to(dtype);
  auto w = at::randn({s.out, s.in, 3, 3}).to(dtype);
  auto g = at::randn({batch, s.out, s.size, s.size}).to(dtype);
  (void)o;
  auto backward = [=](std::array<bool, 3> mask) {
    return [=] {
      auto r = at::convolution_backward(g, x, w, at::OptionalIntArrayRef(), {1, 1}, {1, 1}, {1, 1}, false,
                                        {0, 0}, 1, mask);
      (void)(mask[0] ? std::get<0>(r) : std::get<1>(r)).sum().item<float>();
    };
  };
  return {{tag + " forward", [=] { (void)at::conv2d(x, w, {}, 1, 1).sum().item<float>(); }},
          {tag + " input grad", backward({true, false, false})},
          {tag + " weight grad", backward({false, true, false})}};
}

template <class P>
bench::Variant step_variant(const std::string& name, std::int64_t batch, bool remedy, bool nhwc) {
  torch::manual_seed(0);
  auto model = std::make_shared<fashion_mnist::NetImpl>();
  if (nhwc) {
    for (auto& p : model->parameters()) {
      if (p.dim() == 4) p.set_data(p.data().contiguous(at::MemoryFormat::ChannelsLast));
    }
  }
  if (remedy) mixprec::nn::fp32_conv_weight_grads(*model);
  auto optimizer = std::make_shared<torch::optim::SGD>(model->parameters(),
                                                       torch::optim::SGDOptions(0.01).momentum(0.9));
  auto trainer = std::make_shared<mixprec::Trainer<P>>(
      model, *optimizer, mixprec::TrainerOptions().on_warning([](const std::string&) {}));
  auto x = torch::randn({batch, 1, 28, 28});
  if (nhwc) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  const auto y = torch::randint(0, 10, {batch});
  return {name, [=] {
            (void)optimizer;
            auto report = trainer->step([&] {
              return torch::nn::functional::cross_entropy(model->forward(trainer->cast_input(x)), y);
            });
            (void)report.loss.template item<float>();
          }};
}

}  // namespace

int main(int argc, char** argv) {
  const auto options = bench::parse_options(argc, argv);
  const std::int64_t batch = options.smoke ? 8 : 64;
  std::ostringstream cpu;
  cpu << mixprec::cpu_capabilities();
  std::printf("## fp16 on this CPU\n\n%s; LibTorch %s, %d threads, batch %lld. %s\n",
              cpu.str().c_str(), TORCH_VERSION, torch::get_num_threads(),
              static_cast<long long>(batch), bench::method(options).c_str());
  if (!mixprec::cpu_half_math) {
    std::printf("\nLibTorch %s computes no fp16 on the CPU: nothing to measure (ratio 1.00)\n",
                TORCH_VERSION);
    return 0;
  }
  for (const ConvShape& s : {ConvShape{"conv1 (1->16, 28x28)", 1, 16, 28},
                             ConvShape{"conv2 (16->32, 14x14)", 16, 32, 14}}) {
    std::vector<bench::Variant> variants;
    for (const auto& [dtype, tag] : {std::pair{at::kFloat, "fp32"}, std::pair{at::kHalf, "fp16"},
                                     std::pair{at::kBFloat16, "bf16"}}) {
      for (auto& v : conv_variants(s, batch, dtype, tag)) variants.push_back(std::move(v));
    }
    const auto ms = bench::interleaved_samples(variants, options);
    std::printf("\n### The demo CNN's %s, batch %lld\n\n| product | fp32 ms | fp16 ms | fp16 ratio | "
                "fp16 ratio IQR | bf16 ms | bf16 ratio | bf16 ratio IQR |\n"
                "|---|---:|---:|---:|---:|---:|---:|---:|\n",
                s.name, static_cast<long long>(batch));
    const char* products[] = {"forward", "input gradient", "weight gradient"};
    for (std::size_t p = 0; p < 3; ++p) {
      const auto f16 = bench::paired_ratio(ms[3 + p], ms[p]);
      const auto b16 = bench::paired_ratio(ms[6 + p], ms[p]);
      std::printf("| %s | %.3f | %.3f | %.2f | %s | %.3f | %.2f | %s |\n", products[p],
                  bench::median(ms[p]), bench::median(ms[3 + p]), f16.median,
                  bench::iqr(f16, 2).c_str(), bench::median(ms[6 + p]), b16.median,
                  bench::iqr(b16, 2).c_str());
    }
  }
  using Half = at::Half;
  using BF16 = at::BFloat16;
  std::vector<bench::Variant> steps = {
      step_variant<mixprec::FullPrecision>("FullPrecision", batch, false, false),
      step_variant<mixprec::FullPrecision>("FullPrecision, channels_last", batch, false, true),
      step_variant<mixprec::MixedO2<BF16>>("MixedO2<BFloat16>", batch, false, false),
      step_variant<mixprec::MixedO2<BF16>>("MixedO2<BFloat16>, channels_last", batch, false, true),
      step_variant<mixprec::MixedO1<Half>>("MixedO1<Half>", batch, false, false),
      step_variant<mixprec::MixedO1<Half>>("MixedO1<Half>, fp32 conv weight grads", batch, true, false),
      step_variant<mixprec::MixedO2<Half>>("MixedO2<Half>", batch, false, false),
      step_variant<mixprec::MixedO2<Half>>("MixedO2<Half>, fp32 conv weight grads", batch, true, false),
      step_variant<mixprec::MixedO2<Half>>("MixedO2<Half>, channels_last", batch, false, true),
  };
  bench::print_table("A training step of the demo CNN (Trainer, SGD momentum)", steps,
                     bench::interleaved_samples(steps, options));
  return 0;
}

}  // namespace bench_cpu_fp16
