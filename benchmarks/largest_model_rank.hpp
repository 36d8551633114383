#pragma once
// One rank of bench_largest_model (this binary with --rank): the sizes and configurations both
// sides share, and the run of one rank, phase by phase, each phase's peak RSS measured on its
// own (VmHWM reset at its start) and every phase watched against the budget:
//
//   run:   build (the model and the Trainer), steps, save, load (the same world size), teardown
//   load:  build, load (a checkpoint saved at another world size), teardown
//   steps: build, steps, teardown (the losses' runs)
//
// The ZeRO-3 rows build their units piece by piece (mixprec::ShardedBuild): no rank holds the
// model whole. The checkpoint is Trainer::save / load (save_checkpoint, load_checkpoint below):
// a sharded run's is a directory, each rank streaming its own pieces into its shard and reading
// back only the ranges it holds (at another world size too); an unsharded run's is one file.
#include "harness.hpp"
#include "tensor_memory.hpp"

#include "encoder/bert.hpp"

#include <mixprec/mixprec.hpp>
#include <mixprec/distributed/process_group.hpp>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace largest {

namespace mp = mixprec;

constexpr const char* kLayers = "bert.encoder.layer.*";
constexpr double kMiB = 1024.0 * 1024.0;

// ---- Sizes

struct Sizes {
  encoder::BertConfig bert;
  std::int64_t batch = 4;     // sequences per rank
  std::int64_t tokens = 128;  // per sequence
  std::int64_t classes = 8;
  int world = 4;
  int reshard_world = 3;      // where the checkpoint is loaded again (0: not)
  // 4 ranks x 3 GiB: the machine (24 GiB) is shared; every phase of a run within it.
  double budget_mib = 3072;
  int steps = 3;              // per search run: the first allocates AdamW's state
  int loss_steps = 3;         // per loss run
  int loss_layers = 2;
};

inline Sizes sizes_for(bool smoke) {
  Sizes s;
  s.bert.hidden_size = 768;
  s.bert.num_attention_heads = 12;
  s.bert.intermediate_size = 3072;
  s.bert.vocab_size = 30522;
  s.bert.max_position_embeddings = 512;
  if (smoke) {
    s.bert.hidden_size = 256;
    s.bert.num_attention_heads = 4;
    s.bert.intermediate_size = 1024;
    s.bert.vocab_size = 1000;
    s.bert.max_position_embeddings = 64;
    s.tokens = 32;
    s.world = 2;
    s.reshard_world = 1;
    s.budget_mib = 384;
    s.loss_layers = 1;
    s.loss_steps = 2;
    s.steps = 3;
  }
  return s;
}

// Parameters of one encoder layer, and of the rest (embeddings, pooler, head).
inline std::int64_t layer_parameters(const encoder::BertConfig& c) {
  const auto h = c.hidden_size, i = c.intermediate_size;
  return 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h;
}
inline std::int64_t other_parameters(const encoder::BertConfig& c, std::int64_t classes) {
  const auto h = c.hidden_size;
  return (c.vocab_size + c.max_position_embeddings + c.type_vocab_size) * h + 2 * h  // embeddings
         + (h * h + h)                                                                // pooler
         + (h * classes + classes);                                                   // head
}

enum class Kind { o2, lean, python };

inline const char* kind_key(Kind k) {
  return k == Kind::o2 ? "o2" : k == Kind::lean ? "lean" : "python";
}

// What a rank runs (the phases at the top of this header).
enum class Mode { run, load, steps };

inline const char* mode_key(Mode m) {
  return m == Mode::run ? "run" : m == Mode::load ? "load" : "steps";
}

// ---- A rank

