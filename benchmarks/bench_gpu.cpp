// One training step of a GPT-style block (pre-norm causal self-attention and MLP, AdamW) under
// every policy, against Python's recipes on the same block, weights and data (issue 43): step
// time, tokens/s and peak memory per row, and the ratio mixprec/Python where Python has the
// recipe (torch.autocast + GradScaler, torchao's Float8Linear). Device-agnostic: on CUDA the
// issue's sizes (d 1024 at seq 2048, then d 4096 at seq 1024) with the batch sized from the
// free device memory; on the CPU a small (ctest) or medium size.
//
//   ./build/default/benchmarks/bench_gpu                  CUDA where available, else medium
//   ./build/default/benchmarks/bench_gpu --size medium    the CPU benchmark of docs/benchmarks.md
//   ./build/default/benchmarks/bench_gpu --smoke          = --size small (ctest, a few seconds)
//
// Each row is printed and flushed as soon as it is measured, so a run cut by a deadline
// (scripts/gpu-check --quick) keeps the rows done. Rows run one after another, C++ then Python
// (not interleaved): figures taken on a loaded machine are provisional.
//
// Peak memory: on CUDA the caching allocator's peak of allocated bytes during the row (reset
// before it; the row's model, optimizer state and activations, the shared batch excluded); on
// the CPU the peak of live tensor bytes on this thread (tensor_memory.hpp), the same way. Python
// reports torch.cuda.max_memory_allocated on CUDA, nothing on the CPU.
//
// Weights and data are drawn from one seed by LibTorch's CPU generator on both sides
// (python/bench_gpu.py draws the same tensors in the same order) and checked by checksum.
// MIXPREC_PYTHON names the interpreter (default python3); without torch (or torchao for the fp8
// row) the Python columns say why they are empty.

#include <mixprec/mixprec.hpp>

#include "harness.hpp"
#include "python_child.hpp"
#include "tensor_memory.hpp"

#include <torch/torch.h>

#if __has_include(<c10/core/CachingDeviceAllocator.h>)
#include <c10/core/CachingDeviceAllocator.h>
#define MIXPREC_BENCH_DEVICE_ALLOCATOR 1  // LibTorch >= 2.8: allocator stats by device type
#else
#define MIXPREC_BENCH_DEVICE_ALLOCATOR 0
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace mp = mixprec;

namespace bench_gpu {

namespace {

constexpr std::uint64_t kSeed = 43;

struct Size {
  std::int64_t d = 64;
  std::int64_t heads = 4;
  std::int64_t seq = 32;
  std::int64_t batch = 2;
  int warmup = 1;
  int steps = 2;
};

// ---- The block: ln1, qkv, causal attention, proj, ln2, fc1, gelu, fc2 (python/bench_gpu.py).

struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t d, std::int64_t heads_)
      : heads(heads_),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        qkv(register_module("qkv", mp::nn::Float8Linear(d, 3 * d))),
        proj(register_module("proj", mp::nn::Float8Linear(d, d))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", mp::nn::Float8Linear(d, 4 * d))),
        fc2(register_module("fc2", mp::nn::Float8Linear(4 * d, d))) {}

  at::Tensor forward(const at::Tensor& x) {
    const auto b = x.size(0), s = x.size(1);
    const auto q_k_v = qkv(ln1(x)).view({b, s, 3, heads, -1}).permute({2, 0, 3, 1, 4}).unbind(0);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q_k_v[0].size(-1)));
    const auto future = at::ones({s, s}, x.options().dtype(at::kBool)).triu(1);
    const auto scores = at::matmul(q_k_v[0], q_k_v[1].transpose(-2, -1)) * scale;
    const auto weights = scores.masked_fill(future, -INFINITY).softmax(-1);
    auto h = x + proj(at::matmul(weights, q_k_v[2]).transpose(1, 2).reshape({b, s, -1}));
    return h + fc2(torch::gelu(fc1(ln2(h))));
  }

  std::int64_t heads;
  torch::nn::LayerNorm ln1;
  mp::nn::Float8Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  mp::nn::Float8Linear fc1, fc2;
};
TORCH_MODULE(Block);

// The block behind a Checkpointed wrapper, so that apply_checkpointing can name it ("block").
struct NetImpl : torch::nn::Module {
  NetImpl(std::int64_t d, std::int64_t heads)
      : block(register_module("block", mp::nn::Checkpointed<Block>(d, heads))) {}
  at::Tensor forward(const at::Tensor& x) { return block(x); }
  mp::nn::Checkpointed<Block> block;
};
TORCH_MODULE(Net);

