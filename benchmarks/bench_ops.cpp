// mixprec::ops::masked_softmax against the composite LibTorch users write by hand,
// softmax(x.masked_fill(~mask, lowest)), on fp32 attention scores [batch, heads, queries, keys]
// with a key-padding mask [batch, 1, 1, keys].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdio>
#include <harness.hpp>
#include <limits>
#include <mixprec/ops/masked_ops.hpp>
#include <string>
#include <vector>

namespace bench_ops {

namespace {

struct Shape {
  int64_t batch, heads, queries, keys;
};

// Lengths in [1, keys]; with `empty_sequence` the first sequence has length 0, so its rows are
// fully masked (the composite makes them uniform, mixprec zeros).
at::Tensor key_padding_mask(const Shape& s, bool empty_sequence) {
  auto lengths = at::randint(1, s.keys + 1, {s.batch});
  if (empty_sequence) {
    lengths[0] = 0;
  }
  return (at::arange(s.keys).view({1, s.keys}) < lengths.view({s.batch, 1}))
      .view({s.batch, 1, 1, s.keys});
}

at::Tensor composite(const at::Tensor& x, const at::Tensor& mask) {
  return at::softmax(x.masked_fill(~mask, std::numeric_limits<float>::lowest()), -1);
}

// The timings mean nothing if the results differ: same bits, except in fully masked rows.
bool same_results(const at::Tensor& x, const at::Tensor& mask) {
  at::NoGradGuard no_grad;
  const auto expected = composite(x, mask).masked_fill(~mask.any(-1, true), 0);
  return at::equal(mixprec::ops::masked_softmax(x, mask), expected);
}

// `repeat` calls per sample keep millisecond-sized samples above the timer's and the machine's
// noise.
bool run_table(const std::string& title, const Shape& s, bool empty_sequence, bool backward,
               int repeat, const bench::Options& options) {
  const auto x = at::randn({s.batch, s.heads, s.queries, s.keys});
  const auto mask = key_padding_mask(s, empty_sequence);
  if (!same_results(x, mask)) {
    std::fprintf(stderr, "bench_ops: masked_softmax differs from the composite (%s)\n",
                 title.c_str());
    return false;
  }
  const auto xg = x.clone().requires_grad_(backward);
  const auto grad = at::randn_like(x);
  at::Tensor sink;
  auto run = [&](auto&& softmax) {
    return [&, softmax] {
      for (int i = 0; i < repeat; ++i) {
        if (backward) {
          auto y = softmax();
          y.backward(grad);
          xg.mutable_grad().reset();
        } else {
          at::NoGradGuard no_grad;
          sink = softmax();
        }
      }
    };
  };
  std::vector<bench::Variant> variants{
      {"LibTorch masked_fill + softmax", run([&] { return composite(xg, mask); })},
      {"mixprec masked_softmax", run([&] { return mixprec::ops::masked_softmax(xg, mask); })},
      {"mixprec masked_softmax (memory_efficient)",
       run([&] { return mixprec::ops::masked_softmax(xg, mask, -1, true); })},
  };
  bench::print_table(title, variants, bench::interleaved_samples(variants, options));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const auto options = bench::parse_options(argc, argv);
  at::manual_seed(0);
  std::printf(
      "## bench_ops: masked_softmax against the LibTorch composite\n\n"
      "`at::softmax(x.masked_fill(~mask, lowest), -1)` versus `mixprec::ops::masked_softmax(x, "
      "mask)` on fp32 attention scores, key-padding mask [batch, 1, 1, keys]; results checked "
      "bitwise equal (fully masked rows aside) before timing. %d intra-op thread(s). %s\n",
      at::get_num_threads(), bench::method(options).c_str());
  const Shape shape = options.smoke ? Shape{2, 2, 8, 8} : Shape{32, 8, 256, 256};
  // 4 MiB per tensor: below glibc's mmap threshold, so freed buffers are reused without page
  // faults, which is where the composite loses most of its time at the large shape.
  const Shape small = options.smoke ? Shape{2, 2, 4, 4} : Shape{8, 8, 128, 128};
  const auto dims = [](const Shape& s) {
    char buffer[96];
    std::snprintf(buffer, sizeof buffer, "[%lld, %lld, %lld, %lld]",
                  static_cast<long long>(s.batch), static_cast<long long>(s.heads),
                  static_cast<long long>(s.queries), static_cast<long long>(s.keys));
    return std::string(buffer);
  };
  const bool ok =
      run_table("masked_softmax fp32 " + dims(shape) + ", key-padding mask, inference", shape,
                false, false, 1, options) &&
      run_table("masked_softmax fp32 " + dims(shape) + ", key-padding mask, forward + backward",
                shape, false, true, 1, options) &&
      run_table("masked_softmax fp32 " + dims(shape) + ", one fully masked sequence, inference",
                shape, true, false, 1, options) &&
      run_table("masked_softmax fp32 " + dims(small) + ", key-padding mask, inference (x20)", small,
                false, false, 20, options) &&
      run_table(
          "masked_softmax fp32 " + dims(small) + ", key-padding mask, forward + backward (x20)",
          small, false, true, 20, options);
  std::printf("\nCommand: `");
  for (int i = 0; i < argc; ++i) {
    std::printf(i == 0 ? "%s" : " %s", argv[i]);
  }
  std::printf("`\n");
  return ok ? 0 : 1;
}

}  // namespace bench_ops
