// The lean training state (core/state_storage.hpp): remainder masters, bf16 moments and
// stochastic rounding. Its kernels on bits (optim/lean_kernels.hpp), then Trainers run side by
// side on the same weights and data: remainder masters are MixedO2's fp32 masters bit for bit,
// bf16 moments are fp32 moments rounded once per step, stochastic rounding is unbiased and
// trains where rounding to nearest freezes; checkpoints resume bit for bit and convert.
#include <mixprec/mixprec.hpp>

#include "adam_bound.hpp"
#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <vector>

namespace test_lean_state {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

using Remainder = mp::MixedO2<at::BFloat16, mp::RemainderMasters<>>;
using RemainderBf16 = mp::MixedO2<at::BFloat16, mp::RemainderMasters<at::BFloat16>>;
using PlainO2 = mp::MixedO2<at::BFloat16>;
using Stochastic = mp::PureHalf<at::BFloat16, mp::StochasticRounding<>>;
using StochasticFp32 = mp::PureHalf<at::BFloat16, mp::StochasticRounding<float>>;

float float_of(std::uint32_t b) { return std::bit_cast<float>(b); }

// fp32 values that exercise every case of the split: random magnitudes, both ties (low half
// 0x8000 with the kept half even and odd), the largest values (which round to inf), infs,
// zeros, subnormals.
at::Tensor awkward_values() {
  torch::manual_seed(3);
  auto v = (torch::randn({4096}) * torch::exp(torch::randn({4096}) * 8)).contiguous();
  std::vector<float> special;
  for (std::uint32_t hi : {0x3f80U, 0x3f81U, 0xbf80U, 0xbf81U, 0x0001U, 0x7f7eU, 0x7f7fU}) {
    for (std::uint32_t lo : {0x0000U, 0x0001U, 0x7fffU, 0x8000U, 0x8001U, 0xffffU}) {
      special.push_back(float_of((hi << 16) | lo));
    }
  }
  for (float f : {0.0F, -0.0F, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::max(), -std::numeric_limits<float>::max()}) {
    special.push_back(f);
  }
  return torch::cat({v, torch::tensor(special)}).contiguous();
}

// A model with every kind of parameter the policies treat apart: Linear (bf16 with a master),
// LayerNorm (bf16 under MixedO2) and BatchNorm (kept fp32: no remainder, fp32 state).
struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 32))),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})))),
        bn(register_module("bn", torch::nn::BatchNorm1d(32))),
        fc2(register_module("fc2", torch::nn::Linear(32, 4))) {}
  at::Tensor forward(const at::Tensor& x) {
    return fc2(torch::relu(bn(ln(fc1(x)))));
  }
  torch::nn::Linear fc1;
  torch::nn::LayerNorm ln;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Net);

Net make_net() {
  torch::manual_seed(7);
  return Net();
}

// Step s's batch, the same for every trainer.
std::pair<at::Tensor, at::Tensor> batch(int s) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(500 + static_cast<std::uint64_t>(s));
  return {at::randn({16, 8}, g), at::randn({16, 4}, g)};
}

template <class P>
mp::StepReport train_step(mp::Trainer<P>& trainer, Net& net, int s) {
  const auto [x, y] = batch(s);
  return trainer.step([&] {
    return torch::mse_loss(net->forward(trainer.cast_input(x)).to(at::kFloat), y);
  });
}

bool same_bits(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].scalar_type() != b[i].scalar_type() || !torch::equal(a[i], b[i])) return false;
  }
  return true;
}

double max_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, (a[i].to(at::kDouble) - b[i].to(at::kDouble)).abs().max().item<double>());
  }
  return worst;
}

using MakeOptimizer =
    std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<at::Tensor>&)>;

// Trainers of PA and PB side by side for `steps` steps; the first step after which their
// models' parameters differ in any bit, or -1.
template <class PA, class PB>
int first_difference(int steps, const MakeOptimizer& make, mp::TrainerOptions options = {}) {
  auto a = make_net();
  auto b = make_net();
  auto oa = make(a->parameters());
  auto ob = make(b->parameters());
  mp::Trainer<PA> ta(a, *oa, options);
  mp::Trainer<PB> tb(b, *ob, options);
  for (int s = 0; s < steps; ++s) {
    train_step(ta, a, s);
    train_step(tb, b, s);
    if (!same_bits(a->parameters(), b->parameters())) return s;
  }
  if (!same_bits(ta.master_weights(), tb.master_weights())) return steps;
  return -1;
}

}  // namespace

static_assert(mp::PrecisionPolicy<Remainder> && mp::PrecisionPolicy<RemainderBf16> &&
              mp::PrecisionPolicy<Stochastic> && mp::PrecisionPolicy<StochasticFp32>);
static_assert(!mp::detail::lean_state<PlainO2> && mp::detail::lean_state<Remainder> &&
              mp::detail::lean_state<mp::MixedO2<at::BFloat16, mp::Fp32Masters<at::BFloat16>>>);

