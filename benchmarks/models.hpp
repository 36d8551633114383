#pragma once
// Models and data shared by the benchmarks: the Fashion-MNIST demo's CNN and a one-block
// transformer tagger with masked self-attention over padded sequences.
//
// benchmarks/python/train_loop.py builds the same modules in the same order and draws the same
// batches in the same order, so that one seed gives bit-identical initial weights and data in
// C++ and in Python (bench_vs_python checks the checksums).

#include <mixprec/mixprec.hpp>

#include <torch/torch.h>

#include "../examples/fashion_mnist/model.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace bench::models {

/// `depth` Linear(width, width) + ReLU layers.
inline torch::nn::Sequential mlp(int depth, int width) {
  torch::nn::Sequential net;
  for (int i = 0; i < depth; ++i) {
    net->push_back(torch::nn::Linear(width, width));
    net->push_back(torch::nn::ReLU());
  }
  return net;
}

/// mlp with each Linear declared as mixprec::nn::Mappable<torch::nn::Linear>, which computes as
/// the Linear: the same model, but its layers can be ZeRO-3's units (mlp_unit_paths).
inline torch::nn::Sequential mlp_units(int depth, int width) {
  torch::nn::Sequential net;
  for (int i = 0; i < depth; ++i) {
    net->push_back(mixprec::nn::Mappable<torch::nn::Linear>(width, width));
    net->push_back(torch::nn::ReLU());
  }
  return net;
}

/// The paths of mlp_units' Linear layers ("0", "2", ...): DistributedOptions::shard_parameters.
inline std::vector<std::string> mlp_unit_paths(int depth) {
  std::vector<std::string> paths;
  for (int i = 0; i < depth; ++i) paths.push_back(std::to_string(2 * i));
  return paths;
}

inline std::int64_t parameter_count(const torch::nn::Module& net) {
  std::int64_t n = 0;
  for (const auto& p : net.parameters()) n += p.numel();
  return n;
}

/// The demo's CNN: conv-BN-ReLU-pool, conv-ReLU-pool, linear.
using Cnn = fashion_mnist::Net;

/// Sizes of the tagger and its batches.
struct TaggerConfig {
  std::int64_t vocab = 1000;
  std::int64_t d = 32;
  std::int64_t heads = 4;
  std::int64_t seq = 16;
  std::int64_t classes = 10;
  std::int64_t batch = 8;
};

/// Softmax of attention scores [batch, heads, queries, keys] over the keys, padded keys excluded.
/// `keep` is [batch, 1, 1, keys], true at real tokens; `pad` is its negation.
using AttentionSoftmax = at::Tensor (*)(const at::Tensor& scores, const at::Tensor& keep,
                                        const at::Tensor& pad);

/// mixprec's stable op: fp32 inside, output per policy P (fp32 under MixedO1).
template <class P>
at::Tensor mixprec_softmax(const at::Tensor& scores, const at::Tensor& keep, const at::Tensor&) {
  return mixprec::ops::masked_softmax<P>(scores, keep);
}

/// What Python code usually writes: scores.masked_fill(pad, -inf).softmax(-1).
inline at::Tensor composite_softmax(const at::Tensor& scores, const at::Tensor&,
                                    const at::Tensor& pad) {
  return scores.masked_fill(pad, -std::numeric_limits<double>::infinity()).softmax(-1);
}

/// Embedding, one pre-norm block (masked multi-head self-attention, MLP), per-token classifier.
struct TaggerImpl : torch::nn::Module {
  TaggerImpl(const TaggerConfig& config, AttentionSoftmax softmax)
      : heads(config.heads),
        scale(1.0 / std::sqrt(static_cast<double>(config.d / config.heads))),
        attention_softmax(softmax),
        emb(register_module("emb", torch::nn::Embedding(config.vocab, config.d))),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.d})))),
        qkv(register_module("qkv", torch::nn::Linear(config.d, 3 * config.d))),
        proj(register_module("proj", torch::nn::Linear(config.d, config.d))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.d})))),
        fc1(register_module("fc1", torch::nn::Linear(config.d, 4 * config.d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * config.d, config.d))),
        head(register_module("head", torch::nn::Linear(config.d, config.classes))) {}

  /// tokens [batch, seq] -> logits [batch, seq, classes].
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& keep,
                        const torch::Tensor& pad) {
    const auto b = tokens.size(0);
    const auto s = tokens.size(1);
    auto h = emb(tokens);
    const auto qkv_heads =
        qkv(ln1(h)).view({b, s, 3, heads, -1}).permute({2, 0, 3, 1, 4}).unbind(0);
    const auto scores = at::matmul(qkv_heads[0], qkv_heads[1].transpose(-2, -1)) * scale;
    const auto weights = attention_softmax(scores, keep, pad);
    h = h + proj(at::matmul(weights, qkv_heads[2]).transpose(1, 2).reshape({b, s, -1}));
    h = h + fc2(torch::gelu(fc1(ln2(h))));
    return head(h);
  }

  std::int64_t heads;
  double scale;
  AttentionSoftmax attention_softmax;
  torch::nn::Embedding emb;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv;
  torch::nn::Linear proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
  torch::nn::Linear head;
};
TORCH_MODULE(Tagger);

