// MixedFP8 (fp8.hpp): the fp8 casts against an encoder written here from the formats' definition,
// the fp8 products of Float8Linear against an fp64 reference, training against MixedO2<BFloat16>,
// delayed scaling against a hand-computed trace of amax histories and scales (an inf included),
// bit-for-bit resume, precision maps, and the Errors. LibTorch 1.13 has no fp8: every case is
// reported as skipped there. The parity with torchao is in test_parity.cpp.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace test_fp8 {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

using test::with_fp8;
using test::with_fp8_recipes;

// ---- fp8 formats, from their definition (OCP FP8: e4m3fn bias 7, no inf, S.1111.111 is NaN;
// e5m2 bias 15, IEEE-like).
double decode(std::uint8_t code, bool e5m2) {
  const int mantissa_bits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
  const int exponent = (code & 0x7F) >> mantissa_bits;
  const int mantissa = code & ((1 << mantissa_bits) - 1);
  const double sign = (code & 0x80) != 0 ? -1.0 : 1.0;
  if (!e5m2 && (code & 0x7F) == 0x7F) return std::numeric_limits<double>::quiet_NaN();
  if (e5m2 && exponent == 31) {
    return mantissa == 0 ? sign * std::numeric_limits<double>::infinity()
                         : std::numeric_limits<double>::quiet_NaN();
  }
  const double fraction = static_cast<double>(mantissa) / (1 << mantissa_bits);
  return exponent == 0 ? sign * fraction * std::ldexp(1.0, 1 - bias)
                       : sign * (1.0 + fraction) * std::ldexp(1.0, exponent - bias);
}

// The nearest finite code (ties to the even code), saturating at the largest: what a saturating
// round-to-nearest-even cast gives. NaN is not asked for here.
std::uint8_t encode(double value, bool e5m2) {
  int best = -1;
  double best_error = 0.0;
  for (int code = 0; code < 256; ++code) {
    const double v = decode(static_cast<std::uint8_t>(code), e5m2);
    if (!std::isfinite(v)) continue;
    if (v == 0.0 && ((code & 0x80) != 0) != std::signbit(value)) continue;  // zero keeps the sign
    const double error = std::abs(v - value);
    if (best < 0 || error < best_error || (error == best_error && (code & 1) == 0 && (best & 1) == 1)) {
      best = code;
      best_error = error;
    }
  }
  return static_cast<std::uint8_t>(best);
}

// The fp8 operand a recipe's tensorwise cast must give for `x`: scale = float(max / amax) from
// fp64, bytes from the encoder above, each element multiplied by the scale in fp32 first.
std::vector<std::uint8_t> expected_bytes(const at::Tensor& x, float scale, bool e5m2) {
  const auto values = x.to(at::kFloat).contiguous();
  const auto* p = values.data_ptr<float>();
  std::vector<std::uint8_t> bytes;
  for (std::int64_t i = 0; i < values.numel(); ++i) bytes.push_back(encode(p[i] * scale, e5m2));
  return bytes;
}

// The same with one scale per element: `scales` broadcast to x's shape (a rowwise [rows, 1] or
// [1, columns] scale).
[[maybe_unused]] std::vector<std::uint8_t> expected_bytes(const at::Tensor& x,
                                                          const at::Tensor& scales, bool e5m2) {
  const auto values = x.to(at::kFloat).contiguous();
  const auto s = scales.to(at::kFloat).expand(x.sizes()).contiguous();
  const auto* p = values.data_ptr<float>();
  const auto* q = s.data_ptr<float>();
  std::vector<std::uint8_t> bytes;
  for (std::int64_t i = 0; i < values.numel(); ++i) bytes.push_back(encode(p[i] * q[i], e5m2));
  return bytes;
}

// The rowwise recipes' scale for an amax, from its definition: the largest power of 2 not
// above float(448 / amax) (amax clamped to 1e-12), as torchao's round_scales_to_power_of_2.
[[maybe_unused]] float power_of_2_scale(double amax) {
  const auto scale = static_cast<float>(448.0 / std::max(amax, 1e-12));
  int exponent = 0;
  (void)std::frexp(static_cast<double>(scale), &exponent);  // scale = m * 2^exponent, m in [0.5, 1)
  return static_cast<float>(std::ldexp(1.0, exponent - 1));
}

std::vector<std::uint8_t> bytes(const at::Tensor& fp8) {
  const auto b = test::bytes_of(fp8);
  return {b.data_ptr<std::uint8_t>(), b.data_ptr<std::uint8_t>() + b.numel()};
}

// How many bytes differ (the sizes must agree).
std::int64_t mismatches(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  if (a.size() != b.size()) return -1;
  std::int64_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += a[i] != b[i] ? 1 : 0;
  return n;
}

struct MlpImpl : torch::nn::Module {
  MlpImpl(std::int64_t in, std::int64_t hidden, std::int64_t out)
      : fc1(register_module("fc1", mp::nn::Float8Linear(in, hidden))),
        fc2(register_module("fc2", mp::nn::Float8Linear(hidden, hidden))),
        head(register_module("head", mp::nn::Float8Linear(hidden, out))) {}
  at::Tensor forward(const at::Tensor& x) {
    return head(torch::gelu(fc2(torch::gelu(fc1(x)))));
  }
  mp::nn::Float8Linear fc1, fc2, head;
};
TORCH_MODULE(Mlp);

struct Data {
  std::vector<at::Tensor> x, y;
};
Data make_data(int batches, std::int64_t in, std::int64_t classes, std::uint64_t seed) {
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(seed);
  const auto teacher = torch::randn({in, classes}, generator);
  Data data;
  for (int i = 0; i < batches; ++i) {
    auto x = torch::randn({32, in}, generator);
    data.y.push_back(x.matmul(teacher).argmax(1));
    data.x.push_back(x);
  }
  return data;
}

// Trains a fresh Mlp (seed 0) under P for data.x.size() steps; returns the losses.
template <class P>
std::vector<double> train_mlp(const Data& data, Mlp* keep = nullptr) {
  torch::manual_seed(0);
  Mlp model(16, 64, 4);
  torch::optim::AdamW adam(model->parameters(), torch::optim::AdamWOptions(3e-3));
  mp::Trainer<P> trainer(model, adam);
  std::vector<double> losses;
  for (std::size_t i = 0; i < data.x.size(); ++i) {
    const auto report = trainer.step([&] {
      return torch::cross_entropy_loss(model->forward(trainer.cast_input(data.x[i])).to(at::kFloat),
                                       data.y[i]);
    });
    losses.push_back(report.loss.template item<double>());
  }
  if (keep != nullptr) *keep = model;
  return losses;
}