TEST_CASE("the lean policies' names, as messages and checkpoints print them") {
  CHECK(PlainO2::name == "MixedO2<BFloat16>");  // the default storage: the name of before
  CHECK(Remainder::name == "MixedO2<BFloat16, RemainderMasters>");
  CHECK(RemainderBf16::name == "MixedO2<BFloat16, RemainderMasters<BFloat16>>");
  CHECK(Stochastic::name == "PureHalf<BFloat16, StochasticRounding<BFloat16>>");
  CHECK(StochasticFp32::name == "PureHalf<BFloat16, StochasticRounding>");
  CHECK(mp::PureHalf<at::BFloat16>::name == "PureHalf<BFloat16>");
}

TEST_CASE("split and join: the bf16 rounding is copy_'s and the pair is the fp32 value, exactly") {
  const auto master = awkward_values();
  auto hi = at::empty(master.sizes(), master.options().dtype(at::kBFloat16));
  auto rem = at::empty(master.sizes(), master.options().dtype(at::kShort));
  const auto down_ties = mp::detail::split_master(master, hi, rem);
  CHECK(torch::equal(hi.view(at::kShort), master.to(at::kBFloat16).view(at::kShort)));
  CHECK(!down_ties.empty());  // 1.0 + 0x8000 (even, rounds down) is among the values
  auto back = at::empty_like(master);
  mp::detail::join_master(hi, rem, down_ties, back);
  CHECK(torch::equal(back.view(at::kInt), master.view(at::kInt)));
  // The ATen-op path (CUDA's) computes the same bits.
  auto hi2 = at::empty_like(hi);
  auto rem2 = at::empty_like(rem);
  CHECK(mp::detail::aten_split(master, hi2, rem2) == down_ties);
  CHECK(torch::equal(hi2.view(at::kShort), hi.view(at::kShort)));
  CHECK(torch::equal(rem2, rem));
  auto back2 = at::empty_like(master);
  mp::detail::aten_join(hi, rem, down_ties, back2);
  CHECK(torch::equal(back2.view(at::kInt), master.view(at::kInt)));
}

TEST_CASE("stochastic rounding: between the two neighbours, unbiased, and the same on every path") {
  const float ulp = std::ldexp(1.0F, -7);  // bf16's spacing in [1, 2)
  const float x = 1.0F + 0.3F * ulp;
  const std::int64_t n = 100000;
  const double sigma = ulp * std::sqrt(0.3 * 0.7 / static_cast<double>(n));
  SUBCASE("10^5 elements of one tensor") {
    const auto in = at::full({n}, x);
    auto out = at::empty({n}, at::kBFloat16);
    mp::detail::stochastic_round(in, out, mp::detail::rounding_key(0, 0, 0));
    const auto f = out.to(at::kFloat);
    CHECK(f.eq(1.0F).logical_or(f.eq(1.0F + ulp)).all().item<bool>());
    const double mean = f.to(at::kDouble).mean().item<double>();
    INFO("mean - x = " << mean - x << ", sigma " << sigma);
    CHECK(std::abs(mean - x) < 4 * sigma);
    auto out2 = at::empty_like(out);
    mp::detail::aten_stochastic_round(in, out2, mp::detail::rounding_key(0, 0, 0));
    CHECK(torch::equal(out.view(at::kShort), out2.view(at::kShort)));
    // A slice told where it starts (a rank's piece, sharded) rounds as in the whole tensor;
    // told nothing, it rounds otherwise.
    const std::int64_t from = 33333, count = 4567;
    const auto slice = in.narrow(0, from, count).clone();
    auto part = at::empty({count}, at::kBFloat16), part2 = at::empty_like(part);
    mp::detail::stochastic_round(slice, part, mp::detail::rounding_key(0, 0, 0), from);
    mp::detail::aten_stochastic_round(slice, part2, mp::detail::rounding_key(0, 0, 0), from);
    const auto whole = out.narrow(0, from, count).view(at::kShort);
    CHECK(torch::equal(part.view(at::kShort), whole));
    CHECK(torch::equal(part2.view(at::kShort), whole));
    mp::detail::stochastic_round(slice, part, mp::detail::rounding_key(0, 0, 0));
    CHECK_FALSE(torch::equal(part.view(at::kShort), whole));
  }
  SUBCASE("one element over 10^5 steps") {
    const auto in = at::full({1}, -x);
    auto out = at::empty({1}, at::kBFloat16);
    double sum = 0.0;
    for (std::int64_t s = 0; s < n; ++s) {
      mp::detail::stochastic_round(in, out, mp::detail::rounding_key(5, static_cast<std::uint64_t>(s), 3));
      sum += out.item<float>();
    }
    const double mean = sum / static_cast<double>(n);
    INFO("mean + x = " << mean + x << ", sigma " << sigma);
    CHECK(std::abs(mean + x) < 4 * sigma);
  }
  SUBCASE("values bf16 holds exactly, infinities and NaN stay") {
    const auto in = torch::tensor({1.0F, -2.5F, 0.0F, std::numeric_limits<float>::infinity(),
                                   -std::numeric_limits<float>::infinity()});
    auto out = at::empty(in.sizes(), at::kBFloat16);
    mp::detail::stochastic_round(in, out, 12345);
    CHECK(torch::equal(out.to(at::kFloat), in));
    const auto nan = torch::full({3}, std::numeric_limits<float>::quiet_NaN());
    auto nan_out = at::empty({3}, at::kBFloat16);
    mp::detail::stochastic_round(nan, nan_out, 1);
    CHECK(nan_out.isnan().all().item<bool>());
  }
}

