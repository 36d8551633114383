// Fashion-MNIST demo: trains one small CNN under each precision policy (same seed, same data
// order) and compares test accuracy, time per epoch, peak memory, skipped steps and the loss
// scale; plots the loss curves to an SVG file.
//
//   ./scripts/demo                       # all four policies, defaults, plot to docs/demo_loss.svg
//   ./scripts/demo --policy MixedO2 --epochs 1
//   ./scripts/demo --device cuda         # Half variants on a GPU (a CUDA build of LibTorch)
//
// Each policy trains in a child process (this program re-executed with --result-file), so the
// peak-RSS column is that policy's own and not the maximum of all runs so far.

#include <spawn.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mixprec/mixprec.hpp>
#include <numbers>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "cli.hpp"
#include "idx_dataset.hpp"
#include "model.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "svg_plot.hpp"

extern char** environ;

namespace {

namespace fm = fashion_mnist;

using fm::Net;

// The GradScaler settings of the fp16 policies.
constexpr double kInitScale = 16777216.0;  // 2^24
constexpr std::int64_t kGrowthInterval = 250;

struct Data {
  fm::Split train;
  fm::Split test;
};

Data load_data(const fm::Config& config) {
  return {fm::load_split(config.data_dir, "train", config.train_size),
          fm::load_split(config.data_dir, "t10k", config.test_size)};
}

std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

/// Fraction of the test split classified correctly, in batches of 1000 under the policy.
template <class TrainerT>
double test_accuracy(TrainerT& trainer, Net& model, const fm::Split& test, torch::Device device) {
  constexpr std::int64_t kBatch = 1000;
  std::int64_t correct = 0;
  for (std::int64_t start = 0; start < test.size(); start += kBatch) {
    const std::int64_t n = std::min(kBatch, test.size() - start);
    const auto x = fm::standardize(test.images.narrow(0, start, n)).to(device);
    const auto y = test.labels.narrow(0, start, n).to(device);
    const at::Tensor logits =
        trainer.evaluate([&] { return model->forward(trainer.cast_input(x)); });
    correct += logits.argmax(1).eq(y).sum().template item<std::int64_t>();
  }
  return static_cast<double>(correct) / static_cast<double>(test.size());
}

/// Trains a fresh model under Policy and measures it. Same seed, same initial weights and same
/// data order for every policy: the differences in the table are the policy's.
template <class Policy>
fm::PolicyResult run_policy(const fm::Config& config, const Data& data) {
  const torch::Device device(config.device == "cuda" ? torch::kCUDA : torch::kCPU);
  const std::string name(Policy::name);
  fm::PolicyResult result;
  result.policy = name;

  torch::manual_seed(config.seed);
  Net model;
  model->to(device);
  torch::optim::SGD optimizer(model->parameters(),
                              torch::optim::SGDOptions(config.lr).momentum(0.9));

  const std::int64_t n = data.train.size();
  const std::int64_t batches = (n + config.batch_size - 1) / config.batch_size;
  const std::int64_t total_steps = config.epochs * batches;
  fm::ProgressBar bar(std::cerr, name, total_steps, fm::stderr_is_terminal());

  mixprec::TrainerOptions options;
  // Skips reach the program's own log, with where the inf/NaN was: the library never prints.
  options.on_step([&](const mixprec::StepReport& report) {
    if (report.overflow) {
      std::ostringstream where;
      where << *report.overflow;
      bar.message(name + ": step " + std::to_string(report.step) + " skipped at loss scale " +
                  fixed(report.scale, 1) + ": " + where.str());
    }
    if (report.gradient_stats) {
      std::ostringstream table;
      table << *report.gradient_stats;
      bar.message(name + ": " + table.str().substr(0, table.str().size() - 1));
    }
  });
  // Per layer ("conv1", "bn1", ...): the parameters' counts summed.
  options.gradient_stats(
      mixprec::GradientStatsOptions().every(config.gradient_stats).group_depth(1));
  if constexpr (std::is_same_v<typename Policy::scaler_type, mixprec::GradScaler>) {
    // Above PyTorch's 2^16 and growing every 250 clean steps (PyTorch: 2000), so that the few
    // thousand steps of the demo show the dynamic scale at work: backoffs first, growth later.
    options.scaler(mixprec::GradScalerOptions().init_scale(kInitScale).growth_interval(kGrowthInterval));
  }
  mixprec::Trainer<Policy> trainer(model, optimizer, options);
  std::int64_t iteration = 0;

  const double peak_before = fm::self_status_mib("VmHWM:");
  const bool reset = fm::reset_peak_rss();
  const double rss_before = fm::self_status_mib("VmRSS:");

  std::mt19937 rng(static_cast<std::mt19937::result_type>(config.seed));
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  double train_seconds = 0;
  for (int epoch = 1; epoch <= config.epochs; ++epoch) {
    std::iota(order.begin(), order.end(), std::int64_t{0});
    std::shuffle(order.begin(), order.end(), rng);
    const auto permutation = torch::from_blob(order.data(), {n}, torch::kLong);
    const auto start = std::chrono::steady_clock::now();
    double loss_sum = 0;
    std::int64_t loss_count = 0;
    for (std::int64_t b = 0; b < batches; ++b) {
      // Cosine decay to zero: the final weights settle, so the accuracy compared is not
      // the noise of the last few large steps.
      const double progress = static_cast<double>(iteration) / static_cast<double>(total_steps);
      for (auto& group : optimizer.param_groups()) {
        static_cast<torch::optim::SGDOptions&>(group.options())
            .lr(0.5 * config.lr * (1 + std::cos(std::numbers::pi * progress)));
      }
      const std::int64_t first = b * config.batch_size;
      const auto index = permutation.narrow(0, first, std::min(config.batch_size, n - first));
      const auto x = fm::standardize(data.train.images.index_select(0, index)).to(device);
      const auto y = data.train.labels.index_select(0, index).to(device);
      const auto report = trainer.step([&] {
        return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
      });
      ++iteration;
      const double loss = report.loss.template item<double>();
      result.losses.push_back(loss);
      result.scales.push_back(report.scale);
      if (std::isfinite(loss)) {
        loss_sum += loss;
        ++loss_count;
      }
      bar.update((epoch - 1) * batches + b + 1, "loss " + fixed(loss, 4));
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    train_seconds += seconds;
    bar.message(name + " epoch " + std::to_string(epoch) + "/" + std::to_string(config.epochs) +
                ": mean loss " +
                fixed(loss_count > 0 ? loss_sum / static_cast<double>(loss_count) : NAN, 4) + ", " +
                fixed(seconds, 1) + " s, ETA " +
                fm::format_duration(fm::eta_seconds(bar.elapsed(), epoch, config.epochs)));
  }

  result.test_accuracy = test_accuracy(trainer, model, data.test, device);
  result.seconds_per_epoch = train_seconds / config.epochs;
  const double peak_after = fm::self_status_mib("VmHWM:");
  result.peak_rss_mib = std::max(peak_before, peak_after);
  result.training_peak_mib = reset && rss_before >= 0 ? peak_after - rss_before : -1;
  const auto stats = trainer.stats();
  result.steps = stats.steps;
  result.skipped_steps = stats.skipped_steps;
  result.final_scale = stats.scale;
  bar.message(name + ": test accuracy " + fixed(100 * result.test_accuracy, 2) + "%, " +
              fixed(result.seconds_per_epoch, 1) + " s/epoch");
  return result;
}

template <class Low>
fm::PolicyResult run_named(std::string_view policy, const fm::Config& config, const Data& data) {
  if (policy == "FullPrecision") {
    return run_policy<mixprec::FullPrecision>(config, data);
  }
  if (policy == "MixedO1") {
    return run_policy<mixprec::MixedO1<Low>>(config, data);
  }
  if (policy == "MixedO2") {
    return run_policy<mixprec::MixedO2<Low>>(config, data);
  }
  if (policy == "PureHalf") {
    return run_policy<mixprec::PureHalf<Low>>(config, data);
  }
  throw std::runtime_error("unknown policy " + std::string(policy));
}

fm::PolicyResult run_in_process(std::string_view policy, const fm::Config& config,
                                const Data& data) {
  return config.dtype == "fp16" ? run_named<at::Half>(policy, config, data)
                                : run_named<at::BFloat16>(policy, config, data);
}

/// Child mode: train config.policy and write the result to config.result_file.
int run_child(const fm::Config& config) {
  const Data data = load_data(config);
  const fm::PolicyResult result = run_in_process(config.policy, config, data);
  std::ofstream out(config.result_file, std::ios::trunc);
  fm::write_result(out, result);
  out.close();
  if (!out) {
    throw std::runtime_error("cannot write " + config.result_file);
  }
  return 0;
}

/// Runs this program again as a child that trains `policy`; returns its result.
fm::PolicyResult run_in_child(std::string_view policy, const fm::Config& config) {
  std::string file_name =
      (std::filesystem::temp_directory_path() / "fashion_mnist_result_XXXXXX").string();
  const int fd = ::mkstemp(file_name.data());
  if (fd < 0) {
    throw std::runtime_error("cannot create a temporary file in " +
                             std::filesystem::temp_directory_path().string());
  }
  ::close(fd);
  struct Remove {
    std::string path;
    ~Remove() { std::remove(path.c_str()); }
  } remove_file{file_name};

  std::vector<std::string> args = fm::child_args(config, policy, file_name);
  args.insert(args.begin(), "fashion_mnist");
  std::vector<char*> argv;
  for (auto& arg : args) {
    argv.push_back(arg.data());
  }
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (const int error =
          ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), environ);
      error != 0) {
    throw std::runtime_error("cannot start a child process: " + std::string(std::strerror(error)));
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      throw std::runtime_error("waitpid failed: " + std::string(std::strerror(errno)));
    }
  }
  if (WIFSIGNALED(status)) {
    throw std::runtime_error(std::string(policy) + ": the child process died of signal " +
                             std::to_string(WTERMSIG(status)));
  }
  if (WEXITSTATUS(status) != 0) {
    throw std::runtime_error(std::string(policy) + ": the child process failed (exit status " +
                             std::to_string(WEXITSTATUS(status)) + ")");
  }
  std::ifstream in(file_name);
  return fm::read_result(in);
}

