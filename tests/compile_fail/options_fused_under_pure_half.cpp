// PureHalf keeps the optimizer's parameters in its low dtype, where ATen's fused Adam would
// divide by the loss scale in that dtype: with the policy's own Options, fused_optimizer is a
// compile error (with TrainerOptions, an Error at construction).
// expect: takes_fused_optimizer
#include <mixprec/trainer/trainer.hpp>

#ifdef MIXPREC_COMPILE_FAIL
using Policy = mixprec::PureHalf<at::BFloat16>;
#else
using Policy = mixprec::MixedO2<at::BFloat16>;  // fp32 masters: the fused step is fine
#endif

mixprec::Trainer<Policy>::Options options() {
  return mixprec::Trainer<Policy>::Options().fused_optimizer(true).max_grad_norm(1.0);
}
