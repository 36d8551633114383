// The lean training state (core/state_storage.hpp) against MixedO2's fp32 masters and moments:
// the bytes of training state per parameter, and the time of a step whose cost is the optimizer
// pass (a wide MLP, one row per batch: the forward and backward passes are a small part).
//
//   bench_lean [--smoke]
//
// Bytes: Trainer::state_bytes() between steps (summed from the tensors), and "+ gradients":
// the Low gradients the backward pass makes (2 bytes per bf16 parameter), as the peak holds
// them; "step peak": the largest sum of live CPU tensor bytes during a step (tensor_memory.hpp:
// LibTorch's allocator reports, not RSS), per parameter. AdamW, the fused step where LibTorch
// has it (>= 2.4).
#include "harness.hpp"
#include "tensor_memory.hpp"

#include <mixprec/mixprec.hpp>

#include <torch/torch.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace mp = mixprec;

namespace bench_lean {

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl(std::int64_t width, int layers) {
    for (int i = 0; i < layers; ++i) {
      linears.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(width, width)));
    }
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& l : linears) x = torch::relu(l(x));
    return norm(x);
  }
  std::vector<torch::nn::Linear> linears;
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Mlp);

// One variant: its trainer, model, optimizer and data, built once; step() trains one batch.
struct Run {
  std::string name;
  std::function<void()> step;
  std::function<mp::TrainingStateBytes()> bytes;
  std::int64_t params = 0;
  std::int64_t low_params = 0;
};