// A MixedFP8 Mlp with its optimizer and Trainer, trained on `data` step by step.
template <class P>
struct Fp8Run {
  Mlp model;
  torch::optim::AdamW adam;
  mp::Trainer<P> trainer;
  explicit Fp8Run(std::uint64_t seed)
      : model((torch::manual_seed(seed), Mlp(16, 64, 4))),
        adam(model->parameters(), torch::optim::AdamWOptions(3e-3)),
        trainer(model, adam) {}
  void steps(const Data& data, std::size_t from, std::size_t to) {
    for (std::size_t i = from; i < to; ++i) {
      (void)trainer.step([&] {
        return torch::cross_entropy_loss(model->forward(trainer.cast_input(data.x[i])).to(at::kFloat),
                                         data.y[i]);
      });
    }
  }
  // Everything a load changes: parameters, masters and the fp8 histories and scales.
  std::vector<at::Tensor> state() const {
    auto all = test::snapshot(model->parameters());
    for (const auto& m : trainer.master_weights()) all.push_back(m.clone());
    for (const auto* layer : {&model->fc1, &model->fc2, &model->head}) {
      for (const auto role : {mp::Fp8Role::input, mp::Fp8Role::weight, mp::Fp8Role::grad_output}) {
        const auto& slot = (*layer)->fp8_state()->slot(role);
        if (slot.history.defined()) all.push_back(slot.history.clone());
        if (slot.scale.defined()) all.push_back(slot.scale.clone());
      }
    }
    return all;
  }
};

// The checkpoint Trainer::save wrote before it recorded the policy's settings
// (mixprec.policy_settings): the same archive, with the policy's name alone. `fp8` may change
// the fp8 state first.
template <class P>
void save_without_settings(Fp8Run<P>& run, const std::string& path,
                           const std::function<void(c10::Dict<std::string, at::Tensor>&)>& fp8 = nullptr) {
  torch::serialize::OutputArchive archive;
  archive.write("mixprec.policy", c10::IValue(std::string(P::name)));
  const auto stats = run.trainer.stats();
  archive.write("mixprec.counters", torch::tensor({stats.steps, stats.skipped_steps, stats.micro_batches}));
  for (const auto& item : run.model->named_parameters()) {
    archive.write("model." + item.key(), item.value().detach());
  }
  const auto masters = run.trainer.master_weights();
  for (std::size_t i = 0; i < masters.size(); ++i) archive.write("masters." + std::to_string(i), masters[i]);
  torch::serialize::OutputArchive optimizer, groups, options;
  run.adam.save(optimizer);
  archive.write("optimizer", optimizer);
  run.adam.param_groups()[0].options().serialize(options);
  groups.write("0", options);
  groups.write("sizes", torch::tensor({static_cast<std::int64_t>(masters.size())}));
  archive.write("optimizer.groups", groups);
  archive.write("scaler", c10::IValue(run.trainer.scaler().state_dict()));
  archive.write("rng.cpu", at::detail::getDefaultCPUGenerator().get_state());
  c10::Dict<std::string, at::Tensor> state;
  for (const auto& item : run.model->named_children()) {
    const auto* layer = item.value()->template as<mp::nn::Float8LinearImpl>();
    for (const auto role : {mp::Fp8Role::input, mp::Fp8Role::weight, mp::Fp8Role::grad_output}) {
      const auto& slot = layer->fp8_state()->slot(role);
      if (!slot.history.defined()) continue;  // tensorwise: none
      const auto prefix = item.key() + "." + mp::detail::role_name(role);
      state.insert(prefix + ".amax_history", slot.history.clone());
      state.insert(prefix + ".scale", slot.scale.clone());
    }
  }
  if (fp8) fp8(state);
  archive.write("mixprec.fp8", c10::IValue(state));
  mp::detail::save_checkpoint(archive, path);
}

}  // namespace

TEST_CASE("fp8 casts: scales and bytes as the formats define them, saturating" *
          doctest::skip(!mp::has_fp8)) {
  with_fp8([](auto) {
    auto generator = torch::make_generator<at::CPUGeneratorImpl>(3);
    // bf16 values over many binades, with an outlier that sets the scale, and exact zeros.
    auto x = (torch::randn({64, 48}, generator) * torch::exp(torch::randn({64, 48}, generator) * 3))
                 .to(at::kBFloat16);
    x[0][0] = 1000;
    x[1] = 0;
    for (const auto role : {mp::Fp8Role::input, mp::Fp8Role::grad_output}) {
      const bool e5m2 = role == mp::Fp8Role::grad_output;
      const double max = e5m2 ? 57344.0 : 448.0;
      const double amax = x.to(at::kDouble).abs().max().template item<double>();
      const auto scale = static_cast<float>(max / amax);
      mp::detail::Fp8LayerState state(/*delayed=*/false, 0, 0);
      const auto q = state.cast(role, x);
      CHECK(q.scale.template item<float>() == scale);
      CHECK(0 == mismatches(bytes(q.data), expected_bytes(x, scale, e5m2)));
      // Saturation: a scale 4x too large maps everything beyond max/4 to +-max, not to inf/NaN.
      const auto saturated = mp::detail::quantize(x, at::scalar_tensor(4 * scale), role);
      CHECK(0 == mismatches(bytes(saturated.data), expected_bytes(x, 4 * scale, e5m2)));
      CHECK(saturated.data.to(at::kFloat).abs().max().template item<double>() == max);
    }
    // An all-zero tensor: a finite scale (amax clamped to 1e-12), zeros.
    mp::detail::Fp8LayerState state(false, 0, 0);
    const auto zero = state.cast(mp::Fp8Role::input, torch::zeros({4, 4}, at::kBFloat16));
    CHECK(std::isfinite(zero.scale.template item<float>()));
    CHECK(zero.data.to(at::kFloat).abs().max().template item<float>() == 0.0f);
  });
}

