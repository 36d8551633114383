#pragma once
// The values of a gradient as the diagnostics read them: a sparse gradient's stored values. One
// definition for the passes that look for inf/NaN (overflow.hpp), count what fp16 would keep
// (gradient_stats.hpp) and record magnitudes for advise() (advise_recorder.hpp), so that they
// agree on what a sparse gradient holds.

#include <ATen/core/Tensor.h>

namespace mixprec::detail {

/// The values of a gradient that can be read: a sparse gradient's values.
inline at::Tensor readable(const at::Tensor& grad) {
  return grad.is_sparse() ? grad._values() : grad;
}

}  // namespace mixprec::detail
