#pragma once
/// The CPU's instruction-set flags as LibTorch's kernels can use them (CpuCapabilities' fields),
/// and what they decide without timing anything: whether bf16 is computed natively, by
/// conversion or by ATen's own loops here. capabilities.hpp adds the fp16 convolution verdict and
/// cpu_capabilities(), which probes once per process; include that one.
///
/// bf16 is decided from the flags alone, as LibTorch decides where its bf16 products go: oneDNN
/// computes them where the CPU has AVX-512 (natively with AVX512-BF16 or AMX-BF16, by conversion
/// without), ATen's own loops elsewhere. ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) caps what oneDNN
/// may use, and LibTorch 2.x asks oneDNN, so the cap counts as the CPU's: ONEDNN_MAX_CPU_ISA=AVX2
/// on an AVX512-BF16 machine computes bf16 as an AVX2-only CPU does (ATEN_CPU_CAPABILITY, ATen's
/// own vector width, does not move bf16 products: measured, docs/guide.md "bf16 on a CPU").

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define MIXPREC_X86_CPUID 1
#endif

namespace mixprec {

/// The environment variables that cap the instruction sets oneDNN uses, in the order oneDNN reads
/// them (the first one set counts).
inline constexpr const char* onednn_max_isa_envs[] = {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"};

/// What computes LibTorch's bf16 matrix products and convolutions on this CPU (decided from the
/// flags and oneDNN's cap; figures: bench_cpu_bf16, docs/guide.md "bf16 on a CPU").
enum class Bf16Kernels {
  native,    ///< oneDNN with AVX512-BF16 or AMX-BF16: bf16 faster than fp32
  emulated,  ///< oneDNN with AVX-512 but no bf16 instructions: converts, slower than fp32
  fallback,  ///< ATen's own loops (no AVX-512 that oneDNN may use): several times fp32's time
  unknown,   ///< not an x86 CPU: mixprec cannot tell, and assumes nothing
};

/// What decided CpuCapabilities::fp16_conv_weight_grad_slow.
enum class Fp16ConvBasis {
  flags,             ///< the flags rule the slow path out; nothing timed
  flags_and_timing,  ///< the flags say slow, and the timing could not show fp16 fast
  timing,            ///< the flags say slow, but fp16 timed unmistakably fast: not slow
  environment,       ///< MIXPREC_FP16_CONV_WEIGHT_GRAD (a parent process decided); nothing timed
};

/// The CPU's low-precision features, and what they mean for training in bf16 and fp16 on it.
struct CpuCapabilities {
  std::string model;         ///< /proc/cpuinfo's "model name", or "" where unknown
  bool avx2 = false;
  bool avx512f = false;
  bool avx512_bf16 = false;  ///< bf16 dot products (AMD Zen 4, Intel Cooper Lake and later)
  bool avx512_fp16 = false;  ///< fp16 arithmetic (Intel Sapphire Rapids and later)
  bool amx_bf16 = false;     ///< bf16 tile matrix products (Sapphire Rapids and later)
  bool amx_fp16 = false;     ///< fp16 tile matrix products (Granite Rapids and later)
  /// ONEDNN_MAX_CPU_ISA's value (or DNNL_MAX_CPU_ISA's), "" where neither is set.
  std::string onednn_max_isa;
  /// What computes bf16 matrix products and convolutions here (see Bf16Kernels).
  Bf16Kernels bf16_kernels = Bf16Kernels::unknown;
  /// bf16 computes slower than fp32 here (bf16_kernels emulated or fallback): a bf16 policy saves
  /// memory but costs time; FullPrecision trains faster. The Trainer warns once, advise says so.
  bool bf16_slow = false;
  /// fp16 convolution weight gradients go to oneDNN's reference loop (`ref:any`): LibTorch sends
  /// fp16 convolutions to oneDNN on a CPU with AVX512-FP16, whose weight-gradient kernel needs
  /// AMX-FP16. Measured on a Sapphire Rapids Xeon: 114-385x fp32 per convolution, 37-39x for a
  /// whole CNN step (Python torch too). Decided by the flags; see fp16_conv_weight_grad_basis.
  bool fp16_conv_weight_grad_slow = false;
  /// fp16 / fp32 time of a small convolution weight gradient, the minima of interleaved samples
  /// (0: not measured, because the flags rule the case out or a parent process decided).
  double fp16_conv_weight_grad_ratio = 0.0;
  /// What decided fp16_conv_weight_grad_slow.
  Fp16ConvBasis fp16_conv_weight_grad_basis = Fp16ConvBasis::flags;
  /// How long the probe took, in seconds (the flags: microseconds; the timing: ~0.1 s).
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

// oneDNN's ISA caps in its order (docs: "CPU Dispatcher Control") as ranks; the aliases of
// AVX10.1 share their rank. The three that decide bf16 are named.
inline constexpr int kIsaAvx512Core = 10;      // AVX-512 (F, BW, VL, DQ): oneDNN converts bf16
inline constexpr int kIsaAvx512CoreBf16 = 12;  // and AVX512-BF16: native bf16 dot products
inline constexpr int kIsaAvx512CoreAmx = 14;   // and AMX (AMX-BF16 tiles)

// A cap's rank. A name oneDNN does not know caps nothing (oneDNN ignores it too), nor do
// DEFAULT and ALL. Compared without regard to case, as oneDNN 3.x does.
inline int onednn_isa_rank(std::string name) {
  for (auto& ch : name) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  const std::pair<const char*, int> ranks[] = {
      {"SSE41", 1},
      {"AVX", 2},
      {"AVX2", 3},
      {"AVX2_VNNI", 4},
      {"AVX2_VNNI_2", 5},
      {"AVX512_CORE", kIsaAvx512Core},
      {"AVX512_CORE_VNNI", 11},
      {"AVX512_CORE_BF16", kIsaAvx512CoreBf16},
      {"AVX10_1_512", 13},
      {"AVX512_CORE_FP16", 13},
      {"AVX10_1_512_AMX", kIsaAvx512CoreAmx},
      {"AVX512_CORE_AMX", kIsaAvx512CoreAmx},
      {"AVX10_1_512_AMX_FP16", 15},
      {"AVX512_CORE_AMX_FP16", 15}};
  for (const auto& [isa, rank] : ranks) {
    if (name == isa) return rank;
  }
  return std::numeric_limits<int>::max();
}

// The cap oneDNN reads: ONEDNN_MAX_CPU_ISA, else DNNL_MAX_CPU_ISA; "" where neither is set.
inline std::string onednn_max_isa_setting() {
  for (const auto* name : onednn_max_isa_envs) {
    if (const char* value = std::getenv(name)) return value;
  }
  return "";
}

// The bf16 verdict on `c`'s flags, under oneDNN's cap `max_isa` ("" none), with `onednn` saying
// whether this LibTorch has oneDNN at all. As LibTorch routes: bf16 products go to oneDNN where
// oneDNN may use AVX-512 (LibTorch 2.x asks oneDNN's effective ISA; 1.13 reads the CPU), and
// to ATen's loops elsewhere; oneDNN computes natively with AVX512-BF16 or AMX-BF16.
inline CpuCapabilities decide_bf16(CpuCapabilities c, bool x86, const std::string& max_isa,
                                   bool onednn) {
  c.onednn_max_isa = max_isa;
  if (!x86) {
    c.bf16_kernels = Bf16Kernels::unknown;
    c.bf16_slow = false;
    return c;
  }
  const int cap = onednn_isa_rank(max_isa);
  if (onednn && ((c.avx512_bf16 && cap >= kIsaAvx512CoreBf16) ||
                 (c.amx_bf16 && cap >= kIsaAvx512CoreAmx))) {
    c.bf16_kernels = Bf16Kernels::native;
  } else if (onednn && c.avx512f && cap >= kIsaAvx512Core) {
    c.bf16_kernels = Bf16Kernels::emulated;
  } else {
    c.bf16_kernels = Bf16Kernels::fallback;
  }
  c.bf16_slow = c.bf16_kernels != Bf16Kernels::native;
  return c;
}

#ifdef MIXPREC_X86_CPUID
inline constexpr bool x86_cpu = true;
#else
inline constexpr bool x86_cpu = false;
#endif

// What bf16 costs here, for the Trainer's warning and advise's reason: the CPU, what it lacks,
// what computes bf16 instead, and the measured cost (bench_cpu_bf16, docs/benchmarks.md).
inline std::string slow_bf16_reason(const CpuCapabilities& c) {
  std::ostringstream text;
  text << (c.model.empty() ? std::string("this CPU") : c.model);
  const bool capped =
      onednn_isa_rank(c.onednn_max_isa) < kIsaAvx512CoreBf16 && (c.avx512_bf16 || c.amx_bf16);
  if (capped) {
    text << " has AVX512-BF16 but oneDNN may not use it (ONEDNN_MAX_CPU_ISA=" << c.onednn_max_isa
         << ")";
  } else {
    text << " has no AVX512-BF16 or AMX-BF16";
  }
  if (c.bf16_kernels == Bf16Kernels::emulated) {
    text << ": oneDNN converts bf16 to fp32 for every product, about 2x fp32's time for a "
            "layer and 1.2x for a small CNN's training step";
  } else {
    text << ": LibTorch computes bf16 matrix products and convolutions with ATen's own loops, "
            "about 4x fp32's time for a small CNN's training step and 10x or more for a large "
            "Linear";
  }
  text << " (measured: docs/guide.md, \"bf16 on a CPU\")";
  return text.str();
}

}  // namespace detail
}  // namespace mixprec
