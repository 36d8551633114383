// The catalogue of bad inputs (docs/guide.md, "A catalogue of bad inputs"): each row is one
// SUBCASE that makes one bad call, checks the mixprec::Error's message, and checks that the
// state it could have touched is bit-identical afterwards. The rows' names are the table's.
#include <mixprec/mixprec.hpp>

#include "scaled_policy.hpp"
#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace test_bad_inputs {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;
namespace ops = mixprec::ops;

namespace {

using test::ScaledO2;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A user's scheduler whose every lr is NaN, its first step (at construction) included.
struct NanScheduler : torch::optim::LRScheduler {
  explicit NanScheduler(torch::optim::Optimizer& optimizer) : LRScheduler(optimizer) {}
  std::vector<double> get_lrs() override {
    return std::vector<double>(get_current_lrs().size(), kNaN);
  }
};

// The CPU generator's state put back: rows that build a second model must not move the RNG.
void restore_rng(const at::Tensor& state) {
  auto generator = at::detail::getDefaultCPUGenerator();
  generator.set_state(state);
}

struct Net : test::LinearNormNet {
  Net() : LinearNormNet(6) {}
};

// A MixedO2 run with a dynamic scale, two steps in: masters, Adam state, BatchNorm statistics
// and a scale that has grown are all there to be damaged.
struct World {
  std::shared_ptr<Net> net;
  torch::optim::Adam adam;
  mp::Trainer<ScaledO2> trainer;
  at::Tensor x, y;
  World()
      : net((torch::manual_seed(51), std::make_shared<Net>())),
        adam(net->parameters(), torch::optim::AdamOptions(1e-2)),
        trainer(net, adam, mp::TrainerOptions().scaler(
                               mp::GradScalerOptions().init_scale(1024).growth_interval(2))),
        x(torch::randn({8, 6})),
        y(torch::randint(0, 3, {8}, at::kLong)) {
    for (int i = 0; i < 2; ++i) REQUIRE(step().stepped());
  }
  mp::StepReport step() {
    return trainer.step([&] {
      return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(x)), y);
    });
  }
};

// Everything of a World a refused call must leave bit-identical.
struct Frozen {
  std::vector<at::Tensor> tensors;
  test::AdamMoments moments;
  std::string rest;
  explicit Frozen(World& w)
      : tensors(test::snapshot(w.net->parameters())), moments(test::adam_moments(w.adam)) {
    for (auto& t : test::snapshot(w.net->buffers())) tensors.push_back(t);
    for (auto& t : test::snapshot(w.trainer.master_weights())) tensors.push_back(t);
    for (const auto& p : w.net->parameters()) {
      if (p.grad().defined()) tensors.push_back(p.grad().clone());
    }
    const auto stats = w.trainer.stats();
    const auto& scaler = w.trainer.scaler();
    std::ostringstream text;
    text << std::hexfloat << w.adam.state().size() << " " << w.adam.param_groups().size() << " "
         << w.adam.param_groups()[0].options().get_lr() << " " << scaler.get_scale() << " "
         << scaler.growth_tracker() << " " << scaler.hysteresis_tracker() << " " << stats.steps
         << " " << stats.skipped_steps << " " << stats.micro_batches;
    rest = text.str();
    tensors.push_back(at::detail::getDefaultCPUGenerator().get_state());  // every byte
  }
  bool operator==(const Frozen& other) const {
    return test::identical(tensors, other.tensors) && moments == other.moments &&
           rest == other.rest;
  }
};

std::string write_file(const std::string& name, const std::string& bytes) {
  const auto path = (std::filesystem::path(MIXPREC_TEST_TMPDIR) / name).string();
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  return path;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

struct Row {
  const char* input;    // the table's "input" column
  const char* excerpt;  // what the message must contain
  std::function<void(World&)> call;
};

}  // namespace

