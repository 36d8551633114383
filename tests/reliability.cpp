// mixprec_reliability: the fault programs of docs/reliability.md, one binary (a TU that includes
// LibTorch costs ~25 s to compile).
//
//   mixprec_reliability soak [--steps N] [--seed S] [--rate R] [--growth-interval G]
//                            [--max-grad-norm X] [--smoke]
//     Trains every policy for N optimizer steps with inf/NaN injected at random seeded steps into
//     gradients, the loss and the inputs, beside a reference run that never attempts those steps.
//   mixprec_reliability kill-resume [--steps N] [--every K] [--kills K] [--seed S] [--dir D]
//                                   [--smoke]
//     A child trains and saves every K steps; this parent SIGKILLs it at random moments (inside
//     save() among them) and restarts it from its last checkpoint until the run ends, then
//     compares the result with an uninterrupted run.
//   mixprec_reliability train --dir D --steps N --every K   (the child of kill-resume)
//
// Each prints a Markdown table and exits 0 only if nothing was corrupted.
#include <mixprec/mixprec.hpp>

#include "scaled_policy.hpp"
#include "support.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

// The precompiled header it shares with mixprec_tests declares doctest's registry: this program
// has no tests, but must define it.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <poll.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

namespace mp = mixprec;
namespace fs = std::filesystem;

namespace {

using test::ScaledO2;

// --name value pairs and --flags.
struct Args {
  std::map<std::string, std::string> values;
  Args(int argc, char** argv, int first) {
    for (int i = first; i < argc; ++i) {
      std::string key = argv[i];
      if (key.rfind("--", 0) != 0) throw std::runtime_error("unexpected argument " + key);
      key = key.substr(2);
      if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
        values[key] = argv[++i];
      } else {
        values[key] = "";
      }
    }
  }
  bool has(const std::string& key) const { return values.count(key) > 0; }
  std::int64_t integer(const std::string& key, std::int64_t fallback) const {
    return has(key) ? std::stoll(values.at(key)) : fallback;
  }
  double number(const std::string& key, double fallback) const {
    return has(key) ? std::stod(values.at(key)) : fallback;
  }
  std::string text(const std::string& key, const std::string& fallback) const {
    return has(key) ? values.at(key) : fallback;
  }
};

// Adam's state in the optimizer's parameter order, comparable across two optimizers; the state
// key type differs between LibTorch versions (std::string in 1.13, void* later).
template <class Optimizer>
std::vector<at::Tensor> adam_state(Optimizer& optimizer) {
  using Key = typename std::decay_t<decltype(optimizer.state())>::key_type;
  std::vector<at::Tensor> out;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      Key key;
      if constexpr (std::is_same_v<Key, std::string>) {
        std::ostringstream name;
        name << p.unsafeGetTensorImpl();
        key = name.str();
      } else {
        key = p.unsafeGetTensorImpl();
      }
      const auto it = optimizer.state().find(key);
      if (it == optimizer.state().end()) {
        out.push_back(torch::tensor({std::int64_t{-1}}));  // no state yet
        continue;
      }
      const auto& state = static_cast<const torch::optim::AdamParamState&>(*it->second);
      out.push_back(state.exp_avg().clone());
      out.push_back(state.exp_avg_sq().clone());
      out.push_back(torch::tensor({static_cast<std::int64_t>(state.step())}));
    }
  }
  return out;
}

// A scaler's state dict as text, for bitwise comparisons (doubles printed exactly).
std::string scaler_text(const c10::impl::GenericDict& dict) {
  std::map<std::string, std::string> sorted;
  for (const auto& item : dict) {
    std::ostringstream value;
    const auto& v = item.value();
    if (v.isDouble()) {
      value << std::hexfloat << v.toDouble();
    } else if (v.isInt()) {
      value << v.toInt();
    } else {
      value << v.tagKind();
    }
    sorted[item.key().toStringRef()] = value.str();
  }
  std::string text;
  for (const auto& [key, value] : sorted) text += key + "=" + value + " ";
  return text;
}

