// mixprec against the same training loop in Python and against the hand-written LibTorch loop,
// measured side by side in one run (issue 7):
//  1. Trainer<FullPrecision> vs a Python fp32 loop;
//  2. Trainer<MixedO1<BFloat16>> vs a Python loop under torch.autocast("cpu", torch.bfloat16);
//  3. Trainer<FullPrecision> vs the hand-written LibTorch loop (no mixprec);
// for the demo's CNN and a masked-attention tagger at three sizes: overhead-bound on this machine
// (d 16), the example (d 32, which Debian's reference BLAS makes mostly matmul-bound in
// fp32), and compute-bound (d 256, seq 128). Same model, initial weights (checked by checksum),
// data, optimizer (Adam), batch, seed and thread count on every side. The attention softmax is
// ops::masked_softmax<P> in C++ and masked_fill(-inf) + softmax in Python; a C++ loop with the
// Python composite is measured too.
//
// The Python side is one long-lived Debian /usr/bin/python3 (python3-torch: the same LibTorch)
// running benchmarks/python/train_loop.py, driven over a pipe: "run NAME N" trains N steps and
// replies with the milliseconds measured inside Python, so interpreter start-up is not timed and
// both sides are warm. The variants run interleaved, in alternating order; medians, and ratios
// paired per repetition. Where a target is missed, the lines under the table give the measured
// factors (LibTorch vs Python with the same ops, the softmax, the Trainer's extra work, part by
// part) and an A/A control shows the noise floor.
//
// Then memory (issue 7.3), each measurement in a child process of its own (this program
// re-executed with --memory-child): the RSS growth of training steps per policy for the
// compute-bound tagger at a fixed batch, and the largest batch within a growth budget (doubling,
// then bisection).
//
//   ./build/default/benchmarks/bench_vs_python            full run (about 3 minutes)
//   ./build/default/benchmarks/bench_vs_python --smoke    tiny sizes, 3 repetitions (~10 s)
// MIXPREC_PYTHON overrides the interpreter (default /usr/bin/python3).

#include <mixprec/mixprec.hpp>

#include "harness.hpp"
#include "models.hpp"
#include "python_child.hpp"

#include <ATen/record_function.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

extern char** environ;

