#pragma once
/// The policy core: the precision policies (policy.hpp, with the table of when to use each) and
/// their concepts, mixprec::Error, the LibTorch version switches, the autocast guard, what this
/// CPU computes fast, at::parallel_for with its OpenMP check, and the "each tensor once" helpers
/// every subsystem shares.

#include <ATen/ATen.h>  // first: its header check precompiles it (tests/CMakeLists.txt)
#include <mixprec/core/error.hpp>
#include <mixprec/core/compat.hpp>
#include <mixprec/core/version.hpp>
#include <mixprec/core/concepts.hpp>
#include <mixprec/core/state_storage.hpp>
#include <mixprec/core/policy.hpp>
#include <mixprec/core/cpu_dispatch.hpp>
#include <mixprec/core/autocast.hpp>
#include <mixprec/core/capabilities.hpp>
#include <mixprec/core/parallel.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/core/rng_states.hpp>
#include <mixprec/core/recompute_state.hpp>
