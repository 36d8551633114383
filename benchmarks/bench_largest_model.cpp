// The memory headline under the whole-run rule: the largest BERT-style encoder (hidden 768, 12
// heads, intermediate 3072, random initialisation, layers added until it no longer fits) whose
// whole run keeps every rank's peak RSS within a fixed budget, 4 data-parallel ranks over Gloo on
// loopback: building the model and the Trainer, three AdamW steps, a save, a load at the same
// world size, the Trainer's teardown, and a load of that checkpoint at another world size (fresh
// processes: build, load, teardown). For MixedO2<BFloat16> + data parallel, + activation
// checkpointing, + ZeRO-3 (its layers built unit by unit, mixprec::ShardedBuild), + the lean
// training state (PureHalf<BFloat16, StochasticRounding<>>: bf16 weights and moments); and
// PyTorch's FSDP2 (fully_shard per layer on the meta device, torch.utils.checkpoint, bf16
// parameters with fp32 reduction, torch.distributed.checkpoint) beside them
// (benchmarks/python/fsdp_encoder.py).
//
// Each run is fresh processes (this binary with --rank, largest_model_rank.hpp, or the Python
// script) of one configuration at one number of layers; each phase's peak RSS is measured on its
// own, and a watchdog in each rank ends the run as soon as its RSS passes the budget, naming the
// phase; the parent ends all ranks when the machine's available memory runs low. The search: two
// small probe runs measure the bytes each layer adds to the whole run's peak (and to each
// phase's); the line through them predicts the largest size; runs at it and next to it confirm
// that L layers fit and L + 1 do not. Then the losses: every configuration on the same small
// model, weights and data, its first steps' losses against a reference run's, bitwise (the lean
// row's against its own policy unsharded).
//
//   ./build/default/benchmarks/bench_largest_model              4 ranks, 3072 MiB, the load at 3
//                                                               (~40 minutes on 2 busy cores)
//   ./build/default/benchmarks/bench_largest_model --smoke      2 ranks, 384 MiB, the load at 1,
//                                                               a small model (ctest; FSDP2
//                                                               predicted only)
//   ... [--budget MIB] [--world N] [--reshard-world N (0: none)] [--no-python]
//       [--predict-python] [--only NAME-PREFIX]...
// MIXPREC_PYTHON: the Python with torch (./scripts/bench and ctest set it).
// MIXPREC_BENCH_TRACE=1: rank 0 of each C++ run prints where its memory goes (stderr).
#include "harness.hpp"
#include "largest_model_rank.hpp"
#include "rank_processes.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace bench_largest_model {

using namespace largest;

