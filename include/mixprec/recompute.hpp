#pragma once
/// Activation checkpointing that keeps the precision: mixprec::checkpoint(fn, args...) for a
/// block of code, mixprec::nn::Checkpointed<M> and apply_checkpointing(model, patterns) for
/// modules; the recompute in backward replays the block's autocast, random and grad state.

#include <ATen/ATen.h>  // first: its header check precompiles it (tests/CMakeLists.txt)
#include <mixprec/recompute/checkpoint.hpp>
#include <mixprec/recompute/checkpointed.hpp>