struct ImageBatch {
  at::Tensor x;  // [batch, 1, 28, 28]
  at::Tensor y;  // [batch]
};

/// Random images and labels, drawn as train_loop.py's image_batches draws them.
inline std::vector<ImageBatch> image_batches(std::size_t count, std::int64_t batch) {
  std::vector<ImageBatch> out;
  for (std::size_t i = 0; i < count; ++i) {
    auto x = torch::randn({batch, 1, 28, 28});
    auto y = torch::randint(0, 10, {batch}, at::kLong);
    out.push_back({x, y});
  }
  return out;
}

struct TokenBatch {
  at::Tensor tokens;  // [batch, seq], 0 at padding
  at::Tensor labels;  // [batch, seq], -100 (ignored) at padding
  at::Tensor keep;    // [batch, 1, 1, seq], true at real tokens
  at::Tensor pad;     // !keep
};

/// Sequences of random length in [seq/2, seq], padded to seq, as train_loop.py draws them.
inline std::vector<TokenBatch> token_batches(std::size_t count, const TaggerConfig& c) {
  std::vector<TokenBatch> out;
  for (std::size_t i = 0; i < count; ++i) {
    const auto lengths = torch::randint(c.seq / 2, c.seq + 1, {c.batch}, at::kLong);
    auto tokens = torch::randint(1, c.vocab, {c.batch, c.seq}, at::kLong);
    auto labels = torch::randint(0, c.classes, {c.batch, c.seq}, at::kLong);
    const auto keep = torch::arange(c.seq).unsqueeze(0) < lengths.unsqueeze(1);
    tokens = tokens.masked_fill(keep.logical_not(), 0);
    labels = labels.masked_fill(keep.logical_not(), -100);
    const auto keep4 = keep.view({c.batch, 1, 1, c.seq});
    out.push_back({tokens, labels, keep4, keep4.logical_not()});
  }
  return out;
}

/// A model and its loss on batch i (cycling through the batches): what a training loop needs.
struct Bound {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(std::size_t)> loss;
};

/// The CNN, initialised from `seed`, with its cross-entropy loss over `data`.
inline Bound bind_cnn(std::uint64_t seed, std::shared_ptr<const std::vector<ImageBatch>> data) {
  torch::manual_seed(seed);
  Cnn model;
  Bound bound;
  bound.module = model.ptr();
  bound.loss = [model, data](std::size_t i) mutable {
    const auto& b = (*data)[i % data->size()];
    return torch::nn::functional::cross_entropy(model->forward(b.x), b.y);
  };
  return bound;
}

/// The tagger, initialised from `seed`, with its per-token cross-entropy (padding ignored).
inline Bound bind_tagger(std::uint64_t seed, const TaggerConfig& config, AttentionSoftmax softmax,
                         std::shared_ptr<const std::vector<TokenBatch>> data) {
  torch::manual_seed(seed);
  Tagger model(config, softmax);
  Bound bound;
  bound.module = model.ptr();
  const auto classes = config.classes;
  bound.loss = [model, data, classes](std::size_t i) mutable {
    const auto& b = (*data)[i % data->size()];
    return torch::nn::functional::cross_entropy(
        model->forward(b.tokens, b.keep, b.pad).view({-1, classes}), b.labels.view({-1}));
  };
  return bound;
}

/// The sum of all elements as double, in order: equal in C++ and Python for equal tensors.
inline double checksum(const std::vector<at::Tensor>& tensors) {
  double total = 0.0;
  for (const auto& t : tensors) total += t.detach().to(at::kDouble).sum().item<double>();
  return total;
}

}  // namespace bench::models