/// The initial weights, drawn once: matrices N(0, 0.02), norm weights 1, biases 0.
std::vector<at::Tensor> initial_weights(const Size& size) {
  Net net(size.d, size.heads);
  torch::manual_seed(kSeed);
  std::vector<at::Tensor> out;
  for (const auto& item : net->named_parameters()) {
    const auto& p = item.value();
    const bool norm_weight = item.key().find("ln") != std::string::npos &&
                             item.key().find("weight") != std::string::npos;
    out.push_back(p.dim() == 2 ? torch::randn(p.sizes()) * 0.02
                               : (norm_weight ? torch::ones(p.sizes()) : torch::zeros(p.sizes())));
  }
  return out;
}

double checksum(const std::vector<at::Tensor>& tensors) {
  double total = 0.0;
  for (const auto& t : tensors) total += t.to(at::kDouble).sum().item<double>();
  return total;
}

// ---- Memory and synchronisation, by device.

struct Memory {
  explicit Memory(c10::Device device) : device_(device) {}
  void reset() {
#if MIXPREC_BENCH_DEVICE_ALLOCATOR
    if (device_.is_cuda()) {
      auto* a = c10::getDeviceAllocator(device_.type());
      a->emptyCache();
      a->resetPeakStats(device_.index());
      start_ = stat().current;
      return;
    }
#endif
    if (watch_) {
      watch_->bytes().reset_peak();
      start_ = watch_->bytes().live();
    }
  }
  /// MiB above what was allocated at reset(); -1 where nothing counts.
  double peak_mib() {
#if MIXPREC_BENCH_DEVICE_ALLOCATOR
    if (device_.is_cuda()) return static_cast<double>(stat().peak - start_) / (1 << 20);
#endif
    if (device_.is_cpu() && watch_) return static_cast<double>(watch_->bytes().peak() - start_) / (1 << 20);
    return -1.0;
  }
  /// Free bytes on the device (CUDA), 0 where unknown.
  std::size_t free_bytes() const {
#if MIXPREC_BENCH_DEVICE_ALLOCATOR
    if (device_.is_cuda()) return c10::getDeviceAllocator(device_.type())->getMemoryInfo(device_.index()).first;
#endif
    return 0;
  }
  void empty_cache() {
#if MIXPREC_BENCH_DEVICE_ALLOCATOR
    if (device_.is_cuda()) c10::getDeviceAllocator(device_.type())->emptyCache();
#endif
  }
  /// Counts CPU tensors from now on (before anything of the benchmark is allocated).
  void watch_cpu() {
    if (device_.is_cpu()) watch_.emplace();
  }

 private:
#if MIXPREC_BENCH_DEVICE_ALLOCATOR
  c10::CachingAllocator::Stat stat() const {
    const auto stats = c10::getDeviceAllocator(device_.type())->getDeviceStats(device_.index());
    return stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  }
#endif
  c10::Device device_;
  std::optional<bench::TensorMemoryWatch> watch_;
  std::int64_t start_ = 0;
};

// ---- A row: one policy's steps.

struct Measured {
  double ms = 0;
  double peak_mib = -1;
  std::string skipped;  // why a row with ms 0 did not run ("": LibTorch's missing fp16 matmul)
};

struct Row {
  std::string name;
  std::string python_mode;  // python/bench_gpu.py's mode for the same recipe, "" for none
  std::function<Measured()> run;
};

struct Setup {
  Size size;
  c10::Device device;
  const std::vector<at::Tensor>* weights;
  at::Tensor x, target;
  Memory* memory;
};

// A read of the model's first weight waits for every kernel queued before it.
void sync(Net& net) { (void)net->parameters().front().view(-1)[0].item<double>(); }

template <class P>
Measured run_policy(const Setup& s, bool checkpoint, bool tf32) {
  s.memory->reset();
  at::globalContext().setAllowTF32CuBLAS(tf32);
  Measured out;
  {
    Net net(s.size.d, s.size.heads);
    {
      torch::NoGradGuard no_grad;
      const auto params = net->parameters();
      for (std::size_t i = 0; i < params.size(); ++i) params[i].copy_((*s.weights)[i]);
    }
    net->to(s.device);
    if (checkpoint) mp::apply_checkpointing(net.ptr(), {"block"});
    torch::optim::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(1e-4));
    typename mp::Trainer<P>::Options options;
    if constexpr (mp::detail::takes_fused_optimizer<P>) {
      options.fused_optimizer(mp::fused_adam_available);
    }
    mp::Trainer<P> trainer(net.ptr(), adamw, options);
    std::vector<double> ms;
    for (int k = 0; k < s.size.warmup + s.size.steps; ++k) {
      const auto start = bench::Clock::now();
      trainer.step([&] {
        return torch::mse_loss(net->forward(trainer.cast_input(s.x)).to(at::kFloat), s.target);
      });
      sync(net);
      if (k >= s.size.warmup) ms.push_back(bench::ms_since(start));
    }
    out.ms = bench::median(ms);
    out.peak_mib = s.memory->peak_mib();
  }
  at::globalContext().setAllowTF32CuBLAS(false);
  return out;
}

