// The set of tensors a Trainer works on, over the models users build: tied weights, frozen
// layers, an optimizer over a subset, several param groups, groups added after construction,
// two trainers on one model. Every policy is compared with a hand-written fp32 LibTorch loop.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>

namespace test_models {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

// MixedO2<BFloat16> with dynamic scaling: a tensor unscaled twice is off by a factor of 65536.
struct ScaledO2 : mp::MixedO2<at::BFloat16> {
  static constexpr std::string_view name = "ScaledO2";
  using scaler_type = mp::GradScaler;
};

#define EVERY_POLICY \
  mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>, \
      mp::PureHalf<at::BFloat16>, ScaledO2

// A Sequential body plus a parameter that a late-group scenario registers after construction.
struct Model : torch::nn::Module {
  explicit Model(torch::nn::Sequential b) : body(register_module("body", std::move(b))) {}
  at::Tensor forward(const at::Tensor& x) {
    auto y = body->forward(x);
    return offset.defined() ? y + offset : y;
  }
  torch::nn::Sequential body;
  at::Tensor offset;
};

// Each tensor once, in first-seen order: what Python's model.parameters() gives.
std::vector<at::Tensor> unique(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const void*> seen;
  std::vector<at::Tensor> result;
  for (const auto& t : tensors) {
    if (seen.insert(t.unsafeGetTensorImpl()).second) result.push_back(t);
  }
  return result;
}

std::vector<at::Tensor> optimizer_params(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> result;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) result.push_back(p);
  }
  return result;
}

struct Data {
  at::Tensor x, y;
  Data() {
    torch::manual_seed(11);
    x = torch::randn({6 * 32, 8});
    y = torch::sin(x.sum(1, /*keepdim=*/true));
  }
  at::Tensor batch_x(int i) const { return x.slice(0, i * 32, i * 32 + 32); }
  at::Tensor batch_y(int i) const { return y.slice(0, i * 32, i * 32 + 32); }
};

// A model, its optimizer, and what happens to them before step i (the late group).
struct Setup {
  std::shared_ptr<Model> model;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::function<void(int, Model&, torch::optim::Optimizer&)> before_step;
};

enum class Scenario { tied, frozen, groups, late_group, unfrozen };
constexpr Scenario kScenarios[] = {Scenario::tied, Scenario::frozen, Scenario::groups,
                                   Scenario::late_group, Scenario::unfrozen};
const char* name_of(Scenario s) {
  switch (s) {
    case Scenario::tied: return "tied weights";
    case Scenario::frozen: return "frozen layer, optimizer over a subset";
    case Scenario::groups: return "two param groups, different lr and momentum";
    case Scenario::late_group: return "a group added after construction (unfreezing)";
    case Scenario::unfrozen: return "a frozen layer in the optimizer, unfrozen by requires_grad";
  }
  return "";
}

