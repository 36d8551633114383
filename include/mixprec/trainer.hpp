#pragma once
/// Trainer<P>: the training step of a precision policy, with its options, reports and
/// checkpoints (trainer/trainer.hpp has the usage loop), and what writes its reports: the
/// StepLogger (CSV, JSON lines) and the ProgressLine. Compiles without c10d: data parallel
/// comes with distributed.hpp.

#include <ATen/ATen.h>  // first: its header check precompiles it (tests/CMakeLists.txt)
#include <mixprec/trainer/trainer.hpp>
#include <mixprec/trainer/progress.hpp>
#include <mixprec/trainer/step_log.hpp>
