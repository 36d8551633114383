// PureHalf without masters keeps the optimizer's parameters in its low dtype, where ATen's
// fused Adam would divide by the loss scale in that dtype: with the policy's own Options,
// fused_optimizer is a compile error (with TrainerOptions, an Error at construction). With
// stochastic rounding PureHalf steps an fp32 copy of each weight (the one-pass step on the
// CPU, ATen's fused kernel elsewhere): its Options take fused_optimizer, as its Trainer does.
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

using Stochastic = mixprec::PureHalf<at::BFloat16, mixprec::StochasticRounding<>>;
mixprec::Trainer<Stochastic>::Options stochastic_options() {
  return mixprec::Trainer<Stochastic>::Options().fused_optimizer(true).max_grad_norm(1.0);
}
