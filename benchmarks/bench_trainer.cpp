// Trainer overhead and memory:
//  1. Trainer<FullPrecision> vs the same loop written by hand (target: ratio <= 1.02);
//  2. TrainerOptions::fused_optimizer vs the unfused step on an optimizer-bound model (many
//     parameters, a small batch; target: a step >= 1.3x faster);
//  3. peak RSS of each policy on a model whose activations dominate memory, each policy in a
//     child process of its own so that peaks do not mix.
#include <mixprec/mixprec.hpp>

#include "harness.hpp"

#include <torch/torch.h>

#include <array>
#include <cstdio>
#include <memory>
#include <string>

namespace bench_trainer {

namespace {

torch::nn::Sequential make_mlp(std::int64_t width) {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(256, width), torch::nn::ReLU(),
                               torch::nn::Linear(width, width), torch::nn::ReLU(),
                               torch::nn::Linear(width, 10));
}

void overhead(const bench::Options& options) {
  const std::int64_t width = options.smoke ? 64 : 512;
  const std::int64_t batch = options.smoke ? 16 : 256;
  const int steps = options.smoke ? 2 : 20;
  auto x = torch::randn({batch, 256});
  auto y = torch::randint(0, 10, {batch}, at::kLong);

  auto hand_model = make_mlp(width);
  torch::optim::Adam hand_opt(hand_model->parameters(), torch::optim::AdamOptions(1e-3));
  auto trainer_model = make_mlp(width);
  torch::optim::Adam trainer_opt(trainer_model->parameters(), torch::optim::AdamOptions(1e-3));
  mixprec::Trainer<mixprec::FullPrecision> trainer(trainer_model, trainer_opt);

  const std::vector<bench::Variant> variants = {
      {"hand-written LibTorch loop",
       [&] {
         for (int i = 0; i < steps; ++i) {
           hand_opt.zero_grad();
           torch::nn::functional::cross_entropy(hand_model->forward(x), y).backward();
           hand_opt.step();
         }
       }},
      {"Trainer<FullPrecision>",
       [&] {
         for (int i = 0; i < steps; ++i) {
           trainer.step([&] { return torch::nn::functional::cross_entropy(trainer_model->forward(x), y); });
         }
       }},
  };
  const auto ms = bench::interleaved_samples(variants, options);
  bench::print_table("Trainer overhead: MLP 256-" + std::to_string(width) + "-" +
                         std::to_string(width) + "-10, batch " + std::to_string(batch) + ", " +
                         std::to_string(steps) + " Adam steps, " +
                         std::to_string(at::get_num_threads()) + " threads",
                     variants, ms);
}

// One policy's training steps; returns the process's peak RSS in MiB.
template <class P>
double peak_rss_of(bool smoke) {
  const std::int64_t batch = smoke ? 64 : 4096;
  auto model = make_mlp(smoke ? 64 : 1024);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(1e-3));
  mixprec::Trainer<P> trainer(model, sgd);
  auto x = torch::randn({batch, 256});
  auto y = torch::randint(0, 10, {batch}, at::kLong);
  for (int i = 0; i < 3; ++i) {
    trainer.step([&] { return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y); });
  }
  return bench::memory_status().peak;
}

double run_child(const char* self, const std::string& policy, bool smoke) {
  const std::string command =
      std::string(self) + " --rss-child " + policy + (smoke ? " --smoke" : "");
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command.c_str(), "r"), pclose);
  double mib = 0.0;
  if (!pipe || std::fscanf(pipe.get(), "%lf", &mib) != 1) {
    std::fprintf(stderr, "child for %s failed\n", policy.c_str());
    std::exit(1);
  }
  return mib;
}

