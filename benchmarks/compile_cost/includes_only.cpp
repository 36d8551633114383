// mixprec's headers and LibTorch's, nothing used: what including mixprec costs (scripts/compile-cost).
#include <mixprec/mixprec.hpp>
#include <torch/torch.h>

int main() {}