namespace {

// The machine's available memory under which all ranks of a run are stopped.
constexpr double kReserveMiB = 1536;

// The phases a row reports, in order; "reshard": the whole process that loads the checkpoint at
// the other world size.
const std::vector<std::string> kPhases{"build", "steps", "save", "load", "reshard", "teardown"};

// ---- Configurations

struct Config {
  std::string name;
  Kind kind;
  bool checkpoint;
  bool zero3;
  // The bytes per parameter of a layer a rank keeps between steps: the table's *expected*.
  double unit_bytes(int world) const {
    if (!zero3) return 20;  // bf16 weight + bf16 gradient + fp32 master, its gradient, AdamW's 2
    if (kind == Kind::lean) return 10.0 / world;  // bf16 weight + bf16 moments + fp32 grad slice
    return 16.0 / world;                          // fp32 piece, its gradient slice, AdamW's 2
  }
};

std::vector<Config> configurations() {
  return {
      {"MixedO2<BFloat16> + data parallel", Kind::o2, false, false},
      {"+ activation checkpointing", Kind::o2, true, false},
      {"+ ZeRO-3 (shard_parameters, built unit by unit)", Kind::o2, true, true},
      {"+ lean state (PureHalf<BFloat16, StochasticRounding<>>, its layers built in bf16)",
       Kind::lean, true, true},
      {"Python FSDP2: fully_shard per layer + checkpoint, MixedPrecisionPolicy(bf16, fp32), DCP",
       Kind::python, true, true},
  };
}

// ---- The parent

std::string python() {
  const char* env = std::getenv("MIXPREC_PYTHON");
  return env != nullptr && *env != '\0' ? env : "python3";
}

// What one run (all ranks of one configuration at one size, and the load at the other world
// size) gave.
struct Run {
  std::int64_t layers = 0;
  enum class Status { fits, over, blocked, failed } status = Status::failed;
  std::string note;            // over: in which phase; blocked: the Error; failed: how
  std::int64_t parameters = 0;
  double base = 0;             // MiB, the largest over the ranks
  std::map<std::string, double> phases;  // each phase's peak RSS, MiB, the largest over the ranks
  double peak = 0;             // the whole run's: the largest phase
  double state_bytes = 0;      // Trainer::state_bytes() (Python: the same tensors), largest rank
  double ms = 0;               // the last step, slowest rank
  std::vector<std::vector<double>> losses;  // [rank][step]
};

// The ranks of one process set: `world` of them in `mode`; their results into `run`, phases
// prefixed with `prefix`.
void run_ranks_of(const Config& c, std::int64_t layers, int steps, int world, Mode mode,
                  const Sizes& sizes, bool smoke, const fs::path& dir, const fs::path& checkpoint,
                  Run& run) {
  fs::create_directories(dir);
  const auto self = fs::canonical("/proc/self/exe").string();
  std::vector<bench::RankProcess> ranks;
  for (int r = 0; r < world; ++r) {
    bench::RankProcess p;
    if (c.kind == Kind::python) {
      p.argv = {python(), MIXPREC_FSDP_ENCODER_SCRIPT};
    } else {
      p.argv = {self, "--rank"};
    }
    const std::vector<std::string> args{std::to_string(r),
                                        std::to_string(world),
                                        dir.string(),
                                        kind_key(c.kind),
                                        c.checkpoint ? "1" : "0",
                                        c.zero3 ? "1" : "0",
                                        std::to_string(layers),
                                        std::to_string(steps),
                                        bench::fixed(sizes.budget_mib, 0),
                                        smoke ? "smoke" : "full",
                                        mode_key(mode),
                                        checkpoint.string()};
    p.argv.insert(p.argv.end(), args.begin(), args.end());
    // glibc returns each freed block of 64 KiB or more to the system at once, so that the RSS
    // follows the live memory, not malloc's caching (it would raise the threshold as blocks
    // are freed); one thread per rank: 4 ranks share 2 cores.
    p.env = {{"MALLOC_MMAP_THRESHOLD_", "65536"}, {"OMP_NUM_THREADS", "1"}};
    p.log = (dir / ("rank" + std::to_string(r) + ".log")).string();
    ranks.push_back(std::move(p));
  }
  const auto outcome = bench::run_ranks(ranks, kReserveMiB, std::chrono::minutes(20));
  const std::string prefix = mode == Mode::load ? "reshard " : "";
  // A rank over the budget, or the machine's memory running low, ends a run as too large;
  // a rank whose peer was killed meanwhile fails in a collective with an Error that is no
  // refusal: the library refused the configuration only where every rank says so.
  int errors = 0, done = 0;
  std::string error;
  bool over = false;
  for (int r = 0; r < world; ++r) {
    std::ifstream in(dir / ("rank" + std::to_string(r) + ".txt"));
    std::string word;
    if (!(in >> word)) continue;
    if (word == "over") {
      std::string phase;
      in >> phase;
      over = true;
      run.note = prefix + phase;
    } else if (word == "error") {
      std::getline(in, error);
      ++errors;
    } else if (word == "ok") {
      ++done;
      std::map<std::string, double> v;
      std::vector<double> losses;
      std::string key;
      while (in >> key && key != "losses") in >> v[key];
      double l = 0;
      while (in >> l) losses.push_back(l);
      for (const auto& [name, value] : v) {
        if (name == "params" || name == "base" || name == "rest" || name == "state" || name == "ms") continue;
        // The load at the other world size counts as one phase: its process's peak.
        auto& slot = run.phases[mode == Mode::load ? "reshard" : name];
        slot = std::max(slot, value);
      }
      if (mode == Mode::load) continue;
      run.parameters = static_cast<std::int64_t>(v["params"]);
      run.base = std::max(run.base, v["base"]);
      run.state_bytes = std::max(run.state_bytes, v["state"]);
      run.ms = std::max(run.ms, v["ms"]);
      run.losses.push_back(losses);
    }
  }
  if (over) {
    run.status = Run::Status::over;
  } else if (outcome.machine_memory) {
    run.status = Run::Status::over;
    run.note = "machine memory";
  } else if (errors == world) {
    run.status = Run::Status::blocked;
    run.note = error;
  } else if (errors > 0) {
    run.status = Run::Status::failed;
    run.note = "a rank failed:" + error;
  } else if (!outcome.all_ok || done != world) {
    run.status = Run::Status::failed;
    run.note = outcome.deadline ? "deadline" : prefix + "a rank failed";
  }
  if (run.status == Run::Status::failed || std::getenv("MIXPREC_BENCH_TRACE") != nullptr) {
    for (int r = 0; r < world; ++r) {
      std::ifstream log(dir / ("rank" + std::to_string(r) + ".log"));
      const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
      std::cerr << "bench_largest_model: " << prefix << "rank " << r << "'s output:\n" << text << "\n";
    }
  }
}

// One configuration at one size: its run (`mode`), and, for a full run, the load of its
// checkpoint at the other world size. A size fits when every phase of both stays within the
// budget on every rank.
Run run_configuration(const Config& c, std::int64_t layers, int steps, const Sizes& sizes,
                      bool smoke, const fs::path& root, Mode mode = Mode::run) {
  static int counter = 0;
  const auto dir = root / ("run" + std::to_string(counter++));
  // A file (Trainer::save, unsharded), a directory (a sharded Trainer::save, or
  // torch.distributed.checkpoint).
  const auto checkpoint = dir / (c.kind == Kind::python ? "checkpoint" : "run.ckpt");
  Run run;
  run.layers = layers;
  run.status = Run::Status::fits;
  run_ranks_of(c, layers, steps, sizes.world, mode, sizes, smoke, dir / "main", checkpoint, run);
  if (run.status == Run::Status::fits && mode == Mode::run && sizes.reshard_world > 0) {
    run_ranks_of(c, layers, steps, sizes.reshard_world, Mode::load, sizes, smoke, dir / "reshard",
                 checkpoint, run);
  }
  for (const auto& [name, value] : run.phases) run.peak = std::max(run.peak, value);
  if (run.status == Run::Status::fits && run.peak > sizes.budget_mib) {
    run.status = Run::Status::over;  // between two watchdog readings
    for (const auto& [name, value] : run.phases) {
      if (value > sizes.budget_mib) run.note = name;
    }
  }
  fs::remove_all(dir);  // the checkpoints: several GiB at the largest sizes
  std::cerr << "bench_largest_model: " << c.name << ", " << layers << " layers: "
            << (run.status == Run::Status::fits     ? "fits"
                : run.status == Run::Status::over   ? "over (" + run.note + ")"
                : run.status == Run::Status::blocked ? "blocked:" + run.note
                                                     : "failed (" + run.note + ")")
            << ", peak " << bench::fixed(run.peak, 0) << " MiB (";
  for (const auto& [name, value] : run.phases) std::cerr << name << " " << bench::fixed(value, 0) << " ";
  std::cerr << "), step " << bench::fixed(run.ms, 0) << " ms\n";
  return run;
}

// A phase's peak against the layers, a line through two runs that fit (memory grows with the
// layers by the same bytes each: the model, its gradients and state, a layer's activations).
struct Line {
  double intercept = 0;
  double slope = 0;  // MiB per layer
  static std::optional<Line> through(const Run& a, const Run& b, const std::string& phase) {
    if (a.status != Run::Status::fits || b.status != Run::Status::fits || a.layers == b.layers) {
      return std::nullopt;
    }
    const auto value = [&](const Run& r) {
      if (phase.empty()) return r.peak;
      const auto it = r.phases.find(phase);
      return it == r.phases.end() ? std::nan("") : it->second;
    };
    Line line;
    line.slope = (value(b) - value(a)) / static_cast<double>(b.layers - a.layers);
    line.intercept = value(a) - line.slope * static_cast<double>(a.layers);
    if (!std::isfinite(line.slope)) return std::nullopt;
    return line;
  }
  // The most layers whose value stays within `budget`.
  std::int64_t within(double budget) const {
    return static_cast<std::int64_t>(std::floor((budget - intercept) / slope));
  }
};

// The largest layers that fit: two small probe runs give the bytes per layer, the line through
// them predicts the largest size, and runs at and around it confirm it (L fits, L + 1 does not).
struct Search {
  std::vector<Run> runs;
  std::optional<Run> best;          // the largest run that fits
  std::optional<Line> whole;        // the whole run's peak, from the probes
  std::map<std::string, Line> phases;  // each phase's, from the probes
  std::optional<std::int64_t> predicted;
  std::string binds;                // the phase over the budget at the smallest size that did not fit
  bool confirmed = false;           // best.layers + 1 ran and did not fit
  std::string blocked;              // the Error that refused the configuration
  std::string failed;
};

Search search(const Config& c, const Sizes& sizes, bool smoke, bool confirm, const fs::path& root) {
  Search s;
  const auto record = [&](Run run) {
    s.runs.push_back(run);
    if (run.status == Run::Status::blocked) s.blocked = run.note;
    if (run.status == Run::Status::failed) s.failed = run.note;
    if (run.status == Run::Status::fits && (!s.best || run.layers > s.best->layers)) s.best = run;
    return run;
  };
  const std::int64_t probes[2] = {smoke ? 1 : 2, smoke ? 3 : 8};
  const auto a = record(run_configuration(c, probes[0], sizes.steps, sizes, smoke, root));
  if (a.status != Run::Status::fits) return s;
  const auto b = record(run_configuration(c, probes[1], sizes.steps, sizes, smoke, root));
  if (!s.blocked.empty() || !s.failed.empty()) return s;
  s.whole = Line::through(a, b, "");
  for (const auto& phase : kPhases) {
    if (const auto line = Line::through(a, b, phase)) s.phases.emplace(phase, *line);
  }
  std::int64_t lo = a.layers, hi = b.status == Run::Status::fits ? -1 : b.layers;
  if (hi < 0) lo = b.layers;
  if (s.whole && s.whole->slope > 0) {
    // The largest phase at the probes need not be the largest at scale: every phase's line.
    s.predicted = s.whole->within(sizes.budget_mib);
    for (const auto& [phase, line] : s.phases) {
      if (line.slope > 0) s.predicted = std::min(*s.predicted, line.within(sizes.budget_mib));
    }
  }
  if (!confirm) return s;
  auto next = s.predicted.value_or((lo + std::max<std::int64_t>(hi, lo + 2)) / 2);
  s.confirmed = hi == lo + 1;
  for (int attempt = 0; attempt < (smoke ? 1 : 4) && !s.confirmed; ++attempt) {
    next = std::max(next, lo + 1);
    if (hi > 0) next = std::min(next, hi - 1);
    if (next <= lo) break;
    const auto run = record(run_configuration(c, next, sizes.steps, sizes, smoke, root));
    if (run.status == Run::Status::blocked || run.status == Run::Status::failed) break;
    if (run.status == Run::Status::fits) {
      lo = run.layers;
      const double room = s.whole && s.whole->slope > 0 ? (sizes.budget_mib - run.peak) / s.whole->slope : 1.0;
      next = lo + std::max<std::int64_t>(1, static_cast<std::int64_t>(std::floor(room)));
    } else {
      // The prediction is good to a layer or two: one below it first, then bisection.
      next = hi < 0 ? run.layers - 1 : (lo + run.layers) / 2;
      hi = run.layers;
    }
    s.confirmed = hi == lo + 1;
  }
  // What bound it: the phase over the budget at the smallest size that did not fit.
  std::optional<std::int64_t> smallest_over;
  for (const auto& r : s.runs) {
    if (r.status == Run::Status::over && (!smallest_over || r.layers < *smallest_over)) {
      smallest_over = r.layers;
      s.binds = r.note;
    }
  }
  return s;
}

// "2 8 20 21x": the layers of each run; x: over the budget (the phase in the row's *bound by*),
// m: stopped as the machine's available memory ran low.
std::string layers_run(const Search& s) {
  std::string text;
  for (const auto& r : s.runs) {
    if (!text.empty()) text += " ";
    text += std::to_string(r.layers);
    if (r.status == Run::Status::over) text += r.note == "machine memory" ? "m" : "x";
  }
  return text;
}

std::string millions(std::int64_t n) { return bench::fixed(static_cast<double>(n) / 1e6, 1); }

double per_parameter(double mib, std::int64_t parameters) {
  return mib * kMiB / static_cast<double>(parameters);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--rank") {
    const auto a = parse_rank_args(argc, argv);
    if (!a) {
      std::cerr << "bench_largest_model --rank: expected 12 arguments\n";
      return 2;
    }
    return rank_main(*a);
  }
  bool smoke = false, with_python = true, predict_python = false;
  std::optional<double> budget;
  std::optional<int> world, reshard_world;
  std::vector<std::string> only;  // --only, repeated: the configurations named by any prefix
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--smoke") {
      smoke = true;
    } else if (arg == "--no-python") {
      with_python = false;
    } else if (arg == "--predict-python") {
      predict_python = true;
    } else if (arg == "--budget" && i + 1 < argc) {
      budget = std::stod(argv[++i]);
    } else if (arg == "--world" && i + 1 < argc) {
      world = std::stoi(argv[++i]);
    } else if (arg == "--reshard-world" && i + 1 < argc) {
      reshard_world = std::stoi(argv[++i]);
    } else if (arg == "--only" && i + 1 < argc) {
      only.emplace_back(argv[++i]);
    } else {
      std::cerr << "usage: " << argv[0] << " [--smoke] [--budget MIB] [--world N]"
                << " [--reshard-world N] [--no-python] [--predict-python] [--only NAME-PREFIX]...\n";
      return 2;
    }
  }
  auto sizes = sizes_for(smoke);
  if (budget) sizes.budget_mib = *budget;
  if (world) sizes.world = *world;
  if (world && !reshard_world) sizes.reshard_world = std::max(0, *world - 1);
  if (reshard_world) sizes.reshard_world = *reshard_world;
  const auto root = fs::temp_directory_path() / ("mixprec_bench_largest_" + std::to_string(::getpid()));
  fs::create_directories(root);
  const auto& bert = sizes.bert;
  const auto per_layer = layer_parameters(bert);
  const auto others = other_parameters(bert, sizes.classes);
  const auto started = bench::Clock::now();
  const auto selected = [&](const Config& c) {
    if (c.kind == Kind::python && !with_python) return false;
    return only.empty() || std::any_of(only.begin(), only.end(), [&](const std::string& prefix) {
             return c.name.rfind(prefix, 0) == 0 || (prefix == "python" && c.kind == Kind::python);
           });
  };
  const auto reshard = sizes.reshard_world > 0 ? std::to_string(sizes.reshard_world) : std::string();

  std::ostringstream out;
  out << "## bench_largest_model: the largest encoder whose whole run fits "
      << bench::fixed(sizes.budget_mib, 0) << " MiB per rank, " << sizes.world << " ranks\n\n"
      << "A BERT-style encoder (examples/encoder/bert.hpp: hidden " << bert.hidden_size << ", "
      << bert.num_attention_heads << " heads, intermediate " << bert.intermediate_size
      << ", vocabulary " << bert.vocab_size << ", dropout 0.1; " << millions(per_layer)
      << "M parameters per layer and " << millions(others) << "M outside the layers), random "
      << "initialisation, mean pooling and a Linear head of " << sizes.classes << " classes; "
      << "AdamW (lr 1e-4, weight decay 0.01, the fused step), clipping at 1; batch "
      << sizes.batch << " x " << sizes.tokens << " tokens per rank; " << sizes.world
      << " data-parallel ranks over Gloo on loopback, one thread each. Units of checkpointing "
      << "and of ZeRO-3: `bert.encoder.layer.*`.\n\n"
      << "- *The whole-run rule*: a size fits when every rank's peak RSS stays within the budget "
      << "in every phase of its process: *build* (the model and the Trainer; mixprec's ZeRO-3 "
      << "rows build each layer, cut it into the rank's pieces and free it before the next, "
      << "`mixprec::ShardedBuild`, the lean row in bf16; the others build the fp32 model whole; "
      << "FSDP2 builds on the meta device), *steps* (" << sizes.steps << ", the first allocates "
      << "AdamW's state), *save* and *load* (mixprec: `Trainer::save` / `load`, a sharded run's "
      << "checkpoint directory, each rank streaming its own pieces into its shard and reading "
      << "back only the ranges it holds; the unsharded data-parallel rows: one file; FSDP2: "
      << "`torch.distributed.checkpoint`, each rank its own shards), *teardown* "
      << "(the Trainer, or FSDP2's model and optimizer, goes)"
      << (reshard.empty() ? std::string()
                          : "; and *reshard*: fresh processes on " + reshard + " rank" +
                                (sizes.reshard_world == 1 ? "" : "s") + " that build the model, "
                                "load that checkpoint and tear down (the peak of that process)")
      << ". Each phase's column: its peak (VmHWM reset at its start), the largest over the "
      << "ranks. Every process with MALLOC_MMAP_THRESHOLD_=65536, so that glibc returns freed "
      << "tensors at once and the RSS follows the live memory; a watchdog in each rank ends it "
      << "once its RSS passes the budget, and the phase it was in is the row's *bound by*.\n"
      << "- The search: two probe runs (" << (smoke ? "1 and 3" : "2 and 8") << " layers) give "
      << "the whole run's peak per layer and each phase's (*B/param per layer*: bytes per "
      << "parameter of a layer, against *expected*: what the configuration keeps per parameter "
      << "between steps); the lowest of the lines through them predicts the largest size, and "
      << "runs at and next to it confirm it. The parent stops all ranks when the machine's "
      << "available memory falls under " << bench::fixed(kReserveMiB, 0) << " MiB.\n"
      << "- *state B/param*: what the largest rank holds after the steps, per parameter of the "
      << "model: Trainer::state_bytes() (weights, gradients, masters, AdamW's moments); FSDP2: "
      << "its parameters' and AdamW's tensors (zero_grad freed its gradients). *step s*: the "
      << "last step of the slowest rank.\n\n"
      << "| configuration | layers | parameters (M) | ratio to MixedO2 + DP | whole-run peak MiB "
      << "| build | steps | save | load | reshard" << (reshard.empty() ? "" : " at " + reshard)
      << " | teardown | B/param per layer, construction | B/param per layer, steps | expected "
      << "| state B/param | step s | bound by | layers run |\n"
      << "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n";

  std::optional<std::int64_t> baseline;
  std::optional<double> full_stack;  // the lean row's ratio to the baseline
  std::vector<std::string> notes;
  bool ok = true;  // no run failed, and every loss is its reference's as required
  std::map<Kind, double> bases;  // the baseline RSS of a rank, per side
  for (const auto& c : configurations()) {
    if (!selected(c)) continue;
    // FSDP2's ranks take minutes at the largest size; the smoke run predicts it only.
    const bool confirm = c.kind != Kind::python || !(predict_python || smoke);
    const auto s = search(c, sizes, smoke, confirm, root);
    const auto expected = bench::fixed(c.unit_bytes(sizes.world), 1);
    const auto slope = [&](const std::string& phase) {
      const auto it = s.phases.find(phase);
      return it != s.phases.end() ? bench::fixed(per_parameter(it->second.slope, per_layer), 2) : std::string();
    };
    const std::string empty_phases = " | | | | | | | ";
    out << "| " << c.name << " | ";
    if (!s.blocked.empty()) {
      out << "blocked | | |" << empty_phases << "| | " << expected << " | | | | " << layers_run(s) << " |\n";
      notes.push_back("*" + c.name + "*: refused by the library, every rank:" + s.blocked);
      continue;
    }
    if (!s.failed.empty()) {
      ok = false;
      std::cerr << "bench_largest_model: " << c.name << " failed (" << s.failed << ")"
                << (c.kind == Kind::python ? "; --no-python leaves FSDP2 out" : "") << "\n";
    }
    if (!s.failed.empty() || !s.best) {
      out << (s.failed.empty() ? "none fits" : "failed: " + s.failed) << " | | |" << empty_phases
          << "| | " << expected << " | | | " << s.binds << " | " << layers_run(s) << " |\n";
      continue;
    }
    const auto& b = *s.best;
    if (c.kind != Kind::lean) bases.emplace(c.kind, b.base);
    const bool predicted_only = !confirm && s.predicted && *s.predicted > b.layers;
    const auto layers = predicted_only ? *s.predicted : b.layers;
    const auto parameters = layers * per_layer + others;
    if (c.kind == Kind::o2 && !c.checkpoint && !c.zero3) baseline = parameters;
    if (c.kind == Kind::lean && baseline && !predicted_only) {
      full_stack = static_cast<double>(parameters) / static_cast<double>(*baseline);
    }
    const std::string mark = predicted_only ? "*" : "";
    out << layers << mark << " | " << millions(parameters) << mark << " | "
        << (baseline ? bench::fixed(static_cast<double>(parameters) / static_cast<double>(*baseline), 2) + mark
                     : std::string())
        << " | ";
    const auto at_layers = [&](const std::optional<Line>& line) {
      return line ? "~" + bench::fixed(line->intercept + line->slope * static_cast<double>(layers), 0) + mark
                  : std::string();
    };
    if (predicted_only) {
      out << at_layers(s.whole);
      for (const auto& phase : kPhases) {
        const auto it = s.phases.find(phase);
        out << " | " << (it != s.phases.end() ? at_layers(it->second) : std::string());
      }
    } else {
      out << bench::fixed(b.peak, 0);
      for (const auto& phase : kPhases) {
        const auto it = b.phases.find(phase);
        out << " | " << (it != b.phases.end() ? bench::fixed(it->second, 0) : std::string());
      }
    }
    out << " | " << slope("build") << " | " << slope("steps") << " | " << expected << " | "
        << bench::fixed(b.state_bytes / static_cast<double>(b.parameters), 2) << " | "
        << bench::fixed(b.ms / 1000.0, 1) << (predicted_only ? " (" + std::to_string(b.layers) + " layers)" : "")
        << " | " << s.binds << " | " << layers_run(s) << " |\n";
    if (predicted_only) {
      notes.push_back("*" + c.name + "*, *: predicted by the lines through its probe runs, not run "
                      "at that size (--predict-python, and --smoke); its state B/param and step "
                      "time are those of its largest run.");
    } else if (confirm && !s.confirmed) {
      notes.push_back("*" + c.name + "*: the search ended before a size one layer larger was "
                      "seen not to fit: " + std::to_string(b.layers) + " is a lower bound.");
    }
  }
  out << "\n(x: over the budget, in the phase of *bound by*; m: stopped when the machine's "
      << "available memory fell under 1.5 GiB.)";
  if (!bases.empty()) {
    out << " The RSS of a rank before the model (libraries, the process group):";
    const char* separator = " ";
    for (const auto& [kind, base] : bases) {
      out << separator << (kind == Kind::python ? "Python " : "C++ ") << bench::fixed(base, 0) << " MiB";
      separator = ", ";
    }
    out << ".";
  }
  out << "\n";
  for (const auto& n : notes) out << "\n" << n << "\n";
  if (full_stack) {
    out << "\nIssue 53's target, the full stack (the lean row) training at least 8x the parameters "
        << "of MixedO2 + data parallel under the whole-run rule: " << (*full_stack >= 8 ? "met" : "NOT MET")
        << ", " << bench::fixed(*full_stack, 2) << "x (its losses: below).\n";
  }

  // The losses: every C++ configuration on the same small model, weights and data, against a
  // reference run without checkpointing or sharding. MixedO2's rows against MixedO2 + data
  // parallel; the lean row against PureHalf<BFloat16, StochasticRounding<>> + data parallel
  // (its own policy unsharded: stochastic rounding makes its weights differ from MixedO2's
  // after the first step, by up to one bf16 ulp each, so only the same policy can be required
  // to match at every step), which in turn is held to MixedO2 + data parallel's first loss
  // (the same bf16 weights, the same forward pass) and shown beside its later ones.
  out << "\n### The first steps' losses, " << sizes.loss_layers
      << (sizes.loss_layers == 1 ? " layer" : " layers") << "\n\n"
      << "Every configuration on the same model, weights (seed 1) and data (each rank its own "
      << "batch, the same at each step), " << sizes.loss_steps << " steps; each rank's loss at "
      << "each step against a reference run's (*against*): the largest absolute difference over "
      << "the ranks at step 1 and at the later steps, and the largest relative to the "
      << "reference's loss. Checkpointing and ZeRO-3 must not change a bit. The lean row is held "
      << "to its own policy run unsharded, bitwise at step 1 and within 1e-3 relative later (over "
      << "4 ranks the sharded gradient sums are grouped otherwise, and stochastic rounding turns "
      << "an fp32 ulp of difference into a bf16 ulp on a fraction of the weights): stochastic "
      << "rounding keeps no master, so after the first step its bf16 weights differ from MixedO2's (each by 0 or "
      << "1 bf16 ulp: both are one of the two bf16 neighbours of the same fp32 update's result, "
      << "MixedO2's the nearest), and no bound tighter than what the training itself moves "
      << "would be justified; that policy's first loss must equal MixedO2's bitwise (the same "
      << "bf16 weights, the same forward pass), its later ones are shown.\n\n"
      << "| configuration | rank 0's losses | against | difference, step 1 | difference, later "
      << "steps | relative | required |\n"
      << "|---|---|---|---:|---:|---:|---|\n";
  auto loss_configurations = configurations();
  const Config lean_plain{"PureHalf<BFloat16, StochasticRounding<>> + data parallel", Kind::lean,
                          false, false};
  std::map<std::string, Run> loss_runs;
  for (const auto& c : loss_configurations) {
    if (c.kind == Kind::python || !selected(c)) continue;
    const bool lean_row = c.kind == Kind::lean;
    for (const auto* config : lean_row ? std::vector<const Config*>{&lean_plain, &c}
                                       : std::vector<const Config*>{&c}) {
      const auto r = run_configuration(*config, sizes.loss_layers, sizes.loss_steps, sizes, smoke, root,
                                            Mode::steps);
      out << "| " << config->name << " | ";
      if (r.status == Run::Status::blocked) {
        out << "blocked | | | | | |\n";
        continue;
      }
      if (r.status != Run::Status::fits || r.losses.empty()) {
        out << "failed | | | | | |\n";
        ok = false;
        continue;
      }
      loss_runs[config->name] = r;
      for (std::size_t k = 0; k < r.losses[0].size(); ++k) {
        char text[32];
        std::snprintf(text, sizeof text, "%s%.6f", k ? ", " : "", r.losses[0][k]);
        out << text;
      }
      const std::string plain_name = configurations().front().name;
      const std::string against = config == &c && lean_row ? lean_plain.name : plain_name;
      if (config->name == plain_name) {
        out << " | (the reference) | | | | |\n";
        continue;
      }
      const auto reference = loss_runs.find(against);
      if (reference == loss_runs.end()) {
        out << " | " << against << ": did not run | | | | |\n";
        ok = false;
        continue;
      }
      const auto& ref = reference->second;
      double first = 0, later = 0, relative = 0;
      for (std::size_t q = 0; q < r.losses.size(); ++q) {
        for (std::size_t k = 0; k < r.losses[q].size(); ++k) {
          const double d = std::abs(r.losses[q][k] - ref.losses[q][k]);
          double& worst = k == 0 ? first : later;
          worst = std::max(worst, d);
          relative = std::max(relative, d / std::abs(ref.losses[q][k]));
        }
      }
      // Bitwise at every step, except the lean policy unsharded against MixedO2: at step 1;
      // and the lean stack against it: bitwise at step 1, later within kLeanBound relative.
      // Over 4 ranks the gradient sums are grouped otherwise sharded (FullPrecision's ZeRO-3
      // weights differ by 3e-7 relative there in tests/distributed), and stochastic rounding
      // turns such an fp32 ulp into a bf16 ulp on a fraction of the weights; on 2 and 3 ranks
      // the tests find them bitwise.
      constexpr double kLeanBound = 1e-3;
      const bool first_only = config == &lean_plain;
      const bool bounded = config == &c && lean_row;
      const bool met = first == 0 && (first_only || later == 0 || (bounded && relative <= kLeanBound));
      char text[200];
      std::snprintf(text, sizeof text, " | %s | %.3g | %.3g | %.3g | %s%s |\n", against.c_str(), first,
                    later, relative,
                    first_only ? "step 1 bitwise"
                               : bounded ? "step 1 bitwise, later within 1e-3 relative" : "bitwise",
                    met ? "" : ": NOT MET");
      out << text;
      if (!met) {
        ok = false;
        std::cerr << "bench_largest_model: " << config->name << "'s losses differ from " << against
                  << "'s: by " << first << " at step 1, " << later << " later\n";
      }
    }
  }
  out << "\nRun time " << bench::fixed(bench::ms_since(started) / 60000.0, 1)
      << " minutes. Command: `./build/default/benchmarks/bench_largest_model" << (smoke ? " --smoke" : "")
      << "` (it starts its ranks; MIXPREC_PYTHON: the Python with torch; --predict-python "
      << "leaves FSDP2 at its probe runs and the prediction)\n";
  std::cout << out.str();
  fs::remove_all(root);
  return ok ? 0 : 1;
}

}  // namespace bench_largest_model
