#pragma once
/// Loss scaling: GradScaler (PyTorch's algorithm and state_dict), StaticScaler and NoScaler,
/// with PyTorch's GradScaler API for a loop of your own, and the one-pass unscale-and-check
/// kernels under them.

#include <mixprec/scaling/scalers.hpp>
