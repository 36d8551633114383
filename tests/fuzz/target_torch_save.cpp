// libFuzzer entry point: fuzz_torch_save in harness.cpp. MIXPREC_FUZZ_SEEDS=DIR writes the seeds there.
#include "harness.hpp"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz_torch_save_init();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return fuzz_torch_save(data, size);
}