std::int64_t rss_kib() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<std::int64_t>(::sysconf(_SC_PAGESIZE)) / 1024;
}

// ---------------------------------------------------------------------------------------------
// Soak

// A model without hidden state: its forward draws no random numbers and updates no buffer (a
// constant buffer it reads is checked all the same), so that a run is a function of its inputs.
struct SoakNet : torch::nn::Module {
  SoakNet() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
    offset = register_buffer("offset", torch::linspace(-0.5, 0.5, 8));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc2->forward(torch::tanh(fc1->forward(x - offset.to(x.scalar_type()))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  at::Tensor offset;
};

struct SoakBatch {
  at::Tensor x, y;
};

// Batch `step` of the run: a function of the seed and the step only.
SoakBatch soak_batch(std::uint64_t seed, std::int64_t step) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL +
                                                            static_cast<std::uint64_t>(step));
  auto x = at::randn({32, 8}, generator);
  auto y = at::tanh(x.slice(1, 0, 4) * 0.8 - x.slice(1, 4, 8) * 0.3);
  return {x, y};
}

enum class Target { grad, loss, input };

struct Injection {
  Target target;
  double value;       // +inf, -inf or NaN
  std::size_t index;  // which parameter (grad) or element
  bool multiply;      // loss: loss * value (inf gradients) or loss + value (finite gradients)
};

// The scale as DESIGN.md's algorithm (PyTorch's _amp_update_scale_) and the documented hysteresis
// say, written independently of the library's code.
struct ScaleModel {
  float scale;
  std::int64_t tracker = 0, hysteresis_tracker;
  double growth, backoff;
  std::int64_t interval, hysteresis;
  void update(bool found_inf) {
    if (found_inf) {
      tracker = 0;
      hysteresis_tracker -= 1;
      if (hysteresis_tracker <= 0) scale = static_cast<float>(static_cast<double>(scale) * backoff);
      return;
    }
    const auto next = tracker + 1;
    if (next == interval) {
      const auto grown = static_cast<float>(static_cast<double>(scale) * growth);
      if (std::isfinite(grown)) scale = grown;
      tracker = 0;
      hysteresis_tracker = hysteresis;
    } else {
      tracker = next;
    }
  }
};

struct SoakResult {
  std::string policy;
  std::int64_t steps = 0, injections = 0, by_target[3] = {0, 0, 0};
  std::int64_t skips = 0, natural_skips = 0;
  std::int64_t corruptions = 0;        // a skipped step that changed state, an injection stepped
  std::int64_t scale_mismatches = 0;   // the scale left the algorithm's trajectory
  bool equal_to_reference = false;
  std::int64_t rss_warm = 0, rss_end = 0;
  double final_scale = 1, max_scale = 1, last_loss = 0;
  std::vector<std::string> notes;
};

template <class P>
struct SoakRig {
  std::shared_ptr<SoakNet> net;
  torch::optim::Adam adam;
  mp::Trainer<P> trainer;
  SoakRig(std::uint64_t seed, const mp::TrainerOptions& options)
      : net((torch::manual_seed(seed), std::make_shared<SoakNet>())),
        // eps 1e-4: PureHalf<Half> keeps Adam's state in fp16, where 1e-8 is 0.
        adam(net->parameters(), torch::optim::AdamOptions(1e-3).eps(1e-4)),
        trainer(net, adam, options) {}

  mp::StepReport step(const SoakBatch& batch, const Injection* injection) {
    auto x = batch.x;
    at::Tensor grad_param;
    unsigned hook = 0;
    if (injection != nullptr && injection->target == Target::input) {
      x = x.clone();
      x.view(-1)[static_cast<std::int64_t>(injection->index % static_cast<std::size_t>(x.numel()))] =
          injection->value;
    }
    if (injection != nullptr && injection->target == Target::grad) {
      const auto params = net->parameters();
      grad_param = params[injection->index % params.size()];
      const auto element =
          static_cast<std::int64_t>((injection->index / params.size()) %
                                    static_cast<std::size_t>(grad_param.numel()));
      const double value = injection->value;
      hook = grad_param.register_hook([element, value](const at::Tensor& grad) {
        auto poisoned = grad.clone();
        poisoned.view(-1)[element] = value;
        return poisoned;
      });
    }
    auto report = trainer.step([&] {
      const auto out = net->forward(trainer.cast_input(x)).to(at::kFloat);
      auto loss = torch::mse_loss(out, batch.y);  // fp32: 1.13 has no CPU bf16 mse_loss
      if (injection != nullptr && injection->target == Target::loss) {
        loss = injection->multiply ? loss * injection->value : loss + injection->value;
      }
      return loss;
    });
    if (grad_param.defined()) grad_param.remove_hook(hook);
    return report;
  }

