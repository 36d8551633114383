#pragma once
/// mixprec::nn: drop-in LibTorch modules where mixed precision needs them (Conv2d with fp32
/// weight gradients, Linear computed as F.linear); Mappable and Float8Linear are in
/// precision.hpp and fp8.hpp.

#include <ATen/ATen.h>  // first: its header check precompiles it (tests/CMakeLists.txt)
#include <mixprec/nn/conv.hpp>
#include <mixprec/nn/linear.hpp>
