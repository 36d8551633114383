// fused_adam.hpp and TrainerOptions::fused_optimizer: ATen's fused Adam/AdamW with the unscale
// folded in, against LibTorch's own Adam/AdamW on the same weights and gradients.
//
// The bound: the fused kernel groups Adam's arithmetic differently (its first moment is a lerp
// where LibTorch's is m*beta1 + (1-beta1)*g, its update (lr*m)/d where addcdiv_ is lr*(m/d)),
// so one step from the same state may part by the rounding bound of tests/optim/adam_bound.hpp:
// eps (|p'| + 10.25 lr_t M / d), derived there. Each step below starts both from the same state.
#include <mixprec/optim/fused_adam.hpp>
#include <mixprec/mixprec.hpp>

#include "adam_bound.hpp"
#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <limits>

namespace test_fused_adam {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

// The fused kernels need LibTorch >= 2.4: there every case runs, and the one for older
// versions is reported as skipped; under 1.13 the reverse (doctest's skip decorator).
namespace {
const auto needs_fused = doctest::skip(!mp::fused_adam_available);
}  // namespace


namespace {

// Over a few steps the two paths part by their roundings (from the same state: adam_bound.hpp);
// relative to max|p| + lr they stay within 2 eps a step here (measured 0.06), where a path that
// lost the other's state restarts the moments at zero and is off by about lr.
constexpr double kTrajectory = 2.0;
const double kEps32 = std::numeric_limits<float>::epsilon();

// MixedO2<BFloat16> with dynamic scaling, as a user would derive it.
struct ScaledO2 : mp::MixedO2<at::BFloat16> {
  static constexpr std::string_view name = "ScaledO2";
  using scaler_type = mp::GradScaler;
};

std::vector<at::Tensor> make_params() {
  torch::manual_seed(11);
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<std::int64_t>>{{17, 9}, {33}, {4, 4, 4}, {1}}) {
    params.push_back(torch::randn(shape).requires_grad_());
  }
  params[1].detach().zero_();  // a bias initialised to zero: its steps are all of its value
  return params;
}

/// The same gradients on every copy: drawn from a generator seeded by the step number.
void set_grads(const std::vector<at::Tensor>& params, int step, double scale = 1.0) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 + static_cast<std::uint64_t>(step));
  for (const auto& p : params) {
    p.mutable_grad() = at::randn(p.sizes(), generator) * scale;
  }
}

/// Two param groups (lr 1e-2 and 3e-3), as a user with a backbone and a head has.
template <class Optimizer, class Options>
std::unique_ptr<Optimizer> make_optimizer(const std::vector<at::Tensor>& params, Options options) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0], params[1]},
                      std::make_unique<Options>(options));
  auto head = options;
  head.lr(3e-3);
  groups.emplace_back(std::vector<at::Tensor>{params[2], params[3]}, std::make_unique<Options>(head));
  return std::make_unique<Optimizer>(std::move(groups), options);
}

/// max over tensors of |a - b| / (max|a| + lr): differences in units of one update's size.
double relative_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, double lr) {
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double scale = a[i].abs().max().item<double>() + lr;
    m = std::max(m, (a[i].to(at::kDouble) - b[i].to(at::kDouble)).abs().max().item<double>() / scale);
  }
  return m;
}

std::vector<at::Tensor> detached(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach());
  return out;
}

/// Each parameter's moments, in parameter order (looked up as the optimizer keys them).
template <class State>
std::vector<at::Tensor> moments(torch::optim::Optimizer& optimizer,
                                const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  auto& states = optimizer.state();
  for (const auto& p : params) {
    const auto it = states.find(mp::detail::state_key<decltype(states)>(p));
    REQUIRE(it != states.end());
    const auto& s = static_cast<const State&>(*it->second);
    out.push_back(s.exp_avg());
    out.push_back(s.exp_avg_sq());
    if (s.max_exp_avg_sq().defined()) out.push_back(s.max_exp_avg_sq());
  }
  return out;
}

/// The optimizer state of `p` in `optimizer`.
template <class State>
State& state_of(torch::optim::Optimizer& optimizer, const at::Tensor& p) {
  auto& states = optimizer.state();
  const auto it = states.find(mp::detail::state_key<decltype(states)>(p));
  REQUIRE(it != states.end());
  return static_cast<State&>(*it->second);
}