TEST_CASE("rowwise casts: a power-of-2 scale per row, per column or per tensor, e4m3 for every "
          "operand, as the format defines them" * doctest::skip(!mp::has_fp8)) {
  with_fp8<mp::RowwiseScaling>([](auto recipe) {
    auto generator = torch::make_generator<at::CPUGeneratorImpl>(5);
    auto x = (torch::randn({24, 40}, generator) * torch::exp(torch::randn({24, 40}, generator) * 3))
                 .to(at::kBFloat16);
    x[0][0] = 1000;  // sets row 0's and column 0's scale, no other
    x[1] = 0;        // an all-zero row
    const auto magnitude = x.to(at::kDouble).abs();
    mp::detail::Fp8LayerState state(mp::detail::Fp8Settings::of<decltype(recipe)>());
    using Cast = mp::detail::Fp8Cast;
    struct Case {
      Cast cast;
      std::optional<std::int64_t> dim;
      at::Tensor amaxes;  // the reference's, broadcastable to x
    };
    const std::vector<Case> cases{
        {Cast::input, 1, std::get<0>(magnitude.max(1, /*keepdim=*/true))},
        {Cast::grad_output, 1, std::get<0>(magnitude.max(1, true))},
        {Cast::input_for_grad_weight, 0, std::get<0>(magnitude.max(0, true))},
        {Cast::weight_for_grad_input, std::nullopt, magnitude.max()}};
    for (const auto& c : cases) {
      CAPTURE(static_cast<int>(c.cast));
      const auto q = state.cast_rowwise(c.cast, x, c.dim);
      CHECK(q.data.scalar_type() == mp::detail::float8_e4m3);  // the gradients too
      REQUIRE(q.scale.sizes() == c.amaxes.sizes());
      auto expected = torch::empty(c.amaxes.sizes(), at::kFloat);
      const auto amaxes = c.amaxes.contiguous();
      for (std::int64_t i = 0; i < amaxes.numel(); ++i) {
        expected.view({-1})[i] = power_of_2_scale(amaxes.view({-1})[i].template item<double>());
      }
      CHECK(test::identical(q.scale, expected));
      CHECK(0 == mismatches(bytes(q.data), expected_bytes(x, expected, /*e5m2=*/false)));
      // Dequantized as torchao's emulation: x8 / scale, broadcast; exact for powers of 2.
      CHECK(test::identical(mp::detail::dequantize(q), q.data.to(at::kFloat) / q.scale));
      CHECK(test::identical(mp::detail::dequantize(mp::detail::transposed(q)),
                            (q.data.to(at::kFloat) / q.scale).t()));
    }
    // The zero row gets a finite scale and zeros.
    const auto rows = state.cast_rowwise(Cast::input, x, 1);
    CHECK(std::isfinite(rows.scale[1][0].template item<float>()));
    CHECK(rows.data[1].to(at::kFloat).abs().max().template item<float>() == 0.0f);
    // An outlier coarsens its own row and column only: 448 / 1000 -> 2^-2, where the other
    // rows and columns of normal values keep scales of 2^5 and more (448 / 7).
    auto y = torch::randn({8, 16}, generator).clamp(-7, 7).to(at::kBFloat16);
    y[0][0] = 1000;
    for (const std::int64_t dim : {1, 0}) {
      const auto q = state.cast_rowwise(Cast::input, y, dim).scale.reshape({-1});
      CHECK(q[0].template item<float>() == 0.25f);
      CHECK(q.slice(0, 1).min().template item<float>() >= 32.0f);
    }
    // A one-column tensor with a per-column scale ([1, 1] of [n, 1]): each element divided by it.
    const auto column = state.cast_rowwise(Cast::input_for_grad_weight, x.slice(1, 0, 1).contiguous(), 0);
    REQUIRE(column.scale.sizes() == at::IntArrayRef({1, 1}));
    CHECK(test::identical(mp::detail::dequantize(column), column.data.to(at::kFloat) / column.scale));
    // A scale that fits neither the rows nor the columns of its data is an Error.
    CHECK_THROWS_WITH_AS(mp::detail::dequantize({rows.data, torch::ones({3, 1})}),
                         doctest::Contains("must be 0-dim, or [rows, 1] or [1, columns]"), mp::Error);
  });
}

TEST_CASE("Float8Linear: Linear's initialization and state_dict keys; checkpoints load both ways" *
          doctest::skip(!mp::has_fp8)) {
  with_fp8([](auto) {
    torch::manual_seed(7);
    torch::nn::Linear plain(12, 5);
    torch::manual_seed(7);
    mp::nn::Float8Linear fp8(12, 5);
    CHECK(test::identical(plain->weight, fp8->weight));
    CHECK(test::identical(plain->bias, fp8->bias));
    std::vector<std::string> plain_keys, fp8_keys;
    for (const auto& item : plain->named_parameters()) plain_keys.push_back(item.key());
    for (const auto& item : fp8->named_parameters()) fp8_keys.push_back(item.key());
    CHECK(plain_keys == fp8_keys);
    // Outside a Trainer<MixedFP8> it is a Linear, bit for bit.
    const auto x = torch::randn({3, 12});
    CHECK(test::identical(plain(x), fp8(x)));
    CHECK_FALSE(fp8->computes_fp8());
    // fp8 -> plain and back.
    const auto path = test::temp_path("float8_linear.pt");
    torch::NoGradGuard no_grad;
    fp8->weight.mul_(2);
    torch::save(fp8, path);
    torch::load(plain, path);
    CHECK(test::identical(plain->weight, fp8->weight));
    plain->bias.add_(1);
    torch::save(plain, path);
    torch::load(fp8, path);
    CHECK(test::identical(plain->bias, fp8->bias));
  });
}

TEST_CASE("Float8Linear's fp8 products and gradients against fp64 on the same fp8 operands" *
          doctest::skip(!mp::has_fp8)) {
  with_fp8([](auto recipe) {
    using P = mp::MixedFP8<decltype(recipe)>;
    torch::manual_seed(1);
    Mlp model(16, 32, 4);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
    mp::Trainer<P> trainer(model, sgd);
    CHECK(model->fc1->computes_fp8());
    CHECK(model->fc1->weight.scalar_type() == at::kBFloat16);
    model->fc2->keep_operands();
    at::Tensor input, output, grad_output;
    const auto x = torch::randn({8, 16});
    trainer.step([&] {
      input = torch::gelu(model->fc1(trainer.cast_input(x)));
      input.retain_grad();
      output = model->fc2(input);
      output.retain_grad();
      return model->head(torch::gelu(output)).to(at::kFloat).pow(2).mean();
    });
    const auto& ops = model->fc2->last_operands();
    const auto deq = [](const mp::Fp8Tensor& t) { return t.data.to(at::kDouble) / t.scale.to(at::kDouble); };
    // The operands are the casts of what the layer saw.
    CHECK(0 == mismatches(bytes(ops.input.data), expected_bytes(input.detach(), ops.input.scale.template item<float>(), false)));
    CHECK(0 == mismatches(bytes(ops.grad_output.data), expected_bytes(output.grad(), ops.grad_output.scale.template item<float>(), true)));
    // Forward: x8 @ w8^T / scales, one rounding to bf16, plus the bias in bf16.
    const auto forward = (deq(ops.input).matmul(deq(ops.weight).t())).to(at::kBFloat16) +
                         model->fc2->bias.detach().to(at::kBFloat16);
    const double forward_diff = (output.detach().to(at::kDouble) - forward.to(at::kDouble)).abs().max().template item<double>();
    const double forward_ulp = forward.to(at::kDouble).abs().max().template item<double>() / 128;
    MESSAGE("forward: largest difference " << forward_diff << " (one bf16 ulp of the largest: "
            << forward_ulp << ")");
    CHECK(forward_diff <= forward_ulp);
    // Input gradient: g8 @ w8 / scales.
    const auto grad_input = deq(ops.grad_output).matmul(deq(ops.weight)).to(at::kBFloat16);
    const double input_diff = (input.grad().to(at::kDouble) - grad_input.to(at::kDouble)).abs().max().template item<double>();
    MESSAGE("input gradient: largest difference " << input_diff);
    CHECK(input_diff <= grad_input.to(at::kDouble).abs().max().template item<double>() / 128);
  });
}

