// A sequence tagger with masked self-attention, trained under MixedO2<BFloat16> with the stable
// ops of mixprec::ops. The data are padded batches of sequences of varied length; each token is
// tagged 1 when the same token occurs elsewhere in its sequence, which the model can only learn
// by attending over the real (unpadded) positions.
//
// Padding is filled with garbage on purpose (huge embeddings): masked_softmax and the masked loss
// must keep it from influencing anything. In bf16 the usual fp32 recipe (-1e32 fill, 1e-13
// epsilon) is what silently breaks here; see docs/numerics.md.
//
//   masked_attention_tagger [--steps N] [--smoke]   exits 1 unless the test accuracy > 0.85
//   masked_attention_tagger --advise                mixprec::advise's verdict on the model
//   masked_attention_tagger --keep-fp32 PATTERN     (repeatable) a precision map: advise's for
//       the policy, plus these modules kept in fp32 (e.g. `out`, the classifier), then train

#include <mixprec/mixprec.hpp>

#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

namespace {

namespace ops = mixprec::ops;
using Policy = mixprec::MixedO2<at::BFloat16>;

constexpr std::int64_t kVocab = 24;  // token 0 is padding
constexpr std::int64_t kMaxLength = 24;

struct Batch {
  at::Tensor tokens;  // [batch, length] int64, 0 = padding
  at::Tensor mask;    // [batch, length] bool, true = real token
  at::Tensor tags;    // [batch, length] int64: 1 when the token occurs elsewhere in the sequence
};

Batch make_batch(std::int64_t batch, torch::Generator& generator) {
  const auto lengths = torch::randint(4, kMaxLength + 1, {batch}, generator, at::kLong);
  const auto positions = torch::arange(kMaxLength).unsqueeze(0);
  const auto mask = positions < lengths.unsqueeze(1);
  const auto tokens = torch::randint(1, kVocab, {batch, kMaxLength}, generator, at::kLong) * mask;
  const auto same = tokens.unsqueeze(2) == tokens.unsqueeze(1);              // [b, i, j]
  const auto others = mask.unsqueeze(1) & ~torch::eye(kMaxLength, at::kBool).unsqueeze(0);
  const auto tags = ((same & others).any(2) & mask).to(at::kLong);
  return {tokens, mask, tags};
}

struct TaggerImpl : torch::nn::Module {
  explicit TaggerImpl(std::int64_t d)
      : embedding(register_module("embedding", torch::nn::Embedding(kVocab, d))),
        query(register_module("query", torch::nn::Linear(d, d))),
        key(register_module("key", torch::nn::Linear(d, d))),
        value(register_module("value", torch::nn::Linear(d, d))),
        hidden(register_module("hidden", torch::nn::Linear(2 * d, d))),
        out(register_module("out", mixprec::nn::Mappable<torch::nn::Linear>(d, 2))),
        scale(1.0 / std::sqrt(static_cast<double>(d))) {}

  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& mask) {
    auto x = embedding->forward(tokens);
    // Garbage in the padding: masked positions must never matter.
    x = x.masked_fill(~mask.unsqueeze(-1), 1e4);
    at::Tensor context;
    {
      // Names the ops between the layers for mixprec::advise (and LibTorch's profiler).
      mixprec::NamedScope scope("attention");
      const auto scores = torch::matmul(query->forward(x), key->forward(x).transpose(1, 2)) * scale;
      const auto n = tokens.size(1);
      const auto keys = mask.unsqueeze(1) & ~torch::eye(n, at::kBool).unsqueeze(0);  // not itself
      const auto attention = ops::masked_softmax<Policy>(scores, keys);
      context = torch::matmul(attention, value->forward(x));
    }
    return out->forward(torch::relu(hidden->forward(torch::cat({x, context}, -1))));
  }

  torch::nn::Embedding embedding;
  torch::nn::Linear query, key, value, hidden;
  mixprec::nn::Mappable<torch::nn::Linear> out;  // a precision map can keep it in fp32
  double scale;
};
TORCH_MODULE(Tagger);

}  // namespace

int main(int argc, char** argv) {
  int steps = 400;
  bool advise = false;
  std::vector<std::string> keep_fp32;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--steps" && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (arg == "--smoke") {
      steps = 150;
    } else if (arg == "--advise") {
      advise = true;
    } else if (arg == "--keep-fp32" && i + 1 < argc) {
      keep_fp32.emplace_back(argv[++i]);
    } else {
      std::cerr << "usage: " << argv[0]
                << " [--steps N] [--smoke] [--advise] [--keep-fp32 PATTERN]...\n";
      return 2;
    }
  }
  if (steps < 1) {
    std::cerr << "usage: " << argv[0] << " [--steps N] [--smoke]   (N >= 1)\n";
    return 2;
  }

  torch::manual_seed(0);
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(1);
  Tagger tagger(32);
  const auto measure = [&] {  // before the Trainer casts the model: advise measures it in fp32
    return mixprec::advise(tagger, [&] {
      const auto batch = make_batch(32, generator);
      return ops::sequence_cross_entropy_with_logits<Policy>(
          tagger->forward(batch.tokens, batch.mask), batch.tags, batch.mask, ops::Average::token);
    });
  };
  if (advise) {
    std::cout << measure();
    return 0;
  }
  if (!keep_fp32.empty()) {
    // The modules the policy's dtype cannot hold (none, for this model in bf16), and yours.
    auto map = measure().precision_map(Policy::low_dtype);
    for (const auto& pattern : keep_fp32) map.keep_fp32(pattern);
    for (const auto& m : mixprec::apply_precision_map<Policy>(tagger, map)) {
      std::cout << "precision map: " << m.name << " in " << m.dtype << "\n";
    }
  }
  torch::optim::Adam adam(tagger->parameters(), torch::optim::AdamOptions(3e-3));
  mixprec::Trainer<Policy> trainer(tagger, adam, mixprec::TrainerOptions().max_grad_norm(1.0));

  for (int step = 0; step < steps; ++step) {
    const auto batch = make_batch(32, generator);
    const auto report = trainer.step([&] {
      const auto logits = tagger->forward(batch.tokens, batch.mask);
      return ops::sequence_cross_entropy_with_logits<Policy>(logits, batch.tags, batch.mask,
                                                             ops::Average::token);
    });
    if (step % 50 == 0 || step + 1 == steps) {
      std::cout << "step " << step << "  loss " << report.loss.item<double>() << "  grad norm "
                << report.grad_norm.value_or(0.0) << "  " << report.status << "\n";
    }
  }

  const auto test = make_batch(512, generator);
  const auto logits = trainer.evaluate([&] { return tagger->forward(test.tokens, test.mask); });
  const auto correct = (logits.argmax(-1) == test.tags) & test.mask;
  const double accuracy = correct.sum().item<double>() / test.mask.sum().item<double>();
  const double majority = std::max(test.tags.masked_select(test.mask).to(at::kDouble).mean().item<double>(),
                                   1.0 - test.tags.masked_select(test.mask).to(at::kDouble).mean().item<double>());
  std::cout << "test token accuracy " << accuracy << " (majority class " << majority << "), "
            << trainer.stats().skipped_steps << " skipped steps, policy " << Policy::name << "\n";
  return accuracy > 0.85 ? 0 : 1;
}