namespace bench_vs_python {

namespace {

namespace models = bench::models;
using Bf16O1 = mixprec::MixedO1<at::BFloat16>;
constexpr std::uint64_t kSeed = 0;
constexpr std::size_t kBatches = 4;  // distinct batches each loop cycles through
constexpr const char* kCommand = "./build/default/benchmarks/bench_vs_python";

using bench::Clock;
using bench::PythonChild;
using bench::fixed;
using bench::ms_since;

std::vector<std::string> split(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

// ---------------------------------------------------------------------------------------------
// The training loops. Each runs `steps` steps and returns the milliseconds it took.

struct Loop {
  virtual ~Loop() = default;
  virtual double run(int steps) = 0;
  virtual double last_loss() = 0;
};

/// The loop a LibTorch user writes without mixprec; `autocast`: LibTorch's raw CPU switches.
class HandLoop : public Loop {
 public:
  HandLoop(models::Bound net, bool autocast)
      : net_(std::move(net)),
        optimizer_(net_.module->parameters(), torch::optim::AdamOptions(1e-3)),
        autocast_(autocast) {}

  double run(int steps) override {
    const auto start = Clock::now();
    for (int i = 0; i < steps; ++i) {
      optimizer_.zero_grad();
      at::Tensor loss;
      if (autocast_) {
        // LibTorch's raw switches (through the wrapper that hides their 2.4 renaming).
        mixprec::detail::set_autocast_state(at::kCPU, {true, at::kBFloat16});
        loss = net_.loss(cursor_++);
        mixprec::detail::set_autocast_state(at::kCPU, {false, at::kBFloat16});
        at::autocast::clear_cache();
      } else {
        loss = net_.loss(cursor_++);
      }
      loss.backward();
      optimizer_.step();
      last_ = loss;
    }
    return ms_since(start);
  }

  double last_loss() override { return last_.defined() ? last_.item<double>() : 0.0; }

  torch::optim::Optimizer& optimizer() { return optimizer_; }
  models::Bound& net() { return net_; }

 private:
  models::Bound net_;
  torch::optim::Adam optimizer_;
  bool autocast_;
  std::size_t cursor_ = 0;
  at::Tensor last_;
};

template <class P>
class TrainerLoop : public Loop {
 public:
  explicit TrainerLoop(models::Bound net)
      : net_(std::move(net)),
        optimizer_(net_.module->parameters(), torch::optim::AdamOptions(1e-3)),
        trainer_(net_.module, optimizer_) {}

  double run(int steps) override {
    const auto start = Clock::now();
    for (int i = 0; i < steps; ++i) {
      const auto report = trainer_.step([&] { return net_.loss(cursor_); });
      ++cursor_;
      last_ = report.loss;
    }
    return ms_since(start);
  }

  double last_loss() override { return last_.defined() ? last_.item<double>() : 0.0; }

  torch::optim::Optimizer& optimizer() { return optimizer_; }

 private:
  models::Bound net_;
  torch::optim::Adam optimizer_;
  mixprec::Trainer<P> trainer_;
  std::size_t cursor_ = 0;
  at::Tensor last_;
};

class PythonLoop : public Loop {
 public:
  PythonLoop(PythonChild& python, std::string name) : python_(python), name_(std::move(name)) {}
  ~PythonLoop() override {
    try {
      python_.request("free " + name_);
    } catch (const std::exception&) {
    }
  }
  PythonLoop(const PythonLoop&) = delete;
  PythonLoop& operator=(const PythonLoop&) = delete;

  double run(int steps) override {
    std::string command = "run ";
    command.append(name_).append(" ").append(std::to_string(steps));
    return std::stod(python_.request(command));
  }
  double last_loss() override { return std::stod(python_.request("loss " + name_)); }

 private:
  PythonChild& python_;
  std::string name_;
};

// ---------------------------------------------------------------------------------------------
// Speed.

struct Workload {
  std::string title;
  std::string python_args;  // model and sizes for train_loop.py's setup
  int steps_fp32 = 1;       // training steps per timed sample, fp32 loops
  int steps_bf16 = 1;       // the same, bf16 loops
  int repetitions = 11;
  double target = 1.0;      // mixprec vs Python
  bool tagger = false;
  std::function<models::Bound(models::AttentionSoftmax)> bind;
  double data_checksum = 0.0;
};

Workload cnn_workload(std::int64_t batch, int steps, int repetitions) {
  Workload w;
  w.title = "CNN of the demo (conv-BN-ReLU-pool, conv-ReLU-pool, linear), batch ";
  w.title.append(std::to_string(batch)).append(", random 28x28 images");
  w.python_args = "model=cnn batch=";
  w.python_args.append(std::to_string(batch));
  w.steps_fp32 = steps;
  w.steps_bf16 = steps;
  w.repetitions = repetitions;
  torch::manual_seed(kSeed + 1);
  auto data = std::make_shared<const std::vector<models::ImageBatch>>(
      models::image_batches(kBatches, batch));
  std::vector<at::Tensor> tensors;
  for (const auto& b : *data) {
    tensors.push_back(b.x);
    tensors.push_back(b.y);
  }
  w.data_checksum = models::checksum(tensors);
  w.bind = [data](models::AttentionSoftmax) { return models::bind_cnn(kSeed, data); };
  return w;
}

Workload tagger_workload(const std::string& kind, const models::TaggerConfig& c, int steps_fp32,
                         int steps_bf16, int repetitions, double target) {
  Workload w;
  w.title = "Tagger, ";
  w.title.append(kind)
      .append(": d ")
      .append(std::to_string(c.d))
      .append(", ")
      .append(std::to_string(c.heads))
      .append(" heads, seq ")
      .append(std::to_string(c.seq))
      .append(" (lengths seq/2..seq, padded), batch ")
      .append(std::to_string(c.batch))
      .append(", vocab ")
      .append(std::to_string(c.vocab));
  w.python_args = "model=tagger batch=";
  w.python_args.append(std::to_string(c.batch))
      .append(" vocab=")
      .append(std::to_string(c.vocab))
      .append(" d=")
      .append(std::to_string(c.d))
      .append(" heads=")
      .append(std::to_string(c.heads))
      .append(" seq=")
      .append(std::to_string(c.seq))
      .append(" classes=")
      .append(std::to_string(c.classes));
  w.steps_fp32 = steps_fp32;
  w.steps_bf16 = steps_bf16;
  w.repetitions = repetitions;
  w.target = target;
  w.tagger = true;
  torch::manual_seed(kSeed + 1);
  auto data = std::make_shared<const std::vector<models::TokenBatch>>(
      models::token_batches(kBatches, c));
  std::vector<at::Tensor> tensors;
  for (const auto& b : *data) {
    tensors.push_back(b.tokens);
    tensors.push_back(b.labels);
    tensors.push_back(b.keep);
  }
  w.data_checksum = models::checksum(tensors);
  w.bind = [data, c](models::AttentionSoftmax softmax) {
    return models::bind_tagger(kSeed, c, softmax, data);
  };
  return w;
}

struct Variant {
  Loop* loop;
  int steps;
};

/// Milliseconds per training step, [variant][repetition], interleaved in alternating order: a
/// variant follows its left neighbour in one repetition and its right one in the next (the
/// first and the last follow themselves half the time).
bench::Samples interleaved_samples(const std::vector<Variant>& variants,
                                   const bench::Options& options, int repetitions) {
  auto o = options;
  o.repetitions = repetitions;
  return bench::interleaved_samples(variants.size(), o, [&](std::size_t v) {
    return variants[v].loop->run(variants[v].steps) / variants[v].steps;
  });
}

/// One comparison: baseline time / mixprec time, paired within each repetition.
struct Row {
  std::string mixprec;
  std::string baseline;
  double target;  // on the ratio
  double mixprec_ms = 0;
  double baseline_ms = 0;
  bench::Quartiles ratio{};  // of the per-repetition ratios
  bool met() const { return ratio.median >= target; }
  bool within_noise() const { return !met() && ratio.q3 >= target; }
};

Row make_row(std::string mixprec, const std::vector<double>& mixprec_ms, std::string baseline,
             const std::vector<double>& baseline_ms, double target) {
  Row r{std::move(mixprec), std::move(baseline), target};
  r.mixprec_ms = bench::median(mixprec_ms);
  r.baseline_ms = bench::median(baseline_ms);
  r.ratio = bench::paired_ratio(baseline_ms, mixprec_ms);
  return r;
}

void print_rows(const std::vector<Row>& rows) {
  std::printf("| row | mixprec | ms/step | baseline | ms/step | ratio | ratio IQR | target | "
              "met |\n|---|---|---:|---|---:|---:|---:|---:|---|\n");
  int n = 0;
  for (const auto& r : rows) {
    ++n;
    std::printf("| %d | %s | %.3f | %s | %.3f | %.3f | %s | >= %.2f | %s |\n", n,
                r.mixprec.c_str(), r.mixprec_ms, r.baseline.c_str(), r.baseline_ms,
                r.ratio.median, bench::iqr(r.ratio, 3).c_str(), r.target,
                r.met() ? "yes" : (r.within_noise() ? "no, within noise" : "**no**"));
  }
}

// Time spent in matrix products and convolutions (aten::mm, addmm, bmm, convolution and its
// backward: BLAS or oneDNN kernels, the same in C++ and Python), counted by a RecordFunction
// callback around the outermost such call.
struct KernelClock : at::ObserverContext {
  Clock::time_point start;
};
int g_kernel_depth = 0;
double g_kernel_ms = 0.0;

bool is_big_kernel(const at::RecordFunction& fn) {
  const std::string_view name = fn.name();
  return name == "aten::mm" || name == "aten::addmm" || name == "aten::bmm" ||
         name == "aten::convolution" || name == "aten::convolution_backward";
}

/// Percent of `loop`'s time over `steps` steps spent in those kernels (both measured under the
/// callback, which adds a little to every op).
double kernel_share_percent(Loop& loop, int steps) {
  g_kernel_depth = 0;
  g_kernel_ms = 0.0;
  const auto handle = at::addGlobalCallback(at::RecordFunctionCallback(
      [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
        if (!is_big_kernel(fn) || g_kernel_depth++ > 0) return nullptr;
        auto clock = std::make_unique<KernelClock>();
        clock->start = Clock::now();
        return clock;
      },
      [](const at::RecordFunction& fn, at::ObserverContext* context) {
        if (!is_big_kernel(fn)) return;
        --g_kernel_depth;
        if (context != nullptr) g_kernel_ms += ms_since(static_cast<KernelClock*>(context)->start);
      }));
  const double total_ms = loop.run(steps);
  at::removeCallback(handle);
  return 100.0 * g_kernel_ms / total_ms;
}

/// What Trainer<FullPrecision>::step does beyond the hand-written loop, each part timed alone
/// in a tight loop (microseconds), on the gradients of `optimizer` and the parameters of
/// `module`. In the training loop the same work costs more: its code and data are cold there.
struct TrainerParts {
  double grad_check = 0;  // NoScaler's read-only inf/NaN pass over the gradients
  double loss_check = 0;  // the inf/NaN check of the loss: one read of it on the CPU
  double zero_grad = 0;   // gradients set to none per tensor over Optimizer::zero_grad
  double loss_view = 0;   // loss.to(kFloat).reshape({}) and detach, forward and backward
  double guard = 0;       // autocast<FullPrecision> scope
  double sum() const { return grad_check + loss_check + zero_grad + loss_view + guard; }
};

TrainerParts time_trainer_parts(torch::nn::Module& module, torch::optim::Optimizer& optimizer) {
  TrainerParts parts;
  mixprec::detail::StepEngine scaler(/*allow_fp16=*/false);  // the Trainer's, at scale 1
  parts.grad_check = bench::us_per_call(200, [&] {
    scaler.unscale_planned(optimizer, {});
    scaler.reset_stages();
  });
  const auto weight = torch::ones({}, torch::requires_grad());
  const auto scalar = (weight * 2.0).detach();
  volatile bool finite = true;
  parts.loss_check = bench::us_per_call(2000, [&] { finite = std::isfinite(scalar.item<double>()); });
  const auto params = mixprec::detail::unique_tensors(module.parameters());
  const double module_zero = bench::us_per_call(500, [&] { mixprec::detail::clear_grads(params); });
  const double optimizer_zero = bench::us_per_call(500, [&] { optimizer.zero_grad(); });
  parts.zero_grad = module_zero - optimizer_zero;
  const double plain = bench::us_per_call(2000, [&] { (weight * 2.0).backward(); });
  const double viewed = bench::us_per_call(2000, [&] {
    const auto loss32 = (weight * 2.0).to(at::kFloat).reshape({});
    const auto detached = loss32.detach();
    loss32.backward();
  });
  parts.loss_view = viewed - plain;
  parts.guard =
      bench::us_per_call(20000, [] { auto guard = mixprec::autocast<mixprec::FullPrecision>(); });
  return parts;
}

/// The hand-written fp32 loop with the Trainer's extra work added stage by stage:
/// 1 the gradients set to none tensor by tensor instead of the optimizer's zero_grad, 2 the loss
/// as an fp32 0-dim view and its detached copy, 3 the Trainer's finiteness pass over the
/// gradients before the step, 4 the loss check too (one read on the CPU).
class BuildUpLoop : public Loop {
 public:
  BuildUpLoop(models::Bound net, int stage)
      : net_(std::move(net)),
        optimizer_(net_.module->parameters(), torch::optim::AdamOptions(1e-3)),
        params_(mixprec::detail::unique_tensors(net_.module->parameters())),
        stage_(stage) {}

  double run(int steps) override {
    const auto start = Clock::now();
    for (int i = 0; i < steps; ++i) {
      if (stage_ >= 1) {
        mixprec::detail::clear_grads(params_);
      } else {
        optimizer_.zero_grad();
      }
      auto loss = net_.loss(cursor_++);
      at::Tensor detached;
      if (stage_ >= 2) {
        loss = loss.to(at::kFloat).reshape({});
        detached = loss.detach();
      }
      if (stage_ >= 3) {
        scaler_.scale(loss).backward();
        mixprec::detail::UnscalePlan unscale;
        if (stage_ >= 4 && !std::isfinite(detached.item<double>())) unscale.also_check(detached);
        scaler_.unscale_planned(optimizer_, unscale);
        scaler_.step(optimizer_);
        scaler_.reset_stages();
      } else {
        loss.backward();
        optimizer_.step();
      }
    }
    return ms_since(start);
  }
  double last_loss() override { return 0.0; }

 private:
  models::Bound net_;
  torch::optim::Adam optimizer_;
  std::vector<at::Tensor> params_;  // each tensor once, as the Trainer keeps them
  mixprec::detail::StepEngine scaler_{/*allow_fp16=*/false};  // the Trainer's, at scale 1
  int stage_;
  std::size_t cursor_ = 0;
};

/// Row 3's measured cause: the Trainer's extra work, added to the hand-written loop in stages,
/// interleaved as the main table is.
void print_trainer_build_up(const Workload& w, const bench::Options& options) {
  const auto fp_softmax = &models::mixprec_softmax<mixprec::FullPrecision>;
  std::vector<std::unique_ptr<Loop>> loops;
  for (int stage = 0; stage <= 4; ++stage) {
    loops.push_back(std::make_unique<BuildUpLoop>(w.bind(fp_softmax), stage));
  }
  loops.push_back(std::make_unique<TrainerLoop<mixprec::FullPrecision>>(w.bind(fp_softmax)));
  std::vector<Variant> variants;
  for (auto& loop : loops) variants.push_back({loop.get(), w.steps_fp32});
  const int repetitions = options.smoke ? options.repetitions : w.repetitions;
  const auto ms = interleaved_samples(variants, options, repetitions);
  const std::vector<std::string> names = {
      "hand-written loop",
      "+ gradients set to none tensor by tensor instead of the optimizer's zero_grad()",
      "+ loss.to(kFloat).reshape({}) and loss.detach() for the report",
      "+ the step engine at scale 1: finiteness pass over the gradients (bits only), step",
      "+ the loss check: one read of the fp32 loss (also_check only where it is inf/NaN)",
      "Trainer<FullPrecision>::step (adds the autocast guard and the report)"};
  std::printf("\nRow 3, where the time goes: the hand-written loop with the Trainer's extra work "
              "added step by step (fp32, interleaved, medians; the differences are paired "
              "per repetition).\n\n| loop | ms/step | us/step over the line above |\n"
              "|---|---:|---:|\n");
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i == 0) {
      std::printf("| %s | %.4f | |\n", names[i].c_str(), bench::median(ms[i]));
      continue;
    }
    std::printf("| %s | %.4f | %+.1f |\n", names[i].c_str(), bench::median(ms[i]),
                bench::paired_difference(ms[i], ms[i - 1]).median * 1000.0);
  }
}

void speed(PythonChild& python, const Workload& w, const bench::Options& options, int threads) {
  std::string setup_args = w.python_args;
  setup_args.append(" threads=")
      .append(std::to_string(threads))
      .append(" seed=")
      .append(std::to_string(kSeed))
      .append(" batches=")
      .append(std::to_string(kBatches));
  const auto fp32_reply = split(python.request("setup py32 precision=fp32 " + setup_args));
  const auto bf16_reply = split(python.request("setup pybf16 precision=bf16 " + setup_args));
  PythonLoop py32(python, "py32");
  PythonLoop pybf16(python, "pybf16");

  const auto fp_softmax = &models::mixprec_softmax<mixprec::FullPrecision>;
  const auto o1_softmax = &models::mixprec_softmax<Bf16O1>;
  HandLoop hand(w.bind(fp_softmax), false);
  TrainerLoop<mixprec::FullPrecision> trainer_fp(w.bind(fp_softmax));
  TrainerLoop<Bf16O1> trainer_o1(w.bind(o1_softmax));
  HandLoop hand_o1(w.bind(o1_softmax), true);
  HandLoop hand_o1_composite(w.bind(&models::composite_softmax), true);
  HandLoop hand_again(w.bind(fp_softmax), false);
  HandLoop hand_o1_again(w.bind(o1_softmax), true);

  const double weights = models::checksum(hand.net().module->parameters());
  const bool same_inputs = fp32_reply.size() == 4 && bf16_reply.size() == 4 &&
                           std::stod(fp32_reply[2]) == weights &&
                           std::stod(fp32_reply[3]) == w.data_checksum &&
                           std::stod(bf16_reply[2]) == weights &&
                           std::stod(bf16_reply[3]) == w.data_checksum;

  // The order matters where one process follows the other: a variant that runs right after
  // the other process finds the caches evicted (and that process's worker threads perhaps
  // still spinning). The Python variants come first: py32 follows only Python and row 1's
  // Trainer never follows Python; pybf16 and row 2's Trainer each follow the other process in
  // every second repetition. Row 3's two C++ loops sit inside the C++ block, never right after
  // Python. The A/A controls (second, identical hand-written loops: bf16, and fp32 where its
  // samples are cheap) come after their twins.
  std::vector<Variant> variants;
  const auto add = [&](Loop& loop, int steps) {
    variants.push_back({&loop, steps});
    return variants.size() - 1;
  };
  const auto kPy32 = add(py32, w.steps_fp32);
  const auto kPyBf16 = add(pybf16, w.steps_bf16);
  const auto kTrainerO1 = add(trainer_o1, w.steps_bf16);
  const auto kHandO1 = add(hand_o1, w.steps_bf16);
  const auto kComposite = w.tagger ? add(hand_o1_composite, w.steps_bf16) : 0;
  const auto kHandO1Again = add(hand_o1_again, w.steps_bf16);
  const auto kHand = add(hand, w.steps_fp32);
  const auto kTrainerFp = add(trainer_fp, w.steps_fp32);
  const bool control_fp32 = w.steps_fp32 > 1;
  const auto kHandAgain = control_fp32 ? add(hand_again, w.steps_fp32) : 0;
  const int repetitions = options.smoke ? options.repetitions : w.repetitions;
  const auto ms = interleaved_samples(variants, options, repetitions);
  // After the same number of steps on the same batches (before the profiling below adds some).
  const std::vector<double> last_loss = {hand.last_loss(),    trainer_fp.last_loss(),
                                         py32.last_loss(),    trainer_o1.last_loss(),
                                         hand_o1.last_loss(), pybf16.last_loss()};

  const std::vector<Row> rows = {
      make_row("Trainer<FullPrecision>", ms[kTrainerFp], "Python fp32 loop", ms[kPy32], w.target),
      make_row("Trainer<MixedO1<BFloat16>>", ms[kTrainerO1], "Python loop, torch.autocast bf16",
               ms[kPyBf16], w.target),
      make_row("Trainer<FullPrecision>", ms[kTrainerFp], "hand-written LibTorch loop", ms[kHand],
               1.0 / 1.02),
  };
  std::printf("\n### %s\n\nAdam, %d thread(s), steps per sample %d (fp32) / %d (bf16), %d "
              "repetitions, interleaved. ms/step: medians. ratio = baseline time / mixprec time "
              "(> 1: mixprec faster), the median of the per-repetition ratios, with their "
              "interquartile range.\n\n",
              w.title.c_str(), threads, w.steps_fp32, w.steps_bf16, repetitions);
  print_rows(rows);

  // The factors of rows 1 and 2, each measured in the same repetitions.
  const auto lib_fp32 = make_row("", ms[kHand], "", ms[kPy32], 1.0);     // Python / hand
  const auto lib_bf16 = make_row("", ms[kHandO1], "", ms[kPyBf16], 1.0);  // Python / hand
  const auto trainer_o1_vs_hand = make_row("", ms[kTrainerO1], "", ms[kHandO1], 1.0);
  std::printf("\n- Without mixprec: the hand-written LibTorch loop, fp32 %.3f ms/step (ratio "
              "Python / it %.3f); with LibTorch's raw autocast switches, bf16 %.3f ms/step "
              "(ratio %.3f).\n",
              lib_fp32.mixprec_ms, lib_fp32.ratio.median, lib_bf16.mixprec_ms,
              lib_bf16.ratio.median);
  std::optional<Row> lib_composite;
  std::optional<Row> softmax_factor;
  if (w.tagger) {
    lib_composite = make_row("", ms[kComposite], "", ms[kPyBf16], 1.0);
    softmax_factor = make_row("", ms[kHandO1], "", ms[kComposite], 1.0);  // composite / ours
    std::printf("- The same bf16 loop with Python's masked_fill + softmax (bf16) instead of "
                "ops::masked_softmax<MixedO1> (fp32 inside and out): %.3f ms/step (ratio Python "
                "/ it %.3f; ops::masked_softmax's loop is %.3fx as fast).\n",
                lib_composite->mixprec_ms, lib_composite->ratio.median,
                softmax_factor->ratio.median);
  }
  // Noise floors: the same loop twice. Rows 1 and 3 are fp32, row 2 bf16.
  const auto aa_bf16 = make_row("", ms[kHandO1Again], "", ms[kHandO1], 1.0);
  std::optional<Row> aa_fp32;
  if (control_fp32) aa_fp32 = make_row("", ms[kHandAgain], "", ms[kHand], 1.0);
  std::printf("- A/A controls, a second identical hand-written loop: bf16 ratio %.3f (IQR %s)",
              aa_bf16.ratio.median, bench::iqr(aa_bf16.ratio, 3).c_str());
  if (aa_fp32) {
    std::printf(", fp32 ratio %.3f (IQR %s)", aa_fp32->ratio.median,
                bench::iqr(aa_fp32->ratio, 3).c_str());
  }
  std::printf(": differences of this size in the table are noise.\n");
  const double share_fp32 = kernel_share_percent(hand, std::max(1, w.steps_fp32 / 2));
  const double share_bf16 = kernel_share_percent(hand_o1, std::max(1, w.steps_bf16 / 2));
  std::printf("- Matrix products and convolutions (aten::mm/addmm/bmm/convolution, forward and "
              "backward) take %.0f%% of the hand-written loop's step in fp32 and %.0f%% in bf16 "
              "(the BLAS and oneDNN of this LibTorch: the file's header names them).\n",
              share_fp32, share_bf16);
  const auto parts = time_trainer_parts(*hand.net().module, trainer_fp.optimizer());
  const double trainer_extra_us = (rows[0].mixprec_ms - rows[2].baseline_ms) * 1000.0;
  std::printf("- Trainer<FullPrecision> - hand-written loop: %+.1f us/step (medians). Its extra "
              "work, each part timed alone in a tight loop: inf/NaN check of the loss %.1f us, "
              "of the gradients %.1f us, gradients set to none per tensor instead of the "
              "optimizer's zero_grad %.1f us, "
              "loss .to(kFloat).reshape({}) and detach %.1f us, autocast guard %.2f us.\n",
              trainer_extra_us, parts.loss_check, parts.grad_check, parts.zero_grad,
              parts.loss_view, parts.guard);
  std::printf("- Same initial weights and data in C++ and Python: %s (checksums %.9g, %.9g). "
              "Last loss: hand fp32 %.6g, Trainer<FullPrecision> %.6g, Python fp32 %.6g; "
              "Trainer<MixedO1> %.6g, raw autocast %.6g, Python autocast %.6g.\n",
              same_inputs ? "yes" : "NO", weights, w.data_checksum, last_loss[0], last_loss[1],
              last_loss[2], last_loss[3], last_loss[4], last_loss[5]);

  // A line under the table for each missed target, from what was measured above.
  bool build_up = false;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    if (r.met()) continue;
    std::printf("\n**Row %zu misses its target** (ratio %.3f < %.2f%s). ", i + 1, r.ratio.median,
                r.target,
                r.within_noise() ? "; the upper quartile reaches it: within noise" : "");
    const Row* aa = i == 1 ? &aa_bf16 : (aa_fp32 ? &*aa_fp32 : nullptr);
    if (aa != nullptr && std::abs(r.target - r.ratio.median) <= std::abs(1.0 - aa->ratio.median)) {
      std::printf("The shortfall is no larger than the A/A control's deviation (%.3f). ",
                  aa->ratio.median);
    }
    if (i == 2) {
      const bool cheap = w.steps_fp32 >= 10;
      std::printf("Cause: the Trainer's extra work, %+.1f us/step (%.1f%% of the hand-written "
                  "loop's step)%s\n",
                  trainer_extra_us, 100.0 * (1.0 / r.ratio.median - 1.0),
                  cheap ? "; measured part by part in the table below."
                        : "; the parts timed alone are listed above.");
      build_up = build_up || cheap;
      continue;
    }
    // Row ratio = (LibTorch vs Python, same ops) x (masked_softmax vs composite) x (Trainer vs
    // hand), each factor measured.
    const Row& lib_row = i == 0 ? lib_fp32 : (lib_composite ? *lib_composite : lib_bf16);
    const double lib = lib_row.ratio.median;
    const double softmax = i == 1 && softmax_factor ? softmax_factor->ratio.median : 1.0;
    const double trainer = (i == 0 ? rows[2] : trainer_o1_vs_hand).ratio.median;
    std::printf("Cause, as measured factors of the ratio: LibTorch vs Python running the same "
                "ops %.3f",
                lib);
    if (i == 1 && softmax_factor) {
      std::printf(", ops::masked_softmax<MixedO1> vs Python's masked_fill + softmax %.3f",
                  softmax);
    }
    std::printf(", Trainer vs the hand-written loop %.3f. ", trainer);
    if (r.within_noise()) {
      std::printf("Within noise: no factor to blame.\n");
      continue;
    }
    if (lib * softmax >= r.target) {
      std::printf("Without the Trainer's extra work the ratio would be %.3f: that work (row 3) "
                  "is what brings it below the target.",
                  lib * softmax);
    } else {
      std::printf("Even a Trainer that cost nothing would give %.3f. ", lib * softmax);
      if (lib < r.target) {
        std::printf("LibTorch itself is the limit%s: C++ saves only Python's interpreter time "
                    "between ops, and here %.0f%% of the step is matrix products and "
                    "convolutions (the rest elementwise ops), the same kernels in both "
                    "languages. ",
                    std::abs(lib - 1.0) <= 0.02 ? " (the two languages are level, within 2%)"
                                                : "",
                    i == 0 ? share_fp32 : share_bf16);
      }
      if (softmax < 1.0) {
        std::printf("ops::masked_softmax<MixedO1> costs %.1f%% of the step over Python's "
                    "composite: it upcasts the [batch, heads, seq, seq] scores to fp32 and "
                    "returns fp32 (as autocast's fp32 ops do), so the next matmul casts them "
                    "back to bf16; the composite stays in bf16 (less exact, and NaN for a fully "
                    "padded row).",
                    100.0 * (1.0 / softmax - 1.0));
      }
    }
    std::printf("\n");
  }
  if (build_up) print_trainer_build_up(w, options);
  std::fflush(stdout);
}

