#pragma once
// What one policy's training run reports, how a child process hands it to the parent (a small
// line-based text file), how peak memory is read from /proc, the comparison table, the CSV of
// the loss curves (plot.py draws it), and how many images fit a time budget.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <istream>
#include <limits>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fashion_mnist {

/// The outcome of training one policy.
struct PolicyResult {
  std::string policy;              // the policy's name, e.g. "MixedO2<BFloat16>"
  std::string conv_weight_grads;   // dtype of the convolutions' weight gradients: fp32, bf16, fp16
  bool remedy = false;             // fp16 convolutions whose weight gradients are fp32's
  std::int64_t images = 0;         // training images
  double test_accuracy = 0;        // fraction in [0, 1]
  double seconds_per_epoch = 0;    // training only (no evaluation), mean over the epochs
  double peak_rss_mib = 0;         // VmHWM of the process at the end
  double training_peak_mib = 0;    // peak RSS during training minus RSS before it; -1 unknown
  std::int64_t steps = 0;          // optimizer steps taken
  std::int64_t skipped_steps = 0;  // steps skipped for non-finite gradients
  double final_scale = 1;          // loss scale at the end
  std::vector<double> losses;      // training loss (unscaled) of each iteration
  std::vector<double> scales;      // loss scale after each iteration
};

inline constexpr const char* kResultHeader = "mixprec-fashion-mnist-result 3";

/// The run's name in the log and the CSV: the policy, and the remedy where it was applied.
inline std::string label(const PolicyResult& r) {
  return r.remedy ? r.policy + " (fp32 conv weight grads)" : r.policy;
}

/// The table's "conv weight grads" cell: their dtype, and whether that is the remedy.
inline std::string conv_weight_grads_cell(const PolicyResult& r) {
  return r.remedy ? r.conv_weight_grads + " (remedy)" : r.conv_weight_grads;
}

/// Writes `result` in the line format read_result reads ("key value", vectors with a count).
inline void write_result(std::ostream& out, const PolicyResult& result) {
  out << kResultHeader << '\n' << std::setprecision(17);
  out << "policy " << result.policy << '\n';
  out << "conv_weight_grads " << result.conv_weight_grads << '\n';
  out << "remedy " << result.remedy << '\n';
  out << "images " << result.images << '\n';
  out << "test_accuracy " << result.test_accuracy << '\n';
  out << "seconds_per_epoch " << result.seconds_per_epoch << '\n';
  out << "peak_rss_mib " << result.peak_rss_mib << '\n';
  out << "training_peak_mib " << result.training_peak_mib << '\n';
  out << "steps " << result.steps << '\n';
  out << "skipped_steps " << result.skipped_steps << '\n';
  out << "final_scale " << result.final_scale << '\n';
  for (const auto& [key, values] :
       {std::pair{"losses", &result.losses}, std::pair{"scales", &result.scales}}) {
    out << key << ' ' << values->size();
    for (const double v : *values) {
      out << ' ' << v;
    }
    out << '\n';
  }
  out << "end\n";
}

/// Reads what write_result wrote; throws std::runtime_error on anything else (e.g. a child
/// that died half-way through writing).
inline PolicyResult read_result(std::istream& in) {
  std::string line;
  if (!std::getline(in, line) || line != kResultHeader) {
    throw std::runtime_error("not a result file (header '" + line + "')");
  }
  PolicyResult result;
  bool ended = false;
  std::string key;
  while (!ended && in >> key) {
    bool ok = true;
    if (key == "policy") {
      ok = static_cast<bool>(in >> result.policy);
    } else if (key == "conv_weight_grads") {
      ok = static_cast<bool>(in >> result.conv_weight_grads);
    } else if (key == "remedy") {
      ok = static_cast<bool>(in >> result.remedy);
    } else if (key == "images") {
      ok = static_cast<bool>(in >> result.images);
    } else if (key == "test_accuracy") {
      ok = static_cast<bool>(in >> result.test_accuracy);
    } else if (key == "seconds_per_epoch") {
      ok = static_cast<bool>(in >> result.seconds_per_epoch);
    } else if (key == "peak_rss_mib") {
      ok = static_cast<bool>(in >> result.peak_rss_mib);
    } else if (key == "training_peak_mib") {
      ok = static_cast<bool>(in >> result.training_peak_mib);
    } else if (key == "steps") {
      ok = static_cast<bool>(in >> result.steps);
    } else if (key == "skipped_steps") {
      ok = static_cast<bool>(in >> result.skipped_steps);
    } else if (key == "final_scale") {
      ok = static_cast<bool>(in >> result.final_scale);
    } else if (key == "losses" || key == "scales") {
      auto& values = key == "losses" ? result.losses : result.scales;
      std::size_t count = 0;
      ok = static_cast<bool>(in >> count) && count <= (std::size_t{1} << 28);
      // operator>> does not parse "nan"/"inf"; read tokens and convert with strtod instead.
      for (std::size_t i = 0; ok && i < count; ++i) {
        std::string token;
        ok = static_cast<bool>(in >> token);
        char* end = nullptr;
        const double v = ok ? std::strtod(token.c_str(), &end) : 0;
        ok = ok && end == token.c_str() + token.size();
        values.push_back(v);
      }
    } else if (key == "end") {
      ended = true;
    } else {
      throw std::runtime_error("result file: unknown key '" + key + "'");
    }
    if (!ok) {
      throw std::runtime_error("result file: bad value for '" + key + "'");
    }
  }
  if (!ended) {
    throw std::runtime_error("result file: truncated (no 'end' line)");
  }
  return result;
}