/// 20 steps of LibTorch's optimizer and the fused step, each from the same weights and moments
/// (the fused side takes LibTorch's after each step): every weight within the rounding bound
/// of one step (adam_bound.hpp), every moment within its part of it.
template <class Optimizer, class Options, class State>
void matches_libtorch(const Options& options, bool adamw) {
  auto ref_params = make_params();
  auto fused_params = make_params();
  auto ref = make_optimizer<Optimizer>(ref_params, options);
  auto fused = make_optimizer<Optimizer>(fused_params, options);
  const auto [beta1, beta2] = options.betas();
  const double u = std::ldexp(1.0, -24);
  double worst = 0, worst_old = 0, worst_m = 0, worst_v = 0;
  for (int step = 0; step < 20; ++step) {
    set_grads(ref_params, step);
    set_grads(fused_params, step);
    std::vector<at::Tensor> before, m_before;
    for (const auto& p : ref_params) {
      before.push_back(p.detach().clone());
      m_before.push_back(step == 0 ? torch::zeros_like(p) : state_of<State>(*ref, p).exp_avg().clone());
    }
    ref->step();
    mp::fused_adam_step(*fused);
    for (std::size_t i = 0; i < ref_params.size(); ++i) {
      const double lr = i < 2 ? options.lr() : 3e-3;  // make_optimizer's head group
      auto& rs = state_of<State>(*ref, ref_params[i]);
      auto& fs = state_of<State>(*fused, fused_params[i]);
      const auto& v = options.amsgrad() ? rs.max_exp_avg_sq() : rs.exp_avg_sq();
      const auto p_new = ref_params[i].detach();
      const auto bound = test::adam_rounding_bound(before[i], p_new, m_before[i], ref_params[i].grad(), v,
                                                   lr, beta1, beta2, options.eps(),
                                                   options.weight_decay(), adamw, step + 1);
      const auto diff = (fused_params[i].detach().to(at::kDouble) - p_new.to(at::kDouble)).abs();
      worst = std::max(worst, (diff / (bound + 1e-300)).max().template item<double>());  // 0/0: 0
      // The measure the guide stated before (2 eps of |p| + lr per step): exceeded.
      worst_old = std::max(worst_old, (diff / (2 * kEps32 * (p_new.abs().to(at::kDouble) + lr))).max().template item<double>());
      CHECK(diff.le(bound).all().template item<bool>());
      // The moments: 4u M apart, and the second within 6u of each other.
      const auto big_m = m_before[i].abs().to(at::kDouble) +
                         (1 - beta1) * (ref_params[i].grad().abs().to(at::kDouble) +
                                        (adamw ? 0.0 : options.weight_decay()) * before[i].abs().to(at::kDouble));
      const auto dm = (fs.exp_avg().to(at::kDouble) - rs.exp_avg().to(at::kDouble)).abs();
      const auto dv = (fs.exp_avg_sq().to(at::kDouble) - rs.exp_avg_sq().to(at::kDouble)).abs();
      worst_m = std::max(worst_m, (dm / (4 * u * big_m + 1e-45)).max().template item<double>());
      worst_v = std::max(worst_v, (dv / (6 * u * rs.exp_avg_sq().to(at::kDouble) + 1e-45)).max().template item<double>());
      CHECK(dm.le(4 * u * big_m).all().template item<bool>());
      CHECK(dv.le(6 * u * rs.exp_avg_sq().to(at::kDouble)).all().template item<bool>());
      // The next step starts from the same state again.
      torch::NoGradGuard no_grad;
      fused_params[i].copy_(p_new);
      fs.exp_avg().copy_(rs.exp_avg());
      fs.exp_avg_sq().copy_(rs.exp_avg_sq());
      if (options.amsgrad()) fs.max_exp_avg_sq().copy_(rs.max_exp_avg_sq());
    }
  }
  MESSAGE("one step fused against LibTorch's, 20 steps: the weights at most ", worst,
          " of the bound (", worst_old, " of the 2 eps (|p| + lr) stated before), the moments ",
          worst_m, " and ", worst_v, " of theirs");
  // The state is LibTorch's own: step counts as Adam::step keeps them.
  for (auto& [key, state] : fused->state()) {
    (void)key;
    CHECK(static_cast<const State&>(*state).step() == 20);
  }
}

}  // namespace

