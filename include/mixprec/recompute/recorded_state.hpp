#pragma once
// What a checkpoint's recompute must replay of the thread it first ran on: autocast on each
// device type (on or off, its dtype: the policy's, a mapped module's, an Fp32Region's) and the
// random generators (dropout's masks). The backward pass runs where backward() was called, not
// inside the policy's autocast, and after the random generators have moved on: Python's
// torch.utils.checkpoint records and restores the same, and has had bugs exactly there.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/rng_states.hpp>

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>

namespace mixprec::detail {

/// Autocast's switches on the CPU and CUDA, and whether it caches casts.
struct AutocastSwitches {
  AutocastState cpu{false, c10::ScalarType::BFloat16};
  AutocastState cuda{false, c10::ScalarType::Half};
  bool cache = true;

  static AutocastSwitches now() {
    return {get_autocast_state(c10::DeviceType::CPU), get_autocast_state(c10::DeviceType::CUDA),
            at::autocast::is_autocast_cache_enabled()};
  }
  void apply() const {
    set_autocast_state(c10::DeviceType::CPU, cpu);
    set_autocast_state(c10::DeviceType::CUDA, cuda);
    at::autocast::set_autocast_cache_enabled(cache);
  }
};

/// The state a checkpointed block first ran in.
struct RecordedState {
  AutocastSwitches autocast;
  RngStates rng;

  static RecordedState capture() { return {AutocastSwitches::now(), RngStates::capture()}; }
};

/// A cast cache of the block's own while alive. Autocast caches the casts of leaf tensors (the
/// weights) until its outermost scope ends; a cast made before the block and reused in it would
/// tie the block's graph to one outside it, and one made in the block and reused after it, to
/// the graph the checkpoint drops. So the block starts and ends with the cache empty: a weight
/// used twice in the block is cast once, as without the checkpoint.
class FreshCastCache {
 public:
  FreshCastCache() { at::autocast::clear_cache(); }
  ~FreshCastCache() { at::autocast::clear_cache(); }
  FreshCastCache(const FreshCastCache&) = delete;
  FreshCastCache& operator=(const FreshCastCache&) = delete;
};

/// While alive, this thread computes as when `recorded` was captured: its autocast switches
/// and random states; on exit the thread's own are back (the generators where they were before
/// the replay, so that the recompute draws nothing from the run's random stream).
class Replay {
 public:
  explicit Replay(const RecordedState& recorded)
      : autocast_(AutocastSwitches::now()), rng_(RngStates::capture()) {
    recorded.rng.restore();
    recorded.autocast.apply();
    at::autocast::increment_nesting();
  }
  ~Replay() {
    at::autocast::decrement_nesting();
    autocast_.apply();
    rng_.restore();
  }
  Replay(const Replay&) = delete;
  Replay& operator=(const Replay&) = delete;

 private:
  AutocastSwitches autocast_;
  RngStates rng_;
  FreshCastCache cache_;  // constructed last: the block's casts, under the recorded switches
};

}  // namespace mixprec::detail