// The same model and optimizer for the Trainer and for the reference loop. A user's optimizer
// gets model->parameters() (tied tensors listed twice, as LibTorch does); the reference gets
// the de-duplicated list, as Python's model.parameters() is.
Setup make(Scenario scenario, bool reference) {
  namespace nn = torch::nn;
  torch::manual_seed(5);
  Setup s;
  auto sgd = [](double lr, double momentum = 0.0) {
    return std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(lr).momentum(momentum));
  };
  switch (scenario) {
    case Scenario::tied: {
      auto shared = nn::Linear(8, 8);
      s.model = std::make_shared<Model>(nn::Sequential(shared, nn::Tanh(), shared, nn::Tanh(), nn::Linear(8, 1)));
      auto params = s.model->parameters();
      s.optimizer = std::make_unique<torch::optim::SGD>(reference ? unique(params) : params, *sgd(0.5));
      break;
    }
    case Scenario::frozen: {
      // Layer 0 frozen by requires_grad, layer 2 left out of the optimizer.
      s.model = std::make_shared<Model>(nn::Sequential(nn::Linear(8, 16), nn::Tanh(), nn::Linear(16, 16),
                                                       nn::Tanh(), nn::Linear(16, 1)));
      for (auto& p : s.model->body[0]->parameters()) p.requires_grad_(false);
      auto params = s.model->body[0]->parameters();
      for (auto& p : s.model->body[4]->parameters()) params.push_back(p);
      s.optimizer = std::make_unique<torch::optim::SGD>(params, *sgd(0.5));
      break;
    }
    case Scenario::groups: {
      s.model = std::make_shared<Model>(nn::Sequential(nn::Linear(8, 16), nn::Tanh(), nn::Linear(16, 1)));
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(s.model->body[2]->parameters(), sgd(0.25, 0.5));
      groups.emplace_back(s.model->body[0]->parameters(), sgd(0.5));
      s.optimizer = std::make_unique<torch::optim::SGD>(groups, *sgd(0.125));
      break;
    }
    case Scenario::late_group: {
      s.model = std::make_shared<Model>(nn::Sequential(nn::Linear(8, 16), nn::Tanh(), nn::Linear(16, 1)));
      s.optimizer = std::make_unique<torch::optim::SGD>(s.model->body[2]->parameters(), *sgd(0.5));
      s.before_step = [](int i, Model& model, torch::optim::Optimizer& optimizer) {
        if (i != 2) return;
        // Unfreeze layer 0 (cast to Low since construction under O2/O3) and train a new fp32
        // parameter, in a group of its own lr.
        model.offset = model.register_parameter("offset", torch::full({1}, 0.25));
        auto params = model.body[0]->parameters();
        params.push_back(model.offset);
        optimizer.add_param_group(torch::optim::OptimizerParamGroup(params, std::make_unique<torch::optim::SGDOptions>(0.25)));
      };
      break;
    }
    case Scenario::unfrozen: {
      s.model = std::make_shared<Model>(nn::Sequential(nn::Linear(8, 16), nn::Tanh(), nn::Linear(16, 1)));
      for (auto& p : s.model->body[0]->parameters()) p.requires_grad_(false);
      s.optimizer = std::make_unique<torch::optim::SGD>(s.model->parameters(), *sgd(0.5));
      s.before_step = [](int i, Model& model, torch::optim::Optimizer&) {
        if (i == 2) {
          for (auto& p : model.body[0]->parameters()) p.requires_grad_(true);
        }
      };
      break;
    }
  }
  return s;
}

constexpr int kSteps = 5;

at::Tensor mse(const at::Tensor& out, const at::Tensor& y) {
  return torch::mse_loss(out.to(at::kFloat), y);
}

// Parameters by name, before and after training (a late parameter starts at its initial value),
// and each step's gradient norm.
struct Trace {
  std::map<std::string, at::Tensor> before, after;
  std::vector<double> norms;
};

std::map<std::string, at::Tensor> named_snapshot(const Model& model) {
  std::map<std::string, at::Tensor> result;
  for (const auto& item : model.named_parameters()) result[item.key()] = item.value().detach().clone();
  return result;
}

void finish(Trace& t, const Model& model) {
  t.after = named_snapshot(model);
  if (t.after.count("offset") == 1 && t.before.count("offset") == 0) t.before["offset"] = torch::full({1}, 0.25);
}

// Plain LibTorch in fp32: zero_grad, backward (over n micro-batches, each loss divided by n: the
// accumulation recipe of PyTorch's users), clip_grad_norm_ over the optimizer's tensors (each
// once), step. Against the whole batch in one backward, the sum of the micro-batches' gradients
// rounds differently, by more than the sum's size where they cancel (an output bias).
Trace reference_run(Scenario scenario, std::optional<double> clip, const Data& data,
                    std::int64_t n = 1) {
  auto s = make(scenario, /*reference=*/true);
  Trace t;
  t.before = named_snapshot(*s.model);
  for (int i = 0; i < kSteps; ++i) {
    if (s.before_step) s.before_step(i, *s.model, *s.optimizer);
    s.optimizer->zero_grad();
    const auto x = data.batch_x(i), y = data.batch_y(i);
    const auto size = x.size(0) / n;
    for (std::int64_t k = 0; k < n; ++k) {
      (mse(s.model->forward(x.slice(0, k * size, k * size + size)), y.slice(0, k * size, k * size + size)) /
       static_cast<double>(n)).backward();
    }
    if (clip) {
      t.norms.push_back(torch::nn::utils::clip_grad_norm_(unique(optimizer_params(*s.optimizer)), *clip));
    }
    s.optimizer->step();
  }
  finish(t, *s.model);
  return t;
}