  // Everything a skipped step must leave bitwise as it was.
  std::vector<at::Tensor> state() {
    auto all = test::snapshot(net->parameters());
    for (auto& t : test::snapshot(trainer.master_weights())) all.push_back(t);
    for (auto& t : test::snapshot(net->buffers())) all.push_back(t);
    for (auto& t : adam_state(adam)) all.push_back(t);
    return all;
  }
};

template <class P>
SoakResult soak(const Args& args) {
  const auto steps = args.integer("steps", 10000);
  const auto seed = static_cast<std::uint64_t>(args.integer("seed", 1));
  const double rate = args.number("rate", 0.05);
  constexpr bool dynamic = std::is_same_v<typename P::scaler_type, mp::GradScaler>;
  auto options = mp::TrainerOptions();
  if (args.has("max-grad-norm")) options.max_grad_norm(args.number("max-grad-norm", 1.0));
  // A short growth interval: between injections the fp16 scale grows into real overflows and
  // backs off. (With 2000, 5 % of steps overflowing would drive the scale down to 0.)
  const auto scaler_options = mp::GradScalerOptions()
                                  .growth_interval(args.integer("growth-interval", 10))
                                  .hysteresis(std::is_same_v<P, ScaledO2> ? 2 : 1);
  if constexpr (dynamic) options.scaler(scaler_options);

  SoakResult result;
  result.policy = std::string(P::name);
  SoakRig<P> run(seed, options);
  SoakRig<P> reference(seed, options);  // never attempts the injected steps
  ScaleModel model{static_cast<float>(scaler_options.init_scale()), 0, scaler_options.hysteresis(),
                   scaler_options.growth_factor(), scaler_options.backoff_factor(),
                   scaler_options.growth_interval(), scaler_options.hysteresis()};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const double values[] = {std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity(),
                           std::numeric_limits<double>::quiet_NaN()};
  const auto warm_at = std::max<std::int64_t>(1, steps / 10);

  for (std::int64_t i = 0; i < steps; ++i) {
    if (i == warm_at) result.rss_warm = rss_kib();
    const auto batch = soak_batch(seed, i);
    std::optional<Injection> injection;
    if (uniform(rng) < rate) {
      injection = Injection{static_cast<Target>(rng() % 3), values[rng() % 3],
                            static_cast<std::size_t>(rng() % 100000), rng() % 2 == 0};
      ++result.injections;
      ++result.by_target[static_cast<int>(injection->target)];
    }
    const auto before = run.state();
    const auto report = run.step(batch, injection ? &*injection : nullptr);
    const bool skipped = report.status == mp::StepStatus::skipped;
    if (dynamic && report.scale != static_cast<double>(model.scale)) ++result.scale_mismatches;
    if (skipped) {
      ++result.skips;
      if (!injection) ++result.natural_skips;
      if (!test::identical(run.state(), before)) {
        ++result.corruptions;
        result.notes.push_back("step " + std::to_string(i) + ": a skipped step changed state");
      }
    } else if (injection) {
      ++result.corruptions;
      result.notes.push_back("step " + std::to_string(i) + ": an injected inf/NaN was applied");
    }
    if constexpr (dynamic) {
      model.update(skipped);
      const auto& scaler = run.trainer.scaler();
      if (scaler.get_scale() != static_cast<double>(model.scale) ||
          scaler.growth_tracker() != model.tracker ||
          scaler.hysteresis_tracker() != model.hysteresis_tracker) {
        ++result.scale_mismatches;
      }
    }
    if (!injection) {
      const auto ref = reference.step(batch, nullptr);
      if (ref.status != report.status) {
        result.notes.push_back("step " + std::to_string(i) + ": the reference " +
                               (ref.stepped() ? "stepped" : "skipped"));
      }
    } else if constexpr (dynamic) {
      // The reference does not attempt the step; its scaler is told of the overflow the
      // algorithm says it was (scale backed off, trackers as after a skip).
      auto state = reference.trainer.scaler().state_dict();
      state.insert_or_assign("scale", static_cast<double>(model.scale));
      state.insert_or_assign("_growth_tracker", model.tracker);
      state.insert_or_assign("_hysteresis_tracker", model.hysteresis_tracker);
      reference.trainer.scaler().load_state_dict(state);
    }
    const double loss = report.loss.template item<double>();
    if (!std::isfinite(loss) && !injection && !skipped) ++result.corruptions;
    if (!injection) result.last_loss = loss;
    result.max_scale = std::max(result.max_scale, report.scale);
  }
  result.steps = run.trainer.stats().steps;
  result.rss_end = rss_kib();
  result.final_scale = run.trainer.scaler().get_scale();
  const auto stats = run.trainer.stats();
  const auto ref_stats = reference.trainer.stats();
  if (stats.skipped_steps != result.skips) result.notes.push_back("stats().skipped_steps differs");
  for (const auto& p : run.net->parameters()) {
    if (!torch::isfinite(p).all().template item<bool>()) ++result.corruptions;
  }
  result.equal_to_reference =
      test::identical(run.state(), reference.state()) &&
      scaler_text(run.trainer.scaler().state_dict()) ==
          scaler_text(reference.trainer.scaler().state_dict()) &&
      stats.steps == ref_stats.steps + result.injections &&
      stats.skipped_steps == ref_stats.skipped_steps + result.injections;
  return result;
}

