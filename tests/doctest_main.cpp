// The test runner (runner.hpp). `mixprec_cuda_tests --require-cuda ...` exits 77 (ctest: "not
// run") when no CUDA device is present, so the CUDA suite is reported as not run on CPU machines,
// never as passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include "runner.hpp"

#include <torch/cuda.h>

#include <cstring>
#include <iostream>
#include <vector>

int main(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);
  if (argc > 1 && std::strcmp(argv[1], "--require-cuda") == 0) {
    if (!torch::cuda::is_available()) {
      std::cout << "no CUDA device: the CUDA tests did not run\n";
      return 77;
    }
    args.erase(args.begin() + 1);
  }
  return test::runner::run(static_cast<int>(args.size()), args.data());
}
