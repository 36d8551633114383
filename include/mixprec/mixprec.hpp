#pragma once
/// mixprec: mixed-precision training for LibTorch. Include this header for everything.

#include <mixprec/advise.hpp>
#include <mixprec/autocast.hpp>
#include <mixprec/capabilities.hpp>
#include <mixprec/compat.hpp>
#include <mixprec/concepts.hpp>
#include <mixprec/diagnostics.hpp>
#include <mixprec/distributed.hpp>
#include <mixprec/error.hpp>
#include <mixprec/fp8.hpp>
#include <mixprec/master_weights.hpp>
#include <mixprec/nn.hpp>
#include <mixprec/ops.hpp>
#include <mixprec/policy.hpp>
#include <mixprec/precision_map.hpp>
#include <mixprec/scaler.hpp>
#include <mixprec/trainer.hpp>
#include <mixprec/version.hpp>
