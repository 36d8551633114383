#pragma once
// Command line of the Fashion-MNIST demo: flags, defaults, validation, and the arguments the
// parent process passes to the child that trains one policy.

#include <mixprec/detail/torch_version.hpp>

#include <array>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace fashion_mnist {

/// The four policies the demo compares, in table order.
inline constexpr std::array<std::string_view, 4> kPolicyNames = {"FullPrecision", "MixedO1",
                                                                 "MixedO2", "PureHalf"};

/// --dtype on the CPU by default: both precisions where LibTorch computes fp16 on the CPU.
inline constexpr const char* kCpuDefaultDtype = mixprec::detail::cpu_half_math ? "both" : "bf16";

/// Everything a run needs; parse_args fills it from the command line.
struct Config {
  int epochs = 3;
  std::int64_t train_size = 60000;
  std::int64_t half_train_size = 10000;  // fp16 on the CPU beside bf16 (--dtype both)
  std::int64_t test_size = 10000;
  std::int64_t batch_size = 64;
  double lr = 0.05;
  std::string policy = "all";  // "all" or one of kPolicyNames
  std::string device = "cpu";  // "cpu" or "cuda"
  std::string dtype = "bf16";  // "bf16", "fp16" or "both": the Low of MixedO1/MixedO2/PureHalf
  std::string output = "docs/demo_loss.svg";
  std::uint64_t seed = 42;
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  bool smoke = false;
  bool help = false;
  bool advise = false;               // print mixprec::advise for the CNN and exit
  std::int64_t gradient_stats = 0;   // log fp16's view of the gradients every N steps (0: off)
  std::string result_file;  // internal: set, the process trains one policy and writes here
};

/// A bad command line; main prints the message and the usage and exits with status 2.
class CliError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The help text.
inline std::string usage(std::string_view program) {
  std::string text = "usage: " + std::string(program) + " [options]\n";
  text += R"(
Trains a small CNN on Fashion-MNIST under mixprec's precision policies (same seed, same data
order) and compares test accuracy, time per epoch, peak memory, skipped steps and loss scale.
Each policy runs in a child process, so that each has its own peak RSS.

options:
  --epochs N         training epochs (default 3)
  --train-size N     training images used, at most 60000 (default 60000)
  --half-train-size N  with --dtype both on the CPU, the fp16 policies and their FullPrecision
                     reference train on the first N images (default 10000): fp16 is several
                     times slower than bf16 on a CPU without native fp16
  --test-size N      test images used, at most 10000 (default 10000)
  --batch-size N     mini-batch size (default 64)
  --lr X             peak SGD learning rate, cosine decay to 0, momentum 0.9 (default 0.05)
  --policy NAME      all | FullPrecision | MixedO1 | MixedO2 | PureHalf (or O0..O3; default all)
  --device D         cpu | cuda (default cpu)
  --dtype T          bf16 | fp16 | both: the low precision of the mixed policies (default: both
                     on the CPU with LibTorch >= 2.4, bf16 on the CPU with LibTorch 1.13, whose
                     CPU kernels lack fp16 math; fp16 on CUDA)
  --output PATH      SVG plot of the loss curves and loss scales (default docs/demo_loss.svg;
                     "none" writes no plot)
  --seed N           seed of the model initialisation and the data order (default 42)
  --data DIR         directory of the four *-ubyte.gz files (default
                     /usr/share/datasets/fashion-mnist: Debian package dataset-fashion-mnist)
  --advise           print mixprec::advise's verdict for the CNN (3 fp32 steps on the first
                     batches: layer ranges, fp16/bf16 safety, loss-scale range, recommended
                     policy) and exit without training
  --gradient-stats N log, every N steps, the share of each layer's gradient elements that fp16
                     flushes to zero or overflows at the loss scale (default 0: off)
  --smoke            tiny run for CI (512 training images, 1000 test images, 2 epochs unless
                     given); fails unless every policy beats chance (accuracy > 0.3)
  -h, --help         this text
)";
  return text;
}

namespace detail {

template <class Int>
Int parse_integer(std::string_view flag, std::string_view text, Int min) {
  Int value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc{} || end != text.data() + text.size() || value < min) {
    throw CliError(std::string(flag) + ": expected an integer >= " + std::to_string(min) +
                   ", got '" + std::string(text) + "'");
  }
  return value;
}

inline double parse_positive(std::string_view flag, std::string_view text) {
  double value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc{} || end != text.data() + text.size() || !(value > 0)) {
    throw CliError(std::string(flag) + ": expected a positive number, got '" + std::string(text) +
                   "'");
  }
  return value;
}

inline std::string canonical_policy(std::string_view name) {
  static constexpr std::array<std::string_view, 4> kApex = {"O0", "O1", "O2", "O3"};
  if (name == "all") {
    return "all";
  }
  for (std::size_t i = 0; i < kPolicyNames.size(); ++i) {
    if (name == kPolicyNames[i] || name == kApex[i]) {
      return std::string(kPolicyNames[i]);
    }
  }
  throw CliError("--policy: unknown policy '" + std::string(name) +
                 "' (all, FullPrecision, MixedO1, MixedO2, PureHalf)");
}

}  // namespace detail

