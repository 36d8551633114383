// Sharded optimizer state (DistributedOptions::shard_optimizer_state) over Gloo on loopback:
// memory per rank at 1, 2 and 4 ranks, sharded and not, for a model of 51M parameters under
// MixedO2<BFloat16> + AdamW; and the step time, sharded against unsharded, at 2 ranks. The
// program starts its ranks itself (this binary, `--rank ...`), each configuration in fresh
// processes, so that each peak RSS is that configuration's own.
#include "harness.hpp"
#include "models.hpp"

#include <mixprec/mixprec.hpp>
#include <mixprec/distributed/process_group.hpp>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/torch.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;
namespace mp = mixprec;
using Policy = mp::MixedO2<at::BFloat16>;

namespace {

using bench::models::mlp;
using bench::models::parameter_count;

// The bytes the optimizer side holds on this rank: the tensors it steps (fp32 masters, or their
// pieces) and AdamW's state.
double optimizer_bytes(torch::optim::Optimizer& optimizer) {
  double bytes = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      bytes += static_cast<double>(p.numel() * p.element_size());
      if (auto* state = mp::detail::state_of(optimizer, p)) {
        auto& adamw = static_cast<torch::optim::AdamWParamState&>(*state);
        bytes += static_cast<double>(adamw.exp_avg().numel() * adamw.exp_avg().element_size() +
                                     adamw.exp_avg_sq().numel() * adamw.exp_avg_sq().element_size());
      }
    }
  }
  return bytes;
}

struct Trained {
  Trained(int width, std::int64_t batch, const mp::DistributedOptions& options)
      : net(mlp(4, width)),
        optimizer(net->parameters(), torch::optim::AdamWOptions(1e-4)),
        x(torch::randn({batch, width})),
        y(torch::randn({batch, width})) {
    trainer = std::make_unique<mp::Trainer<Policy>>(net, optimizer,
                                                    mp::TrainerOptions().distributed(options));
  }
  void step() {
    trainer->step([&] {
      auto out = net->forward(trainer->cast_input(x)).to(torch::kFloat);
      return (out - y).pow(2).mean();
    });
  }
  torch::nn::Sequential net;
  torch::optim::AdamW optimizer;
  torch::Tensor x, y;
  std::unique_ptr<mp::Trainer<Policy>> trainer;
};

c10::intrusive_ptr<mp::ProcessGroup> group_of(int rank, int world, const std::string& dir) {
  auto store = c10::make_intrusive<c10d::FileStore>(dir + "/store", world);
  return mp::gloo_group(store, rank, world, std::chrono::seconds(600));
}

// One configuration's rank: train a few steps, write "params peak_mib baseline_mib
// optimizer_bytes step_ms" to DIR/rankR.txt.
int memory_rank(int rank, int world, bool sharded, const std::string& dir, bool smoke) {
  auto group = group_of(rank, world, dir);
  const double baseline = bench::memory_status().rss;  // the libraries, Gloo's buffers
  const int width = smoke ? 64 : 3584;
  Trained t(width, 8, mp::DistributedOptions(group).shard_optimizer_state(sharded));
  std::vector<double> ms;
  for (int k = 0; k < (smoke ? 2 : 4); ++k) {
    group->barrier()->wait();
    const auto start = bench::Clock::now();
    t.step();
    if (k > 0) ms.push_back(bench::ms_since(start));
  }
  std::ofstream(dir + "/rank" + std::to_string(rank) + ".txt")
      << parameter_count(*t.net) << " " << bench::memory_status().peak << " " << baseline << " "
      << optimizer_bytes(t.optimizer) << " " << bench::median(ms) << "\n";
  return 0;
}

// Sharded against unsharded at 2 ranks, interleaved in the same processes; rank 0 writes the
// table to DIR/table.md.
int time_rank(int rank, const std::string& dir, const bench::Options& options) {
  auto group = group_of(rank, 2, dir);
  const int width = options.smoke ? 64 : 2048;
  Trained plain(width, 8, mp::DistributedOptions(group));
  Trained sharded(width, 8, mp::DistributedOptions(group).shard_optimizer_state(true));
  const int steps = options.smoke ? 2 : 5;
  const auto ms = bench::interleaved_samples(2, options, [&](std::size_t v) {
    group->barrier()->wait();
    const auto start = bench::Clock::now();
    for (int k = 0; k < steps; ++k) (v == 0 ? plain : sharded).step();
    return bench::ms_since(start) / steps;
  });
  if (rank != 0) return 0;
  const auto ratio = bench::paired_ratio(ms[1], ms[0]);
  std::ofstream(dir + "/table.md")
      << "\n### Step time at 2 ranks, MLP 4x" << width << " (" << parameter_count(*plain.net)
      << " parameters), batch 8 per rank\n\n"
      << "| optimizer state | step ms | ratio to replicated | ratio IQR |\n|---|---:|---:|---:|\n"
      << "| replicated | " << bench::fixed(bench::median(ms[0]), 1) << " | 1.00 | |\n| sharded | "
      << bench::fixed(bench::median(ms[1]), 1) << " | " << bench::fixed(ratio.median, 2) << " | "
      << bench::iqr(ratio, 2) << " |\n\nstep time ratio, sharded / replicated: **"
      << bench::fixed(ratio.median, 2) << "** (IQR " << bench::iqr(ratio, 2)
      << "; target <= 1.1). " << bench::method(options) << "\n";
  return 0;
}