TEST_CASE("catalogue: bad calls on a training run are Errors that change nothing") {
  const auto tmp = std::filesystem::path(MIXPREC_TEST_TMPDIR);
  const std::vector<Row> rows = {
      // loss_fn is the caller's forward pass: its side effects (BatchNorm statistics) happen
      // before the loss is judged (docs/guide.md, "Errors"), so these rows return a made loss.
      {"loss_fn returns a non-scalar", "must return a scalar loss",
       [](World& w) { w.trainer.step([] { return torch::ones({2}, torch::requires_grad()); }); }},
      {"loss_fn returns an undefined tensor", "returned an undefined tensor",
       [](World& w) { w.trainer.step([] { return at::Tensor(); }); }},
      {"loss_fn returns an integer loss", "floating-point loss",
       [](World& w) { w.trainer.step([] { return torch::ones({}, at::kLong); }); }},
      {"loss_fn returns a loss that does not require grad", "does not require grad",
       [](World& w) { w.trainer.step([] { return torch::ones({}); }); }},
      {"a late param group with a tensor that is not the model's", "not a parameter of the model",
       [](World& w) {
         w.adam.add_param_group(
             torch::optim::OptimizerParamGroup({torch::zeros({3}, torch::requires_grad())}));
         try {
           w.step();
         } catch (...) {
           w.adam.param_groups().pop_back();  // the group is the caller's; the rest must hold
           throw;
         }
       }},
      {"save() into a missing directory", "no_such_dir",
       [&](World& w) { w.trainer.save((tmp / "no_such_dir" / "run.ckpt").string()); }},
      {"load() of a missing file", "cannot read checkpoint",
       [&](World& w) { w.trainer.load((tmp / "catalogue_missing.ckpt").string()); }},
      {"load() of a directory that holds no checkpoint", "holds no 'index.json'",
       [&](World& w) {
         std::filesystem::create_directories(tmp / "catalogue_dir.ckpt");
         w.trainer.load((tmp / "catalogue_dir.ckpt").string());
       }},
      {"load() of an empty file", "does not end in a mixprec checkpoint trailer",
       [](World& w) { w.trainer.load(write_file("catalogue_empty.ckpt", "")); }},
      {"load() of a file that is not a checkpoint", "does not end in a mixprec checkpoint trailer",
       [](World& w) { w.trainer.load(write_file("catalogue_text.ckpt", std::string(4096, 'x'))); }},
      {"load() of a truncated checkpoint", "does not end in a mixprec checkpoint trailer",
       [](World& w) {
         const auto path = write_file("catalogue_whole.ckpt", "");
         w.trainer.save(path);
         const auto bytes = read_file(path);
         w.trainer.load(write_file("catalogue_cut.ckpt", bytes.substr(0, bytes.size() / 2)));
       }},
      {"load() of a checkpoint with bytes appended", "does not end in a mixprec checkpoint trailer",
       [](World& w) {
         const auto path = write_file("catalogue_long.ckpt", "");
         w.trainer.save(path);
         w.trainer.load(write_file("catalogue_long.ckpt", read_file(path) + "tail"));
       }},
      {"load() of a checkpoint with one flipped bit", "corrupted",
       [](World& w) {
         const auto path = write_file("catalogue_flip.ckpt", "");
         w.trainer.save(path);
         auto bytes = read_file(path);
         bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x10);
         w.trainer.load(write_file("catalogue_flip.ckpt", bytes));
       }},
      {"load() of another policy's checkpoint", "this is Trainer<ScaledO2>",
       [](World& w) {
         const auto rng = at::detail::getDefaultCPUGenerator().get_state();
         auto other = std::make_shared<Net>();
         torch::optim::Adam adam(other->parameters(), torch::optim::AdamOptions(1e-2));
         mp::Trainer<mp::FullPrecision> full(other, adam);
         const auto path = write_file("catalogue_policy.ckpt", "");
         full.save(path);
         restore_rng(rng);
         w.trainer.load(path);
       }},
      {"load() of another model's checkpoint", "the trainer's BFloat16[8, 6]",
       [](World& w) {
         // Same names, other shapes: fc1 is [8, 4] there. Saved, the RNG restored, as if never.
         const auto rng = at::detail::getDefaultCPUGenerator().get_state();
         auto other = std::make_shared<torch::nn::Module>();
         other->register_module("fc1", torch::nn::Linear(4, 8));
         torch::optim::Adam adam(other->parameters(), torch::optim::AdamOptions(1e-2));
         mp::Trainer<ScaledO2> o2(other, adam);
         const auto path = write_file("catalogue_model.ckpt", "");
         o2.save(path);
         restore_rng(rng);
         w.trainer.load(path);
       }},
      {"load() with an optimizer of other param groups", "param groups of sizes",
       [](World& w) {
         const auto rng = at::detail::getDefaultCPUGenerator().get_state();
         auto other = std::make_shared<Net>();
         std::vector<torch::optim::OptimizerParamGroup> groups;
         groups.emplace_back(other->fc1->parameters());
         groups.emplace_back(other->norm->parameters());
         groups.emplace_back(other->fc2->parameters());
         torch::optim::Adam adam(groups, torch::optim::AdamOptions(1e-2));
         mp::Trainer<ScaledO2> o2(other, adam);
         const auto path = write_file("catalogue_groups.ckpt", "");
         o2.save(path);
         restore_rng(rng);
         w.trainer.load(path);
       }},
      {"load() of a checkpoint written with a learning-rate schedule", "this Trainer has none",
       [](World& w) {
         const auto rng = at::detail::getDefaultCPUGenerator().get_state();
         auto other = std::make_shared<Net>();
         torch::optim::Adam adam(other->parameters(), torch::optim::AdamOptions(1e-2));
         mp::Trainer<ScaledO2> scheduled(
             other, adam, mp::TrainerOptions().lr_lambda([](std::int64_t) { return 0.5; }));
         const auto path = write_file("catalogue_schedule.ckpt", "");
         scheduled.save(path);
         restore_rng(rng);
         w.trainer.load(path);
       }},
      {"scaler().update(new_scale) with NaN", "update(new_scale) must be a positive normal",
       [](World& w) { w.trainer.scaler().update(kNaN); }},
      {"scaler().update(new_scale) above fp32's range", "update(new_scale) must be a positive normal",
       [](World& w) { w.trainer.scaler().update(1e39); }},
      {"load_weights() of a missing file", "cannot read",
       [&](World& w) { w.trainer.load_weights((tmp / "catalogue_missing.pt").string()); }},
      {"load_weights() of a Trainer checkpoint", "is a mixprec checkpoint (Trainer::save)",
       [](World& w) {
         const auto path = write_file("catalogue_weights.ckpt", "");
         w.trainer.save(path);
         w.trainer.load_weights(path);
       }},
      {"load_state_dict() with a key missing and a shape that differs",
       "1 of the model's tensors has no key (missing keys: 'fc2.bias'); 'fc1.weight' has shape [8, 5]",
       [](World& w) {
         auto weights = w.trainer.fp32_state_dict();
         weights.erase("fc2.bias");
         weights["fc1.weight"] = torch::zeros({8, 5});
         w.trainer.load_state_dict(weights);
       }},
      {"mixprec::load_weights() into the model a Trainer trains", "load weights through it",
       [](World& w) {
         const auto path = (std::filesystem::path(MIXPREC_TEST_TMPDIR) / "catalogue_fp32.pt").string();
         w.trainer.save_fp32(path, mp::WeightsFormat::pickle);
         mp::load_weights(*w.net, path);
       }},
  };
  for (const auto& row : rows) {
    SUBCASE(row.input) {
      World world;
      const Frozen before(world);
      CHECK_THROWS_WITH_AS(row.call(world), doctest::Contains(row.excerpt), mp::Error);
      CHECK(Frozen(world) == before);
      CHECK(world.step().stepped());  // and the run goes on
    }
  }
}

