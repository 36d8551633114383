#pragma once
/// mixprec::ops: masked softmax and friends that stay finite in fp16 and bf16 (docs/numerics.md).
///
///   namespace ops = mixprec::ops;
///   using P = mixprec::MixedO1<at::BFloat16>;
///   auto weights = ops::masked_softmax<P>(scores, key_mask.view({batch, 1, 1, keys}));  // fp32
///   auto pooled = ops::masked_mean<P>(states, token_mask, /*dim=*/1);  // [batch, seq] mask
///
/// Rules every op keeps:
/// - Half and BFloat16 input is computed in fp32. The output has the input's dtype, except under
///   a policy with autocast (MixedO1), where Half/BFloat16 input gives fp32, like autocast's
///   fp32 op list, and for the loss (sequence_cross_entropy_with_logits), which is fp32 for
///   Half/BFloat16 logits under every policy.
/// - A result beyond a narrower output dtype's finite range saturates at its bounds, and its
///   gradient goes straight through (the clamp's would be 0: a saturated value stops learning).
/// - A mask is bool (or numbers that are all 0/1), true = keep. A mask of lower rank gets trailing
///   size-1 dimensions, then must broadcast to the vector; an op working along `dim` needs the
///   mask to have that dimension itself; a mask that PyTorch's or AllenNLP's alignment would
///   also fit, with another meaning, is refused. Anything else is a mixprec::Error.
/// - Masked entries never influence values or gradients, whatever they hold (inf, NaN).
/// - Finite input gives finite output and gradients. Fully masked rows give zeros; exceptions:
///   masked_max (the input dtype's lowest value), masked_log_softmax (the output dtype's lowest
///   value, as at every masked entry) and masked_softmax(memory_efficient = true) (uniform).

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>

#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <mixprec/core/concepts.hpp>
#include <mixprec/ops/common.hpp>
#include <mixprec/ops/masked_softmax.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/policy.hpp>
#include <numeric>
#include <string_view>
#include <vector>

