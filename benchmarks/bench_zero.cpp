// Sharded training state over Gloo on loopback, against unsharded data parallel: ZeRO-1
// (DistributedOptions::shard_optimizer_state), ZeRO-2 (shard_gradients) and ZeRO-3
// (shard_parameters, each Linear of the MLP a unit), under MixedO2<BFloat16> + AdamW, and the
// three stages again under the lean storages (RemainderMasters<BFloat16>, StochasticRounding<>).
// Per configuration and world size (1, 2, 4): the bytes per parameter a rank holds between steps
// (Trainer::state_bytes(), by kind) beside what they should be, the peak of live tensor bytes
// during a step, and peak RSS; then the step time of MixedO2's at 2 ranks against data
// parallel, interleaved in the same two processes. The program starts its ranks itself (this
// binary, `--rank ...`), each memory configuration in fresh processes, so that each peak is its
// own.
//
//   bench_zero [--smoke] [--memory]    (--memory: the bytes table alone, no step times)
#include "harness.hpp"
#include "models.hpp"
#include "counting_allocator.hpp"

#include <mixprec/mixprec.hpp>
#include <mixprec/distributed/process_group.hpp>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/torch.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

extern char** environ;
namespace mp = mixprec;

namespace bench_zero {

namespace {

using bench::models::mlp_unit_paths;
using bench::models::mlp_units;
using bench::models::parameter_count;

constexpr int kDepth = 4;
constexpr std::int64_t kBatch = 8;  // rows per rank and step
// The first step makes AdamW's state; the peaks come in the later ones.
constexpr int kMemorySteps = 3;
// Bytes per parameter a row's state may differ from its formula by (see main).
constexpr double kSlack = 0.01;

// Stage 0: data parallel, every rank holding everything; 1-3: ZeRO's stages, each including
// the ones before it.
mp::DistributedOptions sharding(const c10::intrusive_ptr<mp::ProcessGroup>& group, int stage) {
  auto options = mp::DistributedOptions(group)
                     .shard_optimizer_state(stage >= 1)
                     .shard_gradients(stage >= 2);
  if (stage >= 3) options.shard_parameters(mlp_unit_paths(kDepth));
  return options;
}

// One trained model: what both tables need, whatever its policy.
class Run {
 public:
  virtual ~Run() = default;
  virtual void step() = 0;
  virtual mp::TrainingStateBytes bytes() const = 0;
  /// The model's bytes of its largest unit (its weights in the model's dtype, as a gather
  /// makes them whole); 0 without units.
  std::int64_t largest_unit_bytes(int stage) const {
    if (stage < 3) return 0;
    std::int64_t largest = 0;
    const auto units = mlp_unit_paths(kDepth);
    for (const auto& child : net_->named_children()) {
      if (std::find(units.begin(), units.end(), child.key()) == units.end()) continue;
      std::int64_t bytes = 0;
      for (const auto& p : child.value()->parameters()) bytes += p.numel() * p.element_size();
      largest = std::max(largest, bytes);
    }
    return largest;
  }
  std::int64_t parameters() const { return parameter_count(*net_); }

 protected:
  explicit Run(torch::nn::Sequential net) : net_(std::move(net)) {}
  torch::nn::Sequential net_;
};

template <class P>
class PolicyRun final : public Run {
 public:
  PolicyRun(const c10::intrusive_ptr<mp::ProcessGroup>& group, int stage, int width)
      : Run(mlp_units(kDepth, width)),
        optimizer_(net_->parameters(), torch::optim::AdamWOptions(1e-4)),
        x_(torch::randn({kBatch, width})),
        y_(torch::randn({kBatch, width})),
        trainer_(net_, optimizer_, mp::TrainerOptions().distributed(sharding(group, stage))) {}
  void step() override {
    trainer_.step([&] {
      auto out = net_->forward(trainer_.cast_input(x_)).to(torch::kFloat);
      return (out - y_).pow(2).mean();
    });
  }
  mp::TrainingStateBytes bytes() const override { return trainer_.state_bytes(); }