template <class P>
Trace trainer_run(Scenario scenario, std::optional<double> clip, std::int64_t n, const Data& data) {
  auto s = make(scenario, /*reference=*/false);
  Trace t;
  t.before = named_snapshot(*s.model);
  mp::Trainer<P> trainer(s.model, *s.optimizer,
                         mp::TrainerOptions().max_grad_norm(clip).accumulation_steps(n));
  for (int i = 0; i < kSteps; ++i) {
    if (s.before_step) s.before_step(i, *s.model, *s.optimizer);
    const auto x = data.batch_x(i), y = data.batch_y(i);
    const auto size = x.size(0) / n;
    for (std::int64_t k = 0; k < n; ++k) {
      const auto report = trainer.step([&] {
        return mse(s.model->forward(trainer.cast_input(x.slice(0, k * size, k * size + size))),
                   y.slice(0, k * size, k * size + size));
      });
      REQUIRE(report.status == (k + 1 < n ? mp::StepStatus::accumulating : mp::StepStatus::stepped));
      if (k + 1 == n && clip) t.norms.push_back(report.grad_norm.value());
    }
  }
  finish(t, *s.model);
  // Under O2 every tensor the optimizer trains has one master, and the model holds it rounded.
  if constexpr (P::master_weights) {
    const auto masters = trainer.master_weights();
    CHECK(masters.size() == unique(optimizer_params(*s.optimizer)).size());
    CHECK(test::identical(unique(optimizer_params(*s.optimizer)), masters));
  }
  return t;
}

// Each parameter's change against the reference's: equal within `eps` times (4 x the change,
// for gradients computed in Low, plus kSteps x the weight, for Low weights rounded every step).
void check_updates(const Trace& got, const Trace& expected, double eps) {
  for (const auto& [name, after] : got.after) {
    CAPTURE(name);
    const auto update = after.to(at::kDouble) - got.before.at(name).to(at::kDouble);
    const auto expected_update =
        expected.after.at(name).to(at::kDouble) - expected.before.at(name).to(at::kDouble);
    const double error = (update - expected_update).abs().max().item<double>();
    const double bound = eps * (4 * expected_update.abs().max().item<double>() +
                                kSteps * expected.before.at(name).abs().max().item<double>());
    CHECK(error <= bound);
  }
}

template <class P>
double epsilon() {
  return P::low_dtype == at::kFloat ? std::ldexp(1.0, -23) : std::ldexp(1.0, -7);  // bf16: 2^-7
}

}  // namespace