TEST_CASE("catalogue: habits from Python and LibTorch's own calls are Errors that change nothing") {
  const auto tmp = std::filesystem::path(MIXPREC_TEST_TMPDIR);
  const std::vector<Row> rows = {
      {"loss_fn runs backward() itself", "loss_fn ran a backward pass itself",
       [](World& w) {
         w.trainer.step([&] {
           // fc2 alone: no BatchNorm, whose statistics this forward would update.
           auto loss = w.net->fc2->forward(torch::ones({2, 8}, at::kBFloat16)).sum();
           loss.backward();
           return loss;
         });
       }},
      {"a floating input not passed through cast_input", "trainer.cast_input(x)",
       [](World& w) {
         w.trainer.step([&] {
           return torch::nn::functional::cross_entropy(w.net->forward(w.x), w.y);
         });
       }},
      {"evaluate() with an input not passed through cast_input", "trainer.cast_input(x)",
       [](World& w) { w.trainer.evaluate([&] { return w.net->forward(w.x); }); }},
      {"torch::load(trainer, path) of a missing file", "cannot read",
       [&](World& w) { torch::load(w.trainer, (tmp / "catalogue_missing.pt").string()); }},
      {"torch::load(trainer, path) of a truncated archive", "cannot read",
       [](World& w) {
         const auto path = write_file("catalogue_whole.pt", "");
         torch::save(w.trainer, path);
         const auto bytes = read_file(path);
         torch::load(w.trainer, write_file("catalogue_cut.pt", bytes.substr(0, bytes.size() / 2)));
       }},
      {"torch::save(trainer, path) into a missing directory", "cannot write",
       [&](World& w) { torch::save(w.trainer, (tmp / "no_such_dir" / "run.pt").string()); }},
  };
  for (const auto& row : rows) {
    SUBCASE(row.input) {
      World world;
      const Frozen before(world);
      CHECK_THROWS_WITH_AS(row.call(world), doctest::Contains(row.excerpt), mp::Error);
      CHECK(Frozen(world) == before);
      CHECK(world.step().stepped());  // and the run goes on
    }
  }
}

