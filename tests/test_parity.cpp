// Parity with PyTorch's own AMP, loss for loss: the same model, initial weights and data, trained
// by Trainer<P> here and by Python's recipe (tests/parity.py: torch.autocast, torch.amp.GradScaler)
// in a Python whose torch is the LibTorch in use (MIXPREC_PYTHON). Weights and data cross over
// with torch::pickle_save / torch.load. ctest runs this binary as `parity.python` (label python).
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace mp = mixprec;

namespace {

struct StepRecord {
  double loss = 0;
  double scale = 0;
  bool skipped = false;
};

struct Setup {
  std::int64_t steps = 200;
  std::int64_t batch = 32;
  double lr = 0.05;
  double momentum = 0.9;
  double init_scale = std::ldexp(1.0, 30);  // overflows fp16 at first: backoffs, then work
  std::int64_t growth_interval = 16;          // several growths (and new overflows) in 200 steps
};

// A layer a statement: each Linear draws its weights from the generator, and a call's arguments
// are evaluated in the order the compiler picks (GCC and Clang differ): built as one call, the
// model started from other weights under each compiler.
torch::nn::Sequential make_model() {
  torch::nn::Sequential model;
  model->push_back(torch::nn::Linear(16, 64));
  model->push_back(torch::nn::ReLU());
  model->push_back(torch::nn::Linear(64, 64));
  model->push_back(torch::nn::ReLU());
  model->push_back(torch::nn::Linear(64, 4));
  return model;
}

// Inputs of a few hundred rows, labelled by a fixed random linear map.
std::pair<at::Tensor, at::Tensor> make_data() {
  torch::manual_seed(7);
  const auto x = torch::randn({256, 16}) * 3;
  const auto y = x.matmul(torch::randn({16, 4})).argmax(1);
  return {x, y};
}

// The Python side's input, a torch::pickle_save dict: the initial weights (param.NAME), the data
// (x, y) and the settings.
void write_python_input(const std::string& path, const torch::nn::Module& model, const at::Tensor& x,
                        const at::Tensor& y, const std::vector<std::pair<std::string, c10::IValue>>& settings) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  for (const auto& item : model.named_parameters()) {
    dict.insert("param." + item.key(), item.value().detach().clone());
  }
  dict.insert("x", x);
  dict.insert("y", y);
  for (const auto& [key, value] : settings) dict.insert(key, value);
  const auto bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void write_input(const std::string& path, const torch::nn::Sequential& model, const at::Tensor& x,
                 const at::Tensor& y, const Setup& s) {
  write_python_input(path, *model, x, y,
                     {{"steps", s.steps}, {"batch", s.batch}, {"lr", s.lr},
                      {"momentum", s.momentum}, {"init_scale", s.init_scale},
                      {"growth_interval", s.growth_interval}});
}

std::vector<StepRecord> run_python(const std::string& mode, const std::string& input) {
  const auto output = test::temp_path("parity_" + mode + ".txt");
  std::remove(output.c_str());
  const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + MIXPREC_PARITY_SCRIPT + " " +
                       mode + " " + input + " " + output;
  REQUIRE(std::system(command.c_str()) == 0);
  std::vector<StepRecord> records;
  std::ifstream in(output);
  StepRecord r;
  int skipped = 0;
  while (in >> r.loss >> r.scale >> skipped) {
    r.skipped = skipped != 0;
    records.push_back(r);
  }
  return records;
}

template <class P>
std::vector<StepRecord> run_trainer(torch::nn::Sequential model, const at::Tensor& x,
                                    const at::Tensor& y, const Setup& s) {
  torch::optim::SGD sgd(model->parameters(),
                        torch::optim::SGDOptions(s.lr).momentum(s.momentum));
  mp::TrainerOptions options;
  if constexpr (!std::is_same_v<typename P::scaler_type, mp::NoScaler>) {
    options.scaler(mp::GradScalerOptions().init_scale(s.init_scale).growth_interval(s.growth_interval));
  }
  mp::Trainer<P> trainer(model, sgd, options);
  std::vector<StepRecord> records;
  for (std::int64_t step = 0; step < s.steps; ++step) {
    const auto start = (step * s.batch) % x.size(0);
    const auto xb = x.slice(0, start, start + s.batch);
    const auto yb = y.slice(0, start, start + s.batch);
    const auto r = trainer.step([&] {
      return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(xb)), yb);
    });
    records.push_back({r.loss.template item<double>(), r.scale, r.status == mp::StepStatus::skipped});
  }
  return records;
}

/// Trains both ways and compares step by step: the same skips and scales exactly, the losses
/// within `rel` of each other (relative, plus the same absolute floor).
template <class P>
void check_parity(const std::string& mode, double rel) {
  torch::set_num_threads(1);  // as the Python side: one reduction order
  const Setup setup;
  const auto [x, y] = make_data();
  torch::manual_seed(11);
  auto model = make_model();
  const auto input = test::temp_path("parity_" + mode + ".pt");
  write_input(input, model, x, y, setup);
  const auto python = run_python(mode, input);
  const auto cpp = run_trainer<P>(model, x, y, setup);
  REQUIRE(python.size() == cpp.size());
  double max_diff = 0, max_rel = 0;
  int skips = 0, growths = 0;
  for (std::size_t i = 0; i < cpp.size(); ++i) {
    CAPTURE(i);
    CHECK(cpp[i].skipped == python[i].skipped);
    CHECK(cpp[i].scale == python[i].scale);
    const double diff = std::abs(cpp[i].loss - python[i].loss);
    max_diff = std::max(max_diff, diff);
    max_rel = std::max(max_rel, diff / std::max(std::abs(python[i].loss), 1e-3));
    skips += cpp[i].skipped ? 1 : 0;
    if (i > 0 && cpp[i].scale > cpp[i - 1].scale) ++growths;
  }
  MESSAGE(P::name, " vs Python ", mode, ": ", cpp.size(), " steps, ", skips, " skipped, ",
          growths, " growths, largest loss difference ", max_diff, " (relative ", max_rel,
          "), first loss ", cpp.front().loss, ", last ", cpp.back().loss);
  CHECK(max_rel <= rel);
  CHECK(cpp.back().loss < 0.5 * cpp.front().loss);  // it trained
  if (mode == "fp16") {
    CHECK(skips >= 3);    // the initial scale overflowed, several times
    CHECK(growths >= 3);  // and grew back several times
  }
}

}  // namespace

