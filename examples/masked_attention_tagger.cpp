// A sequence tagger with masked self-attention, trained under MixedO2<BFloat16> (or another
// policy: --policy, --compare) with the stable ops of mixprec::ops. The data are padded batches of sequences of varied length; each token is
// tagged 1 when the same token occurs elsewhere in its sequence, which the model can only learn
// by attending over the real (unpadded) positions.
//
// Padding is filled with garbage on purpose (huge embeddings): masked_softmax and the masked loss
// must keep it from influencing anything. In bf16 the usual fp32 recipe (-1e32 fill, 1e-13
// epsilon) is what silently breaks here; see docs/numerics.md.
//
//   masked_attention_tagger [--steps N] [--smoke]   exits 1 unless the test accuracy > 0.85
//   masked_attention_tagger --policy fp8            MixedFP8: query, key, value and hidden are
//       mixprec::nn::Float8Linear, in fp8; the classifier stays bf16 (also fp32, bf16, fp8-delayed)
//   masked_attention_tagger --compare               every policy from the same seed, as a table;
//       exits 1 unless none of the fp8 ones is more than 1 point below FullPrecision's accuracy
//       (NVFP4's 4-bit values are reported, not held to it)
//   masked_attention_tagger --compare --width 128 --policies fp32,bf16,fp8,mxfp8,nvfp4
//       the block-scaled recipes (mxfp8, mxfp8-rceil, blockwise, nvfp4) need widths their
//       blocks tile: 32 (MXFP8), 128 (blockwise), 16 (NVFP4); the default width is 32
//   masked_attention_tagger --compare --seeds 5 --policies bf16,mxfp8,...
//       each policy from seeds 0..4 (initial weights and data), the first policy the reference:
//       the mean accuracy, and the mean paired difference to the reference with its standard
//       error and the worst seed's
//   masked_attention_tagger --advise                mixprec::advise's verdict on the model
//   masked_attention_tagger --keep-fp32 PATTERN     (repeatable) a precision map: advise's for
//       the policy, plus these modules kept in fp32 (e.g. `out`, the classifier), then train

#include <mixprec/mixprec.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace ops = mixprec::ops;
// The ops' dtype rules differ only under autocast (MixedO1), which this example does not use:
// one policy serves the model's forward under every Trainer policy below.
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
        query(register_module("query", mixprec::nn::Float8Linear(d, d))),
        key(register_module("key", mixprec::nn::Float8Linear(d, d))),
        value(register_module("value", mixprec::nn::Float8Linear(d, d))),
        hidden(register_module("hidden", mixprec::nn::Float8Linear(2 * d, d))),
        out(register_module("out", mixprec::nn::Mappable<mixprec::nn::Linear>(d, 2))),
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
  // mixprec::nn::Linear (F.linear) under every policy but MixedFP8, where their products run
  // in fp8.
  mixprec::nn::Float8Linear query, key, value, hidden;
  mixprec::nn::Mappable<mixprec::nn::Linear> out;  // a precision map can keep it in fp32
  double scale;
};
TORCH_MODULE(Tagger);

struct Result {
  double accuracy = 0, majority = 0, seconds = 0;
  std::int64_t skipped = 0;
};

// Trains a fresh tagger (initial weights from `seed`, the data from seed + 1) under P for
// `steps` steps and tests it.
template <class P>
Result train(int steps, const std::vector<std::string>& keep_fp32, bool verbose, std::int64_t width,
             std::uint64_t seed) {
  torch::manual_seed(seed);
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(seed + 1);
  Tagger tagger(width);
  const auto measure = [&] {  // before the Trainer casts the model: advise measures it in fp32
    return mixprec::advise(tagger, [&] {
      const auto batch = make_batch(32, generator);
      return ops::sequence_cross_entropy_with_logits<P>(
          tagger->forward(batch.tokens, batch.mask), batch.tags, batch.mask, ops::Average::token);
    });
  };
  if (!keep_fp32.empty()) {
    // The modules the policy's dtype cannot hold (none, for this model in bf16), and yours.
    auto map = measure().precision_map(P::low_dtype);
    for (const auto& pattern : keep_fp32) map.keep_fp32(pattern);
    for (const auto& m : mixprec::apply_precision_map<P>(tagger, map)) {
      std::cout << "precision map: " << m.name << " in " << m.dtype << "\n";
    }
  }
  torch::optim::Adam adam(tagger->parameters(), torch::optim::AdamOptions(3e-3));
  mixprec::Trainer<P> trainer(tagger, adam, mixprec::TrainerOptions().max_grad_norm(1.0));

  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < steps; ++step) {
    const auto batch = make_batch(32, generator);
    const auto report = trainer.step([&] {
      const auto logits = tagger->forward(batch.tokens, batch.mask);
      return ops::sequence_cross_entropy_with_logits<P>(logits, batch.tags, batch.mask,
                                                        ops::Average::token);
    });
    if (verbose && (step % 50 == 0 || step + 1 == steps)) {
      std::cout << "step " << step << "  loss " << report.loss.template item<double>() << "  grad norm "
                << report.grad_norm.value_or(0.0) << "  " << report.status << "\n";
    }
  }
  Result result;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const auto test = make_batch(512, generator);
  const auto logits = trainer.evaluate([&] { return tagger->forward(test.tokens, test.mask); });
  const auto correct = (logits.argmax(-1) == test.tags) & test.mask;
  result.accuracy = correct.sum().template item<double>() / test.mask.sum().template item<double>();
  const double ones = test.tags.masked_select(test.mask).to(at::kDouble).mean().template item<double>();
  result.majority = std::max(ones, 1.0 - ones);
  result.skipped = trainer.stats().skipped_steps;
  return result;
}

