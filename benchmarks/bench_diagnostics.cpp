// The cost of the precision diagnostics, on the demo's CNN (batch 64, random images):
//  1. clean steps with every diagnostic off against the hand-written loop (target: the same as
//     Trainer without diagnostics, i.e. bench_trainer's ratio), then each diagnostic on:
//     gradient statistics every 100 steps and every step, the first-non-finite-op finder;
//  2. a skipped step (inf loss: the provenance pass runs) against a clean one;
//  3. mixprec::advise (3 fp32 steps, watched) against 3 training steps.
#include <mixprec/mixprec.hpp>

#include "harness.hpp"
#include "models.hpp"

#include <torch/torch.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace bench_diagnostics {

namespace {

using bench::models::Cnn;

struct Setup {
  Cnn model;
  std::unique_ptr<torch::optim::SGD> optimizer;
};

Setup make(std::uint64_t seed) {
  torch::manual_seed(seed);
  Setup s{Cnn(), nullptr};
  s.optimizer = std::make_unique<torch::optim::SGD>(s.model->parameters(),
                                                    torch::optim::SGDOptions(0.01).momentum(0.9));
  return s;
}

template <class P>
void per_step(const bench::Options& options, const std::vector<bench::models::ImageBatch>& data,
              int steps, bool with_hand_loop) {
  std::vector<Setup> setups;
  for (int i = 0; i < 5; ++i) setups.push_back(make(0));
  auto trainer_with = [&](Setup& s, mixprec::TrainerOptions o) {
    return std::make_shared<mixprec::Trainer<P>>(s.model, *s.optimizer, std::move(o));
  };
  auto off = trainer_with(setups[0], {});
  auto every100 = trainer_with(
      setups[1], mixprec::TrainerOptions().gradient_stats(mixprec::GradientStatsOptions().every(100)));
  auto every1 = trainer_with(
      setups[2], mixprec::TrainerOptions().gradient_stats(mixprec::GradientStatsOptions().every(1)));
  auto finder = trainer_with(setups[3], mixprec::TrainerOptions().find_non_finite_op(true));
  auto& hand = setups[4];
  auto run = [&](mixprec::Trainer<P>& trainer, Cnn& model) {
    return [&trainer, &model, &data, steps] {
      for (int i = 0; i < steps; ++i) {
        const auto& b = data[static_cast<std::size_t>(i) % data.size()];
        (void)trainer.step([&] {
          return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(b.x)), b.y);
        });
      }
    };
  };
  std::vector<bench::Variant> variants;
  if (with_hand_loop) {
    variants.push_back({"hand-written LibTorch loop", [&] {
                          for (int i = 0; i < steps; ++i) {
                            const auto& b = data[static_cast<std::size_t>(i) % data.size()];
                            hand.optimizer->zero_grad();
                            torch::nn::functional::cross_entropy(hand.model->forward(b.x), b.y)
                                .backward();
                            hand.optimizer->step();
                          }
                        }});
  }
  variants.push_back({"diagnostics off (default)", run(*off, setups[0].model)});
  variants.push_back({"gradient_stats every 100 steps", run(*every100, setups[1].model)});
  variants.push_back({"gradient_stats every step", run(*every1, setups[2].model)});
  variants.push_back({"find_non_finite_op", run(*finder, setups[3].model)});
  const auto ms = bench::interleaved_samples(variants, options);
  bench::print_table("Clean steps, Trainer<" + std::string(P::name) + ">: demo CNN, batch " +
                         std::to_string(data.front().x.size(0)) + ", " + std::to_string(steps) +
                         " SGD steps, " + std::to_string(at::get_num_threads()) + " threads",
                     variants, ms);
}

void skipped_step(const bench::Options& options, const std::vector<bench::models::ImageBatch>& data,
                  int steps) {
  auto clean = make(0);
  auto skip = make(0);
  mixprec::Trainer<mixprec::FullPrecision> clean_trainer(clean.model, *clean.optimizer);
  // Every step skips on purpose: no limit on skips in a row.
  mixprec::Trainer<mixprec::FullPrecision> skip_trainer(
      skip.model, *skip.optimizer, mixprec::TrainerOptions().max_consecutive_skips(0));
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<bench::Variant> variants = {
      {"clean step", [&] {
         for (int i = 0; i < steps; ++i) {
           const auto& b = data[static_cast<std::size_t>(i) % data.size()];
           (void)clean_trainer.step([&] {
             return torch::nn::functional::cross_entropy(clean.model->forward(b.x), b.y);
           });
         }
       }},
      {"skipped step (inf loss; names found by the second pass)", [&] {
         for (int i = 0; i < steps; ++i) {
           const auto& b = data[static_cast<std::size_t>(i) % data.size()];
           const auto report = skip_trainer.step([&] {
             return torch::nn::functional::cross_entropy(skip.model->forward(b.x), b.y) * inf;
           });
           if (!report.overflow || report.overflow->param_count == 0) std::abort();
         }
       }},
  };
  const auto ms = bench::interleaved_samples(variants, options);
  bench::print_table("Skipped steps, Trainer<FullPrecision>: demo CNN, batch " +
                         std::to_string(data.front().x.size(0)) + ", " + std::to_string(steps) +
                         " steps",
                     variants, ms);
}

void advisor(const bench::Options& options, const std::vector<bench::models::ImageBatch>& data) {
  auto train = make(0);
  auto watched = make(0);
  mixprec::Trainer<mixprec::FullPrecision> trainer(train.model, *train.optimizer);
  const std::vector<bench::Variant> variants = {
      {"3 Trainer<FullPrecision> steps", [&] {
         for (std::size_t i = 0; i < 3; ++i) {
           (void)trainer.step([&] {
             return torch::nn::functional::cross_entropy(train.model->forward(data[i].x), data[i].y);
           });
         }
       }},
      {"mixprec::advise, 3 steps", [&] {
         std::size_t i = 0;
         const auto advice = mixprec::advise(watched.model, [&] {
           const auto& b = data[i++ % data.size()];
           return torch::nn::functional::cross_entropy(watched.model->forward(b.x), b.y);
         });
         if (advice.layers.empty()) std::abort();
       }},
  };
  const auto ms = bench::interleaved_samples(variants, options);
  bench::print_table("mixprec::advise: demo CNN, batch " + std::to_string(data.front().x.size(0)),
                     variants, ms);
}

}  // namespace

int main(int argc, char** argv) {
  const auto options = bench::parse_options(argc, argv);
  torch::manual_seed(1);
  const std::int64_t batch = options.smoke ? 8 : 64;
  const int steps = options.smoke ? 2 : 20;
  const auto data = bench::models::image_batches(8, batch);
  std::printf("## bench_diagnostics: the cost of the precision diagnostics\n\n"
              "The demo's CNN on random images, SGD with momentum. %s Diagnostics off is the "
              "default; docs/diagnostics.md says what each one reads.\n",
              bench::method(options).c_str());
  per_step<mixprec::FullPrecision>(options, data, steps, /*with_hand_loop=*/true);
  per_step<mixprec::MixedO2<at::BFloat16>>(options, data, steps, /*with_hand_loop=*/false);
  skipped_step(options, data, steps);
  advisor(options, data);
  std::printf("\nRerun alone: `./scripts/bench bench_diagnostics`.\n");
  return 0;
}

}  // namespace bench_diagnostics
