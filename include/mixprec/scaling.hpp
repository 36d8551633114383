#pragma once
/// Loss scaling: GradScaler (PyTorch's algorithm and state_dict), StaticScaler and NoScaler,
/// with PyTorch's GradScaler API for a loop of your own, and the one-pass unscale-and-check
/// kernels under them (scaler_core.hpp, grad_passes.hpp, unscale.hpp, unscale_kernels.hpp).

#include <ATen/ATen.h>  // first: its header check precompiles it (tests/CMakeLists.txt)
#include <mixprec/scaling/scalers.hpp>
#include <mixprec/scaling/options.hpp>