// The policies that compute in a low-precision format: MixedFP8 with each recipe.
bool low_bit(const std::string& policy) {
  return policy.starts_with("fp8") || policy.starts_with("mxfp8") || policy == "blockwise" ||
         policy == "nvfp4";
}

// One policy by name: fp32, bf16 (the default), fp8, fp8-delayed, mxfp8, mxfp8-rceil, blockwise,
// nvfp4. (A template on the recipes only so that MixedFP8 is not compiled under LibTorch 1.13,
// which has no fp8.)
template <class Tensorwise = mixprec::TensorwiseScaling, class Delayed = mixprec::DelayedScaling<>,
          class MxFloor = mixprec::MXFP8Scaling<>, class MxRceil = mixprec::MXFP8Scaling<mixprec::MxScale::rceil>,
          class Blockwise = mixprec::BlockwiseFP8Scaling, class Nvfp4 = mixprec::NVFP4>
Result train_named(const std::string& policy, int steps, const std::vector<std::string>& keep_fp32,
                   bool verbose, std::int64_t width, std::uint64_t seed = 0) {
  if (policy == "fp32") return train<mixprec::FullPrecision>(steps, keep_fp32, verbose, width, seed);
  if (policy == "bf16") return train<mixprec::MixedO2<at::BFloat16>>(steps, keep_fp32, verbose, width, seed);
  if constexpr (mixprec::has_fp8) {
    // The classifier `out` stays bf16, as torchao and Transformer Engine advise for the last layer.
    if (policy == "fp8") return train<mixprec::MixedFP8<Tensorwise>>(steps, keep_fp32, verbose, width, seed);
    if (policy == "fp8-delayed") return train<mixprec::MixedFP8<Delayed>>(steps, keep_fp32, verbose, width, seed);
    if (policy == "mxfp8") return train<mixprec::MixedFP8<MxFloor>>(steps, keep_fp32, verbose, width, seed);
    if (policy == "mxfp8-rceil") return train<mixprec::MixedFP8<MxRceil>>(steps, keep_fp32, verbose, width, seed);
    if (policy == "blockwise") return train<mixprec::MixedFP8<Blockwise>>(steps, keep_fp32, verbose, width, seed);
    if (policy == "nvfp4") return train<mixprec::MixedFP8<Nvfp4>>(steps, keep_fp32, verbose, width, seed);
  } else if (low_bit(policy)) {
    throw std::runtime_error("fp8 needs LibTorch >= 2.5; this is LibTorch " +
                             std::string(mixprec::torch_version));
  }
  throw std::runtime_error("unknown policy '" + policy + "' (fp32, bf16, fp8, fp8-delayed, mxfp8, "
                           "mxfp8-rceil, blockwise, nvfp4)");
}

std::string policy_name(const std::string& policy) {
  if (policy == "fp32") return std::string(mixprec::FullPrecision::name);
  if (policy == "bf16") return std::string(mixprec::MixedO2<at::BFloat16>::name);
  if (policy == "fp8") return "MixedFP8<TensorwiseScaling>";
  if (policy == "fp8-delayed") return "MixedFP8<DelayedScaling>";
  if (policy == "mxfp8") return "MixedFP8<MXFP8Scaling<floor>>";
  if (policy == "mxfp8-rceil") return "MixedFP8<MXFP8Scaling<rceil>>";
  if (policy == "blockwise") return "MixedFP8<BlockwiseFP8Scaling>";
  return "MixedFP8<NVFP4Scaling>";
}