// ---------------------------------------------------------------------------------------------
// Memory: each measurement in a child process of its own.

models::TaggerConfig compute_bound_config(bool smoke) {
  models::TaggerConfig c;
  if (smoke) {
    c.d = 64;
    c.seq = 32;
    c.batch = 4;
  } else {
    c.d = 256;
    c.seq = 128;
    c.batch = 16;
  }
  return c;
}

constexpr int kMemorySteps = 2;  // the second step peaks higher: the heap is fragmented

/// In the child: builds the compute-bound tagger under P, trains one warm-up step on a batch of
/// 1 (optimizer state, gradients, code and kernels in place: the baseline), then `steps` steps
/// of `batch`, and prints "fit <baseline RSS> <peak RSS> <growth>" in MiB. The growth is that
/// of anonymous memory (peak RSS minus mapped files, minus the same before): pages of
/// libtorch's code faulted in by the step count in RSS too, and how many depends on what the
/// page cache holds at the time, which would make the results vary from run to run.
/// With a budget, a watchdog ends the process early with "over <growth>" once the anonymous
/// RSS has grown past it (the peak can only be higher).
template <class P>
int memory_child(std::int64_t batch, double budget_mib, int steps, bool composite, bool smoke) {
  auto config = compute_bound_config(smoke);
  config.batch = batch;
  auto warmup_config = config;
  warmup_config.batch = 1;
  torch::manual_seed(kSeed + 1);
  auto data =
      std::make_shared<std::vector<models::TokenBatch>>(models::token_batches(1, warmup_config));
  data->push_back(models::token_batches(1, config).front());
  auto net = models::bind_tagger(
      kSeed, config, composite ? &models::composite_softmax : &models::mixprec_softmax<P>, data);
  torch::optim::Adam adam(net.module->parameters(), torch::optim::AdamOptions(1e-3));
  mixprec::Trainer<P> trainer(net.module, adam);
  trainer.step([&] { return net.loss(0); });

  std::atomic<bool> done{false};
  std::thread watchdog;
  const auto before = bench::memory_status();
  const double anonymous_before = bench::anonymous_mib();
  if (budget_mib > 0) {
    watchdog = std::thread([&] {
      while (!done.load()) {
        const double growth = bench::anonymous_mib() - anonymous_before;
        if (growth > budget_mib) {
          std::printf("over %.1f\n", growth);
          std::fflush(stdout);
          std::_Exit(0);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    });
  }
  const bool reset = bench::reset_peak_rss();
  for (int i = 0; i < steps; ++i) {
    trainer.step([&] { return net.loss(1); });
  }
  const auto after = bench::memory_status();
  done.store(true);
  if (watchdog.joinable()) watchdog.join();
  if (!reset) {
    std::fprintf(stderr, "cannot reset the peak RSS (/proc/self/clear_refs)\n");
    return 1;
  }
  const double growth = (after.peak - after.file) - (before.rss - before.file);
  std::printf("fit %.1f %.1f %.1f\n", before.rss, after.peak, growth);
  return 0;
}

struct Trial {
  bool finished = false;  // false: stopped by the watchdog
  double baseline = 0;
  double peak = 0;
  double growth = 0;
};

/// How a memory child runs: the attention softmax, and whether freed tensors go back to the
/// system at once (glibc's mmap threshold fixed at 64 KiB: the RSS then follows the tensors
/// alive) or as glibc decides by default (it raises the threshold after frees and keeps freed
/// heap memory, so a second step peaks higher than the first).
struct ChildMode {
  bool composite = false;
  bool live = false;
};

Trial run_memory_child(const char* self, const std::string& policy, std::int64_t batch,
                       double budget_mib, bool smoke, ChildMode mode = {}) {
  std::string command = mode.live ? "MALLOC_MMAP_THRESHOLD_=65536 '" : "'";
  command.append(self)
      .append("' --memory-child ")
      .append(policy)
      .append(" ")
      .append(std::to_string(batch))
      .append(" ")
      .append(fixed(budget_mib, 1))
      .append(" ")
      .append(std::to_string(kMemorySteps))
      .append(mode.composite ? " composite" : " mixprec");
  if (smoke) command.append(" --smoke");
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command.c_str(), "r"), pclose);
  char word[16] = {};
  Trial trial;
  bool ok = pipe && std::fscanf(pipe.get(), "%15s", word) == 1;
  if (ok && std::string(word) == "fit") {
    ok = std::fscanf(pipe.get(), "%lf %lf %lf", &trial.baseline, &trial.peak, &trial.growth) == 3;
    trial.finished = true;
  } else if (ok && std::string(word) == "over") {
    ok = std::fscanf(pipe.get(), "%lf", &trial.growth) == 1;
  } else {
    ok = false;
  }
  if (!ok) {
    std::string message = "memory child failed: ";
    message.append(command);
    throw std::runtime_error(message);
  }
  return trial;
}