TEST_CASE("remainder masters train bit for bit as fp32 masters, 200 steps, every optimizer") {
  SUBCASE("SGD with momentum and weight decay") {
    CHECK(first_difference<PlainO2, Remainder>(200, [](const auto& p) {
      return std::make_unique<torch::optim::SGD>(
          p, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-4));
    }) == -1);
  }
  SUBCASE("Adam") {
    CHECK(first_difference<PlainO2, Remainder>(200, [](const auto& p) {
      return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-3));
    }) == -1);
  }
  SUBCASE("AdamW, accumulating 2 micro-batches, clipping") {
    CHECK(first_difference<PlainO2, Remainder>(
              200,
              [](const auto& p) {
                return std::make_unique<torch::optim::AdamW>(
                    p, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
              },
              mp::TrainerOptions().accumulation_steps(2).max_grad_norm(0.5)) == -1);
  }
  SUBCASE("RMSprop") {
    CHECK(first_difference<PlainO2, Remainder>(200, [](const auto& p) {
      return std::make_unique<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions(1e-3));
    }) == -1);
  }
}

TEST_CASE("the one-pass lean Adam kernel: remainder masters are its fp32 masters, bit for bit") {
  // 200 steps over 2^15 elements (about 50 ties that round down, each carried through a step),
  // bf16 gradients, for each form of the moments and Adam and AdamW (with amsgrad).
  const std::int64_t n = 1 << 15;
  for (const bool moments_bf16 : {false, true}) {
    for (const bool adamw : {false, true}) {
      CAPTURE(moments_bf16);
      CAPTURE(adamw);
      torch::manual_seed(5);
      auto master = torch::randn({n}) * 0.5;
      auto hi = master.to(at::kBFloat16);
      auto rem = at::empty({n}, at::kShort);
      auto ties = mp::detail::split_master(master, hi, rem);
      const auto moment = moments_bf16 ? at::kBFloat16 : at::kFloat;
      std::array<at::Tensor, 3> m32{at::zeros({n}, moment), at::zeros({n}, moment), at::zeros({n}, moment)};
      std::array<at::Tensor, 3> mr{at::zeros({n}, moment), at::zeros({n}, moment), at::zeros({n}, moment)};
      std::size_t tie_steps = 0;
      for (int step = 1; step <= 200; ++step) {
        auto g = at::make_generator<at::CPUGeneratorImpl>(100 + static_cast<std::uint64_t>(step));
        const auto grad = (at::randn({n}, g) * 1e-2).to(at::kBFloat16);
        auto st = mp::detail::LeanAdamStep::make(1e-3, 0.9, 0.999, 1e-8, 0.01, step, adamw,
                                                 /*amsgrad=*/!adamw);
        st.grad_scale = 2.0F;
        mp::detail::LeanAdamTensors a;
        a.numel = n;
        a.grad = grad.data_ptr();
        a.grad_bf16 = true;
        a.moments_bf16 = moments_bf16;
        auto b = a;
        a.fp32 = static_cast<float*>(master.data_ptr());
        a.exp_avg = m32[0].data_ptr();
        a.exp_avg_sq = m32[1].data_ptr();
        a.max_exp_avg_sq = m32[2].data_ptr();
        b.bf16 = static_cast<std::uint16_t*>(hi.data_ptr());
        b.remainder = static_cast<std::int16_t*>(rem.data_ptr());
        b.exp_avg = mr[0].data_ptr();
        b.exp_avg_sq = mr[1].data_ptr();
        b.max_exp_avg_sq = mr[2].data_ptr();
        mp::detail::lean_adam_update(a, st, {});
        ties = mp::detail::lean_adam_update(b, st, ties);
        tie_steps += ties.empty() ? 0 : 1;
      }
      auto back = at::empty({n});
      mp::detail::join_master(hi, rem, ties, back);
      CHECK(torch::equal(back.view(at::kInt), master.view(at::kInt)));
      CHECK(torch::equal(hi.view(at::kShort), master.to(at::kBFloat16).view(at::kShort)));
      for (int k = 0; k < 3; ++k) CHECK(torch::equal(m32[k], mr[k]));
      CHECK(tie_steps >= 10);  // the ties' path ran, and carried over
    }
  }
}

