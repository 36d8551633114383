// mixprec::cpu_capabilities(): the instruction-set flags against the kernel's own view of the CPU
// (/proc/cpuinfo), and the verdict on fp16 convolution weight gradients: from the flags, which
// forced noisy timings (a busy machine) never flip, or handed down in the environment.
#include <mixprec/core/capabilities.hpp>

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <iomanip>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace mp = mixprec;

namespace {

std::set<std::string> proc_cpuinfo_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) == 0) {
      std::istringstream words(line.substr(line.find(':') + 1));
      std::set<std::string> flags;
      for (std::string w; words >> w;) flags.insert(w);
      return flags;
    }
  }
  return {};
}

}  // namespace

TEST_CASE("cpu_capabilities: the flags are the kernel's (/proc/cpuinfo)") {
  const auto flags = proc_cpuinfo_flags();
  if (flags.empty()) {
    MESSAGE("no /proc/cpuinfo flags line (not an x86 Linux machine): nothing to compare");
    return;
  }
  const auto& c = mp::cpu_capabilities();
  MESSAGE(c);
  CHECK(c.avx2 == (flags.count("avx2") == 1));
  CHECK(c.avx512f == (flags.count("avx512f") == 1));
  CHECK(c.avx512_bf16 == (flags.count("avx512_bf16") == 1));
  CHECK(c.avx512_fp16 == (flags.count("avx512_fp16") == 1));
  CHECK(c.amx_bf16 == (flags.count("amx_bf16") == 1));
  CHECK(c.amx_fp16 == (flags.count("amx_fp16") == 1));
  CHECK_FALSE(c.model.empty());
}

TEST_CASE("cpu_capabilities: the flags decide; the timing runs exactly where they suspect oneDNN") {
  const auto& c = mp::cpu_capabilities();
  MESSAGE(c);
  CHECK(&mp::cpu_capabilities() == &c);  // probed once
  if (c.fp16_conv_weight_grad_basis == mp::Fp16ConvBasis::environment) {
    MESSAGE(mp::fp16_conv_weight_grad_env << " is set: its decision, nothing timed");
    CHECK(c.fp16_conv_weight_grad_slow ==
          mp::detail::parse_fp16_conv_setting(std::getenv(mp::fp16_conv_weight_grad_env)).slow);
  } else {
    const bool suspect = mp::cpu_half_math && c.avx512_fp16 && !c.amx_fp16;
    CHECK((c.fp16_conv_weight_grad_basis != mp::Fp16ConvBasis::flags) == suspect);
    CHECK((c.fp16_conv_weight_grad_ratio > 0) == suspect);
    CHECK(c.fp16_conv_weight_grad_slow ==
          (suspect && c.fp16_conv_weight_grad_ratio >= mp::detail::kFastConvRatio));
  }
  // The timed op on its own: fp32 convolution weight gradients take a positive, finite time.
  const double s = mp::detail::conv_weight_grad_seconds(at::kFloat, 2);
  CHECK(s > 0);
  CHECK(s < 10);
  std::ostringstream text;
  text << c;
  CHECK(text.str().find("fp16 convolution weight gradients: ") != std::string::npos);
}

TEST_CASE("cpu_capabilities: the timing runs on one intra-op thread and gives the count back") {
  // Two threads on a busy machine made every op wait for the preempted one (the ratio fell
  // from ~100 to 0.9); the probe times on one and restores the process's setting.
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  const auto probed = mp::detail::probe_cpu();
  CHECK(at::get_num_threads() == 2);
  at::set_num_threads(before);
  CHECK(probed.fp16_conv_weight_grad_slow == mp::cpu_capabilities().fp16_conv_weight_grad_slow);
  MESSAGE("a second probe: " << probed);
}

namespace {

// A scripted timer: the seconds of each sample in order, per dtype; counts the samples taken.
struct ScriptedTimer {
  std::vector<double> fp32, fp16;
  std::size_t fp32_taken = 0, fp16_taken = 0;
  mp::detail::ConvTimer timer() {
    return [this](at::ScalarType dtype, int ops) {
      CHECK(ops == (dtype == at::kFloat && fp32_taken > 0 ? mp::detail::kFp32OpsPerSample : 1));
      auto& taken = dtype == at::kFloat ? fp32_taken : fp16_taken;
      const auto& script = dtype == at::kFloat ? fp32 : fp16;
      REQUIRE(taken < script.size());
      return script[taken++];
    };
  }
};

// A Sapphire Rapids Xeon's flags: AVX512-FP16 without AMX-FP16.
mp::CpuCapabilities xeon_flags() {
  mp::CpuCapabilities c;
  c.model = "Test Xeon";
  c.avx2 = c.avx512f = c.avx512_bf16 = c.avx512_fp16 = c.amx_bf16 = true;
  return c;
}

// Quiet-machine seconds per weight gradient of the probe's convolution on the Xeon (one thread):
// fp32 45 us, fp16 through oneDNN's reference loop 4.8 ms (~106x).
constexpr double kFp32 = 45e-6;
constexpr double kFp16 = 4.8e-3;
constexpr std::size_t kSamples = 1 + mp::detail::kProbeRounds;  // the kernel's creation + rounds

}  // namespace