template <class P>
Row row(std::string name, std::string python_mode, const Setup& s, bool checkpoint = false,
        bool tf32 = false) {
  // LibTorch < 2.4 has no fp16 matmul on the CPU (compat.hpp): such a row is skipped, said so.
  // Not const: where P is not fp16 it is a constant, which Clang warns needs no capture.
  bool skip = P::low_dtype == at::kHalf && s.device.is_cpu() && !mp::cpu_half_math;
  return {std::move(name), std::move(python_mode), [&s, checkpoint, tf32, skip]() -> Measured {
            if (skip) return {};
            return run_policy<P>(s, checkpoint, tf32);
          }};
}

// A block-scaled recipe's row (fp8/block_recipes.hpp), skipped where the block does not tile the
// layers' features (d, 3d, 4d) or a step's tokens: the GEMMs run through _scaled_mm_v2 with block
// scales where the GPU takes them (MXFP8 and NVFP4: sm_100; blockwise fp8: sm_90), emulated
// otherwise (docs/fp8.md).
template <class P>
Row block_row(std::string name, const Setup& s) {
  constexpr auto block = P::recipe::block;
  const bool fits = s.size.d % block == 0 && (s.size.batch * s.size.seq) % block == 0;
  return {std::move(name), "", [&s, fits]() -> Measured {
            if (!fits) {
              Measured m;
              m.skipped = "d or the tokens of a step not a multiple of the block, " + std::to_string(block);
              return m;
            }
            return run_policy<P>(s, false, false);
          }};
}

// (A template on the recipes only so that MixedFP8 is not compiled under LibTorch 1.13.)
template <class Tensorwise, class Delayed, class Rowwise, class MxFloor = mp::MXFP8Scaling<>,
          class MxRceil = mp::MXFP8Scaling<mp::MxScale::rceil>, class Blockwise = mp::BlockwiseFP8Scaling,
          class Nvfp4 = mp::NVFP4>
void add_fp8_rows(std::vector<Row>& rows, const Setup& s) {
  if constexpr (mp::has_fp8) {
    rows.push_back(row<mp::MixedFP8<Tensorwise>>("MixedFP8 tensorwise", "fp8", s));
    rows.push_back(row<mp::MixedFP8<Delayed>>("MixedFP8 delayed", "", s));
    rows.push_back(row<mp::MixedFP8<Rowwise>>("MixedFP8 rowwise", "fp8_rowwise", s));
    rows.push_back(block_row<mp::MixedFP8<MxFloor>>("MixedFP8 MXFP8 (FLOOR)", s));
    rows.push_back(block_row<mp::MixedFP8<MxRceil>>("MixedFP8 MXFP8 (RCEIL)", s));
    rows.push_back(block_row<mp::MixedFP8<Blockwise>>("MixedFP8 blockwise 1x128/128x128", s));
    rows.push_back(block_row<mp::MixedFP8<Nvfp4>>("MixedFP8 NVFP4", s));
  }
}

std::vector<Row> rows_for(const Setup& s) {
  using Bf16 = at::BFloat16;
  std::vector<Row> rows;
  rows.push_back(row<mp::FullPrecision>("FullPrecision (TF32 off)", "fp32", s));
  if (s.device.is_cuda()) {
    rows.push_back(row<mp::FullPrecision>("FullPrecision (TF32 on)", "tf32", s, false, true));
  }
  rows.push_back(row<mp::MixedO1<Bf16>>("MixedO1<BFloat16>", "bf16", s));
  rows.push_back(row<mp::MixedO1<at::Half>>("MixedO1<Half>", "fp16", s));
  rows.push_back(row<mp::MixedO2<Bf16>>("MixedO2<BFloat16>", "", s));
  rows.push_back(row<mp::MixedO2<at::Half>>("MixedO2<Half>", "", s));
  rows.push_back(row<mp::PureHalf<Bf16>>("PureHalf<BFloat16>", "", s));
  add_fp8_rows<mp::TensorwiseScaling, mp::DelayedScaling<>, mp::RowwiseScaling>(rows, s);
  rows.push_back(row<mp::MixedO2<Bf16>>("MixedO2<BFloat16> + checkpointing", "", s, true));
  rows.push_back(row<mp::MixedO2<Bf16, mp::RemainderMasters<Bf16>>>(
      "MixedO2<BFloat16, RemainderMasters<BFloat16>>", "", s));
  rows.push_back(row<mp::PureHalf<Bf16, mp::StochasticRounding<>>>(
      "PureHalf<BFloat16, StochasticRounding<>>", "", s));
  return rows;
}

