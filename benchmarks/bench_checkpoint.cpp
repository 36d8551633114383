// Each rank's memory while a sharded run saves and loads (docs/benchmarks.md, "bench_checkpoint"):
// the consolidated checkpoint that sharded runs wrote before (every rank gathers every tensor's
// fp32 value and the whole optimizer: `torch::save(trainer, path)` still writes it) against the
// sharded checkpoint (`Trainer::save(dir)`: each rank writes its pieces), their loads, and the
// fp32 export gathered (WeightsFormat::pickle) against streamed (WeightsFormat::safetensors).
// ZeRO-1 and ZeRO-3 under MixedO2<BFloat16> + AdamW, ZeRO-3 under RemainderMasters<BFloat16>,
// bench_zero's MLP, at 2 and 4 ranks over Gloo on loopback. Per phase and rank: the peak of live
// CPU tensor bytes above what the rank held before the phase (counting_allocator.hpp), and VmHWM
// reset before the phase (glibc returning freed blocks at once: MALLOC_MMAP_THRESHOLD_=65536).
//
//   bench_checkpoint [--smoke]
#include "counting_allocator.hpp"
#include "harness.hpp"
#include "models.hpp"
#include "rank_processes.hpp"

#include <mixprec/distributed/process_group.hpp>
#include <mixprec/mixprec.hpp>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace mp = mixprec;
namespace fs = std::filesystem;

