#pragma once
/// What this LibTorch and this CPU can do in low precision: compile-time flags of the LibTorch in
/// use, the CPU's instruction-set flags, whether bf16 is faster or slower than fp32 here, and the
/// one case where fp16 training on a CPU is pathologically slow. The Trainer and mixprec::advise
/// consult them; so can a user's code.
///
///   const auto& cpu = mixprec::cpu_capabilities();
///   if (cpu.bf16_slow) { /* bf16 saves memory here, not time: FullPrecision is faster */ }
///   if (cpu.fp16_conv_weight_grad_slow) { /* use mixprec::nn::Conv2d with fp32_weight_grad */ }
///   std::cout << cpu;  // "AMD EPYC ...: avx2 avx512f avx512_bf16; bf16: ...; fp16 convolutions: ..."
///
/// The flags and the bf16 verdict (no timing) are cpu_flags.hpp's.
///
/// The slow case is decided from what cannot flip: the flags (AVX512-FP16 without AMX-FP16 sends
/// fp16 convolutions to oneDNN, whose weight gradient there is its reference loop). A timing only
/// confirms it, and overrules the flags only where fp16 is unmistakably fast (a LibTorch with a
/// better kernel): a busy machine cannot make it so. A process that spawns others hands its
/// decision down in MIXPREC_FP16_CONV_WEIGHT_GRAD (fp16_conv_weight_grad_setting), so that a
/// process tree decides once.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/cpu_flags.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <limits>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>

