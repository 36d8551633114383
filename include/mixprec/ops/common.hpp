#pragma once
/// Internals of mixprec/ops.hpp: dtype limits, the compute/output dtype rules, argument checks
/// and mask preparation. Nothing here is public API.

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mixprec/core/autograd_function.hpp>
#include <mixprec/core/error.hpp>
#include <optional>
#include <string_view>
#include <vector>

namespace mixprec::ops::detail {

/// The finite range of a dtype; `tiny` is 0 for integral dtypes.
struct DtypeLimits {
  double lowest;
  double max;
  double tiny;
};

template <class T>
DtypeLimits floating_limits() {
  using limits = std::numeric_limits<T>;
  // Half and BFloat16 convert to float only; every value is exact in double.
  return {static_cast<double>(static_cast<float>(limits::lowest())),
          static_cast<double>(static_cast<float>(limits::max())),
          static_cast<double>(static_cast<float>(limits::min()))};
}

template <class T>
DtypeLimits integral_limits() {
  using limits = std::numeric_limits<T>;
  double max = static_cast<double>(limits::max());
  // int64's max (2^63 - 1) rounds up to 2^63, which overflows the dtype when converted back:
  // step down to the largest double that is still a valid int64.
  if (max >= 9223372036854775808.0) {
    max = std::nextafter(max, 0.0);
  }
  return {static_cast<double>(limits::lowest()), max, 0.0};
}

/// Limits of the dtypes the ops accept; nullopt for bool, complex, quantized and the rest.
inline std::optional<DtypeLimits> limits_of(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Half:
      return floating_limits<c10::Half>();
    case c10::ScalarType::BFloat16:
      return floating_limits<c10::BFloat16>();
    case c10::ScalarType::Float:
      return floating_limits<float>();
    case c10::ScalarType::Double:
      return DtypeLimits{std::numeric_limits<double>::lowest(), std::numeric_limits<double>::max(),
                         std::numeric_limits<double>::min()};
    case c10::ScalarType::Byte:
      return integral_limits<std::uint8_t>();
    case c10::ScalarType::Char:
      return integral_limits<std::int8_t>();
    case c10::ScalarType::Short:
      return integral_limits<std::int16_t>();
    case c10::ScalarType::Int:
      return integral_limits<std::int32_t>();
    case c10::ScalarType::Long:
      return integral_limits<std::int64_t>();
    default:
      return std::nullopt;
  }
}

inline bool is_reduced_float(c10::ScalarType dtype) {
  return dtype == c10::ScalarType::Half || dtype == c10::ScalarType::BFloat16;
}

/// Half and BFloat16 are computed in fp32: LibTorch 1.13 has no CPU Half kernels for softmax and
/// friends, and fp16 sums overflow at 65504.
inline c10::ScalarType compute_dtype_of(c10::ScalarType input) {
  return is_reduced_float(input) ? c10::ScalarType::Float : input;
}

/// Under autocast (MixedO1) the ops belong to autocast's fp32 list; otherwise the input's dtype.
template <class P>
c10::ScalarType output_dtype_of(c10::ScalarType input) {
  if constexpr (P::autocast) {
    return compute_dtype_of(input);
  } else {
    return input;
  }
}

inline at::Tensor to_compute(const at::Tensor& tensor) {
  return tensor.to(compute_dtype_of(tensor.scalar_type()));
}

/// A cast that clamps to the output dtype's finite range, and whose gradient goes straight
/// through the clamp: a value beyond the range still tells its inputs which way to move (the
/// clamp's own gradient, 0 outside the range, would silently stop a saturated loss from
/// learning). Only the gradient's dtype changes on the way back.
struct SaturatingCast : mixprec::detail::AutogradFunction<SaturatingCast> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& result,
                            c10::ScalarType output) {
    ctx->saved_data["dtype"] = static_cast<int64_t>(result.scalar_type());
    const auto limits = *limits_of(output);
    return result.clamp(limits.lowest, limits.max).to(output);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grads[0].defined() ? grads[0].to(dtype) : grads[0], at::Tensor()};
  }
};

/// `result` in the floating dtype `output`, values beyond its finite range (inf included) held
/// at its bounds, the gradient straight through.
inline at::Tensor saturate_to(const at::Tensor& result, c10::ScalarType output) {
  return SaturatingCast::apply(result, output);
}

/// Casts a result to the output dtype. `saturate` clamps to a narrower output's finite range
/// first (straight-through gradient), where the values may exceed it: a narrowing cast would
/// otherwise turn them into inf silently.
inline at::Tensor to_output(const at::Tensor& result, c10::ScalarType output, bool saturate) {
  if (result.scalar_type() == output) {
    return result;
  }
  if (saturate && is_reduced_float(output)) {
    return saturate_to(result, output);
  }
  return result.to(output);
}

inline void check_defined(std::string_view op, const at::Tensor& tensor, std::string_view what) {
  MIXPREC_CHECK(tensor.defined(), op, ": the ", what, " is an undefined tensor");
}

inline void check_floating(std::string_view op, const at::Tensor& tensor, std::string_view what) {
  check_defined(op, tensor, what);
  MIXPREC_CHECK(at::isFloatingType(tensor.scalar_type()), op, ": the ", what,
                " must be floating point (Half, BFloat16, Float or Double), not ",
                c10::toString(tensor.scalar_type()), "; convert it with .to(at::kFloat)");
}

