// Fashion-MNIST demo: trains one small CNN under each precision policy (same seed, same initial
// weights, same data order) and compares test accuracy, time per epoch, peak memory, skipped
// steps and the loss scale; writes the loss curves as CSV for plot.py.
//
//   ./scripts/demo                       # every policy, bf16 and fp16; plot in docs/demo_loss.*
//   ./scripts/demo --policy MixedO2 --epochs 1
//   ./scripts/demo --device cuda         # Half variants on a GPU (a CUDA build of LibTorch)
//
// Each policy trains in a child process (this program re-executed with --result-file), so the
// peak-RSS column is that policy's own. The parent decides once whether the fp16 runs compute
// their convolution weight gradients in fp32 (mixprec::cpu_capabilities()) and hands that to
// every child in MIXPREC_FP16_CONV_WEIGHT_GRAD; the table says per run what it computed. On a
// CPU, the fp16 policies are sized by a time budget: a few timed steps of each decide how many
// images they train on; so are the bf16 ones on a CPU where bf16 is slower than fp32 (no
// AVX512-BF16 or AMX-BF16 that LibTorch uses: mixprec::cpu_capabilities().bf16_slow).

#include <CLI/CLI.hpp>
#include <mixprec/mixprec.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <numbers>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "child.hpp"
#include "model.hpp"
#include "report.hpp"

extern char** environ;

