// fp8 on the CPU: the matrix product MixedFP8 uses (fp8.hpp: dequantized fp32 operands, an fp32
// product, as torchao's emulation) against fp32, bf16 and LibTorch's own at::_scaled_mm, default
// (oneDNN) and with oneDNN off; then one training step of an MLP of Float8Linear layers under
// MixedFP8 against MixedO2<BFloat16> and FullPrecision. Target (docs/fp8.md): the fp8 product
// within 2x fp32's time at 1024-4096, on both CPUs these machines have.
//
//   ./build/default/benchmarks/bench_fp8            full size
//   ./build/default/benchmarks/bench_fp8 --smoke    tiny sizes, 3 repetitions (ctest)
//
// LibTorch 1.13 has no fp8: there it prints fp32 and bf16 only.

#include <harness.hpp>

#include <mixprec/fp8/linear.hpp>
#include <mixprec/trainer/trainer.hpp>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace bench_fp8 {

namespace {

// LibTorch's _scaled_mm with oneDNN switched off for the call: its reference emulation.
struct OneDnnOff {
  OneDnnOff() : was(at::globalContext().userEnabledMkldnn()) {
    at::globalContext().setUserEnabledMkldnn(false);
  }
  ~OneDnnOff() { at::globalContext().setUserEnabledMkldnn(was); }
  bool was;
};

struct MlpImpl : torch::nn::Module {
  MlpImpl(std::int64_t d, std::int64_t hidden) {
    for (int i = 0; i < 3; ++i) {
      up.push_back(register_module("up" + std::to_string(i), mixprec::nn::Float8Linear(d, hidden)));
      down.push_back(register_module("down" + std::to_string(i), mixprec::nn::Float8Linear(hidden, d)));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (std::size_t i = 0; i < up.size(); ++i) x = x + down[i](torch::gelu(up[i](x)));
    return x;
  }
  std::vector<mixprec::nn::Float8Linear> up, down;
};

// One optimizer step of a fresh MLP under P, as a benchmark variant.
template <class P>
bench::Variant step_variant(std::int64_t batch, std::int64_t d, std::int64_t hidden) {
  auto model = std::make_shared<MlpImpl>(d, hidden);
  auto adam = std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-4));
  auto trainer = std::make_shared<mixprec::Trainer<P>>(model, *adam);
  const auto x = at::randn({batch, d});
  const auto target = at::randn({batch, d});
  return {std::string(P::name), [=] {
            (void)adam;  // kept alive by the variant
            trainer->step([&] {
              return torch::nn::functional::mse_loss(
                  model->forward(trainer->cast_input(x)).to(at::kFloat), target);
            });
          }};
}