namespace mixprec::ops {

/// The most negative finite value of `dtype` (floating or integral): -65504 for Half.
inline double min_value_of_dtype(c10::ScalarType dtype) {
  const auto limits = detail::limits_of(dtype);
  MIXPREC_CHECK(limits.has_value(), "min_value_of_dtype: ", c10::toString(dtype),
                " is not supported; use Half, BFloat16, Float, Double or an integer dtype");
  return limits->lowest;
}

/// The largest finite value of `dtype`; for Long, the largest double that is still a valid
/// int64 (2^63 - 1024), so that the value converts back without overflow.
inline double max_value_of_dtype(c10::ScalarType dtype) {
  const auto limits = detail::limits_of(dtype);
  MIXPREC_CHECK(limits.has_value(), "max_value_of_dtype: ", c10::toString(dtype),
                " is not supported; use Half, BFloat16, Float, Double or an integer dtype");
  return limits->max;
}

/// The smallest positive normal value of a floating dtype (PyTorch's finfo.tiny): 2^-14 for Half.
inline double tiny_value_of_dtype(c10::ScalarType dtype) {
  const auto limits = detail::limits_of(dtype);
  MIXPREC_CHECK(limits.has_value() && at::isFloatingType(dtype),
                "tiny_value_of_dtype: ", c10::toString(dtype),
                " is not supported; it is defined for Half, BFloat16, Float and Double");
  return limits->tiny;
}

/// How sequence_cross_entropy_with_logits reduces the per-token losses.
enum class Average {
  batch,  ///< weighted mean per sequence, then the mean over sequences with nonzero weight
  token,  ///< weighted mean over all tokens of the batch
  none,   ///< one weighted mean per sequence, shape [batch]
};

/// Softmax over `dim` of the kept entries; masked entries get 0. A fully masked row gives zeros,
/// or with `memory_efficient` a uniform row (what a softmax of equal values gives: safe to feed
/// to a log). The flag keeps AllenNLP's name; both variants use the same memory here. An
/// undefined mask keeps everything.
template <class P = FullPrecision>
at::Tensor masked_softmax(const at::Tensor& vector, const at::Tensor& mask, int64_t dim = -1,
                          bool memory_efficient = false) {
  static_assert(require_policy<P>);
  constexpr std::string_view op = "masked_softmax";
  detail::check_floating(op, vector, "vector");
  const int64_t d = detail::wrap_dim(op, vector, dim);
  at::Tensor result;
  if (!mask.defined()) {
    result = at::softmax(detail::to_compute(vector), d);
  } else {
    const auto keep = detail::prepare_mask(op, vector, mask, d);
    // The node casts a reduced-float `vector` to fp32 in the pass that applies the mask.
    result = detail::MaskedSoftmaxFunction::apply(vector, keep, d, memory_efficient);
  }
  return detail::to_output(result, detail::output_dtype_of<P>(vector.scalar_type()),
                           /*saturate=*/false);
}

/// Log-softmax over `dim` of the kept entries. Masked entries (fully masked rows too) hold the
/// output dtype's lowest value, finite and with gradient 0, so exp() of the result is
/// masked_softmax (0 there) and top-k never picks them; mask before summing (two such values
/// overflow to -inf). An undefined mask keeps everything. Log-probabilities below the output
/// dtype's range saturate at its lowest value.
template <class P = FullPrecision>
at::Tensor masked_log_softmax(const at::Tensor& vector, const at::Tensor& mask, int64_t dim = -1) {
  static_assert(require_policy<P>);
  constexpr std::string_view op = "masked_log_softmax";
  detail::check_floating(op, vector, "vector");
  const int64_t d = detail::wrap_dim(op, vector, dim);
  const auto output = detail::output_dtype_of<P>(vector.scalar_type());
  const auto x = detail::to_compute(vector);
  at::Tensor result;
  if (!mask.defined()) {
    result = at::log_softmax(x, d);
  } else {
    const auto keep = detail::prepare_mask(op, vector, mask, d);
    const auto fill = detail::masked_fill_values(keep.any(d, /*keepdim=*/true), x.options());
    // log(0) would be -inf: the lowest finite value keeps exp() at 0 without inf arithmetic.
    result = at::log_softmax(at::where(keep, x, fill), d)
                 .masked_fill(keep.logical_not(), detail::limits_of(output)->lowest);
  }
  // -inf appears only where x - max overflowed (or a cast to fp16 would): saturate instead,
  // the gradient straight through (a saturated log-probability still learns).
  return detail::saturate_to(result, output);
}

/// Maximum over `dim` of the kept entries (-inf if they all are). A fully masked row (or an empty
/// `dim`) gives the input dtype's lowest value, min_value_of_dtype(vector.scalar_type()).
/// Integer vectors work too. Tied maxima share the gradient evenly (as amax; AllenNLP's max gives
/// it all to one of them).
template <class P = FullPrecision>
at::Tensor masked_max(const at::Tensor& vector, const at::Tensor& mask, int64_t dim,
                      bool keepdim = false) {
  static_assert(require_policy<P>);
  constexpr std::string_view op = "masked_max";
  detail::check_defined(op, vector, "vector");
  const auto limits = detail::limits_of(vector.scalar_type());
  MIXPREC_CHECK(limits.has_value(), op, ": the vector must be floating point or integral, not ",
                c10::toString(vector.scalar_type()));
  const int64_t d = detail::wrap_dim(op, vector, dim);
  const auto keep = detail::prepare_mask(op, vector, mask, d);
  const auto x = detail::to_compute(vector);
  // The input dtype's lowest, not the compute dtype's: it survives the cast back to the input.
  const bool floating = at::isFloatingType(x.scalar_type());
  const at::Scalar empty =
      floating ? at::Scalar(limits->lowest) : at::Scalar(static_cast<int64_t>(limits->lowest));
  at::Tensor result;
  if (x.size(d) == 0) {
    if (floating) {
      result = x.sum(d, keepdim).fill_(empty);  // keeps the graph: the gradient is zero
    } else {
      auto sizes = x.sizes().vec();
      if (keepdim) {
        sizes[static_cast<std::size_t>(d)] = 1;
      } else {
        sizes.erase(sizes.begin() + d);
      }
      result = at::full(sizes, empty, x.options());
    }
  } else if (floating) {
    // Masked entries as -inf, not as the lowest value, which would win over kept -inf entries.
    const auto row_any = keep.any(d, keepdim);
    result = at::where(row_any,
                       x.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity())
                           .amax(d, keepdim),
                       empty);
  } else {
    result = x.masked_fill(keep.logical_not(), empty).amax(d, keepdim);
  }
  return detail::to_output(result, detail::output_dtype_of<P>(vector.scalar_type()),
                           /*saturate=*/false);
}

