// Data-parallel training across processes with mixprec and c10d's Gloo backend.
//
//   scripts/launch -n 2 -- build/default/examples/distributed_train --steps 200
//   torchrun --nproc_per_node 2 --no_python build/default/examples/distributed_train
//
// Each rank trains a small MLP under MixedO2<BFloat16> on its own shard of a synthetic
// regression task; the Trainer averages the gradients across ranks. At the end every rank
// checks that its weights equal rank 0's, bit for bit, and rank 0 writes a checkpoint.
#include <mixprec/mixprec.hpp>
#include <mixprec/distributed/process_group.hpp>

#include <torch/torch.h>

#include <cstdlib>
#include <iostream>
#include <string>

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(32, 256));
    fc2 = register_module("fc2", torch::nn::Linear(256, 256));
    fc3 = register_module("fc3", torch::nn::Linear(256, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    return fc3->forward(torch::gelu(fc2->forward(torch::gelu(fc1->forward(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

}  // namespace

int main(int argc, char** argv) {
  int steps = 100;
  std::string checkpoint;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--steps" && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (arg == "--checkpoint" && i + 1 < argc) {
      checkpoint = argv[++i];
    } else {
      std::cerr << "usage: distributed_train [--steps N] [--checkpoint PATH]\n";
      return 2;
    }
  }
  try {
    // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun or scripts/launch.
    const auto env = mixprec::LaunchEnvironment::from_env();
    auto group = mixprec::gloo_group(env);
    torch::manual_seed(env.rank);  // different on purpose: the Trainer starts from rank 0's weights
    Mlp model;
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
    mixprec::Trainer<mixprec::MixedO2<at::BFloat16>> trainer(
        model, optimizer,
        mixprec::TrainerOptions().max_grad_norm(1.0).distributed(mixprec::DistributedOptions(group)));

    // The task: y = sum(sin(x)); each rank draws its own shard.
    auto generator = at::detail::createCPUGenerator(1000 + static_cast<std::uint64_t>(env.rank));
    double loss = 0;
    for (int step = 1; step <= steps; ++step) {
      auto x = torch::randn({64, 32}, generator);
      auto y = torch::sin(x).sum(1, /*keepdim=*/true);
      const auto report = trainer.step([&] {
        auto out = model->forward(trainer.cast_input(x)).to(torch::kFloat);
        return (out - y).pow(2).mean();
      });
      loss = report.loss.item<double>();
      if (env.rank == 0 && (step % 50 == 0 || step == steps)) {
        std::cout << "step " << step << "  loss (rank 0's shard) " << loss << "  scale "
                  << report.scale << "\n";
      }
    }
    if (!checkpoint.empty()) trainer.save(checkpoint);  // every rank calls; rank 0 writes

    // Every rank's weights equal rank 0's: compare a checksum of their bits.
    auto flat = torch::cat({model->fc1->weight.flatten(), model->fc2->weight.flatten(),
                            model->fc3->weight.flatten()}).to(torch::kFloat);
    auto bits = flat.view(torch::kInt).to(torch::kLong).sum().reshape({1});
    std::vector<std::vector<torch::Tensor>> all(1);
    for (int r = 0; r < env.world_size; ++r) all[0].push_back(torch::empty_like(bits));
    std::vector<torch::Tensor> mine{bits};
    group->allgather(all, mine)->wait();
    for (const auto& other : all[0]) {
      if (!torch::equal(other, bits)) {
        std::cerr << "rank " << env.rank << ": weights differ from another rank's\n";
        return 1;
      }
    }
    if (env.rank == 0) {
      std::cout << env.world_size << " ranks agree: weights bitwise identical after " << steps
                << " steps; " << trainer.stats().skipped_steps << " skipped\n";
    }
  } catch (const mixprec::Error& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
