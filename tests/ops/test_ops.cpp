// mixprec::ops: values against a per-row reference (the op applied to the kept entries only) in
// fp32, fp64, Half and BFloat16; masked entries that never matter; fully masked rows; finite
// gradients; the output dtype per policy; the fp32-era constants; the errors.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <mixprec/core/autocast.hpp>
#include <mixprec/core/compat.hpp>
#include <mixprec/ops/masked_ops.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace test_ops {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;
namespace ops = mixprec::ops;

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

// What anomaly detection throws: the engine rethrows it as a std::runtime_error in 1.13.
#if MIXPREC_TORCH_AT_LEAST(2, 0)
using AnomalyError = c10::Error;
#else
using AnomalyError = std::runtime_error;
#endif
constexpr double not_a_number = std::numeric_limits<double>::quiet_NaN();

const std::vector<at::ScalarType> float_dtypes{at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};

double epsilon_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf:
      return std::ldexp(1.0, -10);
    case at::kBFloat16:
      return std::ldexp(1.0, -7);
    case at::kFloat:
      return std::ldexp(1.0, -23);
    default:
      return std::ldexp(1.0, -52);
  }
}

bool all_finite(const at::Tensor& t) { return at::isfinite(t).all().item<bool>(); }

// How far |actual - expected| exceeds what an op computed in fp32 (fp64 for fp64 output) and
// rounded once to the output dtype may be off: 8 eps of the computation (1 + |expected|), plus
// half an ulp of the output dtype (0.5 eps |expected|). Positive: too far. An op computed in bf16
// (several roundings), or fp64 computed through fp32, exceeds it.
double excess_error(const at::Tensor& actual, const at::Tensor& expected) {
  const auto output = actual.scalar_type();
  const double compute = epsilon_of(output == at::kDouble ? at::kDouble : at::kFloat);
  const auto a = actual.detach().to(at::kDouble);
  const auto e = expected.detach().to(at::kDouble);
  const auto tolerance = 8 * compute * (1 + e.abs()) + 0.5 * epsilon_of(output) * e.abs();
  return ((a - e).abs() - tolerance).max().item<double>();
}

// `expected` is computed in fp64 from the inputs as the op saw them (rounded to their dtype).
void check_close(const at::Tensor& actual, const at::Tensor& expected) {
  REQUIRE(actual.sizes() == expected.sizes());
  INFO("actual ", actual, "\nexpected ", expected.to(at::kDouble));
  CHECK(excess_error(actual, expected) <= 0);
}

// The masked rows used throughout: a partial row, a full row, an empty row, a single entry,
// then 60 random rows, enough for a result rounded twice to show up against the tolerance.
at::Tensor row_mask() {
  at::manual_seed(6);
  const auto special = at::tensor({1, 0, 1, 1, 0, 1,  //
                                   1, 1, 1, 1, 1, 1,  //
                                   0, 0, 0, 0, 0, 0,  //
                                   0, 0, 0, 1, 0, 0})
                           .view({4, 6})
                           .to(at::kBool);
  return at::cat({special, at::rand({60, 6}) > 0.3});
}

// Values exact in every dtype (multiples of 1/8 below 32), so all dtypes see the same input.
at::Tensor row_values() {
  at::manual_seed(5);
  return ((at::randn({64, 6}) * 16).round() / 8).clamp(-31, 31);
}

at::ScalarType expected_output(bool autocast, at::ScalarType input) {
  const bool reduced = input == at::kHalf || input == at::kBFloat16;
  return autocast && reduced ? at::kFloat : input;
}

/// A masked op along dim 1 of a [rows, n] vector, with what it means on the kept entries.
struct MaskedOp {
  std::string name;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> run;
  std::function<at::Tensor(const at::Tensor&)> on_kept;  // on one row's kept entries (1-D)
  bool reduces;                                          // one value per row
  double masked;     // elementwise ops: the value of a masked entry
  double empty_row;  // every value of a fully masked row; NaN means uniform (1 / n)
};

template <class P>
std::vector<MaskedOp> masked_ops(at::ScalarType dtype) {
  const double lowest = ops::min_value_of_dtype(dtype);
  const double lowest_out = ops::min_value_of_dtype(expected_output(P::autocast, dtype));
  using T = const at::Tensor&;
  return {
      {"masked_softmax", [](T x, T m) { return ops::masked_softmax<P>(x, m, 1); },
       [](T k) { return at::softmax(k, 0); }, false, 0.0, 0.0},
      {"masked_softmax(memory_efficient)",
       [](T x, T m) { return ops::masked_softmax<P>(x, m, 1, true); },
       [](T k) { return at::softmax(k, 0); }, false, 0.0, not_a_number},
      {"masked_log_softmax", [](T x, T m) { return ops::masked_log_softmax<P>(x, m, 1); },
       [](T k) { return at::log_softmax(k, 0); }, false, lowest_out, lowest_out},
      {"masked_max", [](T x, T m) { return ops::masked_max<P>(x, m, 1); },
       [](T k) { return k.amax(0); }, true, 0.0, lowest},
      {"masked_mean", [](T x, T m) { return ops::masked_mean<P>(x, m, 1); },
       [](T k) { return k.mean(); }, true, 0.0, 0.0},
      {"logsumexp", [](T x, T m) { return ops::logsumexp<P>(x, m, 1); },
       [](T k) { return at::logsumexp(k, 0); }, true, 0.0, 0.0},
      {"replace_masked_values", [](T x, T m) { return ops::replace_masked_values<P>(x, m, -3.5); },
       [](T k) { return k; }, false, -3.5, -3.5},
  };
}

// The op's meaning computed another way: compaction instead of masking. Differentiable.
at::Tensor per_row_reference(const MaskedOp& op, const at::Tensor& x, const at::Tensor& keep) {
  const int64_t n = x.size(1);
  std::vector<at::Tensor> rows;
  for (int64_t r = 0; r < x.size(0); ++r) {
    const auto index = keep[r].nonzero().squeeze(1);
    if (index.numel() == 0) {
      const double value = std::isnan(op.empty_row) ? 1.0 / static_cast<double>(n) : op.empty_row;
      rows.push_back(op.reduces ? at::full({}, value, x.options())
                                : at::full({n}, value, x.options()));
    } else {
      const auto kept = op.on_kept(x[r].index_select(0, index));
      rows.push_back(op.reduces ? kept
                                : at::full({n}, op.masked, x.options()).index_copy(0, index, kept));
    }
  }
  return at::stack(rows);
}

}  // namespace

