#pragma once
// A Trainer's lean training state (core/state_storage.hpp) around the moments that need fp32:
// the optimizer step (LeanStep: masters inflated and moments widened for the gradient passes
// and the step, put away again however it ends) and a checkpoint's load (LeanLoad). Policies
// with MixedO2's fp32 masters and fp32 moments do nothing here.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/state_storage.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/optim/lean_adam_step.hpp>
#include <mixprec/optim/lean_moments.hpp>
#include <mixprec/optim/master_weights.hpp>
#include <mixprec/optim/quantized_moments.hpp>

#include <torch/optim/optimizer.h>

#include <functional>
#include <set>
#include <type_traits>

namespace mixprec::detail {

template <class P>
inline constexpr bool narrow_moments_of = storage_of<P>::moment_dtype == c10::ScalarType::BFloat16;

/// P's masters are lean (RemainderMasters, StochasticRounding): under fused_optimizer on the
/// CPU, Adam and AdamW step them in one pass (optim/lean_adam_step.hpp), inflating nothing.
template <class P>
inline constexpr bool lean_pass_storage = storage_of<P>::masters == MasterStorage::remainder ||
                                          storage_of<P>::masters == MasterStorage::stochastic;

/// Whether P's step is a one-pass kernel over what the storage keeps: a block format's always
/// (quantized_adam_step), lean masters' under fused_optimizer on the CPU (lean_adam_step).
template <class P>
bool one_pass_step(bool fused_optimizer, bool cpu_only) {
  return quantized_moments<P> || (lean_pass_storage<P> && fused_optimizer && cpu_only);
}

/// What the one-pass step (fused_optimizer on the CPU) updates in place: the lean masters'
/// model weights and what is kept of them, or sharded, this rank's pieces'.
inline LeanTargets lean_targets(MasterWeights* masters, StepGroup* group) {
  if (group != nullptr && group->sharded()) {
    return [group](const at::Tensor& p) -> std::optional<LeanTarget> {
      LeanTarget target;
      if (group->lean_target(p, target)) return target;
      return std::nullopt;
    };
  }
  return [masters](const at::Tensor& p) { return masters->lean_target(p); };
}

/// What the quantized step updates: as lean_targets, with each tensor's whole size (a piece's
/// tensor's, sharded), which decides whether torchao would quantize it.
inline QuantizedTargets quantized_targets(MasterWeights* masters, StepGroup* group) {
  if (group != nullptr && group->sharded()) {
    return [group](const at::Tensor& p) {
      QuantizedTarget target;
      LeanTarget lean;
      if (group->lean_target(p, lean)) target.lean = lean;
      target.whole = group->whole_numel(p);
      return target;
    };
  }
  return [masters](const at::Tensor& p) {
    QuantizedTarget target;
    if (masters != nullptr) target.lean = masters->lean_target(p);
    return target;
  };
}

/// P's one-pass step over `masters` (or sharded, `group`'s pieces), gradients divided by its
/// argument (lean_adam_step, or quantized_adam_step for a block format).
template <class P>
std::function<void(const at::Tensor&)> one_pass_step_of(torch::optim::Optimizer& optimizer,
                                                        MasterWeights* masters, StepGroup* group) {
  if constexpr (quantized_moments<P>) {
    return [&optimizer, targets = quantized_targets(masters, group)](const at::Tensor& scale) {
      quantized_adam_step(optimizer, targets, scale, moment_coding_of<P>,
                          storage_of<P>::moment_dtype == c10::ScalarType::BFloat16);
    };
  } else {
    return [&optimizer, targets = lean_targets(masters, group)](const at::Tensor& scale) {
      lean_adam_step(optimizer, targets, scale, narrow_moments_of<P>);
    };
  }
}

/// The Trainer's construction: an Error where P's storage cannot keep this optimizer's state.
template <class P>
void check_lean_optimizer(const torch::optim::Optimizer& optimizer) {
  if constexpr (quantized_moments<P>) {
    check_quantizable_optimizer(optimizer, P::name, moment_coding_of<P>);
    for (const auto& t : optimizer_tensors(optimizer)) {
      MIXPREC_CHECK(t.device().is_cpu(), "Trainer<", P::name, "> keeps Adam's moments in ",
                    moment_coding_name(moment_coding_of<P>), ", which mixprec steps on the CPU; "
                    "a parameter is on ", t.device(), ": keep plain moments there (e.g. "
                    "RemainderMasters<at::BFloat16>)");
    }
  } else if constexpr (narrow_moments_of<P>) {
    check_narrowable_moments(optimizer, P::name);
  }
}

/// The optimizer's moments of the tensors stepped for a bf16 model tensor, rounded to bf16.
inline void narrow_low_moments(torch::optim::Optimizer& optimizer, const MasterWeights& masters) {
  using Key = std::decay_t<decltype(optimizer.state())>::key_type;
  std::set<Key> low;
  for (const auto& m : masters.masters()) {
    if (masters.model_of(m).defined()) low.insert(state_key<decltype(optimizer.state())>(m));
  }
  narrow_moments(optimizer, [&low](const Key& key) { return low.count(key) == 1; });
}

/// Around the gradient passes and the optimizer step of one Trainer step: the masters hold
/// their fp32 values and the moments are fp32 while it lives. A step taken stows the masters
/// (after_step_taken: MasterWeights::copy_to_model); a step skipped, or one that throws, drops
/// their fp32 data unwritten, leaving what was kept: the values from before the step.
template <class P>
class LeanStep {
 public:
  /// `inflate` false: a one-pass step reads and writes what the storage keeps. `group`:
  /// sharded, its pieces are the masters (ShardedOptimizer::gather_parameters stows them after
  /// a step taken, and counts the step's rounding).
  LeanStep(MasterWeights* masters, torch::optim::Optimizer& optimizer, bool inflate = true,
           StepGroup* group = nullptr)
      : masters_(masters), optimizer_(optimizer),
        group_(group != nullptr && group->sharded() ? group : nullptr) {
    if constexpr (lean_state<P>) {
      if (group_ != nullptr) {
        if (!inflate) return;
        try {
          group_->inflate_pieces();
          widen_moments(optimizer_);
        } catch (...) {
          group_->release_pieces(/*narrow=*/false);
          throw;
        }
        return;
      }
      if (masters_ == nullptr || !inflate) return;
      try {
        masters_->inflate();
        if constexpr (narrow_moments_of<P>) widen_moments(optimizer_);
      } catch (...) {
        masters_->release();
        throw;
      }
    }
  }
  LeanStep(const LeanStep&) = delete;
  LeanStep& operator=(const LeanStep&) = delete;

