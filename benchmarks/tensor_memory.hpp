#pragma once
// Peak memory of live CPU tensors, independent of how malloc or an allocator caches what is
// freed: every allocation and free of LibTorch's CPU allocator is reported, with its size, to
// the memory reporter installed in the thread's debug info (c10::MemoryReportingInfoBase, the
// hook through which PyTorch's profiler records memory with profile_memory=True); this one adds
// them up and keeps the largest sum. Python's side (benchmarks/python/encoder_step.py) reads the
// same reports from torch.profiler's memory events, so both count the same bytes. Allocations
// on the installing thread count, and the autograd engine's CPU work runs there; the intra-op
// worker threads' own scratch tensors (allocated and freed inside one kernel) do not.

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace bench {

class LiveTensorBytes final : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void* /*ptr*/, std::int64_t alloc_size, std::size_t /*total_allocated*/,
                         std::size_t /*total_reserved*/, c10::Device device) override {
    if (device.type() != c10::DeviceType::CPU) return;
    live_ += alloc_size;
    peak_ = std::max(peak_, live_);
  }
  bool memoryProfilingEnabled() const override { return true; }

  std::int64_t live() const noexcept { return live_; }
  std::int64_t peak() const noexcept { return peak_; }
  /// Starts a new peak from what is live now.
  void reset_peak() noexcept { peak_ = live_; }

 private:
  std::int64_t live_ = 0;
  std::int64_t peak_ = 0;
};

/// Counts this thread's tensor allocations while alive (install it before anything is allocated:
/// a tensor allocated before is not known to the allocator's reporter when freed).
class TensorMemoryWatch {
 public:
  TensorMemoryWatch()
      : bytes_(std::make_shared<LiveTensorBytes>()),
        guard_(c10::DebugInfoKind::PROFILER_STATE, bytes_) {}
  LiveTensorBytes& bytes() noexcept { return *bytes_; }

 private:
  std::shared_ptr<LiveTensorBytes> bytes_;
  c10::DebugInfoGuard guard_;
};

}  // namespace bench