// ---- Python's side.

std::string python() {
  const char* env = std::getenv("MIXPREC_PYTHON");
  return env != nullptr && *env != '\0' ? env : "python3";
}

std::string mib(double value) { return value < 0 ? "-" : bench::fixed(value, 1); }

// Batch from the free device memory: FullPrecision's state (16 bytes per parameter: weight,
// gradient, two moments) and per-sample activations (about 20 fp32 values per token and
// feature, 3 fp32 attention maps per head), within half of what is free (Python runs beside).
std::int64_t batch_for(const Size& size, std::size_t free_bytes) {
  const double params = 12.0 * static_cast<double>(size.d * size.d);
  const double per_sample = 4.0 * (20.0 * static_cast<double>(size.seq * size.d) +
                                   3.0 * static_cast<double>(size.heads * size.seq * size.seq));
  const double budget = 0.5 * static_cast<double>(free_bytes) - 16.0 * params;
  const auto fits = static_cast<std::int64_t>(budget / per_sample);
  const std::int64_t most = 32768 / size.seq;  // at most 32k tokens a step: a few seconds a row
  return std::clamp<std::int64_t>(fits, 1, most);
}

/// Runs every row at `size`; returns the number of rows that failed or gave a figure that is not
/// finite and positive (a skipped row, ms 0, counts as neither).
int run_size(Size size, c10::Device device, Memory& memory) {
  int bad = 0;
  if (device.is_cuda()) size.batch = batch_for(size, memory.free_bytes());
  const auto weights = initial_weights(size);
  torch::manual_seed(kSeed + 1);
  const auto x = torch::randn({size.batch, size.seq, size.d});
  const auto target = torch::randn({size.batch, size.seq, size.d});
  const Setup setup{size, device, &weights, x.to(device), target.to(device), &memory};
  const double tokens = static_cast<double>(size.batch * size.seq);
  std::printf("\n### d %lld, %lld heads, seq %lld, batch %lld (%s)\n\n",
              static_cast<long long>(size.d), static_cast<long long>(size.heads),
              static_cast<long long>(size.seq), static_cast<long long>(size.batch),
              device.str().c_str());
  std::fflush(stdout);

  std::optional<bench::PythonChild> py;
  std::string python_note;
  std::vector<std::string> args{device.is_cuda() ? "cuda" : "cpu"};
  for (const auto v : {size.d, size.heads, size.seq, size.batch}) args.push_back(std::to_string(v));
  for (const auto v : {size.warmup, size.steps}) args.push_back(std::to_string(v));
  args.push_back(std::to_string(kSeed));
  args.push_back(std::to_string(at::get_num_threads()));
  try {
    memory.empty_cache();
    py.emplace(python(), MIXPREC_BENCH_GPU_SCRIPT, args);
    // "ready TORCH_VERSION WEIGHTS_CHECKSUM DATA_CHECKSUM"
    std::istringstream ready(py->ready());
    std::string word, version;
    double w = 0, d = 0;
    ready >> word >> version >> w >> d;
    const double mine_w = checksum(weights), mine_d = checksum({x, target});
    python_note = "Python: torch " + version + "; same weights and data: " +
                  (w == mine_w && d == mine_d ? "yes" : "NO") + " (checksums " +
                  bench::fixed(mine_w, 6) + ", " + bench::fixed(mine_d, 3) + ").";
  } catch (const std::exception& e) {
    python_note = std::string("Python side not run: ") + e.what();
    py.reset();
  }
  std::printf("%s\n\n| policy | step ms | tokens/s | peak MiB | ratio to FullPrecision | "
              "Python recipe | Python ms | Python peak MiB | ratio mixprec/Python |\n"
              "|---|---:|---:|---:|---:|---|---:|---:|---:|\n",
              python_note.c_str());
  std::fflush(stdout);

  double baseline_ms = 0;
  for (const auto& r : rows_for(setup)) {
    Measured m;
    std::string failure;
    try {
      m = r.run();
    } catch (const std::exception& e) {
      failure = e.what();
      failure = failure.substr(0, failure.find('\n')).substr(0, 120);
      memory.empty_cache();
    }
    std::string cells;
    const bool skipped = failure.empty() && m.ms == 0;
    const bool memory_counted = device.is_cpu() || MIXPREC_BENCH_DEVICE_ALLOCATOR == 1;
    if (!failure.empty() || (!skipped && !(std::isfinite(m.ms) && m.ms > 0 &&
                                           (!memory_counted || m.peak_mib > 0)))) {
      ++bad;
    }
    if (skipped) {
      cells = (m.skipped.empty() ? "skipped: LibTorch " + std::string(mp::torch_version) +
                                       " has no fp16 matmul on the CPU"
                                 : "skipped: " + m.skipped) + " | - | - | -";
    } else if (failure.empty()) {
      if (baseline_ms == 0) baseline_ms = m.ms;
      cells = bench::fixed(m.ms, 2) + " | " + bench::fixed(tokens / m.ms * 1000.0, 0) + " | " +
              mib(m.peak_mib) + " | " + bench::fixed(baseline_ms / m.ms, 2);
    } else {
      cells = "failed: " + failure + " | - | - | -";
    }
    std::string py_cells = "- | - | - | -";
    if (!r.python_mode.empty() && py) {
      memory.empty_cache();
      try {
        // "ms MEDIAN peak MIB" or "skip REASON"
        std::istringstream reply(py->request("run " + r.python_mode));
        std::string word;
        reply >> word;
        if (word == "ms") {
          double py_ms = 0, py_peak = -1;
          reply >> py_ms >> word >> py_peak;
          py_cells = r.python_mode + " | " + bench::fixed(py_ms, 2) + " | " + mib(py_peak) + " | " +
                     (failure.empty() ? bench::fixed(m.ms / py_ms, 3) : "-");
        } else {
          std::string why;
          std::getline(reply, why);
          py_cells = r.python_mode + ":" + why + " | - | - | -";
        }
      } catch (const std::exception& e) {
        py_cells = r.python_mode + ": " + std::string(e.what()).substr(0, 120) + " | - | - | -";
        py.reset();
      }
    }
    std::printf("| %s | %s | %s |\n", r.name.c_str(), cells.c_str(), py_cells.c_str());
    std::fflush(stdout);
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  std::string size_name;
  bool usage = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--smoke") {
      size_name = "small";
    } else if (arg == "--size" && i + 1 < argc) {
      size_name = argv[++i];
    } else {
      usage = true;
    }
  }
  const bool cuda = torch::cuda::is_available();
  if (size_name.empty()) size_name = cuda ? "device" : "medium";
  if (usage || (size_name != "small" && size_name != "medium" && size_name != "device")) {
    std::cerr << "usage: " << argv[0] << " [--size small|medium|device] [--smoke]\n"
              << "  device (the default with CUDA): the issue's sizes on the GPU\n";
    return 2;
  }
  const c10::Device device = size_name == "device" && cuda ? c10::Device(c10::kCUDA, 0)
                                                           : c10::Device(c10::kCPU);
  Memory memory(device);
  memory.watch_cpu();  // installed before any tensor of the run
  std::printf("\n## One training step of a GPT-style block (bench_gpu)\n\n"
              "Pre-norm causal self-attention and MLP (d -> 4d -> d), AdamW (fused where the "
              "policy takes it), MSE loss. Median of the timed steps after warm-up; peak memory "
              "above the shared batch (%s). LibTorch %s, %d thread(s).\n",
              device.is_cuda() ? "the caching allocator's peak allocated bytes"
                               : "live CPU tensor bytes on this thread, tensor_memory.hpp",
              std::string(mp::torch_version).c_str(), at::get_num_threads());
  std::fflush(stdout);
  std::vector<Size> sizes;
  if (size_name == "small") sizes = {{64, 4, 32, 2, 1, 2}};
  if (size_name == "medium" || (size_name == "device" && !cuda)) sizes = {{512, 8, 256, 4, 1, 3}};
  if (device.is_cuda()) sizes = {{1024, 16, 2048, 0, 3, 10}, {4096, 32, 1024, 0, 3, 10}};
  int bad = 0;
  for (const auto& s : sizes) bad += run_size(s, device, memory);
  std::printf("\nRerun: `./scripts/bench bench_gpu` (CPU), `./scripts/gpu-check --quick` (GPU)\n");
  if (bad > 0) {
    std::fprintf(stderr, "bench_gpu: %d row(s) failed or gave a figure that is not finite and positive\n", bad);
    return 1;
  }
  return 0;
}

}  // namespace bench_gpu
