// bf16 on this CPU, and on the CPUs it can pass for: a Linear's and a convolution's forward and
// backward in bf16 against fp32, and a training step of the demo CNN under each bf16 policy
// against FullPrecision, paired per repetition. The same measurements run in a child process per
// configuration of LibTorch's kernels: as the environment is, then, on a CPU with AVX512-BF16,
// oneDNN capped below it (ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI: AVX-512 without bf16, oneDNN
// converts) and to AVX2 with ATen's AVX2 kernels (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2:
// an AVX2-only CPU such as a Zen 2/3 EPYC, where LibTorch computes bf16 with ATen's own loops).
// Each child prints what mixprec::cpu_capabilities() decided there.
//
//   ./build/default/benchmarks/bench_cpu_bf16          full size
//   ./build/default/benchmarks/bench_cpu_bf16 --smoke  tiny sizes, 3 repetitions (ctest)

#include <harness.hpp>
#include "../examples/fashion_mnist/model.hpp"  // the demo's CNN

#include <mixprec/mixprec.hpp>

#include <spawn.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

extern char** environ;

namespace bench_cpu_bf16 {

namespace {

// A configuration of LibTorch's CPU kernels: the environment a child runs under.
struct Configuration {
  std::string name;
  std::vector<std::pair<std::string, std::string>> env;  // set in the child
};

// One layer's forward and backward (the input's and the parameters' gradients) in `dtype`.
bench::Variant layer_variant(const std::string& name, torch::nn::AnyModule layer, at::Tensor x) {
  return {name, [layer, x]() mutable {
            for (auto& p : layer.ptr()->parameters()) p.mutable_grad() = at::Tensor();
            auto y = layer.forward(x);
            y.sum().backward();
            (void)x.grad().sum().item<float>();
          }};
}

struct LayerCase {
  std::string name;
  std::function<torch::nn::AnyModule()> make;
  std::vector<std::int64_t> input;
  bool channels_last = false;
};

// The layer's fp32 and bf16 variants, built from the same seed.
std::vector<bench::Variant> layer_pair(const LayerCase& c) {
  std::vector<bench::Variant> pair;
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    torch::manual_seed(0);
    auto layer = c.make();
    layer.ptr()->to(dtype);
    auto x = torch::randn(c.input).to(dtype);
    if (c.channels_last) {
      x = x.contiguous(at::MemoryFormat::ChannelsLast);
      for (auto& p : layer.ptr()->parameters()) {
        if (p.dim() == 4) p.set_data(p.data().contiguous(at::MemoryFormat::ChannelsLast));
      }
    }
    x.requires_grad_(true);
    pair.push_back(layer_variant(dtype == at::kFloat ? "fp32" : "bf16", std::move(layer), x));
  }
  return pair;
}

// A Trainer<P> step of the demo CNN, channels_last as the demo trains fp32 and bf16.
template <class P>
bench::Variant step_variant(const std::string& name, std::int64_t batch) {
  torch::manual_seed(0);
  auto model = std::make_shared<fashion_mnist::NetImpl>();
  for (auto& p : model->parameters()) {
    if (p.dim() == 4) p.set_data(p.data().contiguous(at::MemoryFormat::ChannelsLast));
  }
  auto optimizer = std::make_shared<torch::optim::SGD>(model->parameters(),
                                                       torch::optim::SGDOptions(0.01).momentum(0.9));
  auto trainer = std::make_shared<mixprec::Trainer<P>>(
      model, *optimizer, mixprec::TrainerOptions().on_warning([](const std::string&) {}));
  const auto x = torch::randn({batch, 1, 28, 28}).contiguous(at::MemoryFormat::ChannelsLast);
  const auto y = torch::randint(0, 10, {batch});
  return {name, [=] {
            (void)optimizer;
            auto report = trainer->step([&] {
              return torch::nn::functional::cross_entropy(model->forward(trainer->cast_input(x)), y);
            });
            (void)report.loss.template item<float>();
          }};
}

std::string env_text(const Configuration& c) {
  std::string text;
  for (const auto& [name, value] : c.env) text += (text.empty() ? "" : " ") + name + "=" + value;
  return text.empty() ? "the environment as it is" : text;
}

// What this process measures: its configuration's section.
int measure(const Configuration& configuration, const bench::Options& options) {
  const std::int64_t batch = options.smoke ? 8 : 64;
  const std::int64_t tokens = options.smoke ? 16 : 512;  // 4 x 128 tokens at full size
  const std::int64_t hidden = options.smoke ? 64 : 768;
  std::ostringstream cpu;
  cpu << mixprec::cpu_capabilities();
  std::printf("\n### %s (%s)\n\n%s.\n", configuration.name.c_str(),
              env_text(configuration).c_str(), cpu.str().c_str());

  const std::vector<LayerCase> layers = {
      {"Linear 512 -> 512, " + std::to_string(batch) + " rows",
       [] { return torch::nn::AnyModule(torch::nn::Linear(512, 512)); }, {batch, 512}},
      {"Linear " + std::to_string(hidden) + " -> " + std::to_string(4 * hidden) + ", " +
           std::to_string(tokens) + " rows (an encoder's feed-forward)",
       [hidden] { return torch::nn::AnyModule(torch::nn::Linear(hidden, 4 * hidden)); },
       {tokens, hidden}},
      {"the demo's conv2 (16 -> 32, 3x3, 14x14), batch " + std::to_string(batch) + ", channels_last",
       [] {
         return torch::nn::AnyModule(
             torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)));
       },
       {batch, 16, 14, 14}, true},
  };
  std::printf("\n| layer, forward + backward | fp32 ms | bf16 ms | bf16 ratio | ratio IQR |\n"
              "|---|---:|---:|---:|---:|\n");
  for (const auto& layer : layers) {
    const auto pair = layer_pair(layer);
    const auto ms = bench::interleaved_samples(pair, options);
    const auto ratio = bench::paired_ratio(ms[1], ms[0]);
    std::printf("| %s | %.3f | %.3f | %.2f | %s |\n", layer.name.c_str(), bench::median(ms[0]),
                bench::median(ms[1]), ratio.median, bench::iqr(ratio, 2).c_str());
  }
  using BF16 = at::BFloat16;
  std::vector<bench::Variant> steps = {
      step_variant<mixprec::FullPrecision>("FullPrecision", batch),
      step_variant<mixprec::MixedO1<BF16>>("MixedO1<BFloat16>", batch),
      step_variant<mixprec::MixedO2<BF16>>("MixedO2<BFloat16>", batch),
      step_variant<mixprec::PureHalf<BF16>>("PureHalf<BFloat16>", batch),
  };
  bench::print_table("A training step of the demo CNN, batch " + std::to_string(batch) +
                         " (Trainer, SGD momentum, channels_last): " + configuration.name,
                     steps, bench::interleaved_samples(steps, options));
  return 0;
}