/// Mean over `dim` of the kept entries; a fully masked row (or an empty `dim`) gives 0.
template <class P = FullPrecision>
at::Tensor masked_mean(const at::Tensor& vector, const at::Tensor& mask, int64_t dim,
                       bool keepdim = false) {
  static_assert(require_policy<P>);
  constexpr std::string_view op = "masked_mean";
  detail::check_floating(op, vector, "vector");
  const int64_t d = detail::wrap_dim(op, vector, dim);
  const auto keep = detail::prepare_mask(op, vector, mask, d);
  const auto x = detail::to_compute(vector);
  const auto total = at::where(keep, x, 0).sum(d, keepdim);
  auto count = keep.sum(d, keepdim, x.scalar_type());
  if (keep.size(d) == 1 && x.size(d) != 1) {
    // A mask of size 1 along dim keeps or drops the whole row: it counts x.size(d) entries.
    count = count * static_cast<double>(x.size(d));
  }
  // The count is a whole number, so clamping to 1 changes only the empty rows (0 / 1 = 0).
  return detail::to_output(total / count.clamp_min(1),
                           detail::output_dtype_of<P>(vector.scalar_type()), /*saturate=*/false);
}

/// `tensor` with its masked entries set to `value`. A finite value outside the output dtype's
/// range is an error (-1e32 would become -inf in fp16); pass +-infinity explicitly if wanted.
template <class P = FullPrecision>
at::Tensor replace_masked_values(const at::Tensor& tensor, const at::Tensor& mask, double value) {
  static_assert(require_policy<P>);
  constexpr std::string_view op = "replace_masked_values";
  detail::check_defined(op, tensor, "tensor");
  const auto output = detail::output_dtype_of<P>(tensor.scalar_type());
  const auto keep = detail::prepare_mask(op, tensor, mask, std::nullopt);
  if (output == c10::ScalarType::Bool) {
    MIXPREC_CHECK(value == 0 || value == 1, op, ": a bool tensor can hold 0 or 1, not ", value);
  } else {
    const auto limits = detail::limits_of(output);
    MIXPREC_CHECK(limits.has_value(), op, ": unsupported dtype ", c10::toString(output));
    const bool floating = at::isFloatingType(output);
    MIXPREC_CHECK(floating || std::isfinite(value), op, ": ", value,
                  " cannot be stored in an integer tensor (", c10::toString(output), ")");
    MIXPREC_CHECK(!std::isfinite(value) || (value >= limits->lowest && value <= limits->max), op,
                  ": the value ", value, " is outside ", c10::toString(output), "'s finite range [",
                  limits->lowest, ", ", limits->max, "] and would not survive the cast",
                  floating ? " (it would become inf)" : "",
                  "; use mixprec::ops::min_value_of_dtype / max_value_of_dtype of the dtype");
    MIXPREC_CHECK(floating || value == std::trunc(value), op, ": ", value,
                  " is not a whole number but the tensor is ", c10::toString(output));
  }
  return tensor.to(output).masked_fill(keep.logical_not(), value);
}

/// log(sum(exp(x))) over `dim` of the kept entries, computed stably (max subtracted). A fully
/// masked row, or an empty `dim`, gives 0 (the library's empty-row convention, not -inf). An
/// undefined mask (the default) keeps everything. Results beyond a narrower output dtype saturate.
template <class P = FullPrecision>
at::Tensor logsumexp(const at::Tensor& tensor, const at::Tensor& mask = {}, int64_t dim = -1,
                     bool keepdim = false) {
  static_assert(require_policy<P>);
  constexpr std::string_view op = "logsumexp";
  detail::check_floating(op, tensor, "tensor");
  const int64_t d = detail::wrap_dim(op, tensor, dim);
  const auto x = detail::to_compute(tensor);
  at::Tensor result;
  if (!mask.defined()) {
    result = at::logsumexp(x, d, keepdim);
    if (x.size(d) == 0) {
      result = result.masked_fill(result.isinf(), 0);  // an empty sum: -inf by the maths
    }
  } else {
    const auto keep = detail::prepare_mask(op, tensor, mask, d);
    // Over the mask broadcast to the tensor: a size-1 mask along an empty dim keeps no entry.
    const auto row_any = keep.expand(x.sizes()).any(d, /*keepdim=*/true);
    result = at::logsumexp(at::where(keep, x, detail::masked_fill_values(row_any, x.options())), d,
                           keepdim);
    result =
        result.masked_fill(keepdim ? row_any.logical_not() : row_any.logical_not().squeeze(d), 0);
  }
  return detail::to_output(result, detail::output_dtype_of<P>(tensor.scalar_type()),
                           /*saturate=*/true);
}

