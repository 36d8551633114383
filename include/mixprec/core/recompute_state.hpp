#pragma once
// Which pass of an activation checkpoint (recompute/) the code on this thread runs in. A block
// runs twice: once in the forward pass, and again inside the backward pass, to recompute what
// the first run did not keep. What must happen once per forward pass (MixedFP8's delayed
// scaling records its amaxes, advise() counts an fp8 operand) reads this flag, which lives here
// so that the subsystems below recompute/ can read it without including it.

namespace mixprec::detail {

enum class CheckpointPass {
  none,       ///< not inside a checkpointed block
  forward,    ///< the block's first run, in the forward pass
  recompute,  ///< the block's run again in the backward pass, replaying the first
};

/// The pass of the innermost checkpointed block running on this thread.
inline CheckpointPass& checkpoint_pass() noexcept {
  thread_local CheckpointPass pass = CheckpointPass::none;
  return pass;
}

/// Whether this thread recomputes a checkpointed block (inside a backward pass): its forward
/// has run already and recorded whatever a forward records.
inline bool recomputing() noexcept { return checkpoint_pass() == CheckpointPass::recompute; }

/// Sets the pass for a scope, restoring the outer one after (checkpoints nest). A block
/// checkpointed inside a block being recomputed recomputes too: its first run is a replay.
class CheckpointPassGuard {
 public:
  explicit CheckpointPassGuard(CheckpointPass pass) noexcept : previous_(checkpoint_pass()) {
    checkpoint_pass() = previous_ == CheckpointPass::recompute ? previous_ : pass;
  }
  ~CheckpointPassGuard() { checkpoint_pass() = previous_; }
  CheckpointPassGuard(const CheckpointPassGuard&) = delete;
  CheckpointPassGuard& operator=(const CheckpointPassGuard&) = delete;

 private:
  CheckpointPass previous_;
};

}  // namespace mixprec::detail