TEST_CASE("catalogue: bad Trainer constructions are Errors that leave model and optimizer alone") {
  using O2 = mp::Trainer<mp::MixedO2<at::BFloat16>>;
  using Scaled = mp::Trainer<ScaledO2>;
  struct Construction {
    const char* input;
    const char* excerpt;
    std::function<void(std::shared_ptr<Net>&, torch::optim::Adam&)> call;
  };
  const std::vector<Construction> rows = {
      {"accumulation_steps(0)", "accumulation_steps must be >= 1",
       [](auto& net, auto& adam) { O2(net, adam, mp::TrainerOptions().accumulation_steps(0)); }},
      {"max_grad_norm(0)", "max_grad_norm must be finite and > 0",
       [](auto& net, auto& adam) { O2(net, adam, mp::TrainerOptions().max_grad_norm(0.0)); }},
      {"max_grad_norm(NaN)", "max_grad_norm must be finite and > 0",
       [](auto& net, auto& adam) { O2(net, adam, mp::TrainerOptions().max_grad_norm(kNaN)); }},
      {"max_grad_norm(kInf)", "max_grad_norm must be finite and > 0",
       [](auto& net, auto& adam) { O2(net, adam, mp::TrainerOptions().max_grad_norm(kInf)); }},
      {"scaler options for a policy without a scaler", "does not scale the loss",
       [](auto& net, auto& adam) {
         O2(net, adam, mp::TrainerOptions().scaler(mp::GradScalerOptions()));
       }},
      {"scaler init_scale(0)", "init_scale must be a positive normal fp32 value",
       [](auto& net, auto& adam) {
         Scaled(net, adam, mp::TrainerOptions().scaler(mp::GradScalerOptions().init_scale(0)));
       }},
      {"scaler growth_factor(1)", "growth_factor must be finite and > 1",
       [](auto& net, auto& adam) {
         Scaled(net, adam, mp::TrainerOptions().scaler(mp::GradScalerOptions().growth_factor(1)));
       }},
      {"scaler backoff_factor(1.5)", "backoff_factor must be in (0, 1)",
       [](auto& net, auto& adam) {
         Scaled(net, adam, mp::TrainerOptions().scaler(mp::GradScalerOptions().backoff_factor(1.5)));
       }},
      {"scaler growth_interval(0)", "growth_interval must be in [1, 2^31)",
       [](auto& net, auto& adam) {
         Scaled(net, adam, mp::TrainerOptions().scaler(mp::GradScalerOptions().growth_interval(0)));
       }},
      {"scaler hysteresis(0)", "hysteresis must be >= 1",
       [](auto& net, auto& adam) {
         Scaled(net, adam, mp::TrainerOptions().scaler(mp::GradScalerOptions().hysteresis(0)));
       }},
      {"scaler min_scale above max_scale", "needs min_scale <= max_scale",
       [](auto& net, auto& adam) {
         Scaled(net, adam, mp::TrainerOptions().scaler(
                               mp::GradScalerOptions().min_scale(8).max_scale(4).init_scale(4)));
       }},
      {"scaler init_scale outside [min_scale, max_scale]", "outside [min_scale, max_scale]",
       [](auto& net, auto& adam) {
         Scaled(net, adam, mp::TrainerOptions().scaler(
                               mp::GradScalerOptions().max_scale(16).init_scale(1024)));
       }},
      {"a model without parameters", "the model has no parameters",
       [](auto&, auto& adam) { O2(std::make_shared<torch::nn::Module>(), adam); }},
      {"an optimizer over tensors that are not the model's", "not a parameter of the model",
       [](auto& net, auto&) {
         auto stranger = torch::zeros({3}, torch::requires_grad());
         torch::optim::Adam foreign({stranger}, torch::optim::AdamOptions(1e-2));
         O2(net, foreign);
       }},
      {"a bf16 model", "expects an fp32 model",
       [](auto&, auto&) {
         auto low = std::make_shared<Net>();
         low->to(at::kBFloat16);
         torch::optim::Adam adam(low->parameters(), torch::optim::AdamOptions(1e-2));
         O2(low, adam);
       }},
      {"a second Trainer on the same model", "another Trainer",
       [](auto& net, auto& adam) {
         mp::Trainer<mp::FullPrecision> first(net, adam);
         torch::optim::Adam second(net->parameters(), torch::optim::AdamOptions(1e-2));
         O2(net, second);
       }},
      {"torch::optim::LBFGS (its step needs a closure)", "LBFGS is not supported",
       [](auto& net, auto&) {
         torch::optim::LBFGS lbfgs(net->parameters(), torch::optim::LBFGSOptions(0.1));
         mp::Trainer<mp::FullPrecision>(net, lbfgs);
       }},
      {"an Adagrad that has stepped, under MixedO2", "it has stepped",
       [](auto& net, auto&) {
         torch::optim::Adagrad adagrad(net->fc2->parameters(), torch::optim::AdagradOptions(0.1));
         const auto params = test::snapshot(net->fc2->parameters());
         net->fc2->forward(torch::ones({2, 8})).sum().backward();
         adagrad.step();
         torch::NoGradGuard no_grad;  // back to the values the row compares against
         for (std::size_t i = 0; i < params.size(); ++i) net->fc2->parameters()[i].copy_(params[i]);
         for (auto& p : net->fc2->parameters()) p.mutable_grad().reset();
         O2(net, adagrad);
       }},
      {"fused_optimizer(true) under PureHalf", "fused",
       [](auto& net, auto& adam) {
         mp::Trainer<mp::PureHalf<at::BFloat16>>(net, adam,
                                                 mp::TrainerOptions().fused_optimizer(true));
       }},
      {"lr_scheduler and lr_lambda both set", "both set",
       [](auto& net, auto& adam) {
         O2(net, adam, mp::TrainerOptions()
                           .lr_scheduler(std::make_shared<torch::optim::StepLR>(adam, 2))
                           .lr_lambda([](std::int64_t) { return 1.0; }));
       }},
      {"an lr_scheduler built on another optimizer", "built on another optimizer",
       [](auto& net, auto& adam) {
         torch::optim::Adam other(net->parameters(), torch::optim::AdamOptions(1e-2));
         O2(net, adam, mp::TrainerOptions().lr_scheduler(
                           std::make_shared<torch::optim::StepLR>(other, 2)));
       }},
      {"lr_lambda that returns NaN", "the lr must be finite and >= 0",
       [](auto& net, auto& adam) {
         O2(net, adam, mp::TrainerOptions().lr_lambda([](std::int64_t) { return kNaN; }));
       }},
      {"an lr_scheduler whose first lr is NaN", "its first step",
       [](auto& net, auto& adam) {
         O2(net, adam, mp::TrainerOptions().lr_scheduler(std::make_shared<NanScheduler>(adam)));
       }},
  };
  for (const auto& row : rows) {
    SUBCASE(row.input) {
      torch::manual_seed(53);
      auto net = std::make_shared<Net>();
      torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
      const auto params = test::snapshot(net->parameters());
      const auto buffers = test::snapshot(net->buffers());
      CHECK_THROWS_WITH_AS(row.call(net, adam), doctest::Contains(row.excerpt), mp::Error);
      CHECK(test::identical(test::snapshot(net->parameters()), params));  // dtypes too: not cast
      CHECK(test::identical(test::snapshot(net->buffers()), buffers));
      CHECK(adam.state().empty());
      REQUIRE(adam.param_groups().size() == 1U);
      CHECK(adam.param_groups()[0].options().get_lr() == 1e-2);
      CHECK(adam.param_groups()[0].params()[0].is_same(net->fc1->weight));  // not rebound
      mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(net, adam);  // the model is free again
    }
  }
}