namespace mixprec {

/// The environment variable that hands a decision on fp16 convolution weight gradients to a
/// process: "slow" or "fast", optionally ":RATIO" (fp16's time over fp32's, as measured), e.g.
/// "slow:106". Set, cpu_capabilities() times nothing and takes it; a bad value is an Error.
inline constexpr const char* fp16_conv_weight_grad_env = "MIXPREC_FP16_CONV_WEIGHT_GRAD";

namespace detail {

// The timing's convolution (16 -> 32 channels, 3x3, 14x14): big enough that the reference loop
// is over 100x fp32 on the Xeon (an 8-channel one measures ~48x on a quiet machine).
inline constexpr std::int64_t kProbeConv[] = {1, 16, 32, 14};  // batch, in, out, side

// Seconds per weight gradient of the timing's convolution in `dtype`, over `ops` of them.
inline double conv_weight_grad_seconds(at::ScalarType dtype, int ops) {
  at::NoGradGuard no_grad;
  const auto [n, in, out, side] = kProbeConv;
  const auto options = at::TensorOptions(dtype);
  const auto input = at::ones({n, in, side, side}, options);
  const auto weight = at::ones({out, in, 3, 3}, options);
  const auto grad_output = at::ones({n, out, side, side}, options);
  at::Tensor grad_weight;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < std::max(ops, 1); ++i) {
    grad_weight = std::get<1>(at::convolution_backward(grad_output, input, weight,
                                                       at::OptionalIntArrayRef(), {1, 1}, {1, 1},
                                                       {1, 1}, false, {0, 0}, 1,
                                                       {false, true, false}));
  }
  (void)grad_weight.sum().item<float>();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return s / std::max(ops, 1);
}

/// One sample of the timing: seconds per weight gradient in `dtype`, over `ops` of them. Tests
/// pass their own to force noisy timings.
using ConvTimer = std::function<double(at::ScalarType dtype, int ops)>;

// Rounds of the timing, each an fp32 sample then an fp16 one, so that load falls on both alike;
// the minima are compared (load only ever adds time).
inline constexpr int kProbeRounds = 5;
// fp32 weight gradients per fp32 sample: its wall time is then comparable to one fp16 sample's,
// so a delay that hits both alike (a preempted thread) leaves the ratio above this count.
inline constexpr int kFp32OpsPerSample = 16;
// Below this fp16 / fp32 ratio, fp16 is fast whatever the flags say (a real kernel takes about
// fp32's time; ATen's own, 0.3-4x); the reference loop measures over 100x. Far from both
// regimes: to cross it, every fp32 sample must be slowed ~25x while some fp16 sample is not.
inline constexpr double kFastConvRatio = 4.0;

// The timing's fp16 / fp32 ratio: the minimum of each dtype's samples; each dtype's first
// sample creates the kernel and is not counted. NaN where the timer gave nonsense.
inline double timed_fp16_conv_ratio(const ConvTimer& time) {
  (void)time(at::kFloat, 1);
  (void)time(at::kHalf, 1);
  double fp32 = std::numeric_limits<double>::infinity();
  double fp16 = fp32;
  for (int round = 0; round < kProbeRounds; ++round) {
    fp32 = std::min(fp32, time(at::kFloat, kFp32OpsPerSample));
    fp16 = std::min(fp16, time(at::kHalf, 1));
  }
  const double ratio = fp16 / fp32;
  return std::isfinite(ratio) && ratio > 0 ? ratio : std::numeric_limits<double>::quiet_NaN();
}

struct Fp16ConvSetting {
  bool slow = false;
  double ratio = 0.0;  // 0: none given
};

// MIXPREC_FP16_CONV_WEIGHT_GRAD's value: "slow" or "fast", optionally ":RATIO".
inline Fp16ConvSetting parse_fp16_conv_setting(const std::string& text) {
  const auto colon = text.find(':');
  const std::string word = text.substr(0, colon);
  Fp16ConvSetting setting;
  bool ok = word == "slow" || word == "fast";
  setting.slow = word == "slow";
  if (ok && colon != std::string::npos) {
    const std::string number = text.substr(colon + 1);
    char* end = nullptr;
    setting.ratio = std::strtod(number.c_str(), &end);
    ok = !number.empty() && end == number.c_str() + number.size() && std::isfinite(setting.ratio) &&
         setting.ratio > 0;
  }
  MIXPREC_CHECK(ok, fp16_conv_weight_grad_env, "='", text,
                "' is neither slow nor fast, optionally followed by :RATIO (fp16's time over "
                "fp32's, a positive number), e.g. slow:106: it hands a parent process's decision "
                "on fp16 convolution weight gradients down; unset it to let mixprec decide");
  return setting;
}

// The decision on `flags` (the flags' fields filled): from `setting` where one is given (the
// environment's value), else from the flags, which only a clearly fast timing overrules.
inline CpuCapabilities decide_fp16_conv(CpuCapabilities c, bool half_math, const char* setting,
                                        const ConvTimer& time) {
  if (setting != nullptr) {
    const auto given = parse_fp16_conv_setting(setting);
    c.fp16_conv_weight_grad_slow = given.slow;
    c.fp16_conv_weight_grad_ratio = given.ratio;
    c.fp16_conv_weight_grad_basis = Fp16ConvBasis::environment;
    return c;
  }
  // LibTorch sends fp16 convolutions to oneDNN only where the CPU has fp16 arithmetic; elsewhere
  // ATen's own kernels run them (a few times fp32's time, not a hundred).
  c.fp16_conv_weight_grad_slow = half_math && c.avx512_fp16 && !c.amx_fp16;
  c.fp16_conv_weight_grad_ratio = 0.0;
  c.fp16_conv_weight_grad_basis = Fp16ConvBasis::flags;
  if (!c.fp16_conv_weight_grad_slow) return c;
  const double ratio = timed_fp16_conv_ratio(time);
  c.fp16_conv_weight_grad_ratio = std::isnan(ratio) ? 0.0 : ratio;
  const bool clearly_fast = ratio < kFastConvRatio;  // false for NaN: the flags stand
  c.fp16_conv_weight_grad_slow = !clearly_fast;
  c.fp16_conv_weight_grad_basis =
      clearly_fast ? Fp16ConvBasis::timing : Fp16ConvBasis::flags_and_timing;
  return c;
}

// One intra-op thread while timing: with two threads on a busy machine every op waits for the
// preempted one, and the tiny fp32 gradient took as long as the fp16 one (single ops timed at
// two threads on the Xeon at load 11: fp16 / fp32 0.4-0.8 in 20 of 20 probes; this timing, on
// one thread: 134-272). Only where LibTorch's threads are OpenMP's (the wheel's, Debian's): its
// native pool cannot be resized once used.
struct OneIntraOpThread {
  static constexpr bool resizable = AT_PARALLEL_OPENMP;
  int before = at::get_num_threads();
  OneIntraOpThread() {
    if (resizable && before != 1) at::set_num_threads(1);
  }
  ~OneIntraOpThread() {
    if (resizable && before != 1) at::set_num_threads(before);
  }
  OneIntraOpThread(const OneIntraOpThread&) = delete;
  OneIntraOpThread& operator=(const OneIntraOpThread&) = delete;
};

inline CpuCapabilities probe_cpu() {
  const auto start = std::chrono::steady_clock::now();
  auto flags = decide_bf16(cpu_flags(), x86_cpu, onednn_max_isa_setting(),
                           at::globalContext().hasMKLDNN());
  std::optional<OneIntraOpThread> one_thread;  // from the first sample to the end of the probe
  auto c = decide_fp16_conv(std::move(flags), cpu_half_math, std::getenv(fp16_conv_weight_grad_env),
                            [&one_thread](at::ScalarType dtype, int ops) {
                              if (!one_thread) one_thread.emplace();
                              return conv_weight_grad_seconds(dtype, ops);
                            });
  c.probe_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return c;
}

// "measured at 106x fp32's time" (the figure of this process or of the parent that handed it
// down), or where a setting gave no figure, what set it: for the Trainer's and advise's messages.
inline std::string fp16_conv_cost(const CpuCapabilities& c) {
  std::ostringstream text;
  if (c.fp16_conv_weight_grad_ratio > 0) {
    text << "measured here at " << std::setprecision(3) << c.fp16_conv_weight_grad_ratio
         << "x fp32's time";
  } else {
    text << "as " << fp16_conv_weight_grad_env << " says";
  }
  return text.str();
}

// A replacement for tests, which must see both answers on any CPU.
inline std::optional<CpuCapabilities>& cpu_capabilities_override() {
  static std::optional<CpuCapabilities> value;
  return value;
}

}  // namespace detail