 private:
  torch::optim::AdamW optimizer_;
  torch::Tensor x_, y_;
  mp::Trainer<P> trainer_;
};

using MakeRun = std::unique_ptr<Run> (*)(const c10::intrusive_ptr<mp::ProcessGroup>&, int stage,
                                         int width);

template <class P>
std::unique_ptr<Run> make_run(const c10::intrusive_ptr<mp::ProcessGroup>& group, int stage,
                              int width) {
  return std::make_unique<PolicyRun<P>>(group, stage, width);
}

// A row of the bytes table: a policy and a stage, and the bytes per parameter a rank should
// hold between steps at N ranks (weights + gradients + masters + optimizer state). `target`:
// issue 42's bound on the state between steps (the unit being gathered comes on top), checked
// by the program; null where none.
struct Config {
  const char* name;
  std::string_view policy;
  int stage;
  MakeRun make;
  const char* formula;
  double (*expected)(int world);
  const char* target_formula = nullptr;
  double (*target)(int world) = nullptr;
};

using Bf16 = mp::MixedO2<at::BFloat16>;
using Remainder = mp::MixedO2<at::BFloat16, mp::RemainderMasters<at::BFloat16>>;
using Rounded = mp::PureHalf<at::BFloat16, mp::StochasticRounding<>>;
// Under MixedO2 the bf16 weights (2 bytes) and fp32 masters (4) with AdamW's two fp32 moments
// (8). Gradients between steps: data parallel keeps its fp32 buckets (4; the masters' gradients
// are views of them, the model's bf16 ones are set to none); ZeRO-1 keeps them whole too,
// ZeRO-2 its fp32 slice of them. ZeRO-3 releases the units' weights: what stays is fp32 pieces,
// their slice of the gradients and of AdamW's moments.
// The lean storages keep a piece's bf16 value (a view of the model's weight; under ZeRO-3 the
// unit's own, counted as weights), no fp32 master between steps, and bf16 moments (4):
// RemainderMasters adds the piece's 16-bit remainder (2), StochasticRounding nothing. Their
// gradients are the same fp32 buckets or slices as MixedO2's.
const std::vector<Config> kConfigs{
    {"data parallel", Bf16::name, 0, make_run<Bf16>, "2 + 4 + 4 + 8", [](int) { return 18.0; }},
    {"ZeRO-1", Bf16::name, 1, make_run<Bf16>, "2 + 4 + (4 + 8) / N",
     [](int n) { return 6.0 + 12.0 / n; }},
    {"ZeRO-2", Bf16::name, 2, make_run<Bf16>, "2 + (4 + 4 + 8) / N",
     [](int n) { return 2.0 + 16.0 / n; }},
    {"ZeRO-3", Bf16::name, 3, make_run<Bf16>, "(4 + 4 + 8) / N", [](int n) { return 16.0 / n; }},
    {"ZeRO-1", Remainder::name, 1, make_run<Remainder>, "2 + 4 + (2 + 4) / N",
     [](int n) { return 6.0 + 6.0 / n; }},
    {"ZeRO-2", Remainder::name, 2, make_run<Remainder>, "2 + (4 + 2 + 4) / N",
     [](int n) { return 2.0 + 10.0 / n; }},
    {"ZeRO-3", Remainder::name, 3, make_run<Remainder>, "(2 + 4 + 2 + 4) / N",
     [](int n) { return 12.0 / n; }},
    {"ZeRO-1", Rounded::name, 1, make_run<Rounded>, "2 + 4 + 4 / N",
     [](int n) { return 6.0 + 4.0 / n; }},
    {"ZeRO-2", Rounded::name, 2, make_run<Rounded>, "2 + (4 + 4) / N",
     [](int n) { return 2.0 + 8.0 / n; }},
    {"ZeRO-3", Rounded::name, 3, make_run<Rounded>, "(2 + 4 + 4) / N",
     [](int n) { return 10.0 / n; }, "10 / N", [](int n) { return 10.0 / n; }},
};

// MixedO2's rows are the step-time table's too; the lean storages' are the bytes table's alone.
bool lean(const Config& config) { return config.policy != Bf16::name; }

c10::intrusive_ptr<mp::ProcessGroup> group_of(int rank, int world, const std::string& dir) {
  auto store = c10::make_intrusive<c10d::FileStore>(dir + "/store", world);
  return mp::gloo_group(store, rank, world, std::chrono::seconds(600));
}

// One configuration's rank: train a few steps, write what it held to DIR/rankR.txt.
int memory_rank(int rank, int world, const Config& config, const std::string& dir, bool smoke) {
  auto& tensors = bench::CountingCpuAllocator::install();  // first: it sees every tensor
  auto group = group_of(rank, world, dir);
  auto run = config.make(group, config.stage, smoke ? 64 : 3584);
  const double construction_peak = bench::memory_status().peak;
  // From here the peaks are the steps': the construction held the whole fp32 model on every
  // rank, whatever the stage.
  bench::reset_peak_rss();
  tensors.reset_peak();
  std::vector<double> ms;
  mp::TrainingStateBytes bytes;
  std::int64_t live = 0;
  for (int k = 0; k < kMemorySteps; ++k) {
    group->barrier()->wait();
    const auto start = bench::Clock::now();
    run->step();
    if (k > 0) ms.push_back(bench::ms_since(start));
    bytes = run->bytes();  // between steps
    live = tensors.live();
  }
  std::ofstream(dir + "/rank" + std::to_string(rank) + ".txt")
      << run->parameters() << " " << bytes.weights << " " << bytes.gradients << " "
      << bytes.masters << " " << bytes.optimizer << " " << run->largest_unit_bytes(config.stage)
      << " " << live << " " << tensors.peak() << " " << bench::memory_status().peak << " "
      << construction_peak << " " << bench::median(ms) << "\n";
  return 0;
}

// Every configuration at 2 ranks, interleaved in the same processes; rank 0 writes the table
// to DIR/table.md.
int time_rank(int rank, const std::string& dir, const bench::Options& options) {
  auto group = group_of(rank, 2, dir);
  const int width = options.smoke ? 64 : 2048;
  std::vector<const Config*> timed;
  std::vector<std::unique_ptr<Run>> runs;
  for (const auto& config : kConfigs) {
    if (lean(config)) continue;
    timed.push_back(&config);
    runs.push_back(config.make(group, config.stage, width));
  }
  const int steps = options.smoke ? 2 : 5;
  const auto ms = bench::interleaved_samples(runs.size(), options, [&](std::size_t v) {
    group->barrier()->wait();
    const auto start = bench::Clock::now();
    for (int k = 0; k < steps; ++k) runs[v]->step();
    return bench::ms_since(start) / steps;
  });
  if (rank != 0) return 0;
  std::ofstream out(dir + "/table.md");
  out << "\n### Step time at 2 ranks, " << Bf16::name << " + AdamW, MLP " << kDepth << "x"
      << width << " (" << runs.front()->parameters() << " parameters), batch " << kBatch
      << " per rank\n\n"
      << "| configuration | step ms | ratio to " << timed.front()->name
      << " | ratio IQR |\n|---|---:|---:|---:|\n";
  for (std::size_t v = 0; v < runs.size(); ++v) {
    const auto ratio = bench::paired_ratio(ms[v], ms[0]);
    out << "| " << timed[v]->name << " | " << bench::fixed(bench::median(ms[v]), 1) << " | "
        << bench::fixed(ratio.median, 2) << " | " << (v == 0 ? "" : bench::iqr(ratio, 2))
        << " |\n";
  }
  out << "\n" << bench::method(options) << " Each sample is " << steps << " steps.\n";
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

// The ranks' lines, summed up as the largest over the ranks (bytes per parameter, MiB, ms).
struct MemoryRow {
  double params = 0;
  double weights = 0, gradients = 0, masters = 0, optimizer = 0, total = 0;
  double live = 0, unit = 0, tensor_peak = 0;  // per parameter
  double rss_steps = 0, rss_construction = 0, ms = 0;
};

MemoryRow read_ranks(const std::filesystem::path& dir, int world) {
  MemoryRow row;
  for (int r = 0; r < world; ++r) {
    std::ifstream in(dir / ("rank" + std::to_string(r) + ".txt"));
    double n = 0, w = 0, g = 0, m = 0, o = 0, unit = 0, live = 0, peak = 0, rss = 0, built = 0,
           t = 0;
    in >> n >> w >> g >> m >> o >> unit >> live >> peak >> rss >> built >> t;
    row.params = n;
    row.weights = std::max(row.weights, w / n);
    row.gradients = std::max(row.gradients, g / n);
    row.masters = std::max(row.masters, m / n);
    row.optimizer = std::max(row.optimizer, o / n);
    row.total = std::max(row.total, (w + g + m + o) / n);
    row.unit = std::max(row.unit, unit / n);
    row.live = std::max(row.live, live / n);
    row.tensor_peak = std::max(row.tensor_peak, peak / n);
    row.rss_steps = std::max(row.rss_steps, rss);
    row.rss_construction = std::max(row.rss_construction, built);
    row.ms = std::max(row.ms, t);
  }
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[1]) == "--rank") {
    at::set_num_threads(1);
    const int rank = std::stoi(argv[2]);
    const bool smoke = std::string(argv[argc - 1]) == "--smoke";
    if (std::string(argv[3]) == "memory") {
      const auto& config = kConfigs.at(static_cast<std::size_t>(std::stoi(argv[4])));
      return memory_rank(rank, std::stoi(argv[5]), config, argv[6], smoke);
    }
    return time_rank(rank, argv[4], bench::options_for(smoke));
  }
  // --memory: the bytes table alone; the rest is the harness's (--smoke).
  bool memory_only = false;
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--memory") {
      memory_only = true;
    } else {
      rest.push_back(argv[i]);
    }
  }
  const auto options = bench::parse_options(static_cast<int>(rest.size()), rest.data());
  const auto root = std::filesystem::temp_directory_path() /
                    ("mixprec_bench_zero_" + std::to_string(::getpid()));
  const int width = options.smoke ? 64 : 3584;
  std::ostringstream out;
  out << "## bench_zero: sharded training state (ZeRO-1, 2, 3) over Gloo, on loopback\n\n"
      << "AdamW under " << Bf16::name << " (data parallel and ZeRO-1, 2, 3), "
      << Remainder::name << " and " << Rounded::name << " (ZeRO-1, 2, 3), an MLP of " << kDepth
      << " Linear(" << width << ", " << width
      << ") + ReLU, each Linear declared as mixprec::nn::Mappable (ZeRO-3's units), batch "
      << kBatch << " per rank, one thread per rank; each row in fresh processes, "
      << kMemorySteps << " steps. Bytes per parameter of the model on one rank (the largest "
      << "over the ranks): *weights*, *gradients*, *masters*, *optimizer* are "
      << "Trainer::state_bytes() after the last step, summed from the tensors (a released "
      << "weight has none, a ZeRO-3 unit's bf16 piece kept by a lean storage counts as weights; "
      << "gradients are data parallel's fp32 buckets, or ZeRO-2's slices of them; masters are "
      << "the fp32 masters or this rank's pieces of them, or what a lean storage keeps of them: "
      << "RemainderMasters' 16-bit remainders, StochasticRounding's nothing but a one-float "
      << "placeholder per piece); *expected* is the formula below the table. *all tensors* counts "
      << "every CPU tensor alive in the process "
      << "at the same moment (counting_allocator.hpp: an allocator between LibTorch and its "
      << "own, which sees Gloo's threads too), the batch included; *step peak* is the largest "
      << "such sum during the steps: activations, the backward's gradients, buckets in flight, "
      << "gathered units and the optimizer's temporaries. *largest unit* is what a gather makes "
      << "whole for a unit's forward or backward (its bf16 weights), which ZeRO-3 holds on top "
      << "of its state. *peak RSS, steps* is VmHWM reset after the Trainer's construction "
      << "(/proc/self/clear_refs) and read after the steps, the largest over the ranks; *peak "
      << "RSS, built* is VmHWM before that reset (every rank builds the whole fp32 model before "
      << "the Trainer shards it). RSS keeps what malloc keeps of freed memory and the "
      << "libraries' pages; the tensor columns do not. *step ms*: the median of the steps after "
      << "the first, not interleaved (the next table is for time).\n\n"
      << "| configuration | policy | ranks | weights | gradients | masters | optimizer | total | "
      << "expected | all tensors | largest unit | step peak | peak RSS, steps MiB | peak RSS, "
      << "built MiB | step ms |\n"
      << "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  bool ok = true;
  double params = 0;
  std::ostringstream checks;
  for (std::size_t c = 0; c < kConfigs.size(); ++c) {
    const auto& config = kConfigs[c];
    // ctest's smoke run leaves out 4 ranks, and 1 rank for the lean storages (2 ranks are
    // what they do differently sharded): 24 of the 70 processes.
    const auto worlds = !options.smoke   ? std::vector<int>{1, 2, 4}
                        : lean(config) ? std::vector<int>{2}
                                       : std::vector<int>{1, 2};
    for (const int world : worlds) {
      const auto dir = root / ("memory_" + std::to_string(c) + "_" + std::to_string(world));
      std::filesystem::create_directories(dir);
      std::vector<std::string> args{"memory", std::to_string(c), std::to_string(world),
                                    dir.string()};
      if (options.smoke) args.emplace_back("--smoke");
      if (!spawn_ranks(world, args)) {
        std::cerr << "bench_zero: a rank failed (" << config.name << ", " << config.policy
                  << ", " << world << " ranks)\n";
        ok = false;
        continue;
      }
      const auto row = read_ranks(dir, world);
      params = row.params;
      out << "| " << config.name << " | " << config.policy << " | " << world << " | "
          << bench::fixed(row.weights, 2) << " | " << bench::fixed(row.gradients, 2) << " | "
          << bench::fixed(row.masters, 2) << " | " << bench::fixed(row.optimizer, 2) << " | "
          << bench::fixed(row.total, 2) << " | " << bench::fixed(config.expected(world), 2)
          << " | " << bench::fixed(row.live, 2) << " | "
          << (config.stage >= 3 ? bench::fixed(row.unit, 2) : "") << " | "
          << bench::fixed(row.tensor_peak, 2) << " | " << bench::fixed(row.rss_steps, 0)
          << " | " << bench::fixed(row.rss_construction, 0) << " | " << bench::fixed(row.ms, 1)
          << " |\n";
      // The state is its formula up to the buckets' padding (world - 1 elements at most per
      // bucket) and the lean pieces' placeholders (4 bytes per piece): less than kSlack.
      if (std::abs(row.total - config.expected(world)) > kSlack) {
        std::cerr << "bench_zero: " << config.name << " under " << config.policy << " at "
                  << world << " ranks holds " << row.total << " bytes per parameter between "
                  << "steps, not " << config.formula << " = " << config.expected(world) << "\n";
        ok = false;
      }
      if (config.target != nullptr) {
        const double held = row.total + row.unit;
        const double bound = config.target(world) + row.unit;
        const bool within = held <= bound + kSlack;
        checks << "| " << config.name << ", " << config.policy << " | " << world << " | "
               << bench::fixed(row.total, 3) << " + " << bench::fixed(row.unit, 3) << " = "
               << bench::fixed(held, 3) << " | " << config.target_formula << " + "
               << bench::fixed(row.unit, 3) << " = " << bench::fixed(bound, 3) << " | "
               << (within ? "pass" : "FAIL") << " |\n";
        if (!within) {
          std::cerr << "bench_zero: " << config.name << " under " << config.policy << " at "
                    << world << " ranks holds " << held << " bytes per parameter with its "
                    << "largest unit gathered, above the target " << config.target_formula
                    << " + the unit = " << bound << "\n";
          ok = false;
        }
      }
    }
  }
  out << "\n" << static_cast<std::int64_t>(params) << " parameters. Expected bytes per "
      << "parameter on each of N ranks between steps (weights + gradients + masters + optimizer "
      << "state):";
  for (std::size_t c = 0; c < kConfigs.size(); ++c) {
    const auto& config = kConfigs[c];
    const bool first_of_policy = c == 0 || kConfigs[c - 1].policy != config.policy;
    out << (c == 0 ? " " : first_of_policy ? ". " : "; ");
    if (first_of_policy) out << config.policy << ": ";
    out << config.name << " " << config.formula;
  }
  out << ". During a step ZeRO-3 adds the unit being gathered. The program fails if a total is "
      << "more than " << kSlack << " B/param off its formula (the buckets' padding and the lean "
      << "pieces' placeholders are less).\n";
  if (!checks.str().empty()) {
    out << "\nIssue 42's target for the lean state under ZeRO-3: at most 10 / N bytes per "
        << "parameter, plus one unit gathered (checked by the program: a row that fails makes "
        << "it exit 1).\n\n| configuration | ranks | state + largest unit, B/param | target, "
        << "B/param | result |\n|---|---:|---:|---:|---|\n"
        << checks.str();
  }
  if (!memory_only) {
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
  out << "\nCommand: `./build/default/benchmarks/bench_zero" << (memory_only ? " --memory" : "")
      << "` (it starts its ranks; `--memory`: the bytes tables alone; `./scripts/bench "
      << "bench_zero` writes this section)\n";
  std::cout << out.str();
  std::filesystem::remove_all(root);
  return ok ? 0 : 1;
}

}  // namespace bench_zero
