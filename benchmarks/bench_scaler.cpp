// Unscale + non-finite check (GradScaler::unscale_) against its floor, one multiply pass over the
// gradients, and against the naive LibTorch recipe (isfinite().all() then mul_, per tensor).
// DESIGN.md §7: unscale_ costs about one mul_ pass (target <= 1.2x the floor) and beats the naive
// recipe by >= 10x; its cost stays linear in the number of elements.
//
//   ./build/default/benchmarks/bench_scaler            full sizes (64M elements, M = 2^20)
//   ./build/default/benchmarks/bench_scaler --smoke    tiny sizes, 3 repetitions (ctest)
//
// Every variant multiplies the gradients by 0.5 and 2 in turn (powers of two: exact, and the
// values neither grow nor shrink towards denormals however many repetitions run). All variants
// work on the same tensors, allocated and first touched before any timing.

#include <harness.hpp>

#include <mixprec/core/compat.hpp>
#include <mixprec/scaling/scalers.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace bench_scaler {

namespace {

constexpr std::int64_t kMi = std::int64_t{1} << 20;

/// Parameters whose .grad() are the benchmarked tensors; the parameters themselves are never
/// read (at::empty: their pages are not even touched).
struct Grads {
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> grads;
};

Grads make_grads(std::int64_t count, std::int64_t per_tensor, at::ScalarType dtype) {
  Grads g;
  at::manual_seed(0);
  for (std::int64_t i = 0; i < count; ++i) {
    auto p = at::empty({per_tensor}, at::TensorOptions(dtype)).set_requires_grad(true);
    auto grad = at::randn({per_tensor}).to(dtype);
    p.mutable_grad() = grad;
    g.params.push_back(p);
    g.grads.push_back(grad);
  }
  return g;
}

/// 0.5, 2, 0.5, 2, ...: the product of any two consecutive factors is 1.
struct Alternating {
  double next() {
    half = !half;
    return half ? 0.5 : 2.0;
  }
  bool half = false;
};

std::string dtype_name(at::ScalarType dtype) { return dtype == at::kBFloat16 ? "bf16" : "fp32"; }

std::string elements_name(std::int64_t n) {
  return n % kMi == 0 ? std::to_string(n / kMi) + "M" : std::to_string(n / 1024) + "K";
}

/// The GradScaler variant: unscale_ by 1/scale, then set the scale that undoes it next time.
/// update(new_scale) ends the iteration (stages reset), so unscale_ may run again.
struct ScalerRun {
  explicit ScalerRun(const std::vector<at::Tensor>& params)
      : optimizer(params, torch::optim::SGDOptions(0.1)),
        scaler(mixprec::GradScalerOptions().init_scale(2.0)) {
    (void)scaler.scale(at::ones({}));  // the scale exists from the first scale(loss) on
  }
  void operator()() {
    scaler.unscale_(optimizer);  // gradients * (1 / scale)
    scale = scale == 2.0 ? 0.5 : 2.0;
    scaler.update(scale);
  }
  torch::optim::SGD optimizer;
  mixprec::GradScaler scaler;
  double scale = 2.0;
};

/// Refuses to time a variant that does not compute what it claims: each of them multiplies the
/// gradients by 0.5 or 2, and the next run undoes it.
void check_variant(const bench::Variant& variant, const std::vector<at::Tensor>& grads) {
  const auto before = grads.front().clone();
  variant.run();
  const bool scaled = grads.front().equal(before * 0.5) || grads.front().equal(before * 2.0);
  variant.run();
  const bool restored = grads.front().equal(before);
  if (!scaled || !restored) {
    std::fprintf(stderr, "bench_scaler: variant '%s' computes the wrong values\n",
                 variant.name.c_str());
    std::exit(1);
  }
}

struct Floors {
  bench::Variant foreach_mul;
  bench::Variant loop_mul;
};

Floors make_floors(const std::vector<at::Tensor>& grads, Alternating& a, Alternating& b) {
  return {{"floor: at::_foreach_mul_", [&grads, &a] { at::_foreach_mul_(grads, a.next()); }},
          {"floor: loop of mul_", [&grads, &b] {
             const double f = b.next();
             for (const auto& g : grads) g.mul_(f);
           }}};
}

/// The table of one dtype; the faster of the two floors becomes the baseline (first row).
/// Returns whether that is _foreach_mul_.
bool main_table(at::ScalarType dtype, std::int64_t count, std::int64_t per_tensor,
                      const bench::Options& options) {
  auto g = make_grads(count, per_tensor, dtype);
  Alternating fa;
  Alternating fb;
  Alternating fn;
  auto floors = make_floors(g.grads, fa, fb);
  ScalerRun scaler_run(g.params);
  bench::Variant mixprec{"mixprec: GradScaler::unscale_", [&scaler_run] { scaler_run(); }};
  bench::Variant naive{"naive: isfinite().all().item() + mul_, per tensor", [&g, &fn] {
                         const double inv = fn.next();
                         bool found = false;
                         for (const auto& grad : g.grads) {
                           found |= !at::isfinite(grad).all().item<bool>();
                           grad.mul_(inv);
                         }
                         if (found) std::abort();  // the data is finite: never taken
                       }};
  std::vector<bench::Variant> variants{floors.foreach_mul, floors.loop_mul, mixprec, naive};
  for (const auto& v : variants) check_variant(v, g.grads);
  auto ms = bench::interleaved_samples(variants, options);

  const bool foreach_faster = bench::median(ms[0]) <= bench::median(ms[1]);
  if (!foreach_faster) {
    std::swap(variants[0], variants[1]);
    std::swap(ms[0], ms[1]);
  }
  const auto title = "Unscale + non-finite check, " + dtype_name(dtype) + " grads: " +
                     elements_name(count * per_tensor) + " elements in " + std::to_string(count) +
                     " tensors of " + elements_name(per_tensor) + ", " +
                     "intra-op threads " + std::to_string(at::get_num_threads());
  bench::print_table(title, variants, ms);
  const double bytes = static_cast<double>(count * per_tensor) *
                       static_cast<double>(2 * at::elementSize(dtype));  // one read, one write
  const double vs_floor = bench::paired_ratio(ms[2], ms[0]).median;
  const double vs_naive = bench::paired_ratio(ms[3], ms[2]).median;
  std::printf("\nFloor: %s (the other floor: %.2fx), %.1f GB/s (one read and one write). "
              "mixprec / floor = %.2fx (target <= 1.2x: %s); naive / mixprec = %.1fx (target "
              ">= 10x: %s).\n",
              foreach_faster ? "`at::_foreach_mul_`" : "a loop of `mul_`",
              bench::paired_ratio(ms[1], ms[0]).median, bytes / (bench::median(ms[0]) * 1e6),
              vs_floor, vs_floor <= 1.2 ? "met" : "MISSED", vs_naive,
              vs_naive >= 10.0 ? "met" : "MISSED");
  return foreach_faster;
}

/// mixprec against the floor at growing sizes: the ratio and ns per element should stay flat.
void scaling_table(const std::vector<std::int64_t>& totals, std::int64_t per_tensor,
                   bool use_foreach, const bench::Options& options) {
  std::printf("\n### Unscale scaling, fp32 grads in tensors of %s elements, intra-op threads %d\n\n"
              "| total elements | tensors | floor ms | mixprec ms | ratio to floor | ratio IQR | "
              "floor ns/element | mixprec ns/element |\n"
              "|---:|---:|---:|---:|---:|---:|---:|---:|\n",
              elements_name(per_tensor).c_str(), at::get_num_threads());
  for (const auto total : totals) {
    const auto count = total / per_tensor;
    auto g = make_grads(count, per_tensor, at::kFloat);
    Alternating fa;
    Alternating fb;
    auto floors = make_floors(g.grads, fa, fb);
    ScalerRun scaler_run(g.params);
    std::vector<bench::Variant> variants{
        use_foreach ? floors.foreach_mul : floors.loop_mul,
        {"mixprec: GradScaler::unscale_", [&scaler_run] { scaler_run(); }}};
    for (const auto& v : variants) check_variant(v, g.grads);
    auto opts = options;
    if (!options.smoke) {  // small sizes are quick and noisier: more repetitions, up to 101
      const auto more = options.repetitions * std::max<std::int64_t>(1, 64 * kMi / total);
      opts.repetitions = static_cast<int>(std::min<std::int64_t>(101, more));
    }
    const auto ms = bench::interleaved_samples(variants, opts);
    const double floor_ms = bench::median(ms[0]);
    const double mixprec_ms = bench::median(ms[1]);
    const auto ratio = bench::paired_ratio(ms[1], ms[0]);
    const double n = static_cast<double>(total);
    std::printf("| %s | %lld | %.3f | %.3f | %.2f | %s | %.3f | %.3f |\n",
                elements_name(total).c_str(), static_cast<long long>(count), floor_ms, mixprec_ms,
                ratio.median, bench::iqr(ratio, 2).c_str(), floor_ms * 1e6 / n,
                mixprec_ms * 1e6 / n);
    std::fflush(stdout);
  }
  std::printf("\nFloor: %s, as in the first table.%s The smaller sizes fit in the CPU caches "
              "(4M fp32 = 16 MiB).\n",
              use_foreach ? "`at::_foreach_mul_`" : "a loop of `mul_`",
              options.smoke ? "" : " Below 64M, more repetitions (up to 101).");
}

/// ATen's CPU kernel (LibTorch >= 2.3) against mixprec's pass, at 1 and 2 intra-op threads;
/// and what keeping mixprec's check of the outputs would cost on ATen's path: a second,
/// checking pass, needed only while the scale is below 1.
void aten_table(at::ScalarType dtype, std::int64_t count, std::int64_t per_tensor,
                const bench::Options& options) {
#if MIXPREC_TORCH_AT_LEAST(2, 3)
  const int threads_before = at::get_num_threads();
  for (const int threads : {1, 2}) {
    at::set_num_threads(threads);
    auto g = make_grads(count, per_tensor, dtype);
    Alternating fa;
    Alternating fb;
    ScalerRun scaler_run(g.params);
    auto found = at::zeros({}, at::kFloat);
    bench::Variant aten{"ATen: _amp_foreach_non_finite_check_and_unscale_", [&] {
                          at::_amp_foreach_non_finite_check_and_unscale_(
                              g.grads, found, at::full({}, fa.next(), at::kFloat));
                        }};
    bench::Variant mixprec{"mixprec: GradScaler::unscale_", [&scaler_run] { scaler_run(); }};
    bench::Variant checked{"ATen + a check of its outputs (the scale < 1 case)", [&] {
                             at::_amp_foreach_non_finite_check_and_unscale_(
                                 g.grads, found, at::full({}, fb.next(), at::kFloat));
                             at::_amp_foreach_non_finite_check_and_unscale_(g.grads, found, at::ones({}));
                           }};
    std::vector<bench::Variant> variants{aten, mixprec, checked};
    for (const auto& v : variants) check_variant(v, g.grads);
    const auto ms = bench::interleaved_samples(variants, options);
    if (found.item<float>() != 0.0F) std::abort();  // the data is finite
    bench::print_table("ATen's AMP kernel vs mixprec's pass, " + dtype_name(dtype) + " grads: " +
                           elements_name(count * per_tensor) + " elements, intra-op threads " +
                           std::to_string(threads),
                       variants, ms);
    std::printf("\nmixprec / ATen = %.2fx; ATen with the output check / ATen = %.2fx.\n",
                bench::paired_ratio(ms[1], ms[0]).median, bench::paired_ratio(ms[2], ms[0]).median);
  }
  at::set_num_threads(threads_before);
#else
  (void)dtype, (void)count, (void)per_tensor, (void)options;
  std::printf("\n### ATen's AMP kernel vs mixprec's pass\n\nLibTorch %s has no CPU kernel for "
              "`_amp_foreach_non_finite_check_and_unscale_` (it came in 2.3): mixprec's pass is "
              "the CPU path.\n", TORCH_VERSION);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const auto options = bench::parse_options(argc, argv);
  const std::int64_t count = options.smoke ? 8 : 256;
  const std::int64_t per_tensor = options.smoke ? 128 * 1024 : 256 * 1024;

  std::printf("## bench_scaler: GradScaler::unscale_ (unscale + inf/NaN check)\n\n"
              "Gradients of SGD parameters; each variant multiplies them by 0.5 and 2 in turn. "
              "%s\n",
              bench::method(options).c_str());
  const bool foreach_faster = main_table(at::kFloat, count, per_tensor, options);
  (void)main_table(at::kBFloat16, count, per_tensor, options);
  aten_table(at::kFloat, count, per_tensor, options);
  aten_table(at::kBFloat16, count, per_tensor, options);

  const std::vector<std::int64_t> totals =
      options.smoke ? std::vector<std::int64_t>{kMi / 4, kMi}
                    : std::vector<std::int64_t>{kMi, 4 * kMi, 16 * kMi, 64 * kMi, 100 * kMi};
  scaling_table(totals, options.smoke ? 32 * 1024 : per_tensor, foreach_faster, options);

  std::printf("\nCommand: `./build/default/benchmarks/bench_scaler`\n");
  return 0;
}

}  // namespace bench_scaler