void memory(const char* self, const bench::Options& options) {
  const auto config = compute_bound_config(options.smoke);
  const std::int64_t fixed_batch = options.smoke ? 8 : 64;
  const std::int64_t start = options.smoke ? 2 : 16;
  const std::int64_t cap = options.smoke ? 32 : 1024;
  // Small enough that the fp32 trials (Debian's reference BLAS: ~1.6 s per step at batch 16)
  // keep the search within about a minute.
  const double budget = options.smoke ? 4.0 : 192.0;
  const std::vector<std::string> policies = {"FullPrecision", "MixedO1", "MixedO2", "PureHalf"};
  const ChildMode live{false, true};
  const ChildMode live_composite{true, true};
  const ChildMode plain_glibc{false, false};

  struct PerPolicy {
    Trial live;            // the deterministic measure: freed tensors go back at once
    Trial live_composite;  // the same with masked_fill + softmax in the attention
    Trial plain_glibc;     // glibc as is: what a user sees, not reproducible run to run
    std::int64_t largest = 0;  // 0: not even batch 1
    Trial largest_trial;
    std::int64_t smallest_over = 0;  // 0: the cap fits
    std::vector<std::int64_t> tried;
  };
  std::vector<PerPolicy> results;
  for (const auto& policy : policies) {
    PerPolicy p;
    // The fixed batch in full (no watchdog): the first table, and one trial of the search.
    p.live = run_memory_child(self, policy, fixed_batch, 0.0, options.smoke, live);
    p.live_composite =
        run_memory_child(self, policy, fixed_batch, 0.0, options.smoke, live_composite);
    p.plain_glibc = run_memory_child(self, policy, fixed_batch, 0.0, options.smoke, plain_glibc);
    const auto fits = [&](std::int64_t batch) {
      p.tried.push_back(batch);
      const auto t = batch == fixed_batch
                         ? p.live
                         : run_memory_child(self, policy, batch, budget, options.smoke, live);
      const bool ok = t.finished && t.growth <= budget;
      if (ok && batch > p.largest) {
        p.largest = batch;
        p.largest_trial = t;
      }
      if (!ok && (p.smallest_over == 0 || batch < p.smallest_over)) p.smallest_over = batch;
      return ok;
    };
    // Doubling from `start` (halving if it does not fit), then bisection down to a quarter of
    // the largest batch that fits.
    std::int64_t batch = start;
    if (fits(batch)) {
      while (batch < cap && fits(std::min(batch * 2, cap))) batch = std::min(batch * 2, cap);
    } else {
      while (batch > 1 && !fits(batch / 2)) batch /= 2;
    }
    if (p.largest > 0 && p.smallest_over > 0) {
      std::int64_t lo = p.largest;
      std::int64_t hi = p.smallest_over;
      while (hi - lo > std::max<std::int64_t>(1, lo / 4)) {
        const std::int64_t mid = lo + (hi - lo) / 2;
        (fits(mid) ? lo : hi) = mid;
      }
    }
    results.push_back(p);
  }

  std::printf("\n### Peak RSS per policy: tagger d %lld, seq %lld, batch %lld, bf16, Adam\n\n"
              "Each measurement in a child process of its own (this program re-executed): one "
              "warm-up step on a batch of 1 (optimizer state, gradients, kernels in place), then "
              "%d training steps. Growth: peak RSS minus the RSS after the warm-up, anonymous "
              "memory only (code pages faulted in from the page cache would count otherwise). "
              "With MALLOC_MMAP_THRESHOLD_=65536 freed tensors go back to the system at once: "
              "the growth is that of the tensors alive at the peak, the same in every run. "
              "glibc's default raises that threshold as blocks are freed and keeps freed heap "
              "memory: more RSS, and different by up to ~20%% from one run to the next. "
              "Composite: masked_fill + softmax (what Python writes) instead of "
              "ops::masked_softmax<P>.\n\n"
              "| policy | growth MiB | growth ratio to FullPrecision | with the composite "
              "softmax MiB | default glibc: RSS before MiB | peak RSS MiB | growth MiB |\n"
              "|---|---:|---:|---:|---:|---:|---:|\n",
              static_cast<long long>(config.d), static_cast<long long>(config.seq),
              static_cast<long long>(fixed_batch), kMemorySteps);
  for (std::size_t i = 0; i < policies.size(); ++i) {
    const auto& p = results[i];
    std::printf("| %s | %.1f | %.2f | %.1f | %.1f | %.1f | %.1f |\n", policies[i].c_str(),
                p.live.growth, p.live.growth / results.front().live.growth,
                p.live_composite.growth, p.plain_glibc.baseline, p.plain_glibc.peak,
                p.plain_glibc.growth);
  }

  std::printf("\n### Largest batch whose training steps grow the RSS by at most %.0f MiB\n\n"
              "The same measurement (MALLOC_MMAP_THRESHOLD_=65536); batches doubled from %lld "
              "(capped at %lld), then bisected to a quarter of the largest that fits; a child "
              "stops early once its memory exceeds the budget.\n\n"
              "| policy | largest batch | its growth MiB | smallest batch over | batches tried | "
              "batch ratio to FullPrecision |\n|---|---:|---:|---:|---|---:|\n",
              budget, static_cast<long long>(start), static_cast<long long>(cap));
  const auto base = static_cast<double>(std::max<std::int64_t>(results.front().largest, 1));
  for (std::size_t i = 0; i < policies.size(); ++i) {
    const auto& p = results[i];
    std::string tried;
    for (const auto b : p.tried) tried.append(tried.empty() ? "" : " ").append(std::to_string(b));
    std::printf("| %s | %lld | %s | %s | %s | %.2f |\n", policies[i].c_str(),
                static_cast<long long>(p.largest),
                p.largest > 0 ? fixed(p.largest_trial.growth, 1).c_str() : "-",
                p.smallest_over > 0 ? std::to_string(p.smallest_over).c_str() : "-",
                tried.c_str(), static_cast<double>(p.largest) / base);
  }
  std::fflush(stdout);
}