// Ends the process (status 3) once its RSS passes the budget, writing "over PHASE RSS" to
// `path`; stops watching when it goes (the rank is done).
class Watchdog {
 public:
  Watchdog(std::string path, double cap_mib)
      : path_(std::move(path)), cap_(cap_mib), thread_([this] { watch(); }) {}
  ~Watchdog() { stop(); }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  void phase(const char* name) { phase_ = name; }
  void stop() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  void watch() {
    while (!done_) {
      const double rss = bench::memory_status().rss;
      if (rss > cap_) {
        std::ofstream(path_) << "over " << phase_.load() << " " << bench::fixed(rss, 1) << "\n";
        std::_Exit(3);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  std::string path_;
  double cap_;
  std::atomic<const char*> phase_{"build"};
  std::atomic<bool> done_{false};
  std::thread thread_;  // last: it starts once the others are set
};

// Each phase's peak RSS (MiB): VmHWM reset when it starts, read when the next one starts.
class Phases {
 public:
  explicit Phases(Watchdog& watchdog) : watchdog_(watchdog) {}
  void start(const char* name) {
    finish();
    current_ = name;
    watchdog_.phase(name);
    bench::reset_peak_rss();
  }
  void finish() {
    if (current_ != nullptr) peaks_.emplace_back(current_, bench::memory_status().peak);
    current_ = nullptr;
  }
  const std::vector<std::pair<std::string, double>>& peaks() const noexcept { return peaks_; }

 private:
  Watchdog& watchdog_;
  const char* current_ = nullptr;
  std::vector<std::pair<std::string, double>> peaks_;
};

struct RankArgs {
  int rank = 0;
  int world = 1;
  std::string dir;
  Kind kind = Kind::o2;
  bool checkpoint = false;
  bool zero3 = false;
  std::int64_t layers = 1;
  int steps = 2;
  double budget = 0;
  bool smoke = false;
  Mode mode = Mode::run;
  std::string checkpoint_path;  // the run's save and load; the load mode's checkpoint
};

// MIXPREC_BENCH_TRACE=1: rank 0 prints its live tensor bytes (the CPU allocator's reports,
// tensor_memory.hpp) after construction, after each forward, when the embeddings' gradient
// arrives (the end of the backward pass) and at each step's end, with the step's peak: where a
// step's memory goes.
class Trace {
 public:
  explicit Trace(bool on) {
    if (on) watch_.emplace();
  }
  void print(const std::string& where) {
    if (!watch_) return;
    const auto& bytes = watch_->bytes();
    std::fprintf(stderr, "trace: %-28s live %8.1f MiB, peak %8.1f MiB, RSS %8.1f MiB\n",
                 where.c_str(), static_cast<double>(bytes.live()) / kMiB,
                 static_cast<double>(bytes.peak()) / kMiB, bench::memory_status().rss);
  }
  void reset_peak() {
    if (watch_) watch_->bytes().reset_peak();
  }
  bool on() const { return watch_.has_value(); }

 private:
  std::optional<bench::TensorMemoryWatch> watch_;
};

// The checkpoint's two phases: Trainer::save / load, a directory of per-rank shards where the
// run is sharded (no rank gathers a whole tensor), one file (rank 0 writes it) where it is not.
template <class P>
void save_checkpoint(mp::Trainer<P>& trainer, const std::string& path) {
  trainer.save(path);
}
template <class P>
void load_checkpoint(mp::Trainer<P>& trainer, const std::string& path) {
  trainer.load(path);
}

template <class P>
int train_rank(const RankArgs& a, Watchdog& watchdog, const std::string& out_path) {
  const auto sizes = sizes_for(a.smoke);
  Trace trace(a.rank == 0 && std::getenv("MIXPREC_BENCH_TRACE") != nullptr);
  auto store = c10::make_intrusive<c10d::FileStore>(a.dir + "/store", a.world);
  auto group = mp::gloo_group(store, a.rank, a.world, std::chrono::minutes(30));
  const double base = bench::memory_status().rss;  // the libraries, Gloo's buffers
  Phases phases(watchdog);
  phases.start("build");
  auto config = sizes.bert;
  config.num_hidden_layers = a.layers;
  torch::manual_seed(1);  // the same weights on every rank, in every configuration, at any size
  encoder::Classifier model = nullptr;
  if (a.zero3) {
    // Each layer built, cut into this rank's pieces and freed before the next (PureHalf's in
    // bf16, the cast its model takes first): a rank never holds the model whole.
    std::optional<c10::ScalarType> dtype;
    if constexpr (mp::detail::takes_low_model<P>) dtype = P::low_dtype;
    mp::ShardedBuild build(group, dtype);
    model = encoder::Classifier(config, sizes.classes);
  } else {
    model = encoder::Classifier(config, sizes.classes);
  }
  trace.print("after the model");
  // PureHalf takes the model in bf16, as Python's pure-bf16 runs hand it over (model.to(
  // torch.bfloat16) before the optimizer): the state its cast would make. cast_floating, not
  // LibTorch's to(dtype), which casts the position ids too; the held layers cast their pieces.
  if constexpr (mp::detail::takes_low_model<P>) mp::cast_floating(*model, P::low_dtype);
  std::int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  if (a.checkpoint) mp::apply_checkpointing(model, {kLayers});
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
  mp::DistributedOptions distributed(group);
  if (a.zero3) distributed.shard_parameters({kLayers});
  auto options = mp::TrainerOptions().max_grad_norm(1.0).distributed(distributed);
  if constexpr (mp::detail::takes_fused_optimizer<P>) {
    options.fused_optimizer(mp::fused_adam_available || mp::detail::lean_pass_storage<P>);
  }
  std::unique_ptr<mp::Trainer<P>> trainer;
  try {
    trainer = std::make_unique<mp::Trainer<P>>(model, optimizer, options);
  } catch (const mp::Error& e) {
    std::string message = e.what();
    std::replace(message.begin(), message.end(), '\n', ' ');
    std::ofstream(out_path) << "error " << message << "\n";
    return 0;
  }
  const double rest = bench::memory_status().rss;
  trace.print("after construction");

  std::vector<double> ms, losses;
  if (a.mode != Mode::load) {
    phases.start("steps");
    auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(7 + a.rank));
    const auto ids = torch::randint(1000 % config.vocab_size, config.vocab_size,
                                    {sizes.batch, sizes.tokens}, gen, torch::kLong);
    const auto mask = torch::ones({sizes.batch, sizes.tokens}, torch::kLong);
    const auto labels = torch::randint(0, sizes.classes, {sizes.batch}, gen, torch::kLong);
    torch::manual_seed(100 + a.rank);  // dropout
    for (int k = 0; k < a.steps; ++k) {
      group->barrier()->wait();
      trace.reset_peak();
      const auto start = bench::Clock::now();
      const auto report = trainer->step([&] {
        const auto logits = model->template forward<P>(ids, mask).to(torch::kFloat);
        trace.print("step " + std::to_string(k + 1) + ", after forward");
        if (trace.on()) {
          // A tensor hook fires when the gradient is computed, before it is accumulated.
          logits.register_hook([&trace, k](const at::Tensor& g) {
            trace.print("step " + std::to_string(k + 1) + ", backward starts");
            return g;
          });
          model->bert->embeddings->word_embeddings->weight.register_hook(
              [&trace, k, fired = std::make_shared<bool>(false)](const at::Tensor& g) {
                if (!*fired) trace.print("step " + std::to_string(k + 1) + ", backward ends");
                *fired = true;
                return g;
              });
        }
        return torch::nn::functional::cross_entropy(logits, labels);
      });
      losses.push_back(report.loss.template item<double>());
      ms.push_back(bench::ms_since(start));
      trace.print("step " + std::to_string(k + 1) + ", end");
    }
  }
  const auto state = trainer->state_bytes();
  if (a.mode == Mode::run) {
    phases.start("save");
    save_checkpoint(*trainer, a.checkpoint_path);
    trace.print("after save");
  }
  if (a.mode != Mode::steps) {
    phases.start("load");
    load_checkpoint(*trainer, a.checkpoint_path);
    trace.print("after load");
  }
  // The Trainer goes; a ZeRO-3 model's layers stay held in this rank's pieces.
  phases.start("teardown");
  trainer.reset();
  trace.print("after teardown");
  phases.finish();
  watchdog.stop();
  std::ofstream out(out_path);
  out << "ok params " << parameters << " base " << bench::fixed(base, 1) << " rest "
      << bench::fixed(rest, 1) << " state " << state.total() << " ms "
      << bench::fixed(ms.empty() ? 0.0 : ms.back(), 1);
  for (const auto& [name, peak] : phases.peaks()) out << " " << name << " " << bench::fixed(peak, 1);
  out << " losses";
  for (const auto l : losses) {
    char text[32];
    std::snprintf(text, sizeof text, " %.9g", l);
    out << text;
  }
  out << "\n";
  return 0;
}

inline int rank_main(const RankArgs& a) {
  at::set_num_threads(1);
  const auto out_path = a.dir + "/rank" + std::to_string(a.rank) + ".txt";
  Watchdog watchdog(out_path, a.budget);
  if (a.kind == Kind::lean) {
    return train_rank<mp::PureHalf<at::BFloat16, mp::StochasticRounding<>>>(a, watchdog, out_path);
  }
  return train_rank<mp::MixedO2<at::BFloat16>>(a, watchdog, out_path);
}

// "--rank RANK WORLD DIR KIND CHECKPOINT ZERO3 LAYERS STEPS BUDGET smoke|full MODE PATH"
inline std::optional<RankArgs> parse_rank_args(int argc, char** argv) {
  if (argc != 14) return std::nullopt;
  RankArgs a;
  a.rank = std::stoi(argv[2]);
  a.world = std::stoi(argv[3]);
  a.dir = argv[4];
  a.kind = std::string(argv[5]) == "lean" ? Kind::lean : Kind::o2;
  a.checkpoint = std::string(argv[6]) == "1";
  a.zero3 = std::string(argv[7]) == "1";
  a.layers = std::stoll(argv[8]);
  a.steps = std::stoi(argv[9]);
  a.budget = std::stod(argv[10]);
  a.smoke = std::string(argv[11]) == "smoke";
  const std::string mode = argv[12];
  a.mode = mode == "load" ? Mode::load : mode == "steps" ? Mode::steps : Mode::run;
  a.checkpoint_path = argv[13];
  return a;
}

}  // namespace largest