TEST_CASE("catalogue: bad state dicts and scaler calls are Errors that leave the scaler alone") {
  struct ScalerRow {
    const char* input;
    const char* excerpt;
    std::function<void(mp::GradScaler&, c10::impl::GenericDict&, torch::optim::SGD&)> call;
    std::function<void(mp::GradScaler&, torch::optim::SGD&)> prepare = nullptr;  // valid calls first
  };
  const auto with = [](const char* key, c10::IValue value) {
    return [key, value](mp::GradScaler& s, c10::impl::GenericDict& d, torch::optim::SGD&) {
      d.insert_or_assign(key, value);
      s.load_state_dict(d);
    };
  };
  const auto without = [](const char* key) {
    return [key](mp::GradScaler& s, c10::impl::GenericDict& d, torch::optim::SGD&) {
      (void)d.erase(key);
      s.load_state_dict(d);
    };
  };
  const std::vector<ScalerRow> rows = {
      {"state dict without 'scale'", "lacks the key 'scale'", without("scale")},
      {"state dict without '_growth_tracker'", "lacks the key '_growth_tracker'",
       without("_growth_tracker")},
      {"state dict with a string scale", "'scale' must be a number", with("scale", std::string("big"))},
      {"state dict with a negative scale", "a finite fp32 value >= 0", with("scale", -4.0)},
      {"state dict with a NaN scale", "a finite fp32 value >= 0", with("scale", kNaN)},
      {"state dict with a scale beyond fp32 (1e39)", "a finite fp32 value >= 0", with("scale", 1e39)},
      {"state dict with a scale above this scaler's max_scale", "outside [min_scale, max_scale]",
       with("scale", 1e9)},
      {"state dict with growth_factor 0.5", "growth_factor must be finite and > 1",
       with("growth_factor", 0.5)},
      {"state dict with backoff_factor 2", "backoff_factor must be in (0, 1)",
       with("backoff_factor", 2.0)},
      {"state dict with a fractional growth_interval", "'growth_interval' must be an integer",
       with("growth_interval", 2.5)},
      {"state dict with growth_interval 0", "growth_interval must be in [1, 2^31)",
       with("growth_interval", std::int64_t{0})},
      {"state dict with _growth_tracker >= growth_interval", "outside [0, growth_interval)",
       with("_growth_tracker", std::int64_t{2000})},
      {"state dict with a negative _growth_tracker", "outside [0, growth_interval)",
       with("_growth_tracker", std::int64_t{-1})},
      {"state dict with _hysteresis_tracker above hysteresis", "above hysteresis",
       with("_hysteresis_tracker", std::int64_t{5})},
      {"an empty state dict (a disabled scaler's)", "empty state dict",
       [](mp::GradScaler& s, c10::impl::GenericDict&, torch::optim::SGD&) {
         s.load_state_dict(mp::NoScaler().state_dict());
       }},
      {"update() without a step", "no inf checks",
       [](mp::GradScaler& s, c10::impl::GenericDict&, torch::optim::SGD&) { s.update(); }},
      {"step() before any backward()", "found no gradients",
       [](mp::GradScaler& s, c10::impl::GenericDict&, torch::optim::SGD& sgd) {
         for (auto& p : sgd.param_groups()[0].params()) p.mutable_grad() = at::Tensor();
         s.step(sgd);
       }},
      {"unscale_() twice", "already been called",
       [](mp::GradScaler& s, c10::impl::GenericDict&, torch::optim::SGD& sgd) { s.unscale_(sgd); },
       [](mp::GradScaler& s, torch::optim::SGD& sgd) { s.unscale_(sgd); }},
      {"step() twice", "step() has already been called",
       [](mp::GradScaler& s, c10::impl::GenericDict&, torch::optim::SGD& sgd) { s.step(sgd); },
       [](mp::GradScaler& s, torch::optim::SGD& sgd) { s.step(sgd); }},
      {"unscale_() after step()", "after step()",
       [](mp::GradScaler& s, c10::impl::GenericDict&, torch::optim::SGD& sgd) { s.unscale_(sgd); },
       [](mp::GradScaler& s, torch::optim::SGD& sgd) { s.step(sgd); }},
      {"fp16 gradients unscaled in place", "unscale fp16 gradients in place",
       [](mp::GradScaler& s, c10::impl::GenericDict&, torch::optim::SGD&) {
         auto half = torch::ones({2}, at::kHalf).requires_grad_();
         half.mutable_grad() = torch::ones({2}, at::kHalf);
         torch::optim::SGD low({half}, torch::optim::SGDOptions(0.1));
         s.unscale_(low);
       }},
      {"unscale_() with clipping at max_grad_norm(-1)", "max_grad_norm must be finite and > 0",
       [](mp::GradScaler& s, c10::impl::GenericDict&, torch::optim::SGD& sgd) {
         s.unscale_(sgd, mp::UnscaleOptions().max_grad_norm(-1.0));
       }},
  };
  for (const auto& row : rows) {
    SUBCASE(row.input) {
      auto w = torch::full({4}, 1.0).requires_grad_();
      torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.5));
      mp::GradScaler scaler(mp::GradScalerOptions().init_scale(64).growth_interval(2000)
                                .hysteresis(2).max_scale(1e6));
      scaler.scale(w.sum()).backward();  // grads of 64, not yet unscaled
      auto dict = scaler.state_dict();
      if (row.prepare) row.prepare(scaler, sgd);
      const auto state = [&] {
        std::ostringstream text;
        text << std::hexfloat << scaler.get_scale() << " " << scaler.growth_tracker() << " "
             << scaler.hysteresis_tracker() << " " << scaler.options().growth_factor() << " "
             << scaler.options().backoff_factor() << " " << scaler.options().growth_interval();
        return text.str();
      };
      const auto before = state();
      const auto weights = test::snapshot({w});
      const auto grads = w.grad().defined() ? test::snapshot({w.grad()}) : std::vector<at::Tensor>{};
      CHECK_THROWS_WITH_AS(row.call(scaler, dict, sgd), doctest::Contains(row.excerpt), mp::Error);
      CHECK(state() == before);
      CHECK(test::identical(test::snapshot({w}), weights));  // never stepped on an error
      if (w.grad().defined()) {
        CHECK(test::identical(test::snapshot({w.grad()}), grads));  // not unscaled either
      }
    }
  }
}

