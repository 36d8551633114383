// mixprec::cpu_capabilities(): the instruction-set flags against the kernel's own view of the CPU
// (/proc/cpuinfo); the verdict on bf16 (from the flags and oneDNN's cap, ONEDNN_MAX_CPU_ISA) and
// what a Trainer and advise() say on a CPU where bf16 is slow; the verdict on fp16 convolution
// weight gradients: from the flags, which forced noisy timings (a busy machine) never flip, or
// handed down in the environment.
#include <mixprec/core/capabilities.hpp>
#include <mixprec/mixprec.hpp>

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <iomanip>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdlib.h>
#include <string>
#include <vector>

namespace test_capabilities {  // one namespace a file: unity groups (tests/CMakeLists.txt)

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

// ---------------------------------------------------------------------------------------------
// bf16: native, emulated or ATen's loops, from the flags and oneDNN's cap; the Trainer's warning
// and advise()'s reason where it is slow.

namespace {

// The AMD EPYC of CI: AVX512-BF16, no AVX512-FP16, no AMX.
mp::CpuCapabilities epyc_bf16_flags() {
  mp::CpuCapabilities c;
  c.model = "Test EPYC";
  c.avx2 = c.avx512f = c.avx512_bf16 = true;
  return c;
}

// Sets an environment variable for a scope, and puts back what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace

TEST_CASE("cpu_capabilities: bf16 is native, emulated or ATen's loops by the flags and oneDNN's "
          "cap") {
  auto avx2_only = epyc_bf16_flags();  // Zen 2/3: the AVX2-only EPYC
  avx2_only.avx512f = avx2_only.avx512_bf16 = false;
  auto cascade_lake = epyc_bf16_flags();  // AVX-512 without bf16 instructions
  cascade_lake.avx512_bf16 = false;
  auto sapphire = xeon_flags();  // AVX512-BF16 and AMX-BF16
  struct Case {
    std::string name;
    mp::CpuCapabilities flags;
    std::string cap;
    bool onednn;
    mp::Bf16Kernels kernels;
  };
  using K = mp::Bf16Kernels;
  const Case cases[] = {
      {"EPYC, no cap", epyc_bf16_flags(), "", true, K::native},
      {"EPYC, ONEDNN_MAX_CPU_ISA=AVX2 (the emulation of an AVX2-only CPU)", epyc_bf16_flags(),
       "AVX2", true, K::fallback},
      {"EPYC, lower case, as oneDNN 3.x reads it", epyc_bf16_flags(), "avx2", true, K::fallback},
      {"EPYC, capped at AVX-512 without bf16", epyc_bf16_flags(), "AVX512_CORE_VNNI", true,
       K::emulated},
      {"EPYC, capped at AVX512_CORE_BF16", epyc_bf16_flags(), "AVX512_CORE_BF16", true, K::native},
      {"EPYC, DEFAULT", epyc_bf16_flags(), "DEFAULT", true, K::native},
      {"EPYC, a name oneDNN does not know caps nothing", epyc_bf16_flags(), "bogus", true,
       K::native},
      {"EPYC, a LibTorch without oneDNN", epyc_bf16_flags(), "", false, K::fallback},
      {"AVX2-only", avx2_only, "", true, K::fallback},
      {"AVX2-only, whatever the cap", avx2_only, "AVX512_CORE_AMX", true, K::fallback},
      {"AVX-512 without bf16", cascade_lake, "", true, K::emulated},
      {"Sapphire Rapids", sapphire, "", true, K::native},
      {"Sapphire Rapids without AMX (AVX512_CORE_BF16)", sapphire, "AVX512_CORE_BF16", true,
       K::native},
  };
  for (const auto& tc : cases) {
    CAPTURE(tc.name);
    const auto c = mp::detail::decide_bf16(tc.flags, true, tc.cap, tc.onednn);
    CHECK(c.bf16_kernels == tc.kernels);
    CHECK(c.bf16_slow == (tc.kernels != K::native));
    CHECK(c.onednn_max_isa == tc.cap);
    std::ostringstream text;
    text << c;
    CHECK(text.str().find(tc.kernels == K::native ? "bf16: native" : "bf16: slower than fp32") !=
          std::string::npos);
  }
  // Not an x86 CPU: nothing known, nothing claimed.
  const auto other = mp::detail::decide_bf16(mp::CpuCapabilities{}, false, "", true);
  CHECK(other.bf16_kernels == K::unknown);
  CHECK_FALSE(other.bf16_slow);
  // The reason names what the CPU lacks, or the cap that hides what it has.
  CHECK(mp::detail::slow_bf16_reason(mp::detail::decide_bf16(avx2_only, true, "", true))
            .find("Test EPYC has no AVX512-BF16 or AMX-BF16: LibTorch computes bf16 matrix "
                  "products and convolutions with ATen's own loops") != std::string::npos);
  CHECK(mp::detail::slow_bf16_reason(mp::detail::decide_bf16(epyc_bf16_flags(), true, "AVX2", true))
            .find("has AVX512-BF16 but oneDNN may not use it (ONEDNN_MAX_CPU_ISA=AVX2)") !=
        std::string::npos);
  CHECK(mp::detail::slow_bf16_reason(mp::detail::decide_bf16(cascade_lake, true, "", true))
            .find("oneDNN converts bf16 to fp32") != std::string::npos);
}

TEST_CASE("cpu_capabilities: the probe reads ONEDNN_MAX_CPU_ISA, then DNNL_MAX_CPU_ISA") {
  const auto flags = mp::detail::cpu_flags();
  const bool onednn = at::globalContext().hasMKLDNN();
  {
    ScopedEnv onednn_cap("ONEDNN_MAX_CPU_ISA", "AVX2");
    ScopedEnv dnnl_cap("DNNL_MAX_CPU_ISA", "AVX512_CORE_BF16");
    const auto c = mp::detail::probe_cpu();
    CHECK(c.onednn_max_isa == "AVX2");
    if (mp::detail::x86_cpu) CHECK(c.bf16_kernels == mp::Bf16Kernels::fallback);
    MESSAGE("under ONEDNN_MAX_CPU_ISA=AVX2: " << c);
  }
  {
    ScopedEnv onednn_cap("ONEDNN_MAX_CPU_ISA", nullptr);
    ScopedEnv dnnl_cap("DNNL_MAX_CPU_ISA", "AVX2");
    CHECK(mp::detail::probe_cpu().onednn_max_isa == "AVX2");
  }
  {
    ScopedEnv onednn_cap("ONEDNN_MAX_CPU_ISA", nullptr);
    ScopedEnv dnnl_cap("DNNL_MAX_CPU_ISA", nullptr);
    const auto c = mp::detail::probe_cpu();
    CHECK(c.onednn_max_isa.empty());
    if (mp::detail::x86_cpu) {
      CHECK(c.bf16_slow == !(onednn && (flags.avx512_bf16 || flags.amx_bf16)));
    }
  }
}

namespace {

// A small CNN and an MLP for the bf16 warning: what a Trainer builds on, and advise() watches.
struct Bf16Net : torch::nn::Module {
  torch::nn::Conv2d conv{torch::nn::Conv2dOptions(1, 4, 3).padding(1)};
  torch::nn::Linear fc{4 * 8 * 8, 3};
  Bf16Net() {
    register_module("conv", conv);
    register_module("fc", fc);
  }
  at::Tensor forward(const at::Tensor& x) { return fc(torch::relu(conv(x)).flatten(1)); }
};

// The warnings a Trainer<P> gives on a fresh model under `caps`, the once-flag reset first.
template <class P>
std::vector<std::string> bf16_warnings(const mp::CpuCapabilities& caps, bool reset = true) {
  mp::detail::cpu_capabilities_override() = caps;
  if (reset) mp::detail::slow_bf16_warned() = false;
  std::vector<std::string> warnings;
  torch::manual_seed(3);
  auto model = std::make_shared<Bf16Net>();
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05));
  mp::Trainer<P> trainer(model, sgd, mp::TrainerOptions().on_warning([&](const std::string& w) {
    warnings.push_back(w);
  }));
  mp::detail::cpu_capabilities_override().reset();
  return warnings;
}

}  // namespace