TEST_CASE("the one-pass lean Adam kernel computes fp32 masters as ATen's fused kernel, bit for "
          "bit" * doctest::skip(!mp::fused_adam_available)) {
  // Three steps from random moments, for sizes with and without ATen's tail (the last numel % 8
  // elements), Adam (weight decay into the gradient, amsgrad) and AdamW, both forms of
  // ATen's lerp (1 - beta1 below and above 0.5), with and without a gradient scale; and a
  // rank's slice of a tensor (first, whole), which steps as those elements of the whole do.
  MESSAGE("ATen's CPU capability: ", mp::detail::aten_cpu_capability(), "; the kernel's grouping: ",
          std::string(mp::detail::aten_adam_arithmetic().fused ? "fused" : "unfused"));
  struct Hyper {
    bool adamw, amsgrad;
    double beta1, beta2, weight_decay;
    float scale;
  };
  const std::vector<Hyper> hypers{{true, false, 0.9, 0.999, 0.01, 1.0F},
                                  {true, true, 0.9, 0.999, 0.0, 1024.0F},
                                  {false, true, 0.9, 0.999, 0.1, 1.0F},
                                  {false, false, 0.3, 0.99, 0.01, 3.0F},
                                  {true, false, 0.3, 0.99, 0.05, 1.0F}};
  std::int64_t compared = 0, differ = 0;
  for (const auto& h : hypers) {
    for (const std::int64_t n : {1, 7, 15, 17, 40, 1000, 70003}) {
      for (const std::int64_t first : {std::int64_t{0}, n / 3}) {
        CAPTURE(h.adamw);
        CAPTURE(h.beta1);
        CAPTURE(n);
        CAPTURE(first);
        torch::manual_seed(n + first);
        auto p = torch::randn({n});
        auto m = torch::randn({n}) * 1e-3;
        auto v = torch::rand({n}) * 1e-6;
        auto vmax = v * 2;
        std::array<at::Tensor, 4> mine{p.clone(), m.clone(), v.clone(), vmax.clone()};
        for (int step = 1; step <= 3; ++step) {
          auto g = torch::randn({n}) * 1e-3 * h.scale;
          g.narrow(0, 0, std::min<std::int64_t>(n, 3)).zero_();  // zero gradients too
          // ATen's kernel over the whole tensor.
          mp::detail::FusedAdamBatch batch;
          batch.params = {p};
          batch.grads = {g.clone()};
          batch.exp_avgs = {m};
          batch.exp_avg_sqs = {v};
          if (h.amsgrad) batch.max_exp_avg_sqs = {vmax};
          batch.steps = {torch::full({}, static_cast<float>(step))};
          std::optional<at::Tensor> scale;
          if (h.scale != 1.0F) scale = torch::full({}, h.scale);
          mp::detail::fused_adam_kernel(h.adamw, batch, 1e-3, h.beta1, h.beta2, h.weight_decay,
                                        1e-8, h.amsgrad, scale);
          // The one-pass kernel over elements [first, n) as a slice of it.
          auto st = mp::detail::LeanAdamStep::make(1e-3, h.beta1, h.beta2, 1e-8, h.weight_decay,
                                                   step, h.adamw, h.amsgrad);
          st.grad_scale = h.scale;
          const auto slice = [&](const at::Tensor& t) { return t.narrow(0, first, n - first); };
          const auto gs = slice(g).contiguous();
          auto parts = std::array<at::Tensor, 4>{slice(mine[0]), slice(mine[1]), slice(mine[2]),
                                                 slice(mine[3])};
          mp::detail::LeanAdamTensors t;
          t.numel = n - first;
          t.first = first;
          t.whole = n;
          t.fp32 = static_cast<float*>(parts[0].data_ptr());
          t.grad = gs.data_ptr();
          t.exp_avg = parts[1].data_ptr();
          t.exp_avg_sq = parts[2].data_ptr();
          if (h.amsgrad) t.max_exp_avg_sq = parts[3].data_ptr();
          mp::detail::lean_adam_update(t, st, {});
          const std::array<at::Tensor, 4> theirs{p, m, v, vmax};
          for (int k = 0; k < (h.amsgrad ? 4 : 3); ++k) {
            const auto a = slice(theirs[k]).view(at::kInt), b = parts[k].view(at::kInt);
            differ += a.ne(b).sum().item<std::int64_t>();
            compared += a.numel();
          }
          // The next step starts from ATen's values, so that every step compares one step.
          for (int k = 0; k < 4; ++k) mine[k].copy_(theirs[k]);
        }
      }
    }
  }
  MESSAGE("one-pass kernel against ATen's fused kernel: ", differ, " of ", compared,
          " values differ");
  CHECK(differ == 0);
}