TEST_CASE("MixedFP8 trains an MLP as MixedO2<BFloat16> does, under each recipe" *
          doctest::skip(!mp::has_fp8)) {
  with_fp8_recipes<mp::TensorwiseScaling, mp::DelayedScaling<>, mp::RowwiseScaling,
                   mp::RowwiseScalingWithGwHp>([](auto... recipes) {
    const auto data = make_data(120, 16, 4, 11);
    const auto bf16 = train_mlp<mp::MixedO2<at::BFloat16>>(data);
    const auto tail = [](const std::vector<double>& l) {
      double s = 0;
      for (std::size_t i = l.size() - 20; i < l.size(); ++i) s += l[i];
      return s / 20;
    };
    CHECK(tail(bf16) < 0.5 * bf16.front());
    const auto run = [&](auto recipe) {
      using P = mp::MixedFP8<decltype(recipe)>;
      const auto fp8 = train_mlp<P>(data);
      double worst = 0;
      for (std::size_t i = 0; i < bf16.size(); ++i) worst = std::max(worst, std::abs(fp8[i] - bf16[i]));
      MESSAGE(P::name, ": loss ", bf16.front(), " -> ", tail(fp8), " (MixedO2<BFloat16>: ",
              tail(bf16), "); largest per-step difference from bf16: ", worst);
      CHECK(std::abs(tail(fp8) - tail(bf16)) < 0.1 * tail(bf16) + 0.02);
    };
    (run(recipes), ...);
  });
}

TEST_CASE("DelayedScaling: amax histories and scales step by step, an inf skipped" *
          doctest::skip(!mp::has_fp8)) {
  with_fp8<mp::DelayedScaling<3, 1>>([](auto recipe) {
    using P = mp::MixedFP8<decltype(recipe)>;
    torch::manual_seed(2);
    auto layer = mp::nn::Float8Linear(torch::nn::LinearOptions(4, 2).bias(false));
    torch::optim::SGD sgd(layer->parameters(), torch::optim::SGDOptions(0.0));  // weights fixed
    mp::Trainer<P> trainer(layer, sgd);
    const double weight_amax = layer->weight.to(at::kDouble).abs().max().template item<double>();
    const auto probe = torch::full({3, 2}, 3.0);  // grad_output: 3 everywhere (the loss is a sum)
    // History 3, margin 1: scale = max / max(history) / 2, 1 until an amax was seen.
    const auto scale_of = [](double max, std::vector<double> history) {
      double amax = 0;
      for (const double a : history) amax = std::max(amax, a);
      return amax > 0 ? static_cast<float>(max / amax / 2) : 1.0f;
    };
    std::vector<double> input_history{0, 0, 0}, grad_history{0, 0, 0}, weight_history{0, 0, 0};
    const double inf = std::numeric_limits<double>::infinity();
    for (const double amax : {2.0, 8.0, 0.5, inf, 4.0, 1.0}) {
      auto x = torch::full({3, 4}, 0.25);
      x[1][2] = amax;
      const float input_scale = scale_of(448, input_history);  // what this step must use
      layer->keep_operands();
      const auto report = trainer.step([&] {
        return (layer(trainer.cast_input(x)).to(at::kFloat) * probe).sum();
      });
      CHECK(layer->last_operands().input.scale.template item<float>() == input_scale);
      if (std::isinf(amax)) {
        // Saturated to 448 in the product: finite gradients, but the step is skipped.
        CHECK(report.status == mp::StepStatus::skipped);
      } else {
        CHECK(report.status == mp::StepStatus::stepped);
        const auto push = [](std::vector<double>& h, double a) {
          h.insert(h.begin(), a);
          h.pop_back();
        };
        push(input_history, amax);
        push(weight_history, weight_amax);
        push(grad_history, 3.0);
      }
      const auto& state = *layer->fp8_state();
      const auto check_slot = [&](mp::Fp8Role role, const std::vector<double>& h, double max) {
        const auto& slot = state.slot(role);
        for (int i = 0; i < 3; ++i) CHECK(slot.history[i].template item<double>() == static_cast<float>(h[i]));
        CHECK(slot.scale.template item<float>() == scale_of(max, h));
      };
      check_slot(mp::Fp8Role::input, input_history, 448);
      check_slot(mp::Fp8Role::weight, weight_history, 448);
      check_slot(mp::Fp8Role::grad_output, grad_history, 57344);
    }
    CHECK(trainer.stats().skipped_steps == 1);
  });
}

TEST_CASE("MixedFP8 resumes from a checkpoint bit for bit (delayed scaling's histories too)" *
          doctest::skip(!mp::has_fp8)) {
  with_fp8<mp::DelayedScaling<4>>([](auto recipe) {
    using P = mp::MixedFP8<decltype(recipe)>;
    const auto data = make_data(10, 16, 4, 5);
    const auto run = [&](bool resume) {
      torch::manual_seed(0);
      Mlp model(16, 64, 4);
      torch::optim::AdamW adam(model->parameters(), torch::optim::AdamWOptions(3e-3));
      mp::Trainer<P> trainer(model, adam);
      const auto path = test::temp_path("fp8_resume.ckpt");
      std::vector<at::Tensor> losses;
      for (int i = 0; i < 10; ++i) {
        if (i == 5) {
          if (!resume) {
            trainer.save(path);
          } else {
            trainer.load(path);
          }
        }
        if (resume && i < 5) continue;
        losses.push_back(trainer.step([&] {
          return torch::cross_entropy_loss(model->forward(trainer.cast_input(data.x[i])).to(at::kFloat), data.y[i]);
        }).loss);
      }
      auto state = model->fc1->fp8_state()->slot(mp::Fp8Role::input).history.clone();
      losses.push_back(state);
      for (const auto& m : trainer.master_weights()) losses.push_back(m);
      return losses;
    };
    auto first = run(false);
    first.erase(first.begin(), first.begin() + 5);  // the steps before the checkpoint
    const auto resumed = run(true);
    CHECK(test::identical(first, resumed));
  });
}

TEST_CASE("a MixedFP8 checkpoint loads into the recipe it was written with only: History and "
          "Margin included" * doctest::skip(!mp::has_fp8)) {
  with_fp8_recipes<mp::DelayedScaling<4>, mp::DelayedScaling<4, 3>, mp::DelayedScaling<8>,
                   mp::TensorwiseScaling>([](auto saved, auto margin3, auto history8, auto tensorwise) {
    const auto data = make_data(6, 16, 4, 7);
    const auto path = test::temp_path("fp8_recipe.ckpt");
    Fp8Run<mp::MixedFP8<decltype(saved)>> source(0);
    source.steps(data, 0, 3);
    source.trainer.save(path);
    const auto refused = [&](auto recipe, const char* message) {
      Fp8Run<mp::MixedFP8<decltype(recipe)>> target(1);
      target.steps(data, 3, 4);
      const auto before = target.state();
      CHECK_THROWS_WITH_AS(target.trainer.load(path), doctest::Contains(message), mp::Error);
      CHECK(test::identical(target.state(), before));
    };
    // The same name, "MixedFP8<DelayedScaling>": the next steps would use scales 2^3 too large.
    refused(margin3, "this is Trainer<MixedFP8<DelayedScaling>>, and their settings that change "
                     "the numbers differ: fp8_margin 0 there, 3 here");
    refused(history8, "fp8_history 4 there, 8 here");
    refused(tensorwise, "fp8 delayed there, tensorwise here, fp8_history 4 there, (none) here, "
                        "fp8_margin 0 there, (none) here");
    // The recipe it was written with resumes it.
    Fp8Run<mp::MixedFP8<decltype(saved)>> resumed(1);
    resumed.trainer.load(path);
    source.steps(data, 3, 6);
    resumed.steps(data, 3, 6);
    CHECK(test::identical(resumed.state(), source.state()));
  });
}