TEST_CASE("a Trainer computing in bf16 warns once where the CPU has no bf16 hardware, never "
          "where it has") {
  auto slow = mp::detail::decide_bf16(epyc_bf16_flags(), true, "AVX2", true);  // as emulated
  auto avx2_only = epyc_bf16_flags();
  avx2_only.avx512f = avx2_only.avx512_bf16 = false;
  avx2_only = mp::detail::decide_bf16(avx2_only, true, "", true);
  const auto fast = mp::detail::decide_bf16(epyc_bf16_flags(), true, "", true);
  REQUIRE(slow.bf16_slow);
  REQUIRE(avx2_only.bf16_slow);
  REQUIRE_FALSE(fast.bf16_slow);

  const auto warned = bf16_warnings<mp::MixedO2<at::BFloat16>>(avx2_only);
  REQUIRE(warned.size() == 1);
  MESSAGE(warned[0]);
  CHECK(warned[0].find("Trainer<MixedO2<BFloat16>> computes in bf16 on the CPU, and Test EPYC has "
                       "no AVX512-BF16 or AMX-BF16") != std::string::npos);
  CHECK(warned[0].find("train in FullPrecision") != std::string::npos);
  // Once per process: a second bf16 Trainer says nothing.
  CHECK(bf16_warnings<mp::PureHalf<at::BFloat16>>(avx2_only, /*reset=*/false).empty());
  // Every policy that computes in bf16 warns; the emulated CPU names its cap.
  CHECK(bf16_warnings<mp::MixedO1<at::BFloat16>>(slow).size() == 1);
  const auto capped = bf16_warnings<mp::PureHalf<at::BFloat16>>(slow);
  REQUIRE(capped.size() == 1);
  CHECK(capped[0].find("ONEDNN_MAX_CPU_ISA=AVX2") != std::string::npos);
  // A policy that computes in fp32 or fp16 says nothing of bf16.
  CHECK(bf16_warnings<mp::FullPrecision>(avx2_only).empty());
  if constexpr (mp::cpu_half_math) {
    CHECK(bf16_warnings<mp::MixedO2<at::Half>>(avx2_only).empty());
  }
  // On a CPU with bf16 hardware, never.
  CHECK(bf16_warnings<mp::MixedO2<at::BFloat16>>(fast).empty());
  CHECK(bf16_warnings<mp::MixedO1<at::BFloat16>>(fast).empty());
  CHECK(bf16_warnings<mp::PureHalf<at::BFloat16>>(fast).empty());
  mp::detail::slow_bf16_warned() = false;
}

