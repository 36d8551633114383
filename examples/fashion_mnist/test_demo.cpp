// The demo's own pieces (report.hpp, child.hpp): result files between the processes, the table
// with each run's convolution weight gradients, the CSV plot.py reads, the fp16 group's size from
// a time budget, /proc's peak memory, and the environment a child inherits.
#include "child.hpp"
#include "report.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace fm = fashion_mnist;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

fm::PolicyResult sample() {
  fm::PolicyResult r;
  r.policy = "MixedO2<Half>";
  r.conv_weight_grads = "fp32";
  r.remedy = true;
  r.images = 12000;
  r.test_accuracy = 0.8765;
  r.seconds_per_epoch = 12.25;
  r.peak_rss_mib = 420.5;
  r.training_peak_mib = -1;
  r.steps = 3;
  r.skipped_steps = 1;
  r.final_scale = 32768;
  r.losses = {2.3, std::numeric_limits<double>::quiet_NaN(), 0.1 + 0.2};
  r.scales = {65536, 32768, 32768};
  return r;
}

}  // namespace

TEST_CASE("demo: result files round-trip, broken ones are refused") {
  const auto r = sample();
  std::stringstream file;
  fm::write_result(file, r);
  const fm::PolicyResult back = fm::read_result(file);
  CHECK(back.policy == r.policy);
  CHECK(back.conv_weight_grads == "fp32");
  CHECK(back.remedy);
  CHECK(back.images == 12000);
  CHECK(back.test_accuracy == r.test_accuracy);
  CHECK(back.seconds_per_epoch == r.seconds_per_epoch);
  CHECK(back.peak_rss_mib == r.peak_rss_mib);
  CHECK(back.training_peak_mib == r.training_peak_mib);
  CHECK(back.steps == 3);
  CHECK(back.skipped_steps == 1);
  CHECK(back.final_scale == 32768);
  REQUIRE(back.losses.size() == 3);
  CHECK(back.losses[0] == 2.3);
  CHECK(std::isnan(back.losses[1]));
  CHECK(back.losses[2] == 0.1 + 0.2);  // 17 digits: exact
  CHECK(back.scales == r.scales);

  auto plain = r;
  plain.conv_weight_grads = "fp16";
  plain.remedy = false;
  std::stringstream plain_file;
  fm::write_result(plain_file, plain);
  const auto plain_back = fm::read_result(plain_file);
  CHECK(plain_back.conv_weight_grads == "fp16");
  CHECK_FALSE(plain_back.remedy);

  std::istringstream empty("");
  CHECK_THROWS_WITH_AS(fm::read_result(empty), doctest::Contains("not a result file"),
                       std::runtime_error);
  const std::string text = file.str();
  std::istringstream truncated(text.substr(0, text.size() / 2));
  CHECK_THROWS_WITH_AS(fm::read_result(truncated), doctest::Contains("result file: "),
                       std::runtime_error);
  std::istringstream unknown(std::string(fm::kResultHeader) + "\nbogus 1\nend\n");
  CHECK_THROWS_WITH_AS(fm::read_result(unknown), doctest::Contains("unknown key 'bogus'"),
                       std::runtime_error);
}

TEST_CASE("demo: the table, relative to its first row, says each run's conv weight gradients") {
  fm::PolicyResult a;
  a.policy = "FullPrecision";
  a.conv_weight_grads = "fp32";
  a.images = 60000;
  a.test_accuracy = 0.9;
  a.seconds_per_epoch = 10;
  a.peak_rss_mib = 400;
  a.training_peak_mib = 20;
  fm::PolicyResult b = a;
  b.policy = "MixedO1<BFloat16>";
  b.test_accuracy = 0.8975;
  b.seconds_per_epoch = 5;
  b.training_peak_mib = -1;
  b.conv_weight_grads = "bf16";
  // The run: a Half policy without the remedy, on the same footing as those with it.
  fm::PolicyResult without = sample();
  without.policy = "PureHalf<Half>";
  without.conv_weight_grads = "fp16";
  without.remedy = false;
  const std::string table = fm::format_table({a, b, sample(), without});
  CHECK(contains(table, "| policy | conv weight grads | images |"));
  CHECK(contains(table, "| FullPrecision | fp32 | 60000 | 90.00% | +0.00 pp | 10.00 | 1.00x | "
                        "400.0 | 20.0 |"));
  CHECK(contains(table, "| MixedO1<BFloat16> | bf16 | 60000 | 89.75% | -0.25 pp | 5.00 | 2.00x | "
                        "400.0 | n/a |"));
  CHECK(contains(table, "| MixedO2<Half> | fp32 (remedy) | 12000 | 87.65% | -2.35 pp |"));
  CHECK(contains(table, "| PureHalf<Half> | fp16 | 12000 | 87.65% | -2.35 pp |"));
  // The log and the CSV name a run with the remedy so.
  CHECK(fm::label(sample()) == "MixedO2<Half> (fp32 conv weight grads)");
  CHECK(fm::label(without) == "PureHalf<Half>");
}