// --compare --seeds N: every policy from seeds 0..N-1; each seed's accuracy against the first
// policy's from the same seed (the same initial weights and data), so that what the seeds share
// cancels. Information, not a test: exits 0 unless a run fails.
int compare_seeds(const std::vector<std::string>& policies, int seeds, int steps,
                  const std::vector<std::string>& keep_fp32, std::int64_t width) {
  std::vector<double> reference;
  std::cout << "| policy | mean test token accuracy | vs " << policy_name(policies.front())
            << ", mean pp | standard error pp | worst seed pp | train s (mean) |\n"
            << "|---|---:|---:|---:|---:|---:|\n";
  for (const auto& p : policies) {
    std::vector<double> accuracy, points;
    double seconds = 0;
    for (int seed = 0; seed < seeds; ++seed) {
      const auto r = train_named(p, steps, keep_fp32, /*verbose=*/false, width,
                                 static_cast<std::uint64_t>(seed));
      accuracy.push_back(r.accuracy);
      seconds += r.seconds / seeds;
      std::cerr << p << " seed " << seed << ": accuracy " << r.accuracy << ", " << r.skipped
                << " skipped steps\n";
    }
    if (reference.empty()) reference = accuracy;
    double mean = 0, mean_points = 0, worst = 1e9;
    for (int seed = 0; seed < seeds; ++seed) {
      points.push_back(100 * (accuracy[seed] - reference[seed]));
      mean += accuracy[seed] / seeds;
      mean_points += points.back() / seeds;
      worst = std::min(worst, points.back());
    }
    double variance = 0;
    for (const double d : points) variance += (d - mean_points) * (d - mean_points) / (seeds - 1);
    std::cout << "| " << policy_name(p) << " | " << std::fixed << std::setprecision(4) << mean
              << " | " << std::showpos << std::setprecision(2) << mean_points << " | "
              << std::noshowpos << std::sqrt(variance / seeds) << " | " << std::showpos << worst
              << std::noshowpos << " | " << std::setprecision(1) << seconds << " |\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 400, seeds = 1;
  std::int64_t width = 32;
  bool advise = false, compare = false;
  std::string policy = "bf16";
  std::vector<std::string> keep_fp32, chosen;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--steps" && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (arg == "--smoke") {
      steps = 150;
    } else if (arg == "--advise") {
      advise = true;
    } else if (arg == "--compare") {
      compare = true;
    } else if (arg == "--policy" && i + 1 < argc) {
      policy = argv[++i];
    } else if (arg == "--keep-fp32" && i + 1 < argc) {
      keep_fp32.emplace_back(argv[++i]);
    } else if (arg == "--seeds" && i + 1 < argc) {
      seeds = std::atoi(argv[++i]);
    } else if (arg == "--width" && i + 1 < argc) {
      width = std::atoll(argv[++i]);
    } else if (arg == "--policies" && i + 1 < argc) {
      std::stringstream list(argv[++i]);
      for (std::string p; std::getline(list, p, ',');) chosen.push_back(p);
    } else {
      std::cerr << "usage: " << argv[0] << " [--steps N] [--smoke] [--advise] [--compare] "
                << "[--policy fp32|bf16|fp8|fp8-delayed|mxfp8|mxfp8-rceil|blockwise|nvfp4] "
                << "[--width D] [--policies P,P,...] [--seeds N] [--keep-fp32 PATTERN]...\n";
      return 2;
    }
  }
  if (steps < 1 || width < 1 || seeds < 1) {
    std::cerr << "usage: " << argv[0] << " [--steps N] [--width D] [--seeds N]   (each >= 1)\n";
    return 2;
  }
  if (advise) {
    torch::manual_seed(0);
    auto generator = torch::make_generator<at::CPUGeneratorImpl>(1);
    Tagger tagger(32);
    std::cout << mixprec::advise(tagger, [&] {
      const auto batch = make_batch(32, generator);
      return ops::sequence_cross_entropy_with_logits<Policy>(
          tagger->forward(batch.tokens, batch.mask), batch.tags, batch.mask, ops::Average::token);
    });
    return 0;
  }
  if (!compare) {
    const auto r = train_named(policy, steps, keep_fp32, /*verbose=*/true, width);
    std::cout << "test token accuracy " << r.accuracy << " (majority class " << r.majority << "), "
              << r.skipped << " skipped steps, policy " << policy_name(policy) << "\n";
    return r.accuracy > 0.85 ? 0 : 1;
  }
  // Every policy from the same seed and data: no fp8 one may fall more than 1 point below fp32.
  std::vector<std::string> policies{"fp32", "bf16"};
  if (mixprec::has_fp8) policies.insert(policies.end(), {"fp8", "fp8-delayed"});
  if (!chosen.empty()) policies = chosen;
  if (seeds > 1) return compare_seeds(policies, seeds, steps, keep_fp32, width);
  std::cout << "| policy | test token accuracy | vs FullPrecision | skipped steps | train s |\n"
            << "|---|---|---|---|---|\n";
  double reference = 0;
  bool within = true;
  for (const auto& p : policies) {
    const auto r = train_named(p, steps, keep_fp32, /*verbose=*/false, width);
    if (p == "fp32") reference = r.accuracy;
    const double points = 100 * (r.accuracy - reference);
    within = within && r.accuracy > 0.85 && (!low_bit(p) || p == "nvfp4" || points >= -1.0);
    std::cout << "| " << policy_name(p) << " | " << std::fixed << std::setprecision(4)
              << r.accuracy << " | " << std::showpos << std::setprecision(2) << points
              << " pp" << std::noshowpos << " | " << r.skipped << " | " << std::setprecision(1)
              << r.seconds << " |\n";
  }
  std::cout << (within ? "every policy above 0.85, no fp8 one more than 1 pp below FullPrecision\n"
                       : "a policy fell below 0.85, or an fp8 one more than 1 pp below FullPrecision\n");
  return within ? 0 : 1;
}