TEST_CASE("advise() says that bf16 is slower than fp32 on a CPU without bf16 hardware") {
  auto avx2_only = epyc_bf16_flags();
  avx2_only.avx512f = avx2_only.avx512_bf16 = false;
  avx2_only = mp::detail::decide_bf16(avx2_only, true, "", true);
  const auto fast = mp::detail::decide_bf16(epyc_bf16_flags(), true, "", true);
  torch::manual_seed(4);
  const auto x = torch::randn({8, 1, 8, 8});
  const auto y = torch::randint(0, 3, {8});
  auto advise_under = [&](const mp::CpuCapabilities& caps) {
    mp::detail::cpu_capabilities_override() = caps;
    torch::manual_seed(5);
    auto model = std::make_shared<Bf16Net>();
    auto advice = mp::advise(model, [&] {
      return torch::nn::functional::cross_entropy(model->forward(x), y);
    });
    mp::detail::cpu_capabilities_override().reset();
    std::ostringstream text;
    text << advice;
    return std::pair{advice, text.str()};
  };
  const auto [slow_advice, slow_text] = advise_under(avx2_only);
  MESSAGE(slow_text);
  CHECK(slow_advice.slow_bf16);
  CHECK(slow_advice.recommended == "MixedO2<BFloat16>");  // the numerics' verdict stands
  CHECK(slow_text.find("bf16 is slower than fp32 on this CPU: Test EPYC has no AVX512-BF16 or "
                       "AMX-BF16") != std::string::npos);
  CHECK(slow_text.find("for speed here train in FullPrecision") != std::string::npos);
  CHECK(slow_text.find("bf16 is computed natively") == std::string::npos);
  const auto [fast_advice, fast_text] = advise_under(fast);
  CHECK_FALSE(fast_advice.slow_bf16);
  CHECK(fast_text.find("slower than fp32") == std::string::npos);
  CHECK(fast_text.find("bf16 is computed natively") != std::string::npos);
}

}  // namespace test_capabilities
