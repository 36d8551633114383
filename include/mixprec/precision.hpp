#pragma once
/// Precision per module: PrecisionMap (module-path rules), apply_precision_map, the Mappable
/// wrapper that gives a module its region, Fp32Region for a block of code, and how a Trainer
/// casts its model.

#include <ATen/ATen.h>  // first: its header check precompiles it (tests/CMakeLists.txt)
#include <mixprec/precision/model_cast.hpp>
#include <mixprec/precision/precision_map.hpp>
