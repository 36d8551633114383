#pragma once
// The states of a process's random generators (the CPU's, each CUDA device's): what a
// checkpoint carries and what advise() puts back after its trial steps.

#include <ATen/Context.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/cuda.h>

#include <cstddef>
#include <mutex>
#include <utility>
#include <vector>

namespace mixprec::detail {

// CUDA's generators, one per device; none on a machine without CUDA.
inline std::size_t cuda_devices() {
  return torch::cuda::is_available() ? torch::cuda::device_count() : 0;
}
inline at::Generator cuda_generator(std::size_t device) {
  return at::globalContext().defaultGenerator(
      at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
}
inline at::Tensor cpu_rng_state() {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

/// The states of this process's random generators: the CPU's and those of CUDA devices.
struct RngStates {
  at::Tensor cpu;
  std::vector<std::pair<std::size_t, at::Tensor>> cuda;  // (device, state)

  /// Now: the CPU's and every CUDA device's.
  static RngStates capture() {
    RngStates states{cpu_rng_state(), {}};
    for (std::size_t d = 0; d < cuda_devices(); ++d) {
      auto generator = cuda_generator(d);
      std::lock_guard<std::mutex> lock(generator.mutex());
      states.cuda.emplace_back(d, generator.get_state());
    }
    return states;
  }
  void restore() const {
    auto generator = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(cpu);
    }
    for (const auto& [device, state] : cuda) {
      auto generator_d = cuda_generator(device);
      std::lock_guard<std::mutex> lock(generator_d.mutex());
      generator_d.set_state(state);
    }
  }
};

}  // namespace mixprec::detail