std::string plural(std::int64_t n, const std::string& word) {
  return std::to_string(n) + " " + word + (n == 1 ? "" : "s");
}

/// Three panels: smoothed training loss, its difference to FullPrecision's (the curves
/// themselves overlap at this scale), and the loss scale.
void write_plot(const fm::Config& config, const std::vector<fm::PolicyResult>& results) {
  fm::svg::Panel losses{"Training loss (exponential moving average)",
                        "optimizer step",
                        "cross-entropy",
                        false,
                        "",
                        {}};
  fm::svg::Panel deltas{"Smoothed training loss minus FullPrecision's",
                        "optimizer step",
                        "loss difference",
                        false,
                        "same initial weights and data order: the difference is the policy's",
                        {}};
  fm::svg::Panel scales{"Loss scale", "optimizer step", "scale (log)", true, "", {}};
  const auto reference = std::find_if(results.begin(), results.end(), [](const auto& r) {
    return r.policy == mixprec::FullPrecision::name;
  });
  const std::size_t steps =
      results.empty()
          ? 0
          : std::max_element(results.begin(), results.end(), [](const auto& a, const auto& b) {
              return a.losses.size() < b.losses.size();
            })->losses.size();
  const double weight =
      std::clamp(1.0 - 20.0 / static_cast<double>(std::max<std::size_t>(steps, 1)), 0.6, 0.98);
  losses.note =
      "smoothing weight " + fixed(weight, 2) + "; same seed and data order for every policy";
  const auto smoothed = [&](const fm::PolicyResult& r) {
    return fm::svg::smooth_ema(r.losses, weight);
  };
  const std::vector<double> reference_loss =
      reference != results.end() ? smoothed(*reference) : std::vector<double>{};
  bool all_one = true;
  for (const auto& r : results) {
    fm::svg::Series loss{r.policy, {}, smoothed(r)};
    for (std::size_t i = 0; i < loss.y.size(); ++i) {
      loss.x.push_back(static_cast<double>(i + 1));
    }
    fm::svg::Series delta{r.policy, loss.x, loss.y};
    for (std::size_t i = 0; i < delta.y.size(); ++i) {
      delta.y[i] = i < reference_loss.size() ? delta.y[i] - reference_loss[i] : NAN;
    }
    fm::svg::Series scale{r.policy, loss.x, r.scales};
    scale.x.resize(scale.y.size());
    all_one =
        all_one && std::all_of(r.scales.begin(), r.scales.end(), [](double s) { return s == 1.0; });
    losses.series.push_back(fm::svg::downsample(loss, 800));
    if (r.losses.size() == reference_loss.size()) {  // same data: the difference is the policy's
      deltas.series.push_back(fm::svg::downsample(delta, 800));
    }
    scales.series.push_back(fm::svg::downsample(scale, 800));
  }
  if (all_one) {
    scales.note =
        "every policy ran at scale 1: bfloat16 has fp32's exponent range and needs no loss "
        "scaling (fp16 uses a dynamic GradScaler)";
  } else {
    scales.note = "fp16 MixedO1/MixedO2: GradScaler from 2^24, halved on overflow, doubled after " +
                  std::to_string(kGrowthInterval) + " clean steps; the others run at scale 1";
  }
  fm::svg::Figure figure{"Fashion-MNIST, " + std::to_string(config.train_size) + " images x " +
                             plural(config.epochs, "epoch") + ", seed " +
                             std::to_string(config.seed) + ", " + config.device + ", " +
                             config.dtype,
                         {},
                         860,
                         300};
  figure.panels.push_back(losses);
  if (reference != results.end() && results.size() > 1) {
    figure.panels.push_back(deltas);
  }
  figure.panels.push_back(scales);
  const std::filesystem::path path(config.output);
  if (path.has_parent_path()) {
    std::filesystem::create_directories(path.parent_path());
  }
  std::ofstream out(path, std::ios::trunc);
  out << fm::svg::render(figure);
  out.close();
  if (!out) {
    throw std::runtime_error("cannot write " + path.string());
  }
}