TEST_CASE("dtype constants: exact values, and each survives a round trip through its dtype") {
  struct Row {
    at::ScalarType dtype;
    double min, max, tiny;
  };
  const std::vector<Row> rows{
      {at::kHalf, -65504.0, 65504.0, 6.103515625e-05},
      {at::kBFloat16, -3.3895313892515355e38, 3.3895313892515355e38, 1.1754943508222875e-38},
      {at::kFloat, -3.4028234663852886e38, 3.4028234663852886e38, 1.1754943508222875e-38},
      {at::kDouble, -1.7976931348623157e308, 1.7976931348623157e308, 2.2250738585072014e-308},
  };
  for (const auto& row : rows) {
    INFO(std::string(c10::toString(row.dtype)));
    CHECK(ops::min_value_of_dtype(row.dtype) == row.min);
    CHECK(ops::max_value_of_dtype(row.dtype) == row.max);
    CHECK(ops::tiny_value_of_dtype(row.dtype) == row.tiny);
    for (const double value : {row.min, row.max, row.tiny}) {
      CHECK(at::full({}, value, at::kDouble).to(row.dtype).item<double>() == value);
    }
  }
  CHECK(ops::min_value_of_dtype(at::kByte) == 0);
  CHECK(ops::max_value_of_dtype(at::kByte) == 255);
  CHECK(ops::min_value_of_dtype(at::kChar) == -128);
  CHECK(ops::max_value_of_dtype(at::kShort) == 32767);
  CHECK(ops::min_value_of_dtype(at::kInt) == -2147483648.0);
  CHECK(ops::max_value_of_dtype(at::kInt) == 2147483647.0);
  CHECK(ops::min_value_of_dtype(at::kLong) == -9223372036854775808.0);
  // 2^63 - 1 is no double; the largest double below it converts back without overflow.
  CHECK(ops::max_value_of_dtype(at::kLong) == 9223372036854774784.0);
  CHECK(at::full({}, ops::max_value_of_dtype(at::kLong), at::kLong).item<int64_t>() ==
        9223372036854774784LL);

  CHECK_THROWS_WITH_AS(ops::min_value_of_dtype(at::kBool),
                       doctest::Contains("min_value_of_dtype: Bool is not supported"), mp::Error);
  CHECK_THROWS_WITH_AS(ops::max_value_of_dtype(at::kBool),
                       doctest::Contains("max_value_of_dtype: Bool is not supported"), mp::Error);
  CHECK_THROWS_WITH_AS(ops::max_value_of_dtype(at::kComplexFloat),
                       doctest::Contains("is not supported"), mp::Error);
  CHECK_THROWS_WITH_AS(ops::tiny_value_of_dtype(at::kLong),
                       doctest::Contains("defined for Half, BFloat16, Float and Double"),
                       mp::Error);
  CHECK_THROWS_AS(ops::tiny_value_of_dtype(at::kBool), mp::Error);
}

TEST_CASE("regression: the fp32-era constants are what break fp16") {
  const auto to_half = [](double value) {
    return at::full({}, value, at::kDouble).to(at::kHalf).item<double>();
  };
  // Additive "tiny" epsilons vanish; "very negative" fill values overflow.
  CHECK(to_half(1e-13) == 0);
  CHECK(to_half(1e-45) == 0);
  CHECK(static_cast<float>(1e-45) > 0);  // ...while fp32 still keeps it (as a subnormal)
  for (const double big : {-1e32, -1e20, -1e7}) {
    CHECK(to_half(big) == -inf);
  }
  CHECK(at::full({}, 1e-45, at::kDouble).to(at::kBFloat16).item<double>() == 0);

  // A fully masked row in fp16 through the old formulas. LibTorch 1.13 has no CPU Half exp, log
  // or softmax: they run in fp32 and round back to fp16 after each step, as a GPU's fp16 would.
  const auto vector = at::tensor({1.0, 2.0, 3.0}).to(at::kHalf).view({1, 3});
  const auto mask = at::zeros({1, 3}, at::kBool);
  const auto m = mask.to(at::kHalf);
  const auto half_const = [](double value) { return at::full({}, value).to(at::kHalf); };
  const auto half_log = [](const at::Tensor& x) { return x.to(at::kFloat).log().to(at::kHalf); };
  const auto softmax = [](const at::Tensor& x) {
    const auto e = (x - x.amax(-1, true)).to(at::kFloat).exp().to(at::kHalf);
    return e / e.sum(-1, true);
  };
  // masked_log_softmax: vector + log(mask + 1e-13). The sum is 0 in fp16, so its log is -inf
  // everywhere, then x - max is NaN.
  const auto sum = m + half_const(1e-13);
  CHECK(at::equal(sum, at::zeros_like(sum)));
  const auto shifted = vector + half_log(sum);
  CHECK(at::isnan(shifted - shifted.amax(-1, true)).all().item<bool>());
  // masked_softmax: softmax(v * m) * m / (sum + 1e-13) = 0 / 0.
  const auto product = softmax(vector * m) * m;
  CHECK(at::isnan(product / (product.sum(-1, true) + half_const(1e-13))).all().item<bool>());
  // memory-efficient masked_softmax: v + (1 - m) * -1e32 is -inf everywhere, softmax NaN.
  for (const double big : {-1e32, -1e20, -1e7}) {
    CHECK(at::isnan(softmax(vector + (1 - m) * half_const(big))).all().item<bool>());
  }
  // LibTorch's own masked_fill refuses such a value for Half (a crash, which is fine)...
  // (c10's report_overflow throws a std::runtime_error, not a c10::Error.)
  CHECK_THROWS_WITH_AS(vector.masked_fill(mask.logical_not(), -1e32),
                       doctest::Contains("without overflow"), std::runtime_error);

  // ...and none of the ops uses them: the same fully masked row gives zeros (max: fp16's lowest).
  CHECK(at::equal(ops::masked_softmax(vector, mask), at::zeros({1, 3}, at::kHalf)));
  CHECK(
      at::equal(ops::masked_softmax(vector, mask, -1, true), at::full({1, 3}, 1.0 / 3, at::kHalf)));
  CHECK(at::equal(ops::masked_log_softmax(vector, mask), at::full({1, 3}, -65504.0, at::kHalf)));
  CHECK(at::equal(ops::masked_mean(vector, mask, 1), at::zeros({1}, at::kHalf)));
  CHECK(at::equal(ops::logsumexp(vector, mask, 1), at::zeros({1}, at::kHalf)));
  CHECK(ops::masked_max(vector, mask, 1).item<double>() == -65504.0);
  CHECK_THROWS_WITH_AS(ops::replace_masked_values(vector, mask, -1e32),
                       doctest::Contains("outside Half's finite range"), mp::Error);
}

TEST_CASE("every masked op matches its per-row reference, values and gradients, in 4 dtypes") {
  const auto keep = row_mask();
  for (const auto dtype : float_dtypes) {
    for (const auto& op : masked_ops<mp::FullPrecision>(dtype)) {
      INFO(op.name);
      INFO(std::string(c10::toString(dtype)));
      const auto x = row_values().to(dtype).requires_grad_();
      const auto y = op.run(x, keep);
      CHECK(y.scalar_type() == dtype);
      CHECK(all_finite(y));
      const auto x_ref = x.detach().to(at::kDouble).requires_grad_();
      const auto y_ref = per_row_reference(op, x_ref, keep);
      check_close(y, y_ref);
      // The fully masked row is exact: zeros, the uniform 1/6, or the dtype's lowest.
      CHECK(at::equal(y[2], y_ref[2].detach().to(dtype)));

      const auto grad = (at::randn(y.sizes()) * 4).round().to(dtype);
      y.backward(grad);
      y_ref.backward(grad.to(at::kDouble));
      REQUIRE(x.grad().defined());
      CHECK(all_finite(x.grad()));
      CHECK(at::equal(x.grad().masked_select(keep.logical_not()),
                      at::zeros({keep.logical_not().sum().item<int64_t>()}, dtype)));
      check_close(x.grad(), x_ref.grad());
    }
  }
}

TEST_CASE("masked entries never influence values or gradients, whatever they hold") {
  const auto keep = row_mask();
  // 1e5 is inf in fp16 and -1e32 is -inf there: padding may carry anything.
  for (const auto dtype : float_dtypes) {
    for (const auto& op : masked_ops<mp::FullPrecision>(dtype)) {
      INFO(op.name);
      INFO(std::string(c10::toString(dtype)));
      const auto grad = (at::randn(op.run(row_values(), keep).sizes()) * 4).round().to(dtype);
      at::Tensor clean_y, clean_grad;
      for (const double garbage : {0.0, 1e5, -1e32, inf, -inf, not_a_number, 7.0}) {
        INFO("masked entries hold ", garbage);
        const auto x =
            row_values().masked_fill(keep.logical_not(), garbage).to(dtype).requires_grad_();
        const auto y = op.run(x, keep);
        y.backward(grad);
        CHECK(all_finite(y));
        CHECK(all_finite(x.grad()));
        if (!clean_y.defined()) {
          clean_y = y.detach();
          clean_grad = x.grad();
        } else {
          CHECK(at::equal(y, clean_y));  // bitwise
          CHECK(at::equal(x.grad(), clean_grad));
        }
      }
    }
  }
}