TEST_CASE_TEMPLATE("every policy matches the fp32 reference loop on the models users build", P,
                   EVERY_POLICY) {
  const Data data;
  for (const auto scenario : kScenarios) {
    for (const std::optional<double> clip : {std::optional<double>(), std::optional<double>(0.25)}) {
      for (const std::int64_t n : {1, 2}) {
        const auto expected = reference_run(scenario, clip, data, n);
        CAPTURE(name_of(scenario));
        CAPTURE(clip.has_value());
        CAPTURE(n);
        const Trace got = trainer_run<P>(scenario, clip, n, data);
        REQUIRE(got.after.size() == expected.after.size());
        // fp32, one micro-batch, no clipping: the same operations in the same order.
        check_updates(got, expected, P::low_dtype == at::kFloat && n == 1 && !clip ? 0.0 : epsilon<P>());
        REQUIRE(got.norms.size() == expected.norms.size());
        for (std::size_t i = 0; i < got.norms.size(); ++i) {
          CHECK(std::abs(got.norms[i] - expected.norms[i]) <= 8 * epsilon<P>() * expected.norms[i]);
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("tied weights: clipped, unscaled and counted once, as PyTorch's clip_grad_norm_", P,
                   EVERY_POLICY) {
  // The repro: one Linear registered twice, SGD on parameters(), max_grad_norm 0.5.
  const Data data;
  const auto expected = reference_run(Scenario::tied, 0.25, data);
  for (const std::int64_t n : {1, 2}) {
    CAPTURE(n);
    const Trace got = trainer_run<P>(Scenario::tied, 0.25, n, data);
    CHECK(got.norms.front() == doctest::Approx(expected.norms.front()).epsilon(8 * epsilon<P>()));
  }
}

TEST_CASE("GradScaler::unscale_ on an optimizer that holds a tensor twice unscales it once") {
  // Dyadic: grad 4 * (3, 4) under scale 4 is (3, 4) unscaled, norm 5; clipped to 2.5 it halves.
  auto w = torch::zeros({2}, torch::requires_grad());
  auto run = [&](std::optional<double> clip) {
    torch::optim::SGD sgd(std::vector<at::Tensor>{w, w}, torch::optim::SGDOptions(1.0));
    mp::GradScaler scaler(mp::GradScalerOptions().init_scale(4.0));
    w.mutable_grad() = at::Tensor();
    scaler.scale((w * torch::tensor({3.0F, 4.0F})).sum()).backward();
    const auto norm = scaler.unscale_(sgd, mp::UnscaleOptions().max_grad_norm(clip));
    return std::make_pair(norm, w.grad().clone());
  };
  const auto [no_norm, unscaled] = run(std::nullopt);
  CHECK(unscaled.equal(torch::tensor({3.0F, 4.0F})));
  const auto [norm, clipped] = run(2.5);
  CHECK(norm.value() == doctest::Approx(5.0).epsilon(1e-12));
  CHECK(clipped.allclose(torch::tensor({1.5F, 2.0F}), 1e-6, 0.0));
  CHECK_FALSE(no_norm.has_value());
}

TEST_CASE("the Trainer's unscale with grads_from: a repeated tensor needs the same source") {
  auto master = torch::zeros({2}, torch::requires_grad());
  auto model = torch::zeros({2}, at::TensorOptions(at::kBFloat16).requires_grad(true));
  auto other = torch::zeros({2}, at::TensorOptions(at::kBFloat16).requires_grad(true));
  model.mutable_grad() = torch::tensor({6.0, 8.0}, at::kBFloat16);
  other.mutable_grad() = torch::tensor({1.0, 1.0}, at::kBFloat16);
  torch::optim::SGD sgd(std::vector<at::Tensor>{master, master}, torch::optim::SGDOptions(1.0));
  {
    mp::detail::StepEngine scaler(/*allow_fp16=*/false);
    scaler.use_scale(2.0);
    (void)scaler.scale(torch::ones({}));
    CHECK_THROWS_WITH_AS(scaler.unscale_planned(sgd, mp::detail::UnscalePlan().grads_from({model, other})),
                         doctest::Contains("grads_from[1]"), mp::Error);
    CHECK_FALSE(master.grad().defined());  // nothing written
    // Consistent: the norm counts the tensor once, (3, 4) -> 5.
    const auto norm = scaler.unscale_planned(sgd, mp::detail::UnscalePlan().grads_from({model, model}).max_grad_norm(100.0));
    CHECK(norm.value() == 5.0);
    CHECK(master.grad().equal(torch::tensor({3.0F, 4.0F})));
  }
}

TEST_CASE("one tensor in two param groups is an Error, from the Trainer and the scaler") {
  auto check_refused = [](auto policy_tag) {
    using P = decltype(policy_tag);
    auto model = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 1));
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(model[0]->parameters());
    groups.emplace_back(std::vector<at::Tensor>{model[1]->as<torch::nn::Linear>()->weight,
                                                model[0]->as<torch::nn::Linear>()->bias});
    torch::optim::SGD sgd(groups, torch::optim::SGDOptions(0.1));
    const auto before = test::snapshot(model->parameters());
    CHECK_THROWS_WITH_AS(mp::Trainer<P>(model, sgd), doctest::Contains("param groups 0 and 1"),
                         mp::Error);
    CHECK(test::identical(test::snapshot(model->parameters()), before));  // still fp32, untouched
    CHECK(sgd.param_groups()[1].params()[1].is_same(model[0]->as<torch::nn::Linear>()->bias));
    // The model is free again for a Trainer with a valid optimizer.
    torch::optim::SGD good(model->parameters(), torch::optim::SGDOptions(0.1));
    CHECK_NOTHROW(mp::Trainer<P>(model, good));
  };
  check_refused(mp::FullPrecision{});
  check_refused(mp::MixedO2<at::BFloat16>{});
  check_refused(mp::PureHalf<at::BFloat16>{});

  auto w = torch::zeros({2}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{w});
  groups.emplace_back(std::vector<at::Tensor>{w});
  torch::optim::SGD sgd(groups, torch::optim::SGDOptions(0.1));
  mp::GradScaler scaler(mp::GradScalerOptions().init_scale(2.0));
  scaler.scale(w.sum()).backward();
  CHECK_THROWS_WITH_AS(scaler.unscale_(sgd), doctest::Contains("param groups 0 and 1"), mp::Error);
  CHECK(w.grad().equal(torch::full({2}, 2.0F)));  // still scaled
}

TEST_CASE_TEMPLATE("a parameter added after construction is zeroed and trained like the others", P,
                   EVERY_POLICY) {
  // d loss / d offset = 1 exactly; lr 2^-4: the offset moves by -2^-4 per step, in any dtype.
  for (const std::int64_t n : {1, 2}) {
    CAPTURE(n);
    auto model = std::make_shared<Model>(torch::nn::Sequential(torch::nn::Linear(4, 1)));
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.0));
    mp::Trainer<P> trainer(model, sgd, mp::TrainerOptions().accumulation_steps(n));
    model->offset = model->register_parameter("offset", torch::zeros({1}));
    sgd.add_param_group(torch::optim::OptimizerParamGroup(
        {model->offset}, std::make_unique<torch::optim::SGDOptions>(1.0 / 16)));
    const auto x = torch::randn({4, 4});
    for (int step = 1; step <= 3; ++step) {
      for (std::int64_t k = 0; k < n; ++k) {
        trainer.step([&] { return model->forward(trainer.cast_input(x)).mean(); });
      }
      CHECK(model->offset.template item<double>() == -step / 16.0);
    }
    CHECK(model->offset.scalar_type() == (P::cast_model ? at::kBFloat16 : at::kFloat));
    if constexpr (P::master_weights) {
      REQUIRE(trainer.master_weights().size() == 3U);
      CHECK(trainer.master_weights().back().scalar_type() == at::kFloat);
      CHECK(trainer.master_weights().back().template item<double>() == -3 / 16.0);
    }
  }
}

TEST_CASE("MixedO2 unfreezing: a late group of Low tensors gets masters from their current values") {
  for (const std::int64_t n : {1, 2}) {
    CAPTURE(n);
    torch::manual_seed(2);
    auto model = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Tanh(), torch::nn::Linear(4, 1));
    torch::optim::SGD sgd(model[2]->parameters(), torch::optim::SGDOptions(0.1));
    mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, sgd, mp::TrainerOptions().accumulation_steps(n));
    const auto x = torch::randn({8, 4});
    auto loss = [&] { return model->forward(trainer.cast_input(x)).pow(2).mean().to(at::kFloat); };
    for (std::int64_t k = 0; k < n; ++k) trainer.step(loss);
    auto first = model[0]->as<torch::nn::Linear>();
    const auto rounded = first->weight.detach().clone();
    REQUIRE(rounded.scalar_type() == at::kBFloat16);
    sgd.add_param_group(torch::optim::OptimizerParamGroup(first->parameters()));
    trainer.step(loss);  // pairs the new group (and accumulates under n = 2)
    REQUIRE(trainer.master_weights().size() == 4U);
    for (std::int64_t k = 1; k < n; ++k) trainer.step(loss);
    const auto master = trainer.master_weights()[2];
    CHECK(master.scalar_type() == at::kFloat);
    CHECK(sgd.param_groups()[1].params()[0].is_same(master));  // the optimizer is rebound
    CHECK_FALSE(master.to(at::kBFloat16).equal(rounded));      // it trained
    CHECK(first->weight.equal(master.to(at::kBFloat16)));       // and the model follows it
    CHECK(first->weight.scalar_type() == at::kBFloat16);
  }
}