TEST_SUITE("fused adam" * needs_fused) {
  TEST_CASE("fused_adam_step: one step within the derived rounding bound of LibTorch's Adam and AdamW") {
    using torch::optim::Adam, torch::optim::AdamW, torch::optim::AdamOptions,
        torch::optim::AdamWOptions, torch::optim::AdamParamState, torch::optim::AdamWParamState;
    SUBCASE("Adam") { matches_libtorch<Adam, AdamOptions, AdamParamState>(AdamOptions(1e-2), false); }
    SUBCASE("Adam, weight decay, amsgrad") {
      matches_libtorch<Adam, AdamOptions, AdamParamState>(
          AdamOptions(1e-2).weight_decay(0.1).amsgrad(true).betas({0.8, 0.99}), false);
    }
    SUBCASE("AdamW") {
      matches_libtorch<AdamW, AdamWOptions, AdamWParamState>(AdamWOptions(1e-2), true);
    }
    SUBCASE("AdamW, amsgrad, eps") {
      matches_libtorch<AdamW, AdamWOptions, AdamWParamState>(
          AdamWOptions(1e-2).weight_decay(0.05).amsgrad(true).eps(1e-6), true);
    }
  }

  TEST_CASE("a power-of-two grad_scale folds the unscale in exactly, and writes the gradient back unscaled") {
    auto plain = make_params();
    auto scaled = make_params();
    auto a = make_optimizer<torch::optim::AdamW>(plain, torch::optim::AdamWOptions(1e-2));
    auto b = make_optimizer<torch::optim::AdamW>(scaled, torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 5; ++step) {
      set_grads(plain, step);
      set_grads(scaled, step, 1024.0);
      mp::fused_adam_step(*a);
      mp::fused_adam_step(*b, at::full({}, 1024.0F));
      CHECK(test::identical(detached(plain), detached(scaled)));
      for (std::size_t i = 0; i < plain.size(); ++i) CHECK(scaled[i].grad().equal(plain[i].grad()));
    }
    CHECK(test::identical(moments<torch::optim::AdamWParamState>(*a, plain),
                          moments<torch::optim::AdamWParamState>(*b, scaled)));
  }

  TEST_CASE("fused and unfused steps share LibTorch's state: each continues the other, and it serializes") {
    using torch::optim::Adam, torch::optim::AdamOptions;
    const auto options = AdamOptions(1e-2).weight_decay(0.01);
    auto run = [&](bool fused_first, bool fused_then) {
      auto params = make_params();
      auto optimizer = make_optimizer<Adam>(params, options);
      for (int step = 0; step < 6; ++step) {
        set_grads(params, step);
        if ((step < 3 ? fused_first : fused_then)) {
          mp::fused_adam_step(*optimizer);
        } else {
          optimizer->step();
        }
      }
      return std::make_pair(params, std::move(optimizer));
    };
    auto [reference, ref_opt] = run(false, false);
    auto [fused_later, opt1] = run(false, true);
    auto [fused_first, opt2] = run(true, false);
    // Had a path not found the other's state, it would restart the moments at 0: an update
    // many times the bound off.
    CHECK(relative_diff(detached(reference), detached(fused_later), 1e-2) <= kTrajectory * kEps32 * 6);
    CHECK(relative_diff(detached(reference), detached(fused_first), 1e-2) <= kTrajectory * kEps32 * 6);
    for (auto* optimizer : {opt1.get(), opt2.get()}) {
      CHECK(optimizer->state().size() == 4U);
      for (auto& [key, state] : optimizer->state()) {
        (void)key;
        CHECK(static_cast<const torch::optim::AdamParamState&>(*state).step() == 6);
      }
    }
    // A state the fused step made round-trips through LibTorch's serialization.
    torch::serialize::OutputArchive out;
    opt2->save(out);
    std::ostringstream bytes;
    out.save_to(bytes);
    auto copy_params = make_params();
    auto copy = make_optimizer<Adam>(copy_params, options);
    torch::serialize::InputArchive in;
    std::istringstream stream(bytes.str());
    in.load_from(stream);
    copy->load(in);
    CHECK(test::identical(moments<torch::optim::AdamParamState>(*copy, copy_params),
                          moments<torch::optim::AdamParamState>(*opt2, fused_first)));
  }

  TEST_CASE("fused_adam_step refuses what it cannot step, before changing anything") {
    auto params = make_params();
    set_grads(params, 0);
    const auto before = test::snapshot(params);
    torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.1));
    CHECK_THROWS_WITH_AS(mp::fused_adam_step(sgd), doctest::Contains("exactly torch::optim::Adam"),
                         mp::Error);
    struct MyAdam : torch::optim::Adam {
      using Adam::Adam;
    };
    MyAdam mine(params, torch::optim::AdamOptions(1e-2));
    CHECK_THROWS_WITH_AS(mp::fused_adam_step(mine), doctest::Contains("subclass"), mp::Error);
    auto tied = params;
    tied.push_back(params[0]);
    torch::optim::Adam twice(tied, torch::optim::AdamOptions(1e-2));
    CHECK_THROWS_WITH_AS(mp::fused_adam_step(twice), doctest::Contains("listed twice"), mp::Error);
    auto half = torch::randn({3}).to(at::kHalf).requires_grad_();
    half.mutable_grad() = torch::ones({3}, at::kHalf);
    torch::optim::Adam low({params[0], half}, torch::optim::AdamOptions(1e-2));
    CHECK_THROWS_WITH_AS(mp::fused_adam_step(low), doctest::Contains("fp32 (or fp64) parameters only"),
                         mp::Error);
    CHECK(low.state().empty());  // params[0] was valid, but nothing was stepped
    CHECK(test::identical(test::snapshot(params), before));
  }
}