TEST_CASE("no NaN even inside backward: anomaly detection stays quiet") {
  torch::autograd::DetectAnomalyGuard anomaly;  // throws if any backward node returns NaN
  {
    // It would catch the -inf composite on a fully masked row:
    const auto x = at::zeros({1, 3}).requires_grad_();
    const auto y = at::softmax(x.masked_fill(at::ones({1, 3}, at::kBool), -inf), -1);
    CHECK_THROWS_WITH_AS(y.backward(at::ones_like(y)), doctest::Contains("returned nan values"),
                         AnomalyError);
  }
  const auto keep = row_mask();
  for (const auto dtype : float_dtypes) {
    INFO(std::string(c10::toString(dtype)));
    for (const auto& op : masked_ops<mp::FullPrecision>(dtype)) {
      INFO(op.name);
      const auto x = row_values()
                         .masked_fill(keep.logical_not(), not_a_number)
                         .to(dtype)
                         .requires_grad_();
      const auto y = op.run(x, keep);
      CHECK_NOTHROW(y.backward(at::ones_like(y)));
    }
    const auto logits = at::randn({2, 3, 4}).masked_fill(at::tensor({1, 0, 1, 0, 0, 0})
                                                             .view({2, 3, 1})
                                                             .to(at::kBool),
                                                         inf);
    const auto leaf = logits.to(dtype).requires_grad_();
    const auto weights = at::tensor({0, 1, 0, 0, 0, 0}).view({2, 3}).to(at::kBool);
    const auto loss = ops::sequence_cross_entropy_with_logits(leaf, at::zeros({2, 3}, at::kLong),
                                                              weights, ops::Average::batch, 0.1);
    CHECK_NOTHROW(loss.backward());
  }
}

TEST_CASE("exact results where the arithmetic is exact") {
  for (const auto dtype : float_dtypes) {
    INFO(std::string(c10::toString(dtype)));
    const auto x = at::tensor({1.0, 1e5, 1.0, 1.0, -inf, 1.0}).to(dtype).view({1, 6});
    const auto keep = at::tensor({1, 0, 1, 1, 0, 1}).view({1, 6}).to(at::kBool);
    CHECK(at::equal(ops::masked_softmax(x, keep),
                    at::tensor({0.25, 0.0, 0.25, 0.25, 0.0, 0.25}).to(dtype).view({1, 6})));
    const auto y = at::tensor({1.0, 1e5, 2.0, 3.0, inf, 2.0}).to(dtype).view({1, 6});
    CHECK(ops::masked_mean(y, keep, 1).item<double>() == 2.0);  // 8 / 4
    CHECK(ops::masked_max(y, keep, 1).item<double>() == 3.0);
    CHECK(at::equal(ops::replace_masked_values(y, keep, 0.5),
                    at::tensor({1.0, 0.5, 2.0, 3.0, 0.5, 2.0}).to(dtype).view({1, 6})));
    // Uniform rows: log_softmax and logsumexp are -log 4 and log 4, to the last bit of fp32.
    check_close(ops::masked_log_softmax(x, keep).masked_select(keep),
                at::full({4}, -std::log(4.0), at::kDouble));
    check_close(ops::logsumexp(x, keep, 1), at::full({1}, 1.0 + std::log(4.0), at::kDouble));
  }
  // Integer vectors: masked_max works, an empty row gives the integer dtype's minimum.
  const auto ints = at::tensor({3, 9, 4, 7}, at::kInt).view({2, 2});
  const auto keep = at::tensor({1, 0, 0, 0}).view({2, 2}).to(at::kBool);
  CHECK(at::equal(ops::masked_max(ints, keep, 1),
                  at::tensor(std::vector<int64_t>{3, -2147483648LL}).to(at::kInt)));
}

TEST_CASE("fully masked rows and empty dimensions") {
  for (const auto dtype : float_dtypes) {
    INFO(std::string(c10::toString(dtype)));
    const auto x = at::randn({2, 3, 4}).to(dtype);
    const auto none = at::zeros({2, 3, 4}, at::kBool);
    CHECK(at::equal(ops::masked_softmax(x, none), at::zeros_like(x)));
    CHECK(at::equal(ops::masked_softmax(x, none, 1, true), at::full_like(x, 1.0 / 3)));
    CHECK(at::equal(ops::masked_log_softmax(x, none, 0),
                    at::full_like(x, ops::min_value_of_dtype(dtype))));
    CHECK(at::equal(ops::masked_mean(x, none, 2, true), at::zeros({2, 3, 1}, dtype)));
    CHECK(at::equal(ops::logsumexp(x, none, 1), at::zeros({2, 4}, dtype)));
    CHECK(at::equal(ops::masked_max(x, none, 1),
                    at::full({2, 4}, ops::min_value_of_dtype(dtype), dtype)));
    // Under MixedO1 the output is fp32 but an empty max is still the input dtype's lowest, which
    // stays finite when cast back down.
    CHECK(ops::masked_max<mp::MixedO1<at::BFloat16>>(x, none, 1)[0][0].item<double>() ==
          ops::min_value_of_dtype(dtype));

    // An empty dimension is a fully masked row.
    const auto empty = at::randn({2, 0}).to(dtype).requires_grad_();
    const auto keep = at::ones({2, 0}, at::kBool);
    CHECK(ops::masked_softmax(empty, keep).sizes() == empty.sizes());
    CHECK(at::equal(ops::masked_mean(empty, keep, 1), at::zeros({2}, dtype)));
    CHECK(at::equal(ops::logsumexp(empty, keep, 1), at::zeros({2}, dtype)));
    CHECK(at::equal(ops::logsumexp(empty, 1), at::zeros({2}, dtype)));
    // A mask of size 1 along the empty dim (found by tests/fuzz): still no entry to keep.
    const auto keep_rows = at::ones({2, 1}, at::kBool);
    CHECK(at::equal(ops::logsumexp(empty, keep_rows, 1), at::zeros({2}, dtype)));
    CHECK(at::equal(ops::logsumexp(empty, keep_rows, 1, true), at::zeros({2, 1}, dtype)));
    CHECK(at::equal(ops::masked_mean(empty, keep_rows, 1), at::zeros({2}, dtype)));
    CHECK(at::equal(ops::masked_max(empty, keep_rows, 1),
                    at::full({2}, ops::min_value_of_dtype(dtype), dtype)));
    const auto max = ops::masked_max(empty, keep, 1, true);
    CHECK(at::equal(max, at::full({2, 1}, ops::min_value_of_dtype(dtype), dtype)));
    max.sum().backward();
    CHECK(empty.grad().sizes() == empty.sizes());
  }
}

