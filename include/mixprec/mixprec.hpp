#pragma once
/// mixprec: mixed-precision training for LibTorch. Include this header for everything; each
/// subsystem also has a header of its own beside its folder (docs/architecture.md).

#include <mixprec/core.hpp>
#include <mixprec/io.hpp>
#include <mixprec/ops.hpp>
#include <mixprec/scaling.hpp>
#include <mixprec/optim.hpp>
#include <mixprec/nn.hpp>
#include <mixprec/precision.hpp>
#include <mixprec/lora.hpp>
#include <mixprec/fp8.hpp>
#include <mixprec/recompute.hpp>
#include <mixprec/distributed.hpp>
#include <mixprec/diagnostics.hpp>
#include <mixprec/trainer.hpp>