TEST_CASE("parity with PyTorch: FullPrecision vs a plain Python loop") {
  check_parity<mp::FullPrecision>("fp32", 1e-6);
}

TEST_CASE("parity with PyTorch: MixedO1<BFloat16> vs torch.autocast(bfloat16)") {
  check_parity<mp::MixedO1<at::BFloat16>>("bf16", std::ldexp(1.0, -8));  // one bf16 ulp
}

TEST_CASE("parity with PyTorch: MixedO1<Half> vs torch.autocast(float16) + GradScaler(\"cpu\")" *
          doctest::skip(!mp::cpu_half_math)) {
  check_parity<mp::MixedO1<at::Half>>("fp16", std::ldexp(1.0, -11));  // one fp16 ulp
}

namespace {

// One optimizer step of the schedule parity: the lrs it used, its scale and skip, the losses of
// its two micro-batches.
struct ScheduleStep {
  double lr0 = 0, lr1 = 0, scale = 0;
  bool skipped = false;
  double loss0 = 0, loss1 = 0;
};

// tests/parity.py's schedule(): SGD over two param groups, accumulation 2, StepLR or LambdaLR
// driven by the Trainer; the micro-batches in `poison` return loss * inf.
template <class P>
std::vector<ScheduleStep> run_schedule(const std::string& kind, torch::nn::Sequential model,
                                       const at::Tensor& x, const at::Tensor& y,
                                       const std::vector<std::int64_t>& poison, std::int64_t steps,
                                       std::int64_t batch) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back((*model)[0]->parameters(),
                      std::make_unique<torch::optim::SGDOptions>(
                          torch::optim::SGDOptions(0.05).momentum(0.9)));
  std::vector<at::Tensor> rest;
  for (std::size_t i = 1; i < model->size(); ++i) {
    for (const auto& p : (*model)[i]->parameters()) rest.push_back(p);
  }
  groups.emplace_back(rest, std::make_unique<torch::optim::SGDOptions>(
                                torch::optim::SGDOptions(0.02).momentum(0.9)));
  torch::optim::SGD sgd(std::move(groups), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto options = mp::TrainerOptions().accumulation_steps(2);
  if (kind == "step") {
    options.lr_scheduler(std::make_shared<torch::optim::StepLR>(sgd, 3, 0.5));
  } else {
    options.lr_lambda([](std::int64_t k) {
      return k < 4 ? static_cast<double>(k + 1) / 4 : std::ldexp(1.0, -static_cast<int>((k - 4) / 5));
    });
  }
  if constexpr (!std::is_same_v<typename P::scaler_type, mp::NoScaler>) {
    options.scaler(mp::GradScalerOptions().init_scale(std::ldexp(1.0, 30)).growth_interval(4));
  }
  mp::Trainer<P> trainer(model, sgd, options);
  std::vector<ScheduleStep> records;
  for (std::int64_t step = 0; step < steps; ++step) {
    ScheduleStep r;
    r.lr0 = sgd.param_groups()[0].options().get_lr();
    r.lr1 = sgd.param_groups()[1].options().get_lr();
    for (std::int64_t micro = 0; micro < 2; ++micro) {
      const auto i = 2 * step + micro;
      const auto start = (i * batch) % x.size(0);
      const auto xb = x.slice(0, start, start + batch);
      const auto yb = y.slice(0, start, start + batch);
      const bool poisoned = std::find(poison.begin(), poison.end(), i) != poison.end();
      const auto report = trainer.step([&] {
        auto loss = torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(xb)), yb);
        return poisoned ? loss * std::numeric_limits<double>::infinity() : loss;
      });
      CHECK(report.lr == r.lr0);  // the lr this optimizer step uses, on every micro-batch
      (micro == 0 ? r.loss0 : r.loss1) = report.loss.template item<double>();
      if (micro == 1) {
        r.scale = report.scale;
        r.skipped = report.status == mp::StepStatus::skipped;
        CHECK(report.status != mp::StepStatus::accumulating);
      }
    }
    records.push_back(r);
  }
  return records;
}

}  // namespace

