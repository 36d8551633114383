// A training loop of your own, with only the pieces of mixprec you want: the autocast guard and
// the GradScaler. This is the loop of a PyTorch AMP user, in C++:
//
//   optimizer.zero_grad();
//   { auto guard = mixprec::autocast<Policy>(device); loss = ...; }   // forward under autocast
//   scaler.scale(loss).backward();                                   // backward outside it
//   scaler.unscale_(optimizer);                                      // then clip real gradients
//   torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
//   scaler.step(optimizer);                                          // skipped on inf/NaN
//   scaler.update();
//
// It fits y = sin(3x) + noise with a small MLP under MixedO1<BFloat16> on the CPU (MixedO1<Half>
// on a GPU), prints the loss, and saves the scaler state so a resumed run keeps its scale.
//
//   custom_loop [--steps N]   exits 1 unless the loss fell to under a third of its start

#include <mixprec/mixprec.hpp>

#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  int steps = 600;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--steps" && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else {
      std::cerr << "usage: " << argv[0] << " [--steps N]\n";
      return 2;
    }
  }
  if (steps < 1) {
    std::cerr << "usage: " << argv[0] << " [--steps N]   (N >= 1)\n";
    return 2;
  }

  using Policy = mixprec::MixedO1<at::BFloat16>;  // bf16 autocast: the CPU's mixed precision
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(1, 64), torch::nn::Tanh(),
                                     torch::nn::Linear(64, 64), torch::nn::Tanh(),
                                     torch::nn::Linear(64, 1));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(3e-3));
  // bf16 needs no scaling, but the loop is the one fp16 needs: dynamic scaling, PyTorch's defaults
  // except a growth interval that this short run can reach.
  mixprec::GradScaler scaler(mixprec::GradScalerOptions().init_scale(1024).growth_interval(100));

  const auto x = torch::linspace(-2, 2, 512).unsqueeze(1);
  const auto y = torch::sin(3 * x) + 0.05 * torch::randn_like(x);
  double first_loss = 0.0, last_loss = 0.0;
  int skipped = 0;
  for (int step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    at::Tensor loss;
    {
      auto guard = mixprec::autocast<Policy>(torch::kCPU);
      loss = torch::mse_loss(model->forward(x).to(torch::kFloat), y);
    }
    scaler.scale(loss).backward();
    scaler.unscale_(optimizer);  // clip the real gradients, not the scaled ones
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    if (!scaler.step(optimizer)) ++skipped;  // the library prints nothing: log it yourself
    scaler.update();
    last_loss = loss.item<double>();
    if (step == 0) first_loss = last_loss;
    if (step % 100 == 0) {
      std::cout << "step " << step << "  loss " << last_loss << "  scale " << scaler.get_scale()
                << "\n";
    }
  }
  std::cout << "final loss " << last_loss << " (from " << first_loss << "), skipped steps "
            << skipped << ", scale " << scaler.get_scale() << "\n";

  // The scaler state belongs in the checkpoint; this file also loads in Python with torch.load.
  const auto bytes = torch::pickle_save(c10::IValue(scaler.state_dict()));
  std::ofstream("custom_loop_scaler.pt", std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return last_loss < first_loss / 3 ? 0 : 1;
}
