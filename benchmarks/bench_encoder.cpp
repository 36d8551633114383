// Fine-tuning the pretrained encoder (examples/encoder: all-MiniLM-L6-v2, 22.7M parameters, with
// a classification head, AdamW, clipping at 1) per policy, with and without activation
// checkpointing of every encoder layer, against Python's transformers (torch.autocast,
// activation_checkpointing_enable()) on the same model and data:
//  1. step time at batch 32 x 128 tokens: every configuration, both sides, one process per run;
//     the runs interleaved, all configurations in each repetition, in alternating order, so that
//     the machine's noise hits them alike; medians, quartiles, and ratios paired per repetition;
//  2. memory at that batch: the peak of live tensor bytes during a step (the CPU allocator's
//     reports, benchmarks/tensor_memory.hpp; Python: torch.profiler's memory events), which does
//     not depend on how malloc caches freed memory, and the peak RSS with glibc told to return
//     every block of 64 KiB or more at once (MALLOC_MMAP_THRESHOLD_=65536);
//  3. the largest batch whose run stays within 3 GiB of peak RSS (the same glibc setting).
//
//   ./build/default/benchmarks/bench_encoder            full run (about 45 minutes on 2 cores)
//   ./build/default/benchmarks/bench_encoder --checkpointing [--repetitions N]
//                              the rows that checkpointing changes: fp32, MixedO1 and MixedO2
//                              in bf16 with and without it, Python's fp32 and autocast likewise
//   ./build/default/benchmarks/bench_encoder --smoke    tiny sizes (ctest): memory measured in
//                              the timed runs, one batch per recipe in part 3 (10 processes, not
//                              24: each loads the model, a Python one imports transformers too)
// MIXPREC_PYTHON: the Python with transformers (./scripts/bench sets it).
#include "harness.hpp"
#include "tensor_memory.hpp"

#include "encoder/finetune.hpp"

#include <mixprec/mixprec.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace mp = mixprec;