// (Templates on the recipes only so that MixedFP8 is not compiled under LibTorch 1.13.)
template <class Recipe, class Delayed = mixprec::DelayedScaling<>>
void fp8_tables(const bench::Options& options) {
  using mixprec::Fp8Role;
  const std::vector<std::int64_t> sizes =
      options.smoke ? std::vector<std::int64_t>{64, 128} : std::vector<std::int64_t>{1024, 2048, 4096};
  for (const auto n : sizes) {
    const auto a = at::randn({n, n}), b = at::randn({n, n});
    const auto a16 = a.to(at::kBFloat16), b16 = b.to(at::kBFloat16);
    const auto one = at::ones({}, at::kFloat);
    const auto qa = mixprec::detail::quantize(a, one, Fp8Role::input);
    const auto qb = mixprec::detail::quantize(b, one, Fp8Role::weight);
    const auto qb_columns = qb.data.t().contiguous().t();  // _scaled_mm: column-major
    mixprec::detail::Fp8LayerState state(/*delayed=*/false, 0, 0);
    std::vector<bench::Variant> variants{
        {"fp32 mm", [&] { (void)at::mm(a, b); }},
        {"bf16 mm", [&] { (void)at::mm(a16, b16); }},
        {"fp8: mixprec's product (fp8 operands given)",
         [&] { (void)mixprec::detail::fp8_mm(qa, qb, at::kBFloat16); }},
        {"fp8: mixprec's casts (amax, scale, e4m3) + product",
         [&] {
           const auto x = state.cast(Fp8Role::input, a16);
           const auto w = state.cast(Fp8Role::weight, b16);
           (void)mixprec::detail::fp8_mm(x, w, at::kBFloat16);
         }},
        {"fp8: at::_scaled_mm, oneDNN off (its emulation)",
         [&] {
           const OneDnnOff off;
           (void)mixprec::detail::scaled_mm(qa.data, qb_columns, one, one, at::kBFloat16);
         }},
    };
    const auto ms = bench::interleaved_samples(variants, options);
    bench::print_table(std::to_string(n) + "^3 matrix product, bf16 output (fp32: fp32 output)",
                       variants, ms);
  }

  // oneDNN's default path, at a size where it still finishes: 12,000x fp32 on a Xeon at 256^3.
  {
    const std::int64_t n = options.smoke ? 32 : 128;
    const auto a = at::randn({n, n}), b = at::randn({n, n});
    const auto one = at::ones({}, at::kFloat);
    const auto qa = mixprec::detail::quantize(a, one, Fp8Role::input);
    const auto qb = mixprec::detail::quantize(b, one, Fp8Role::weight);
    const auto qb_columns = qb.data.t().contiguous().t();
    bench::Options few = options;
    few.repetitions = 3;
    few.warmup = 1;
    std::vector<bench::Variant> variants{
        {"fp32 mm", [&] { (void)at::mm(a, b); }},
        {"fp8: mixprec's product", [&] { (void)mixprec::detail::fp8_mm(qa, qb, at::kBFloat16); }},
        {"fp8: at::_scaled_mm, default (oneDNN)",
         [&] { (void)mixprec::detail::scaled_mm(qa.data, qb_columns, one, one, at::kBFloat16); }},
    };
    const auto ms = bench::interleaved_samples(variants, few);
    bench::print_table(std::to_string(n) + "^3: LibTorch's default CPU _scaled_mm (3 repetitions)",
                       variants, ms);
  }

  // One training step: 3 residual blocks d -> 4d -> d of Float8Linear, AdamW.
  {
    const std::int64_t batch = options.smoke ? 8 : 512, d = options.smoke ? 32 : 1024;
    std::vector<bench::Variant> variants{
        step_variant<mixprec::MixedO2<at::BFloat16>>(batch, d, 4 * d),
        step_variant<mixprec::MixedFP8<Recipe>>(batch, d, 4 * d),
        step_variant<mixprec::MixedFP8<Delayed>>(batch, d, 4 * d),
        step_variant<mixprec::FullPrecision>(batch, d, 4 * d),
    };
    const auto ms = bench::interleaved_samples(variants, options);
    bench::print_table("One AdamW step of an MLP (batch " + std::to_string(batch) +
                           ", 3 residual blocks " + std::to_string(d) + " -> " +
                           std::to_string(4 * d) + " -> " + std::to_string(d) +
                           " of Float8Linear)",
                       variants, ms);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const auto options = bench::parse_options(argc, argv);
  std::printf("\n## fp8 matrix products and training steps on the CPU (bench_fp8)\n\n"
              "%s %d thread(s). MixedFP8's product: the fp8 operands dequantized to fp32, one "
              "fp32 matrix product, one rounding to bf16 (docs/fp8.md).\n",
              bench::method(options).c_str(), at::get_num_threads());
  if constexpr (mixprec::has_fp8) {
    fp8_tables<mixprec::TensorwiseScaling>(options);
  } else {
    const std::int64_t n = options.smoke ? 64 : 1024;
    const auto a = at::randn({n, n}), b = at::randn({n, n});
    const auto a16 = a.to(at::kBFloat16), b16 = b.to(at::kBFloat16);
    std::vector<bench::Variant> variants{{"fp32 mm", [&] { (void)at::mm(a, b); }},
                                         {"bf16 mm", [&] { (void)at::mm(a16, b16); }}};
    std::printf("\nLibTorch %s has no fp8 (MixedFP8 needs >= 2.5): fp32 and bf16 only.\n",
                std::string(mixprec::torch_version).c_str());
    bench::print_table(std::to_string(n) + "^3 matrix product", variants,
                       bench::interleaved_samples(variants, options));
  }
  std::printf("\nRerun: `./scripts/bench bench_fp8`\n");
  return 0;
}

}  // namespace bench_fp8