/// One Trainer<P> step loop with AdamW, fused or not, on a deep 1024-wide MLP at batch 8.
template <class P>
void fused_vs_unfused(const bench::Options& options) {
#if MIXPREC_TORCH_AT_LEAST(2, 4)
  const std::int64_t width = options.smoke ? 64 : 1024;
  const int layers = options.smoke ? 2 : 6;
  const int steps = options.smoke ? 2 : 5;
  auto make = [&] {
    torch::manual_seed(0);
    torch::nn::Sequential net;
    for (int i = 0; i < layers; ++i) {
      net->push_back(torch::nn::Linear(width, width));
      net->push_back(torch::nn::Tanh());
    }
    return net;
  };
  auto x = torch::randn({8, width});
  auto y = torch::randn({8, width});
  auto unfused_net = make();
  auto fused_net = make();
  torch::optim::AdamW unfused_opt(unfused_net->parameters(), torch::optim::AdamWOptions(1e-4));
  torch::optim::AdamW fused_opt(fused_net->parameters(), torch::optim::AdamWOptions(1e-4));
  mixprec::Trainer<P> unfused(unfused_net, unfused_opt);
  mixprec::Trainer<P> fused(fused_net, fused_opt, mixprec::TrainerOptions().fused_optimizer(true));
  auto loop = [&](mixprec::Trainer<P>& trainer, torch::nn::Sequential& net) {
    return [&] {
      for (int i = 0; i < steps; ++i) {
        const auto report = trainer.step([&] {
          return torch::mse_loss(net->forward(trainer.cast_input(x)), trainer.cast_input(y));
        });
        if (!report.stepped()) std::abort();  // finite data: never skipped
      }
    };
  };
  const std::vector<bench::Variant> variants = {
      {"Trainer<" + std::string(P::name) + ">, AdamW", loop(unfused, unfused_net)},
      {"the same, fused_optimizer(true)", loop(fused, fused_net)},
  };
  const auto ms = bench::interleaved_samples(variants, options);
  const auto params = static_cast<long long>(layers) * (width * width + width);
  bench::print_table("Fused AdamW: " + std::string(P::name) + ", " + std::to_string(layers) +
                         " Linear(" + std::to_string(width) + ", " + std::to_string(width) +
                         ") layers (" + std::to_string(params) + " parameters), batch 8, " +
                         std::to_string(steps) + " steps, " + std::to_string(at::get_num_threads()) +
                         " threads",
                     variants, ms);
  const auto speed_up = bench::paired_ratio(ms[0], ms[1]);
  std::printf("\nA fused step is %.2fx faster (IQR %s; target >= 1.3x: %s).\n", speed_up.median,
              bench::iqr(speed_up, 2).c_str(), speed_up.median >= 1.3 ? "met" : "MISSED");
#else
  (void)options;
  std::printf("\n### Fused AdamW: %s\n\nLibTorch %s has no fused CPU Adam kernel (2.4 on): "
              "TrainerOptions::fused_optimizer is an Error here.\n", std::string(P::name).c_str(),
              TORCH_VERSION);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[1]) == "--rss-child") {
    const std::string policy = argv[2];
    const bool smoke = argc >= 4;
    double mib = 0.0;
    if (policy == "FullPrecision") mib = peak_rss_of<mixprec::FullPrecision>(smoke);
    if (policy == "MixedO1") mib = peak_rss_of<mixprec::MixedO1<at::BFloat16>>(smoke);
    if (policy == "MixedO2") mib = peak_rss_of<mixprec::MixedO2<at::BFloat16>>(smoke);
    if (policy == "PureHalf") mib = peak_rss_of<mixprec::PureHalf<at::BFloat16>>(smoke);
    std::printf("%.1f\n", mib);
    return mib > 0 ? 0 : 1;
  }
  const auto options = bench::parse_options(argc, argv);
  overhead(options);
  fused_vs_unfused<mixprec::FullPrecision>(options);
  fused_vs_unfused<mixprec::MixedO2<at::BFloat16>>(options);

  const std::array<const char*, 4> policies = {"FullPrecision", "MixedO1", "MixedO2", "PureHalf"};
  std::printf("\n### Peak RSS per policy: MLP 256-1024-1024-10, batch 4096, bf16, SGD\n\n"
              "| policy | peak RSS MiB | ratio to FullPrecision |\n|---|---:|---:|\n");
  double baseline = 0.0;
  for (const auto* policy : policies) {
    const double mib = run_child(argv[0], policy, options.smoke);
    if (baseline == 0.0) baseline = mib;
    std::printf("| %s | %.1f | %.2f |\n", policy, mib, mib / baseline);
  }
  std::printf("\nCommand: ./build/default/benchmarks/bench_trainer\n");
  return 0;
}

}  // namespace bench_trainer
