#pragma once
/// What this LibTorch and this CPU can do in low precision: compile-time flags of the LibTorch in
/// use, the CPU's instruction-set flags, and a probe of the one case where fp16 training on a CPU
/// is pathologically slow. The Trainer and mixprec::advise consult them; so can a user's code.
///
///   const auto& cpu = mixprec::cpu_capabilities();
///   if (cpu.fp16_conv_weight_grad_slow) { /* use mixprec::nn::Conv2d with fp32_weight_grad */ }
///   std::cout << cpu;  // "AMD EPYC ...: avx2 avx512f avx512_bf16; fp16 convolutions: ..."

#include <mixprec/compat.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define MIXPREC_X86_CPUID 1
#endif

namespace mixprec {

/// The CPU's low-precision features, and what they mean for training in fp16 on it.
struct CpuCapabilities {
  std::string model;         ///< /proc/cpuinfo's "model name", or "" where unknown
  bool avx2 = false;
  bool avx512f = false;
  bool avx512_bf16 = false;  ///< bf16 dot products (AMD Zen 4, Intel Cooper Lake and later)
  bool avx512_fp16 = false;  ///< fp16 arithmetic (Intel Sapphire Rapids and later)
  bool amx_bf16 = false;     ///< bf16 tile matrix products (Sapphire Rapids and later)
  bool amx_fp16 = false;     ///< fp16 tile matrix products (Granite Rapids and later)
  /// fp16 convolution weight gradients go to oneDNN's reference loop (`ref:any`): LibTorch sends
  /// fp16 convolutions to oneDNN on a CPU with AVX512-FP16, whose weight-gradient kernel needs
  /// AMX-FP16. Measured on a Sapphire Rapids Xeon: 114-385x fp32 per convolution, 37-39x for a
  /// whole CNN step (Python torch too). Decided by the flags and confirmed by one timed op.
  bool fp16_conv_weight_grad_slow = false;
  /// The probe's fp16 / fp32 time of one small convolution weight gradient (0: not measured,
  /// because the flags rule the case out).
  double fp16_conv_weight_grad_ratio = 0.0;
  /// How long the probe took, in seconds (the flags: microseconds; the timed op: milliseconds).
  double probe_seconds = 0.0;
};

namespace detail {

#ifdef MIXPREC_X86_CPUID
inline bool cpuid_bit(unsigned leaf, unsigned subleaf, int reg, unsigned bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (__get_cpuid_count(leaf, subleaf, &r[0], &r[1], &r[2], &r[3]) == 0) return false;
  return ((r[reg] >> bit) & 1U) != 0;
}
// XCR0: which register states the operating system saves (AVX-512's opmask/ZMM, AMX's tiles).
inline std::uint64_t xcr0() {
  if (!cpuid_bit(1, 0, 2, 27)) return 0;  // OSXSAVE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}
#endif

inline std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) break;
      auto name = line.substr(colon + 1);
      name.erase(0, name.find_first_not_of(' '));
      return name;
    }
  }
  return "";
}

inline CpuCapabilities cpu_flags() {
  CpuCapabilities c;
  c.model = cpu_model_name();
#ifdef MIXPREC_X86_CPUID
  const auto x = xcr0();
  const bool avx_state = (x & 0x6) == 0x6;       // SSE + AVX
  const bool avx512_state = (x & 0xE6) == 0xE6;  // + opmask, ZMM_Hi256, Hi16_ZMM
  const bool amx_state = (x & 0x60000) == 0x60000;  // XTILECFG + XTILEDATA
  c.avx2 = avx_state && cpuid_bit(7, 0, 1, 5);
  c.avx512f = avx512_state && cpuid_bit(7, 0, 1, 16);
  c.avx512_bf16 = c.avx512f && cpuid_bit(7, 1, 0, 5);
  c.avx512_fp16 = c.avx512f && cpuid_bit(7, 0, 3, 23);
  c.amx_bf16 = amx_state && cpuid_bit(7, 0, 3, 22);
  c.amx_fp16 = amx_state && cpuid_bit(7, 1, 0, 21);
#endif
  return c;
}