namespace bench_encoder {

namespace {

constexpr const char* kLayers = "bert.encoder.layer.*";
constexpr double kMiB = 1024.0 * 1024.0;

// What one run (a process) reports.
struct Measure {
  std::vector<double> ms;      // the step times after the first
  double rss_mib = 0;          // peak RSS (VmHWM)
  double live_mib = -1;        // peak of live tensor bytes during the last step (memory runs)
  double live_start_mib = -1;  // ... and at its start
};

// ---- A run of the C++ side, in this process (--run).

// Exits with status 3 once the resident set exceeds `budget` MiB: a batch too large, found
// without waiting for its steps.
void watch_rss(double budget) {
  std::thread([budget] {
    for (;;) {
      if (bench::memory_status().rss > budget) {
        std::printf("over budget\n");
        std::fflush(stdout);
        std::_Exit(3);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }).detach();
}

template <class P>
int run_steps(bool fused, bool checkpoint, bool memory, const std::string& data_path, int steps) {
  // Installed first: every tensor of the run is allocated while it counts.
  std::optional<bench::TensorMemoryWatch> watch;
  if (memory) watch.emplace();
  std::ifstream in(data_path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto dict = torch::pickle_load(bytes).toGenericDict();
  const encoder::Batch b{dict.at("ids").toTensor(), dict.at("mask").toTensor(),
                         dict.at("labels").toTensor()};
  torch::manual_seed(1);
  auto model = encoder::pretrained_classifier(MIXPREC_ENCODER_MODEL_DIR, 8);
  if (checkpoint) mp::apply_checkpointing(model, {kLayers});
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
  auto options = typename mp::Trainer<P>::Options().max_grad_norm(1.0);
  if constexpr (mp::detail::takes_fused_optimizer<P>) {
    if (fused) options.fused_optimizer(true);
  }
  mp::Trainer<P> trainer(model, optimizer, options);
  std::vector<double> ms;
  double start_mib = -1;
  for (int k = 0; k < steps; ++k) {
    if (watch && k == steps - 1) {
      watch->bytes().reset_peak();
      start_mib = static_cast<double>(watch->bytes().live()) / kMiB;
    }
    const auto start = bench::Clock::now();
    const auto report = trainer.step([&] { return encoder::batch_loss<P>(model, b); });
    (void)report.loss.template item<double>();
    ms.push_back(bench::ms_since(start));
  }
  if (ms.size() > 1) ms.erase(ms.begin());
  std::cout << "ms";
  for (const auto t : ms) std::cout << " " << bench::fixed(t, 3);
  std::cout << " rss " << bench::fixed(bench::memory_status().peak, 1) << " live "
            << bench::fixed(watch ? static_cast<double>(watch->bytes().peak()) / kMiB : -1.0, 1)
            << " " << bench::fixed(start_mib, 1) << "\n";
  return 0;
}

int run_policy(const std::string& policy, const std::string& flags, const std::string& data,
               int steps) {
  const bool fused = flags.find("fused") != std::string::npos;
  const bool checkpoint = flags.find("checkpoint") != std::string::npos;
  const bool memory = flags.find("memory") != std::string::npos;
  const auto budget = flags.find("budget=");
  if (budget != std::string::npos) watch_rss(std::stod(flags.substr(budget + 7)));
  if (policy == "fp32") return run_steps<mp::FullPrecision>(fused, checkpoint, memory, data, steps);
  if (policy == "bf16") return run_steps<mp::MixedO1<at::BFloat16>>(fused, checkpoint, memory, data, steps);
  if (policy == "bf16-o2") return run_steps<mp::MixedO2<at::BFloat16>>(fused, checkpoint, memory, data, steps);
  if (policy == "fp16") return run_steps<mp::MixedO1<at::Half>>(fused, checkpoint, memory, data, steps);
  if (policy == "fp16-o2") return run_steps<mp::MixedO2<at::Half>>(fused, checkpoint, memory, data, steps);
  std::cerr << "bench_encoder: unknown policy " << policy << "\n";
  return 2;
}

// ---- The parent: configurations, each run a process.

std::string self_path() { return std::filesystem::canonical("/proc/self/exe").string(); }

std::string python() {
  const char* env = std::getenv("MIXPREC_PYTHON");
  return env != nullptr && *env != '\0' ? env : "python3";
}

// A configuration: the C++ side (policy as run_policy names it) or Python's (mode as
// encoder_step.py names it), with flags (fused, checkpoint).
struct Config {
  std::string name;
  bool is_python;
  std::string policy;
  bool fused = false;
  bool checkpoint = false;
};

std::optional<Measure> parse(const std::string& text) {
  std::istringstream in(text);
  std::string word;
  Measure m;
  if (!(in >> word) || word != "ms") return std::nullopt;
  while (in >> word && word != "rss") m.ms.push_back(std::stod(word));
  if (word != "rss" || !(in >> m.rss_mib >> word) || word != "live") return std::nullopt;
  if (!(in >> m.live_mib >> m.live_start_mib)) return std::nullopt;
  return m;
}

// One run of `c` on the batch in `data`; extra: "memory", "budget=MIB". glibc returns every
// freed block of 64 KiB or more to the system at once, so that the peak RSS follows the live
// memory and not malloc's caching (MALLOC_MMAP_THRESHOLD_ pins the threshold, which glibc would
// otherwise raise as blocks are freed).
std::optional<Measure> run(const Config& c, const std::string& data, int steps, int threads,
                           const std::string& extra = "") {
  std::string flags = std::string(c.fused ? " fused" : "") + (c.checkpoint ? " checkpoint" : "") +
                      (extra.empty() ? "" : " " + extra);
  std::string command = "MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=" + std::to_string(threads) + " ";
  if (c.is_python) {
    command += python() + " " + MIXPREC_ENCODER_STEP_SCRIPT + " " + c.policy + " " +
               MIXPREC_ENCODER_MODEL_DIR + " " + data + " " + std::to_string(steps) + " " +
               std::to_string(threads) + flags + " 2>/dev/null";
  } else {
    command += "'" + self_path() + "' --run " + c.policy + " '" + flags + "' " + data + " " +
               std::to_string(steps);
  }
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(command.c_str(), "r"), ::pclose);
  if (!pipe) return std::nullopt;
  std::string text;
  char buffer[4096];
  while (std::fgets(buffer, sizeof buffer, pipe.get()) != nullptr) text += buffer;
  return parse(text);
}

// Random token ids (no padding) and labels, written for both sides.
void write_batch(const std::string& path, std::int64_t batch, std::int64_t tokens) {
  auto gen = at::detail::createCPUGenerator(7);
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("ids", torch::randint(1000, 30000, {batch, tokens}, gen, torch::kLong));
  dict.insert("mask", torch::ones({batch, tokens}, torch::kLong));
  dict.insert("labels", torch::randint(0, 8, {batch}, gen, torch::kLong));
  const auto bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string spread(const std::vector<double>& values, int digits) {
  if (values.empty()) return "";
  const auto [low, high] = std::minmax_element(values.begin(), values.end());
  return bench::fixed(*high - *low, digits);
}

int index_of(const std::vector<Config>& configs, const std::string& name) {
  for (std::size_t i = 0; i < configs.size(); ++i) {
    if (configs[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "--run") {
    return run_policy(argv[2], argv[3], argv[4], std::stoi(argv[5]));
  }
  bool smoke = false, checkpointing_only = false;
  int repetitions = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--smoke") {
      smoke = true;
    } else if (arg == "--checkpointing") {
      checkpointing_only = true;
    } else if (arg == "--repetitions" && i + 1 < argc && std::atoi(argv[i + 1]) > 0) {
      repetitions = std::atoi(argv[++i]);
    } else {
      std::cerr << "usage: " << argv[0] << " [--smoke] [--checkpointing] [--repetitions N]\n";
      return 2;
    }
  }
  if (!std::filesystem::exists(std::string(MIXPREC_ENCODER_MODEL_DIR) + "/model.safetensors")) {
    std::cerr << "bench_encoder: no model in " << MIXPREC_ENCODER_MODEL_DIR
              << " (scripts/lib.sh unpacks it)\n";
    return 1;
  }
  const bool have_python =
      std::system((python() + " -c 'import transformers' 2>/dev/null").c_str()) == 0;
  const int threads = 2;
  const std::int64_t batch = smoke ? 2 : 32, tokens = smoke ? 16 : 128;
  const int steps = smoke ? 2 : 3;
  // --checkpointing is the short run: no warm-up repetition (each run is a process that times
  // its steps after the first anyway), memory from the second step (AdamW's state exists then).
  const int reps = repetitions > 0 ? repetitions : smoke ? 1 : 5;
  const int warmup = smoke || checkpointing_only ? 0 : 1;
  const int memory_steps = checkpointing_only ? 2 : steps;
  const auto dir = std::filesystem::temp_directory_path() /
                   ("mixprec_bench_encoder_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto data = (dir / "batch.pt").string();
  write_batch(data, batch, tokens);

  // The configurations; a C++ one's Python twin (the same recipe) is named in `twin`.
  std::vector<Config> configs{{"FullPrecision", false, "fp32"},
                              {"FullPrecision, checkpointed", false, "fp32", false, true},
                              {"MixedO1<BFloat16>", false, "bf16"},
                              {"MixedO1<BFloat16>, checkpointed", false, "bf16", false, true},
                              {"MixedO2<BFloat16>", false, "bf16-o2"},
                              {"MixedO2<BFloat16>, checkpointed", false, "bf16-o2", false, true}};
  // MixedO1's rows: only in the full run (the smoke run keeps CI short).
  if (checkpointing_only || smoke) configs.erase(configs.begin() + 2, configs.begin() + 4);
  const bool all_rows = !smoke && !checkpointing_only;
  if (mp::fused_adam_available && all_rows) {
    configs.push_back({"FullPrecision, fused AdamW", false, "fp32", true});
    configs.push_back({"MixedO1<BFloat16>, fused AdamW", false, "bf16", true});
    configs.push_back({"MixedO2<BFloat16>, fused AdamW", false, "bf16-o2", true});
  }
  if (mp::cpu_half_math && all_rows) {
    configs.push_back({"MixedO1<Half> + GradScaler", false, "fp16"});
    configs.push_back({"MixedO2<Half> + GradScaler", false, "fp16-o2"});
  }
  struct Twin {
    std::string cpp, python;
  };
  std::vector<Twin> twins;
  if (have_python) {
    const std::vector<Config> python_configs{
        {"Python fp32", true, "fp32"},
        {"Python fp32, checkpointed", true, "fp32", false, true},
        {"Python torch.autocast(bfloat16)", true, "bf16"},
        {"Python torch.autocast(bfloat16), checkpointed", true, "bf16", false, true},
        {"Python torch.autocast(bfloat16), softmax in fp32", true, "bf16-fp32-softmax"},
        {"Python fp32, fused AdamW", true, "fp32", true},
        {"Python torch.autocast(bfloat16), fused AdamW", true, "bf16", true},
        {"Python torch.autocast(float16) + GradScaler", true, "fp16"}};
    for (const auto& c : python_configs) {
      if (smoke && c.name != "Python fp32" && c.name != "Python fp32, checkpointed") continue;
      if (checkpointing_only && c.name.find("fused") != std::string::npos) continue;
      if (checkpointing_only && (c.policy == "fp16" || c.policy == "bf16-fp32-softmax")) continue;
      if (c.fused && !mp::fused_adam_available) continue;
      if (c.policy == "fp16" && !mp::cpu_half_math) continue;
      configs.push_back(c);
    }
    twins = {{"FullPrecision", "Python fp32"},
             {"FullPrecision, checkpointed", "Python fp32, checkpointed"},
             {"MixedO1<BFloat16>", "Python torch.autocast(bfloat16)"},
             {"MixedO1<BFloat16>, checkpointed", "Python torch.autocast(bfloat16), checkpointed"},
             {"FullPrecision, fused AdamW", "Python fp32, fused AdamW"},
             {"MixedO1<BFloat16>, fused AdamW", "Python torch.autocast(bfloat16), fused AdamW"},
             {"MixedO1<Half> + GradScaler", "Python torch.autocast(float16) + GradScaler"}};
  }

  // 1. Step times: every configuration once per repetition, interleaved.
  bench::Options timing;
  timing.smoke = smoke;
  timing.warmup = warmup;
  timing.repetitions = reps;
  std::vector<std::vector<double>> rss(configs.size());
  std::vector<std::vector<double>> live(configs.size()), live_step(configs.size());
  bool ok = true;
  std::size_t runs = 0;  // the first warmup * configs.size() are the warm-up's
  const auto samples = bench::interleaved_samples(configs.size(), timing, [&](std::size_t v) {
    // The smoke run measures memory here too (its figures are not read): no runs of part 2.
    const auto m = ok ? run(configs[v], data, steps, threads, smoke ? "memory" : "") : std::nullopt;
    if (!m || m->ms.empty() || (smoke && m->live_mib < 0)) {
      if (ok) std::cerr << "bench_encoder: " << configs[v].name << " failed\n";
      ok = false;
      return 1.0;
    }
    if (runs++ >= static_cast<std::size_t>(warmup) * configs.size()) rss[v].push_back(m->rss_mib);
    if (smoke) {
      live[v].push_back(m->live_mib);
      live_step[v].push_back(m->live_mib - m->live_start_mib);
    }
    return bench::median(m->ms);
  });
  if (!ok) return 1;
  // 2. Memory: each configuration's live tensor bytes, in runs of their own (two, to show the
  // measure does not wander; the smoke run's came from its timed runs).
  const int memory_runs = smoke ? 0 : 2;
  for (int r = 0; r < memory_runs && ok; ++r) {
    for (std::size_t v = 0; v < configs.size(); ++v) {
      const auto m = run(configs[v], data, memory_steps, threads, "memory");
      if (!m || m->live_mib < 0) {
        std::cerr << "bench_encoder: memory of " << configs[v].name << " failed\n";
        ok = false;
        break;
      }
      live[v].push_back(m->live_mib);
      live_step[v].push_back(m->live_mib - m->live_start_mib);
    }
  }
  if (!ok) return 1;

  const auto fp32 = static_cast<std::size_t>(index_of(configs, "FullPrecision"));
  std::ostringstream out;
  out << "## bench_encoder: fine-tuning the pretrained encoder per policy, with and without "
      << "activation checkpointing\n\n"
      << "all-MiniLM-L6-v2 (22.7M parameters) + mean pooling + Linear(384, 8), AdamW (lr 1e-4, "
      << "weight decay 0.01), clipping at 1, dropout 0.1, batch " << batch << " x " << tokens
      << " tokens (random ids, no padding), " << threads << " threads. *checkpointed*: every "
      << "encoder layer (mixprec: `apply_checkpointing(model, {\"" << kLayers << "\"})`; Python: "
      << "transformers' `activation_checkpointing_enable()` (formerly "
      << "`gradient_checkpointing_enable()`), torch.utils.checkpoint with "
      << "use_reentrant=False). *Python*: transformers' BertModel (eager attention) with the same "
      << "head, data and recipe (torch.autocast, GradScaler(\"cpu\")).\n\n"
      << "Step time: a run is a process of its own that reports the median of its " << steps - 1
      << " steps after the first; each repetition runs every configuration of the table once, in "
      << "alternating order (" << reps << " repetitions after " << warmup << " of warm-up): "
      << "the median and quartiles over repetitions, and ratios paired per repetition (*speed-up*: "
      << "FullPrecision's time over the row's; *vs Python*: the Python twin's time over the row's, "
      << "above 1 mixprec faster; *checkpointing costs*: the row's time over the same recipe "
      << "unchecked). Memory: *live tensors*: the peak of live tensor bytes during a step, as the "
      << "CPU allocator reports every allocation and free (the hook of PyTorch's profiler; Python: "
      << "torch.profiler's memory events), in the last of " << memory_steps << " steps of "
      << (smoke ? std::string("the timed runs (--smoke)")
                : std::to_string(memory_runs) + " runs of their own")
      << "; *step's "
      << "own*: that peak above what was live when the step began (model, optimizer state): "
      << "activations, gradients, temporaries. Peak RSS: with MALLOC_MMAP_THRESHOLD_=65536, so "
      << "that glibc returns freed tensors to the system at once and the RSS follows the live "
      << "memory; median over the timed runs, and its spread (largest minus smallest).\n\n"
      << "| configuration | step ms | step ms q1-q3 | speed-up ratio | vs Python ratio | vs "
      << "Python IQR | checkpointing costs ratio | live tensors MiB | step's own MiB | step's own "
      << "ratio to unchecked | peak RSS MiB | peak RSS spread MiB |\n"
      << "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (std::size_t v = 0; v < configs.size(); ++v) {
    const auto& c = configs[v];
    const auto q = bench::quartiles(samples[v]);
    const auto speed = bench::paired_ratio(samples[fp32], samples[v]);
    std::string vs_python = " | ", cost = "", own_ratio = "";
    for (const auto& t : twins) {
      const int cpp = index_of(configs, t.cpp), py = index_of(configs, t.python);
      if (cpp == static_cast<int>(v) && py >= 0) {
        const auto ratio = bench::paired_ratio(samples[static_cast<std::size_t>(py)], samples[v]);
        vs_python = bench::fixed(ratio.median, 2) + " | " + bench::iqr(ratio, 2);
      }
    }
    if (c.checkpoint) {
      // The same recipe unchecked: the row of the same side, policy and optimizer.
      for (std::size_t u = 0; u < configs.size(); ++u) {
        const auto& d = configs[u];
        if (d.is_python == c.is_python && d.policy == c.policy && d.fused == c.fused && !d.checkpoint) {
          cost = bench::fixed(bench::paired_ratio(samples[v], samples[u]).median, 2);
          own_ratio = bench::fixed(bench::median(live_step[v]) / bench::median(live_step[u]), 2);
        }
      }
    }
    out << "| " << c.name << " | " << bench::fixed(q.median, 1) << " | " << bench::fixed(q.q1, 1)
        << "-" << bench::fixed(q.q3, 1) << " | " << bench::fixed(speed.median, 2) << " | "
        << vs_python << " | " << cost << " | " << bench::fixed(bench::median(live[v]), 0) << " | "
        << bench::fixed(bench::median(live_step[v]), 0) << " | " << own_ratio << " | "
        << bench::fixed(bench::median(rss[v]), 0) << " | " << spread(rss[v], 0) << " |\n";
  }
  double live_spread = 0;
  for (std::size_t v = 0; v < configs.size(); ++v) {
    if (live[v].size() > 1) live_spread = std::max(live_spread, std::stod(spread(live[v], 3)));
  }
  if (!smoke) {
    out << "\nThe live tensor peaks of the " << memory_runs << " memory runs of each "
        << "configuration differ by at most " << bench::fixed(live_spread, 3) << " MiB.\n";
  }

  // 3. The largest batch within the budget: batches growing by half, then bisected to a
  // multiple of 8, each a process of 2 steps (the first allocates AdamW's state) that stops as
  // soon as its RSS exceeds the budget.
  const double budget = smoke ? 1e9 : 3072;
  const std::int64_t first = smoke ? 2 : 16, cap = smoke ? 2 : 1024, grain = smoke ? 1 : 8;
  std::vector<std::string> budgeted{"FullPrecision", "FullPrecision, checkpointed"};
  if (all_rows) budgeted.insert(budgeted.end(), {"MixedO2<BFloat16>", "MixedO2<BFloat16>, checkpointed"});
  if (all_rows) budgeted.insert(budgeted.begin() + 2, {"MixedO1<BFloat16>", "MixedO1<BFloat16>, checkpointed"});
  std::vector<const char*> python_budgeted{"Python fp32", "Python fp32, checkpointed"};
  if (all_rows) {
    python_budgeted.insert(python_budgeted.end(), {"Python torch.autocast(bfloat16)",
                                                   "Python torch.autocast(bfloat16), checkpointed"});
  }
  if (have_python) {
    for (const auto* name : python_budgeted) {
      if (index_of(configs, name) >= 0) budgeted.push_back(name);
    }
  }
  out << "\n### The largest batch within " << bench::fixed(budget, 0) << " MiB of peak RSS ("
      << tokens << " tokens, MALLOC_MMAP_THRESHOLD_=65536; batches from " << first << " growing "
      << "by half, then bisected to a multiple of " << grain << "; each batch a process of 2 steps, "
      << "the first allocating AdamW's state, stopped once its RSS exceeds the budget)\n\n"
      << "| recipe | largest batch | its peak RSS MiB | smallest batch over | ratio to the same "
      << "side's FullPrecision | ratio to the same recipe unchecked | batches tried |\n"
      << "|---|---:|---:|---:|---:|---:|---|\n";
  std::int64_t cpp_fp32 = 0, python_fp32 = 0;
  std::map<std::string, std::int64_t> largest_of;
  for (const auto& name : budgeted) {
    const auto& c = configs[static_cast<std::size_t>(index_of(configs, name))];
    std::int64_t largest = 0, over = 0;
    double largest_peak = 0;
    std::string tried;
    const auto fits = [&](std::int64_t size) {
      const auto path = (dir / ("budget_" + std::to_string(size) + ".pt")).string();
      if (!std::filesystem::exists(path)) write_batch(path, size, tokens);
      const auto m = run(c, path, 2, threads, "budget=" + bench::fixed(budget, 0));
      const bool fit = m && m->rss_mib <= budget;
      // Appended piece by piece: GCC 12 at -O3 warns (falsely) on the concatenated temporary.
      if (!tried.empty()) tried.push_back(' ');
      tried.append(std::to_string(size));
      if (!fit) tried.push_back('x');
      if (fit) {
        largest = size;
        largest_peak = m->rss_mib;
      } else if (over == 0 || size < over) {
        over = size;
      }
      return fit;
    };
    for (auto size = first; size <= cap; size = std::max(size + grain, size * 3 / 2 / grain * grain)) {
      if (!fits(size)) break;
    }
    while (over > 0 && over - largest > grain) {
      const auto middle = (largest + over) / 2 / grain * grain;
      if (middle <= largest || middle >= over) break;
      fits(middle);
    }
    if (name == "FullPrecision") cpp_fp32 = largest;
    if (name == "Python fp32") python_fp32 = largest;
    largest_of[name] = largest;
    const auto base = c.is_python ? python_fp32 : cpp_fp32;
    const auto ratio = [&](std::int64_t of) {
      return bench::fixed(of > 0 ? static_cast<double>(largest) / static_cast<double>(of) : 0.0, 2);
    };
    std::string unchecked;
    const std::string suffix = ", checkpointed";
    if (c.checkpoint && name.size() > suffix.size()) {
      const auto it = largest_of.find(name.substr(0, name.size() - suffix.size()));
      if (it != largest_of.end()) unchecked = ratio(it->second);
    }
    out << "| " << (c.is_python ? "" : "mixprec ") << name << " | " << largest << " | "
        << bench::fixed(largest_peak, 0) << " | " << (over > 0 ? std::to_string(over) : "")
        << " | " << ratio(base) << " | " << unchecked << " | " << tried << " |\n";
  }
  out << "\n(x: over the budget.)";
  if (!have_python) out << " (No Python with transformers: no Python rows.)";
  std::string command = "./build/default/benchmarks/bench_encoder";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  out << "\n\nCommand: `" << command << "` (MIXPREC_PYTHON: the Python with transformers; "
      << "./scripts/bench sets it)\n";
  std::cout << out.str();
  std::filesystem::remove_all(dir);
  return ok ? 0 : 1;
}

}  // namespace bench_encoder
