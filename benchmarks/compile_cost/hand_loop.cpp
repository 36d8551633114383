// The README example's training loop written by hand against LibTorch alone: bf16 autocast is
// left out (LibTorch has no GradScaler), the rest is what the Trainer does for the example:
// AdamW, clipping, StepLR stepped per optimizer step, a CSV line per step, a checkpoint. The
// baseline of scripts/compile-cost (docs/build.md): what a user's train.cpp costs to compile
// without mixprec.
#include <torch/torch.h>

#include <chrono>
#include <fstream>

int main() {
  auto model = torch::nn::Sequential(torch::nn::Linear(784, 256), torch::nn::ReLU(),
                                     torch::nn::Linear(256, 10));
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::StepLR scheduler(optimizer, 30, 0.5);
  std::ofstream log("train.csv");
  log << "step,loss,lr,grad_norm,samples_per_s\n";

  auto x = torch::randn({64, 784});
  auto y = torch::randint(0, 10, {64}, torch::kLong);
  for (int step = 0; step < 100; ++step) {
    const auto start = std::chrono::steady_clock::now();
    optimizer.zero_grad();
    auto logits = model->forward(x);
    auto loss = torch::nn::functional::cross_entropy(logits, y);
    loss.backward();
    const double norm = torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    optimizer.step();
    scheduler.step();
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    log << step + 1 << ',' << loss.item<double>() << ','
        << optimizer.param_groups()[0].options().get_lr() << ',' << norm << ','
        << 64 / took.count() << '\n';
  }
  torch::save(model, "model.pt");
  torch::save(optimizer, "optimizer.pt");
}