namespace bench_checkpoint {

namespace {

constexpr int kDepth = 4;
constexpr std::int64_t kBatch = 8;

using Bf16 = mp::MixedO2<at::BFloat16>;
using Remainder = mp::MixedO2<at::BFloat16, mp::RemainderMasters<at::BFloat16>>;

struct Config {
  const char* name;
  const char* policy;
  int stage;
};
const std::vector<Config> kConfigs{{"ZeRO-1", "MixedO2<BFloat16>", 1},
                                   {"ZeRO-3", "MixedO2<BFloat16>", 3},
                                   {"ZeRO-3", "MixedO2<BFloat16, RemainderMasters<BFloat16>>", 3}};

// The phases, in the order a rank runs them.
const std::vector<std::string> kPhases{"consolidated save", "sharded save", "sharded load",
                                       "consolidated load", "fp32 export, gathered",
                                       "fp32 export, streamed"};

// One phase's peaks above what the rank held before it: tensor bytes and VmHWM, MiB.
struct Peak {
  double tensors = 0;
  double rss = 0;
};

template <class P>
int rank_main(int rank, int world, int stage, const fs::path& dir, int width) {
  auto& tensors = bench::CountingCpuAllocator::install();  // first: it sees every tensor
  auto store = c10::make_intrusive<c10d::FileStore>((dir / "store").string(), world);
  auto group = mp::gloo_group(store, rank, world, std::chrono::seconds(600));
  auto net = bench::models::mlp_units(kDepth, width);
  torch::optim::AdamW optimizer(net->parameters(), torch::optim::AdamWOptions(1e-4));
  auto distributed = mp::DistributedOptions(group).shard_optimizer_state(true).shard_gradients(stage >= 2);
  if (stage >= 3) distributed.shard_parameters(bench::models::mlp_unit_paths(kDepth));
  mp::Trainer<P> trainer(net, optimizer, mp::TrainerOptions().distributed(distributed));
  const auto x = torch::randn({kBatch, width}), y = torch::randn({kBatch, width});
  for (int k = 0; k < 2; ++k) {
    trainer.step([&] { return (net->forward(trainer.cast_input(x)).to(torch::kFloat) - y).pow(2).mean(); });
  }
  const auto state = trainer.state_bytes();
  const double held = static_cast<double>(tensors.live()) / (1 << 20);
  // torch::save(trainer, path) writes on every rank: a file of each rank's (the memory is that of
  // the consolidated save, whose rank 0 alone wrote).
  const auto file = (dir / ("consolidated" + std::to_string(rank) + ".pt")).string();
  const auto sharded = (dir / "sharded").string();
  const std::vector<std::function<void()>> phases{
      [&] { torch::save(trainer, file); },
      [&] { trainer.save(sharded); },
      [&] { trainer.load(sharded); },
      [&] { torch::load(trainer, file); },
      [&] { trainer.save_fp32((dir / "fp32.pkl").string(), mp::WeightsFormat::pickle); },
      [&] { trainer.save_fp32((dir / "fp32.safetensors").string(), mp::WeightsFormat::safetensors); },
  };
  std::vector<Peak> peaks;
  for (const auto& phase : phases) {
    group->barrier()->wait();
    const auto before = tensors.live();
    const double rss_before = bench::memory_status().rss;
    tensors.reset_peak();
    bench::reset_peak_rss();
    phase();
    peaks.push_back({static_cast<double>(tensors.peak() - before) / (1 << 20),
                     bench::memory_status().peak - rss_before});
  }
  std::ofstream out(dir / ("rank" + std::to_string(rank) + ".txt"));
  out << bench::models::parameter_count(*net) << " " << held << " "
      << static_cast<double>(state.weights + state.gradients + state.masters + state.optimizer) / (1 << 20);
  for (const auto& p : peaks) out << " " << p.tensors << " " << p.rss;
  out << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--rank") {
    at::set_num_threads(1);
    const int rank = std::stoi(argv[2]), world = std::stoi(argv[3]), c = std::stoi(argv[4]);
    const fs::path dir = argv[5];
    const int width = std::stoi(argv[6]);
    const auto& config = kConfigs.at(static_cast<std::size_t>(c));
    if (c == 2) return rank_main<Remainder>(rank, world, config.stage, dir, width);
    return rank_main<Bf16>(rank, world, config.stage, dir, width);
  }
  const auto options = bench::parse_options(argc, argv);
  const int width = options.smoke ? 64 : 3584;
  const auto root = fs::temp_directory_path() / ("mixprec_bench_checkpoint_" + std::to_string(::getpid()));
  const auto self = fs::canonical("/proc/self/exe").string();
  std::ostringstream out;
  out << "## bench_checkpoint: each rank's memory while a sharded run saves and loads\n\n"
      << "AdamW, an MLP of " << kDepth << " Linear(" << width << ", " << width << ") + ReLU (bench_zero's; "
      << "ZeRO-3's units: each Linear), batch " << kBatch << " per rank, 2 steps before the "
      << "checkpoints, one thread per rank, the ranks over Gloo on loopback, each row in fresh "
      << "processes. Each phase's peak above what the rank held just before it, the largest over "
      << "the ranks: *tensors* is the peak of live CPU tensor bytes (counting_allocator.hpp, every "
      << "thread), *RSS* the rise of VmHWM (reset before the phase; glibc returns freed blocks at "
      << "once, MALLOC_MMAP_THRESHOLD_=65536). *held* is what the rank's tensors took before the "
      << "first phase (model, gradients, masters, optimizer state, batch). *consolidated* is the "
      << "single-file checkpoint that sharded runs wrote until now (every rank gathers every "
      << "tensor's fp32 value and the whole optimizer; `torch::save(trainer, path)` still writes "
      << "it), *sharded* `Trainer::save(dir)` and `load(dir)`; the fp32 export gathered is "
      << "`save_fp32(path, WeightsFormat::pickle)`, streamed `WeightsFormat::safetensors`. MiB.\n\n"
      << "| configuration | policy | ranks | held | consolidated save: tensors / RSS | sharded "
      << "save | sharded load | consolidated load | fp32 export, gathered | fp32 export, "
      << "streamed |\n|---|---|---:|---:|---|---|---|---|---|---|\n";
  bool ok = true;
  double params = 0;
  for (std::size_t c = 0; c < kConfigs.size(); ++c) {
    for (const int world : {2, 4}) {
      if (options.smoke && world == 4) continue;
      const auto dir = root / ("c" + std::to_string(c) + "_x" + std::to_string(world));
      fs::create_directories(dir);
      std::vector<bench::RankProcess> ranks;
      for (int r = 0; r < world; ++r) {
        bench::RankProcess p;
        p.argv = {self, "--rank", std::to_string(r), std::to_string(world), std::to_string(c),
                  dir.string(), std::to_string(width)};
        p.env = {{"MALLOC_MMAP_THRESHOLD_", "65536"}, {"OMP_NUM_THREADS", "1"}};
        p.log = (dir / ("rank" + std::to_string(r) + ".log")).string();
        ranks.push_back(std::move(p));
      }
      const auto outcome = bench::run_ranks(ranks, 1024, std::chrono::minutes(20));
      if (!outcome.all_ok) {
        std::cerr << "bench_checkpoint: a rank failed (" << kConfigs[c].name << ", "
                  << kConfigs[c].policy << ", " << world << " ranks); see " << dir << "\n";
        ok = false;
        continue;
      }
      std::vector<double> worst(2 + 2 * kPhases.size(), 0.0);
      for (int r = 0; r < world; ++r) {
        std::ifstream in(dir / ("rank" + std::to_string(r) + ".txt"));
        in >> params;
        for (auto& w : worst) {
          double v = 0;
          in >> v;
          w = std::max(w, v);
        }
      }
      out << "| " << kConfigs[c].name << " | " << kConfigs[c].policy << " | " << world << " | "
          << bench::fixed(worst[0], 0);
      for (std::size_t k = 0; k < kPhases.size(); ++k) {
        out << " | " << bench::fixed(worst[2 + 2 * k], 1) << " / " << bench::fixed(worst[3 + 2 * k], 1);
      }
      out << " |\n";
    }
  }
  out << "\n" << static_cast<std::int64_t>(params) << " parameters (" << bench::fixed(params * 4 / (1 << 20), 0)
      << " MiB in fp32). Command: `./build/default/benchmarks/bench_checkpoint` (it starts its "
      << "ranks; `./scripts/bench bench_checkpoint` writes this section).\n";
  std::cout << out.str();
  if (ok) fs::remove_all(root);  // a failed rank's log stays, for its Error
  return ok ? 0 : 1;
}

}  // namespace bench_checkpoint
