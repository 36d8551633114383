// The block-scaled recipes of MixedFP8 (fp8/block_recipes.hpp): MXFP8's e8m0 scales and
// NVFP4's e2m1 rounding and scales against their definitions written here, blockwise fp8's
// scales, the 16x16 and 128x128 tiles of a transposed weight, stochastic rounding's mean, the
// random Hadamard transform's orthogonality; training an MLP and a token model under each
// recipe, the Errors (features, rows, dtypes), the policy identity in checkpoints and a
// bit-for-bit resume with NVFP4's rounding state. Byte-for-byte parity with torchao is in
// tests/test_parity_block.cpp. LibTorch 1.13 has no fp8: every case is skipped there.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace test_block_formats {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

using test::with_fp8_recipes;

// The e8m0 byte of an MX block from the OCP definition: FLOOR 2^(floor(log2 amax) - 8) (8: the
// exponent of e4m3's largest power of 2), RCEIL 2^ceil(log2(amax / 448)), clamped to e8m0's
// range [2^-127, 2^127]; a zero block gets the smallest byte.
int mx_byte(double amax, mp::MxScale mode) {
  if (amax == 0) return 0;
  const double exponent = mode == mp::MxScale::floor ? std::floor(std::log2(amax)) - 8
                                                     : std::ceil(std::log2(amax / 448.0));
  return static_cast<int>(std::clamp(exponent, -127.0, 127.0)) + 127;
}

// The nearest e2m1 value of |v| <= 6 (ties to the even code) as a code with v's sign.
std::uint8_t e2m1_definition(float v) {
  const float magnitude = std::min(std::abs(v), 6.0f);
  int best = 0;
  for (int code = 1; code < 8; ++code) {
    const float d = std::abs(mp::detail::e2m1_values[code] - magnitude);
    const float best_d = std::abs(mp::detail::e2m1_values[best] - magnitude);
    if (d < best_d || (d == best_d && code % 2 == 0)) best = code;
  }
  return static_cast<std::uint8_t>(best | (std::signbit(v) ? 8 : 0));
}

float e2m1_value(std::uint8_t code) {
  const float magnitude = mp::detail::e2m1_values[code & 7];
  return (code & 8) != 0 ? -magnitude : magnitude;
}

// fc1, fc2 in the recipe, the classifier kept bf16 by a precision map (its 4 outputs fit no
// block), as torchao's examples filter out the last layer.
struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", mp::nn::Float8Linear(128, 128))),
        fc2(register_module("fc2", mp::nn::Float8Linear(128, 128))),
        head(register_module("head", mp::nn::Float8Linear(128, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return head(torch::gelu(fc2(torch::gelu(fc1(x))))); }
  mp::nn::Float8Linear fc1, fc2, head;
};
TORCH_MODULE(Mlp);

// Batches of 128 rows (a multiple of every block) from a linear teacher; `tokens` > 1 makes
// them [128 / tokens, tokens, 128], a token model's activations.
struct Data {
  std::vector<at::Tensor> x, y;
};
Data make_data(int batches, std::int64_t tokens = 1, std::uint64_t seed = 5) {
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(seed);
  const auto teacher = torch::randn({128, 4}, generator);
  Data data;
  for (int i = 0; i < batches; ++i) {
    auto x = torch::randn({128, 128}, generator);
    data.y.push_back(x.matmul(teacher).argmax(1));
    data.x.push_back(tokens > 1 ? x.reshape({128 / tokens, tokens, 128}) : x);
  }
  return data;
}

// An Mlp, its optimizer and a Trainer<P> (the head kept bf16), trained step by step.
template <class P>
struct Run {
  Mlp model;
  torch::optim::AdamW adam;
  mp::Trainer<P> trainer;
  explicit Run(std::uint64_t seed, std::uint64_t rounding_seed = 0)
      : model(make(seed)),
        adam(model->parameters(), torch::optim::AdamWOptions(1e-2)),
        trainer(model, adam, mp::TrainerOptions().rounding_seed(rounding_seed)) {}
  static Mlp make(std::uint64_t seed) {
    torch::manual_seed(seed);
    Mlp model;
    if constexpr (mp::detail::fp8_policy<P>) {
      mp::apply_precision_map<P>(model, mp::PrecisionMap().add("head", mp::Precision::low));
    }
    return model;
  }
  std::vector<double> steps(const Data& data, std::size_t from, std::size_t to) {
    std::vector<double> losses;
    for (std::size_t i = from; i < to; ++i) {
      const auto report = trainer.step([&] {
        auto logits = model->forward(trainer.cast_input(data.x[i]));
        if (logits.dim() == 3) logits = logits.reshape({-1, 4});
        return torch::cross_entropy_loss(logits.to(at::kFloat), data.y[i]);
      });
      losses.push_back(report.loss.template item<double>());
    }
    return losses;
  }
  std::vector<at::Tensor> state() const {
    auto all = test::snapshot(model->parameters());
    for (const auto& m : trainer.master_weights()) all.push_back(m.clone());
    return all;
  }
};

double mean(const std::vector<double>& v, std::size_t from, std::size_t to) {
  double sum = 0;
  for (std::size_t i = from; i < to; ++i) sum += v[i];
  return sum / static_cast<double>(to - from);
}

}  // namespace