namespace {

struct Mlp : torch::nn::Module {
  Mlp() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct Run {
  std::vector<mp::StepStatus> statuses;
  std::vector<double> losses, scales, norms;
  std::vector<at::Tensor> params;
};

/// 30 micro-batches of Trainer<P> with AdamW, fused or not; the 8th has a NaN input. Half
/// policies start at a scale that overflows, so the first steps are skipped for real.
template <class P>
Run train(bool fused, std::optional<double> clip, std::int64_t accumulation) {
  torch::manual_seed(5);
  auto net = std::make_shared<Mlp>();
  torch::optim::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  auto options = mp::TrainerOptions().fused_optimizer(fused).max_grad_norm(clip).accumulation_steps(
      accumulation);
  if constexpr (!std::is_same_v<typename P::scaler_type, mp::NoScaler>) {
    options.scaler(mp::GradScalerOptions().init_scale(std::ldexp(1.0, 30)).growth_interval(4));
  }
  mp::Trainer<P> trainer(net, adamw, options);
  auto x = torch::randn({64, 16});
  auto y = x.slice(1, 0, 4).argmax(1);
  Run run;
  for (int step = 0; step < 30; ++step) {
    auto input = x.clone();
    if (step == 7) input[3][2] = std::numeric_limits<float>::quiet_NaN();
    const auto before = test::snapshot(net->parameters());
    const auto masters_before = test::snapshot(trainer.master_weights());
    const auto report = trainer.step([&] {
      return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(input)), y);
    });
    if (report.status == mp::StepStatus::skipped) {
      CHECK(test::identical(test::snapshot(net->parameters()), before));
      CHECK(test::identical(trainer.master_weights(), masters_before));
    }
    run.statuses.push_back(report.status);
    run.losses.push_back(report.loss.template item<double>());
    run.scales.push_back(report.scale);
    run.norms.push_back(report.grad_norm.value_or(-1.0));
  }
  run.params = test::snapshot(trainer.master_weights().empty() ? net->parameters()
                                                               : trainer.master_weights());
  return run;
}

}  // namespace

