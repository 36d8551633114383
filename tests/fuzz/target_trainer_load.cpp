// libFuzzer entry point: fuzz_trainer_load in harness.cpp. MIXPREC_FUZZ_SEEDS=DIR writes the seeds there.
#include "harness.hpp"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz_trainer_load_init();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return fuzz_trainer_load(data, size);
}