/// --advise: mixprec::advise on the CNN, fp32, the first three training batches.
int run_advise(const fm::Config& config) {
  const torch::Device device(config.device == "cuda" ? torch::kCUDA : torch::kCPU);
  const auto train = fm::load_split(config.data_dir, "train",
                                    std::min<std::int64_t>(config.train_size, 3 * config.batch_size));
  torch::manual_seed(config.seed);
  Net model;
  model->to(device);
  std::int64_t batch = 0;
  const auto advice = mixprec::advise(model, [&] {
    const std::int64_t first = (batch++ * config.batch_size) % train.size();
    const std::int64_t n = std::min(config.batch_size, train.size() - first);
    const auto x = fm::standardize(train.images.narrow(0, first, n)).to(device);
    const auto y = train.labels.narrow(0, first, n).to(device);
    return torch::nn::functional::cross_entropy(model->forward(x), y);
  });
  std::cout << "Fashion-MNIST CNN, batch " << config.batch_size << ", seed " << config.seed
            << ", device " << config.device << ", LibTorch " << TORCH_VERSION << "\n"
            << advice;
  return 0;
}

/// Parent mode: one child per policy, then the table, the plot and (with --smoke) the check.
int run_parent(const fm::Config& config) {
  fm::check_data_files(config.data_dir);
  if (config.advise) return run_advise(config);
  if (config.device == "cuda" && !torch::cuda::is_available()) {
    throw std::runtime_error("--device cuda: this LibTorch has no CUDA device available");
  }
  // One group per low precision asked for, each with its FullPrecision reference. fp16 without
  // native hardware support is several times slower than bf16 on a CPU: beside bf16, its group
  // trains on the first --half-train-size images, so that the demo stays a few minutes.
  struct Group {
    std::string dtype;
    std::int64_t train_size;
    std::vector<fm::PolicyResult> results;
  };
  std::vector<Group> groups;
  for (const std::string dtype : {"bf16", "fp16"}) {
    if (config.dtype == dtype || config.dtype == "both") {
      const bool subset = dtype == "fp16" && config.dtype == "both" && config.device == "cpu";
      groups.push_back({dtype, subset ? std::min(config.half_train_size, config.train_size)
                                      : config.train_size, {}});
    }
  }
  const bool can_spawn = std::filesystem::exists("/proc/self/exe");
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    auto& group = groups[g];
    for (const auto name : fm::kPolicyNames) {
      if (config.policy != "all" && config.policy != name) continue;
      const bool same_reference = g > 0 && group.train_size == groups[g - 1].train_size;
      if (name == "FullPrecision" && same_reference) {  // the same run: reuse it
        for (const auto& r : groups[g - 1].results) {
          if (r.policy == name) group.results.push_back(r);
        }
        continue;
      }
      fm::Config run = config;
      run.dtype = group.dtype;
      run.train_size = group.train_size;
      group.results.push_back(can_spawn ? run_in_child(name, run)
                                        : run_in_process(name, run, load_data(run)));
    }
  }
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::cout << "\nFashion-MNIST: " << config.test_size << " test images, "
            << plural(config.epochs, "epoch") << ", batch " << config.batch_size << ", SGD lr "
            << config.lr << " (cosine decay) momentum 0.9, seed " << config.seed << ", device "
            << config.device << ", " << torch::get_num_threads() << " threads, LibTorch "
            << TORCH_VERSION << "; fp16 GradScaler: init 2^24, x2 after " << kGrowthInterval
            << " clean steps\n";
  std::vector<fm::PolicyResult> results;
  for (const auto& group : groups) {
    std::cout << "\nLow precision " << group.dtype << ", " << group.train_size
              << " training images:\n\n" << fm::format_table(group.results);
    for (auto r : group.results) {
      if (group.train_size != groups.front().train_size) {
        r.policy += " (" + std::to_string(group.train_size) + " images)";
      }
      if (std::none_of(results.begin(), results.end(),
                       [&](const auto& other) { return other.policy == r.policy; })) {
        results.push_back(std::move(r));
      }
    }
  }
  std::cout << "\n"
            << (config.device == "cpu" && !mixprec::detail::cpu_half_math
                    ? "No Half policies: the CPU kernels of LibTorch " TORCH_VERSION " compute no "
                      "fp16 (the default LibTorch 2.x of ./scripts/demo does).\n"
                    : "")
            << "Total " << fixed(total, 1) << " s. Peak RSS: each policy in its own process"
            << (can_spawn ? "" : " (no /proc: all in one process, peaks accumulate)")
            << "; training peak: peak RSS during training and evaluation minus RSS before.\n";
  if (config.output != "none") {
    write_plot(config, results);
    std::cout << "Loss curves and loss scales: " << config.output << "\n";
  }
  std::cout << std::flush;

  if (config.smoke) {
    bool ok = true;
    for (const auto& r : results) {
      if (!(r.test_accuracy > 0.3)) {
        std::cerr << "smoke check failed: " << r.policy << " test accuracy "
                  << fixed(100 * r.test_accuracy, 2) << "% is not above 30%\n";
        ok = false;
      }
    }
    if (!ok) {
      return 1;
    }
    std::cerr << "smoke check passed: every policy above 30% test accuracy\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  fm::Config config;
  try {
    config = fm::parse_args(args);
  } catch (const fm::CliError& error) {
    std::cerr << "fashion_mnist: " << error.what() << "\n\n" << fm::usage(argv[0]);
    return 2;
  }
  if (config.help) {
    std::cout << fm::usage(argv[0]);
    return 0;
  }
  try {
    return config.result_file.empty() ? run_parent(config) : run_child(config);
  } catch (const fm::MissingDataError& error) {
    std::cerr << "fashion_mnist: " << error.what() << "\n";
    return 1;
  } catch (const std::exception& error) {
    std::cerr << "fashion_mnist: error: " << error.what() << "\n";
    return 1;
  }
}