namespace {

namespace fm = fashion_mnist;
using fm::Net;

// The GradScaler settings of the fp16 policies: above PyTorch's 2^16, and growing every 250
// clean steps (PyTorch: 2000), so that the demo's few thousand steps show the dynamic scale at
// work: backoffs first, growth later.
constexpr double kInitScale = 16777216.0;  // 2^24
constexpr std::int64_t kGrowthInterval = 250;
constexpr const char* kPolicies[] = {"FullPrecision", "MixedO1", "MixedO2", "PureHalf"};

// The policies of a group: the bf16 one adds MixedFP8 where LibTorch has fp8 (its Float8Linear,
// the classifier fc, computes in fp8; the convolutions in bf16).
std::vector<std::string> group_policies(const std::string& dtype) {
  std::vector<std::string> policies(std::begin(kPolicies), std::end(kPolicies));
  if (dtype == "bf16" && mixprec::has_fp8) policies.emplace_back("MixedFP8");
  return policies;
}

struct Config {
  int epochs = 3;
  std::int64_t train_size = 60000;
  std::int64_t half_train_size = 0;  // 0: sized by half_budget
  double half_budget = 100;          // seconds of training for the fp16 group's four runs
  // The same for the bf16 group where bf16 is slow here: the rest of the demo took 261 s on an
  // AVX2-only EPYC (its 14 min 54 s less the unsized bf16 group's 633 s), so 40 s keeps the
  // whole run within 5 minutes there.
  double bf16_budget = 40;
  bool train_size_set = false;       // --train-size given (or --smoke): no group is sized
  std::int64_t test_size = 10000;
  std::int64_t batch_size = 64;
  double lr = 0.02;
  std::string policy = "all";
  std::string device = "cpu";
  std::string dtype = mixprec::cpu_half_math ? "both" : "bf16";
  std::string conv_weight_grad = "auto";  // auto | fp16 | fp32
  std::string channels_last = "auto";     // auto | on | off
  std::string csv = "none";
  std::uint64_t seed = 42;
  std::string data_dir = MIXPREC_FASHION_MNIST_DIR;
  bool smoke = false;
  bool advise = false;
  std::int64_t gradient_stats = 0;
  std::string result_file;  // internal: set, the process trains one policy and writes here
};

std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

// What a run of `dtype`'s group does beyond its policy: where the flags say so (auto: where
// mixprec::cpu_capabilities() does, which in a child is the parent's decision, handed down),
// fp32 weight gradients for the fp16 convolutions; channels_last memory.
bool fp32_conv_weight_grads(const Config& c, const std::string& dtype) {
  if (dtype != "fp16" || c.conv_weight_grad == "fp16") return false;
  return c.conv_weight_grad == "fp32" ||
         (c.device == "cpu" && mixprec::cpu_capabilities().fp16_conv_weight_grad_slow);
}
// The dtype a run computes its convolutions' weight gradients in, and whether that is the remedy.
void set_conv_weight_grads(fm::PolicyResult& r, const Config& c, const std::string& dtype,
                           bool full_precision) {
  r.remedy = !full_precision && fp32_conv_weight_grads(c, dtype);
  r.conv_weight_grads = full_precision || r.remedy ? "fp32" : dtype;
}
// Why the fp16 runs compute their convolutions' weight gradients as they do, for the table.
std::string conv_weight_grad_reason(const Config& c) {
  if (c.conv_weight_grad != "auto") return "--conv-weight-grad " + c.conv_weight_grad;
  if (c.device != "cpu") return "fp16 on " + c.device;
  const auto& cpu = mixprec::cpu_capabilities();
  std::ostringstream why;
  why << "fp16 ones are " << (cpu.fp16_conv_weight_grad_slow ? "slow" : "fast") << " here";
  switch (cpu.fp16_conv_weight_grad_basis) {
    case mixprec::Fp16ConvBasis::flags:
      why << " (" << (cpu.avx512_fp16 ? "AMX-FP16" : "no AVX512-FP16: ATen's kernels") << ")";
      break;
    case mixprec::Fp16ConvBasis::flags_and_timing:
      why << " (oneDNN's reference loop: AVX512-FP16 without AMX-FP16, timed at "
          << fixed(cpu.fp16_conv_weight_grad_ratio, 0) << "x fp32)";
      break;
    case mixprec::Fp16ConvBasis::timing:
      why << " (timed at " << fixed(cpu.fp16_conv_weight_grad_ratio, 1) << "x fp32)";
      break;
    case mixprec::Fp16ConvBasis::environment:
      why << " (" << mixprec::fp16_conv_weight_grad_env << "="
          << mixprec::fp16_conv_weight_grad_setting(cpu) << ")";
      break;
  }
  return why.str();
}
// auto: channels_last for fp32 and bf16 on the CPU; fp16 convolutions ran slower in it on the
// EPYC these demos are measured on (docs/guide.md, "fp16 on a CPU").
bool channels_last(const Config& c, const std::string& dtype) {
  if (c.channels_last != "auto") return c.channels_last == "on";
  return c.device == "cpu" && dtype != "fp16";
}

// ---------------------------------------------------------------- data

struct Data {
  at::Tensor train_x, train_y, test_x, test_y;
};

const char* const kFiles[] = {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};

void check_data(const std::string& dir) {
  for (const auto* file : kFiles) {
    if (!std::filesystem::exists(std::filesystem::path(dir) / file)) {
      throw std::runtime_error(
          "no Fashion-MNIST file " + (std::filesystem::path(dir) / file).string() +
          ": install Debian's dataset-fashion-mnist (./scripts/demo does) and rebuild, which "
          "unpacks its *-ubyte.gz files there; or point --data at a directory of the four "
          "unpacked IDX files");
    }
  }
}

// LibTorch's own reader of the IDX files; images scaled to [0, 1], then standardized with
// Fashion-MNIST's mean and standard deviation.
Data load_data(const Config& c, std::int64_t train_size) {
  using torch::data::datasets::MNIST;
  const MNIST train(c.data_dir, MNIST::Mode::kTrain);
  const MNIST test(c.data_dir, MNIST::Mode::kTest);
  const auto standardize = [](const at::Tensor& x) { return (x - 0.2860) / 0.3530; };
  return {standardize(train.images().narrow(0, 0, train_size)),
          train.targets().narrow(0, 0, train_size),
          standardize(test.images().narrow(0, 0, c.test_size)),
          test.targets().narrow(0, 0, c.test_size)};
}

// ---------------------------------------------------------------- one policy

template <class TrainerT>
double test_accuracy(TrainerT& trainer, Net& model, const Data& data, torch::Device device,
                     bool nhwc) {
  constexpr std::int64_t kBatch = 1000;
  std::int64_t correct = 0;
  const auto n = data.test_x.size(0);
  for (std::int64_t start = 0; start < n; start += kBatch) {
    auto x = data.test_x.narrow(0, start, std::min(kBatch, n - start)).to(device);
    if (nhwc) x = x.contiguous(at::MemoryFormat::ChannelsLast);
    const auto y = data.test_y.narrow(0, start, x.size(0)).to(device);
    const at::Tensor logits = trainer.evaluate([&] { return model->forward(trainer.cast_input(x)); });
    correct += logits.argmax(1).eq(y).sum().template item<std::int64_t>();
  }
  return static_cast<double>(correct) / static_cast<double>(n);
}

void to_channels_last(torch::nn::Module& model) {
  for (auto& p : model.parameters()) {
    if (p.dim() == 4) p.set_data(p.data().contiguous(at::MemoryFormat::ChannelsLast));
  }
}

/// Trains a fresh model under Policy for `max_steps` steps (all epochs when negative) and
/// measures it. Same seed, same initial weights and same data order for every policy.
template <class Policy>
fm::PolicyResult run_policy(const Config& c, const std::string& dtype, const Data& data,
                            std::int64_t max_steps = -1) {
  const torch::Device device(c.device == "cuda" ? torch::kCUDA : torch::kCPU);
  const std::string name(Policy::name);
  const bool full_precision = std::is_same_v<Policy, mixprec::FullPrecision>;
  fm::PolicyResult result;
  result.policy = name;
  set_conv_weight_grads(result, c, dtype, full_precision);
  result.images = data.train_x.size(0);

  torch::manual_seed(c.seed);
  Net model;
  model->to(device);
  const bool nhwc = channels_last(c, dtype);
  if (nhwc) to_channels_last(*model);
  if (result.remedy) mixprec::nn::fp32_conv_weight_grads(*model);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(c.lr).momentum(0.9));

