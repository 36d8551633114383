// mixprec::cpu_capabilities(): the instruction-set flags against the kernel's own view of the CPU
// (/proc/cpuinfo), and the probe's verdict on fp16 convolution weight gradients.
#include <mixprec/capabilities.hpp>

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

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

TEST_CASE("cpu_capabilities: the timed probe runs exactly where the flags suspect oneDNN") {
  const auto& c = mp::cpu_capabilities();
  const bool suspect = mp::cpu_half_math && c.avx512_fp16 && !c.amx_fp16;
  CHECK((c.fp16_conv_weight_grad_ratio > 0) == suspect);
  CHECK(c.fp16_conv_weight_grad_slow == (suspect && c.fp16_conv_weight_grad_ratio > 8));
  CHECK(&mp::cpu_capabilities() == &c);  // probed once
  // The timed op on its own: fp32 convolution weight gradients take a positive, finite time.
  const double s = mp::detail::conv_weight_grad_seconds(at::kFloat, 1);
  CHECK(s > 0);
  CHECK(s < 10);
  std::ostringstream text;
  text << c;
  CHECK(text.str().find("fp16 convolution weight gradients: ") != std::string::npos);
}