/// Validates `dim` against `tensor` and returns it non-negative.
inline int64_t wrap_dim(std::string_view op, const at::Tensor& tensor, int64_t dim) {
  const int64_t rank = tensor.dim();
  MIXPREC_CHECK(rank >= 1, op, ": needs a tensor with at least one dimension, got a 0-d tensor; ",
                "unsqueeze it first");
  MIXPREC_CHECK(dim >= -rank && dim < rank, op, ": dim ", dim,
                " is out of range for a tensor of shape ", tensor.sizes(), " (valid: ", -rank,
                " to ", rank - 1, ")");
  return dim < 0 ? dim + rank : dim;
}

/// Turns `mask` into a bool "keep" tensor of the vector's rank that broadcasts to the vector.
/// A mask of lower rank gets trailing size-1 dimensions ([batch, seq] masks a [batch, seq, dim]
/// vector per position). `reduced_dim`, for the ops that reduce or normalise along a dimension,
/// must be one of the mask's own dimensions: an added one would mask whole rows, which is never
/// what a [batch, keys] mask of [batch, queries, keys] scores meant.
inline at::Tensor prepare_mask(std::string_view op, const at::Tensor& vector,
                               const at::Tensor& mask, std::optional<int64_t> reduced_dim) {
  // The ops whose mask is optional handle an undefined one before they get here.
  MIXPREC_CHECK(mask.defined(), op, ": the mask is an undefined tensor; this op needs one "
                "(at::ones_like(vector, at::kBool) keeps every entry)");
  MIXPREC_CHECK(mask.device() == vector.device(), op, ": the mask is on ", mask.device(),
                " but the vector is on ", vector.device(), "; move the mask with .to(device)");
  at::Tensor keep;
  const auto dtype = mask.scalar_type();
  if (dtype == c10::ScalarType::Bool) {
    keep = mask;
  } else {
    MIXPREC_CHECK(at::isFloatingType(dtype) || at::isIntegralType(dtype, /*includeBool=*/false), op,
                  ": the mask must be bool (or 0/1 numbers), not ", c10::toString(dtype));
    // A soft mask (0.5) or a NaN cannot be told apart from a bug; refuse rather than binarise.
    MIXPREC_CHECK(at::logical_or(mask == 0, mask == 1).all().item<bool>(), op,
                  ": a numeric mask must hold only 0 and 1, but this ", c10::toString(dtype),
                  " mask holds other values; pass a bool mask (e.g. mask > 0.5)");
    keep = mask != 0;
  }
  const int64_t missing = vector.dim() - mask.dim();
  MIXPREC_CHECK(missing >= 0, op, ": the mask of shape ", mask.sizes(),
                " has more dimensions than the vector of shape ", vector.sizes());
  const auto broadcasts = [&](const std::vector<int64_t>& shape) {
    for (int64_t i = 0; i < vector.dim(); ++i) {
      const auto size = shape[static_cast<std::size_t>(i)];
      if (size != vector.size(i) && size != 1) {
        return false;
      }
    }
    return true;
  };
  std::vector<int64_t> padded(mask.sizes().begin(), mask.sizes().end());
  padded.insert(padded.end(), static_cast<std::size_t>(missing), 1);
  MIXPREC_CHECK(broadcasts(padded), op, ": the mask of shape ", mask.sizes(),
                " does not broadcast to the vector of shape ", vector.sizes(),
                " (a shorter mask is aligned with the vector's leading dimensions); reshape the "
                "mask, e.g. mask.view({batch, 1, 1, keys}) for attention scores");
  if (missing > 0 && mask.dim() > 0) {
    // PyTorch broadcasting aligns a shorter mask from the right; AllenNLP's masked_softmax put
    // the padding after the batch dimension. Where either also fits with another meaning, the
    // caller may have meant it: refuse to guess.
    std::vector<int64_t> from_right(static_cast<std::size_t>(missing), 1);
    from_right.insert(from_right.end(), mask.sizes().begin(), mask.sizes().end());
    std::vector<int64_t> after_batch = padded;
    std::rotate(after_batch.begin() + 1, after_batch.end() - missing, after_batch.end());
    for (const auto& other : {from_right, after_batch}) {
      MIXPREC_CHECK(other == padded || !broadcasts(other), op, ": the mask of shape ", mask.sizes(),
                    " is ambiguous for the vector of shape ", vector.sizes(),
                    ": mixprec pads it at the end to ", at::IntArrayRef(padded), ", but ",
                    at::IntArrayRef(other), " fits too; give the mask the vector's rank, e.g. ",
                    "mask.unsqueeze(-1) or mask.unsqueeze(1)");
    }
  }
  if (reduced_dim) {
    MIXPREC_CHECK(*reduced_dim < mask.dim(), op, ": the mask of shape ", mask.sizes(),
                  " has no dimension ", *reduced_dim,
                  " (the dimension this op works along) for "
                  "the vector of shape ",
                  vector.sizes(),
                  "; padding it with size-1 dimensions "
                  "would mask whole rows. Reshape the mask to the vector's rank explicitly, e.g. "
                  "mask.unsqueeze(1) for a [batch, keys] mask of [batch, queries, keys] scores");
  }
  while (keep.dim() < vector.dim()) {
    keep = keep.unsqueeze(-1);
  }
  return keep;
}

/// Fill value per row for the ops that mask with -inf: -inf where the row keeps something, 0 in
/// fully masked rows, so that no row is all -inf (softmax of such a row is NaN, and so is its
/// gradient). `row_any` is keep.any(dim, keepdim = true).
inline at::Tensor masked_fill_values(const at::Tensor& row_any, const at::TensorOptions& options) {
  return at::zeros(row_any.sizes(), options)
      .masked_fill_(row_any, -std::numeric_limits<double>::infinity());
}

}  // namespace mixprec::ops::detail