TEST_CASE("late param groups that cannot be trained are refused before anything changes") {
  auto model = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 1));
  torch::optim::SGD sgd(model[1]->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, sgd, mp::TrainerOptions().accumulation_steps(2));
  const auto x = torch::randn({8, 4});
  auto loss = [&] { return model->forward(trainer.cast_input(x)).mean().to(at::kFloat); };
  auto first = model[0]->as<torch::nn::Linear>();
  SUBCASE("a tensor the optimizer already trains, in a new group") {
    sgd.add_param_group(torch::optim::OptimizerParamGroup({model[1]->as<torch::nn::Linear>()->weight}));
    CHECK_THROWS_WITH_AS(trainer.step(loss), doctest::Contains("already"), mp::Error);
  }
  SUBCASE("a tensor that is not the model's") {
    sgd.add_param_group(torch::optim::OptimizerParamGroup({torch::zeros({3}, torch::requires_grad())}));
    CHECK_THROWS_WITH_AS(trainer.step(loss), doctest::Contains("not a parameter of the model"), mp::Error);
  }
  SUBCASE("in the middle of an accumulation") {
    trainer.step(loss);
    sgd.add_param_group(torch::optim::OptimizerParamGroup(first->parameters()));
    CHECK_THROWS_WITH_AS(trainer.step(loss), doctest::Contains("middle of an accumulation"), mp::Error);
  }
  CHECK(trainer.master_weights().size() == 2U);
  CHECK(first->weight.scalar_type() == at::kBFloat16);
  CHECK(trainer.stats().micro_batches <= 1);
}