/// This machine's CPU, probed once per process: the flags, and on a CPU with AVX512-FP16 but no
/// AMX-FP16 a timing of fp16 and fp32 convolution weight gradients that can only confirm the
/// flags' verdict unless fp16 is clearly fast (~0.1 s, on one intra-op thread); or, where
/// MIXPREC_FP16_CONV_WEIGHT_GRAD is set, that decision and no timing.
inline const CpuCapabilities& cpu_capabilities() {
  if (const auto& forced = detail::cpu_capabilities_override()) return *forced;
  static const CpuCapabilities probed = detail::probe_cpu();
  return probed;
}

/// The value of MIXPREC_FP16_CONV_WEIGHT_GRAD that hands `c`'s decision to a child process
/// ("slow:106", "fast"), so that the child decides as this process did and times nothing.
inline std::string fp16_conv_weight_grad_setting(const CpuCapabilities& c) {
  std::ostringstream text;
  text << (c.fp16_conv_weight_grad_slow ? "slow" : "fast");
  if (c.fp16_conv_weight_grad_ratio > 0) {
    text << ':' << std::setprecision(4) << c.fp16_conv_weight_grad_ratio;
  }
  return text.str();
}

/// "AMD EPYC 9R14: avx2 avx512f avx512_bf16; bf16: native (oneDNN, AVX512-BF16 or AMX-BF16); fp16
/// convolution weight gradients: ATen's kernels (no AVX512-FP16) (probed in 0.1 ms)".
inline std::ostream& operator<<(std::ostream& out, const CpuCapabilities& c) {
  out << (c.model.empty() ? std::string("unknown CPU") : c.model) << ":";
  const std::pair<bool, const char*> flags[] = {
      {c.avx2, "avx2"},         {c.avx512f, "avx512f"},   {c.avx512_bf16, "avx512_bf16"},
      {c.avx512_fp16, "avx512_fp16"}, {c.amx_bf16, "amx_bf16"}, {c.amx_fp16, "amx_fp16"}};
  for (const auto& [on, name] : flags) {
    if (on) out << ' ' << name;
  }
  if (!c.onednn_max_isa.empty()) out << " (oneDNN capped: ONEDNN_MAX_CPU_ISA=" << c.onednn_max_isa << ")";
  out << "; bf16: ";
  switch (c.bf16_kernels) {
    case Bf16Kernels::native: out << "native (oneDNN, AVX512-BF16 or AMX-BF16)"; break;
    case Bf16Kernels::emulated: out << "slower than fp32 (oneDNN converts: no AVX512-BF16)"; break;
    case Bf16Kernels::fallback:
      out << "slower than fp32 (ATen's own loops: no AVX-512 for oneDNN)";
      break;
    case Bf16Kernels::unknown: out << "not known (not an x86 CPU)"; break;
  }
  out << "; fp16 convolution weight gradients: ";
  const auto precision = out.precision(3);
  switch (c.fp16_conv_weight_grad_basis) {
    case Fp16ConvBasis::environment:
      out << (c.fp16_conv_weight_grad_slow ? "slow" : "fast") << ", as "
          << fp16_conv_weight_grad_env << "=" << fp16_conv_weight_grad_setting(c)
          << " says (nothing timed)";
      break;
    case Fp16ConvBasis::flags_and_timing:
      out << "oneDNN's reference loop (AVX512-FP16 without AMX-FP16), timed at "
          << c.fp16_conv_weight_grad_ratio << "x fp32";
      break;
    case Fp16ConvBasis::timing:
      out << "fast, timed at " << c.fp16_conv_weight_grad_ratio
          << "x fp32 (the flags, AVX512-FP16 without AMX-FP16, suggested oneDNN's reference loop)";
      break;
    case Fp16ConvBasis::flags:
      if (!cpu_half_math) {
        out << "none (this LibTorch computes no fp16 on the CPU)";
      } else {
        out << (c.avx512_fp16 ? "oneDNN (AMX-FP16)" : "ATen's kernels (no AVX512-FP16)");
      }
      break;
  }
  if (c.fp16_conv_weight_grad_slow) {
    out << " (compute them in fp32: mixprec::nn::Conv2d, fp32_weight_grad)";
  }
  out << " (probed in " << c.probe_seconds * 1000 << " ms)";
  out.precision(precision);
  return out;
}

}  // namespace mixprec