  mixprec::TrainerOptions options;
  // Skips reach the program's own log, with where the inf/NaN was: the library never prints.
  options.on_step([&](const mixprec::StepReport& report) {
    if (report.overflow && max_steps < 0) {
      std::cerr << name << ": step " << report.step << " skipped at loss scale "
                << fixed(report.scale, 1) << ": " << *report.overflow << "\n";
    }
    if (report.gradient_stats) std::cerr << name << ": " << *report.gradient_stats;
  });
  options.on_warning([](const std::string& warning) { std::cerr << warning << "\n"; });
  options.gradient_stats(mixprec::GradientStatsOptions().every(c.gradient_stats).group_depth(1));
  if constexpr (std::is_same_v<typename Policy::scaler_type, mixprec::GradScaler>) {
    options.scaler(mixprec::GradScalerOptions().init_scale(kInitScale).growth_interval(kGrowthInterval));
  }
  mixprec::Trainer<Policy> trainer(model, optimizer, options);

  const double peak_before = fm::self_status_mib("VmHWM:");
  const bool reset = fm::reset_peak_rss();
  const double rss_before = fm::self_status_mib("VmRSS:");

  const std::int64_t n = data.train_x.size(0);
  const std::int64_t batches = (n + c.batch_size - 1) / c.batch_size;
  const std::int64_t total_steps = c.epochs * batches;
  std::mt19937 rng(static_cast<std::mt19937::result_type>(c.seed));
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  double train_seconds = 0;
  std::int64_t iteration = 0;
  std::vector<double> step_seconds;
  for (int epoch = 1; epoch <= c.epochs; ++epoch) {
    std::iota(order.begin(), order.end(), std::int64_t{0});
    std::shuffle(order.begin(), order.end(), rng);
    const auto permutation = torch::from_blob(order.data(), {n}, torch::kLong);
    const auto start = std::chrono::steady_clock::now();
    double loss_sum = 0;
    std::int64_t loss_count = 0;
    for (std::int64_t b = 0; b < batches; ++b) {
      if (iteration == max_steps) break;
      // Cosine decay to zero: the final weights settle, so the accuracy compared is not the
      // noise of the last few large steps.
      const double progress = static_cast<double>(iteration) / static_cast<double>(total_steps);
      for (auto& group : optimizer.param_groups()) {
        static_cast<torch::optim::SGDOptions&>(group.options())
            .lr(0.5 * c.lr * (1 + std::cos(std::numbers::pi * progress)));
      }
      const std::int64_t first = b * c.batch_size;
      const auto index = permutation.narrow(0, first, std::min(c.batch_size, n - first));
      auto x = data.train_x.index_select(0, index).to(device);
      if (nhwc) x = x.contiguous(at::MemoryFormat::ChannelsLast);
      const auto y = data.train_y.index_select(0, index).to(device);
      const auto step_start = std::chrono::steady_clock::now();
      const auto report = trainer.step([&] {
        return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
      });
      const double loss = report.loss.template item<double>();  // waits for the step
      step_seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count());
      ++iteration;
      result.losses.push_back(loss);
      result.scales.push_back(report.scale);
      if (std::isfinite(loss)) {
        loss_sum += loss;
        ++loss_count;
      }
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    train_seconds += seconds;
    if (max_steps >= 0) break;
    std::cerr << fm::label(result) << ", " << dtype << ", " << n << " images, epoch " << epoch
              << "/" << c.epochs << ": mean loss "
              << fixed(loss_count > 0 ? loss_sum / static_cast<double>(loss_count) : NAN, 4)
              << ", " << fixed(seconds, 1) << " s\n";
  }
  if (max_steps >= 0) {  // a timing probe: the median step after the first three
    std::vector<double> timed(step_seconds.begin() + std::min<std::ptrdiff_t>(3, std::ssize(step_seconds)),
                              step_seconds.end());
    std::sort(timed.begin(), timed.end());
    result.seconds_per_epoch = timed.empty() ? 0.0 : timed[timed.size() / 2];
    return result;
  }
  result.test_accuracy = test_accuracy(trainer, model, data, device, nhwc);
  result.seconds_per_epoch = train_seconds / c.epochs;
  const double peak_after = fm::self_status_mib("VmHWM:");
  result.peak_rss_mib = std::max(peak_before, peak_after);
  result.training_peak_mib = reset && rss_before >= 0 ? peak_after - rss_before : -1;
  const auto stats = trainer.stats();
  result.steps = stats.steps;
  result.skipped_steps = stats.skipped_steps;
  result.final_scale = stats.scale;
  return result;
}

