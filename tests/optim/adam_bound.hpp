#pragma once
// How far two fp32 implementations of one Adam or AdamW step, from the same weights, moments
// and gradient, may part (docs/numerics.md, "Adam's arithmetic: what is bitwise, what is
// bounded"). With u = 2^-24, eps = 2u, lr_t = lr / (1 - beta1^t), d = sqrt(v') / sqrt(1 -
// beta2^t) + epsilon (v': the new second moment, or its running maximum under amsgrad), and
// M = |m| + (1 - beta1) |g| (Adam: |g| + weight_decay |p|, its L2 term):
//   - the first moments part by at most 4u M: each side rounds (g - m) or m beta1 and the sum
//     (u M each, ATen's lerp one more u (1 - beta1)|g - m|), and fl(beta1) and fl(1 - beta1)
//     do not add up to 1 (u |m|);
//   - the second moments are sums of non-negative terms, each within 3u of the exact one, so
//     the denominators d are within 4.5u and 4u of theirs: 8.5u apart; the update (lr_t m) / d
//     or lr_t (m / d) rounds twice on each side: the updates part by 16.5u lr_t M / d;
//   - a gradient divided by a scale that is not a power of two, and Adam's L2 term, round once
//     more on each side: 2u lr_t M / d each;
//   - the new weight rounds on each side: u |p'| each.
// Together: |p_a - p_b| <= eps (|p'| + 10.25 lr_t M / d).
#include <torch/torch.h>

#include <cmath>
#include <cstdint>

namespace test {

/// The bound above, per element (double): `p` and `m` before the step, `grad` unscaled, `v` the
/// new second moment (or its maximum), `p_new` the new weight.
inline at::Tensor adam_rounding_bound(const at::Tensor& p, const at::Tensor& p_new,
                                      const at::Tensor& m, const at::Tensor& grad,
                                      const at::Tensor& v, double lr, double beta1, double beta2,
                                      double epsilon, double weight_decay, bool adamw,
                                      std::int64_t step) {
  const double eps = std::ldexp(1.0, -23);
  const auto t = static_cast<double>(step);
  const double lr_t = lr / (1 - std::pow(beta1, t));
  const auto d = v.to(at::kDouble).sqrt() / std::sqrt(1 - std::pow(beta2, t)) + epsilon;
  auto g = grad.to(at::kDouble).abs();
  if (!adamw) g = g + weight_decay * p.to(at::kDouble).abs();
  const auto big_m = m.to(at::kDouble).abs() + (1 - beta1) * g;
  return eps * (p_new.to(at::kDouble).abs() + 10.25 * lr_t * big_m / d);
}

}  // namespace test
