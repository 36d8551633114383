#pragma once
/// fp8 training: the MixedFP8 policy and its scaling recipes (tensorwise, delayed, rowwise),
/// Float8Linear (e4m3 input and weight, e5m2 grad_output; e4m3 throughout under the rowwise
/// recipes), numerically torchao's float8 training.

#include <ATen/ATen.h>  // first: its header check precompiles it (tests/CMakeLists.txt)
#include <mixprec/fp8/linear.hpp>
