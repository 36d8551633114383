#pragma once
/// What the optimizer steps: fp32 master weights for low-precision models (Apex O2), the fused
/// Adam/AdamW step that folds the unscale into ATen's kernel, and the optimizer-state slices of
/// sharded data parallel.

#include <ATen/ATen.h>  // first: its header check precompiles it (tests/CMakeLists.txt)
#include <mixprec/optim/master_weights.hpp>
#include <mixprec/optim/block_quantize.hpp>
#include <mixprec/optim/quantized_adam.hpp>
#include <mixprec/optim/quantized_moments.hpp>
#include <mixprec/optim/fused_adam.hpp>
#include <mixprec/optim/lean_adam.hpp>
#include <mixprec/optim/lean_adam_step.hpp>
#include <mixprec/optim/lean_kernels.hpp>
#include <mixprec/optim/lean_masters.hpp>
#include <mixprec/optim/lean_moments.hpp>