TEST_CASE("cpu_capabilities: forced noisy timings never flip the flags' verdict") {
  struct Case {
    std::string name;
    std::vector<double> fp32, fp16;  // seconds per op of each sample, the first one the warm-up
  };
  const auto same = [](double v) { return std::vector<double>(kSamples, v); };
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> factor(1.0, 30.0);
  std::vector<double> random32, random16;
  for (std::size_t i = 0; i < kSamples; ++i) {
    random32.push_back(kFp32 * factor(rng));
    random16.push_back(kFp16 * factor(rng));
  }
  // A delay that hits one sample whole (a preempted thread), spread over its ops.
  const auto delayed = [](double per_op, int ops, double delay) { return per_op + delay / ops; };
  const int k = mp::detail::kFp32OpsPerSample;
  std::vector<Case> cases = {
      {"a quiet machine", same(kFp32), same(kFp16)},
      // The busy Xeon: 14.5x measured once, under 8 in a child. Here every fp32 sample is
      // 20x slower and no fp16 one is: 5.3x, under the old threshold.
      {"every fp32 sample 20x slow", same(20 * kFp32), same(kFp16)},
      {"every fp32 sample 25x slow: the margin", same(25 * kFp32), same(kFp16)},
      {"every sample delayed 5 ms", same(delayed(kFp32, k, 5e-3)), same(delayed(kFp16, 1, 5e-3))},
      {"every sample delayed 500 ms", same(delayed(kFp32, k, 0.5)), same(delayed(kFp16, 1, 0.5))},
      {"alternating: fp32 slow in even rounds, fp16 in odd ones",
       {kFp32, 50 * kFp32, kFp32, 50 * kFp32, kFp32, 50 * kFp32},
       {kFp16, kFp16, 50 * kFp16, kFp16, 50 * kFp16, kFp16}},
      {"one outlier each, and a slow warm-up",
       {1.0, kFp32, kFp32, 1000 * kFp32, kFp32, kFp32},
       {1.0, kFp16, kFp16, kFp16, 1000 * kFp16, kFp16}},
      {"every sample 1-30x slow at random", random32, random16},
      {"fp32 slow in all rounds but one",
       {kFp32, 40 * kFp32, 40 * kFp32, kFp32, 40 * kFp32, 40 * kFp32},
       same(kFp16)},
  };
  for (const auto& tc : cases) {
    CAPTURE(tc.name);
    ScriptedTimer script{tc.fp32, tc.fp16};
    const auto c = mp::detail::decide_fp16_conv(xeon_flags(), true, nullptr, script.timer());
    MESSAGE(tc.name << ": fp16 / fp32 " << c.fp16_conv_weight_grad_ratio);
    CHECK(c.fp16_conv_weight_grad_slow);
    CHECK(c.fp16_conv_weight_grad_basis == mp::Fp16ConvBasis::flags_and_timing);
    CHECK(c.fp16_conv_weight_grad_ratio >= mp::detail::kFastConvRatio);
    CHECK(script.fp32_taken == kSamples);  // every round sampled: minima over all of them
    CHECK(script.fp16_taken == kSamples);
  }
  // A timer that gives nonsense (a broken clock) leaves the flags' verdict.
  for (const double bad : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN()}) {
    ScriptedTimer script{same(bad), same(kFp16)};
    const auto c = mp::detail::decide_fp16_conv(xeon_flags(), true, nullptr, script.timer());
    CHECK(c.fp16_conv_weight_grad_slow);
    CHECK(c.fp16_conv_weight_grad_ratio == 0);
  }
}

TEST_CASE("cpu_capabilities: only a clearly fast fp16 timing overrules the flags") {
  // A LibTorch whose fp16 weight gradient is a real kernel: ~1.2x fp32 in every round, fp16's
  // samples noisy. Not slow, and it says the timing decided.
  ScriptedTimer fast{std::vector<double>(kSamples, kFp32),
                     {kFp32, 1.2 * kFp32, 9 * kFp32, 1.3 * kFp32, 1.2 * kFp32, 30 * kFp32}};
  const auto c = mp::detail::decide_fp16_conv(xeon_flags(), true, nullptr, fast.timer());
  CHECK_FALSE(c.fp16_conv_weight_grad_slow);
  CHECK(c.fp16_conv_weight_grad_basis == mp::Fp16ConvBasis::timing);
  CHECK(c.fp16_conv_weight_grad_ratio == doctest::Approx(1.2));
  std::ostringstream text;
  text << c;
  CHECK(text.str().find("fast, timed at 1.2x fp32") != std::string::npos);
}