TEST_CASE_TEMPLATE("Trainer: fused_optimizer takes the unfused path's steps, skips and scales" * needs_fused, P,
                   mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>,
                   ScaledO2, mp::MixedO1<at::Half>, mp::MixedO2<at::Half>) {
  struct Case {
    std::optional<double> clip;
    std::int64_t accumulation;
  };
  for (const auto& c : {Case{std::nullopt, 1}, Case{0.5, 1}, Case{0.5, 2}}) {
    const auto clip = c.clip;
    const auto accumulation = c.accumulation;
    CAPTURE(clip.value_or(0.0));
    CAPTURE(accumulation);
    const auto unfused = train<P>(false, clip, accumulation);
    const auto fused = train<P>(true, clip, accumulation);
    CHECK(fused.statuses == unfused.statuses);
    CHECK(fused.scales == unfused.scales);
    CHECK(std::count(fused.statuses.begin(), fused.statuses.end(), mp::StepStatus::skipped) >=
          (P::low_dtype == c10::ScalarType::Half ? 2 : 1));
    // A weight that differs by an fp32 ulp can round to the neighbouring low-precision value
    // where the model computes in it (MixedO2's cast, MixedO1's autocast): the trajectories
    // then agree to two of its ulps, bf16's 2^-7 (measured: 1e-2 at most) or fp16's 2^-10
    // (measured 7e-6 under AVX2 and AVX-512 kernels, 1.7e-4 under ATEN_CPU_CAPABILITY=default,
    // where a rounding flipped); FullPrecision to 1e-4 (measured: 7e-7).
    const double tolerance = P::low_dtype == c10::ScalarType::BFloat16 ? 2.0 / 128
                             : P::low_dtype == c10::ScalarType::Half   ? 2.0 / 1024
                                                                       : 1e-4;
    for (std::size_t i = 0; i < fused.losses.size(); ++i) {
      if (!std::isfinite(unfused.losses[i])) {
        CHECK_FALSE(std::isfinite(fused.losses[i]));
        continue;
      }
      CHECK(fused.losses[i] == doctest::Approx(unfused.losses[i]).epsilon(tolerance));
      if (!clip) continue;
      if (std::isinf(unfused.norms[i])) {
        CHECK(std::isinf(fused.norms[i]));  // an overflowing step reports an infinite norm
      } else {
        CHECK(fused.norms[i] == doctest::Approx(unfused.norms[i]).epsilon(tolerance));
      }
    }
    double worst_loss = 0.0;
    for (std::size_t i = 0; i < fused.losses.size(); ++i) {
      if (std::isfinite(unfused.losses[i])) {
        worst_loss = std::max(worst_loss, std::abs(fused.losses[i] / unfused.losses[i] - 1.0));
      }
    }
    const double param_diff = relative_diff(fused.params, unfused.params, 1e-2);
    MESSAGE(P::name << ": largest relative loss difference " << worst_loss
                    << ", final parameters " << param_diff);
    CHECK(param_diff <= tolerance);
  }
}

TEST_CASE("Trainer: fused_optimizer refuses what it cannot fuse, before anything is cast" * needs_fused) {
  auto net = std::make_shared<Mlp>();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  CHECK_THROWS_WITH_AS(mp::Trainer<mp::MixedO2<at::BFloat16>>(
                           net, sgd, mp::TrainerOptions().fused_optimizer(true)),
                       doctest::Contains("turn fused_optimizer off"), mp::Error);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  CHECK_THROWS_WITH_AS(mp::Trainer<mp::PureHalf<at::BFloat16>>(
                           net, adam, mp::TrainerOptions().fused_optimizer(true)),
                       doctest::Contains("use MixedO2 (fp32 masters)"), mp::Error);
  CHECK(net->fc1->weight.scalar_type() == at::kFloat);
  // Nothing was claimed either: a valid Trainer can still take the model.
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(net, adam, mp::TrainerOptions().fused_optimizer(true));
  CHECK(net->fc1->weight.scalar_type() == at::kBFloat16);
}

TEST_CASE("fused_optimizer needs LibTorch >= 2.4: a clear Error, before anything is cast" *
          doctest::skip(mp::fused_adam_available)) {
  auto net = std::make_shared<torch::nn::LinearImpl>(4, 2);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  CHECK_FALSE(mp::fused_adam_available);
  CHECK_THROWS_WITH_AS(mp::Trainer<mp::MixedO2<at::BFloat16>>(
                           net, adam, mp::TrainerOptions().fused_optimizer(true)),
                       doctest::Contains("needs LibTorch >= 2.4"), mp::Error);
  CHECK(net->weight.scalar_type() == at::kFloat);
  CHECK_THROWS_WITH_AS(mp::fused_adam_step(adam), doctest::Contains("needs LibTorch >= 2.4"), mp::Error);
}

}  // namespace test_fused_adam