TEST_CASE("parity with PyTorch: StepLR and LambdaLR driven by the Trainer, with skips and "
          "accumulation 2, use Python's lr at every step") {
  torch::set_num_threads(1);
  const std::int64_t steps = 30, batch = 16;
  const std::vector<std::int64_t> poison = {9, 30};  // step 4's second, step 15's first micro-batch
  // fp32: a NaN loss skips (any LibTorch); fp16: torch.autocast + GradScaler("cpu") from 2^30,
  // which overflows and grows back (LibTorch >= 2.4, whose Python has a CPU GradScaler).
  std::vector<std::string> configs = {"step_fp32", "lambda_fp32"};
  if (mp::cpu_half_math) {
    configs.emplace_back("step_fp16");
    configs.emplace_back("lambda_fp16");
  }
  std::string joined;
  for (const auto& c : configs) joined += (joined.empty() ? "" : ",") + c;
  const auto [x, y] = make_data();
  torch::manual_seed(17);
  auto initial = make_model();
  const auto input = test::temp_path("parity_schedule.pt");
  write_python_input(input, *initial, x, y,
                     {{"steps", steps}, {"batch", batch}, {"lr0", 0.05}, {"lr1", 0.02},
                      {"init_scale", std::ldexp(1.0, 30)}, {"growth_interval", std::int64_t{4}},
                      {"poison", at::tensor(poison, at::kLong)}, {"configs", joined}});
  const auto output = test::temp_path("parity_schedule.txt");
  std::remove(output.c_str());
  const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + MIXPREC_PARITY_SCRIPT +
                       " schedule " + input + " " + output;
  REQUIRE(std::system(command.c_str()) == 0);
  std::map<std::string, std::vector<ScheduleStep>> python;
  {
    std::ifstream in(output);
    for (std::string line; std::getline(in, line);) {
      std::istringstream fields(line);
      std::string config, lr0, lr1, scale, skipped, loss0, loss1;  // "inf": std::stod reads it
      fields >> config >> lr0 >> lr1 >> scale >> skipped >> loss0 >> loss1;
      python[config].push_back({std::stod(lr0), std::stod(lr1), std::stod(scale), skipped == "1",
                                std::stod(loss0), std::stod(loss1)});
    }
  }
  for (const auto& config : configs) {
    CAPTURE(config);
    const auto kind = config.substr(0, config.find('_'));
    auto model = make_model();
    {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < model->parameters().size(); ++i) {
        model->parameters()[i].copy_(initial->parameters()[i]);
      }
    }
    const auto cpp = config.ends_with("fp16")
                         ? run_schedule<mp::MixedO1<at::Half>>(kind, model, x, y, poison, steps, batch)
                         : run_schedule<mp::FullPrecision>(kind, model, x, y, poison, steps, batch);
    const auto& py = python[config];
    REQUIRE(py.size() == cpp.size());
    int skips = 0, lr_changes = 0;
    double largest = 0;
    for (std::size_t i = 0; i < cpp.size(); ++i) {
      CAPTURE(i);
      CHECK(cpp[i].lr0 == py[i].lr0);  // exactly: the same double arithmetic
      CHECK(cpp[i].lr1 == py[i].lr1);
      CHECK(cpp[i].scale == py[i].scale);
      CHECK(cpp[i].skipped == py[i].skipped);
      skips += cpp[i].skipped ? 1 : 0;
      lr_changes += i > 0 && cpp[i].lr0 != cpp[i - 1].lr0 ? 1 : 0;
      const std::pair<double, double> losses[] = {{cpp[i].loss0, py[i].loss0},
                                                  {cpp[i].loss1, py[i].loss1}};
      for (const auto& [a, b] : losses) {
        if (std::isfinite(b)) {
          largest = std::max(largest, std::abs(a - b) / std::max(std::abs(b), 1e-3));
        } else {
          CHECK(!std::isfinite(a));
        }
      }
    }
    MESSAGE(config, ": ", cpp.size(), " optimizer steps, ", skips, " skipped, ", lr_changes,
            " lr changes, the same lrs at every step; largest relative loss difference ", largest);
    CHECK(skips >= 2);        // the poisoned steps at least, which the schedule counts too
    CHECK(lr_changes >= 5);
    CHECK(largest <= (config.ends_with("fp16") ? std::ldexp(1.0, -11) : 1e-6));
  }
}