TEST_CASE("the one-pass lean Adam kernel: one step within the derived rounding bound of LibTorch's Adam and AdamW") {
  // The bound of tests/optim/adam_bound.hpp (another grouping of the same arithmetic), one
  // step at a time from LibTorch's state; under LibTorch 1.13 (no fused kernel) too.
  double worst = 0, worst_old = 0;
  for (const bool adamw : {true, false}) {
    CAPTURE(adamw);
    torch::manual_seed(9);
    const std::int64_t n = 4099;
    auto p = torch::randn({n});
    p.narrow(0, 0, 64).zero_();  // weights near zero (a bias initialised so): steps are all of them
    p.requires_grad_();
    auto q = p.detach().clone();
    std::unique_ptr<torch::optim::Optimizer> reference;
    if (adamw) {
      reference = std::make_unique<torch::optim::AdamW>(
          std::vector<at::Tensor>{p}, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    } else {
      reference = std::make_unique<torch::optim::Adam>(
          std::vector<at::Tensor>{p}, torch::optim::AdamOptions(1e-3).weight_decay(0.01));
    }
    auto m = at::zeros({n});
    auto v = at::zeros({n});
    for (int step = 1; step <= 20; ++step) {
      auto g = at::make_generator<at::CPUGeneratorImpl>(40 + static_cast<std::uint64_t>(step));
      const auto grad = at::randn({n}, g) * 1e-2;
      grad.narrow(0, 0, 5).zero_();
      const auto before = p.detach().clone();
      const auto m_before = m.clone();
      p.mutable_grad() = grad;
      reference->step();
      const auto st = mp::detail::LeanAdamStep::make(1e-3, 0.9, 0.999, 1e-8, 0.01, step, adamw,
                                                     /*amsgrad=*/false);
      mp::detail::LeanAdamTensors t;
      t.numel = n;
      t.fp32 = static_cast<float*>(q.data_ptr());
      t.grad = grad.data_ptr();
      t.exp_avg = m.data_ptr();
      t.exp_avg_sq = v.data_ptr();
      mp::detail::lean_adam_update(t, st, {});
      auto& state = *mp::detail::state_of(*reference, p);
      const auto& ref_m = adamw ? static_cast<torch::optim::AdamWParamState&>(state).exp_avg()
                                : static_cast<torch::optim::AdamParamState&>(state).exp_avg();
      const auto& ref_v = adamw ? static_cast<torch::optim::AdamWParamState&>(state).exp_avg_sq()
                                : static_cast<torch::optim::AdamParamState&>(state).exp_avg_sq();
      const auto bound = test::adam_rounding_bound(before, p.detach(), m_before, grad, ref_v, 1e-3,
                                                   0.9, 0.999, 1e-8, 0.01, adamw, step);
      const auto diff = (p.detach().to(at::kDouble) - q.to(at::kDouble)).abs();
      worst = std::max(worst, (diff / (bound + 1e-300)).max().item<double>());  // 0/0: 0
      worst_old = std::max(worst_old, (diff / (2 * std::numeric_limits<float>::epsilon() *
                                               (p.detach().abs().to(at::kDouble) + 1e-3)))
                                          .max().item<double>());
      CHECK(diff.le(bound).all().item<bool>());
      // The next step starts from LibTorch's state.
      q.copy_(p.detach());
      m.copy_(ref_m);
      v.copy_(ref_v);
    }
  }
  MESSAGE("one-pass Adam/AdamW vs LibTorch's, one step at a time: largest difference ", worst,
          " of the bound (", worst_old, " of the 2 eps (|p| + lr) stated before)");
}

TEST_CASE("fused_optimizer under the lean storages: the one-pass step trains as the others") {
  // RemainderMasters with fused_optimizer steps in one pass (no fp32 master, master gradient or
  // fp32 moment made); without it, MixedO2's own step, bit for bit. The two curves agree as two
  // groupings of Adam's arithmetic do (losses within 1 %, as for bf16 moments above).
  const auto adamw = [](const auto& p) {
    return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-3));
  };
  const auto losses = [&](auto policy_tag, bool fused, int accumulation) {
    using P = decltype(policy_tag);
    auto net = make_net();
    auto optimizer = adamw(net->parameters());
    mp::Trainer<P> trainer(net, *optimizer,
                           mp::TrainerOptions().fused_optimizer(fused).max_grad_norm(1.0)
                               .accumulation_steps(accumulation));
    std::vector<double> out;
    for (int s = 0; s < 100 * accumulation; ++s) {
      const auto r = train_step(trainer, net, s);
      if (r.status != mp::StepStatus::accumulating) out.push_back(r.loss.template item<double>());
    }
    const auto bytes = trainer.state_bytes();
    CHECK(bytes.gradients == 0);
    return out;
  };
  for (const int accumulation : {1, 2}) {
    CAPTURE(accumulation);
    const auto reference = losses(Remainder{}, false, accumulation);
    for (const auto& curve : {losses(Remainder{}, true, accumulation),
                              losses(RemainderBf16{}, true, accumulation),
                              losses(Stochastic{}, true, accumulation)}) {
      double worst = 0;
      for (std::size_t i = 0; i < curve.size(); ++i) {
        worst = std::max(worst, std::abs(curve[i] - reference[i]) / reference[i]);
      }
      MESSAGE("one-pass step vs MixedO2's: largest relative loss difference ", worst);
      CHECK(worst < 0.05);
    }
  }
}

