// Data parallel over Gloo on loopback: what the gradient averaging costs per step, bucketed and
// overlapped against one allreduce per tensor after the backward pass, and the throughput of
// 2 processes against 1. The program starts its ranks itself (this binary, `--rank R DIR`),
// over a FileStore in DIR; rank 0 prints the tables. Each rank uses one thread: the machine
// this runs on in CI has 2 cores, which bound the scaling.
#include "harness.hpp"
#include "models.hpp"

#include <mixprec/mixprec.hpp>
#include <mixprec/distributed/process_group.hpp>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/torch.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;
namespace mp = mixprec;

namespace bench_distributed {

namespace {

constexpr int kWorld = 2;

using bench::models::mlp;
using bench::models::parameter_count;

// A model, its optimizer and its Trainer; `steps` training steps per run().
template <class P>
struct Setup {
  Setup(int depth, int width, std::int64_t batch, std::optional<mp::DistributedOptions> dist)
      : net(mlp(depth, width)),
        optimizer(net->parameters(), torch::optim::SGDOptions(1e-3)),
        x(torch::randn({batch, width})),
        y(torch::randn({batch, width})) {
    auto options = mp::TrainerOptions();
    if (dist) options.distributed(*dist);
    trainer = std::make_unique<mp::Trainer<P>>(net, optimizer, options);
  }
  void run(int steps) {
    for (int i = 0; i < steps; ++i) {
      trainer->step([&] {
        auto out = net->forward(trainer->cast_input(x)).to(torch::kFloat);
        return (out - y).pow(2).mean();
      });
    }
  }
  torch::nn::Sequential net;
  torch::optim::SGD optimizer;
  torch::Tensor x, y;
  std::unique_ptr<mp::Trainer<P>> trainer;
};

using bench::fixed;

/// Milliseconds per step, [variant][repetition]: each variant runs `steps` steps per sample.
bench::Samples step_ms(const std::vector<bench::Variant>& variants, int steps,
                       const bench::Options& options) {
  auto ms = bench::interleaved_samples(variants, options);
  for (auto& samples : ms) {
    for (auto& sample : samples) sample /= steps;
  }
  return ms;
}

int run_rank(int rank, const std::string& dir, const bench::Options& options) {
  auto store = c10::make_intrusive<c10d::FileStore>(dir + "/store", kWorld);
  auto group = mp::gloo_group(store, rank, kWorld, std::chrono::seconds(120));
  const int steps = options.smoke ? 2 : 10;
  const std::int64_t batch = 32;
  std::ostringstream out;

  out << "## bench_distributed: data parallel over Gloo, 2 processes on loopback\n\n"
      << "Per optimizer step, FullPrecision, SGD, batch " << batch << " per rank, one thread per "
      << "rank. *overhead* = step time with `TrainerOptions::distributed` minus the same step "
      << "without it, both measured in the 2 processes at once (interleaved in alternating order, "
      << "medians of " << options.repetitions << " runs of " << steps << " steps after "
      << options.warmup << " warm-up; overheads and ratios paired per run).\n\n"
      << "| model | tensors | parameters | local step ms | distributed step ms | overhead ms | "
      << "overhead ratio | ratio IQR |\n|---|---:|---:|---:|---:|---:|---:|---:|\n";
  struct Size {
    int depth, width;
  };
  const std::vector<Size> sizes = options.smoke ? std::vector<Size>{{2, 32}}
                                                : std::vector<Size>{{4, 64}, {4, 256}, {4, 512},
                                                                    {4, 1024}, {4, 2048}};
  for (const auto size : sizes) {
    Setup<mp::FullPrecision> local(size.depth, size.width, batch, std::nullopt);
    Setup<mp::FullPrecision> dist(size.depth, size.width, batch, mp::DistributedOptions(group));
    const auto ms = step_ms(
        {{"local", [&] { local.run(steps); }}, {"distributed", [&] { dist.run(steps); }}}, steps,
        options);
    const auto ratio = bench::paired_ratio(ms[1], ms[0]);
    out << "| MLP " << size.depth << "x" << size.width << " | " << local.net->parameters().size()
        << " | " << parameter_count(*local.net) << " | " << fixed(bench::median(ms[0]), 3)
        << " | " << fixed(bench::median(ms[1]), 3) << " | "
        << fixed(bench::paired_difference(ms[1], ms[0]).median, 3) << " | "
        << fixed(ratio.median, 2) << " | " << bench::iqr(ratio, 2) << " |\n";
  }

  // Many small tensors: where per-tensor collectives pay their latency again and again.
  const int depth = options.smoke ? 4 : 64, width = options.smoke ? 32 : 128;
  Setup<mp::FullPrecision> local(depth, width, batch, std::nullopt);
  Setup<mp::FullPrecision> bucketed(depth, width, batch, mp::DistributedOptions(group));
  Setup<mp::FullPrecision> unoverlapped(depth, width, batch,
                                        mp::DistributedOptions(group).overlap(false));
  Setup<mp::FullPrecision> per_tensor(
      depth, width, batch,
      mp::DistributedOptions(group).bucket_cap_mb(0).first_bucket_cap_mb(0).overlap(false));
  const auto ms = step_ms({{"local", [&] { local.run(steps); }},
                           {"bucketed, overlapped", [&] { bucketed.run(steps); }},
                           {"bucketed, after backward", [&] { unoverlapped.run(steps); }},
                           {"per tensor, after backward", [&] { per_tensor.run(steps); }}},
                          steps, options);
  const auto overhead = [&](std::size_t v) {
    return bench::paired_difference(ms[v], ms[0]).median;
  };
  const double overhead_bucketed = overhead(1), overhead_per_tensor = overhead(3);
  out << "\n### Buckets and overlap, MLP " << depth << "x" << width << " ("
      << local.net->parameters().size() << " tensors, " << parameter_count(*local.net)
      << " parameters)\n\n| reduction | step ms | overhead ms |\n|---|---:|---:|\n"
      << "| none (local step) | " << fixed(bench::median(ms[0]), 3) << " | |\n"
      << "| DDP buckets (25 MiB, first 1 MiB), launched during backward (default) | "
      << fixed(bench::median(ms[1]), 3) << " | " << fixed(overhead_bucketed, 3) << " |\n"
      << "| DDP buckets, launched after backward | " << fixed(bench::median(ms[2]), 3) << " | "
      << fixed(overhead(2), 3) << " |\n"
      << "| one allreduce per tensor after backward | " << fixed(bench::median(ms[3]), 3) << " | "
      << fixed(overhead_per_tensor, 3) << " |\n\n"
      << "overhead ratio, per tensor / bucketed and overlapped: **"
      << fixed(overhead_per_tensor / std::max(overhead_bucketed, 1e-6), 2)
      << "** (target >= 1.5)\n";

  // The 16-bit reduction: half the bytes, rounded twice.
  {
    const int w = options.smoke ? 32 : 1024;
    const auto low = mixprec::gloo_reduces_bf16 ? at::kBFloat16 : at::kHalf;  // 1.13's Gloo: no bf16
    using P = mp::MixedO2<at::BFloat16>;
    Setup<P> fp32(4, w, batch, mp::DistributedOptions(group));
    Setup<P> half(4, w, batch, mp::DistributedOptions(group).reduce_dtype(low));
    const auto t = step_ms(
        {{"fp32", [&] { fp32.run(steps); }}, {"16-bit", [&] { half.run(steps); }}}, steps, options);
    const auto ratio = bench::paired_ratio(t[0], t[1]);
    out << "\n### Reduction dtype, MixedO2<BFloat16>, MLP 4x" << w << "\n\n"
        << "| reduced in | step ms |\n|---|---:|\n| fp32 (default) | "
        << fixed(bench::median(t[0]), 3) << " |\n| " << c10::toString(low) << " | "
        << fixed(bench::median(t[1]), 3) << " |\n\nratio fp32 / " << c10::toString(low) << ": "
        << fixed(ratio.median, 2) << " (IQR " << bench::iqr(ratio, 2) << ")\n";
  }

  // Scaling: the same per-rank batch on 1 process (rank 0 alone, rank 1 waits) and on 2,
  // interleaved; each run starts at a barrier, where rank 1 waits while rank 0 runs alone.
  {
    const int w = options.smoke ? 32 : 512;
    Setup<mp::FullPrecision> alone(4, w, batch, std::nullopt);
    Setup<mp::FullPrecision> both(4, w, batch, mp::DistributedOptions(group));
    const auto t = bench::interleaved_samples(2, options, [&](std::size_t v) {
      group->barrier()->wait();  // outside the timing
      const auto start = bench::Clock::now();
      if (v == 1) {
        both.run(steps);
      } else if (rank == 0) {
        alone.run(steps);
      }
      return bench::ms_since(start) / steps;
    });
    if (rank == 0) {
      const double t1 = bench::median(t[0]), t2 = bench::median(t[1]);
      const auto per_rank = bench::paired_ratio(t[0], t[1]);  // t1 / t2 per run
      const bench::Quartiles ratio{2 * per_rank.q1, 2 * per_rank.median, 2 * per_rank.q3};
      out << "\n### Scaling, FullPrecision, MLP 4x" << w << ", batch " << batch << " per process\n\n"
          << "| processes | step ms | samples/s |\n|---|---:|---:|\n| 1 | " << fixed(t1, 3)
          << " | " << fixed(batch * 1000.0 / t1, 0) << " |\n| 2 | " << fixed(t2, 3) << " | "
          << fixed(2 * batch * 1000.0 / t2, 0) << " |\n\nthroughput ratio, 2 processes / 1: "
          << fixed(ratio.median, 2) << " (IQR " << bench::iqr(ratio, 2)
          << "; bounded by the cores: at most 2 on a 2-core machine, whose cores the 2 processes "
          << "share with Gloo's threads)\n";
    }
  }
  out << "\nCommand: `./build/default/benchmarks/bench_distributed` (it starts its 2 ranks)\n";
  if (rank == 0) std::cout << out.str();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 4 && std::string(argv[1]) == "--rank") {
    at::set_num_threads(1);
    return run_rank(std::stoi(argv[2]), argv[3],
                    bench::options_for(argc == 5 && std::string(argv[4]) == "--smoke"));
  }
  const auto options = bench::parse_options(argc, argv);
  const auto self = std::filesystem::canonical("/proc/self/exe").string();
  const auto dir = std::filesystem::temp_directory_path() /
                   ("mixprec_bench_distributed_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < kWorld; ++rank) {
    std::vector<std::string> args{self, "--rank", std::to_string(rank), dir.string()};
    if (options.smoke) args.emplace_back("--smoke");
    std::vector<char*> argv_rank;
    for (auto& a : args) argv_rank.push_back(a.data());
    argv_rank.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv_rank.data(), environ) != 0) {
      std::cerr << "bench_distributed: cannot start rank " << rank << "\n";
      return 1;
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (const auto pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  std::filesystem::remove_all(dir);
  return failed == 0 ? 0 : 1;
}

}  // namespace bench_distributed
