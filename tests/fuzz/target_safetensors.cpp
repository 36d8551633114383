// libFuzzer entry point: fuzz_safetensors in harness.cpp. MIXPREC_FUZZ_SEEDS=DIR writes the seeds there.
#include "harness.hpp"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz_safetensors_init();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return fuzz_safetensors(data, size);
}
