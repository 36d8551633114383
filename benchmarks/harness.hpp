#pragma once
// The benchmarks' one harness. Variants run interleaved, in order in even repetitions and in
// reverse order in odd ones, so that machine noise hits all of them alike and each follows each
// of its neighbours equally often. A table gives each variant's median and its ratio to the
// baseline paired per repetition (the median of the per-repetition ratios, with their
// interquartile range): the noise that two variants share in one repetition cancels there.
// Output is Markdown, collected by scripts/bench into docs/benchmarks.md. Also: RSS readings from
// /proc for the memory benchmarks.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

namespace bench {

using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

inline std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

struct Options {
  bool smoke = false;  // tiny sizes and few repetitions: CI checks that the program still works
  int warmup = 2;
  int repetitions = 11;
};

inline Options options_for(bool smoke) {
  Options options;
  if (smoke) {
    options.smoke = true;
    options.warmup = 1;
    options.repetitions = 3;
  }
  return options;
}

/// --smoke selects tiny sizes; anything else is an error.
inline Options parse_options(int argc, char** argv) {
  bool smoke = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) != "--smoke") {
      std::cerr << "usage: " << argv[0] << " [--smoke]\n";
      std::exit(2);
    }
    smoke = true;
  }
  return options_for(smoke);
}

/// How the tables were measured, for a program's introduction.
inline std::string method(const Options& options) {
  return "Medians of " + std::to_string(options.repetitions) +
         " repetitions, the variants interleaved in alternating order (" +
         std::to_string(options.warmup) +
         " warm-up); ratios are paired per repetition: their median and interquartile range.";
}

/// The q-quantile of `values`, interpolated linearly between neighbours.
inline double quantile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  const double position = q * static_cast<double>(values.size() - 1);
  const auto below = static_cast<std::size_t>(position);
  const auto above = std::min(below + 1, values.size() - 1);
  const double fraction = position - static_cast<double>(below);
  return values[below] * (1.0 - fraction) + values[above] * fraction;
}

inline double median(const std::vector<double>& values) { return quantile(values, 0.5); }

/// The median of per-repetition values and the quartiles around it.
struct Quartiles {
  double q1 = 0;
  double median = 0;
  double q3 = 0;
};

inline Quartiles quartiles(const std::vector<double>& values) {
  return {quantile(values, 0.25), quantile(values, 0.5), quantile(values, 0.75)};
}

/// numerator[r] / denominator[r] for each repetition r.
inline Quartiles paired_ratio(const std::vector<double>& numerator,
                              const std::vector<double>& denominator) {
  std::vector<double> ratios;
  for (std::size_t r = 0; r < numerator.size(); ++r) {
    ratios.push_back(numerator[r] / denominator[r]);
  }
  return quartiles(ratios);
}

/// a[r] - b[r] for each repetition r.
inline Quartiles paired_difference(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> differences;
  for (std::size_t r = 0; r < a.size(); ++r) differences.push_back(a[r] - b[r]);
  return quartiles(differences);
}

/// "q1-q3", for a table's IQR column.
inline std::string iqr(const Quartiles& q, int digits) {
  return fixed(q.q1, digits) + "-" + fixed(q.q3, digits);
}

/// Samples [variant][repetition]: measure(v) runs variant v once and returns its sample.
using Samples = std::vector<std::vector<double>>;

template <class Measure>
Samples interleaved_samples(std::size_t count, const Options& options, Measure&& measure) {
  Samples samples(count);
  for (int rep = -options.warmup; rep < options.repetitions; ++rep) {
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t v = (rep + options.warmup) % 2 == 0 ? i : count - 1 - i;
      const double sample = measure(v);
      if (rep >= 0) samples[v].push_back(sample);
    }
  }
  return samples;
}

struct Variant {
  std::string name;
  std::function<void()> run;
};

/// Milliseconds per run, [variant][repetition].
inline Samples interleaved_samples(const std::vector<Variant>& variants, const Options& options) {
  return interleaved_samples(variants.size(), options, [&](std::size_t v) {
    const auto start = Clock::now();
    variants[v].run();
    return ms_since(start);
  });
}

/// Microseconds per call of `f`: the median of 7 batches of `calls` calls.
template <class F>
double us_per_call(int calls, F&& f) {
  std::vector<double> batches;
  for (int b = 0; b < 7; ++b) {
    const auto start = Clock::now();
    for (int i = 0; i < calls; ++i) f();
    batches.push_back(ms_since(start) * 1000.0 / calls);
  }
  return median(batches);
}

/// A Markdown table: each variant's median ms and its paired ratio to the first, the baseline.
inline void print_table(std::string_view title, const std::vector<Variant>& variants,
                        const Samples& ms) {
  std::printf("\n### %.*s\n\n| variant | median ms | ratio to %s | ratio IQR |\n"
              "|---|---:|---:|---:|\n",
              static_cast<int>(title.size()), title.data(), variants.front().name.c_str());
  for (std::size_t v = 0; v < variants.size(); ++v) {
    const auto ratio = paired_ratio(ms[v], ms.front());
    // Two decimals, or two significant digits below 0.01: a stall of the baseline in one
    // repetition must not print a positive ratio as 0.00.
    std::printf(ratio.median >= 0.01 ? "| %s | %.3f | %.2f | %s |\n" : "| %s | %.3f | %.2g | %s |\n",
                variants[v].name.c_str(), median(ms[v]), ratio.median, iqr(ratio, 2).c_str());
  }
  std::fflush(stdout);
}

// ---------------------------------------------------------------------------------------------
// Memory, from /proc (zeros where it is absent).

/// Fields of /proc/self/status, in MiB.
struct MemoryStatus {
  double rss = 0;   // VmRSS
  double peak = 0;  // VmHWM
  double file = 0;  // RssFile + RssShmem: mapped files (code) and shared memory
};

inline MemoryStatus memory_status() {
  std::ifstream status("/proc/self/status");
  MemoryStatus m;
  std::string key;
  while (status >> key) {
    if (key != "VmRSS:" && key != "VmHWM:" && key != "RssFile:" && key != "RssShmem:") continue;
    double kib = 0;
    status >> kib;
    const double mib = kib / 1024.0;
    if (key == "VmRSS:") m.rss = mib;
    if (key == "VmHWM:") m.peak = mib;
    if (key == "RssFile:" || key == "RssShmem:") m.file += mib;
  }
  return m;
}

/// Resident anonymous memory in MiB (resident minus shared pages), cheap enough to poll.
inline double anonymous_mib() {
  std::ifstream statm("/proc/self/statm");
  long size = 0;
  long resident = 0;
  long shared = 0;
  statm >> size >> resident >> shared;
  return static_cast<double>(resident - shared) * static_cast<double>(sysconf(_SC_PAGESIZE)) /
         (1024.0 * 1024.0);
}

/// Makes VmHWM restart from the current RSS (Linux >= 4.0).
inline bool reset_peak_rss() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  clear_refs.flush();
  return static_cast<bool>(clear_refs);
}

}  // namespace bench