int run_soak(const Args& args) {
  Args sized = args;
  if (args.has("smoke") && !args.has("steps")) sized.values["steps"] = "400";
  if (args.has("smoke") && !args.has("rate")) sized.values["rate"] = "0.1";
  std::vector<SoakResult> results;
  results.push_back(soak<mp::FullPrecision>(sized));
  results.push_back(soak<mp::MixedO1<at::BFloat16>>(sized));
  results.push_back(soak<mp::MixedO2<at::BFloat16>>(sized));
  results.push_back(soak<mp::PureHalf<at::BFloat16>>(sized));
  results.push_back(soak<ScaledO2>(sized));
  if constexpr (mp::cpu_half_math) {
    results.push_back(soak<mp::MixedO1<at::Half>>(sized));
    results.push_back(soak<mp::MixedO2<at::Half>>(sized));
    results.push_back(soak<mp::PureHalf<at::Half>>(sized));
  }
  const auto steps = sized.integer("steps", 10000);
  // A leak of one small tensor per step is ~1 MiB per 10000 steps; the noise measured is < 256 KiB.
  const std::int64_t rss_allowance_kib = 1024;
  std::cout << "LibTorch " << TORCH_VERSION << ", seed " << sized.integer("seed", 1)
            << ", injection rate " << sized.number("rate", 0.05) << ", growth_interval "
            << sized.integer("growth-interval", 10)
            << (args.has("max-grad-norm") ? ", max_grad_norm " + args.text("max-grad-norm", "") : "") << "\n\n"
            << "| policy | steps | injections (grad/loss/input) | skips (of which natural) | "
               "corruptions | scale off trajectory | equals reference | RSS KiB warm -> end | "
               "largest / final scale | last clean loss |\n"
            << "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|\n";
  bool ok = true;
  std::int64_t total_steps = 0, total_injections = 0, total_skips = 0, total_corruptions = 0;
  for (const auto& r : results) {
    const bool rss_flat = steps < 2000 || r.rss_end - r.rss_warm <= rss_allowance_kib;
    ok = ok && r.corruptions == 0 && r.scale_mismatches == 0 && r.equal_to_reference &&
         r.notes.empty() && rss_flat && r.injections > 0;
    total_steps += r.steps;
    total_injections += r.injections;
    total_skips += r.skips;
    total_corruptions += r.corruptions;
    std::cout << "| " << r.policy << " | " << r.steps << " | " << r.injections << " ("
              << r.by_target[0] << "/" << r.by_target[1] << "/" << r.by_target[2] << ") | "
              << r.skips << " (" << r.natural_skips << ") | " << r.corruptions << " | "
              << r.scale_mismatches << " | " << (r.equal_to_reference ? "yes" : "NO") << " | "
              << r.rss_warm << " -> " << r.rss_end << (rss_flat ? "" : " (GREW)") << " | "
              << r.max_scale << " / " << r.final_scale << " | " << r.last_loss << " |\n";
    for (const auto& note : r.notes) std::cout << "  " << r.policy << ": " << note << "\n";
  }
  std::cout << "\ntotal: " << total_steps << " steps, " << total_injections << " injections, "
            << total_skips << " skips, " << total_corruptions << " corruptions\n"
            << (ok ? "soak: ok\n" : "soak: FAILED\n");
  return ok ? 0 : 1;
}