// Starts `world` ranks of this binary with `args` after "--rank R"; true if all exited 0.
bool spawn_ranks(int world, const std::vector<std::string>& args) {
  const auto self = std::filesystem::canonical("/proc/self/exe").string();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    std::vector<std::string> all{self, "--rank", std::to_string(rank)};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv.data(), environ) != 0) return false;
    pids.push_back(pid);
  }
  bool ok = true;
  for (const auto pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[1]) == "--rank") {
    at::set_num_threads(1);
    const int rank = std::stoi(argv[2]);
    const bool smoke = std::string(argv[argc - 1]) == "--smoke";
    if (std::string(argv[3]) == "memory") {
      return memory_rank(rank, std::stoi(argv[4]), std::string(argv[5]) == "1", argv[6], smoke);
    }
    return time_rank(rank, argv[4], bench::options_for(smoke));
  }
  const auto options = bench::parse_options(argc, argv);
  const auto root = std::filesystem::temp_directory_path() /
                    ("mixprec_bench_zero_" + std::to_string(::getpid()));
  std::ostringstream out;
  out << "## bench_zero: sharded optimizer state (ZeRO-1) over Gloo, on loopback\n\n"
      << "MixedO2<BFloat16> + AdamW, MLP 4x" << (options.smoke ? 64 : 3584) << ", batch 8 per "
      << "rank, one thread per rank; each configuration in fresh processes. *optimizer B/param* "
      << "counts what the optimizer side holds on a rank (fp32 masters or their slices, AdamW's "
      << "two moments) per parameter of the model; *peak RSS* is the rank's VmHWM, the largest "
      << "over the ranks; *above start* is that peak minus the rank's RSS once its process group "
      << "existed, per parameter. Step times are medians of 3 steps: the memory runs are not "
      << "interleaved (see the next table for time).\n\n"
      << "| ranks | optimizer state | parameters | optimizer B/param | target | peak RSS MiB | "
      << "above start B/param | step ms |\n|---:|---|---:|---:|---:|---:|---:|---:|\n";
  bool ok = true;
  for (const int world : {1, 2, 4}) {
    for (const bool sharded : {false, true}) {
      const auto dir = root / (std::to_string(world) + (sharded ? "_sharded" : "_replicated"));
      std::filesystem::create_directories(dir);
      std::vector<std::string> args{"memory", std::to_string(world), sharded ? "1" : "0",
                                    dir.string()};
      if (options.smoke) args.emplace_back("--smoke");
      if (!spawn_ranks(world, args)) {
        std::cerr << "bench_zero: a rank failed (" << world << " ranks)\n";
        ok = false;
        continue;
      }
      double params = 0, peak = 0, above = 0, bytes = 0, ms = 0;
      for (int r = 0; r < world; ++r) {
        std::ifstream in(dir / ("rank" + std::to_string(r) + ".txt"));
        double n = 0, p = 0, base = 0, b = 0, t = 0;
        in >> n >> p >> base >> b >> t;
        params = n;
        peak = std::max(peak, p);
        above = std::max(above, (p - base) * 1024.0 * 1024.0 / n);
        bytes = std::max(bytes, b / n);
        ms = std::max(ms, t);
      }
      out << "| " << world << " | " << (sharded ? "sharded" : "replicated") << " | "
          << static_cast<std::int64_t>(params) << " | " << bench::fixed(bytes, 2) << " | "
          << (sharded ? "<= " : "") << (sharded ? bench::fixed(12.0 / world * 1.05, 2) : "12") << " | "
          << bench::fixed(peak, 0) << " | " << bench::fixed(above, 1) << " | "
          << bench::fixed(ms, 1) << " |\n";
    }
  }
  {
    const auto dir = root / "time";
    std::filesystem::create_directories(dir);
    std::vector<std::string> args{"time", dir.string()};
    if (options.smoke) args.emplace_back("--smoke");
    if (spawn_ranks(2, args)) {
      std::ifstream in(dir / "table.md");
      out << in.rdbuf();
    } else {
      std::cerr << "bench_zero: a rank of the timing run failed\n";
      ok = false;
    }
  }
  out << "\nCommand: `./build/default/benchmarks/bench_zero` (it starts its ranks)\n";
  std::cout << out.str();
  std::filesystem::remove_all(root);
  return ok ? 0 : 1;
}