TEST_CASE("a rowwise MixedFP8 checkpoint loads into its own recipe only, and resumes bit for bit" *
          doctest::skip(!mp::has_fp8)) {
  with_fp8_recipes<mp::RowwiseScaling, mp::RowwiseScalingWithGwHp, mp::TensorwiseScaling>(
      [](auto rowwise, auto gw_hp, auto tensorwise) {
    using Rowwise = mp::MixedFP8<decltype(rowwise)>;
    const auto data = make_data(6, 16, 4, 13);
    const auto path = test::temp_path("fp8_rowwise.ckpt");
    const auto refused = [&](auto recipe, const std::string& from, const char* message) {
      Fp8Run<mp::MixedFP8<decltype(recipe)>> target(1);
      target.steps(data, 3, 4);
      const auto before = target.state();
      CHECK_THROWS_WITH_AS(target.trainer.load(from), doctest::Contains(message), mp::Error);
      CHECK(test::identical(target.state(), before));
    };
    Fp8Run<Rowwise> source(0);
    source.steps(data, 0, 3);
    source.trainer.save(path);
    refused(gw_hp, path, "this is Trainer<MixedFP8<RowwiseScalingWithGwHp>>, and their settings "
                         "that change the numbers differ: fp8_weight_grad fp8 there, bf16 here");
    refused(tensorwise, path, "fp8 rowwise there, tensorwise here, fp8_power_of_2_scales true "
                              "there, (none) here, fp8_grad_output e4m3 there, (none) here, "
                              "fp8_weight_grad fp8 there, (none) here");
    // The other way: a tensorwise checkpoint, with its settings and from before them.
    Fp8Run<mp::MixedFP8<decltype(tensorwise)>> plain(2);
    plain.steps(data, 0, 2);
    const auto plain_path = test::temp_path("fp8_tensorwise.ckpt");
    plain.trainer.save(plain_path);
    refused(rowwise, plain_path, "fp8 tensorwise there, rowwise here");
    save_without_settings(plain, plain_path);
    refused(rowwise, plain_path, "was written by Trainer<MixedFP8<TensorwiseScaling>>, this is "
                                 "Trainer<MixedFP8<RowwiseScaling>>");
    // Its own recipe resumes it, bit for bit.
    Fp8Run<Rowwise> resumed(1);
    resumed.trainer.load(path);
    source.steps(data, 3, 6);
    resumed.steps(data, 3, 6);
    CHECK(test::identical(resumed.state(), source.state()));
  });
}

TEST_CASE("a MixedFP8 checkpoint written before the recipe was recorded loads where its scales "
          "show the same Margin" * doctest::skip(!mp::has_fp8)) {
  with_fp8_recipes<mp::DelayedScaling<4, 3>, mp::DelayedScaling<4>, mp::TensorwiseScaling>(
      [](auto margin3, auto margin0, auto tensorwise) {
    using Margin3 = mp::MixedFP8<decltype(margin3)>;
    using Margin0 = mp::MixedFP8<decltype(margin0)>;
    const auto data = make_data(6, 16, 4, 9);
    const auto old_path = test::temp_path("fp8_before_settings.ckpt");
    const auto new_path = test::temp_path("fp8_with_settings.ckpt");
    Fp8Run<Margin3> source(0);
    source.steps(data, 0, 3);
    save_without_settings(source, old_path);
    source.trainer.save(new_path);
    // Into the recipe it was written with: as the same checkpoint with its settings.
    Fp8Run<Margin3> from_old(1), from_new(2);
    from_old.trainer.load(old_path);
    from_new.trainer.load(new_path);
    from_old.steps(data, 3, 6);
    from_new.steps(data, 3, 6);
    CHECK(test::identical(from_old.state(), from_new.state()));
    // Into another Margin: its scales tell which one they were computed with.
    Fp8Run<Margin0> other(3);
    const auto before = other.state();
    CHECK_THROWS_WITH_AS(other.trainer.load(old_path),
                         doctest::Contains("written before checkpoints recorded DelayedScaling's "
                                           "History and Margin, and its fp8 scale 'fc1.input.scale' "
                                           "was computed with Margin 3, this Trainer's "
                                           "DelayedScaling with Margin 0: load it with "
                                           "DelayedScaling<4, 3>"),
                         mp::Error);
    CHECK(test::identical(other.state(), before));
    // A scale whose amaxes the history has dropped cannot be checked: refused.
    save_without_settings(source, old_path, [](auto& state) {
      state.insert_or_assign("fc2.weight.amax_history", torch::zeros({4}));
    });
    Fp8Run<Margin3> same(4);
    CHECK_THROWS_WITH_AS(same.trainer.load(old_path),
                         doctest::Contains("its fp8 scale 'fc2.weight.scale' comes from amaxes "
                                           "its history no longer holds"),
                         mp::Error);
    // Saved before any step, the state is the initial one, whatever the Margin: it loads.
    Fp8Run<Margin3> fresh(5);
    save_without_settings(fresh, old_path);
    other.trainer.load(old_path);
    // Tensorwise scaling keeps no state: its checkpoints load as they did.
    Fp8Run<mp::MixedFP8<decltype(tensorwise)>> plain(6), plain_target(7);
    plain.steps(data, 0, 2);
    save_without_settings(plain, old_path);
    plain_target.trainer.load(old_path);
    CHECK(test::identical(plain_target.state(), plain.state()));
  });
}

TEST_CASE("MixedFP8 with a precision map: layers kept in bf16 or fp32, under each recipe" *
          doctest::skip(!mp::has_fp8)) {
  const auto kept = [](auto recipe) {
    using P = mp::MixedFP8<decltype(recipe)>;
    CAPTURE(P::name);
    torch::manual_seed(0);
    Mlp model(16, 32, 4);
    const auto changed = mp::apply_precision_map<P>(
        model, mp::PrecisionMap().add("head", mp::Precision::low).keep_fp32("fc1"));
    REQUIRE(changed.size() == 2);
    torch::optim::AdamW adam(model->parameters());
    mp::Trainer<P> trainer(model, adam);
    CHECK_FALSE(model->fc1->computes_fp8());
    CHECK(model->fc1->weight.scalar_type() == at::kFloat);
    CHECK(model->fc2->computes_fp8());
    CHECK_FALSE(model->head->computes_fp8());
    CHECK(model->head->weight.scalar_type() == at::kBFloat16);
    const auto report = trainer.step([&] {
      return model->forward(trainer.cast_input(torch::randn({4, 16}))).to(at::kFloat).pow(2).mean();
    });
    CHECK(report.stepped());
  };
  with_fp8_recipes<mp::TensorwiseScaling, mp::RowwiseScaling, mp::RowwiseScalingWithGwHp>(
      [&](auto... recipes) { (kept(recipes), ...); });
  with_fp8([](auto recipe) {
    // The Trainer's end turns fp8 off: the layers are Linear's again.
    torch::manual_seed(0);
    Mlp model(16, 32, 4);
    torch::optim::AdamW adam(model->parameters());
    {
      mp::Trainer<mp::MixedFP8<decltype(recipe)>> trainer(model, adam);
      CHECK(model->fc1->computes_fp8());
    }
    CHECK_FALSE(model->fc1->computes_fp8());
  });
}

