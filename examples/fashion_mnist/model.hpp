#pragma once
// The demo's CNN, shared with benchmarks/bench_vs_python.cpp so both train the same model.

#include <mixprec/fp8/linear.hpp>
#include <mixprec/nn/conv.hpp>

#include <torch/torch.h>

namespace fashion_mnist {

/// conv-BN-ReLU-pool, conv-ReLU-pool, linear: 28x28 -> 14x14 -> 7x7 -> 10 classes. The BatchNorm
/// is there to exercise the policies' norm-layer rule (fp32 under MixedO2, Low under PureHalf).
/// The convolutions are mixprec::nn::Conv2d: torch::nn::Conv2d's parameters and forward, and on a
/// CPU whose fp16 weight gradients are slow, the option to compute those in fp32. The classifier
/// is a mixprec::nn::Float8Linear: a torch::nn::Linear but under MixedFP8.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : conv1(register_module("conv1", mixprec::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(16))),
        conv2(register_module("conv2", mixprec::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
        fc(register_module("fc", mixprec::nn::Float8Linear(32 * 7 * 7, 10))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    return fc(x.flatten(1));
  }

  mixprec::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  mixprec::nn::Conv2d conv2;
  mixprec::nn::Float8Linear fc;  // a torch::nn::Linear; in fp8 under MixedFP8
};
TORCH_MODULE(Net);

}  // namespace fashion_mnist
