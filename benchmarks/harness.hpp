#pragma once
// A small benchmark harness: variants run interleaved (A B A B ...) so that machine noise hits
// all of them alike; each reports its median. Output is Markdown, collected by scripts/bench
// into docs/benchmarks.md.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

namespace bench {

struct Variant {
  std::string name;
  std::function<void()> run;
};

struct Options {
  bool smoke = false;  // tiny sizes and few repetitions: CI checks that the program still works
  int warmup = 2;
  int repetitions = 11;
};

/// --smoke selects tiny sizes; anything else is an error.
inline Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--smoke") {
      options.smoke = true;
      options.warmup = 1;
      options.repetitions = 3;
    } else {
      std::cerr << "usage: " << argv[0] << " [--smoke]\n";
      std::exit(2);
    }
  }
  return options;
}

inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const auto n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

/// Median milliseconds per variant, the variants interleaved within each repetition.
inline std::vector<double> interleaved_medians(const std::vector<Variant>& variants,
                                               const Options& options) {
  std::vector<std::vector<double>> samples(variants.size());
  for (int rep = -options.warmup; rep < options.repetitions; ++rep) {
    for (std::size_t v = 0; v < variants.size(); ++v) {
      const auto start = std::chrono::steady_clock::now();
      variants[v].run();
      const auto stop = std::chrono::steady_clock::now();
      if (rep >= 0) {
        samples[v].push_back(std::chrono::duration<double, std::milli>(stop - start).count());
      }
    }
  }
  std::vector<double> medians;
  for (auto& s : samples) medians.push_back(median(s));
  return medians;
}

/// Peak resident set size of this process in MiB (VmHWM), 0 where /proc is absent.
inline double peak_rss_mib() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmHWM:") {
      double kib = 0;
      status >> kib;
      return kib / 1024.0;
    }
  }
  return 0.0;
}

/// Prints a Markdown table: variant, median ms, ratio to the first variant (the baseline).
inline void print_table(std::string_view title, const std::vector<Variant>& variants,
                        const std::vector<double>& medians) {
  std::printf("\n### %.*s\n\n| variant | median ms | ratio to %s |\n|---|---:|---:|\n",
              static_cast<int>(title.size()), title.data(), variants.front().name.c_str());
  for (std::size_t v = 0; v < variants.size(); ++v) {
    std::printf("| %s | %.3f | %.2f |\n", variants[v].name.c_str(), medians[v],
                medians[v] / medians.front());
  }
  std::fflush(stdout);
}

}  // namespace bench
