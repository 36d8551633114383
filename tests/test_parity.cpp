// Parity with PyTorch's own AMP, loss for loss: the same model, initial weights and data, trained
// by Trainer<P> here and by Python's recipe (tests/parity.py: torch.autocast, torch.amp.GradScaler)
// in a Python whose torch is the LibTorch in use (MIXPREC_PYTHON). Weights and data cross over
// with torch::pickle_save / torch.load. ctest runs this binary as `parity.python` (label python).
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
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

torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 4));
}

// Inputs of a few hundred rows, labelled by a fixed random linear map.
std::pair<at::Tensor, at::Tensor> make_data() {
  torch::manual_seed(7);
  const auto x = torch::randn({256, 16}) * 3;
  const auto y = x.matmul(torch::randn({16, 4})).argmax(1);
  return {x, y};
}

void write_input(const std::string& path, const torch::nn::Sequential& model, const at::Tensor& x,
                 const at::Tensor& y, const Setup& s) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  for (const auto& item : model->named_parameters()) {
    dict.insert("param." + item.key(), item.value().detach().clone());
  }
  dict.insert("x", x);
  dict.insert("y", y);
  dict.insert("steps", s.steps);
  dict.insert("batch", s.batch);
  dict.insert("lr", s.lr);
  dict.insert("momentum", s.momentum);
  dict.insert("init_scale", s.init_scale);
  dict.insert("growth_interval", s.growth_interval);
  const auto bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
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
  {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    for (const auto& item : model->named_parameters()) {
      dict.insert("param." + item.key(), item.value().detach().clone());
    }
    dict.insert("x", x);
    dict.insert("y", y);
    dict.insert("steps", steps);
    dict.insert("batch", batch);
    dict.insert("lr", 1e-2);
    dict.insert("weight_decay", 0.5);
    const auto bytes = torch::pickle_save(c10::IValue(dict));
    std::ofstream(input, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
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