  ~LeanStep() {
    if constexpr (lean_state<P>) {
      if (group_ != nullptr) {
        try {
          group_->release_pieces(/*narrow=*/true);
        } catch (...) {  // out of memory: the moments stay fp32, their values right
        }
        return;
      }
      if (masters_ == nullptr) return;
      masters_->release();
      if constexpr (narrow_moments_of<P>) {
        try {
          narrow_low_moments(optimizer_, *masters_);
        } catch (...) {  // out of memory: the moments stay fp32, their values right
        }
      }
    }
  }

 private:
  MasterWeights* masters_;
  torch::optim::Optimizer& optimizer_;
  StepGroup* group_;
};

/// Around a checkpoint's load: the masters inflated, so that the loaded values land in them,
/// then stowed (RemainderMasters: split again; StochasticRounding: the model holds them). A
/// checkpoint of another storage converts: it holds fp32 master values whatever its storage,
/// and its moments are decoded from its block format (`saved`, where it has one) and coded in
/// P's, or widened to fp32, then narrowed to bf16 where P keeps them so.
template <class P>
class LeanLoad {
 public:
  LeanLoad(MasterWeights* masters, torch::optim::Optimizer& optimizer)
      : masters_(masters), optimizer_(optimizer) {
    if (masters_ != nullptr) masters_->inflate();
  }
  LeanLoad(const LeanLoad&) = delete;
  LeanLoad& operator=(const LeanLoad&) = delete;
  void loaded(MomentCoding saved = {}) {
    if (masters_ == nullptr) return;
    masters_->stow(/*stepped=*/false);
    recode_moments(optimizer_, saved, moment_coding_of<P>);
    widen_moments(optimizer_);  // fp32 state for fp32 masters
    if constexpr (narrow_moments_of<P>) narrow_low_moments(optimizer_, *masters_);
  }
  ~LeanLoad() {
    if (masters_ != nullptr) masters_->release();
  }

 private:
  MasterWeights* masters_;
  torch::optim::Optimizer& optimizer_;
};

}  // namespace mixprec::detail