/// The value in KiB of `key` ("VmHWM:", "VmRSS:") in a /proc/<pid>/status text; -1 if absent.
inline double status_kib(std::istream& status, const std::string& key) {
  std::string line;
  while (std::getline(status, line)) {
    if (line.starts_with(key)) {
      std::istringstream fields(line.substr(key.size()));
      double kib = -1;
      fields >> kib;
      return fields ? kib : -1;
    }
  }
  return -1;
}

/// This process's `key` from /proc/self/status in MiB; -1 where /proc is absent.
inline double self_status_mib(const std::string& key) {
  std::ifstream status("/proc/self/status");
  const double kib = status ? status_kib(status, key) : -1;
  return kib < 0 ? -1 : kib / 1024.0;
}

/// Resets this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0); false if refused.
inline bool reset_peak_rss() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  clear_refs.flush();
  return static_cast<bool>(clear_refs);
}

/// The comparison table (Markdown), the first row as the baseline of the relative columns.
inline std::string format_table(const std::vector<PolicyResult>& results) {
  std::string out =
      "| policy | conv weight grads | images | test accuracy | vs first | s/epoch | speed vs first "
      "| peak RSS MiB | training peak +MiB | steps | skipped | final scale |\n"
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  if (results.empty()) {
    return out;
  }
  const PolicyResult& base = results.front();
  char row[512];
  for (const auto& r : results) {
    const double delta = 100.0 * (r.test_accuracy - base.test_accuracy);
    const double speed = r.seconds_per_epoch > 0 ? base.seconds_per_epoch / r.seconds_per_epoch : 0;
    std::string training = r.training_peak_mib < 0 ? "n/a" : "";
    if (training.empty()) {
      char text[32];
      std::snprintf(text, sizeof text, "%.1f", r.training_peak_mib);
      training = text;
    }
    std::snprintf(row, sizeof row,
                  "| %s | %s | %lld | %.2f%% | %+.2f pp | %.2f | %.2fx | %.1f | %s | %lld | %lld | "
                  "%g |\n",
                  r.policy.c_str(), conv_weight_grads_cell(r).c_str(),
                  static_cast<long long>(r.images), 100.0 * r.test_accuracy,
                  delta, r.seconds_per_epoch, speed,
                  r.peak_rss_mib, training.c_str(), static_cast<long long>(r.steps),
                  static_cast<long long>(r.skipped_steps), r.final_scale);
    out += row;
  }
  return out;
}

/// The loss curves as CSV, one row per optimizer step of each run: run (its row label), dtype
/// (the group's low precision: bf16 or fp16), step, loss (the unscaled micro-batch loss; "nan"
/// or "inf" where it was), scale (the loss scale the step used).
inline void write_csv(std::ostream& out, const std::vector<std::pair<std::string, PolicyResult>>& runs) {
  out << "run,dtype,images,step,loss,scale\n" << std::setprecision(9);
  for (const auto& [dtype, r] : runs) {
    for (std::size_t i = 0; i < r.losses.size(); ++i) {
      out << '"' << label(r) << "\"," << dtype << ',' << r.images << ',' << i + 1 << ','
          << r.losses[i] << ',' << (i < r.scales.size() ? r.scales[i] : 1.0) << '\n';
    }
  }
}

/// How many training images the runs of a group can take within `budget` seconds of training:
/// the measured seconds per step of each run (one step of each, summed, per batch), whole
/// epochs of whole batches, rounded down to a multiple of `round`, within [minimum, maximum].
inline std::int64_t images_within_budget(double budget, const std::vector<double>& step_seconds,
                                         int epochs, std::int64_t batch, std::int64_t minimum,
                                         std::int64_t maximum, std::int64_t round = 1000) {
  double per_step = 0;
  for (const double s : step_seconds) per_step += s;
  if (!(per_step > 0) || epochs < 1 || batch < 1) return minimum;
  const double steps = budget / (per_step * epochs);
  auto images = static_cast<std::int64_t>(std::min(steps * static_cast<double>(batch), 1e15));
  images = images / round * round;
  return std::clamp(images, minimum, maximum);
}

}  // namespace fashion_mnist