TEST_CASE("MXFP8 casts: e8m0 scales from the OCP definition (FLOOR, RCEIL), e4m3 codes of x / "
          "scale, zeros, saturation, subnormal inputs" * doctest::skip(!mp::has_fp8)) {
  // Row 0: a block of amax 3 and one of 500 (FLOOR's 2^0 saturates it at 448); row 1: a zero
  // block and one of fp32 subnormals; row 2: amax 448 exactly and 2^-120.
  auto x = torch::zeros({3, 64}, at::kFloat);
  x[0].slice(0, 0, 32).copy_(torch::linspace(-3, 3, 32));
  x[0][40] = 500.0;
  x[0][41] = 0.75;
  x[1].slice(0, 32, 64).fill_(std::ldexp(1.0, -140));
  x[2][0] = 448.0;
  x[2][33] = std::ldexp(1.0, -120);
  for (const auto mode : {mp::MxScale::floor, mp::MxScale::rceil}) {
    CAPTURE(static_cast<int>(mode));
    const auto q = mp::detail::mx_quantize(x, mode);
    REQUIRE(q.scale.sizes() == at::IntArrayRef({3, 2}));
    REQUIRE(q.data.scalar_type() == mp::detail::float8_e4m3);
    const auto blocks = x.reshape({3, 2, 32});
    for (int r = 0; r < 3; ++r) {
      for (int b = 0; b < 2; ++b) {
        CAPTURE(r);
        CAPTURE(b);
        const double amax = blocks[r][b].abs().max().item<double>();
        const int byte = q.scale[r][b].item<int>();
        CHECK(byte == mx_byte(amax, mode));
        // Codes: x over the scale (FLOOR: never below 2^-126; RCEIL: times 2^(127 - byte),
        // 1 for the byte 0), saturated at 448, to nearest even.
        const double scale = mode == mp::MxScale::floor ? std::max(std::ldexp(1.0, byte - 127), std::ldexp(1.0, -126))
                             : byte == 0 ? 1.0 : std::ldexp(1.0, byte - 127);
        const auto expected = (blocks[r][b] / scale).clamp(-448, 448).to(mp::detail::float8_e4m3);
        CHECK(test::bytes_of(q.data.reshape({3, 2, 32})[r][b]).equal(test::bytes_of(expected)));
      }
    }
    // Dequantized in bf16: code x 2^(byte - 127).
    const auto values = mp::detail::mx_dequantize(q, at::kBFloat16).to(at::kDouble);
    const auto scales = torch::pow(2.0, q.scale.to(at::kDouble) - 127).repeat_interleave(32, 1);
    CHECK(values.equal(q.data.to(at::kDouble) * scales));
  }
  // FLOOR saturates the 500, RCEIL does not (a scale of 2: 250, e4m3's nearest is 256).
  CHECK(mp::detail::mx_quantize(x, mp::MxScale::floor).data.to(at::kFloat)[0][40].item<float>() == 448.0f);
  CHECK(mp::detail::mx_quantize(x, mp::MxScale::rceil).data.to(at::kFloat)[0][40].item<float>() == 256.0f);
  // A width the block does not divide.
  CHECK_THROWS_WITH_AS(mp::detail::mx_quantize(torch::zeros({2, 48}), mp::MxScale::floor),
                       doctest::Contains("multiple of 32"), mp::Error);
}

