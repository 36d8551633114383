// Fine-tuning the pretrained encoder (examples/encoder: all-MiniLM-L6-v2, 22.7M parameters, with
// a classification head, AdamW, clipping at 1) per policy: the step time and peak RSS at batch
// 32 x 128 tokens, fused AdamW on and off, against Python's transformers + torch.autocast on the
// same model and data; and the largest batch each fits in a memory budget. Every configuration
// runs in a process of its own (this binary with --run, or benchmarks/python/encoder_step.py),
// so that each peak RSS is its own; times are medians of the steps after the first.
#include "harness.hpp"

#include "encoder/finetune.hpp"

#include <mixprec/mixprec.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace mp = mixprec;

namespace {

struct Measure {
  double ms = 0, peak_mib = 0;
};

// One configuration, in this process: `steps` steps on the batch in `data`.
template <class P>
int run_steps(bool fused, const std::string& data_path, int steps) {
  std::ifstream in(data_path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto dict = torch::pickle_load(bytes).toGenericDict();
  const encoder::Batch b{dict.at("ids").toTensor(), dict.at("mask").toTensor(),
                         dict.at("labels").toTensor()};
  torch::manual_seed(1);
  auto model = encoder::pretrained_classifier(MIXPREC_ENCODER_MODEL_DIR, 8);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
  auto options = typename mp::Trainer<P>::Options().max_grad_norm(1.0);
  if constexpr (mp::detail::takes_fused_optimizer<P>) {
    if (fused) options.fused_optimizer(true);
  }
  mp::Trainer<P> trainer(model, optimizer, options);
  std::vector<double> ms;
  for (int k = 0; k < steps; ++k) {
    const auto start = bench::Clock::now();
    const auto report = trainer.step([&] { return encoder::batch_loss<P>(model, b); });
    (void)report.loss.template item<double>();
    ms.push_back(bench::ms_since(start));
  }
  if (ms.size() > 1) ms.erase(ms.begin());
  std::cout << bench::median(ms) << " " << bench::memory_status().peak << "\n";
  return 0;
}

int run_policy(const std::string& policy, bool fused, const std::string& data, int steps) {
  if (policy == "fp32") return run_steps<mp::FullPrecision>(fused, data, steps);
  if (policy == "bf16") return run_steps<mp::MixedO1<at::BFloat16>>(fused, data, steps);
  if (policy == "bf16-o2") return run_steps<mp::MixedO2<at::BFloat16>>(fused, data, steps);
  if (policy == "fp16") return run_steps<mp::MixedO1<at::Half>>(fused, data, steps);
  if (policy == "fp16-o2") return run_steps<mp::MixedO2<at::Half>>(fused, data, steps);
  std::cerr << "bench_encoder: unknown policy " << policy << "\n";
  return 2;
}

std::string self_path() { return std::filesystem::canonical("/proc/self/exe").string(); }

std::optional<Measure> run_command(const std::string& command) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(command.c_str(), "r"), ::pclose);
  if (!pipe) return std::nullopt;
  Measure m;
  if (std::fscanf(pipe.get(), "%lf %lf", &m.ms, &m.peak_mib) != 2) return std::nullopt;
  return m;
}

std::optional<Measure> cpp(const std::string& policy, bool fused, const std::string& data,
                           int steps, int threads) {
  return run_command("OMP_NUM_THREADS=" + std::to_string(threads) + " " + self_path() +
                     " --run " + policy + " " + (fused ? "1" : "0") + " " + data + " " +
                     std::to_string(steps));
}

std::string python() {
  const char* env = std::getenv("MIXPREC_PYTHON");
  return env != nullptr && *env != '\0' ? env : "python3";
}