namespace {

// What on_step's gradients() gives against Python's p.grad after scaler.step(opt) (parity.py's
// grads()): SGD, two micro-batches per optimizer step, clipping at 0.5 after the unscale; fp16
// through torch.autocast + GradScaler("cpu") from 2^10, growing every 2 steps.
template <class P>
void check_gradient_parity(const std::string& prec, double tolerance) {
  torch::set_num_threads(1);
  const std::int64_t steps = 8, batch = 16;
  const double clip = 0.5;
  const auto [x, y] = make_data();
  torch::manual_seed(19);
  auto model = make_model();
  const auto input = test::temp_path("parity_grads_" + prec + ".pt");
  write_python_input(input, *model, x, y,
                     {{"steps", steps}, {"batch", batch}, {"lr", 0.05}, {"momentum", 0.9},
                      {"clip", clip}, {"prec", prec}, {"init_scale", 1024.0},
                      {"growth_interval", std::int64_t{2}}});
  const auto output = test::temp_path("parity_grads_" + prec + ".txt");
  std::remove(output.c_str());
  const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + MIXPREC_PARITY_SCRIPT +
                       " grads " + input + " " + output;
  REQUIRE(std::system(command.c_str()) == 0);
  std::ifstream python(output);

  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto options = mp::TrainerOptions().accumulation_steps(2).max_grad_norm(clip);
  if constexpr (!std::is_same_v<typename P::scaler_type, mp::NoScaler>) {
    options.scaler(mp::GradScalerOptions().init_scale(1024).growth_interval(2));
  }
  mp::Trainer<P>* self = nullptr;
  double largest = 0, scale_seen = 0;
  std::int64_t read = 0;
  options.on_step([&](const mp::StepReport& report) {
    if (report.status == mp::StepStatus::accumulating) return;
    std::vector<at::Tensor> flat;
    for (const auto& item : self->gradients()) flat.push_back(item.value().value.to(at::kDouble).reshape({-1}));
    const auto ours = at::cat(flat);
    std::string line;
    REQUIRE(std::getline(python, line));
    std::istringstream values(line);
    double scale = 0;
    values >> scale;
    std::vector<double> theirs;
    for (double v = 0; values >> v;) theirs.push_back(v);
    CHECK(report.scale == scale);
    scale_seen = std::max(scale_seen, scale);
    REQUIRE(static_cast<std::int64_t>(theirs.size()) == ours.numel());
    const auto reference = at::tensor(theirs, at::kDouble);
    const double diff = (ours - reference).abs().max().item<double>() /
                        reference.abs().max().item<double>();
    largest = std::max(largest, diff);
    CHECK(diff <= tolerance);
    ++read;
  });
  mp::Trainer<P> trainer(model, sgd, options);
  self = &trainer;
  for (std::int64_t i = 0; i < 2 * steps; ++i) {
    const auto start = (i * batch) % x.size(0);
    const auto xb = x.slice(0, start, start + batch), yb = y.slice(0, start, start + batch);
    trainer.step([&] { return torch::nn::functional::cross_entropy(model->forward(xb), yb); });
  }
  CHECK(read == steps);
  if (prec == "fp16") CHECK(scale_seen >= 4096);  // the scale grew: unscaled by each step's own
  MESSAGE(P::name, " vs Python's p.grad after scaler.step(opt) (", prec, ", accumulation 2, "
          "clipping): largest difference over ", steps, " steps ", largest, " of the largest "
          "gradient");
}

}  // namespace

TEST_CASE("parity with PyTorch: on_step's gradients() are Python's p.grad after "
          "scaler.step(opt), FullPrecision vs a plain loop") {
  check_gradient_parity<mp::FullPrecision>("fp32", 1e-5);
}

TEST_CASE("parity with PyTorch: ... and MixedO1<Half> vs torch.autocast(float16) + "
          "GradScaler(\"cpu\")" * doctest::skip(!mp::cpu_half_math)) {
  // fp32 agrees within 1.5e-7 of the largest gradient: one pass writes grad * (1/scale * clip
  // coefficient, in double), where Python rounds twice (unscale_, then clip_grad_norm_'s
  // multiply), so the weights drift from Python's in their last bits. Under fp16 autocast a
  // weight that drifted across a rounding boundary of its fp16 copy moves a gradient by ~1e-5:
  // 1.09e-5 at step 8 from this model's weights (measured, GCC 12 and Clang 16 alike).
  check_gradient_parity<mp::MixedO1<at::Half>>("fp16", 1e-4);
}

namespace {

// AdamW on a model with a branch taken every other step, against Python's AdamW, whose
// zero_grad() sets gradients to none so that the step skips the unused head: every parameter
// compared after every step.
template <class P>
void check_branch_parity(const std::string& mode, double tolerance,
                         mp::TrainerOptions options = {}) {
  torch::set_num_threads(1);
  const std::int64_t steps = 8, batch = 16;
  const auto [x, y] = make_data();
  torch::manual_seed(13);
  auto model = std::make_shared<test::Branchy>();
  const auto input = test::temp_path("parity_" + mode + ".pt");
  write_python_input(input, *model, x, y,
                     {{"steps", steps}, {"batch", batch}, {"lr", 1e-2}, {"weight_decay", 0.5}});
  const auto output = test::temp_path("parity_" + mode + ".txt");
  std::remove(output.c_str());
  const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + MIXPREC_PARITY_SCRIPT + " " +
                       mode + " " + input + " " + output;
  REQUIRE(std::system(command.c_str()) == 0);
  std::ifstream python(output);

  torch::optim::AdamW adamw(model->parameters(),
                            torch::optim::AdamWOptions(1e-2).weight_decay(0.5));
  mp::Trainer<P> trainer(model, adamw, options);
  double largest = 0;
  for (std::int64_t step = 0; step < steps; ++step) {
    CAPTURE(step);
    const auto xb = x.slice(0, step * batch, (step + 1) * batch);
    const auto yb = y.slice(0, step * batch, (step + 1) * batch);
    REQUIRE(trainer.step([&] {
      return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(xb), step % 2 == 0), yb);
    }).stepped());
    std::vector<at::Tensor> flat;
    for (const auto& p : model->parameters()) flat.push_back(p.detach().to(at::kDouble).reshape({-1}));
    const auto ours = at::cat(flat);
    std::string line;
    REQUIRE(std::getline(python, line));
    std::istringstream values(line);
    std::vector<double> theirs;
    for (double v = 0; values >> v;) theirs.push_back(v);
    REQUIRE(static_cast<std::int64_t>(theirs.size()) == ours.numel());
    const auto diff = (ours - at::tensor(theirs, at::kDouble)).abs().max().item<double>();
    largest = std::max(largest, diff);
    CHECK(diff <= tolerance);
  }
  MESSAGE(P::name, " vs Python AdamW (", mode, "), head b on even steps only: largest parameter "
          "difference over ", steps, " steps ", largest);
}

}  // namespace

TEST_CASE("parity with PyTorch: an unused head is skipped by AdamW, FullPrecision vs plain Python") {
  check_branch_parity<mp::FullPrecision>("branch_fp32", 1e-6);
}