template <class P>
Run make_run(std::string name, std::int64_t width, int layers, bool fused,
             bool in_backward = false) {
  torch::manual_seed(0);
  auto net = Mlp(width, layers);
  auto optimizer = std::make_shared<torch::optim::AdamW>(net->parameters(),
                                                         torch::optim::AdamWOptions(1e-4));
  auto trainer = std::make_shared<mp::Trainer<P>>(
      net, *optimizer, mp::TrainerOptions()
                           .fused_optimizer(fused && mp::fused_adam_available)
                           .step_in_backward(in_backward));
  auto x = torch::randn({1, width});
  auto y = torch::randn({1, width});
  Run run;
  run.name = std::move(name);
  run.step = [net, optimizer, trainer, x, y]() mutable {
    trainer->step([&] {
      return torch::mse_loss(net->forward(trainer->cast_input(x)).to(at::kFloat), y);
    });
  };
  run.bytes = [trainer] { return trainer->state_bytes(); };
  for (const auto& p : net->parameters()) {
    run.params += p.numel();
    if (p.scalar_type() != at::kFloat) run.low_params += p.numel();
  }
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  const auto options = bench::parse_options(argc, argv);
  torch::set_num_threads(1);
  const std::int64_t width = options.smoke ? 64 : 1024;
  const int layers = 4;
  using Lean = mp::RemainderMasters<at::BFloat16>;
  const auto make_runs = [&] {
    std::vector<std::function<Run()>> makers{
        [&] { return make_run<mp::MixedO2<at::BFloat16>>("MixedO2<BFloat16>", width, layers, true); },
        [&] {
          return make_run<mp::MixedO2<at::BFloat16>>("MixedO2<BFloat16>, unfused AdamW", width,
                                                     layers, false);
        },
        [&] {
          return make_run<mp::MixedO2<at::BFloat16, mp::RemainderMasters<>>>("RemainderMasters<>, one pass",
                                                                             width, layers, true);
        },
        [&] {
          return make_run<mp::MixedO2<at::BFloat16, Lean>>("RemainderMasters<BFloat16>, one pass", width,
                                                           layers, true);
        },
        [&] {
          return make_run<mp::PureHalf<at::BFloat16, mp::StochasticRounding<>>>(
              "PureHalf + StochasticRounding<BFloat16>, one pass", width, layers, true);
        },
        // Block formats (torchao's low-bit states): stepped in one pass whatever fused says.
        [&] {
          return make_run<mp::MixedO2<at::BFloat16, mp::RemainderMasters<mp::Moments8bit<>>>>(
              "RemainderMasters<Moments8bit>", width, layers, true);
        },
        [&] {
          return make_run<mp::PureHalf<at::BFloat16, mp::StochasticRounding<mp::Moments8bit<>>>>(
              "PureHalf + StochasticRounding<Moments8bit>", width, layers, true);
        },
        [&] {
          return make_run<mp::PureHalf<at::BFloat16, mp::StochasticRounding<mp::Moments4bit<>>>>(
              "PureHalf + StochasticRounding<Moments4bit>", width, layers, true);
        },
        [&] {
          return make_run<mp::PureHalf<at::BFloat16, mp::StochasticRounding<mp::MomentsFp8<>>>>(
              "PureHalf + StochasticRounding<MomentsFp8>", width, layers, true);
        }};
    // The step inside the backward pass (step_in_backward, LibTorch >= 2.1): one gradient
    // alive at a time.
    if (mp::post_accumulate_grad_hooks) {
      makers.emplace_back([&] {
        return make_run<mp::MixedO2<at::BFloat16>>("MixedO2<BFloat16>, step in backward", width,
                                                   layers, true, true);
      });
      makers.emplace_back([&] {
        return make_run<mp::PureHalf<at::BFloat16, mp::StochasticRounding<>>>(
            "PureHalf + StochasticRounding<BFloat16>, one pass, step in backward", width, layers,
            true, true);
      });
      makers.emplace_back([&] {
        return make_run<mp::PureHalf<at::BFloat16, mp::StochasticRounding<mp::Moments8bit<>>>>(
            "PureHalf + StochasticRounding<Moments8bit>, step in backward", width, layers, true,
            true);
      });
    }
    return makers;
  };
  const auto makers = make_runs();

  std::printf("## bench_lean: the lean training state's bytes and step time\n\n"
              "An MLP of %d Linear(%lld, %lld) layers and a LayerNorm, one row per batch, AdamW "
              "(%s; *one pass*: fused_optimizer under a lean storage, mixprec's one-pass step, "
              "optim/lean_adam.hpp; the block formats Moments8bit, Moments4bit, MomentsFp8 are "
              "always stepped so, in torchao's arithmetic: optim/quantized_adam.hpp), one "
              "thread. %s\n",
              layers, static_cast<long long>(width), static_cast<long long>(width),
              mp::fused_adam_available ? "ATen's fused step, but for the unfused row"
                                       : "LibTorch's step",
              bench::method(options).c_str());

  // Bytes after two steps (the optimizer's state exists), and the peak of the third: each
  // variant built and run under its own watch of the allocator, so that every tensor is known.
  std::printf("\n### Training state, bytes per parameter\n\n"
              "| variant | weights | masters | optimizer | between steps | + gradients | step peak |\n"
              "|---|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& make : makers) {
    bench::TensorMemoryWatch watch;
    auto r = make();
    r.step();
    r.step();
    const auto b = r.bytes();
    watch.bytes().reset_peak();
    r.step();
    const double peak = static_cast<double>(watch.bytes().peak());
    const auto per = [&](double bytes) {
      return bench::fixed(bytes / static_cast<double>(r.params), 2);
    };
    // The backward pass's gradients: 2 bytes per bf16 parameter, 4 per fp32 one.
    const double with_grads = static_cast<double>(b.total()) +
                              2.0 * static_cast<double>(r.low_params) +
                              4.0 * static_cast<double>(r.params - r.low_params);
    std::printf("| %s | %s | %s | %s | %s | %s | %s |\n", r.name.c_str(),
                per(static_cast<double>(b.weights)).c_str(),
                per(static_cast<double>(b.masters)).c_str(),
                per(static_cast<double>(b.optimizer)).c_str(),
                per(static_cast<double>(b.total())).c_str(), per(with_grads).c_str(),
                per(peak).c_str());
  }
  std::fflush(stdout);

  std::vector<Run> runs;
  for (const auto& make : makers) runs.push_back(make());
  std::vector<bench::Variant> variants;
  for (auto& r : runs) variants.push_back({r.name, [&r] { r.step(); }});
  const auto ms = bench::interleaved_samples(variants, options);
  bench::print_table("Step time (the optimizer pass dominates)", variants, ms);
  std::printf("\nCommand: `./build/bench/benchmarks/bench_lean` (`./scripts/bench bench_lean`). "
              "*between steps*: Trainer::state_bytes(), summed from the tensors; *+ gradients*: "
              "and the backward pass's gradients (2 bytes per bf16 parameter); *step peak*: the "
              "largest sum of live CPU tensor bytes during a step, from LibTorch's allocator "
              "reports (tensor_memory.hpp), each variant built and run under its own count. *step in "
              "backward*: TrainerOptions::step_in_backward, each tensor stepped as its gradient "
              "is complete and the gradient freed (the *+ gradients* column counts them all "
              "alive at once, as the ordinary step has them).\n");
  return 0;
}

}  // namespace bench_lean
