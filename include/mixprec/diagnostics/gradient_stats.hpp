#pragma once
/// How much of each gradient fp16 would flush to zero or overflow at the loss scale:
/// GradientStatsOptions (TrainerOptions::gradient_stats), the counts per parameter or module
/// prefix (GradientRange, GradientStats) and their table, and the passes that count them in one
/// synchronisation and sum them per prefix.

#include <mixprec/diagnostics/gradient_values.hpp>

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec {

/// Settings of the gradient statistics of a Trainer (TrainerOptions::gradient_stats).
struct GradientStatsOptions {
  /// Counted on optimizer steps N, 2N, 3N, ... (StepReport::step) for N = every; 0: never.
  TORCH_ARG(std::int64_t, every) = 0;
  /// 0: one entry per parameter; k > 0: per module prefix of k components ("encoder.layer1"
  /// for k = 2), the parameters' counts summed.
  TORCH_ARG(std::int64_t, group_depth) = 0;
};

/// The gradient elements of a parameter (or a module prefix) as fp16 would hold them at the
/// step's loss scale, counted on the scaled gradients before unscaling.
struct GradientRange {
  std::string name;            ///< the parameter's name, or the module prefix
  std::int64_t elements = 0;   ///< gradient elements counted
  std::int64_t zeros = 0;      ///< exactly 0 (under a Half policy, fp16's flushed values are here)
  std::int64_t underflow = 0;  ///< not 0, but 0 in fp16 (|g * scale| <= 2^-25)
  std::int64_t subnormal = 0;  ///< fp16 subnormal: kept with fewer bits (2^-25 < |g*s| < 2^-14)
  std::int64_t overflow = 0;   ///< inf in fp16 (|g * scale| >= 65520), or inf/NaN already
  double max_abs = 0.0;        ///< the largest |gradient|, unscaled (inf/NaN: not finite)

  double fraction(std::int64_t count) const {
    return elements == 0 ? 0.0 : static_cast<double>(count) / static_cast<double>(elements);
  }
  double zero_fraction() const { return fraction(zeros); }
  double underflow_fraction() const { return fraction(underflow); }
  double subnormal_fraction() const { return fraction(subnormal); }
  double overflow_fraction() const { return fraction(overflow); }
};

/// The gradient statistics of one optimizer step.
struct GradientStats {
  std::int64_t step = 0;  ///< the optimizer step (1-based, as StepReport::step)
  double scale = 1.0;     ///< the loss scale of the gradients counted
  std::vector<GradientRange> entries;  ///< in model order
};

/// A table: name, elements, then the fractions in percent.
inline std::ostream& operator<<(std::ostream& out, const GradientStats& stats) {
  std::ostringstream text;
  text << "gradients at step " << stats.step << ", loss scale " << stats.scale
       << " (% of elements; underflow/overflow: as fp16 would hold them):\n";
  std::size_t width = 4;
  for (const auto& e : stats.entries) width = std::max(width, e.name.size());
  text << "  " << std::left << std::setw(static_cast<int>(width)) << "name" << std::right
       << std::setw(11) << "elements" << std::setw(9) << "zero" << std::setw(11) << "underflow"
       << std::setw(11) << "subnormal" << std::setw(10) << "overflow" << std::setw(12)
       << "max |g|" << '\n';
  for (const auto& e : stats.entries) {
    text << "  " << std::left << std::setw(static_cast<int>(width)) << e.name << std::right
         << std::setw(11) << e.elements << std::fixed << std::setprecision(3) << std::setw(9)
         << 100 * e.zero_fraction() << std::setw(11) << 100 * e.underflow_fraction()
         << std::setw(11) << 100 * e.subnormal_fraction() << std::setw(10)
         << 100 * e.overflow_fraction() << std::defaultfloat << std::setprecision(4)
         << std::setw(12) << e.max_abs << '\n';
  }
  return out << text.str();
}

namespace detail {

/// The module prefix of `depth` components of a parameter's name; depth 0: the name itself.
inline std::string name_prefix(const std::string& name, std::int64_t depth) {
  if (depth <= 0) return name;
  const auto last = name.rfind('.');
  if (last == std::string::npos) return "(model)";  // a parameter of the model itself
  std::size_t end = 0;
  for (std::int64_t k = 0; k < depth; ++k) {
    const auto dot = name.find('.', end == 0 ? 0 : end + 1);
    if (dot == std::string::npos || dot > last) return name.substr(0, last);
    end = dot;
  }
  return name.substr(0, end);
}

/// Counts of GradientRange for each tensor (scaled gradients, `scale` their loss scale), read
/// back together: one synchronisation.
inline std::vector<GradientRange> gradient_ranges(const std::vector<at::Tensor>& grads,
                                                  double scale) {
  // fp16's thresholds on the fp32 value (round to nearest even): 2^-25 ties to 0, 65520 to inf.
  constexpr double flush = 2.98023223876953125e-08;  // 2^-25
  constexpr double min_normal = 6.103515625e-05;     // 2^-14
  constexpr double to_inf = 65520.0;
  std::vector<at::Tensor> counts, maxima;
  for (const auto& grad : grads) {
    const auto values = readable(grad);
    if (values.numel() == 0) {
      counts.push_back(at::zeros({4}, values.options().dtype(at::kLong)));
      maxima.push_back(at::zeros({}, values.options().dtype(at::kDouble)));
      continue;
    }
    const auto a = values.to(at::kFloat).abs();
    const auto nan = at::isnan(a);
    counts.push_back(at::stack({a.eq(0).sum(), (a.gt(0) & a.le(flush)).sum(),
                                (a.gt(flush) & a.lt(min_normal)).sum(),
                                (a.ge(to_inf) | nan).sum()}));
    // NaN wins over the maximum: a NaN gradient's max_abs is NaN.
    maxima.push_back(at::where(nan.any(), at::full({}, std::nan(""), a.options()), a.max())
                         .to(at::kDouble));
  }
  std::vector<GradientRange> result(grads.size());
  if (grads.empty()) return result;
  const auto c = at::stack(counts).to(at::kCPU);
  const auto m = at::stack(maxima).to(at::kCPU);
  const auto* cd = c.data_ptr<std::int64_t>();
  const auto* md = m.data_ptr<double>();
  for (std::size_t i = 0; i < grads.size(); ++i) {
    auto& r = result[i];
    r.elements = readable(grads[i]).numel();
    r.zeros = cd[4 * i];
    r.underflow = cd[4 * i + 1];
    r.subnormal = cd[4 * i + 2];
    r.overflow = cd[4 * i + 3];
    r.max_abs = md[i] / scale;
  }
  return result;
}

/// Sums ranges of the same name (module prefixes), keeping the order of first appearance.
inline std::vector<GradientRange> merge_ranges(std::vector<GradientRange> ranges) {
  std::vector<GradientRange> merged;
  std::unordered_map<std::string, std::size_t> index;
  for (auto& r : ranges) {
    const auto [it, inserted] = index.try_emplace(r.name, merged.size());
    if (inserted) {
      merged.push_back(std::move(r));
      continue;
    }
    auto& m = merged[it->second];
    m.elements += r.elements;
    m.zeros += r.zeros;
    m.underflow += r.underflow;
    m.subnormal += r.subnormal;
    m.overflow += r.overflow;
    m.max_abs = std::isnan(m.max_abs) || std::isnan(r.max_abs) ? std::nan("")
                                                               : std::max(m.max_abs, r.max_abs);
  }
  return merged;
}

}  // namespace detail

}  // namespace mixprec