TEST_CASE("catalogue: bad op arguments are Errors that leave the inputs alone") {
  struct OpRow {
    const char* input;
    const char* excerpt;
    std::function<void(const at::Tensor&, const at::Tensor&)> call;
  };
  const std::vector<OpRow> rows = {
      {"masked_softmax, a mask that does not broadcast", "does not broadcast to the vector",
       [](auto& x, auto&) { ops::masked_softmax(x, at::ones({2, 4}, at::kBool)); }},
      {"masked_mean, a mask with more dimensions than the vector", "has more dimensions",
       [](auto& x, auto&) { ops::masked_mean(x, at::ones({2, 3, 1}, at::kBool), 1); }},
      {"masked_softmax, a soft mask (0.5)", "must hold only 0 and 1",
       [](auto& x, auto&) { ops::masked_softmax(x, at::full({2, 3}, 0.5)); }},
      {"masked_log_softmax, a NaN in a float mask", "must hold only 0 and 1",
       [](auto& x, auto&) { ops::masked_log_softmax(x, at::full({2, 3}, kNaN)); }},
      {"masked_softmax, a complex mask", "must be bool (or 0/1 numbers)",
       [](auto& x, auto&) { ops::masked_softmax(x, at::ones({2, 3}, at::kComplexFloat)); }},
      {"masked_max, an undefined mask", "mask is an undefined tensor",
       [](auto& x, auto&) { ops::masked_max(x, at::Tensor(), 1); }},
      {"masked_softmax, dim out of range", "dim 2 is out of range",
       [](auto& x, auto& keep) { ops::masked_softmax(x, keep, 2); }},
      {"logsumexp of a 0-d tensor", "0-d tensor",
       [](auto&, auto&) { ops::logsumexp(at::scalar_tensor(1.0), 0); }},
      {"masked_softmax of an integer vector", "must be floating point",
       [](auto&, auto& keep) { ops::masked_softmax(at::ones({2, 3}, at::kLong), keep); }},
      {"masked_max of a bool vector", "floating point or integral, not Bool",
       [](auto&, auto& keep) { ops::masked_max(at::ones({2, 3}, at::kBool), keep, 1); }},
      {"an ambiguous [batch, keys] mask of square scores", "is ambiguous",
       [](auto&, auto&) {
         ops::replace_masked_values(at::randn({2, 3, 3}), at::ones({2, 3}, at::kBool), 0);
       }},
      {"a mask without the dimension the op works along", "has no dimension 2",
       [](auto&, auto&) { ops::masked_softmax(at::randn({2, 3, 4}), at::ones({2, 3}, at::kBool)); }},
      {"replace_masked_values, -1e32 into fp16", "outside Half's finite range",
       [](auto& x, auto& keep) { ops::replace_masked_values(x.to(at::kHalf), keep, -1e32); }},
      {"replace_masked_values, 0.5 into an integer tensor", "not a whole number",
       [](auto&, auto& keep) { ops::replace_masked_values(at::ones({2, 3}, at::kInt), keep, 0.5); }},
      {"replace_masked_values, inf into an integer tensor", "cannot be stored in an integer tensor",
       [](auto&, auto& keep) { ops::replace_masked_values(at::ones({2, 3}, at::kLong), keep, kInf); }},
      {"cross entropy, a target outside the classes", "is not a class index",
       [](auto&, auto&) {
         ops::sequence_cross_entropy_with_logits(at::randn({2, 3, 4}), at::full({2, 3}, 4, at::kLong),
                                                 at::ones({2, 3}, at::kBool));
       }},
      {"cross entropy, label_smoothing 1", "label_smoothing must be in [0, 1)",
       [](auto&, auto&) {
         ops::sequence_cross_entropy_with_logits(at::randn({2, 3, 4}), at::zeros({2, 3}, at::kLong),
                                                 at::ones({2, 3}, at::kBool), ops::Average::batch, 1.0);
       }},
      {"layer_norm, eps 0", "must be finite and at least",
       [](auto& x, auto&) { ops::layer_norm(x, {3}, {}, {}, 0.0); }},
      {"min_value_of_dtype(Bool)", "Bool is not supported",
       [](auto&, auto&) { ops::min_value_of_dtype(at::kBool); }},
  };
  for (const auto& row : rows) {
    SUBCASE(row.input) {
      torch::manual_seed(54);
      const auto x = at::randn({2, 3});
      const auto keep = at::ones({2, 3}, at::kBool);
      const auto before = test::snapshot({x, keep});
      CHECK_THROWS_WITH_AS(row.call(x, keep), doctest::Contains(row.excerpt), mp::Error);
      CHECK(test::identical(test::snapshot({x, keep}), before));
    }
  }
}