TEST_CASE("NVFP4: e2m1 to nearest even and saturating; stochastic rounding between the two "
          "neighbours, unbiased" * doctest::skip(!mp::has_fp8)) {
  const std::vector<float> values{0.0f, -0.0f, 0.25f, 0.2500001f, 0.75f, 1.25f, 1.75f, 2.5f,
                                  3.5f, 5.0f, 5.0001f, 6.0f, 7.0f, -1e30f, 1e-30f, -2.9f};
  for (const float v : values) {
    CAPTURE(v);
    CHECK(mp::detail::e2m1_nearest(v) == e2m1_definition(v));
  }
  CHECK(mp::detail::e2m1_nearest(std::numeric_limits<float>::quiet_NaN()) == 3);  // torchao's
  // Stochastic: the two neighbours only, with the mean of the value (4096 draws; 4.5 standard
  // deviations of a mean of Bernoulli draws across a gap of 2 is 0.07).
  for (const float v : {0.3f, 1.2f, 2.6f, 5.0f, -4.5f, 0.01f}) {
    CAPTURE(v);
    double sum = 0;
    for (std::uint32_t i = 0; i < 4096; ++i) {
      const auto code = mp::detail::e2m1_stochastic(v, mp::detail::hash32(i ^ 0x9e3779b9U));
      const float value = e2m1_value(code);
      sum += value;
      CHECK(std::abs(value - v) <= 2.0f);
      CHECK((value == v || std::signbit(value) == std::signbit(v)));
    }
    CHECK(std::abs(sum / 4096 - v) < 0.07);
  }
  CHECK(mp::detail::e2m1_stochastic(6.0f, 0xffffffffU) == 7);
  CHECK(mp::detail::e2m1_stochastic(1.5f, 0U) == 3);  // a value on the grid stays
}

TEST_CASE("NVFP4 casts: the tensor scale, e4m3 block scales, values within e2m1's rounding; "
          "16x16 tiles of W^T are W's, transposed" * doctest::skip(!mp::has_fp8)) {
  torch::manual_seed(3);
  auto w = torch::randn({32, 48}).to(at::kBFloat16);
  w[5][7] = 40.0;  // an outlier: its tile's scale, not its neighbours'
  for (const bool tiles : {false, true}) {
    CAPTURE(tiles);
    const auto q = mp::detail::nvfp4_quantize(w, tiles);
    const float amax = w.abs().max().to(at::kFloat).item<float>();
    CHECK(q.tensor_scale.item<float>() == static_cast<float>(amax / 2688.0f));
    REQUIRE(q.scale.sizes() == at::IntArrayRef({32, 3}));
    REQUIRE(q.data.sizes() == at::IntArrayRef({32, 24}));
    auto block_amax = w.to(at::kFloat).abs().reshape({32, 3, 16}).amax({2});
    if (tiles) block_amax = block_amax.reshape({2, 16, 3}).amax({1}).repeat_interleave(16, 0);
    const auto expected = (block_amax / 6.0 / q.tensor_scale).clamp(0.015625, 448.0).to(mp::detail::float8_e4m3);
    CHECK(test::bytes_of(q.scale).equal(test::bytes_of(expected)));
    // Each value within half a step of e2m1's grid (steps of 2 at the top) times its scale.
    const auto values = mp::detail::nvfp4_dequantize(q);
    const auto factor = (q.tensor_scale * q.scale.to(at::kFloat)).repeat_interleave(16, 1);
    CHECK(((values - w.to(at::kFloat)).abs() <= factor * 1.0 + 1e-6).all().item<bool>());
  }
  // The 16x16 cast of W^T: the same codes and scales, transposed.
  const auto q = mp::detail::nvfp4_quantize(w, true);
  const auto qt = mp::detail::nvfp4_quantize(w.t().contiguous(), true);
  CHECK(mp::detail::e2m1_unpack(qt.data).equal(mp::detail::e2m1_unpack(q.data).t()));
  CHECK(mp::detail::nvfp4_dequantize(qt).equal(mp::detail::nvfp4_dequantize(q).t()));
  // An all-zero tensor: scale 1, zero codes (torchao's emulated cast divides by 0 there).
  const auto zero = mp::detail::nvfp4_quantize(torch::zeros({16, 16}), true);
  CHECK(zero.tensor_scale.item<float>() == 1.0f);
  CHECK(mp::detail::nvfp4_dequantize(zero).abs().max().item<float>() == 0.0f);
}