TEST_CASE("mask broadcasting: trailing size-1 dimensions, attention masks, size-1 rows") {
  at::manual_seed(1);
  // [batch, seq] mask of a [batch, seq, features] vector: one mask entry per position.
  const auto states = at::randn({2, 5, 3});
  const auto tokens = at::tensor({1, 1, 0, 1, 0, 0, 0, 0, 0, 0}).view({2, 5}).to(at::kBool);
  CHECK(at::equal(ops::masked_mean(states, tokens, 1),
                  ops::masked_mean(states, tokens.unsqueeze(-1), 1)));
  check_close(ops::masked_mean(states, tokens, 1)[0],
              states[0].index_select(0, at::tensor({0, 1, 3})).mean(0));
  CHECK(at::equal(ops::masked_max(states, tokens, 1),
                  ops::masked_max(states, tokens.unsqueeze(-1), 1)));

  // Attention scores [batch, heads, queries, keys] with a key-padding mask [batch, 1, 1, keys]:
  // the per-row reference on the flattened rows.
  const auto scores = at::randn({2, 3, 4, 5});
  const auto key_mask = at::tensor({1, 1, 1, 0, 0, 1, 0, 1, 1, 1}).view({2, 1, 1, 5}).to(at::kBool);
  const auto op = masked_ops<mp::FullPrecision>(at::kFloat)[0];
  const auto flat_keep = key_mask.expand({2, 3, 4, 5}).reshape({24, 5});
  check_close(ops::masked_softmax(scores, key_mask).reshape({24, 5}),
              per_row_reference(op, scores.reshape({24, 5}).to(at::kDouble), flat_keep));
  // Along a leading dimension: the same as transposing (up to LibTorch's summation order).
  check_close(
      ops::masked_softmax(scores, key_mask.expand({2, 3, 4, 5}), 0),
      ops::masked_softmax(scores.transpose(0, 3), key_mask.expand({2, 3, 4, 5}).transpose(0, 3))
          .transpose(0, 3));

  // A mask of size 1 along dim keeps or drops whole rows, and counts every entry.
  const auto x = at::tensor({1.0, 2.0, 3.0, 6.0, 5.0, 4.0}).view({2, 3});
  const auto rows = at::tensor({0, 1}).view({2, 1}).to(at::kBool);
  CHECK(at::equal(ops::masked_mean(x, rows, 1), at::tensor({0.0f, 5.0f})));
  CHECK(at::equal(ops::masked_softmax(x, rows)[0], at::zeros({3})));

  // 0/1 numeric masks work like bool ones.
  CHECK(at::equal(ops::masked_softmax(scores, key_mask.to(at::kFloat)),
                  ops::masked_softmax(scores, key_mask)));
  CHECK(at::equal(ops::masked_mean(states, tokens.to(at::kLong), 1),
                  ops::masked_mean(states, tokens, 1)));

  // An undefined mask keeps everything, where the reference library accepted None.
  CHECK(at::equal(ops::masked_softmax(scores, {}), at::softmax(scores, -1)));
  CHECK(at::equal(ops::masked_log_softmax(scores, {}, 2), at::log_softmax(scores, 2)));
  CHECK(at::equal(ops::logsumexp(scores, 1, true), at::logsumexp(scores, 1, true)));
  CHECK(at::equal(ops::logsumexp(scores, {}, 1), at::logsumexp(scores, 1)));  // {} is the mask
  CHECK(at::equal(ops::logsumexp(scores), at::logsumexp(scores, -1)));
}

TEST_CASE("masked_softmax's in-place CPU path: every dim, inputs untouched, under autocast") {
  at::manual_seed(7);
  // Inner sizes beyond a vector register, so LibTorch's non-last-dim kernel runs vectorised.
  const auto scores = at::randn({3, 6, 40});
  const auto keep = at::rand({3, 6, 40}) > 0.3;
  for (int64_t dim = 0; dim < 3; ++dim) {
    INFO("dim ", dim);
    const auto keep_dim = keep.logical_or(at::arange(6).view({1, 6, 1}).eq(0).expand_as(keep));
    const auto copy = scores.clone();
    const auto ours = ops::masked_softmax(scores, keep_dim, dim);
    CHECK(at::equal(scores, copy));
    const auto expected = at::softmax(scores.masked_fill(keep_dim.logical_not(), -inf), dim);
    check_close(ours.masked_fill(ours.isnan(), 0), expected.masked_fill(expected.isnan(), 0));
  }
  // An outer CPU autocast region (bf16) changes nothing: the ops compute in fp32 either way.
  const auto x = scores.to(at::kBFloat16);
  using O1 = mp::MixedO1<at::BFloat16>;
  const auto outside = ops::masked_softmax<O1>(x, keep);
  const auto outside_ln = ops::layer_norm<O1>(x, {40});
  auto guard = mp::autocast<O1>(torch::kCPU);
  CHECK(at::equal(ops::masked_softmax<O1>(x, keep), outside));
  CHECK(at::equal(ops::layer_norm<O1>(x, {40}), outside_ln));
  CHECK(ops::masked_log_softmax<O1>(x, keep).scalar_type() == at::kFloat);
}

TEST_CASE("masked_softmax: second-order gradients match the composite softmax") {
  at::manual_seed(2);
  const auto keep = at::tensor({1, 0, 1, 1, 1, 1, 0, 1}).view({2, 4}).to(at::kBool);
  const auto grad = at::randn({2, 4}, at::kDouble);
  const auto direction = at::randn({2, 4}, at::kDouble);
  const auto second = [&](auto&& softmax) {
    const auto x = at::randn({2, 4}, at::TensorOptions(at::kDouble).requires_grad(false));
    auto leaf = x.clone().requires_grad_();
    const auto first =
        torch::autograd::grad({(softmax(leaf) * grad).sum()}, {leaf}, {}, true, true)[0];
    (first * direction).sum().backward();
    return std::make_pair(first.detach(), leaf.grad());
  };
  at::manual_seed(3);
  const auto ours = second([&](const at::Tensor& x) { return ops::masked_softmax(x, keep); });
  at::manual_seed(3);
  const auto composite = second([&](const at::Tensor& x) {
    return at::softmax(x.masked_fill(keep.logical_not(), -inf), -1);
  });
  check_close(ours.first, composite.first);
  check_close(ours.second, composite.second);
}

TEST_CASE("sequence_cross_entropy_with_logits matches LibTorch's cross_entropy") {
  at::manual_seed(4);
  const int64_t batch = 3, steps = 4, classes = 5;
  const auto clean_logits = (at::randn({batch, steps, classes}) * 16).round() / 8;
  const auto clean_targets = at::randint(0, classes, {batch, steps});
  const auto mask =
      at::tensor({1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0}).view({batch, steps}).to(at::kBool);
  const auto numeric = at::tensor({0.5, 2.0, 1.0, 0.0, 1.0, 1.0, 0.25, 1.0, 0.0, 0.0, 0.0, 0.0})
                           .view({batch, steps})
                           .to(at::kFloat);
  for (const auto& weights : {mask, numeric}) {
    const auto w = weights.to(at::kDouble);
    const auto kept = weights != 0;
    for (const double smoothing : {0.0, 0.1}) {
      namespace F = torch::nn::functional;
      const auto nll =
          F::cross_entropy(
              clean_logits.to(at::kDouble).view({-1, classes}), clean_targets.view({-1}),
              F::CrossEntropyFuncOptions().reduction(torch::kNone).label_smoothing(smoothing))
              .view({batch, steps});
      const auto seq_sum = (nll * w).sum(1), seq_weight = w.sum(1);
      const auto per_sequence = at::where(seq_weight != 0, seq_sum / seq_weight, 0);
      const auto expected_batch = per_sequence.sum() / (seq_weight != 0).sum();
      const auto expected_token = (nll * w).sum() / w.sum();
      for (const auto dtype : float_dtypes) {
        INFO(std::string(c10::toString(dtype)), " smoothing ", smoothing);
        at::Tensor first_loss, first_grad;
        // Ignored tokens may hold anything: NaN logits, a target of -100 or 999.
        for (const double garbage : {0.0, not_a_number, inf}) {
          const auto logits = clean_logits.masked_fill(kept.logical_not().unsqueeze(-1), garbage)
                                  .to(dtype)
                                  .requires_grad_();
          const auto targets =
              clean_targets.masked_fill(kept.logical_not(), garbage == 0 ? -100 : 999);
          const auto loss = [&](ops::Average average) {
            return ops::sequence_cross_entropy_with_logits(logits, targets, weights, average,
                                                           smoothing);
          };
          check_close(loss(ops::Average::batch), expected_batch);
          check_close(loss(ops::Average::token), expected_token);
          check_close(loss(ops::Average::none), per_sequence);
          const auto l = loss(ops::Average::batch);
          CHECK(l.scalar_type() == (dtype == at::kDouble ? at::kDouble : at::kFloat));  // losses: fp32
          CHECK(l.dim() == 0);
          l.backward();
          CHECK(all_finite(logits.grad()));
          if (!first_loss.defined()) {
            first_loss = l.detach();
            first_grad = logits.grad();
          } else {
            CHECK(at::equal(l, first_loss));
            CHECK(at::equal(logits.grad(), first_grad));
          }
        }
      }
    }
  }
  // Nothing kept at all: every average is 0, not 0 / 0.
  const auto nothing = at::zeros({batch, steps}, at::kBool);
  for (const auto average : {ops::Average::batch, ops::Average::token, ops::Average::none}) {
    const auto logits = clean_logits.clone().requires_grad_();
    const auto loss =
        ops::sequence_cross_entropy_with_logits(logits, clean_targets, nothing, average);
    CHECK(at::equal(loss, at::zeros_like(loss)));
    loss.sum().backward();
    CHECK(at::equal(logits.grad(), at::zeros_like(logits)));
  }
  // One token per sequence: [batch, classes] logits and [batch] targets.
  const auto logits2 = clean_logits[0];
  const auto targets2 = clean_targets[0];
  check_close(ops::sequence_cross_entropy_with_logits(
                  logits2, targets2, at::ones({steps}, at::kBool), ops::Average::none),
              at::cross_entropy_loss(logits2.to(at::kDouble), targets2, {}, at::Reduction::None));
}

