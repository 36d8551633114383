// A downstream program: an autocast guard, a data-parallel step over a Gloo group of one rank
// through mixprec::distributed (its definitions and include paths, as installed), and one OpenMP
// runtime, LibTorch's: the libgomp that mixprec::mixprec links is the one libtorch_cpu loads
// (cmake/mixprecOpenMP.cmake). Exits 0 when all behave.
#include <mixprec/mixprec.hpp>
#include <mixprec/distributed/process_group.hpp>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <string>

#ifndef MIXPREC_C10D_GLOO
#error "mixprec::distributed did not define MIXPREC_C10D_GLOO on a machine with Gloo's headers"
#endif

namespace {

// The files of this process's mappings whose name contains `part` (from /proc/self/maps).
std::set<std::string> mapped(const std::string& part) {
  std::set<std::string> files;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash != std::string::npos && line.find(part, slash) != std::string::npos) {
      files.insert(line.substr(slash));
    }
  }
  return files;
}

// One libgomp loaded, and where libtorch_cpu's directory has one, that one.
bool one_openmp_runtime() {
  const auto gomp = mapped("libgomp");
  const auto torch = mapped("libtorch_cpu");
  if (torch.size() != 1) {
    std::cout << "OpenMP runtime: libtorch_cpu not found in /proc/self/maps\n";
    return false;
  }
  const auto torch_dir = std::filesystem::path(*torch.begin()).parent_path();
  bool torch_has_gomp = false;
  for (const auto& entry : std::filesystem::directory_iterator(torch_dir)) {
    torch_has_gomp = torch_has_gomp || entry.path().filename().string().rfind("libgomp", 0) == 0;
  }
  std::cout << "OpenMP runtime:";
  for (const auto& file : gomp) std::cout << ' ' << file;
  std::cout << " (libtorch_cpu in " << torch_dir.string() << ")\n";
  return gomp.size() == 1 &&
         (!torch_has_gomp || std::filesystem::path(*gomp.begin()).parent_path() == torch_dir);
}

}  // namespace

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
  const bool openmp_ok = one_openmp_runtime();
  return autocast_ok && step_ok && openmp_ok ? 0 : 1;
}