TEST_CASE("the random Hadamard transform: diag(signs) H / 4 is orthogonal, the product of two "
          "transformed operands is theirs" * doctest::skip(!mp::has_fp8)) {
  const auto r = mp::detail::random_hadamard16(12345U).to(at::kDouble);
  CHECK(r.mm(r.t()).equal(torch::eye(16, at::kDouble)));
  CHECK(r.abs().eq(0.25).all().item<bool>());
  const auto other = mp::detail::random_hadamard16(54321U).to(at::kDouble);
  CHECK_FALSE(other.equal(r));  // the signs follow the key
  torch::manual_seed(1);
  const auto a = torch::randn({6, 48}, at::kDouble), b = torch::randn({5, 48}, at::kDouble);
  const auto ta = a.reshape({-1, 16}).mm(r).reshape({6, 48});
  const auto tb = b.reshape({-1, 16}).mm(r).reshape({5, 48});
  CHECK((ta.mm(tb.t()) - a.mm(b.t())).abs().max().item<double>() < 1e-12);
  // hadamard_rows: the fp32 product rounded to bf16.
  const auto x = torch::randn({4, 32}).to(at::kBFloat16);
  const auto h = mp::detail::hadamard_rows(x, r.to(at::kFloat));
  CHECK(h.scalar_type() == at::kBFloat16);
  CHECK(h.equal(x.to(at::kFloat).reshape({-1, 16}).mm(r.to(at::kFloat)).to(at::kBFloat16).reshape({4, 32})));
}