TEST_CASE("layer_norm computes Half and BFloat16 in fp32") {
  at::manual_seed(6);
  const auto x32 = (at::randn({4, 16}) * 300).round();  // squares far beyond fp16's 65504
  const auto weight = at::randn({16}), bias = at::randn({16});
  // A naive fp16 variance overflows.
  CHECK_FALSE(all_finite(x32.to(at::kHalf).pow(2).mean(-1)));
  for (const auto dtype : float_dtypes) {
    INFO(std::string(c10::toString(dtype)));
    const auto x = x32.to(dtype).detach().requires_grad_();
    // fp32 parameters (MixedO2 keeps norms fp32) and low-precision ones (PureHalf) both work.
    for (const auto& w : {weight, weight.to(dtype)}) {
      const auto b = bias.to(dtype);
      const auto y = ops::layer_norm(x, {16}, w.detach().requires_grad_(), b);
      CHECK(y.scalar_type() == dtype);
      // The reference sees the inputs as rounded to the dtype.
      const auto d = [](const at::Tensor& t) { return t.detach().to(at::kDouble); };
      check_close(y, at::layer_norm(d(x), {16}, d(w), d(b)));
      y.sum().backward();
      CHECK(all_finite(x.grad()));
      x.mutable_grad().reset();
    }
    CHECK(ops::layer_norm<mp::MixedO1<at::BFloat16>>(x, {16}).scalar_type() ==
          expected_output(true, dtype));
    CHECK(all_finite(ops::layer_norm(at::full({2, 8}, 3.0).to(dtype), {8})));  // constant rows
  }
}

TEST_CASE_TEMPLATE("the output dtype and values follow the policy; no NaN or inf under any policy",
                   P, mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO1<at::Half>,
                   mp::MixedO2<at::BFloat16>, mp::MixedO2<at::Half>, mp::PureHalf<at::BFloat16>,
                   mp::PureHalf<at::Half>) {
  const auto keep = row_mask();
  for (const auto dtype : float_dtypes) {
    INFO(std::string(c10::toString(dtype)));
    const auto output = expected_output(P::autocast, dtype);
    for (const auto& op : masked_ops<P>(dtype)) {
      INFO(op.name);
      const auto x = row_values().masked_fill(keep.logical_not(), 1e5).to(dtype).requires_grad_();
      const auto y = op.run(x, keep);
      CHECK(y.scalar_type() == output);
      CHECK(all_finite(y));
      // Values to the output dtype's rounding: an fp32 output under MixedO1 must not have been
      // computed in the input's 16 bits.
      const auto x_ref = x.detach().to(at::kDouble).requires_grad_();
      const auto y_ref = per_row_reference(op, x_ref, keep);
      check_close(y, y_ref);
      y.sum().backward();
      y_ref.sum().backward();
      CHECK(all_finite(x.grad()));
      CHECK(x.grad().scalar_type() == dtype);
      check_close(x.grad(), x_ref.grad());
    }
    const auto x = row_values().to(dtype);
    const auto x64 = x.to(at::kDouble);
    const auto lse = ops::logsumexp<P>(x, 1);
    CHECK(lse.scalar_type() == output);
    check_close(lse, at::logsumexp(x64, 1));
    const auto ln = ops::layer_norm<P>(x, {6});
    CHECK(ln.scalar_type() == output);
    check_close(ln, at::layer_norm(x64, {6}));
    const auto ce = ops::sequence_cross_entropy_with_logits<P>(
        x.view({32, 2, 6}), at::zeros({32, 2}, at::kLong), at::ones({32, 2}, at::kBool));
    // The loss is fp32 for 16-bit logits under every policy, as autocast computes losses.
    CHECK(ce.scalar_type() == (dtype == at::kDouble ? at::kDouble : at::kFloat));
    check_close(ce, -at::log_softmax(x64, -1).select(-1, 0).mean());
  }
}

TEST_CASE("the tolerance has teeth: it rejects an op rounded in 16 bits or fp64 through fp32") {
  const auto keep = row_mask();
  const auto x = row_values().masked_fill(keep.logical_not(), -inf);
  const auto reference = at::softmax(x.to(at::kDouble), 1).nan_to_num(0);
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    INFO(std::string(c10::toString(dtype)));
    // Computed in fp32, rounded once: within tolerance.
    CHECK(excess_error(at::softmax(x, 1).nan_to_num(0).to(dtype), reference) <= 0);
    // exp, sum and division each rounded to 16 bits (as 16-bit arithmetic would): beyond it.
    const auto round = [&](const at::Tensor& t) { return t.to(dtype).to(at::kFloat); };
    const auto e = round((x - x.amax(1, true)).exp());
    CHECK(excess_error(round(e / round(e.sum(1, true))).nan_to_num(0).to(dtype), reference) > 0);
  }
  CHECK(excess_error(at::softmax(x, 1).nan_to_num(0).to(at::kDouble), reference) > 0);
  CHECK(excess_error(at::softmax(x.to(at::kDouble), 1).nan_to_num(0), reference) <= 0);
}

