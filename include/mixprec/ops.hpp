#pragma once
/// Stable ops: masked softmax, log-softmax, max and mean, logsumexp and the dtype constants,
/// templated on the policy, accumulating low-precision input in fp32 (ops/masked_ops.hpp).

#include <ATen/ATen.h>  // first: its header check precompiles it (tests/CMakeLists.txt)
#include <mixprec/ops/masked_ops.hpp>