TEST_CASE("blockwise fp8 casts: scales 448 / amax per 1x128, 128x1 and 128x128 block; the "
          "tiles of W^T are W's, transposed" * doctest::skip(!mp::has_fp8)) {
  torch::manual_seed(4);
  auto x = torch::randn({256, 256}).to(at::kBFloat16);
  x[3][200] = 300.0;
  x.slice(0, 128, 256).slice(1, 0, 128).zero_();  // a zero tile
  const auto scale_of = [](const at::Tensor& amax) {
    return (448.0 / amax.to(at::kDouble).clamp_min(1e-12)).to(at::kFloat);
  };
  const auto q1 = mp::detail::blockwise_quantize_1x128(x);
  const auto amax1 = x.abs().reshape({256, 2, 128}).amax({2});
  CHECK(q1.scale.equal(scale_of(amax1).reciprocal()));
  const auto q2 = mp::detail::blockwise_quantize_128x1(x);
  CHECK(q2.scale.sizes() == at::IntArrayRef({2, 256}));
  const auto amax2 = x.abs().reshape({2, 128, 256}).amax({1});
  // Scales of nonzero blocks as the definition; a zero block's scale is from bf16's 1e-12.
  const auto nonzero = amax2 > 0;
  CHECK(q2.scale.masked_select(nonzero).equal(scale_of(amax2).reciprocal().masked_select(nonzero)));
  const auto q3 = mp::detail::blockwise_quantize_128x128(x);
  const auto amax3 = x.abs().reshape({2, 128, 2, 128}).amax({1, 3});
  CHECK(q3.scale.equal(scale_of(amax3).reciprocal()));
  const auto codes = (x.to(at::kFloat) * scale_of(amax3).repeat_interleave(128, 0).repeat_interleave(128, 1))
                         .clamp(-448, 448).to(mp::detail::float8_e4m3);
  CHECK(test::bytes_of(q3.data).equal(test::bytes_of(codes)));
  const auto q3t = mp::detail::blockwise_quantize_128x128(x.t().contiguous());
  CHECK(test::bytes_of(q3t.data).equal(test::bytes_of(q3.data.t().contiguous())));
  CHECK(q3t.scale.equal(q3.scale.t()));
  // Dequantized: code x reciprocal scale.
  CHECK(mp::detail::blockwise_dequantize(q1).equal(
      q1.data.to(at::kFloat) * q1.scale.repeat_interleave(128, 1)));
}

TEST_CASE("the block recipes train an MLP and a token model as MixedO2<BFloat16> does" *
          doctest::skip(!mp::has_fp8)) {
  with_fp8_recipes<mp::MXFP8Scaling<mp::MxScale::floor>, mp::MXFP8Scaling<mp::MxScale::rceil, true>,
                   mp::BlockwiseFP8Scaling, mp::NVFP4>([](auto... recipes) {
    for (const std::int64_t tokens : {1, 16}) {
      CAPTURE(tokens);
      const auto data = make_data(24, tokens);
      Run<mp::MixedO2<at::BFloat16>> bf16(0);
      const auto reference = bf16.steps(data, 0, 24);
      const auto check = [&](auto recipe) {
        using P = mp::MixedFP8<decltype(recipe)>;
        CAPTURE(P::name);
        Run<P> run(0);
        CHECK(run.model->fc1->computes_fp8());
        CHECK_FALSE(run.model->head->computes_fp8());
        const auto losses = run.steps(data, 0, 24);
        // It trains, and its last 8 losses' mean is within 10% of bf16's (4-bit values move
        // them most: NVFP4 measured 3-6%, the fp8 recipes below 2%).
        CHECK(mean(losses, 16, 24) < 0.6 * mean(losses, 0, 4));
        MESSAGE(P::name, ", tokens ", tokens, ": last 8 steps' mean loss ", mean(losses, 16, 24),
                ", MixedO2<BFloat16> ", mean(reference, 16, 24));
        CHECK(std::abs(mean(losses, 16, 24) - mean(reference, 16, 24)) < 0.1 * mean(reference, 16, 24));
      };
      (check(recipes), ...);
    }
  });
}