/// logsumexp over `dim` without a mask, with the same dtype rules. A template on the dim's type
/// so that logsumexp(x, {}, 1) means "no mask, dim 1", not "dim 0, keepdim".
template <class P = FullPrecision, std::integral Dim>
at::Tensor logsumexp(const at::Tensor& tensor, Dim dim, bool keepdim = false) {
  return logsumexp<P>(tensor, at::Tensor(), static_cast<int64_t>(dim), keepdim);
}

/// Cross entropy of `logits` [batch, ..., classes] against class indices `targets`
/// [batch, ...], weighted per token by `weights` (same shape as targets: a bool mask or numeric
/// weights; weight 0 = ignored, whatever its logits and target hold). `label_smoothing` in [0, 1)
/// moves that much probability mass uniformly over the classes, as PyTorch's cross_entropy does.
/// Sequences (and batches) whose weights sum to 0 contribute a loss of 0. The loss is fp32 for
/// Half/BFloat16 logits under every policy (the input's dtype otherwise), as autocast computes
/// its losses: an fp16 loss would saturate at 65504 and pass back no gradient.
template <class P = FullPrecision>
at::Tensor sequence_cross_entropy_with_logits(const at::Tensor& logits, const at::Tensor& targets,
                                              const at::Tensor& weights,
                                              Average average = Average::batch,
                                              double label_smoothing = 0.0) {
  static_assert(require_policy<P>);
  constexpr std::string_view op = "sequence_cross_entropy_with_logits";
  detail::check_floating(op, logits, "logits tensor");
  detail::check_defined(op, targets, "targets tensor");
  detail::check_defined(op, weights, "weights tensor");
  MIXPREC_CHECK(logits.dim() >= 2, op, ": logits must be [batch, ..., classes], got shape ",
                logits.sizes());
  const auto token_shape = logits.sizes().slice(0, static_cast<std::size_t>(logits.dim() - 1));
  MIXPREC_CHECK(targets.sizes() == token_shape, op, ": targets of shape ", targets.sizes(),
                " do not match logits of shape ", logits.sizes(), "; targets must have shape ",
                token_shape, " (the logits' shape without the class dimension)");
  MIXPREC_CHECK(at::isIntegralType(targets.scalar_type(), /*includeBool=*/false), op,
                ": targets must hold class indices (an integer dtype such as Long), not ",
                c10::toString(targets.scalar_type()));
  MIXPREC_CHECK(weights.sizes() == token_shape, op, ": weights of shape ", weights.sizes(),
                " must have the targets' shape ", token_shape);
  MIXPREC_CHECK(
      weights.scalar_type() == c10::ScalarType::Bool || at::isFloatingType(weights.scalar_type()) ||
          at::isIntegralType(weights.scalar_type(), /*includeBool=*/false),
      op, ": weights must be bool or real numbers, not ", c10::toString(weights.scalar_type()));
  MIXPREC_CHECK(targets.device() == logits.device() && weights.device() == logits.device(), op,
                ": logits, targets and weights must be on one device");
  MIXPREC_CHECK(label_smoothing >= 0.0 && label_smoothing < 1.0, op,
                ": label_smoothing must be in ", "[0, 1), got ", label_smoothing);
  const int64_t classes = logits.size(-1);
  MIXPREC_CHECK(classes > 0, op, ": logits have no classes (last dimension of size 0)");

  const auto keep = weights.scalar_type() == c10::ScalarType::Bool ? weights : weights != 0;
  const auto safe_targets = targets.masked_fill(keep.logical_not(), 0).to(c10::ScalarType::Long);
  if (logits.is_cpu()) {
    // On the GPU the gather's own bounds check asserts; on the CPU say which value is wrong.
    const auto bad = at::logical_or(safe_targets < 0, safe_targets >= classes);
    MIXPREC_CHECK(!bad.any().item<bool>(), op, ": target ",
                  safe_targets.masked_select(bad)[0].item<int64_t>(),
                  " is not a class index in [0, ", classes, "); give ignored tokens weight 0");
  }
  auto x = detail::to_compute(logits);
  const auto w = weights.to(x.scalar_type());
  // Ignored tokens may hold garbage logits: without this their NaN would reach the gradient.
  x = x.masked_fill(keep.logical_not().unsqueeze(-1), 0);
  const auto log_probs = at::log_softmax(x, -1);
  auto nll = -log_probs.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1);
  if (label_smoothing > 0.0) {
    nll = (1.0 - label_smoothing) * nll - label_smoothing * log_probs.mean(-1);
  }
  const auto per_token = nll * w;  // nll is finite at ignored tokens, so weight 0 gives 0

  at::Tensor loss;
  if (average == Average::token) {
    const auto total_weight = w.sum();
    const auto nonzero = total_weight != 0;
    // where() alone is not enough: the gradient of x / 0 in the untaken branch would be NaN.
    loss = at::where(nonzero, per_token.sum() / at::where(nonzero, total_weight, 1), 0);
  } else {
    std::vector<int64_t> token_dims(static_cast<std::size_t>(targets.dim() - 1));
    std::iota(token_dims.begin(), token_dims.end(), int64_t{1});
    const auto seq_loss = token_dims.empty() ? per_token : per_token.sum(token_dims);
    const auto seq_weight = token_dims.empty() ? w : w.sum(token_dims);
    const auto nonempty = seq_weight != 0;
    const auto per_sequence = at::where(nonempty, seq_loss / at::where(nonempty, seq_weight, 1), 0);
    if (average == Average::none) {
      loss = per_sequence;
    } else {
      loss = per_sequence.sum() / nonempty.sum().clamp_min(1).to(x.scalar_type());
    }
  }
  // A loss comes out in the compute dtype (fp32 for fp16/bf16 logits) under every policy, as
  // autocast keeps its loss ops in fp32: a narrower loss would saturate, and the value that
  // reaches backward would not be the loss.
  return loss;
}