std::optional<Measure> py(const std::string& mode, bool fused, const std::string& data, int steps,
                          int threads) {
  return run_command(python() + " " + MIXPREC_ENCODER_STEP_SCRIPT + " " + mode + " " +
                     MIXPREC_ENCODER_MODEL_DIR + " " + data + " " + std::to_string(steps) + " " +
                     std::to_string(threads) + (fused ? " fused" : "") + " 2>/dev/null");
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

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "--run") {
    return run_policy(argv[2], std::string(argv[3]) == "1", argv[4], std::stoi(argv[5]));
  }
  const auto options = bench::parse_options(argc, argv);
  const bool smoke = options.smoke;
  if (!std::filesystem::exists(std::string(MIXPREC_ENCODER_MODEL_DIR) + "/model.safetensors")) {
    std::cerr << "bench_encoder: no model in " << MIXPREC_ENCODER_MODEL_DIR
              << " (scripts/lib.sh unpacks it)\n";
    return 1;
  }
  const bool have_python =
      std::system((python() + " -c 'import transformers' 2>/dev/null").c_str()) == 0;
  const int threads = 2;
  const std::int64_t batch = smoke ? 2 : 32, tokens = smoke ? 16 : 128;
  const int steps = smoke ? 2 : 4;
  const auto dir = std::filesystem::temp_directory_path() /
                   ("mixprec_bench_encoder_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto data = (dir / "batch.pt").string();
  write_batch(data, batch, tokens);

  struct Row {
    std::string name, policy, python_mode;
    bool fused;
  };
  std::vector<Row> rows{{"FullPrecision", "fp32", "fp32", false},
                        {"MixedO1<BFloat16>", "bf16", "bf16", false},
                        {"MixedO1<BFloat16>; Python's softmax in fp32 too", "bf16", "bf16-fp32-softmax", false},
                        {"MixedO2<BFloat16>", "bf16-o2", "", false}};
  // The smoke run (ctest) checks that the program works: two rows, one Python process.
  if (smoke) rows = {{"FullPrecision", "fp32", "fp32", false}, {"MixedO2<BFloat16>", "bf16-o2", "", false}};
  if (mp::fused_adam_available && !smoke) {
    rows.push_back({"FullPrecision, fused AdamW", "fp32", "fp32", true});
    rows.push_back({"MixedO1<BFloat16>, fused AdamW", "bf16", "bf16", true});
    rows.push_back({"MixedO2<BFloat16>, fused AdamW", "bf16-o2", "", true});
  }
  if (mp::cpu_half_math && !smoke) {
    rows.push_back({"MixedO1<Half> + GradScaler", "fp16", "fp16", false});
    rows.push_back({"MixedO2<Half> + GradScaler", "fp16-o2", "", false});
  }
  // Repetitions: each a process per side, the two sides in alternating order; the ratios to
  // Python are paired per repetition.
  const int reps = smoke ? 1 : 3;
  std::ostringstream out;
  out << "## bench_encoder: fine-tuning the pretrained encoder per policy\n\n"
      << "all-MiniLM-L6-v2 (22.7M parameters) + mean pooling + Linear(384, 8), AdamW (lr 1e-4, "
      << "weight decay 0.01), clipping at 1, dropout 0.1, batch " << batch << " x " << tokens
      << " tokens (random ids, no padding), " << threads << " threads. A run is a process of its "
      << "own that reports the median of its " << steps - 1 << " steps after the first; each row "
      << "is " << reps << " runs per side, mixprec's and Python's in alternating order: medians, "
      << "and for *vs Python* (Python's step time over mixprec's, above 1: mixprec faster) the "
      << "median and interquartile range of the ratios paired per repetition. *Python*: "
      << "transformers' BertModel (eager attention) with the same head, data and recipe "
      << "(torch.autocast, GradScaler(\"cpu\")); *speed-up* is FullPrecision's step time over the "
      << "row's. Peak RSS: the largest of the runs.\n\n"
      << "| policy | step ms | speed-up ratio | peak RSS MiB | Python step ms | vs Python ratio | "
      << "vs Python IQR | Python peak RSS MiB |\n|---|---:|---:|---:|---:|---:|---:|---:|\n";
  double fp32_ms = 0;
  bool ok = true;
  for (const auto& row : rows) {
    const bool paired = have_python && !row.python_mode.empty();
    std::vector<double> ours, theirs;
    double peak = 0, python_peak = 0;
    for (int r = 0; r < reps && ok; ++r) {
      const auto record = [](const std::optional<Measure>& m, std::vector<double>& ms, double& top) {
        if (m) {
          ms.push_back(m->ms);
          top = std::max(top, m->peak_mib);
        }
        return m.has_value();
      };
      const auto run_ours = [&] { return record(cpp(row.policy, row.fused, data, steps, threads), ours, peak); };
      const auto run_theirs = [&] {
        return record(py(row.python_mode, row.fused, data, steps, threads), theirs, python_peak);
      };
      const bool done = !paired ? run_ours()
                        : r % 2 == 0 ? run_ours() && run_theirs()
                                     : run_theirs() && run_ours();
      if (!done) {
        std::cerr << "bench_encoder: " << row.name << " failed\n";
        ok = false;
      }
    }
    if (!ok) break;
    const double ms = bench::median(ours);
    if (row.policy == "fp32" && !row.fused) fp32_ms = ms;
    out << "| " << row.name << " | " << bench::fixed(ms, 1) << " | "
        << bench::fixed(fp32_ms / ms, 2) << " | " << bench::fixed(peak, 0) << " | ";
    if (paired) {
      const auto ratio = bench::paired_ratio(theirs, ours);
      out << bench::fixed(bench::median(theirs), 1) << " | " << bench::fixed(ratio.median, 2)
          << " | " << bench::iqr(ratio, 2) << " | " << bench::fixed(python_peak, 0) << " |\n";
    } else {
      out << "| | | |\n";
    }
  }

  // The largest batch of 128 tokens whose run stays within the budget (2 steps: the first
  // allocates AdamW's state): batches growing by half, then refined.
  const double budget = smoke ? 1e9 : 3072;
  const std::vector<std::int64_t> sizes =
      smoke ? std::vector<std::int64_t>{2, 4}
            : std::vector<std::int64_t>{16, 24, 32, 48, 64, 96, 128, 192, 256, 384};
  const std::int64_t step = smoke ? 1 : 8;
  out << "\n### The largest batch within " << bench::fixed(budget, 0) << " MiB of peak RSS ("
      << tokens << " tokens; batches " << sizes.front() << ", " << sizes[1] << ", ... growing by "
      << "half, then by " << step << " from the largest that fits to the first that does not; "
      << "each batch a process of 2 steps, the first allocating AdamW's state)\n\n| recipe | largest batch | its peak RSS MiB | ratio to FullPrecision |\n"
      << "|---|---:|---:|---:|\n";
  struct Budgeted {
    std::string name, policy;
    bool python;
  };
  std::vector<Budgeted> budgeted{{"mixprec FullPrecision", "fp32", false},
                                 {"mixprec MixedO1<BFloat16>", "bf16", false},
                                 {"mixprec MixedO2<BFloat16>", "bf16-o2", false}};
  if (smoke) budgeted.erase(budgeted.begin() + 1);  // FullPrecision and MixedO2
  if (have_python && !smoke) {
    budgeted.push_back({"Python fp32", "fp32", true});
    budgeted.push_back({"Python torch.autocast(bfloat16)", "bf16", true});
  }
  std::int64_t fp32_batch = 0;
  for (const auto& b : budgeted) {
    std::int64_t largest = 0, too_large = 0;
    double largest_peak = 0;
    const auto fits = [&](std::int64_t size) {
      const auto path = (dir / ("budget_" + std::to_string(size) + ".pt")).string();
      if (!std::filesystem::exists(path)) write_batch(path, size, tokens);
      const auto m = b.python ? py(b.policy, false, path, 2, threads) : cpp(b.policy, false, path, 2, threads);
      if (!m || m->peak_mib > budget) return false;
      largest = size;
      largest_peak = m->peak_mib;
      return true;
    };
    for (const auto size : sizes) {
      if (!fits(size)) {
        too_large = size;
        break;
      }
    }
    // Then by `step` between the largest batch that fits and the first that does not.
    for (auto size = largest + step; too_large > 0 && size < too_large; size += step) {
      if (!fits(size)) break;
    }
    if (b.name == "mixprec FullPrecision") fp32_batch = largest;
    out << "| " << b.name << " | " << largest << " | " << bench::fixed(largest_peak, 0) << " | "
        << bench::fixed(fp32_batch > 0 ? static_cast<double>(largest) / static_cast<double>(fp32_batch) : 0.0, 2)
        << " |\n";
  }
  if (!have_python) out << "\n(No Python with transformers: the Python columns are empty.)\n";
  out << "\nCommand: `./build/default/benchmarks/bench_encoder` (MIXPREC_PYTHON: the Python with "
      << "transformers; ./scripts/bench sets it)\n";
  std::cout << out.str();
  std::filesystem::remove_all(dir);
  return ok ? 0 : 1;
}