TEST_CASE("masked_log_softmax is the log of masked_softmax: exp() of it gives it back") {
  // Beam search and top-k over log-probabilities need masked entries to be very unlikely, not
  // probability exp(0) = 1; and finite, so no inf - inf turns into NaN.
  const auto keep = row_mask();
  for (const auto dtype : float_dtypes) {
    INFO(std::string(c10::toString(dtype)));
    const auto x = row_values().masked_fill(keep.logical_not(), 1e5).to(dtype).requires_grad_();
    const auto check = [&](const at::Tensor& log_probs, const at::Tensor& probs) {
      CHECK(all_finite(log_probs));
      const double lowest = ops::min_value_of_dtype(log_probs.scalar_type());
      const auto masked = keep.logical_not();
      CHECK(at::equal(log_probs.masked_select(masked),
                      at::full({masked.sum().item<int64_t>()}, lowest, log_probs.options())));
      const auto exp = log_probs.to(at::kDouble).exp();
      CHECK(at::equal(exp.masked_select(masked), at::zeros({masked.sum().item<int64_t>()},
                                                           at::kDouble)));
      if (log_probs.scalar_type() == at::kFloat || log_probs.scalar_type() == at::kDouble) {
        check_close(exp.to(log_probs.scalar_type()), probs);
      } else {
        // exp() turns the half ulp of a 16-bit log-probability into a relative error of
        // |log p| * eps / 2, and the probabilities' own rounding adds eps / 2.
        const auto bound =
            (1 + log_probs.to(at::kDouble).abs()) * epsilon_of(log_probs.scalar_type());
        CHECK(((exp - probs.to(at::kDouble)).abs() <= bound * probs.to(at::kDouble) + 1e-6)
                  .all()
                  .item<bool>());
      }
      // The k most likely entries of a row are its k kept ones.
      const auto kept = keep.sum(1, true);
      const auto ranks = log_probs.argsort(int64_t{1}, /*descending=*/true).argsort(int64_t{1});
      CHECK(at::equal(ranks < kept, keep));
    };
    check(ops::masked_log_softmax(x, keep), ops::masked_softmax(x, keep));
    check(ops::masked_log_softmax<mp::MixedO1<at::BFloat16>>(x, keep),
          ops::masked_softmax<mp::MixedO1<at::BFloat16>>(x, keep));
    // Masked entries are constants: whatever arrives there, nothing flows back.
    ops::masked_log_softmax(x, keep).sum().backward();
    CHECK(at::equal(x.grad().masked_select(keep.logical_not()),
                    at::zeros({keep.logical_not().sum().item<int64_t>()}, dtype)));
    CHECK(all_finite(x.grad()));
  }
}

TEST_CASE("masked_max: kept entries that are all -inf give -inf; masked ones never win") {
  for (const auto dtype : float_dtypes) {
    INFO(std::string(c10::toString(dtype)));
    // Row 0: kept -inf only (the masked entry holds 5). Row 1: fully masked. Row 2: kept -inf
    // and a kept lowest value. Row 3: a masked entry holds the lowest, the kept max is -inf.
    const double lowest = ops::min_value_of_dtype(dtype);
    const auto x = at::tensor({-inf, 5.0, -inf, 1.0, 2.0, 3.0, -inf, lowest, 4.0, -inf, lowest, -inf})
                       .to(dtype)
                       .view({4, 3})
                       .requires_grad_();
    const auto keep = at::tensor({1, 0, 1, 0, 0, 0, 1, 1, 0, 1, 0, 1}).view({4, 3}).to(at::kBool);
    const auto y = ops::masked_max(x, keep, 1);
    CHECK(at::equal(y, at::tensor({-inf, lowest, lowest, -inf}).to(dtype)));
    CHECK(at::equal(ops::masked_max<mp::MixedO1<at::BFloat16>>(x, keep, 1),
                    at::tensor({-inf, lowest, lowest, -inf}).to(expected_output(true, dtype))));
    y.sum().backward();
    CHECK(all_finite(x.grad()));
    CHECK(at::equal(x.grad().masked_select(keep.logical_not()), at::zeros({6}, dtype)));
    CHECK(x.grad()[2][1].item<double>() == 1.0);  // the kept lowest is the max of row 2
  }
}

TEST_CASE("saturation instead of inf when the output dtype is narrower than fp32") {
  // fp16 logits 60000 apart: log-probabilities below -65504 saturate, they do not become -inf.
  const auto x = at::tensor({60000.0, -60000.0}).to(at::kHalf).view({1, 2});
  const auto keep = at::ones({1, 2}, at::kBool);
  const auto log_probs = ops::masked_log_softmax(x, keep);
  CHECK(all_finite(log_probs));
  CHECK(log_probs[0][1].item<double>() == -65504.0);
  // Under MixedO1 the fp32 output holds the exact value.
  CHECK(ops::masked_log_softmax<mp::MixedO1<at::Half>>(x, keep)[0][1].item<double>() == -120000.0);
  CHECK(ops::logsumexp(at::full({1, 64}, 65504.0).to(at::kHalf), at::ones({1, 64}, at::kBool), 1)
            .item<double>() == 65504.0);
}

TEST_CASE_TEMPLATE("a saturated fp16 result passes the fp64 reference's gradient straight through",
                   P, mp::FullPrecision, mp::MixedO2<at::Half>, mp::PureHalf<at::Half>) {
  // Logits [60000, -60000, 0], target 1: the loss is 120000 (beyond fp16), its gradient
  // [1, -1, 0]. A clamp's own gradient would be [0, 0, 0]: training would stop learning from it.
  const auto values = at::tensor({60000.0, -60000.0, 0.0});
  const auto x64 = values.to(at::kDouble).view({1, 3}).requires_grad_();
  (-at::log_softmax(x64, -1)[0][1]).backward();
  const auto reference = x64.grad();
  auto report = [&](const std::string& what, const at::Tensor& grad) {
    const auto g = grad.to(at::kDouble).reshape({-1});
    const double diff = (g - reference.reshape({-1})).abs().max().template item<double>();
    MESSAGE(std::string(P::name), " ", what, ": gradient [", g[0].template item<double>(), ", ",
            g[1].template item<double>(), ", ", g[2].template item<double>(),
            "], fp64 reference [1, -1, 0], largest difference ", diff);
    CHECK(diff <= 1e-3);  // fp16's rounding of 1
  };
  SUBCASE("sequence_cross_entropy_with_logits: an fp32 loss, the exact value") {
    const auto x = values.to(at::kHalf).view({1, 3}).requires_grad_();
    const auto loss = ops::sequence_cross_entropy_with_logits<P>(
        x, at::ones({1}, at::kLong), at::ones({1}, at::kBool));
    CHECK(loss.scalar_type() == at::kFloat);
    CHECK(loss.template item<double>() == 120000.0);
    loss.backward();
    report("cross entropy", x.grad());
  }
  SUBCASE("masked_log_softmax: saturated in fp16, the gradient straight through") {
    const auto x = values.to(at::kHalf).view({1, 3}).requires_grad_();
    const auto log_probs = ops::masked_log_softmax<P>(x, at::ones({1, 3}, at::kBool));
    CHECK(log_probs[0][1].template item<double>() == -65504.0);
    (-log_probs[0][1].to(at::kFloat)).backward();
    report("masked_log_softmax", x.grad());
  }
  SUBCASE("logsumexp: saturated at 65504, the gradient is softmax's") {
    const auto x = at::full({1, 3}, 65504.0).to(at::kHalf).requires_grad_();
    const auto lse = ops::logsumexp<P>(x, 1);
    CHECK(lse.template item<double>() == 65504.0);
    lse.to(at::kFloat).sum().backward();
    const double diff = (x.grad().to(at::kDouble) - 1.0 / 3.0).abs().max().template item<double>();
    MESSAGE(std::string(P::name), " logsumexp: largest difference to the reference's 1/3 ", diff);
    CHECK(diff <= 1e-3);
  }
}