// (A template on the fp8 recipe only so that MixedFP8 is not compiled under LibTorch 1.13.)
template <class Fp8Recipe = mixprec::TensorwiseScaling>
fm::PolicyResult run_named(const std::string& policy, const Config& c, const std::string& dtype,
                           const Data& data, std::int64_t max_steps = -1) {
  auto by_low = [&]<class Low>() -> fm::PolicyResult {
    if (policy == "FullPrecision") return run_policy<mixprec::FullPrecision>(c, dtype, data, max_steps);
    if constexpr (mixprec::has_fp8) {
      if (policy == "MixedFP8" && dtype == "bf16") {
        return run_policy<mixprec::MixedFP8<Fp8Recipe>>(c, dtype, data, max_steps);
      }
    }
    if (policy == "MixedO1") return run_policy<mixprec::MixedO1<Low>>(c, dtype, data, max_steps);
    if (policy == "MixedO2") return run_policy<mixprec::MixedO2<Low>>(c, dtype, data, max_steps);
    if (policy == "PureHalf") return run_policy<mixprec::PureHalf<Low>>(c, dtype, data, max_steps);
    throw std::runtime_error("unknown policy " + policy);
  };
  return dtype == "fp16" ? by_low.template operator()<at::Half>()
                         : by_low.template operator()<at::BFloat16>();
}

