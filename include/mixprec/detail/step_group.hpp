#pragma once
// What a Trainer asks of data parallel, in words that need no c10d header: distributed.hpp's
// DataParallel is the one implementation. trainer.hpp includes this header only, so that a
// program that trains in one process compiles without c10d; TrainerOptions::distributed(...)
// takes DistributedOptions, whose header brings c10d and the factory below with it.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace mixprec {

struct DistributedOptions;  // mixprec/distributed.hpp

namespace detail {

class StepGroup {
 public:
  virtual ~StepGroup() = default;
  StepGroup() = default;
  StepGroup(const StepGroup&) = delete;
  StepGroup& operator=(const StepGroup&) = delete;

  virtual int rank() const noexcept = 0;
  virtual int world_size() const noexcept = 0;
  /// Where the collectives' tensors live.
  virtual at::Device device() const noexcept = 0;
  /// DistributedOptions::broadcast_buffers.
  virtual bool broadcast_buffers() const noexcept = 0;
  /// An Error on every rank unless every rank's model has the same tensors. Collective.
  virtual void check_same_model(const torch::nn::Module& model) = 0;
  /// Reduce the gradients of `params` into `holders[i].grad()` from now on. Collective.
  virtual void bind(const std::vector<at::Tensor>& params,
                    const std::vector<at::Tensor>& holders) = 0;
  /// Before a backward pass; `sync`: reduce the gradients during it.
  virtual void prepare(bool sync) = 0;
  /// After the backward pass of a prepare(true): the averages are in the holders' gradients.
  virtual void finish() = 0;
  /// Every rank steps or skips alike, and every rank is at the same step() call.
  virtual void agree_step(at::Tensor& found_inf, std::int64_t calls) = 0;
  /// Whether `local` is true on any rank.
  virtual bool any(bool local) = 0;
  /// `value` of every rank, in rank order.
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& value) = 0;
  /// Rank 0's buffers (and, with `parameters`, its parameters) on every rank.
  virtual void broadcast_from_rank0(torch::nn::Module& model, bool parameters) = 0;
};

/// Makes the group a Trainer trains over; distributed.hpp defines it for DistributedOptions,
/// where that type is complete.
template <class Options>
struct StepGroupFactory;

using MakeStepGroup = std::unique_ptr<StepGroup> (*)(torch::nn::Module& model,
                                                     const DistributedOptions& options);

}  // namespace detail
}  // namespace mixprec
