// A loss_fn that returns a number (or nothing) instead of the loss tensor is refused in one line
// that names the contract, not in pages of errors from inside Trainer::step.
// expect: loss_fn must take no arguments and return the loss as a tensor
#include <mixprec/trainer/trainer.hpp>

static_assert(mixprec::detail::returns_loss<decltype([] { return at::Tensor(); })>);
static_assert(!mixprec::detail::returns_loss<decltype([] {})>);
static_assert(!mixprec::detail::returns_loss<decltype([] { return 1.0; })>);
static_assert(!mixprec::detail::returns_loss<decltype([](int) { return at::Tensor(); })>);

inline void train(mixprec::Trainer<mixprec::FullPrecision>& trainer, const at::Tensor& x) {
#ifdef MIXPREC_COMPILE_FAIL
  trainer.step([&] { return x.sum().item<double>(); });
#else
  trainer.step([&] { return x.sum(); });
#endif
}