// ---------------------------------------------------------------- processes

std::vector<std::string> child_args(const Config& c, const std::string& policy,
                                    const std::string& dtype, std::int64_t train_size,
                                    const std::string& result_file) {
  char lr[32];
  std::snprintf(lr, sizeof lr, "%.17g", c.lr);
  return {"fashion_mnist", "--policy", policy, "--dtype", dtype,
          "--train-size", std::to_string(train_size), "--epochs", std::to_string(c.epochs),
          "--test-size", std::to_string(c.test_size), "--batch-size", std::to_string(c.batch_size),
          "--lr", lr, "--seed", std::to_string(c.seed), "--device", c.device,
          "--conv-weight-grad", c.conv_weight_grad, "--channels-last", c.channels_last,
          "--data", c.data_dir, "--gradient-stats", std::to_string(c.gradient_stats),
          "--result-file", result_file};
}

/// Runs this program again as a child that trains `policy`, with this process's decision on
/// fp16 convolution weight gradients; returns its result, checked to have applied it.
fm::PolicyResult run_in_child(const Config& c, const std::string& policy, const std::string& dtype,
                              std::int64_t train_size) {
  std::string file_name =
      (std::filesystem::temp_directory_path() / "fashion_mnist_result_XXXXXX").string();
  const int fd = ::mkstemp(file_name.data());
  if (fd < 0) throw std::runtime_error("cannot create a temporary file");
  ::close(fd);
  struct Remove {
    std::string path;
    ~Remove() { std::remove(path.c_str()); }
  } remove_file{file_name};
  const auto decision = mixprec::fp16_conv_weight_grad_setting(mixprec::cpu_capabilities());
  fm::run_self(child_args(c, policy, dtype, train_size, file_name),
               fm::environment_with(::environ, mixprec::fp16_conv_weight_grad_env, decision), policy);
  std::ifstream in(file_name);
  auto result = fm::read_result(in);
  fm::PolicyResult expected;
  set_conv_weight_grads(expected, c, dtype, policy == "FullPrecision");
  if (result.remedy != expected.remedy || result.conv_weight_grads != expected.conv_weight_grads) {
    throw std::runtime_error(fm::label(result) + " computed its convolution weight gradients in " +
                             fm::conv_weight_grads_cell(result) + ", the parent decided " +
                             fm::conv_weight_grads_cell(expected));
  }
  return result;
}

int run_child(const Config& c) {
  const auto result = run_named(c.policy, c, c.dtype, load_data(c, c.train_size));
  std::ofstream out(c.result_file, std::ios::trunc);
  fm::write_result(out, result);
  out.close();
  if (!out) throw std::runtime_error("cannot write " + c.result_file);
  return 0;
}

// ---------------------------------------------------------------- the comparison

int run_advise(const Config& c) {
  const torch::Device device(c.device == "cuda" ? torch::kCUDA : torch::kCPU);
  const auto data = load_data(c, std::min<std::int64_t>(c.train_size, 3 * c.batch_size));
  torch::manual_seed(c.seed);
  Net model;
  model->to(device);
  std::int64_t batch = 0;
  const auto advice = mixprec::advise(model, [&] {
    const std::int64_t first = (batch++ * c.batch_size) % data.train_x.size(0);
    const std::int64_t n = std::min(c.batch_size, data.train_x.size(0) - first);
    const auto x = data.train_x.narrow(0, first, n).to(device);
    const auto y = data.train_y.narrow(0, first, n).to(device);
    return torch::nn::functional::cross_entropy(model->forward(x), y);
  });
  std::cout << "Fashion-MNIST CNN, batch " << c.batch_size << ", seed " << c.seed << ", device "
            << c.device << ", LibTorch " << TORCH_VERSION << "\n"
            << advice;
  return 0;
}