/// Parses the arguments after the program name. `--flag value` and `--flag=value` both work.
/// Throws CliError for an unknown flag, a missing or malformed value, or a bad combination.
inline Config parse_args(const std::vector<std::string>& args) {
  Config config;
  std::optional<int> epochs;
  std::optional<std::int64_t> train_size;
  std::optional<std::int64_t> test_size;
  std::optional<std::string> dtype;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string_view arg = args[i];
    std::optional<std::string> inline_value;
    if (const auto eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      inline_value = std::string(arg.substr(eq + 1));
      arg = arg.substr(0, eq);
    }
    const auto value = [&]() -> std::string {
      if (inline_value) {
        return *inline_value;
      }
      if (i + 1 >= args.size()) {
        throw CliError(std::string(arg) + ": missing value");
      }
      return args[++i];
    };
    const auto no_value = [&] {
      if (inline_value) {
        throw CliError(std::string(arg) + " takes no value");
      }
    };
    if (arg == "-h" || arg == "--help") {
      no_value();
      config.help = true;
    } else if (arg == "--smoke") {
      no_value();
      config.smoke = true;
    } else if (arg == "--advise") {
      no_value();
      config.advise = true;
    } else if (arg == "--gradient-stats") {
      config.gradient_stats = detail::parse_integer<std::int64_t>(arg, value(), 0);
    } else if (arg == "--epochs") {
      epochs = detail::parse_integer<int>(arg, value(), 1);
    } else if (arg == "--train-size") {
      train_size = detail::parse_integer<std::int64_t>(arg, value(), 1);
    } else if (arg == "--half-train-size") {
      config.half_train_size = detail::parse_integer<std::int64_t>(arg, value(), 1);
    } else if (arg == "--test-size") {
      test_size = detail::parse_integer<std::int64_t>(arg, value(), 1);
    } else if (arg == "--batch-size") {
      config.batch_size = detail::parse_integer<std::int64_t>(arg, value(), 1);
    } else if (arg == "--lr") {
      config.lr = detail::parse_positive(arg, value());
    } else if (arg == "--seed") {
      config.seed = detail::parse_integer<std::uint64_t>(arg, value(), 0);
    } else if (arg == "--policy") {
      config.policy = detail::canonical_policy(value());
    } else if (arg == "--device") {
      config.device = value();
      if (config.device != "cpu" && config.device != "cuda") {
        throw CliError("--device: expected cpu or cuda, got '" + config.device + "'");
      }
    } else if (arg == "--dtype") {
      dtype = value();
      if (*dtype != "bf16" && *dtype != "fp16" && *dtype != "both") {
        throw CliError("--dtype: expected bf16, fp16 or both, got '" + *dtype + "'");
      }
    } else if (arg == "--output") {
      config.output = value();
    } else if (arg == "--data") {
      config.data_dir = value();
    } else if (arg == "--result-file") {
      config.result_file = value();
    } else {
      throw CliError("unknown argument '" + args[i] + "'");
    }
  }
  // --smoke changes the defaults only: explicit sizes win, whatever their position.
  config.epochs = epochs.value_or(config.smoke ? 2 : config.epochs);
  config.train_size = train_size.value_or(config.smoke ? 512 : config.train_size);
  config.test_size = test_size.value_or(config.smoke ? 1000 : config.test_size);
  config.dtype = dtype.value_or(config.device == "cuda" ? "fp16" : kCpuDefaultDtype);
  if (config.train_size > 60000) {
    throw CliError("--train-size: Fashion-MNIST has 60000 training images, got " +
                   std::to_string(config.train_size));
  }
  if (config.test_size > 10000) {
    throw CliError("--test-size: Fashion-MNIST has 10000 test images, got " +
                   std::to_string(config.test_size));
  }
  if (!mixprec::detail::cpu_half_math && config.device == "cpu" && config.dtype != "bf16") {
    throw CliError("--dtype " + config.dtype + " needs --device cuda or LibTorch >= 2.4: the "
                   "CPU kernels of LibTorch " TORCH_VERSION " have no fp16 convolution, matmul or "
                   "softmax (\"not implemented for 'Half'\"); use --dtype bf16 on the CPU");
  }
  if (!config.result_file.empty() && (config.policy == "all" || config.dtype == "both")) {
    throw CliError("--result-file trains one policy in one dtype: give --policy and --dtype too");
  }
  return config;
}

/// The arguments of the child process that trains `policy` and writes its result to
/// `result_file`: every setting explicit, so the child does not depend on defaults.
inline std::vector<std::string> child_args(const Config& config, std::string_view policy,
                                           std::string_view result_file) {
  char lr[32];
  std::snprintf(lr, sizeof lr, "%.17g", config.lr);
  return {"--policy",      std::string(policy),
          "--epochs",      std::to_string(config.epochs),
          "--train-size",  std::to_string(config.train_size),
          "--test-size",   std::to_string(config.test_size),
          "--batch-size",  std::to_string(config.batch_size),
          "--lr",          lr,
          "--seed",        std::to_string(config.seed),
          "--device",      config.device,
          "--dtype",       config.dtype,
          "--data",        config.data_dir,
          "--output",      "none",
          "--gradient-stats", std::to_string(config.gradient_stats),
          "--result-file", std::string(result_file)};
}

}  // namespace fashion_mnist