// Runs this program again under `configuration`'s environment; its Markdown goes to stdout.
int run_child(const char* self, const Configuration& configuration, std::size_t index,
              bool smoke) {
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    bool replaced = false;
    for (const auto& [name, value] : configuration.env) {
      replaced = replaced || entry.substr(0, name.size() + 1) == name + "=";
    }
    if (!replaced) env.emplace_back(entry);
  }
  for (const auto& [name, value] : configuration.env) env.push_back(name + "=" + value);
  std::vector<std::string> args = {self, "--configuration", std::to_string(index)};
  if (smoke) args.emplace_back("--smoke");
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::fflush(stdout);
  pid_t pid = 0;
  if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), envp.data()) != 0) {
    std::cerr << "bench_cpu_bf16: cannot start a child process\n";
    return 1;
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::cerr << "bench_cpu_bf16: the child for '" << configuration.name << "' failed\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // --configuration N (internal: this process is the child measuring configuration N).
  long configuration = -1;
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--configuration" && i + 1 < argc) {
      configuration = std::strtol(argv[++i], nullptr, 10);
    } else {
      rest.push_back(argv[i]);
    }
  }
  const auto options = bench::parse_options(static_cast<int>(rest.size()), rest.data());

  const std::vector<Configuration> configurations = {
      {"this CPU", {}},
      {"AVX-512 without bf16 (oneDNN converts)", {{"ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI"}}},
      {"AVX2 only (ATen's own loops)",
       {{"ONEDNN_MAX_CPU_ISA", "AVX2"}, {"ATEN_CPU_CAPABILITY", "avx2"}}}};
  if (configuration >= 0) {  // a child: its configuration, under the environment it names
    if (static_cast<std::size_t>(configuration) >= configurations.size()) return 2;
    return measure(configurations[static_cast<std::size_t>(configuration)], options);
  }
  // A cap passes this CPU off as an older one only where it has what the cap takes away, and no
  // cap is set already. LibTorch 1.13 sends bf16 products to oneDNN by the CPU's flags, and a
  // capped oneDNN refuses them ("could not create a primitive descriptor"): no emulation there.
  const auto& cpu = mixprec::cpu_capabilities();
  const bool can_emulate = MIXPREC_TORCH_AT_LEAST(2, 0) && cpu.onednn_max_isa.empty() &&
                           cpu.bf16_kernels == mixprec::Bf16Kernels::native;
  const std::size_t runs = can_emulate ? configurations.size() : 1;

  std::printf("## bench_cpu_bf16: bf16 on this CPU, and on CPUs without bf16 hardware\n\nLibTorch %s, intra-op threads: %d. "
              "Each configuration runs in a child process with the environment it names: LibTorch "
              "reads the caps once, at its first product. %s\n",
              TORCH_VERSION, torch::get_num_threads(), bench::method(options).c_str());
  if (!can_emulate) {
    std::printf("\nThis CPU, or this LibTorch, cannot pass for the others (%s): this CPU "
                "only.\n",
                MIXPREC_TORCH_AT_LEAST(2, 0) ? "no native bf16, or a cap is set already"
                                              : "LibTorch 1.13's bf16 products fail under a cap");
  }
  for (std::size_t i = 0; i < runs; ++i) {
    if (run_child(argv[0], configurations[i], i, options.smoke) != 0) return 1;
  }
  std::printf("\nCommand: `./build/default/benchmarks/bench_cpu_bf16` (a child process per "
              "configuration)\n");
  return 0;
}

}  // namespace bench_cpu_bf16