TEST_CASE("MixedFP8 Errors name the module and change nothing" * doctest::skip(!mp::has_fp8)) {
  with_fp8([](auto recipe) {
    using P = mp::MixedFP8<decltype(recipe)>;
    // No Float8Linear: nothing would compute in fp8.
    torch::nn::Sequential plain(torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
    torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.1));
    CHECK_THROWS_WITH_AS((mp::Trainer<P>(plain, sgd)),
                         doctest::Contains("no layer of the model computes in fp8"), mp::Error);
    CHECK_THROWS_WITH_AS((mp::Trainer<P>(plain, sgd)), doctest::Contains("'0', '2'"), mp::Error);
    CHECK(plain->parameters()[0].scalar_type() == at::kFloat);

    // fp8 asked of a module that is no Float8Linear.
    torch::nn::Sequential mixed(mp::nn::Float8Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
    CHECK_THROWS_WITH_AS(mp::apply_precision_map<P>(mixed, mp::PrecisionMap().add("1", mp::Precision::fp8)),
                         doctest::Contains("module '1'"), mp::Error);
    CHECK_THROWS_WITH_AS(mp::apply_precision_map<P>(mixed, mp::PrecisionMap().add("2", mp::Precision::fp8)),
                         doctest::Contains("declare it as mixprec::nn::Float8Linear"), mp::Error);
    // fp8 under a policy without it.
    CHECK_THROWS_WITH_AS(mp::apply_precision_map<mp::MixedO2<at::BFloat16>>(
                             mixed, mp::PrecisionMap().add("0", mp::Precision::fp8)),
                         doctest::Contains("only an fp8 policy computes"), mp::Error);
    // Nothing changed: the map can still be applied, and the layer trains in fp8.
    CHECK(mixed->parameters()[0].scalar_type() == at::kFloat);
    mp::apply_precision_map<P>(mixed, mp::PrecisionMap().add("0", mp::Precision::fp8));
    torch::optim::SGD sgd2(mixed->parameters(), torch::optim::SGDOptions(0.1));
    mp::Trainer<P> trainer(mixed, sgd2);
    CHECK(mixed[0]->as<mp::nn::Float8LinearImpl>()->computes_fp8());

    // The step inside the backward pass: the fp8 scales see the whole step's gradients first.
    torch::nn::Sequential fresh(mp::nn::Float8Linear(8, 8), torch::nn::ReLU(), mp::nn::Float8Linear(8, 2));
    const auto before = fresh->parameters()[0].clone();
    torch::optim::AdamW adamw(fresh->parameters(), torch::optim::AdamWOptions(1e-2));
    CHECK_THROWS_WITH_AS((mp::Trainer<P>(fresh, adamw, mp::TrainerOptions().step_in_backward(true))),
                         doctest::Contains(mp::post_accumulate_grad_hooks ? "fp8's scaling state" : "2.1"),
                         mp::Error);
    CHECK(fresh->parameters()[0].scalar_type() == at::kFloat);
    CHECK(at::equal(fresh->parameters()[0], before));
    CHECK_FALSE(fresh[0]->as<mp::nn::Float8LinearImpl>()->computes_fp8());
    CHECK(adamw.state().empty());

    // A LoRA adapter on a layer that would compute in fp8: refused, nothing changed; kept in
    // bf16 by a precision map, it trains beside a layer in fp8.
    torch::manual_seed(0);
    torch::nn::Sequential adapted(mp::nn::Float8Linear(8, 8), torch::nn::ReLU(), mp::nn::Float8Linear(8, 2));
    mp::apply_lora(adapted.ptr(), {"0"}, mp::LoraOptions().rank(2).seed(1));
    const auto base = adapted[0]->as<mp::nn::Float8LinearImpl>()->weight.clone();
    torch::optim::AdamW lora_adam(mp::trainable_parameters(*adapted.ptr()), torch::optim::AdamWOptions(1e-2));
    CHECK_THROWS_WITH_AS((mp::Trainer<P>(adapted, lora_adam)),
                         doctest::Contains("LoRA adapters sit on Float8Linear layers that would "
                                           "compute in fp8: '0'"), mp::Error);
    CHECK(at::equal(adapted[0]->as<mp::nn::Float8LinearImpl>()->weight, base));
    CHECK_FALSE(adapted[0]->as<mp::nn::Float8LinearImpl>()->computes_fp8());
    CHECK(lora_adam.state().empty());
    mp::apply_precision_map<P>(adapted, mp::PrecisionMap().add("0", mp::Precision::low));
    {
      mp::Trainer<P> lora_trainer(adapted, lora_adam);
      CHECK_FALSE(adapted[0]->as<mp::nn::Float8LinearImpl>()->computes_fp8());
      CHECK(adapted[2]->as<mp::nn::Float8LinearImpl>()->computes_fp8());
      const auto report = lora_trainer.step([&] {
        return adapted->forward(lora_trainer.cast_input(torch::randn({16, 8}))).to(at::kFloat).pow(2).mean();
      });
      CHECK(report.stepped());
      CHECK(at::equal(adapted[0]->as<mp::nn::Float8LinearImpl>()->weight.to(at::kFloat),
                      base.to(at::kBFloat16).to(at::kFloat)));  // frozen
      CHECK(adapted[0]->named_parameters()["lora_B.weight"].ne(0).any().item<bool>());  // trained
    }
    // Adapters after the Trainer turned fp8 on: refused, the layer still in fp8.
    torch::nn::Sequential late(mp::nn::Float8Linear(8, 8));
    torch::optim::SGD late_sgd(late->parameters(), torch::optim::SGDOptions(0.1));
    mp::Trainer<P> late_trainer(late, late_sgd);
    CHECK_THROWS_WITH_AS(mp::apply_lora(late.ptr(), {"0"}, mp::LoraOptions().rank(2)),
                         doctest::Contains("apply the adapters before constructing the Trainer"),
                         mp::Error);
    CHECK_FALSE(late[0]->as<mp::nn::Float8LinearImpl>()->adapter);
    CHECK(late[0]->as<mp::nn::Float8LinearImpl>()->computes_fp8());
  });
}