// Seconds of the best of `reps` weight gradients of one small convolution in `dtype`.
inline double conv_weight_grad_seconds(at::ScalarType dtype, int reps) {
  at::NoGradGuard no_grad;
  const auto options = at::TensorOptions(dtype);
  const auto input = at::ones({4, 8, 16, 16}, options);
  const auto weight = at::ones({8, 8, 3, 3}, options);
  const auto grad_output = at::ones({4, 8, 16, 16}, options);
  double best = 1e30;
  for (int r = 0; r < reps + 1; ++r) {  // the first call creates the kernel: not timed
    const auto start = std::chrono::steady_clock::now();
    const auto grads =
        at::convolution_backward(grad_output, input, weight, at::OptionalIntArrayRef(), {1, 1},
                                 {1, 1}, {1, 1}, false, {0, 0}, 1, {false, true, false});
    (void)std::get<1>(grads).sum().item<float>();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (r > 0) best = std::min(best, s);
  }
  return best;
}

// A ratio far above the few-fold that fp16 costs without native arithmetic: the reference loop.
inline constexpr double kSlowConvRatio = 8.0;

inline CpuCapabilities probe_cpu() {
  const auto start = std::chrono::steady_clock::now();
  auto c = cpu_flags();
  // LibTorch sends fp16 convolutions to oneDNN only where the CPU has fp16 arithmetic; elsewhere
  // ATen's own kernels run them (a few times fp32's time, not a hundred).
  if (cpu_half_math && c.avx512_fp16 && !c.amx_fp16) {
    const double fp32 = conv_weight_grad_seconds(at::kFloat, 3);
    const double fp16 = conv_weight_grad_seconds(at::kHalf, 2);
    c.fp16_conv_weight_grad_ratio = fp16 / std::max(fp32, 1e-9);
    c.fp16_conv_weight_grad_slow = c.fp16_conv_weight_grad_ratio > kSlowConvRatio;
  }
  c.probe_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return c;
}

// A replacement for tests, which must see both answers on any CPU.
inline std::optional<CpuCapabilities>& cpu_capabilities_override() {
  static std::optional<CpuCapabilities> value;
  return value;
}

}  // namespace detail

/// This machine's CPU, probed once per process (the flags, and on a CPU with AVX512-FP16 but no
/// AMX-FP16 one timed fp16 and fp32 convolution weight gradient: a few milliseconds).
inline const CpuCapabilities& cpu_capabilities() {
  if (const auto& forced = detail::cpu_capabilities_override()) return *forced;
  static const CpuCapabilities probed = detail::probe_cpu();
  return probed;
}

/// "AMD EPYC 9R14: avx2 avx512f avx512_bf16; fp16 convolutions: ATen's kernels".
inline std::ostream& operator<<(std::ostream& out, const CpuCapabilities& c) {
  out << (c.model.empty() ? std::string("unknown CPU") : c.model) << ":";
  const std::pair<bool, const char*> flags[] = {
      {c.avx2, "avx2"},         {c.avx512f, "avx512f"},   {c.avx512_bf16, "avx512_bf16"},
      {c.avx512_fp16, "avx512_fp16"}, {c.amx_bf16, "amx_bf16"}, {c.amx_fp16, "amx_fp16"}};
  for (const auto& [on, name] : flags) {
    if (on) out << ' ' << name;
  }
  out << "; fp16 convolution weight gradients: ";
  if (c.fp16_conv_weight_grad_slow) {
    out << "oneDNN's reference loop, " << c.fp16_conv_weight_grad_ratio
        << "x fp32 (compute them in fp32: mixprec::nn::Conv2d, fp32_weight_grad)";
  } else if (c.fp16_conv_weight_grad_ratio > 0) {
    out << c.fp16_conv_weight_grad_ratio << "x fp32";
  } else {
    out << (c.avx512_fp16 ? "oneDNN (AMX-FP16)" : "ATen's kernels (no AVX512-FP16)");
  }
  return out << " (probed in " << c.probe_seconds * 1000 << " ms)";
}

}  // namespace mixprec
