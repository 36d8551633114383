// A policy that scales nothing (FullPrecision: NoScaler) has no scaler options to set: with the
// policy's own Options it is a compile error (with TrainerOptions, an Error at construction).
// expect: takes_scaler_options
#include <mixprec/trainer/trainer.hpp>

#ifdef MIXPREC_COMPILE_FAIL
using Policy = mixprec::FullPrecision;
#else
using Policy = mixprec::MixedO1<at::Half>;  // a GradScaler: its options are welcome
#endif

mixprec::Trainer<Policy>::Options options() {
  return mixprec::Trainer<Policy>::Options().scaler(mixprec::GradScalerOptions().init_scale(1024));
}