TEST_CASE("advise: which Float8Linear layers fp8 holds, and the map that keeps the others bf16" *
          doctest::skip(!mp::has_fp8)) {
  with_fp8([](auto recipe) {
    using P = mp::MixedFP8<decltype(recipe)>;
    torch::manual_seed(0);
    // tanh bounds what the later layers see: an outlier in the data reaches fc1 alone.
    torch::nn::Sequential model(mp::nn::Float8Linear(16, 32), torch::nn::Tanh(),
                                mp::nn::Float8Linear(32, 32), torch::nn::Tanh(),
                                mp::nn::Float8Linear(32, 4));
    auto generator = torch::make_generator<at::CPUGeneratorImpl>(4);
    // Well-spread inputs: fp8 holds every layer, and the map is empty.
    const auto clean = mp::advise(model, [&] { return model->forward(torch::randn({16, 16}, generator)).pow(2).mean(); });
    REQUIRE(clean.fp8_layers.size() == 3);
    for (const auto& layer : clean.fp8_layers) {
      CAPTURE(layer.name);
      CHECK(layer.fp8);
      CHECK(layer.input.flushed < 1e-2);
    }
    CHECK(clean.fp8_precision_map().empty());
    // One huge entry per batch (padding filled with garbage, say): the tensorwise scale maps
    // 1e5 to 448, and a sixth of the other inputs, below 1e5 * 2^-10 / 448 = 0.22, round to 0.
    const auto loss_fn = [&] {
      auto x = torch::randn({16, 16}, generator);
      x[0][0] = 1e5;
      return model->forward(x).pow(2).mean();
    };
    const auto before = test::snapshot(model->parameters());
    const auto advice = mp::advise(model, loss_fn);
    CHECK(test::identical(before, test::snapshot(model->parameters())));  // changed nothing
    REQUIRE(advice.fp8_layers.size() == 3);
    const auto& fc1 = advice.fp8_layers[0];
    CHECK(fc1.name == "0");
    CHECK(fc1.input.amax == doctest::Approx(1e5));
    MESSAGE("layer 0's inputs: " << 100 * fc1.input.flushed << "% round to 0, "
            << 100 * fc1.input.subnormal << "% subnormal (clean data: "
            << 100 * clean.fp8_layers[0].input.flushed << "% and "
            << 100 * clean.fp8_layers[0].input.subnormal << "%)");
    CHECK(fc1.input.flushed > 0.1);
    CHECK_FALSE(fc1.fp8);
    CHECK(fc1.reason.find("inputs would round to 0 in e4m3") != std::string::npos);
    std::ostringstream text;
    text << advice;
    CHECK(text.str().find("keep 0 in bf16 under MixedFP8") != std::string::npos);
    CHECK(advice.fp8_layers[1].fp8);
    CHECK(advice.fp8_layers[2].fp8);
    // Its map keeps that layer in bf16, and the Trainer runs the others in fp8.
    const auto map = advice.fp8_precision_map();
    REQUIRE(map.rules().size() == 1);
    CHECK(map.rules()[0].pattern == "0");
    mp::apply_precision_map<P>(model, map);
    torch::optim::AdamW adam(model->parameters());
    mp::Trainer<P> trainer(model, adam);
    CHECK_FALSE(model[0]->template as<mp::nn::Float8LinearImpl>()->computes_fp8());
    CHECK(model[2]->template as<mp::nn::Float8LinearImpl>()->computes_fp8());
    CHECK(model[4]->template as<mp::nn::Float8LinearImpl>()->computes_fp8());
    CHECK_THROWS_WITH_AS(mp::advise(model, loss_fn, mp::AdviseOptions().fp8_underflow_tolerance(1)),
                         doctest::Contains("fp8_underflow_tolerance must be in [0, 1)"), mp::Error);
  });
}

// advise() needs no fp8 dtype: this runs under LibTorch 1.13 too, but for the Trainer at its end.
TEST_CASE("advise: which Float8Linear layers each recipe holds, and each recipe's map") {
  using Tensorwise = mp::TensorwiseScaling;
  using Rowwise = mp::RowwiseScaling;
  using GwHp = mp::RowwiseScalingWithGwHp;
  torch::manual_seed(0);
  // tanh bounds what the later layers see: the data's outliers reach the first layer alone.
  torch::nn::Sequential model(mp::nn::Float8Linear(64, 32), torch::nn::Tanh(),
                              mp::nn::Float8Linear(32, 4));
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(6);
  // Where the outliers are decides which casts they coarsen: one element (its row and column),
  // one sample (every column: RowwiseScaling's grad_weight product casts the input per
  // column), one feature (every row: the forward product, under both rowwise recipes).
  enum class Outliers { element, sample, feature };
  const auto advise = [&](Outliers where) {
    return mp::advise(model, [&] {
      auto x = torch::randn({64, 64}, generator);
      if (where == Outliers::element) x[5][7] = 1e5;
      if (where == Outliers::sample) x[5].mul_(1e5);
      if (where == Outliers::feature) x.select(1, 7).mul_(1e5);
      return model->forward(x).pow(2).mean();
    });
  };
  struct Expected {
    Outliers where;
    bool tensorwise, rowwise, gw_hp;  // whether each holds layer 0
  };
  for (const auto& e : {Expected{Outliers::element, false, true, true},
                        Expected{Outliers::sample, false, false, true},
                        Expected{Outliers::feature, false, false, false}}) {
    CAPTURE(static_cast<int>(e.where));
    const auto advice = advise(e.where);
    REQUIRE(advice.fp8_layers.size() == 2);
    const auto& first = advice.fp8_layers[0];
    const auto& in = first.input;
    MESSAGE("outliers " << static_cast<int>(e.where) << ": layer 0's inputs round to 0: "
            << 100 * in.flushed << "% tensorwise, " << 100 * in.flushed_rows << "% per row, "
            << 100 * in.flushed_columns << "% per column");
    CHECK(first.holds<Tensorwise>() == e.tensorwise);
    CHECK(first.holds<Rowwise>() == e.rowwise);
    CHECK(first.holds<GwHp>() == e.gw_hp);
    CHECK(advice.fp8_layers[1].holds<Rowwise>());  // behind tanh: nothing to coarsen
    CHECK(advice.fp8_layers[1].holds<GwHp>());
    // Each recipe's map keeps exactly the layers it does not hold in bf16.
    const auto check_map = [&](const mp::PrecisionMap& map, bool holds) {
      REQUIRE(map.rules().size() == (holds ? 0U : 1U));
      if (!holds) CHECK(map.rules()[0].pattern == "0");
    };
    check_map(advice.fp8_precision_map<Tensorwise>(), e.tensorwise);
    check_map(advice.fp8_precision_map<Rowwise>(), e.rowwise);
    check_map(advice.fp8_precision_map<GwHp>(), e.gw_hp);
    std::ostringstream text;
    text << advice;
    CHECK((text.str().find("keep 0 in bf16 under MixedFP8<RowwiseScaling>: ") != std::string::npos) ==
          !e.rowwise);
    CHECK((text.str().find("keep 0 in bf16 under MixedFP8<RowwiseScalingWithGwHp>: ") !=
           std::string::npos) == !e.gw_hp);
    if (!e.rowwise) {
      CHECK(first.rowwise_reason.find("inputs would round to 0 in e4m3 with one scale per") !=
            std::string::npos);
    }
  }
  // A map for a rowwise recipe applies and trains as any.
  const auto map = advise(Outliers::sample).fp8_precision_map<Rowwise>();
  with_fp8<Rowwise>([&](auto recipe) {
    using P = mp::MixedFP8<decltype(recipe)>;
    mp::apply_precision_map<P>(model, map);
    torch::optim::AdamW adam(model->parameters());
    mp::Trainer<P> trainer(model, adam);
    CHECK_FALSE(model[0]->template as<mp::nn::Float8LinearImpl>()->computes_fp8());
    CHECK(model[2]->template as<mp::nn::Float8LinearImpl>()->computes_fp8());
    CHECK(trainer.step([&] {
      return model->forward(trainer.cast_input(torch::randn({8, 64}))).to(at::kFloat).pow(2).mean();
    }).stepped());
  });
}

