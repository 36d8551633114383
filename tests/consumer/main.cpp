// A downstream program: an autocast guard, and a data-parallel step over a Gloo group of one
// rank through mixprec::distributed (its definitions and include paths, as installed). Exits 0
// when both behave.
#include <mixprec/mixprec.hpp>
#include <mixprec/distributed/process_group.hpp>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <iostream>

#ifndef MIXPREC_C10D_GLOO
#error "mixprec::distributed did not define MIXPREC_C10D_GLOO on a machine with Gloo's headers"
#endif

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
  const bool autocast_ok =
      inside.scalar_type() == at::kBFloat16 && outside.scalar_type() == at::kFloat;

  torch::nn::Linear model(4, 2);
  torch::optim::SGD optimizer(model->parameters(), /*lr=*/0.5);
  const auto before = model->weight.detach().clone();
  auto group = mixprec::gloo_group(c10::make_intrusive<c10d::HashStore>(), 0, 1);
  mixprec::Trainer<Policy> trainer(
      model, optimizer, mixprec::TrainerOptions().distributed(mixprec::DistributedOptions(group)));
  const auto report = trainer.step([&] { return model->forward(a).square().mean(); });
  const bool step_ok = report.stepped() && !model->weight.detach().equal(before);
  std::cout << "data parallel over Gloo (1 rank): " << report.status << "\n";
  return autocast_ok && step_ok ? 0 : 1;
}