// ---------------------------------------------------------------------------------------------
// Kill and resume

// Every kind of state a checkpoint holds: BatchNorm buffers, dropout (the RNG), fp32 masters, a
// dynamic scaler with hysteresis, Adam's moments, counters with skips.
struct ResumeNet : torch::nn::Module {
  ResumeNet() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    norm = register_module("norm", torch::nn::BatchNorm1d(32));
    drop = register_module("drop", torch::nn::Dropout(0.2));
    fc2 = register_module("fc2", torch::nn::Linear(32, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc2->forward(drop->forward(torch::relu(norm->forward(fc1->forward(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  torch::nn::Dropout drop{nullptr};
};

struct ResumeRig {
  std::shared_ptr<ResumeNet> net;
  torch::optim::Adam adam;
  mp::Trainer<ScaledO2> trainer;
  ResumeRig()
      : net((torch::manual_seed(7), std::make_shared<ResumeNet>())),
        adam(net->parameters(), torch::optim::AdamOptions(1e-2)),
        trainer(net, adam, mp::TrainerOptions().scaler(
                               mp::GradScalerOptions().init_scale(256).growth_interval(7).hysteresis(2))) {}

  // One step on a batch drawn from the global RNG, which the checkpoint must restore; every
  // 13th micro-batch has a NaN loss, so that the skip counters and the scale move too.
  void step() {
    const auto x = torch::randn({16, 8});
    const auto y = torch::randint(0, 3, {16}, at::kLong);
    const bool poison = trainer.stats().micro_batches % 13 == 5;
    trainer.step([&] {
      auto loss = torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(x)), y);
      return poison ? loss * std::numeric_limits<float>::quiet_NaN() : loss;
    });
  }

  // Everything the run's result is made of, after load(): model, masters, optimizer state and
  // lr, scaler, counters and the CPU RNG state.
  std::vector<at::Tensor> everything(std::string& text) {
    auto all = test::snapshot(net->parameters());
    for (auto& t : test::snapshot(net->buffers())) all.push_back(t);
    for (auto& t : test::snapshot(trainer.master_weights())) all.push_back(t);
    for (auto& t : adam_state(adam)) all.push_back(t);
    all.push_back(at::detail::getDefaultCPUGenerator().get_state());
    const auto stats = trainer.stats();
    std::ostringstream out;
    out << "steps=" << stats.steps << " skipped=" << stats.skipped_steps
        << " micro_batches=" << stats.micro_batches << " lr=" << std::hexfloat
        << adam.param_groups()[0].options().get_lr() << " "
        << scaler_text(trainer.scaler().state_dict());
    text = out.str();
    return all;
  }
};

// The child: resumes from dir/run.ckpt if there is one, trains to `steps`, saves every `every`
// steps. Tells the parent on stdout: "r N" resumed at N, "s N" after step N, "b" before save(),
// "e" after it; "x MESSAGE" if a checkpoint it found did not load.
int run_train(const Args& args) {
  const fs::path dir = args.text("dir", ".");
  const auto steps = args.integer("steps", 100);
  const auto every = args.integer("every", 5);
  const auto path = (dir / "run.ckpt").string();
  ResumeRig rig;
  if (fs::exists(path)) {
    try {
      rig.trainer.load(path);
    } catch (const std::exception& e) {
      std::cout << "x " << e.what() << std::endl;
      return 3;
    }
  }
  std::cout << "r " << rig.trainer.stats().steps << std::endl;
  while (rig.trainer.stats().steps < steps) {
    rig.step();
    const auto done = rig.trainer.stats().steps;
    std::cout << "s " << done << std::endl;
    if (done % every == 0 || done == steps) {
      std::cout << "b" << std::endl;
      rig.trainer.save(path);
      std::cout << "e" << std::endl;
    }
  }
  return 0;
}

// A child process running `train`, its stdout read line by line.
class Child {
 public:
  Child(const std::string& self, const std::vector<std::string>& args) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::dup2(fds[1], 1);
      ::close(fds[0]);
      ::close(fds[1]);
      std::vector<char*> argv{const_cast<char*>(self.c_str())};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(self.c_str(), argv.data());
      std::_Exit(127);
    }
    ::close(fds[1]);
    fd_ = fds[0];
  }
  ~Child() {
    if (fd_ >= 0) ::close(fd_);
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  /// The next line, or nullopt at EOF. Throws after 120 s without one: a hung child.
  std::optional<std::string> line() {
    while (true) {
      const auto newline = buffer_.find('\n');
      if (newline != std::string::npos) {
        auto result = buffer_.substr(0, newline);
        buffer_.erase(0, newline + 1);
        return result;
      }
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 120000) == 0) throw std::runtime_error("the child hangs");
      char chunk[4096];
      const auto n = ::read(fd_, chunk, sizeof chunk);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return std::nullopt;
      buffer_.append(chunk, static_cast<std::size_t>(n));
    }
  }
  void kill() { ::kill(pid_, SIGKILL); }
  /// The exit status, or -signal.
  int wait() {
    int status = 0;
    ::waitpid(pid_, &status, 0);
    reaped_ = true;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  bool reaped_ = false;
  std::string buffer_;
};

std::string self_path() { return fs::read_symlink("/proc/self/exe").string(); }

int run_kill_resume(const Args& args) {
  const bool smoke = args.has("smoke");
  const auto kills_wanted = args.integer("kills", smoke ? 6 : 30);
  const auto every = args.integer("every", smoke ? 3 : 5);
  const auto steps = args.integer("steps", every * (2 * kills_wanted + 4));
  const auto seed = static_cast<std::uint64_t>(args.integer("seed", 1));
  const fs::path dir = args.text("dir", (fs::temp_directory_path() / "mixprec_kill_resume").string());
  fs::remove_all(dir);
  fs::create_directories(dir / "killed");
  fs::create_directories(dir / "reference");
  const auto self = self_path();
  const auto train_args = [&](const fs::path& d) {
    return std::vector<std::string>{"train", "--dir", d.string(), "--steps", std::to_string(steps),
                                    "--every", std::to_string(every)};
  };

  {  // the uninterrupted run
    Child child(self, train_args(dir / "reference"));
    while (child.line()) {
    }
    if (child.wait() != 0) {
      std::cout << "the uninterrupted run failed\n";
      return 1;
    }
  }

  std::mt19937_64 rng(seed);
  std::int64_t kills = 0, kills_in_save = 0, restarts = 0, partial_refused = 0, complete_temps = 0;
  std::int64_t farthest = 0;
  bool finished = false, ok = true;
  std::vector<std::string> notes;
  const auto killed_dir = dir / "killed";
  while (!finished) {
    ++restarts;
    Child child(self, train_args(killed_dir));
    const bool want_kill = kills < kills_wanted;
    const bool in_save = rng() % 2 == 0;
    const auto save_index = static_cast<std::int64_t>(rng() % 2) + 1;    // which save to hit
    const auto step_index = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(2 * every)) + 1;
    const auto delay = std::chrono::microseconds(rng() % (in_save ? 4000 : 1500));
    std::int64_t saves = 0, step_lines = 0;
    bool killed = false, open_save = false;
    while (auto line = child.line()) {
      if (line->empty()) continue;
      const char kind = (*line)[0];
      if (kind == 'x') {
        notes.push_back("a checkpoint did not load: " + line->substr(2));
        ok = false;
      } else if (kind == 's') {
        ++step_lines;
        farthest = std::max<std::int64_t>(farthest, std::stoll(line->substr(2)));
      } else if (kind == 'b') {
        ++saves;
        open_save = true;
      } else if (kind == 'e') {
        open_save = false;
      }
      if (!want_kill || killed) continue;
      if ((in_save && kind == 'b' && saves == save_index) ||
          (!in_save && kind == 's' && step_lines == step_index)) {
        std::this_thread::sleep_for(delay);
        child.kill();
        killed = true;
      }
    }
    const int status = child.wait();
    if (killed && status == -SIGKILL) {
      ++kills;
      // The last marker read before EOF says where the kill landed.
      if (open_save) ++kills_in_save;
    } else if (status == 0) {
      finished = true;
    } else if (status != -SIGKILL) {
      notes.push_back("the child exited with " + std::to_string(status));
      ok = false;
      break;
    }
    // What a kill inside save() leaves: a temporary beside the checkpoint. A partial one must
    // be refused by load(); a complete one (killed before the rename) may load. Then removed.
    for (const auto& entry : fs::directory_iterator(killed_dir)) {
      const auto name = entry.path().filename().string();
      if (name.rfind("run.ckpt.tmp.", 0) != 0) continue;
      ResumeRig probe;
      try {
        probe.trainer.load(entry.path().string());
        ++complete_temps;
      } catch (const mp::Error&) {
        ++partial_refused;
      }
      fs::remove(entry.path());
    }
    if (restarts > 10 * kills_wanted + 10) {
      notes.push_back("no progress");
      ok = false;
      break;
    }
  }

  ResumeRig reference, resumed;
  reference.trainer.load((dir / "reference" / "run.ckpt").string());
  std::string reference_text, resumed_text;
  const auto reference_state = reference.everything(reference_text);
  resumed.trainer.load((killed_dir / "run.ckpt").string());
  const auto resumed_state = resumed.everything(resumed_text);
  const bool equal = test::identical(reference_state, resumed_state) && reference_text == resumed_text;
  ok = ok && equal && kills >= kills_wanted && finished;
  std::cout << "LibTorch " << TORCH_VERSION << ", seed " << seed << ", " << steps
            << " steps, save every " << every << "\n\n"
            << "| kills | inside save() | restarts | partial temporaries refused | complete "
               "temporaries | final state equals the uninterrupted run |\n"
            << "|---:|---:|---:|---:|---:|---|\n"
            << "| " << kills << " | " << kills_in_save << " | " << restarts << " | "
            << partial_refused << " | " << complete_temps << " | " << (equal ? "yes" : "NO")
            << " |\n\nfinal: " << resumed_text << "\n";
  if (!equal) std::cout << "uninterrupted: " << reference_text << "\n";
  for (const auto& note : notes) std::cout << "  " << note << "\n";
  std::cout << (ok ? "kill-resume: ok\n" : "kill-resume: FAILED\n");
  if (ok) fs::remove_all(dir);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string command = argc > 1 ? argv[1] : "";
    const Args args(argc, argv, 2);
    if (command == "soak") return run_soak(args);
    if (command == "kill-resume") return run_kill_resume(args);
    if (command == "train") return run_train(args);
    std::cerr << "usage: mixprec_reliability soak|kill-resume [options] (see the source)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "mixprec_reliability: " << e.what() << "\n";
    return 1;
  }
}