// ATen's fused Adam needs LibTorch >= 2.4: under 1.13 these cases are reported as skipped.
const auto needs_fused = doctest::skip(!mp::fused_adam_available);

TEST_CASE("fused_optimizer: RemainderMasters trains bit for bit as MixedO2, the one-pass step "
          "as ATen's fused kernel" * needs_fused) {
  // MixedO2 steps its fp32 masters through at::_fused_adamw_ / _fused_adam_; RemainderMasters
  // through mixprec's one-pass kernel, over the bf16 weight and its remainder. The kernel takes
  // ATen's arithmetic for the CPU capability ATen dispatches to (its fused multiply-adds on
  // AVX2 and AVX-512, none on DEFAULT), so the masters agree in every bit.
  struct Case {
    const char* name;
    MakeOptimizer make;
    mp::TrainerOptions options;
  };
  const std::vector<Case> cases{
      {"AdamW", [](const auto& p) {
         return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
       }, mp::TrainerOptions()},
      {"AdamW, accumulating 2 micro-batches, clipping", [](const auto& p) {
         return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
       }, mp::TrainerOptions().accumulation_steps(2).max_grad_norm(0.5)},
      {"Adam, weight decay, amsgrad, beta1 0.3", [](const auto& p) {
         return std::make_unique<torch::optim::Adam>(
             p, torch::optim::AdamOptions(1e-3).weight_decay(0.01).amsgrad(true).betas({0.3, 0.99}));
       }, mp::TrainerOptions().max_grad_norm(0.5)},
  };
  MESSAGE("ATen's CPU capability: ", mp::detail::aten_cpu_capability());
  for (const auto& c : cases) {
    CAPTURE(c.name);
    auto options = c.options;
    options.fused_optimizer(true);
    // After one step: how many masters differ.
    auto a = make_net();
    auto b = make_net();
    auto oa = c.make(a->parameters());
    auto ob = c.make(b->parameters());
    mp::Trainer<PlainO2> ta(a, *oa, options);
    mp::Trainer<Remainder> tb(b, *ob, options);
    for (int s = 0; s < options.accumulation_steps(); ++s) {
      train_step(ta, a, s);
      train_step(tb, b, s);
    }
    std::int64_t differ = 0, total = 0;
    const auto ma = ta.master_weights(), mb = tb.master_weights();
    for (std::size_t i = 0; i < ma.size(); ++i) {
      differ += ma[i].view(at::kInt).ne(mb[i].view(at::kInt)).sum().item<std::int64_t>();
      total += ma[i].numel();
    }
    const int first = first_difference<PlainO2, Remainder>(60, c.make, options);
    MESSAGE(std::string(c.name), ": after one step ", differ, " of ", total, " masters differ; first step "
            "whose weights differ in 60: ", first);
    CHECK(differ == 0);
    CHECK(first == -1);
  }
}

TEST_CASE("state_bytes: what each storage keeps between steps, from the tensors") {
  // Net's parameters: L elements that the policies cast to bf16 (Linear, LayerNorm) in T
  // tensors, and F in BatchNorm, which MixedO2 keeps in fp32 (its own master, fp32 state).
  std::int64_t low = 0, fp32 = 0, low_tensors = 0;
  for (const auto& item : make_net()->named_parameters()) {
    const bool bn = item.key().rfind("bn.", 0) == 0;
    (bn ? fp32 : low) += item.value().numel();
    low_tensors += bn ? 0 : 1;
  }
  const auto measure = [](auto policy_tag) {
    using P = decltype(policy_tag);
    auto net = make_net();
    torch::optim::AdamW optimizer(net->parameters(), torch::optim::AdamWOptions(1e-3));
    mp::Trainer<P> trainer(net, optimizer);
    for (int s = 0; s < 3; ++s) train_step(trainer, net, s);
    const auto bytes = trainer.state_bytes();
    CHECK(bytes.optimizer_known);
    CHECK(bytes.gradients == 0);  // cleared after each optimizer step
    return bytes;
  };
  const auto o2 = measure(PlainO2{});
  CHECK(o2.weights == 2 * low + 4 * fp32);
  CHECK(o2.masters == 4 * low);
  CHECK(o2.optimizer == 8 * (low + fp32));
  const auto rem = measure(Remainder{});
  // Each lean master keeps one float (its expanded NaN); ties that rounded down, 8 bytes each.
  const auto ties = rem.masters - (2 * low + 4 * low_tensors);
  CHECK(ties >= 0);
  CHECK(ties % 8 == 0);
  CHECK(ties < low / 100);
  CHECK(rem.optimizer == 8 * (low + fp32));
  const auto lean = measure(RemainderBf16{});
  CHECK(lean.optimizer == 4 * low + 8 * fp32);  // BatchNorm's stay fp32
  const auto sr = measure(Stochastic{});        // everything bf16, BatchNorm too
  CHECK(sr.weights == 2 * (low + fp32));
  CHECK(sr.masters == 4 * (low_tensors + 2));
  CHECK(sr.optimizer == 4 * (low + fp32));
  std::cout << "training state, bytes per parameter between steps (AdamW): MixedO2 "
            << static_cast<double>(o2.total()) / static_cast<double>(low + fp32) << ", remainders "
            << static_cast<double>(rem.total()) / static_cast<double>(low + fp32)
            << ", + bf16 moments " << static_cast<double>(lean.total()) / static_cast<double>(low + fp32)
            << ", stochastic rounding " << static_cast<double>(sr.total()) / static_cast<double>(low + fp32)
            << "\n";
}