TEST_CASE("bad input is a mixprec::Error that says what is wrong and how to fix it") {
  const auto x = at::randn({2, 3});
  const auto keep = at::ones({2, 3}, at::kBool);
  using doctest::Contains;
  CHECK_THROWS_WITH_AS(
      ops::masked_softmax(x, at::ones({2, 4}, at::kBool)),
      Contains("mask of shape [2, 4] does not broadcast to the vector of shape [2, 3]"), mp::Error);
  CHECK_THROWS_WITH_AS(ops::masked_mean(x, at::ones({2, 3, 1}, at::kBool), 1),
                       Contains("has more dimensions than the vector"), mp::Error);
  CHECK_THROWS_WITH_AS(ops::masked_softmax(x, at::full({2, 3}, 0.5)),
                       Contains("must hold only 0 and 1"), mp::Error);
  CHECK_THROWS_WITH_AS(ops::masked_softmax(x, at::full({2, 3}, not_a_number)),
                       Contains("must hold only 0 and 1"), mp::Error);
  CHECK_THROWS_WITH_AS(ops::masked_softmax(x, at::ones({2, 3}, at::kComplexFloat)),
                       Contains("must be bool (or 0/1 numbers)"), mp::Error);
  CHECK_THROWS_WITH_AS(ops::masked_max(x, at::Tensor(), 1), Contains("mask is an undefined tensor"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(
      ops::masked_softmax(x, keep, 2),
      Contains("dim 2 is out of range for a tensor of shape [2, 3] (valid: -2 to 1)"), mp::Error);
  CHECK_THROWS_WITH_AS(ops::masked_mean(x, keep, -3), Contains("out of range"), mp::Error);
  CHECK_THROWS_WITH_AS(ops::logsumexp(at::scalar_tensor(1.0), 0), Contains("0-d tensor"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(ops::masked_softmax(at::ones({2, 3}, at::kLong), keep),
                       Contains("must be floating point"), mp::Error);
  CHECK_THROWS_WITH_AS(ops::masked_max(at::ones({2, 3}, at::kBool), keep, 1),
                       Contains("floating point or integral, not Bool"), mp::Error);
  // A [batch, keys] mask of [batch, queries, keys] scores must not silently mask query rows:
  // with queries == keys, padding at the end and AllenNLP's padding after the batch both fit.
  CHECK_THROWS_WITH_AS(
      ops::replace_masked_values(at::randn({2, 3, 3}), at::ones({2, 3}, at::kBool), 0),
      Contains("the mask of shape [2, 3] is ambiguous for the vector of shape "
               "[2, 3, 3]: mixprec pads it at the end to [2, 3, 1], but [2, 1, 3] "
               "fits too"),
      mp::Error);
  CHECK_THROWS_WITH_AS(ops::masked_mean(at::randn({3, 3}), at::ones({3}, at::kBool), 1),
                       Contains("is ambiguous"), mp::Error);  // PyTorch would align from the right
  CHECK_THROWS_WITH_AS(ops::masked_softmax(at::randn({2, 3, 4}), at::ones({2, 3}, at::kBool)),
                       Contains("has no dimension 2"), mp::Error);

  // replace_masked_values refuses values the output dtype cannot hold.
  CHECK_THROWS_WITH_AS(ops::replace_masked_values(x.to(at::kHalf), keep, -1e32),
                       Contains("outside Half's finite range [-65504, 65504]"), mp::Error);
  CHECK(
      ops::replace_masked_values<mp::MixedO1<at::Half>>(x.to(at::kHalf), keep.logical_not(), -1e32)
          .min()
          .item<double>() == static_cast<double>(static_cast<float>(-1e32)));  // fp32 under O1
  CHECK(
      ops::replace_masked_values(x.to(at::kHalf), keep.logical_not(), -inf).min().item<double>() ==
      -inf);
  CHECK_THROWS_WITH_AS(ops::replace_masked_values(at::ones({2, 3}, at::kInt), keep, 0.5),
                       Contains("not a whole number"), mp::Error);
  CHECK_THROWS_WITH_AS(ops::replace_masked_values(at::ones({2, 3}, at::kByte), keep, -1),
                       Contains("outside Byte's finite range"), mp::Error);
  CHECK_THROWS_WITH_AS(ops::replace_masked_values(at::ones({2, 3}, at::kLong), keep, inf),
                       Contains("cannot be stored in an integer tensor"), mp::Error);

  // Cross entropy.
  const auto logits = at::randn({2, 3, 4});
  const auto targets = at::zeros({2, 3}, at::kLong);
  const auto weights = at::ones({2, 3}, at::kBool);
  const auto ce = [&](const at::Tensor& t, const at::Tensor& w, double smoothing = 0.0) {
    return ops::sequence_cross_entropy_with_logits(logits, t, w, ops::Average::batch, smoothing);
  };
  CHECK_THROWS_WITH_AS(ce(at::zeros({2, 4}, at::kLong), weights),
                       Contains("targets of shape [2, 4] do not match logits of shape [2, 3, 4]"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(ce(at::zeros({2, 3}), weights), Contains("must hold class indices"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(ce(targets, at::ones({2})), Contains("weights of shape [2] must have"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(ce(at::full({2, 3}, 4, at::kLong), weights),
                       Contains("target 4 is not a class index in [0, 4)"), mp::Error);
  for (const double smoothing : {-0.1, 1.0, not_a_number}) {
    CHECK_THROWS_WITH_AS(ce(targets, weights, smoothing),
                         Contains("label_smoothing must be in [0, 1)"), mp::Error);
  }
  CHECK_THROWS_WITH_AS(ops::sequence_cross_entropy_with_logits(
                           at::randn({4}), at::zeros({}, at::kLong), at::ones({}, at::kBool)),
                       Contains("logits must be [batch, ..., classes]"), mp::Error);

  // layer_norm.
  CHECK_THROWS_WITH_AS(ops::layer_norm(x, {2}), Contains("must be the trailing dimensions"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(
      ops::layer_norm(x, {3}, at::ones({2})),
      Contains("the weight of shape [2] must have the shape normalized_shape = [3]"), mp::Error);
  for (const double eps : {0.0, 1e-50, not_a_number}) {
    CHECK_THROWS_WITH_AS(ops::layer_norm(x, {3}, {}, {}, eps),
                         Contains("must be finite and at least"), mp::Error);
  }
}

TEST_CASE("masked_softmax with a mask that keeps everything is softmax, values and gradients") {
  // The node skips the fill then (a batch without padding): nothing else may change.
  for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    INFO(std::string(c10::toString(dtype)));
    const auto x = at::randn({3, 5}).to(dtype).requires_grad_();
    const auto all = at::ones({3, 5}, at::kBool);
    const auto y = mixprec::ops::masked_softmax(x, all);
    // The reference computes where the op does: in fp32 for bf16 and fp16.
    const auto compute = dtype == at::kDouble ? at::kDouble : at::kFloat;
    const auto x_ref = x.detach().to(compute).requires_grad_();
    const auto y_ref = at::softmax(x_ref, -1).to(y.scalar_type());
    CHECK(at::equal(y, y_ref));
    const auto g = at::randn({3, 5}).to(y.scalar_type());
    y.backward(g);
    y_ref.backward(g);
    CHECK(at::equal(x.grad(), x_ref.grad().to(dtype)));
  }
}

TEST_CASE("masked_softmax backward: inf or NaN arriving at masked outputs changes nothing") {
  const auto keep = torch::tensor({true, true, false, false});
  auto v = torch::tensor({1.0F, 2.0F, 3.0F, 4.0F}, torch::requires_grad());
  // log() of the masked zeros is -inf, and its gradient there is inf: it must not leak.
  at::where(keep, mixprec::ops::masked_softmax(v, keep).log(), 0).sum().backward();
  const auto via_softmax = v.grad().clone();
  v.mutable_grad().reset();
  at::where(keep, mixprec::ops::masked_log_softmax(v, keep), 0).sum().backward();
  CHECK(at::isfinite(via_softmax).all().item<bool>());
  CHECK(via_softmax.allclose(v.grad(), 1e-6, 1e-6));
  // The careful path (a non-finite gradient somewhere) and the fast one (finite everywhere)
  // give the same gradient, bit for bit, in every dtype and with a uniform (empty) row.
  const auto rows = torch::tensor({true, true, false, false, false, false, false, false}).view({2, 4});
  for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    for (const bool uniform : {false, true}) {
      INFO(std::string(c10::toString(dtype)), " memory_efficient ", uniform);
      const auto x = at::randn({2, 4}).to(dtype).requires_grad_();
      const auto y = mixprec::ops::masked_softmax(x, rows, -1, uniform);
      const auto g = at::randn({2, 4}).to(y.scalar_type());
      const auto fast = torch::autograd::grad({y}, {x}, {g.masked_fill(rows.logical_not(), 0)},
                                              /*retain_graph=*/true)[0];
      const auto careful = torch::autograd::grad({y}, {x}, {g.masked_fill(rows.logical_not(), inf)})[0];
      CHECK(at::isfinite(careful).all().item<bool>());
      CHECK(at::equal(fast, careful));
      CHECK(at::equal(fast.masked_select(rows.logical_not()), at::zeros({6}, dtype)));
    }
  }
}

// ---- Optional inputs are undefined tensors (STYLE.md): every op whose mask, weight or bias is
// optional runs without it, with tensors that need no gradient (an input, a frozen weight or
// bias, a float mask from a computation) and in evaluation (grad mode off): every way an
// undefined tensor or gradient reaches an op and its autograd Functions. Against fp64.

namespace {

enum class Param { none, trained, frozen };

const char* name_of(Param p) {
  return p == Param::none ? "none" : p == Param::trained ? "trained" : "frozen";
}

// Upstream gradients that every dtype holds exactly (multiples of 1/8 in [-4, 4]), so that the
// reference sees what the op saw.
at::Tensor exact_probe(at::IntArrayRef sizes) {
  at::manual_seed(8);
  return ((at::randn(sizes) * 8).round() / 8).clamp(-4, 4);
}

// One backward of `y` and of `reference` against the same probe; then each tensor's gradient
// against its reference's, and no gradient where none is needed.
void check_gradients(const at::Tensor& y, const at::Tensor& reference,
                     const std::vector<std::pair<at::Tensor, at::Tensor>>& tensors) {
  const auto probe = exact_probe(y.sizes());
  (y.to(at::kDouble) * probe).sum().backward();
  (reference * probe).sum().backward();
  for (const auto& [t, t_ref] : tensors) {
    if (!t.defined()) continue;
    if (!t_ref.requires_grad()) {
      CHECK_FALSE(t.grad().defined());
      continue;
    }
    REQUIRE(t.grad().defined());
    CHECK(t.grad().scalar_type() == t.scalar_type());
    check_close(t.grad(), t_ref.grad());
  }
}

}  // namespace

TEST_CASE_TEMPLATE("optional inputs left undefined or frozen: no mask, layer_norm without weight "
                   "or bias; values and every gradient as fp64's, under every policy",
                   P, mp::FullPrecision, mp::MixedO1<at::BFloat16>, mp::MixedO1<at::Half>,
                   mp::MixedO2<at::BFloat16>, mp::MixedO2<at::Half>, mp::PureHalf<at::BFloat16>,
                   mp::PureHalf<at::Half>) {
  using T = const at::Tensor&;
  struct Unmasked {
    std::string name;
    std::function<at::Tensor(T)> run;
    std::function<at::Tensor(T)> reference;
  };
  const std::vector<Unmasked> unmasked{
      {"masked_softmax", [](T x) { return ops::masked_softmax<P>(x, {}, 1); },
       [](T x) { return at::softmax(x, 1); }},
      {"masked_softmax(memory_efficient)", [](T x) { return ops::masked_softmax<P>(x, {}, 1, true); },
       [](T x) { return at::softmax(x, 1); }},
      {"masked_log_softmax", [](T x) { return ops::masked_log_softmax<P>(x, {}, 1); },
       [](T x) { return at::log_softmax(x, 1); }},
      {"logsumexp", [](T x) { return ops::logsumexp<P>(x, {}, 1); },
       [](T x) { return at::logsumexp(x, 1); }},
  };
  const auto weight = exact_probe({6}) + 1, bias = exact_probe({6}).flip(0);
  for (const auto dtype : float_dtypes) {
    INFO(std::string(c10::toString(dtype)));
    const auto output = expected_output(P::autocast, dtype);
    for (const bool grad_mode : {true, false}) {
      for (const bool input_grad : {true, false}) {
        INFO("grad mode ", grad_mode, ", input needs a gradient ", input_grad);
        const auto fresh = [&](const at::Tensor& t, at::ScalarType type, bool grad) {
          return t.detach().to(type).clone().requires_grad_(grad);
        };
        for (const auto& op : unmasked) {
          INFO(op.name);
          const auto x = fresh(row_values(), dtype, input_grad);
          const auto x_ref = fresh(x, at::kDouble, input_grad);
          at::Tensor y;
          {
            const torch::AutoGradMode mode(grad_mode);
            y = op.run(x);
          }
          CHECK(y.scalar_type() == output);
          const auto y_ref = op.reference(x_ref);
          check_close(y, y_ref);
          CHECK(y.requires_grad() == (grad_mode && input_grad));
          if (y.requires_grad()) check_gradients(y, y_ref, {{x, x_ref}});
        }
        // layer_norm: weight and bias each absent, trained or frozen.
        for (const auto w_kind : {Param::none, Param::trained, Param::frozen}) {
          for (const auto b_kind : {Param::none, Param::trained, Param::frozen}) {
            INFO("layer_norm, weight ", name_of(w_kind), ", bias ", name_of(b_kind));
            const auto param = [&](const at::Tensor& t, Param kind, at::ScalarType type) {
              return kind == Param::none ? at::Tensor() : fresh(t, type, kind == Param::trained);
            };
            const auto x = fresh(row_values(), dtype, input_grad);
            const auto w = param(weight, w_kind, dtype), b = param(bias, b_kind, dtype);
            const auto x_ref = fresh(x, at::kDouble, input_grad);
            const auto w_ref = param(weight, w_kind, at::kDouble);
            const auto b_ref = param(bias, b_kind, at::kDouble);
            at::Tensor y;
            {
              const torch::AutoGradMode mode(grad_mode);
              y = ops::layer_norm<P>(x, {6}, w, b);
            }
            CHECK(y.scalar_type() == output);
            const auto y_ref = at::layer_norm(x_ref, {6}, w_ref, b_ref);
            check_close(y, y_ref);
            const bool any = input_grad || w_kind == Param::trained || b_kind == Param::trained;
            CHECK(y.requires_grad() == (grad_mode && any));
            if (y.requires_grad()) check_gradients(y, y_ref, {{x, x_ref}, {w, w_ref}, {b, b_ref}});
          }
        }
      }
    }
    // A float 0/1 mask computed with a gradient gets none; a vector that needs none gives an
    // output that needs none (masked_softmax's node then records nothing).
    const auto keep = row_mask();
    for (const bool input_grad : {true, false}) {
      INFO("masked_softmax with a float mask that requires grad, input needs a gradient ", input_grad);
      const auto mask = keep.to(at::kFloat).requires_grad_();
      const auto x = row_values().to(dtype).clone().requires_grad_(input_grad);
      const auto y = ops::masked_softmax<P>(x, mask * 1, 1);
      CHECK(y.requires_grad() == input_grad);
      const MaskedOp op = masked_ops<P>(dtype)[0];
      const auto x_ref = x.detach().to(at::kDouble).requires_grad_(input_grad);
      const auto y_ref = per_row_reference(op, x_ref, keep);
      check_close(y, y_ref);
      if (input_grad) check_gradients(y, y_ref, {{x, x_ref}});
      CHECK_FALSE(mask.grad().defined());
    }
  }
  // Where the mask is not optional, its absence is an Error that says what to pass instead.
  const auto x = row_values();
  using doctest::Contains;
  const auto* needs_mask = "the mask is an undefined tensor; this op needs one";
  CHECK_THROWS_WITH_AS(ops::masked_max<P>(x, {}, 1), Contains(needs_mask), mp::Error);
  CHECK_THROWS_WITH_AS(ops::masked_mean<P>(x, {}, 1), Contains(needs_mask), mp::Error);
  CHECK_THROWS_WITH_AS(ops::replace_masked_values<P>(x, {}, 0.0), Contains(needs_mask), mp::Error);
}

}  // namespace test_ops
