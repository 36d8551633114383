// A custom policy whose scaler_type lacks the scaler interface is refused by the Trainer by name.
// expect: the policy's scaler_type must satisfy mixprec::LossScaler
#include <mixprec/trainer/trainer.hpp>

// Has scale() and step(), PyTorch's loop API, but none of the calls a Trainer makes.
struct HalfAScaler {
  explicit HalfAScaler(const mixprec::GradScalerOptions& = {}) {}
  at::Tensor scale(const at::Tensor& loss) { return loss; }
  bool step(torch::optim::Optimizer& optimizer) {
    optimizer.step();
    return true;
  }
};

struct MyPolicy : mixprec::MixedO1<at::BFloat16> {
  static constexpr std::string_view name = "MyPolicy";
#ifdef MIXPREC_COMPILE_FAIL
  using scaler_type = HalfAScaler;
#else
  using scaler_type = mixprec::GradScaler;
#endif
};

std::size_t size() { return sizeof(mixprec::Trainer<MyPolicy>); }