struct Group {
  std::string dtype;
  std::int64_t images;
  std::string why;  // how the size was chosen
  std::vector<fm::PolicyResult> results;
};

// A group's size on a CPU where its low precision is slow or of unknown speed: a few timed steps
// of each of its runs decide how many images fit `budget` seconds (the fp16 kernels' speed
// differs by orders of magnitude between CPUs; bf16 without bf16 hardware is several times
// fp32's time).
std::int64_t size_group(const Config& c, const std::string& dtype, double budget,
                        const std::string& flag, std::string& why) {
  const auto probe = load_data(c, std::min<std::int64_t>(c.train_size, 16 * c.batch_size));
  std::vector<double> seconds;
  std::ostringstream text;
  for (const auto& policy : group_policies(dtype)) {
    if (c.policy != "all" && c.policy != policy && policy != "FullPrecision") continue;
    const double s = run_named(policy, c, dtype, probe, /*max_steps=*/3 + 8).seconds_per_epoch;
    seconds.push_back(s);
    text << (seconds.size() > 1 ? ", " : "") << policy << " " << fixed(1000 * s, 1) << " ms";
  }
  const std::int64_t minimum = std::min<std::int64_t>(2000, c.train_size);
  const auto images =
      fm::images_within_budget(budget, seconds, c.epochs, c.batch_size, minimum, c.train_size);
  why = "a step of each run measured " + text.str() + " (batch " + std::to_string(c.batch_size) +
        "): " + std::to_string(images) + " images x " + std::to_string(c.epochs) +
        " epochs fit the " + flag + " of " + fixed(budget, 0) + " s";
  return images;
}