/// Layer normalisation over the trailing `normalized_shape` dimensions, computed in fp32 for
/// Half/BFloat16 input and parameters (fp16's variance overflows, and 1.13 has no CPU Half
/// kernel). `weight` and `bias` are optional (undefined tensors); eps must be positive and
/// representable in the compute dtype.
template <class P = FullPrecision>
at::Tensor layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                      const at::Tensor& weight = {}, const at::Tensor& bias = {},
                      double eps = 1e-5) {
  static_assert(require_policy<P>);
  constexpr std::string_view op = "layer_norm";
  detail::check_floating(op, input, "input");
  const auto n = static_cast<int64_t>(normalized_shape.size());
  MIXPREC_CHECK(
      n >= 1 && n <= input.dim() &&
          input.sizes().slice(static_cast<std::size_t>(input.dim() - n)) == normalized_shape,
      op, ": normalized_shape ", normalized_shape,
      " must be the trailing dimensions of the input of shape ", input.sizes());
  for (const auto* parameter : {&weight, &bias}) {
    if (parameter->defined()) {
      detail::check_floating(op, *parameter, parameter == &weight ? "weight" : "bias");
      MIXPREC_CHECK(parameter->sizes() == normalized_shape, op, ": the ",
                    parameter == &weight ? "weight" : "bias", " of shape ", parameter->sizes(),
                    " must have the shape normalized_shape = ", normalized_shape);
      MIXPREC_CHECK(parameter->device() == input.device(), op,
                    ": weight, bias and input must be on one device");
    }
  }
  const auto compute = detail::compute_dtype_of(input.scalar_type());
  MIXPREC_CHECK(std::isfinite(eps) && eps >= tiny_value_of_dtype(compute), op, ": eps = ", eps,
                " must be finite and at least ", tiny_value_of_dtype(compute),
                " (the smallest normal ", c10::toString(compute),
                "); a zero eps divides by zero on a constant row");
  const auto x = input.to(compute);
  const auto w = weight.defined() ? weight.to(compute) : weight;
  const auto b = bias.defined() ? bias.to(compute) : bias;
  return detail::to_output(at::layer_norm(x, normalized_shape, w, b, eps),
                           detail::output_dtype_of<P>(input.scalar_type()), /*saturate=*/true);
}

}  // namespace mixprec::ops