TEST_CASE("catalogue: bad diagnostics calls are Errors that leave the model alone") {
  struct DiagnosticsRow {
    const char* input;
    const char* excerpt;
    std::function<void(std::shared_ptr<Net>&, torch::optim::Adam&)> call;
  };
  const auto loss_of = [](const std::shared_ptr<Net>& net) {
    return [net] { return net->forward(torch::ones({4, 6})).square().mean(); };
  };
  const std::vector<DiagnosticsRow> rows = {
      {"gradient_stats every(-1)", "every and group_depth must be >= 0",
       [](auto& net, auto& adam) {
         mp::Trainer<mp::MixedO2<at::BFloat16>>(
             net, adam, mp::TrainerOptions().gradient_stats(mp::GradientStatsOptions().every(-1)));
       }},
      {"gradient_stats group_depth(-1)", "every and group_depth must be >= 0",
       [](auto& net, auto& adam) {
         mp::Trainer<mp::MixedO2<at::BFloat16>>(
             net, adam,
             mp::TrainerOptions().gradient_stats(mp::GradientStatsOptions().every(1).group_depth(-1)));
       }},
      {"find_non_finite_op inside a NonFiniteOpFinder", "already active on this thread",
       [](auto& net, auto& adam) {
         mp::Trainer<mp::FullPrecision> trainer(net, adam,
                                                mp::TrainerOptions().find_non_finite_op(true));
         mp::NonFiniteOpFinder outer;
         trainer.step([&] { return net->forward(torch::ones({4, 6})).square().mean(); });
       }},
      {"advise() with steps(0)", "steps must be >= 1",
       [&](auto& net, auto&) { mp::advise(net, loss_of(net), mp::AdviseOptions().steps(0)); }},
      {"advise() with headroom(0.5)", "headroom must be finite and >= 1",
       [&](auto& net, auto&) { mp::advise(net, loss_of(net), mp::AdviseOptions().headroom(0.5)); }},
      {"advise() with underflow_tolerance(1)", "underflow_tolerance must be in [0, 1)",
       [&](auto& net, auto&) {
         mp::advise(net, loss_of(net), mp::AdviseOptions().underflow_tolerance(1));
       }},
      {"advise() with a loss_fn that returns a non-scalar", "must return a scalar loss",
       [](auto& net, auto&) { mp::advise(net, [&] { return net->forward(torch::ones({4, 6})); }); }},
      {"advise() of a model a Trainer has cast", "call it before a Trainer casts the model",
       [&](auto&, auto&) {
         const auto rng = at::detail::getDefaultCPUGenerator().get_state();
         auto other = std::make_shared<Net>();
         restore_rng(rng);
         torch::optim::Adam adam(other->parameters(), torch::optim::AdamOptions(1e-2));
         mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(other, adam);
         mp::advise(other, loss_of(other));
       }},
      {"advise() inside a NonFiniteOpFinder", "already active on this thread",
       [&](auto& net, auto&) {
         mp::NonFiniteOpFinder outer;
         mp::advise(net, loss_of(net));
       }},
  };
  for (const auto& row : rows) {
    SUBCASE(row.input) {
      torch::manual_seed(55);
      auto net = std::make_shared<Net>();
      torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
      const auto params = test::snapshot(net->parameters());
      const auto buffers = test::snapshot(net->buffers());
      const auto rng = at::detail::getDefaultCPUGenerator().get_state();
      CHECK_THROWS_WITH_AS(row.call(net, adam), doctest::Contains(row.excerpt), mp::Error);
      CHECK(test::identical(test::snapshot(net->parameters()), params));
      CHECK(test::identical(test::snapshot(net->buffers()), buffers));
      CHECK(torch::equal(at::detail::getDefaultCPUGenerator().get_state(), rng));
      for (const auto& p : net->parameters()) CHECK_FALSE(p.grad().defined());
      CHECK(adam.state().empty());
      // The thread is free for a finder, and the model for a Trainer.
      mp::NonFiniteOpFinder finder;
      CHECK_FALSE(finder.first().has_value());
    }
  }
}

}  // namespace test_bad_inputs