TEST_CASE("block recipes: features and rows the block does not fill, and dtypes the casts do "
          "not take, are Errors that change nothing" * doctest::skip(!mp::has_fp8)) {
  with_fp8_recipes<mp::MXFP8Scaling<>, mp::BlockwiseFP8Scaling, mp::NVFP4>([](auto... recipes) {
    const auto check = [](auto recipe) {
      using P = mp::MixedFP8<decltype(recipe)>;
      CAPTURE(P::name);
      // The head (128 -> 4) left in the recipe: refused at construction, the model untouched.
      torch::manual_seed(0);
      Mlp model;
      torch::optim::AdamW adam(model->parameters());
      CHECK_THROWS_WITH_AS((mp::Trainer<P>(model, adam)),
                           doctest::Contains("not: 'head' (128 -> 4). Keep them in bf16"), mp::Error);
      CHECK(model->fc1->weight.scalar_type() == at::kFloat);
      CHECK_FALSE(model->fc1->computes_fp8());
      // With the head kept bf16 it trains; a batch of 48 rows does not fill the blocks of 32 /
      // 128 / 16... (NVFP4's 16 divide 48: 40 rows then).
      mp::apply_precision_map<P>(model, mp::PrecisionMap().add("head", mp::Precision::low));
      mp::Trainer<P> trainer(model, adam);
      const std::int64_t rows = P::recipe::block == 16 ? 40 : 48;
      const auto before = test::snapshot(model->parameters());
      const auto message = "not a multiple of " + std::to_string(P::recipe::block);
      CHECK_THROWS_WITH_AS(trainer.step([&] {
        return model->forward(trainer.cast_input(torch::randn({rows, 128}))).to(at::kFloat).sum();
      }), doctest::Contains(message.c_str()), mp::Error);
      CHECK(test::identical(test::snapshot(model->parameters()), before));
      // Evaluation sums over no rows: any batch.
      {
        torch::NoGradGuard no_grad;
        CHECK(model->forward(trainer.cast_input(torch::randn({rows, 128}))).size(0) == rows);
      }
      // An input of another dtype than the layer's: the casts take the layer's bf16.
      CHECK_THROWS_WITH_AS(model->fc1->forward(torch::randn({32, 128}).to(at::kHalf)),
                           doctest::Contains("got a Half input for a BFloat16 weight"), mp::Error);
      const auto report = trainer.step([&] {
        return model->forward(trainer.cast_input(torch::randn({128, 128}))).to(at::kFloat).pow(2).mean();
      });
      CHECK(report.stepped());
    };
    (check(recipes), ...);
  });
}

TEST_CASE("block recipes in checkpoints: the recipe's settings refuse another's; NVFP4 resumes bit "
          "for bit, its rounding seed and draws saved" * doctest::skip(!mp::has_fp8)) {
  with_fp8_recipes<mp::MXFP8Scaling<mp::MxScale::floor>, mp::MXFP8Scaling<mp::MxScale::rceil>,
                   mp::BlockwiseFP8Scaling, mp::NVFP4, mp::NVFP4Scaling<true, false, true>,
                   mp::TensorwiseScaling>(
      [](auto floor, auto rceil, auto blockwise, auto nvfp4, auto nvfp4_nearest, auto tensorwise) {
    const auto data = make_data(8);
    const auto refused = [&](auto recipe, const std::string& from, const char* message) {
      Run<mp::MixedFP8<decltype(recipe)>> target(1);
      target.steps(data, 0, 1);
      const auto before = target.state();
      CHECK_THROWS_WITH_AS(target.trainer.load(from), doctest::Contains(message), mp::Error);
      CHECK(test::identical(target.state(), before));
    };
    const auto path = test::temp_path("block_mxfp8.ckpt");
    Run<mp::MixedFP8<decltype(floor)>> mx(0);
    mx.steps(data, 0, 2);
    mx.trainer.save(path);
    refused(rceil, path, "fp8_scale_mode floor there, rceil here");
    refused(blockwise, path, "fp8 mxfp8 there, blockwise here, fp8_block 32 there, 1x128,128x128 here");
    refused(tensorwise, path, "fp8 mxfp8 there, tensorwise here");
    // NVFP4: 3 steps, save, 3 more; a fresh Trainer loads and takes the same 3 steps.
    const auto nv_path = test::temp_path("block_nvfp4.ckpt");
    Run<mp::MixedFP8<decltype(nvfp4)>> source(0, /*rounding_seed=*/7);
    source.steps(data, 0, 3);
    source.trainer.save(nv_path);
    refused(nvfp4_nearest, nv_path, "nvfp4_gradient_rounding stochastic there, nearest here");
    refused(floor, nv_path, "fp8 nvfp4 there, mxfp8 here");
    const auto continued = source.steps(data, 3, 6);
    Run<mp::MixedFP8<decltype(nvfp4)>> resumed(1, /*rounding_seed=*/0);  // the file's seed wins
    resumed.trainer.load(nv_path);
    const auto after_load = resumed.steps(data, 3, 6);
    CHECK(after_load == continued);
    CHECK(test::identical(resumed.state(), source.state()));
    // The seed matters: another one rounds the gradients otherwise.
    Run<mp::MixedFP8<decltype(nvfp4)>> seven(0, 7), eight(0, 8);
    seven.steps(data, 0, 2);
    eight.steps(data, 0, 2);
    CHECK_FALSE(test::identical(seven.state(), eight.state()));
  });
}