TEST_CASE("parity with PyTorch: ... and MixedO1<BFloat16> vs torch.autocast(bfloat16)") {
  check_branch_parity<mp::MixedO1<at::BFloat16>>("branch_bf16", 1e-6);
}

TEST_CASE("parity with PyTorch: ... and the fused AdamW step" * doctest::skip(!mp::fused_adam_available)) {
  check_branch_parity<mp::FullPrecision>("branch_fp32", 1e-6,
                                         mp::TrainerOptions().fused_optimizer(true));
}

TEST_CASE("parity with PyTorch: the step inside the backward pass (step_in_backward) vs Python's "
          "optimizer-in-backward recipe, FullPrecision" *
          doctest::skip(!mp::post_accumulate_grad_hooks)) {
  check_branch_parity<mp::FullPrecision>("inbackward_fp32", 1e-6,
                                         mp::TrainerOptions().step_in_backward(true));
}

TEST_CASE("parity with PyTorch: ... and MixedO1<BFloat16> vs the recipe under torch.autocast" *
          doctest::skip(!mp::post_accumulate_grad_hooks)) {
  check_branch_parity<mp::MixedO1<at::BFloat16>>("inbackward_bf16", 1e-6,
                                                 mp::TrainerOptions().step_in_backward(true));
}

// ---- MixedFP8<TensorwiseScaling> vs torchao's float8 training (tests/parity_fp8.py): the same
// MLP and transformer block, weights and data; the fp8 operands of the first step byte for byte,
// its outputs and gradients, then the loss of every step.
namespace {

struct Fp8MlpImpl : torch::nn::Module {
  Fp8MlpImpl()
      : fc1(register_module("fc1", mp::nn::Float8Linear(16, 64))),
        fc2(register_module("fc2", mp::nn::Float8Linear(64, 64))),
        head(register_module("head", mp::nn::Float8Linear(64, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return head(torch::gelu(fc2(torch::gelu(fc1(x))))); }
  mp::nn::Float8Linear fc1, fc2, head;
};
TORCH_MODULE(Fp8Mlp);

// A pre-norm transformer block (two heads) and a linear head on the mean over positions.
struct Fp8BlockImpl : torch::nn::Module {
  explicit Fp8BlockImpl(std::int64_t d = 32)
      : norm1(register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        query(register_module("query", mp::nn::Float8Linear(d, d))),
        key(register_module("key", mp::nn::Float8Linear(d, d))),
        value(register_module("value", mp::nn::Float8Linear(d, d))),
        proj(register_module("proj", mp::nn::Float8Linear(d, d))),
        norm2(register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", mp::nn::Float8Linear(d, 4 * d))),
        fc2(register_module("fc2", mp::nn::Float8Linear(4 * d, d))),
        head(register_module("head", mp::nn::Float8Linear(d, 4))) {}
  at::Tensor forward(const at::Tensor& x0) {
    const auto b = x0.size(0), t = x0.size(1), d = x0.size(2), heads = std::int64_t{2};
    const auto split = [&](const at::Tensor& y) { return y.reshape({b, t, heads, d / heads}).transpose(1, 2); };
    const auto h = norm1(x0);
    const auto q = split(query(h)), k = split(key(h)), v = split(value(h));
    const auto scores = torch::matmul(q, k.transpose(-2, -1)) *
                        (1.0 / std::sqrt(static_cast<double>(d / heads)));
    const auto attended = torch::matmul(torch::softmax(scores, -1), v).transpose(1, 2).reshape({b, t, d});
    auto x = x0 + proj(attended);
    x = x + fc2(torch::gelu(fc1(norm2(x))));
    return head(x.mean(1));
  }
  torch::nn::LayerNorm norm1;
  mp::nn::Float8Linear query, key, value, proj;
  torch::nn::LayerNorm norm2;
  mp::nn::Float8Linear fc1, fc2, head;
};
TORCH_MODULE(Fp8Block);

// The losses of `steps` steps of Trainer<P> with AdamW(lr) over the batches of (x, y);
// on_step(step, logits, grads) after each (the step's gradients by parameter name, copied in
// the Trainer's on_step: it clears them after the step), and on_step(-1, {}, {}) once the
// Trainer is built.
template <class P, class Model, class OnStep>
std::vector<double> train_batches(Model& model, const at::Tensor& x, const at::Tensor& y,
                                  std::int64_t steps, std::int64_t batch, double lr, OnStep&& on_step) {
  torch::optim::AdamW adam(model->parameters(), torch::optim::AdamWOptions(lr));
  std::map<std::string, at::Tensor> grads;
  mp::Trainer<P>* self = nullptr;
  mp::Trainer<P> trainer(model, adam, mp::TrainerOptions().on_step([&](const mp::StepReport&) {
    // The step's gradients (the masters' under MixedO2, unscaled), in the model's dtype: the
    // bf16 values torchao's p.grad holds (bf16 -> fp32 -> bf16 is exact).
    for (const auto& item : self->gradients()) {
      const auto dtype = model->named_parameters()[item.key()].scalar_type();
      grads[item.key()] = item.value().value.to(dtype).clone();
    }
  }));
  self = &trainer;
  on_step(-1, at::Tensor(), grads);  // before the first step
  std::vector<double> losses;
  for (std::int64_t step = 0; step < steps; ++step) {
    const auto start = (step * batch) % x.size(0);
    const auto xb = x.slice(0, start, start + batch);
    const auto yb = y.slice(0, start, start + batch);
    at::Tensor logits;
    const auto report = trainer.step([&] {
      logits = model->forward(trainer.cast_input(xb));
      return torch::nn::functional::cross_entropy(logits.to(at::kFloat), yb);
    });
    REQUIRE(report.stepped());
    on_step(step, logits, grads);
    losses.push_back(report.loss.template item<double>());
  }
  return losses;
}

// torchao's name of a recipe (Float8LinearConfig.from_recipe_name).
template <class Recipe>
std::string torchao_recipe() {
  if constexpr (!Recipe::rowwise) {
    return "tensorwise";
  } else if constexpr (Recipe::weight_grad_fp8) {
    return "rowwise";
  } else {
    return "rowwise_with_gw_hp";
  }
}

// The casts a layer makes in a step, in the order of Fp8Operands (tests/parity_fp8.py's names).
const std::vector<std::string>& fp8_cast_names() {
  static const std::vector<std::string> names{"input", "weight", "grad_output",
                                              "weight_for_grad_input",
                                              "grad_output_for_grad_weight",
                                              "input_for_grad_weight"};
  return names;
}

// MixedFP8<Recipe> against torchao's recipe of that name in `python` (parity_fp8.py's output):
// the fp8 operands of the first step, its outputs and gradients, the loss of every step.
// `bf16`: the losses of MixedO2<BFloat16> on the same model and data.
template <class Recipe, class Model>
void compare_with_torchao(const std::string& kind, const at::Tensor& x, const at::Tensor& y,
                          const c10::impl::GenericDict& python, const std::vector<double>& bf16,
                          std::int64_t steps, std::int64_t batch, double lr) {
  using P = mp::MixedFP8<Recipe>;
  const auto recipe = torchao_recipe<Recipe>();
  INFO(kind, ", ", recipe);
  const auto theirs = [&](const std::string& key) {
    INFO((recipe + "." + key));
    REQUIRE(python.contains(recipe + "." + key));
    return python.at(recipe + "." + key).toTensor();
  };
  torch::manual_seed(11);
  Model model;
  // mixprec: the head kept in bf16 for the block, as torchao's module_filter_fn does there.
  if (kind == "block") {
    mp::apply_precision_map<P>(model, mp::PrecisionMap().add("head", mp::Precision::low));
  }
  std::vector<std::pair<std::string, mp::nn::Float8LinearImpl*>> layers;
  double first_diff = 0;
  std::int64_t operands = 0;
  std::vector<double> weights, gradients;  // each step's fingerprints, as parity_fp8.py's
  const auto ours = train_batches<P>(model, x, y, steps, batch, lr, [&](std::int64_t step, const at::Tensor& logits,
                                                                              const std::map<std::string, at::Tensor>& grads) {
    if (step >= 0) {
      std::vector<at::Tensor> params, grad_list;
      for (const auto& item : model->named_parameters()) {
        params.push_back(item.value());
        grad_list.push_back(grads.at(item.key()));
      }
      weights.push_back(test::fingerprint(params));
      gradients.push_back(test::fingerprint(grad_list));
    }
    if (step == -1) {
      for (const auto& item : model->named_modules("", false)) {
        auto* layer = item.value()->template as<mp::nn::Float8LinearImpl>();
        if (layer != nullptr && layer->computes_fp8()) {
          layer->keep_operands();
          layers.emplace_back(item.key(), layer);
        }
      }
      REQUIRE(layers.size() == (kind == "block" ? 6U : 3U));
    } else if (step == 0) {
      // The fp8 operands: the same scales (shapes too) and bytes, for each cast torchao made.
      // Tensorwise scaling casts each operand once and reuses it; torchao casts it again for
      // the backward products, the same bytes.
      for (const auto& [name, layer] : layers) {
        const auto& ops = layer->last_operands();
        const std::vector<const mp::Fp8Tensor*> cast{&ops.input, &ops.weight, &ops.grad_output,
                                                     &ops.weight_for_grad_input,
                                                     &ops.grad_output_for_grad_weight,
                                                     &ops.input_for_grad_weight};
        const std::vector<const mp::Fp8Tensor*> reused{nullptr, nullptr, nullptr, &ops.weight,
                                                       &ops.grad_output, &ops.input};
        for (std::size_t i = 0; i < cast.size(); ++i) {
          const auto key = "ops." + name + "." + fp8_cast_names()[i];
          INFO(key);
          const auto* t = cast[i]->data.defined() ? cast[i] : Recipe::rowwise ? nullptr : reused[i];
          if (t == nullptr && i >= 4 && !Recipe::weight_grad_fp8) {
            // grad_weight in bf16: neither side casts for it.
            CHECK_FALSE(python.contains(recipe + "." + key + ".scale"));
            continue;
          }
          if (t == nullptr) {
            // grad_input of the MLP's first layer, whose input needs no gradient: torchao
            // computes it anyway, mixprec does not (the rowwise recipes cast for it alone).
            CHECK((kind == "mlp" && name == "fc1" && (i == 2 || i == 3)));
            continue;
          }
          CHECK(t->scale.equal(theirs(key + ".scale")));
          CHECK(test::bytes_of(t->data).equal(theirs(key + ".bytes").reshape({-1})));
          ++operands;
        }
      }
      // Outputs and gradients of the first step.
      const auto diff = [&](const at::Tensor& a, const at::Tensor& b) {
        return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().template item<double>();
      };
      first_diff = diff(logits.detach(), theirs("first.logits"));
      for (const auto& item : model->named_parameters()) {
        first_diff = std::max(first_diff, diff(grads.at(item.key()), theirs("first.grad." + item.key())));
      }
    }
  });
  double loss_diff = 0, fp8_effect = 0;
  std::int64_t identical_steps = 0;  // from the first, the steps whose losses are bitwise equal
  // The steps that both sides began from the same bf16 weights (the first, and each after a
  // step that left them equal): each must give the same loss and gradients, bit for bit.
  std::int64_t same_start = 0, same_result = 0;
  const auto their_weights = theirs("weights"), their_gradients = theirs("grads");
  for (std::int64_t step = 0; step < steps; ++step) {
    const auto s = static_cast<std::size_t>(step);
    const double python_loss = theirs("losses")[step].template item<double>();
    if (ours[s] == python_loss && identical_steps == step) identical_steps = step + 1;
    if (step == 0 || weights[s - 1] == their_weights[step - 1].template item<double>()) {
      ++same_start;
      same_result += ours[s] == python_loss &&
                     gradients[s] == their_gradients[step].template item<double>() ? 1 : 0;
    }
    loss_diff = std::max(loss_diff, std::abs(ours[s] - python_loss));
    fp8_effect = std::max(fp8_effect, std::abs(bf16[s] - python_loss));
  }
  const double first = theirs("losses")[0].template item<double>();
  const double last = theirs("losses")[steps - 1].template item<double>();
  MESSAGE(kind, ", ", P::name, " vs torchao's ", recipe, ", ", steps, " steps: the first step's ",
          operands, " fp8 operands compared (scales and bytes), its outputs and gradients largest "
          "difference ", first_diff, "; ", same_start, " steps began from the same bf16 weights, ",
          same_result, " of them gave the same loss and gradients; losses identical for the "
          "first ", identical_steps, " steps, largest loss difference ", loss_diff, " (loss ",
          first, " -> ", last, "); torchao vs MixedO2<BFloat16>: ", fp8_effect);
  const auto casts = static_cast<std::int64_t>(layers.size()) * (Recipe::weight_grad_fp8 ? 6 : 4);
  CHECK(operands == casts - (Recipe::rowwise && kind == "mlp" ? 2 : 0));
  CHECK(first_diff == 0.0);
  // Bit for bit from the same weights. The runs part where an fp32 master first rounds to
  // another bf16 weight (AdamW's arithmetic differs between LibTorch and Python in the last
  // fp32 bit), a step that chance picks (the 11th for the block under RowwiseScaling, the
  // 43rd under TensorwiseScaling); from there they are two draws of the same fp8 rounding
  // noise, which stay closer to each other than fp8 is to bf16.
  CHECK(same_result == same_start);
  CHECK(same_start >= 5);
  CHECK(loss_diff <= 0.5 * fp8_effect);
  CHECK(last < 0.7 * first);  // it trained
}

// Model under each of torchao's three recipes against MixedFP8 with the same recipe: one
// Python process trains all three (tests/parity_fp8.py), the same weights and data.
template <class Model, class... Recipes>
void check_torchao_parity(const std::string& kind, const at::Tensor& x, const at::Tensor& y) {
  torch::manual_seed(11);
  Model model;
  torch::set_num_threads(1);  // as the Python side: one reduction order
  const std::int64_t steps = 120, batch = 32;
  const double lr = 3e-3;
  const auto input = test::temp_path("parity_fp8_" + kind + ".pt");
  const auto output = test::temp_path("parity_fp8_" + kind + ".out.pt");
  write_python_input(input, *model, x, y, {{"steps", steps}, {"batch", batch}, {"lr", lr}});
  std::remove(output.c_str());
  std::string recipes;
  ((recipes += (recipes.empty() ? "" : ",") + torchao_recipe<Recipes>()), ...);
  const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + MIXPREC_PARITY_FP8_SCRIPT + " " +
                       kind + " " + input + " " + output + " " + recipes;
  REQUIRE(std::system(command.c_str()) == 0);
  std::ifstream in(output, std::ios::binary);
  const std::vector<char> saved((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto python = torch::pickle_load(saved).toGenericDict();
  // The same model and data under MixedO2<BFloat16>: how far fp8 itself moves the losses.
  torch::manual_seed(11);
  Model bf16_model;
  const auto bf16 = train_batches<mp::MixedO2<at::BFloat16>>(bf16_model, x, y, steps, batch, lr,
                                                             [](std::int64_t, const at::Tensor&,
                                                                const std::map<std::string, at::Tensor>&) {});
  (compare_with_torchao<Recipes, Model>(kind, x, y, python, bf16, steps, batch, lr), ...);
}

}  // namespace

// Stochastic rounding draws its bits from a hash here and from torch's generator in torchao:
// two runs are two draws of the same noise, never the same bits. So both sides train the same
// model, weights and data under kSeeds seeds each, and each window of 25 steps' mean loss is
// compared as two samples: the difference of the two sides' means within 4 standard errors
// (from the spread of each side's seeds), plus a floor of 1 % of the loss for the rest of what
// differs (torchao's lerp for the moments, LibTorch's mul_/add_).
TEST_CASE("parity with torchao: PureHalf<BFloat16, StochasticRounding<>> vs "
          "_AdamW(bf16_stochastic_round=True)" *
          doctest::skip(!mp::has_fp8)) {  // torchao: in the wheel's venv (LibTorch >= 2.5) only
  torch::set_num_threads(1);
  constexpr int kSeeds = 4, kWindow = 25;
  Setup setup;
  setup.lr = 2e-3;
  const double weight_decay = 0.01;
  const auto [x, y] = make_data();
  torch::manual_seed(11);
  auto initial = make_model();
  const auto input = test::temp_path("parity_sr.pt");
  write_python_input(input, *initial, x, y,
                     {{"steps", setup.steps}, {"batch", setup.batch}, {"lr", setup.lr},
                      {"weight_decay", weight_decay}, {"seeds", static_cast<std::int64_t>(kSeeds)}});
  const auto output = test::temp_path("parity_sr.txt");
  std::remove(output.c_str());
  const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + MIXPREC_PARITY_SCRIPT +
                       " sr_adamw " + input + " " + output;
  REQUIRE(std::system(command.c_str()) == 0);
  std::vector<std::vector<double>> python(kSeeds), cpp(kSeeds);
  {
    std::ifstream in(output);
    double loss = 0;
    for (std::int64_t step = 0; step < setup.steps; ++step) {
      for (int s = 0; s < kSeeds; ++s) {
        REQUIRE(static_cast<bool>(in >> loss));
        python[static_cast<std::size_t>(s)].push_back(loss);
      }
    }
  }
  using P = mp::PureHalf<at::BFloat16, mp::StochasticRounding<>>;
  for (int s = 0; s < kSeeds; ++s) {
    auto model = make_model();
    {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < model->parameters().size(); ++i) {
        model->parameters()[i].copy_(initial->parameters()[i]);
      }
    }
    torch::optim::AdamW adamw(model->parameters(),
                              torch::optim::AdamWOptions(setup.lr).weight_decay(weight_decay));
    mp::Trainer<P> trainer(model, adamw,
                           mp::TrainerOptions().rounding_seed(static_cast<std::uint64_t>(s)));
    for (std::int64_t step = 0; step < setup.steps; ++step) {
      const auto start = (step * setup.batch) % x.size(0);
      const auto xb = x.slice(0, start, start + setup.batch);
      const auto yb = y.slice(0, start, start + setup.batch);
      const auto r = trainer.step([&] {
        return torch::nn::functional::cross_entropy(
            model->forward(trainer.cast_input(xb)).to(at::kFloat), yb);
      });
      cpp[static_cast<std::size_t>(s)].push_back(r.loss.item<double>());
    }
  }
  const auto window_means = [&](const std::vector<double>& run) {
    std::vector<double> means;
    for (std::size_t w = 0; w + kWindow <= run.size(); w += kWindow) {
      double sum = 0;
      for (std::size_t i = w; i < w + kWindow; ++i) sum += run[i];
      means.push_back(sum / kWindow);
    }
    return means;
  };
  const auto mean_and_variance = [](const std::vector<double>& v) {
    double m = 0, var = 0;
    for (const double a : v) m += a;
    m /= static_cast<double>(v.size());
    for (const double a : v) var += (a - m) * (a - m);
    return std::make_pair(m, var / static_cast<double>(v.size() - 1));
  };
  const auto windows = window_means(cpp[0]).size();
  double worst = 0;  // the largest difference in standard errors
  for (std::size_t w = 0; w < windows; ++w) {
    std::vector<double> a, b;
    for (int s = 0; s < kSeeds; ++s) {
      a.push_back(window_means(cpp[static_cast<std::size_t>(s)])[w]);
      b.push_back(window_means(python[static_cast<std::size_t>(s)])[w]);
    }
    const auto [ma, va] = mean_and_variance(a);
    const auto [mb, vb] = mean_and_variance(b);
    const double se = std::sqrt(va / kSeeds + vb / kSeeds);
    const double diff = std::abs(ma - mb);
    CHECK(diff <= 4 * se + 0.01 * mb);
    worst = std::max(worst, diff / (se + 1e-12));
    MESSAGE("window ", w, ": mixprec ", ma, ", torchao ", mb, ", difference ", diff,
            " (standard error ", se, ")");
  }
  MESSAGE("stochastic rounding vs torchao: ", windows, " windows of ", kWindow,
          " steps, largest difference ", worst, " standard errors");
  const auto first = window_means(cpp[0]).front(), last = window_means(cpp[0]).back();
  CHECK(last < 0.5 * first);  // it trained
}

TEST_CASE("parity with torchao: MixedFP8 vs Float8Linear (tensorwise, rowwise, "
          "rowwise_with_gw_hp), an MLP" * doctest::skip(!mp::has_fp8)) {
  test::with_fp8_recipes<mp::TensorwiseScaling, mp::RowwiseScaling, mp::RowwiseScalingWithGwHp>(
      [](auto... recipes) {
    torch::manual_seed(7);
    const auto x = torch::randn({256, 16}) * 3;
    const auto y = x.matmul(torch::randn({16, 4})).argmax(1);
    check_torchao_parity<Fp8Mlp, decltype(recipes)...>("mlp", x, y);
  });
}

TEST_CASE("parity with torchao: MixedFP8 vs Float8Linear (tensorwise, rowwise, "
          "rowwise_with_gw_hp), a transformer block" * doctest::skip(!mp::has_fp8)) {
  test::with_fp8_recipes<mp::TensorwiseScaling, mp::RowwiseScaling, mp::RowwiseScalingWithGwHp>(
      [](auto... recipes) {
    torch::manual_seed(7);
    const auto x = torch::randn({256, 8, 32});
    const auto y = x.mean(1).matmul(torch::randn({32, 4})).argmax(1);
    check_torchao_parity<Fp8Block, decltype(recipes)...>("block", x, y);
  });
}
