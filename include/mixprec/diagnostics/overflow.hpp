#pragma once
/// Where a skipped step's inf/NaN was: Overflow (in every skipped StepReport) and its message,
/// and the one-synchronisation pass over the gradients that fills it (non_finite_flags, run by
/// the Trainer on skipped steps only).

#include <mixprec/diagnostics/gradient_values.hpp>

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace mixprec {

/// Where the inf/NaN of a skipped step was. Found by a second pass over the gradients that runs
/// on skipped steps only: clean steps pay nothing for it.
struct Overflow {
  /// At most this many names in `params`.
  static constexpr std::size_t max_names = 8;
  /// The loss was inf or NaN (in one of the micro-batches of the step, or their sum).
  bool loss = false;
  /// The first parameters, in model order and by their names in the model, whose gradients
  /// held inf or NaN; a tensor registered under two names (tied weights) by its first.
  std::vector<std::string> params;
  /// How many parameters' gradients held inf or NaN in all.
  std::int64_t param_count = 0;
  /// How many parameters had gradients to check.
  std::int64_t checked = 0;
  /// Data parallel: neither was found on this rank; another rank's loss was inf/NaN (gradients
  /// are averaged, so another rank's inf/NaN gradient is found on every rank).
  bool other_rank = false;
};

/// "inf/NaN in the loss and in the gradients of 3 parameters: fc.weight, fc.bias, out.weight";
/// "inf/NaN in the gradients of all 8 parameters (...): conv1.weight, ...".
inline std::ostream& operator<<(std::ostream& out, const Overflow& o) {
  out << "inf/NaN";
  if (o.other_rank) return out << " on another rank (its loss)";
  if (o.loss) out << " in the loss";
  if (o.param_count > 0) {
    out << (o.loss ? " and" : "") << " in the gradients of ";
    if (o.param_count == o.checked && o.param_count > 1 && !o.loss) {
      // The usual signature of an activation gradient that overflowed: the backward pass
      // carries it into every layer below.
      out << "all " << o.param_count << " parameters (an overflow in the backward pass reaches "
          << "every layer it passes): ";
    } else {
      out << o.param_count << (o.param_count == 1 ? " parameter: " : " parameters: ");
    }
    for (std::size_t i = 0; i < o.params.size(); ++i) out << (i ? ", " : "") << o.params[i];
    if (static_cast<std::int64_t>(o.params.size()) < o.param_count) out << ", ...";
  }
  if (!o.loss && o.param_count == 0) out << " (not found in the loss or the gradients)";
  return out;
}

namespace detail {

/// One flag per tensor, read back together: whether it holds inf or NaN. One synchronisation.
inline std::vector<bool> non_finite_flags(const std::vector<at::Tensor>& tensors) {
  std::vector<bool> result(tensors.size(), false);
  if (tensors.empty()) return result;
  std::vector<at::Tensor> flags;
  flags.reserve(tensors.size());
  for (const auto& t : tensors) {
    const auto values = readable(t);
    flags.push_back(values.numel() == 0 ? at::zeros({}, values.options().dtype(at::kBool))
                                        : at::isfinite(values).logical_not().any());
  }
  const auto host = at::stack(flags).to(at::kCPU);
  const auto* data = host.data_ptr<bool>();
  for (std::size_t i = 0; i < tensors.size(); ++i) result[i] = data[i];
  return result;
}

}  // namespace detail

}  // namespace mixprec