int memory_child_main(int argc, char** argv) {
  // --memory-child POLICY BATCH BUDGET_MIB STEPS mixprec|composite [--smoke]
  if (argc < 7) return 2;
  const std::string policy = argv[2];
  const std::int64_t batch = std::stoll(argv[3]);
  const double budget = std::stod(argv[4]);
  const int steps = std::stoi(argv[5]);
  const bool composite = std::string(argv[6]) == "composite";
  const bool smoke = argc >= 8 && std::string(argv[7]) == "--smoke";
  if (policy == "FullPrecision") {
    return memory_child<mixprec::FullPrecision>(batch, budget, steps, composite, smoke);
  }
  if (policy == "MixedO1") return memory_child<Bf16O1>(batch, budget, steps, composite, smoke);
  if (policy == "MixedO2") {
    return memory_child<mixprec::MixedO2<at::BFloat16>>(batch, budget, steps, composite, smoke);
  }
  if (policy == "PureHalf") {
    return memory_child<mixprec::PureHalf<at::BFloat16>>(batch, budget, steps, composite, smoke);
  }
  return 2;
}

// From CMake, not __FILE__: under ccache's base_dir, __FILE__ is relative to the build directory.
std::string python_script() { return MIXPREC_TRAIN_LOOP_SCRIPT; }

}  // namespace