TEST_CASE("advise: the block recipes' verdicts (features the block tiles, values a block rounds to "
          "0, NVFP4's last layers) and the maps that let their Trainers build" *
          doctest::skip(!mp::has_fp8)) {
  with_fp8_recipes<mp::MXFP8Scaling<>, mp::BlockwiseFP8Scaling, mp::NVFP4>(
      [](auto mx, auto blockwise, auto nvfp4) {
    auto generator = torch::make_generator<at::CPUGeneratorImpl>(9);
    torch::manual_seed(0);
    Mlp model;
    const auto advise_with = [&](bool outlier_row, const mp::AdviseOptions& options = {}) {
      return mp::advise(model, [&] {
        auto x = torch::randn({128, 128}, generator);
        if (outlier_row) {
          x[0].fill_(1e7);  // one sample of 1e7 in every feature
        } else {
          x.select(1, 0).fill_(1e7);  // one feature of 1e7 in every sample
        }
        return model->forward(x).pow(2).mean();
      }, options);
    };
    // An outlier sample: tensorwise scaling flushes the others; a scale per block of a row
    // isolates it. The head (128 -> 4) fits no block.
    const auto rows = advise_with(true);
    REQUIRE(rows.fp8_layers.size() == 3);
    const auto& fc1 = rows.fp8_layers[0];
    const auto& head = rows.fp8_layers[2];
    CHECK_FALSE(fc1.fp8);
    CHECK(fc1.mxfp8);
    CHECK(fc1.blockwise);
    CHECK(fc1.nvfp4);
    CHECK(fc1.input.flushed_mxfp8 == 0.0);
    CHECK_FALSE(head.template holds<decltype(mx)>());
    CHECK(head.mxfp8_reason == "its features (128 -> 4) are no multiples of MXFP8's block of 32");
    CHECK_FALSE(head.template holds<decltype(blockwise)>());
    CHECK_FALSE(head.template holds<decltype(nvfp4)>());
    // An outlier feature: each row's first block of 32 (or 128) is its scale's, and the rest
    // of that block rounds to 0: 31/128 of the inputs under MXFP8, 127/128 under blockwise.
    const auto columns = advise_with(false);
    const auto& c1 = columns.fp8_layers[0];
    CHECK_FALSE(c1.mxfp8);
    CHECK(c1.input.flushed_mxfp8 == doctest::Approx(31.0 / 128).epsilon(0.02));
    CHECK_FALSE(c1.blockwise);
    CHECK(c1.input.flushed_blockwise == doctest::Approx(127.0 / 128).epsilon(0.02));
    CHECK(c1.mxfp8_reason.find("of its nonzero inputs would round to 0 in MXFP8") != std::string::npos);
    // The maps: each keeps what its recipe cannot hold, and its Trainer builds with it.
    const auto map = columns.template fp8_precision_map<decltype(mx)>();
    CHECK(map.rules().size() == 2);  // fc1 and head
    mp::apply_precision_map<mp::MixedFP8<decltype(mx)>>(model, map);
    torch::optim::AdamW adam(model->parameters());
    {
      mp::Trainer<mp::MixedFP8<decltype(mx)>> trainer(model, adam);
      CHECK_FALSE(model->fc1->computes_fp8());
      CHECK(model->fc2->computes_fp8());
    }
    // NVFP4 keeps the last share of the layers in bf16, NVIDIA's recipe (15%: the head alone
    // of three; 50%: fc2 too).
    CHECK(rows.template fp8_precision_map<decltype(nvfp4)>().rules().size() == 1);
    torch::manual_seed(0);
    Mlp fresh;
    model = fresh;
    const auto half = advise_with(true, mp::AdviseOptions().nvfp4_bf16_share(0.5));
    CHECK_FALSE(half.fp8_layers[1].nvfp4);
    CHECK(half.fp8_layers[1].nvfp4_reason.find("NVIDIA's NVFP4 recipe keeps the last 50%") == 0);
    CHECK(half.template fp8_precision_map<decltype(nvfp4)>().rules().size() == 2);
  });
}

