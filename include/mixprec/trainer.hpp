#pragma once
/// Trainer<P>: the training step of a precision policy, with its options, reports and
/// checkpoints (trainer/trainer.hpp has the usage loop). Compiles without c10d: data parallel
/// comes with distributed.hpp.

#include <mixprec/trainer/trainer.hpp>