/// A path as the docs show it: relative to the working directory when inside it (the checkout
/// in scripts/bench), so that no machine's absolute paths reach docs/benchmarks.md.
std::string shown_path(const std::string& path) {
  std::error_code error;
  const auto cwd = std::filesystem::current_path(error);
  const auto absolute = std::filesystem::absolute(path, error);
  if (error) return path;
  const auto relative = absolute.lexically_relative(cwd);
  return !relative.empty() && *relative.begin() != ".." ? relative.string() : path;
}

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--memory-child") return memory_child_main(argc, argv);
  const auto options = bench::parse_options(argc, argv);
  signal(SIGPIPE, SIG_IGN);  // a dead Python child is reported, not a silent exit
  try {
    const int threads = at::get_num_threads();
    const char* env_python = std::getenv("MIXPREC_PYTHON");
    const std::string interpreter = env_python != nullptr ? env_python : "/usr/bin/python3";
    const auto total_start = Clock::now();
    PythonChild python(interpreter, python_script());
    const auto ready = split(python.ready());
    std::printf("## mixprec vs Python PyTorch vs hand-written LibTorch\n\n"
                "Command: `%s%s`. Threads: %d intra-op on each side (at::get_num_threads(); "
                "Python: torch.set_num_threads). Python: %s, torch %s, the same LibTorch. "
                "Attention softmax: mixprec::ops::masked_softmax<P> in C++, masked_fill(-inf) + "
                "softmax in Python.\n",
                kCommand, options.smoke ? " --smoke" : "", threads, shown_path(interpreter).c_str(),
                ready.size() > 1 ? ready[1].c_str() : "?");

    std::vector<Workload> workloads;
    models::TaggerConfig tiny;  // overhead-bound on this machine: per-op costs dominate
    tiny.d = 16;
    tiny.heads = 2;
    tiny.seq = 8;
    tiny.batch = 4;
    models::TaggerConfig small;  // d 32, 4 heads, seq 16, batch 8: the example
    const bool smoke = options.smoke;
    workloads.push_back(cnn_workload(smoke ? 8 : 64, smoke ? 1 : 6, 21));
    workloads.push_back(tagger_workload("overhead-bound", tiny, smoke ? 5 : 100, smoke ? 5 : 100,
                                        21, 1.2));
    workloads.push_back(tagger_workload("small (the issue's overhead-bound example)", small,
                                        smoke ? 2 : 30, smoke ? 2 : 30, 21, 1.2));
    workloads.push_back(tagger_workload("compute-bound", compute_bound_config(smoke), 1,
                                        smoke ? 1 : 8, 11, 1.0));
    for (const auto& w : workloads) speed(python, w, options, threads);
    const double speed_s = ms_since(total_start) / 1000.0;

    const auto memory_start = Clock::now();
    memory(argv[0], options);
    std::printf("\nSpeed %.0f s, memory %.0f s. Command: `%s%s`\n", speed_s,
                ms_since(memory_start) / 1000.0, kCommand, options.smoke ? " --smoke" : "");
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "bench_vs_python: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace bench_vs_python