TEST_CASE("two Trainers on one model are refused, in either order, until the first is gone") {
  using O2 = mp::Trainer<mp::MixedO2<at::BFloat16>>;
  using O0 = mp::Trainer<mp::FullPrecision>;
  auto model = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 1));
  torch::optim::SGD a(model->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD b(model->parameters(), torch::optim::SGDOptions(0.1));
  const auto x = torch::randn({8, 4});
  {
    O0 first(model, a);
    CHECK_THROWS_WITH_AS(O2(model, b), doctest::Contains("another Trainer"), mp::Error);
    CHECK_THROWS_WITH_AS(O0(model, b), doctest::Contains("another Trainer"), mp::Error);
    // A submodule shares the tensors: refused too.
    auto head = model[1];
    torch::optim::SGD c(head->parameters(), torch::optim::SGDOptions(0.1));
    CHECK_THROWS_WITH_AS(O2(head, c), doctest::Contains("another Trainer"), mp::Error);
    CHECK(model[0]->as<torch::nn::Linear>()->weight.scalar_type() == at::kFloat);
    CHECK(first.step([&] { return model->forward(x).mean(); }).stepped());  // unharmed
  }
  {
    std::optional<O2> first;
    first.emplace(model, b);  // the first Trainer is gone: the model is free
    O2 moved = std::move(*first);
    first.reset();  // the moved-from Trainer releases nothing
    CHECK_THROWS_WITH_AS(O0(model, a), doctest::Contains("another Trainer"), mp::Error);
    CHECK(moved.step([&] { return model->forward(moved.cast_input(x)).mean().to(at::kFloat); }).stepped());
  }
  // Free again; what remains is the model's dtype, which only an fp32 policy checks: the Error
  // says that a Trainer cast it, not that the user should drop a cast they never made.
  CHECK_THROWS_WITH_AS(O0(model, a), doctest::Contains("because an earlier Trainer<"), mp::Error);
}

TEST_CASE("MixedO2 refuses a sparse Embedding at construction, whatever accumulation_steps") {
  for (const std::int64_t n : {1, 2}) {
    CAPTURE(n);
    auto model = torch::nn::Sequential(torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true)),
                                       torch::nn::Linear(4, 1));
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
    CHECK_THROWS_WITH_AS(mp::Trainer<mp::MixedO2<at::BFloat16>>(model, sgd,
                                                                 mp::TrainerOptions().accumulation_steps(n)),
                         doctest::Contains("sparse"), mp::Error);
    CHECK(model[0]->as<torch::nn::Embedding>()->weight.scalar_type() == at::kFloat);
    // Other policies train it (the gradient stays sparse).
    bool sparse = false;  // read in on_step: the Trainer clears the gradients after the step
    mp::Trainer<mp::FullPrecision> trainer(
        model, sgd, mp::TrainerOptions().accumulation_steps(n).on_step([&](const mp::StepReport&) {
          const auto& grad = model[0]->as<torch::nn::Embedding>()->weight.grad();
          sparse = grad.defined() && grad.is_sparse();
        }));
    const auto ids = torch::tensor({1, 2, 3}, at::kLong);
    for (std::int64_t k = 0; k < n; ++k) trainer.step([&] { return model->forward(ids).mean(); });
    CHECK(sparse);
  }
}

}  // namespace test_models