TEST_CASE("Float8Linear's fp8 products without bias, with frozen tensors, an input that needs no "
          "gradient or grad mode off, under each recipe: forward and every gradient against fp64 "
          "on the same operands" * doctest::skip(!mp::has_fp8)) {
  with_fp8_recipes<mp::TensorwiseScaling, mp::RowwiseScaling, mp::RowwiseScalingWithGwHp>([](auto... recipes) {
    enum class Bias { none, trained, frozen };
    struct Case {
      Bias bias;
      bool weight_grad, input_grad, grad_mode;
    };
    std::vector<Case> cases;
    for (const auto bias : {Bias::none, Bias::trained, Bias::frozen}) {
      for (const bool weight_grad : {true, false}) {
        for (const bool input_grad : {true, false}) cases.push_back({bias, weight_grad, input_grad, true});
      }
    }
    cases.push_back({Bias::none, true, true, false});
    cases.push_back({Bias::trained, true, true, false});
    const auto deq = [](const mp::Fp8Tensor& t) { return t.data.to(at::kDouble) / t.scale.to(at::kDouble); };
    // At most one bf16 ulp of the reference's largest value.
    const auto check_bf16 = [](const at::Tensor& actual, const at::Tensor& expected, double& worst) {
      REQUIRE(actual.sizes() == expected.sizes());
      const auto e = expected.to(at::kDouble);
      const double diff = (actual.to(at::kDouble) - e).abs().max().template item<double>();
      const double ulp = e.abs().max().template item<double>() / 128;
      worst = std::max(worst, diff / ulp);
      CHECK(diff <= ulp);
    };
    torch::manual_seed(31);
    const auto x = torch::randn({4, 3, 16}).to(at::kBFloat16);
    const auto probe = torch::randn({4, 3, 8});
    const auto run = [&](auto recipe) {
      using Recipe = decltype(recipe);
      double worst = 0;
      for (const auto& c : cases) {
        INFO(mp::MixedFP8<Recipe>::name, ": bias ", static_cast<int>(c.bias), ", weight grad ",
             c.weight_grad, ", input grad ", c.input_grad, ", grad mode ", c.grad_mode);
        torch::manual_seed(32);
        mp::nn::Float8Linear layer(torch::nn::LinearOptions(16, 8).bias(c.bias != Bias::none));
        layer->to(at::kBFloat16);  // as MixedFP8 casts it
        layer->set_fp8_state(c10::make_intrusive<mp::detail::Fp8LayerState>(
            mp::detail::Fp8Settings::of<Recipe>()));
        layer->keep_operands();
        layer->weight.requires_grad_(c.weight_grad);
        if (c.bias != Bias::none) layer->bias.requires_grad_(c.bias == Bias::trained);
        const auto input = x.clone().requires_grad_(c.input_grad);
        at::Tensor y;
        {
          const torch::AutoGradMode mode(c.grad_mode);
          y = layer(input);
        }
        CHECK(y.scalar_type() == at::kBFloat16);
        const bool any = c.input_grad || c.weight_grad || c.bias == Bias::trained;
        CHECK(y.requires_grad() == (c.grad_mode && any));
        const auto& ops = layer->last_operands();
        if constexpr (Recipe::rowwise) {  // one scale per row of the input and of the weight
          CHECK(ops.input.scale.sizes() == at::IntArrayRef({12, 1}));
          CHECK(ops.weight.scale.sizes() == at::IntArrayRef({8, 1}));
        }
        auto forward = deq(ops.input).matmul(deq(ops.weight).t()).to(at::kBFloat16);
        if (c.bias != Bias::none) forward = forward + layer->bias.detach();
        check_bf16(y.reshape({12, 8}), forward, worst);
        if (!y.requires_grad()) continue;
        (y.to(at::kFloat) * probe).sum().backward();
        // What the layer's backward cast; it ran only where the input or the weight needs a
        // gradient (the rowwise recipes: each product's own casts, where it runs).
        const auto grad_output = probe.to(at::kBFloat16).to(at::kDouble).reshape({12, 8});
        const auto& g = ops.grad_output;
        CHECK(g.data.defined() == (Recipe::rowwise ? c.input_grad : c.input_grad || c.weight_grad));
        if (g.data.defined()) {
          CHECK(g.data.scalar_type() == (Recipe::rowwise ? mp::detail::float8_e4m3 : mp::detail::float8_e5m2));
        }
        CHECK(ops.grad_output_for_grad_weight.data.defined() ==
              (Recipe::rowwise && Recipe::weight_grad_fp8 && c.weight_grad));
        if (c.input_grad) {
          REQUIRE(input.grad().defined());
          // grad_input's weight: per column (rowwise), one scale (..._WithGwHp), the forward
          // product's cast (tensorwise).
          const auto& w = Recipe::rowwise ? ops.weight_for_grad_input : ops.weight;
          if constexpr (Recipe::rowwise) {
            CHECK(w.scale.sizes() == (Recipe::weight_grad_fp8 ? at::IntArrayRef({1, 16})
                                                             : at::IntArrayRef({})));
          }
          check_bf16(input.grad().reshape({12, 16}), deq(g).matmul(deq(w)), worst);
        } else {
          CHECK_FALSE(input.grad().defined());
        }
        if (c.weight_grad) {
          REQUIRE(layer->weight.grad().defined());
          at::Tensor expected;
          if constexpr (!Recipe::rowwise) {
            expected = deq(g).t().matmul(deq(ops.input));
          } else if constexpr (Recipe::weight_grad_fp8) {  // both per column
            CHECK(ops.grad_output_for_grad_weight.scale.sizes() == at::IntArrayRef({1, 8}));
            CHECK(ops.input_for_grad_weight.scale.sizes() == at::IntArrayRef({1, 16}));
            expected = deq(ops.grad_output_for_grad_weight).t().matmul(deq(ops.input_for_grad_weight));
          } else {  // in bf16: the layer's own input and gradient, no fp8
            expected = grad_output.t().matmul(x.to(at::kDouble).reshape({12, 16}));
          }
          check_bf16(layer->weight.grad(), expected, worst);
        } else {
          CHECK_FALSE(layer->weight.grad().defined());
        }
        if (c.bias == Bias::trained) {
          // The bias is added after the product, in bf16: its gradient is the upstream one's sum.
          REQUIRE(layer->bias.grad().defined());
          check_bf16(layer->bias.grad(), probe.to(at::kBFloat16).to(at::kDouble).sum(at::IntArrayRef{0, 1}), worst);
        } else if (c.bias == Bias::frozen) {
          CHECK_FALSE(layer->bias.grad().defined());
        }
      }
      MESSAGE(mp::MixedFP8<Recipe>::name, ": largest difference from fp64 on the fp8 operands, in "
              "bf16 ulps of the largest value: ", worst);
    };
    (run(recipes), ...);
  });
}

}  // namespace test_fp8