TEST_CASE("bf16 moments: one step is the fp32 moments' step, its moments rounded to bf16") {
  // Same weights, the same first batch: the step computes in fp32 in both; the moments kept
  // are the fp32 ones rounded to nearest, the weights the same bits.
  auto a = make_net();
  auto b = make_net();
  torch::optim::AdamW oa(a->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW ob(b->parameters(), torch::optim::AdamWOptions(1e-3));
  mp::Trainer<Remainder> ta(a, oa);
  mp::Trainer<RemainderBf16> tb(b, ob);
  train_step(ta, a, 0);
  train_step(tb, b, 0);
  CHECK(same_bits(a->parameters(), b->parameters()));
  const auto moments = [](torch::optim::AdamW& o, bool second) {
    std::vector<at::Tensor> out;
    for (const auto& p : o.param_groups()[0].params()) {
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(
          *o.state().at(mp::detail::state_key<decltype(o.state())>(p)));
      out.push_back(second ? s.exp_avg_sq() : s.exp_avg());
    }
    return out;
  };
  for (bool second : {false, true}) {
    const auto full = moments(oa, second);
    const auto kept = moments(ob, second);
    for (std::size_t i = 0; i < full.size(); ++i) {
      const auto expect = kept[i].scalar_type() == at::kBFloat16 ? full[i].to(at::kBFloat16)
                                                                  : full[i];
      CHECK(torch::equal(kept[i], expect));
    }
  }
  // 200 steps: the trajectories part. Not by a bound on the weights: Adam's update of an
  // element whose gradient hovers around 0 is +-lr by the sign of its first moment, which any
  // difference in the weights flips (two fp32 runs that differ in one ulp part the same way).
  // The losses are what must agree: each step's within 1 % (measured: 0.1 % at most).
  const int steps = 200;
  double worst = 0.0;
  for (int s = 1; s < steps; ++s) {
    const double la = train_step(ta, a, s).loss.item<double>();
    const double lb = train_step(tb, b, s).loss.item<double>();
    worst = std::max(worst, std::abs(la - lb) / la);
  }
  std::cout << "bf16 moments vs fp32 moments, AdamW, 200 steps: largest relative loss "
            << "difference " << worst << ", largest master difference "
            << max_difference(ta.master_weights(), tb.master_weights()) << "\n";
  CHECK(worst < 0.01);
}

TEST_CASE("stochastic rounding trains where rounding to nearest freezes") {
  // Weights near 1 (bf16's half ulp there is 2^-8 = 0.0039) and Adam's updates of ~1e-3: each
  // update rounds back to the old weight to nearest; stochastically it lands a step away 1e-3 /
  // 2^-7 of the times, so the weights drift to the target on average.
  const auto run = [](auto policy_tag, int steps) {
    using P = decltype(policy_tag);
    torch::manual_seed(1);
    auto net = torch::nn::Linear(torch::nn::LinearOptions(64, 1).bias(false));
    {
      torch::NoGradGuard no_grad;
      net->weight.fill_(1.0);
    }
    auto target = torch::full({64, 1}, 1.05F);
    torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-3));
    mp::Trainer<P> trainer(net, optimizer);
    auto g = at::make_generator<at::CPUGeneratorImpl>(9);
    double last = 0.0;
    for (int s = 0; s < steps; ++s) {
      const auto x = at::randn({32, 64}, g);
      const auto y = x.matmul(target);
      last = trainer.step([&] {
        return torch::mse_loss(net->forward(trainer.cast_input(x)).to(at::kFloat), y);
      }).loss.template item<double>();
    }
    return std::make_pair(last, net->weight.detach().to(at::kFloat).clone());
  };
  const auto [loss_rn, w_rn] = run(mp::PureHalf<at::BFloat16>{}, 300);
  const auto [loss_sr, w_sr] = run(Stochastic{}, 300);
  const auto [loss_o2, w_o2] = run(PlainO2{}, 300);
  const double initial = 64 * 0.05 * 0.05;  // E[(x . (w - target))^2] at w = 1
  std::cout << "weights at 1, target 1.05, Adam lr 1e-3, 300 steps: loss "
            << loss_rn << " (round to nearest), " << loss_sr << " (stochastic), " << loss_o2
            << " (MixedO2), from " << initial << "\n";
  CHECK(w_rn.eq(1.0F).all().item<bool>());  // frozen
  // Stochastic: within what bf16 weights can reach: MixedO2's loss plus each weight off by
  // up to one ulp (2^-7) of noise, 64 * 2^-14.
  CHECK(loss_sr < 0.25 * initial);
  CHECK(loss_sr <= loss_o2 + 64 * std::ldexp(1.0, -14));
}