TEST_CASE("demo: the CSV has a row per step of each run, labelled, with nan kept") {
  std::ostringstream out;
  fm::write_csv(out, {{"fp16", sample()}});
  const std::string csv = out.str();
  CHECK(contains(csv, "run,dtype,images,step,loss,scale\n"));
  CHECK(contains(csv, "\"MixedO2<Half> (fp32 conv weight grads)\",fp16,12000,1,2.3,65536\n"));
  CHECK(contains(csv, ",fp16,12000,2,nan,32768\n"));
  CHECK(contains(csv, ",fp16,12000,3,0.3,32768\n"));  // 9 digits: what a plot needs
  std::size_t lines = 0;
  for (const char ch : csv) lines += ch == '\n';
  CHECK(lines == 4);
}

TEST_CASE("demo: the fp16 group takes the images that fit the time budget") {
  // Four runs at 10 + 50 + 50 + 90 ms a step: 0.2 s per batch of each; 100 s over 2 epochs is
  // 250 steps of 64 images: 16000.
  CHECK(fm::images_within_budget(100, {0.01, 0.05, 0.05, 0.09}, 2, 64, 2000, 60000) == 16000);
  CHECK(fm::images_within_budget(100, {0.01, 0.05, 0.05, 0.09}, 2, 64, 2000, 60000, 64) == 16000);
  // Rounded down, never more than the budget.
  CHECK(fm::images_within_budget(101, {0.2}, 2, 64, 2000, 60000) == 16000);
  // Bounded: a fast machine takes all, a pathologically slow one (fp16 through a reference
  // loop) still the minimum, and a failed measurement the minimum.
  CHECK(fm::images_within_budget(1e6, {0.001}, 3, 64, 2000, 60000) == 60000);
  CHECK(fm::images_within_budget(100, {5.0}, 3, 64, 2000, 60000) == 2000);
  CHECK(fm::images_within_budget(100, {}, 3, 64, 2000, 60000) == 2000);
  CHECK(fm::images_within_budget(100, {std::nan("")}, 3, 64, 2000, 60000) == 2000);
}

TEST_CASE("demo: /proc status parsing") {
  std::istringstream status("Name:\tx\nVmPeak:\t  999 kB\nVmHWM:\t  2048 kB\nVmRSS:\t 1024 kB\n");
  CHECK(fm::status_kib(status, "VmHWM:") == 2048);
  std::istringstream none("Name:\tx\n");
  CHECK(fm::status_kib(none, "VmHWM:") == -1);
  // Linux has /proc: this process's peak is a positive size (failure is -1).
  CHECK(fm::self_status_mib("VmHWM:") > 0);
  CHECK(fm::self_status_mib("NoSuchKey:") == -1);
}

TEST_CASE("demo: a child inherits the environment with the parent's decision, set once") {
  std::string a = "PATH=/usr/bin", b = "MIXPREC_FP16_CONV_WEIGHT_GRAD=fast",
              d = "MIXPREC_FP16_CONV_WEIGHT_GRAD_X=1", e = "HOME=/root";
  char* parent[] = {a.data(), b.data(), d.data(), e.data(), nullptr};
  // Replaced where the parent had it (a user's value the parent itself decided from), the rest
  // kept in order; a name that merely begins the same is another variable.
  CHECK(fm::environment_with(parent, "MIXPREC_FP16_CONV_WEIGHT_GRAD", "slow:250") ==
        std::vector<std::string>{"PATH=/usr/bin", "MIXPREC_FP16_CONV_WEIGHT_GRAD_X=1",
                                 "HOME=/root", "MIXPREC_FP16_CONV_WEIGHT_GRAD=slow:250"});
  char* none[] = {a.data(), nullptr};
  CHECK(fm::environment_with(none, "MIXPREC_FP16_CONV_WEIGHT_GRAD", "fast") ==
        std::vector<std::string>{"PATH=/usr/bin", "MIXPREC_FP16_CONV_WEIGHT_GRAD=fast"});
  CHECK(fm::environment_with(nullptr, "X", "1") == std::vector<std::string>{"X=1"});
}
