// A downstream program: uses a policy and the autocast guard, exits 0 when both behave.
#include <mixprec/mixprec.hpp>

#include <ATen/ATen.h>

#include <iostream>

int main() {
  using Policy = mixprec::MixedO1<at::BFloat16>;
  const auto a = at::ones({4, 4});
  at::Tensor inside;
  {
    auto guard = mixprec::autocast<Policy>(c10::DeviceType::CPU);
    inside = at::mm(a, a);
  }
  const auto outside = at::mm(a, a);
  std::cout << "mixprec " << mixprec::version << " " << Policy::name << ": "
            << inside.scalar_type() << " inside, " << outside.scalar_type() << " outside\n";
  return inside.scalar_type() == at::kBFloat16 && outside.scalar_type() == at::kFloat ? 0 : 1;
}