TEST_CASE("lean checkpoints resume bit for bit, and convert to and from fp32 masters") {
  const auto dir = std::filesystem::temp_directory_path() / "mixprec_test_lean_state";
  std::filesystem::create_directories(dir);
  const auto make_opt = [](const std::vector<at::Tensor>& p) {
    return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-3));
  };
  const auto resume = [&](auto policy_tag) {
    using P = decltype(policy_tag);
    const auto path = (dir / "lean.pt").string();
    auto a = make_net();
    auto oa = make_opt(a->parameters());
    mp::Trainer<P> ta(a, *oa, mp::TrainerOptions().rounding_seed(42));
    for (int s = 0; s < 10; ++s) train_step(ta, a, s);
    ta.save(path);
    for (int s = 10; s < 20; ++s) train_step(ta, a, s);
    auto b = make_net();
    auto ob = make_opt(b->parameters());
    mp::Trainer<P> tb(b, *ob);
    tb.load(path);
    for (int s = 10; s < 20; ++s) train_step(tb, b, s);
    CHECK(same_bits(a->parameters(), b->parameters()));
    CHECK(same_bits(ta.master_weights(), tb.master_weights()));
  };
  SUBCASE("RemainderMasters<BFloat16>") { resume(RemainderBf16{}); }
  SUBCASE("StochasticRounding") { resume(Stochastic{}); }
  SUBCASE("a lean checkpoint into fp32 masters and back") {
    const auto path = (dir / "convert.pt").string();
    auto a = make_net();
    auto oa = make_opt(a->parameters());
    mp::Trainer<RemainderBf16> ta(a, *oa);
    for (int s = 0; s < 10; ++s) train_step(ta, a, s);
    ta.save(path);
    auto b = make_net();
    auto ob = make_opt(b->parameters());
    mp::Trainer<PlainO2> tb(b, *ob);
    tb.load(path);
    CHECK(same_bits(ta.master_weights(), tb.master_weights()));
    CHECK(same_bits(a->parameters(), b->parameters()));
    for (const auto& [key, state] : ob->state()) {  // widened: fp32 masters take fp32 moments
      CHECK(static_cast<const torch::optim::AdamWParamState&>(*state).exp_avg().scalar_type() ==
            at::kFloat);
    }
    const auto back = (dir / "back.pt").string();
    tb.save(back);
    auto c = make_net();
    auto oc = make_opt(c->parameters());
    mp::Trainer<RemainderBf16> tc(c, *oc);
    tc.load(back);
    for (int s = 10; s < 15; ++s) {
      train_step(ta, a, s);
      train_step(tc, c, s);
    }
    CHECK(same_bits(a->parameters(), c->parameters()));
  }
  SUBCASE("the fp32 export is the masters, exactly") {
    auto a = make_net();
    auto b = make_net();
    auto oa = make_opt(a->parameters());
    auto ob = make_opt(b->parameters());
    mp::Trainer<PlainO2> ta(a, *oa);
    mp::Trainer<Remainder> tb(b, *ob);
    for (int s = 0; s < 10; ++s) {
      train_step(ta, a, s);
      train_step(tb, b, s);
    }
    const auto ea = ta.fp32_state_dict();
    const auto eb = tb.fp32_state_dict();
    REQUIRE(ea.size() == eb.size());
    for (std::size_t i = 0; i < ea.size(); ++i) {
      CHECK(torch::equal(ea[i].value(), eb[i].value()));
    }
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("lean state: bad input is an Error that leaves the model and optimizer untouched") {
  auto net = make_net();
  const auto before = net->parameters();
  std::vector<at::Tensor> copies;
  for (const auto& p : before) copies.push_back(p.detach().clone());
  torch::optim::RMSprop rmsprop(net->parameters(), torch::optim::RMSpropOptions(1e-3));
  CHECK_THROWS_WITH_AS(mp::Trainer<RemainderBf16>(net, rmsprop),
                       doctest::Contains("keeps the optimizer's moments in bf16"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::Trainer<Stochastic>(net, rmsprop),
                       doctest::Contains("StochasticRounding<float>"), mp::Error);
  CHECK(same_bits(net->parameters(), copies));
  CHECK(rmsprop.state().empty());
  // The one-pass step (fused_optimizer) is Adam's and AdamW's.
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  CHECK_THROWS_WITH_AS(mp::Trainer<Remainder>(net, sgd, mp::TrainerOptions().fused_optimizer(true)),
                       doctest::Contains("steps Adam or AdamW in one pass"), mp::Error);
  CHECK(same_bits(net->parameters(), copies));
  // With fp32 moments RMSprop is fine.
  CHECK_NOTHROW(mp::Trainer<StochasticFp32>(net, rmsprop));
}

}  // namespace test_lean_state
