#pragma once
// Live and peak bytes of CPU tensors over the whole process, from every thread. tensor_memory.hpp
// counts what its own thread allocates and frees (the profiler's reports are thread-local); a
// process group's collectives allocate and free on their worker threads as well (Gloo's
// buffers, and the last reference to a collective's tensors is often dropped there), so its
// sum drifts by their sizes. This one stands between LibTorch and its CPU allocator instead:
// installed first thing in main(), it sees every CPU tensor allocated after it, whatever thread
// allocates or frees it. For the distributed benchmarks; the LibTorch of the wheel (2.x).

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace bench {

class CountingCpuAllocator final : public c10::Allocator {
 public:
  /// Puts the allocator in place of LibTorch's CPU allocator for the rest of the process
  /// (never removed: tensors allocated through it free through it).
  static CountingCpuAllocator& install() {
    static CountingCpuAllocator* self = [] {
      auto* counting = new CountingCpuAllocator(c10::GetCPUAllocator());
      c10::SetCPUAllocator(counting, /*priority=*/100);
      return counting;
    }();
    return *self;
  }

  c10::DataPtr allocate(std::size_t n) override {
    auto inner = inner_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;
    // The context is the data pointer itself, as LibTorch's own allocator has it
    // (raw_allocate and is_simple_data_ptr rely on that); what to free goes into the table.
    const auto deleter = inner.get_deleter();
    void* context = inner.release_context();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_[data] = {n, context, deleter};
      live_ += static_cast<std::int64_t>(n);
      peak_ = std::max(peak_, live_);
    }
    return {data, data, &counting_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  std::int64_t live() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_;
  }
  std::int64_t peak() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }
  /// Starts a new peak from what is live now.
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_ = live_;
  }

 private:
  struct Block {
    std::size_t bytes;
    void* context;
    c10::DeleterFnPtr deleter;
  };

  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner) {}

  static void counting_delete(void* data) {
    auto& self = install();
    Block block{};
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      const auto it = self.blocks_.find(data);
      TORCH_INTERNAL_ASSERT(it != self.blocks_.end(), "CountingCpuAllocator: an unknown block");
      block = it->second;
      self.blocks_.erase(it);
      self.live_ -= static_cast<std::int64_t>(block.bytes);
    }
    if (block.deleter != nullptr) block.deleter(block.context);
  }

  c10::Allocator* inner_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, Block> blocks_;
  std::int64_t live_ = 0;
  std::int64_t peak_ = 0;
};

}  // namespace bench