TEST_CASE("each block cast's signal-to-noise ratio on normal data against torchao's thresholds "
          "(MX e4m3 18 dB, NVFP4 8 dB)" * doctest::skip(!mp::has_fp8)) {
  // torchao's compute_error: 20 log10(|x| / |x - dequantized|), in dB. Its tests hold MX
  // e4m3 casts of randn to 18 dB (test_mx_tensor.py) and NVFP4's to 8 dB
  // (test_nvfp4_tensor.py); the blockwise casts, e4m3 too, are held to MX's.
  torch::manual_seed(5);
  const auto x = torch::randn({256, 256}).to(at::kBFloat16);
  const auto reference = x.to(at::kFloat);
  const auto sqnr = [&](const at::Tensor& values) {
    return 20.0 * std::log10(reference.norm().item<double>() /
                             (reference - values).norm().item<double>());
  };
  namespace d = mp::detail;
  const double mx_floor = sqnr(d::mx_dequantize(d::mx_quantize(x, mp::MxScale::floor), at::kFloat));
  const double mx_rceil = sqnr(d::mx_dequantize(d::mx_quantize(x, mp::MxScale::rceil), at::kFloat));
  const double bw_1x128 = sqnr(d::blockwise_dequantize(d::blockwise_quantize_1x128(x)));
  const double bw_128x1 = sqnr(d::blockwise_dequantize(d::blockwise_quantize_128x1(x)));
  const double bw_128x128 = sqnr(d::blockwise_dequantize(d::blockwise_quantize_128x128(x)));
  const double nv_1x16 = sqnr(d::nvfp4_dequantize(d::nvfp4_quantize(x, false)));
  const double nv_16x16 = sqnr(d::nvfp4_dequantize(d::nvfp4_quantize(x, true)));
  const double nv_stochastic =
      sqnr(d::nvfp4_dequantize(d::nvfp4_quantize(x, false, {.stochastic = true, .key = 77U})));
  MESSAGE("SQNR (dB) on randn [256, 256] bf16: MXFP8 FLOOR ", mx_floor, ", RCEIL ", mx_rceil,
          "; blockwise fp8 1x128 ", bw_1x128, ", 128x1 ", bw_128x1, ", 128x128 ", bw_128x128,
          "; NVFP4 1x16 ", nv_1x16, ", 16x16 ", nv_16x16, ", 1x16 stochastic ", nv_stochastic);
  for (const double fp8 : {mx_floor, mx_rceil, bw_1x128, bw_128x1, bw_128x128}) CHECK(fp8 >= 18.0);
  for (const double fp4 : {nv_1x16, nv_16x16}) CHECK(fp4 >= 8.0);
  // A scale per 16x16 tile is coarser than one per 16 values; stochastic rounding, unbiased,
  // adds noise to each value (its point is the mean, tested above), so its ratio is lower.
  CHECK(nv_16x16 <= nv_1x16);
  CHECK(nv_stochastic < nv_1x16);
  // e4m3's 3 mantissa bits against e2m1's 1: the fp8 casts are at least 10 dB cleaner.
  CHECK(std::min({mx_floor, mx_rceil, bw_1x128}) > nv_1x16 + 10.0);
}

}  // namespace test_block_formats
