// Unscale + gradient clipping: mixprec's fused unscale_(optimizer, max_grad_norm) against
// PyTorch's recipe, GradScaler::unscale_ followed by torch::nn::utils::clip_grad_norm_.
// DESIGN.md §7: fused, one read pass (norm and finiteness) and one read/write pass; the recipe
// makes three reads and two writes. Target: fused >= 1.5x faster.
//
//   ./build/default/benchmarks/bench_clip            full size (64M fp32 elements, M = 2^20)
//   ./build/default/benchmarks/bench_clip --smoke    tiny size, 3 repetitions (ctest)
//
// Clipping is active in every repetition of both variants: the scale is 0.25, so unscaling
// multiplies the gradients, whose norm the previous clipping left at 1, by 4 (and the reference
// row in between by 0.5 or 2); the norm before clipping is then 2 to 8 > max_grad_norm = 1, and
// clipping brings it back to 1. The program checks this, and exits 1 if a variant ever saw a
// norm <= max_grad_norm.

#include <harness.hpp>

#include <mixprec/scaling/scalers.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/types.h>  // before clip_grad.h, which is not self-contained in 1.13
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

namespace bench_clip {

namespace {

constexpr std::int64_t kMi = std::int64_t{1} << 20;
constexpr double kMaxNorm = 1.0;  // the table title says 1
constexpr double kScale = 0.25;  // unscale_ multiplies by 4

std::string elements_name(std::int64_t n) {
  return n % kMi == 0 ? std::to_string(n / kMi) + "M" : std::to_string(n / 1024) + "K";
}

/// One optimizer and one scaler per variant, over the same parameters and gradients.
struct Setup {
  explicit Setup(const std::vector<at::Tensor>& params)
      : optimizer(params, torch::optim::SGDOptions(0.1)),
        scaler(mixprec::GradScalerOptions().init_scale(kScale)) {
    (void)scaler.scale(at::ones({}));
  }
  torch::optim::SGD optimizer;
  mixprec::GradScaler scaler;
  double min_norm_seen = std::numeric_limits<double>::infinity();

  void saw(double norm) { min_norm_seen = std::min(min_norm_seen, norm); }
};

double total_norm(const std::vector<at::Tensor>& grads) {
  double sum = 0.0;
  for (const auto& g : grads) sum += g.to(at::kDouble).square().sum().item<double>();
  return std::sqrt(sum);
}

}  // namespace

int main(int argc, char** argv) {
  const auto options = bench::parse_options(argc, argv);
  const std::int64_t count = options.smoke ? 8 : 256;
  const std::int64_t per_tensor = options.smoke ? 128 * 1024 : 256 * 1024;

  at::manual_seed(0);
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> grads;
  for (std::int64_t i = 0; i < count; ++i) {
    auto p = at::empty({per_tensor}).set_requires_grad(true);  // never read: pages untouched
    p.mutable_grad() = at::randn({per_tensor});
    params.push_back(p);
    grads.push_back(p.grad());
  }

  Setup recipe(params);
  Setup fused(params);
  bool toggle = false;
  std::vector<bench::Variant> variants{
      {"PyTorch recipe: unscale_ + clip_grad_norm_",
       [&] {
         recipe.scaler.unscale_(recipe.optimizer);
         recipe.saw(torch::nn::utils::clip_grad_norm_(params, kMaxNorm));
         recipe.scaler.update(kScale);
       }},
      {"mixprec fused: unscale_(opt, max_grad_norm)",
       [&] {
         const auto norm = fused.scaler.unscale_(
             fused.optimizer, mixprec::UnscaleOptions().max_grad_norm(kMaxNorm));
         fused.saw(norm.value_or(0.0));
         fused.scaler.update(kScale);
       }},
      // For scale: one multiply pass, the least any unscale can cost (x0.5 and x2 in turn).
      {"reference: one at::_foreach_mul_ pass (no clipping)",
       [&] {
         toggle = !toggle;
         at::_foreach_mul_(grads, toggle ? 0.5 : 2.0);
       }},
  };

  // Both clipping variants leave gradients of norm 1 (as clipping to 1 must).
  for (std::size_t v = 0; v < 2; ++v) {
    variants[v].run();
    const double after = total_norm(grads);
    if (std::abs(after - kMaxNorm) > 1e-3) {
      std::fprintf(stderr, "bench_clip: '%s' left a gradient norm of %g, not %g\n",
                   variants[v].name.c_str(), after, kMaxNorm);
      return 1;
    }
  }

  const auto ms = bench::interleaved_samples(variants, options);

  if (!(recipe.min_norm_seen > kMaxNorm) || !(fused.min_norm_seen > kMaxNorm)) {
    std::fprintf(stderr, "bench_clip: clipping was inactive (smallest norms seen %g, %g)\n",
                 recipe.min_norm_seen, fused.min_norm_seen);
    return 1;
  }

  std::printf("## bench_clip: unscale_ + gradient clipping\n\n"
              "Gradients of SGD parameters, scale %g, max_grad_norm %g. %s\n",
              kScale, kMaxNorm, bench::method(options).c_str());
  const auto title = "Unscale + clip to max_grad_norm 1, fp32 grads: " +
                     elements_name(count * per_tensor) + " elements in " + std::to_string(count) +
                     " tensors of " + elements_name(per_tensor) + ", intra-op threads " +
                     std::to_string(at::get_num_threads());
  bench::print_table(title, variants, ms);
  const auto speed_up = bench::paired_ratio(ms[0], ms[1]);
  std::printf("\nClipping active in every repetition of both: smallest norm before clipping "
              "%.3f (recipe), %.3f (fused) > %g. Speed-up fused vs recipe: %.2fx (IQR %s; target "
              ">= 1.5x: %s). Fused / one mul_ pass: %.2fx (fused: one read pass, then one "
              "read/write pass; the recipe: three reads, two writes).\n",
              recipe.min_norm_seen, fused.min_norm_seen, kMaxNorm, speed_up.median,
              bench::iqr(speed_up, 2).c_str(), speed_up.median >= 1.5 ? "met" : "MISSED",
              bench::paired_ratio(ms[1], ms[2]).median);
  std::printf("\nCommand: `./build/default/benchmarks/bench_clip`\n");
  return 0;
}

}  // namespace bench_clip