TEST_CASE("cpu_capabilities: where the flags rule the slow path out, nothing is timed") {
  auto epyc = xeon_flags();  // AVX512-BF16 without AVX512-FP16: ATen's kernels
  epyc.avx512_fp16 = epyc.amx_bf16 = false;
  auto granite = xeon_flags();  // AMX-FP16: oneDNN's real kernels
  granite.amx_fp16 = true;
  struct Case {
    std::string name;
    mp::CpuCapabilities flags;
    bool half_math;
  };
  for (const auto& tc : {Case{"no AVX512-FP16", epyc, true}, Case{"AMX-FP16", granite, true},
                         Case{"a LibTorch without CPU fp16 (1.13)", xeon_flags(), false}}) {
    CAPTURE(tc.name);
    // A timer that would say "slow" if it were asked.
    ScriptedTimer script{std::vector<double>(kSamples, kFp32),
                         std::vector<double>(kSamples, 1000 * kFp32)};
    const auto c = mp::detail::decide_fp16_conv(tc.flags, tc.half_math, nullptr, script.timer());
    CHECK_FALSE(c.fp16_conv_weight_grad_slow);
    CHECK(c.fp16_conv_weight_grad_basis == mp::Fp16ConvBasis::flags);
    CHECK(c.fp16_conv_weight_grad_ratio == 0);
    CHECK(script.fp32_taken + script.fp16_taken == 0);
  }
}

TEST_CASE("cpu_capabilities: a decision handed down in MIXPREC_FP16_CONV_WEIGHT_GRAD is taken, "
          "nothing timed") {
  struct Case {
    std::string setting;
    bool slow;
    double ratio;
  };
  for (const auto& tc : {Case{"slow", true, 0}, Case{"fast", false, 0}, Case{"slow:106", true, 106},
                         Case{"fast:1.25", false, 1.25}}) {
    CAPTURE(tc.setting);
    for (auto flags : {xeon_flags(), mp::CpuCapabilities{}}) {  // the flags do not matter
      ScriptedTimer script;  // no samples: taking one fails
      const auto c = mp::detail::decide_fp16_conv(flags, true, tc.setting.c_str(), script.timer());
      CHECK(c.fp16_conv_weight_grad_slow == tc.slow);
      CHECK(c.fp16_conv_weight_grad_ratio == tc.ratio);
      CHECK(c.fp16_conv_weight_grad_basis == mp::Fp16ConvBasis::environment);
      CHECK(script.fp32_taken + script.fp16_taken == 0);
      std::ostringstream text;
      text << c;
      CHECK(text.str().find(std::string(", as MIXPREC_FP16_CONV_WEIGHT_GRAD=") + tc.setting +
                            " says (nothing timed)") != std::string::npos);
    }
  }
  // What a parent hands down is what its child decides: the verdict, and the figure to 4 digits.
  ScriptedTimer quiet{std::vector<double>(kSamples, kFp32), std::vector<double>(kSamples, kFp16)};
  const auto parent = mp::detail::decide_fp16_conv(xeon_flags(), true, nullptr, quiet.timer());
  const auto setting = mp::fp16_conv_weight_grad_setting(parent);
  CHECK(setting == "slow:106.7");
  ScriptedTimer none;
  const auto child = mp::detail::decide_fp16_conv(mp::CpuCapabilities{}, true, setting.c_str(),
                                                  none.timer());
  CHECK(child.fp16_conv_weight_grad_slow);
  CHECK(child.fp16_conv_weight_grad_ratio ==
        doctest::Approx(parent.fp16_conv_weight_grad_ratio).epsilon(1e-3));
  CHECK(mp::fp16_conv_weight_grad_setting(mp::CpuCapabilities{}) == "fast");
  // The Trainer's and advise's messages quote the figure, or the setting where it gave none.
  CHECK(mp::detail::fp16_conv_cost(child) == "measured here at 107x fp32's time");
  mp::CpuCapabilities bare;
  bare.fp16_conv_weight_grad_slow = true;
  CHECK(mp::detail::fp16_conv_cost(bare) == "as MIXPREC_FP16_CONV_WEIGHT_GRAD says");
}

TEST_CASE("cpu_capabilities: a bad MIXPREC_FP16_CONV_WEIGHT_GRAD is an Error with the format") {
  for (const std::string bad : {"", "SLOW", "maybe", "slow:", "slow:abc", "slow:-3", "slow:0",
                                "fast:inf", "slow:12x", "slow 12"}) {
    CAPTURE(bad);
    ScriptedTimer none;
    const std::string expected = "MIXPREC_FP16_CONV_WEIGHT_GRAD='" + bad +
                                 "' is neither slow nor fast, optionally followed by :RATIO";
    CHECK_THROWS_WITH_AS(
        mp::detail::decide_fp16_conv(xeon_flags(), true, bad.c_str(), none.timer()),
        doctest::Contains(expected.c_str()), mp::Error);
  }
}

TEST_CASE("cpu_capabilities: printing leaves the stream's precision as it was") {
  std::ostringstream text;
  text << std::setprecision(9);
  ScriptedTimer quiet{std::vector<double>(kSamples, kFp32), std::vector<double>(kSamples, kFp16)};
  text << mp::detail::decide_fp16_conv(xeon_flags(), true, nullptr, quiet.timer());
  CHECK(text.str().find("oneDNN's reference loop (AVX512-FP16 without AMX-FP16), timed at 107x "
                        "fp32 (compute them in fp32") != std::string::npos);
  CHECK(text.precision() == 9);
}