int run_parent(const Config& c) {
  check_data(c.data_dir);
  if (c.advise) return run_advise(c);
  if (c.device == "cuda" && !torch::cuda::is_available()) {
    throw std::runtime_error("--device cuda: this LibTorch has no CUDA device available");
  }
  if (c.device == "cpu" && c.dtype != "bf16" && !mixprec::cpu_half_math) {
    std::cout << "not run: --dtype " << c.dtype << " needs fp16 math on the CPU, which LibTorch "
              << mixprec::torch_version << " lacks (--dtype bf16 runs)\n";
    return 77;
  }
  const auto start = std::chrono::steady_clock::now();
  std::cerr << "CPU: " << mixprec::cpu_capabilities() << "\n";
  std::vector<Group> groups;
  for (const std::string dtype : {"bf16", "fp16"}) {
    if (c.dtype != dtype && c.dtype != "both") continue;
    Group group{dtype, c.train_size, "--train-size", {}};
    if (dtype == "fp16" && c.device == "cpu" && c.dtype == "both") {
      if (c.half_train_size > 0) {
        group.images = std::min(c.half_train_size, c.train_size);
        group.why = "--half-train-size";
      } else {
        group.images = size_group(c, "fp16", c.half_budget, "--half-budget", group.why);
      }
      std::cerr << "fp16 group: " << group.images << " images: " << group.why << "\n";
    }
    // Without bf16 hardware bf16 is several times fp32's time (a whole run 3-4x on an AVX2-only
    // EPYC: 15 minutes for the demo unsized), so the bf16 group is sized as the fp16 one is.
    if (dtype == "bf16" && c.device == "cpu" && !c.train_size_set &&
        mixprec::cpu_capabilities().bf16_slow) {
      group.images = size_group(c, "bf16", c.bf16_budget, "--bf16-budget", group.why);
      group.why += ", as bf16 is slower than fp32 on this CPU";
      std::cerr << "bf16 group: " << group.images << " images: " << group.why << "\n";
    }
    groups.push_back(group);
  }
  for (auto& group : groups) {
    for (const auto& policy : group_policies(group.dtype)) {
      if (c.policy != "all" && c.policy != policy) continue;
      group.results.push_back(run_in_child(c, policy, group.dtype, group.images));
    }
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const auto& cpu = mixprec::cpu_capabilities();
  std::cout << "\nFashion-MNIST: " << c.test_size << " test images, " << c.epochs << " epochs, batch "
            << c.batch_size << ", SGD lr " << c.lr << " (cosine decay) momentum 0.9, seed " << c.seed
            << ", device " << c.device << ", " << torch::get_num_threads() << " threads, LibTorch "
            << TORCH_VERSION << ", CPU " << (cpu.model.empty() ? "unknown" : cpu.model)
            << "; fp16 GradScaler: init 2^24, x2 after " << kGrowthInterval << " clean steps\n";
  std::vector<std::pair<std::string, fm::PolicyResult>> runs;
  for (const auto& group : groups) {
    std::cout << "\nLow precision " << group.dtype << ", " << group.images << " training images ("
              << group.why << ")" << (channels_last(c, group.dtype) ? ", channels_last" : "");
    if (group.dtype == "fp16") {
      std::cout << "; convolution weight gradients in "
                << (fp32_conv_weight_grads(c, "fp16") ? "fp32 (the remedy)" : "fp16")
                << ", decided once for every run: " << conv_weight_grad_reason(c);
    }
    std::cout << ":\n\n" << fm::format_table(group.results);
    for (const auto& r : group.results) runs.emplace_back(group.dtype, r);
  }
  std::cout << "\n"
            << (c.device == "cpu" && !mixprec::cpu_half_math
                    ? "No Half policies: the CPU kernels of LibTorch " TORCH_VERSION " compute no "
                      "fp16 (the default LibTorch 2.x of ./scripts/demo does).\n"
                    : "")
            << "Total " << fixed(total, 1) << " s (training and evaluation of every run, and the "
            << "fp16 timing steps). Peak RSS: each policy in its own process; training peak: "
            << "peak RSS during training and evaluation minus RSS before.\n";
  if (c.csv != "none") {
    std::ofstream out(c.csv, std::ios::trunc);
    fm::write_csv(out, runs);
    out.close();
    if (!out) throw std::runtime_error("cannot write " + c.csv);
    std::cout << "Loss curves: " << c.csv << "\n";
  }
  std::cout << std::flush;
  if (c.smoke) {
    bool ok = true;
    for (const auto& [dtype, r] : runs) {
      if (!(r.test_accuracy > 0.3)) {
        std::cerr << "smoke check failed: " << fm::label(r) << " (" << dtype << ") test accuracy "
                  << fixed(100 * r.test_accuracy, 2) << "% is not above 30%\n";
        ok = false;
      }
    }
    if (!ok) return 1;
    std::cerr << "smoke check passed: every policy above 30% test accuracy\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"Trains a small CNN on Fashion-MNIST under mixprec's precision policies (same "
               "seed, same data order) and compares test accuracy, time per epoch, peak memory, "
               "skipped steps and loss scale. Each policy runs in a child process.",
               "fashion_mnist"};
  app.add_option("--epochs", c.epochs, "training epochs")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--train-size", c.train_size, "training images, at most 60000")
      ->check(CLI::Range(1, 60000))->capture_default_str();
  app.add_option("--half-train-size", c.half_train_size,
                 "training images of the fp16 policies and their FullPrecision reference on the "
                 "CPU with --dtype both (default: as many as fit --half-budget)")
      ->check(CLI::Range(1, 60000));
  app.add_option("--half-budget", c.half_budget,
                 "seconds of training for the fp16 group's four runs; a few timed steps of each "
                 "decide its number of images")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--bf16-budget", c.bf16_budget,
                 "on a CPU where bf16 is slower than fp32 (no AVX512-BF16 or AMX-BF16 that "
                 "LibTorch uses), seconds of training for the bf16 group's runs, sized as the "
                 "fp16 group is; unused where --train-size is given")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--test-size", c.test_size, "test images, at most 10000")
      ->check(CLI::Range(1, 10000))->capture_default_str();
  app.add_option("--batch-size", c.batch_size, "mini-batch size")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr", c.lr, "peak SGD learning rate, cosine decay to 0, momentum 0.9")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--policy", c.policy,
                 "all, FullPrecision, MixedO1, MixedO2, PureHalf (O0..O3) or MixedFP8 (bf16 only)")
      ->transform(CLI::CheckedTransformer(std::map<std::string, std::string>{
          {"all", "all"}, {"FullPrecision", "FullPrecision"}, {"MixedO1", "MixedO1"},
          {"MixedO2", "MixedO2"}, {"PureHalf", "PureHalf"}, {"MixedFP8", "MixedFP8"},
          {"O0", "FullPrecision"},
          {"O1", "MixedO1"}, {"O2", "MixedO2"}, {"O3", "PureHalf"}}))
      ->capture_default_str();
  app.add_option("--device", c.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--dtype", c.dtype, "bf16, fp16 or both: the low precision of the mixed policies")
      ->check(CLI::IsMember({"bf16", "fp16", "both"}))->capture_default_str();
  app.add_option("--conv-weight-grad", c.conv_weight_grad,
                 "fp16 runs: auto (fp32 where mixprec::cpu_capabilities() finds LibTorch's fp16 "
                 "weight gradients slow: decided once, from the CPU flags, in this process, and "
                 "handed to every child process in MIXPREC_FP16_CONV_WEIGHT_GRAD; set beforehand "
                 "to slow or fast, that variable decides instead), fp16 or fp32")
      ->check(CLI::IsMember({"auto", "fp16", "fp32"}))->capture_default_str();
  app.add_option("--channels-last", c.channels_last,
                 "auto (fp32 and bf16 runs on the CPU), on or off")
      ->check(CLI::IsMember({"auto", "on", "off"}))->capture_default_str();
  app.add_option("--csv", c.csv, "write the loss curves here (plot.py draws them); none: no file")
      ->capture_default_str();
  app.add_option("--seed", c.seed, "seed of the initial weights and the data order")->capture_default_str();
  app.add_option("--data", c.data_dir, "directory of the four unpacked Fashion-MNIST IDX files")
      ->capture_default_str();
  app.add_option("--gradient-stats", c.gradient_stats,
                 "log, every N steps, how much of each layer's gradient fp16 would lose (0: off)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--advise", c.advise, "print mixprec::advise's verdict for the CNN and exit");
  app.add_flag("--smoke", c.smoke,
               "tiny run for CI (512 training and 1000 test images, 2 epochs unless given); "
               "fails unless every policy beats chance");
  app.add_option("--result-file", c.result_file)->group("");  // internal: the child's output
  try {
    app.parse(argc, argv);
    if (c.smoke) {
      if (app.count("--train-size") == 0) c.train_size = 512;
      if (app.count("--test-size") == 0) c.test_size = 1000;
      if (app.count("--epochs") == 0) c.epochs = 2;
      if (app.count("--lr") == 0) c.lr = 0.05;  // 16 steps learn only at a larger rate
      if (app.count("--half-train-size") == 0) c.half_train_size = c.train_size;
    }
    c.train_size_set = c.smoke || app.count("--train-size") > 0;
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cerr << "fashion_mnist: " << e.what() << "\nRun with --help for the options.\n";
    return 2;
  }
  try {
    return c.result_file.empty() ? run_parent(c) : run_child(c);
  } catch (const std::exception& error) {
    std::cerr << "fashion_mnist: error: " << error.what() << "\n";
    return 1;
  }
}
