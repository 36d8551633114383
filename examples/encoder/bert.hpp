#pragma once
// A BERT encoder as LibTorch modules whose parameter names are those of Hugging Face's
// BertModel checkpoints ("encoder.layer.0.attention.self.query.weight", ...), so that a
// model.safetensors loads by name (mixprec::load_weights); its attention masks padding with
// mixprec::ops::masked_softmax under the training policy. And a sentence classifier on top: mean pooling over the real
// tokens (as sentence-transformers pools all-MiniLM-L6-v2), dropout, one Linear.
// The encoder layers' six linear layers are mixprec::nn::Float8Linear: mixprec::nn::Linear
// (F.linear, what apply_lora adapts) under every policy but MixedFP8, under which they compute
// in its recipe's format; the pooler and the classifier's head stay mixprec::nn::Linear (bf16
// under MixedFP8, as torchao and Transformer Engine advise for the last layer).

#include <mixprec/mixprec.hpp>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

namespace encoder {

/// The fields of a BERT config.json this encoder uses.
struct BertConfig {
  std::int64_t vocab_size = 30522;
  std::int64_t hidden_size = 384;
  std::int64_t num_hidden_layers = 6;
  std::int64_t num_attention_heads = 12;
  std::int64_t intermediate_size = 1536;
  std::int64_t max_position_embeddings = 512;
  std::int64_t type_vocab_size = 2;
  double layer_norm_eps = 1e-12;
  double hidden_dropout_prob = 0.1;
  double attention_probs_dropout_prob = 0.1;

  /// Reads config.json; an Error names a field that is missing or not a number, or a model
  /// that is not a BERT with GELU activations.
  static BertConfig from_file(const std::string& path) {
    std::ifstream in(path);
    MIXPREC_CHECK(in, "BertConfig: cannot open '", path, "'");
    nlohmann::json json;
    try {
      json = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      mixprec::detail::fail("BertConfig: '", path, "' is not valid JSON: ", e.what());
    }
    MIXPREC_CHECK(json.value("model_type", std::string()) == "bert" &&
                      json.value("hidden_act", std::string()) == "gelu",
                  "BertConfig: '", path, "' is not a BERT model with GELU activations "
                  "(model_type \"bert\", hidden_act \"gelu\")");
    BertConfig c;
    const auto integer = [&](const char* key, std::int64_t& field) {
      MIXPREC_CHECK(json.contains(key) && json[key].is_number_integer() && json[key].get<std::int64_t>() > 0,
                    "BertConfig: '", path, "' lacks a positive integer '", key, "'");
      field = json[key].get<std::int64_t>();
    };
    const auto number = [&](const char* key, double& field) {
      MIXPREC_CHECK(json.contains(key) && json[key].is_number(), "BertConfig: '", path,
                    "' lacks the number '", key, "'");
      field = json[key].get<double>();
    };
    integer("vocab_size", c.vocab_size);
    integer("hidden_size", c.hidden_size);
    integer("num_hidden_layers", c.num_hidden_layers);
    integer("num_attention_heads", c.num_attention_heads);
    integer("intermediate_size", c.intermediate_size);
    integer("max_position_embeddings", c.max_position_embeddings);
    integer("type_vocab_size", c.type_vocab_size);
    number("layer_norm_eps", c.layer_norm_eps);
    number("hidden_dropout_prob", c.hidden_dropout_prob);
    number("attention_probs_dropout_prob", c.attention_probs_dropout_prob);
    MIXPREC_CHECK(c.hidden_size % c.num_attention_heads == 0, "BertConfig: hidden_size ",
                  c.hidden_size, " is not a multiple of num_attention_heads ",
                  c.num_attention_heads);
    return c;
  }
};

// Linear + dropout + LayerNorm(x + residual): BertSelfOutput and BertOutput.
struct BertResidualImpl : torch::nn::Module {
  BertResidualImpl(std::int64_t in, const BertConfig& c)
      : dense(register_module("dense", mixprec::nn::Float8Linear(in, c.hidden_size))),
        LayerNorm(register_module(
            "LayerNorm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size})
                                                  .eps(c.layer_norm_eps)))),
        dropout(register_module("dropout", torch::nn::Dropout(c.hidden_dropout_prob))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& residual) {
    return LayerNorm(dropout(dense(x)) + residual);
  }
  mixprec::nn::Float8Linear dense;
  torch::nn::LayerNorm LayerNorm;  // the checkpoint's name
  torch::nn::Dropout dropout;
};
TORCH_MODULE(BertResidual);

struct BertSelfAttentionImpl : torch::nn::Module {
  explicit BertSelfAttentionImpl(const BertConfig& c)
      : heads(c.num_attention_heads),
        query(register_module("query", mixprec::nn::Float8Linear(c.hidden_size, c.hidden_size))),
        key(register_module("key", mixprec::nn::Float8Linear(c.hidden_size, c.hidden_size))),
        value(register_module("value", mixprec::nn::Float8Linear(c.hidden_size, c.hidden_size))),
        dropout(register_module("dropout", torch::nn::Dropout(c.attention_probs_dropout_prob))) {}

  /// x [batch, tokens, hidden]; keep [batch, 1, 1, tokens], true at real tokens.
  template <class P>
  at::Tensor forward(const at::Tensor& x, const at::Tensor& keep) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2) / heads;
    const auto split = [&](const at::Tensor& y) { return y.view({b, t, heads, d}).transpose(1, 2); };
    const auto q = split(query(x)), k = split(key(x)), v = split(value(x));
    const auto scores = at::matmul(q, k.transpose(-1, -2)) * std::pow(static_cast<double>(d), -0.5);
    // fp32 inside; padded keys weigh exactly 0, a row of padding gives zeros, never NaN.
    const auto probs = mixprec::ops::masked_softmax<P>(scores, keep).to(v.scalar_type());
    return at::matmul(dropout(probs), v).transpose(1, 2).reshape({b, t, heads * d});
  }
  std::int64_t heads;
  mixprec::nn::Float8Linear query, key, value;
  torch::nn::Dropout dropout;
};
TORCH_MODULE(BertSelfAttention);

struct BertAttentionImpl : torch::nn::Module {
  explicit BertAttentionImpl(const BertConfig& c)
      : self(register_module("self", BertSelfAttention(c))),
        output(register_module("output", BertResidual(c.hidden_size, c))) {}
  template <class P>
  at::Tensor forward(const at::Tensor& x, const at::Tensor& keep) {
    return output(self->template forward<P>(x, keep), x);
  }
  BertSelfAttention self;
  BertResidual output;
};
TORCH_MODULE(BertAttention);

struct BertIntermediateImpl : torch::nn::Module {
  explicit BertIntermediateImpl(const BertConfig& c)
      : dense(register_module("dense", mixprec::nn::Float8Linear(c.hidden_size, c.intermediate_size))) {}
  at::Tensor forward(const at::Tensor& x) { return at::gelu(dense(x)); }  // erf GELU: "gelu"
  mixprec::nn::Float8Linear dense;
};
TORCH_MODULE(BertIntermediate);

struct BertLayerImpl : torch::nn::Module {
  explicit BertLayerImpl(const BertConfig& c)
      : attention(register_module("attention", BertAttention(c))),
        intermediate(register_module("intermediate", BertIntermediate(c))),
        output(register_module("output", BertResidual(c.intermediate_size, c))) {}
  template <class P>
  at::Tensor forward(const at::Tensor& x, const at::Tensor& keep) {
    const auto a = attention->template forward<P>(x, keep);
    return output(intermediate(a), a);
  }
  BertAttention attention;
  BertIntermediate intermediate;
  BertResidual output;
};
TORCH_MODULE(BertLayer);

struct BertEmbeddingsImpl : torch::nn::Module {
  explicit BertEmbeddingsImpl(const BertConfig& c)
      : word_embeddings(register_module("word_embeddings",
                                        torch::nn::Embedding(c.vocab_size, c.hidden_size))),
        position_embeddings(register_module(
            "position_embeddings", torch::nn::Embedding(c.max_position_embeddings, c.hidden_size))),
        token_type_embeddings(register_module(
            "token_type_embeddings", torch::nn::Embedding(c.type_vocab_size, c.hidden_size))),
        LayerNorm(register_module(
            "LayerNorm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size})
                                                  .eps(c.layer_norm_eps)))),
        dropout(register_module("dropout", torch::nn::Dropout(c.hidden_dropout_prob))) {
    // In the checkpoints too: 0 .. max_position_embeddings - 1.
    position_ids = register_buffer(
        "position_ids", torch::arange(c.max_position_embeddings, torch::kLong).unsqueeze(0));
  }
  at::Tensor forward(const at::Tensor& ids) {
    const auto positions = position_ids.narrow(1, 0, ids.size(1));
    const auto x = word_embeddings(ids) + token_type_embeddings(torch::zeros_like(ids)) +
                   position_embeddings(positions);
    return dropout(LayerNorm(x));
  }
  torch::nn::Embedding word_embeddings, position_embeddings, token_type_embeddings;
  torch::nn::LayerNorm LayerNorm;
  torch::nn::Dropout dropout;
  at::Tensor position_ids;
};
TORCH_MODULE(BertEmbeddings);

struct BertPoolerImpl : torch::nn::Module {
  explicit BertPoolerImpl(const BertConfig& c)
      : dense(register_module("dense", mixprec::nn::Linear(c.hidden_size, c.hidden_size))) {}
  at::Tensor forward(const at::Tensor& hidden) { return torch::tanh(dense(hidden.select(1, 0))); }
  mixprec::nn::Linear dense;
};
TORCH_MODULE(BertPooler);

/// A layer whose activations apply_checkpointing can drop ("bert.encoder.layer.*", as
/// transformers' gradient_checkpointing_enable() does): the same names and forward.
using CheckpointedLayer = mixprec::nn::Checkpointed<BertLayer>;

/// BertModel: embeddings, `num_hidden_layers` layers, the pooler (loaded, unused by the
/// classifier, as in the checkpoint).
struct BertModelImpl : torch::nn::Module {
  explicit BertModelImpl(const BertConfig& c)
      : embeddings(register_module("embeddings", BertEmbeddings(c))),
        pooler(register_module("pooler", BertPooler(c))) {
    auto encoder = register_module("encoder", std::make_shared<torch::nn::Module>());
    layers = encoder->register_module("layer", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(CheckpointedLayer(c));
  }
  /// last_hidden_state [batch, tokens, hidden] of token ids [batch, tokens] (int64) where
  /// `mask` [batch, tokens] is true (or 1) at real tokens.
  template <class P = mixprec::FullPrecision>
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& mask) {
    const auto keep = mask.to(at::kBool).view({mask.size(0), 1, 1, mask.size(1)});
    auto x = embeddings(ids);
    for (const auto& layer : *layers) {
      // run(): a layer whose forward is a template (the policy's softmax) is called through it.
      x = layer->as<mixprec::nn::CheckpointedImpl<BertLayer>>()->run(
          [](BertLayerImpl& l, const at::Tensor& h, const at::Tensor& k) {
            return l.template forward<P>(h, k);
          },
          x, keep);
    }
    return x;
  }
  BertEmbeddings embeddings;
  torch::nn::ModuleList layers;
  BertPooler pooler;
};
TORCH_MODULE(BertModel);

/// The pretrained encoder with a classification head: mean of the last hidden states over the
/// real tokens, dropout, Linear(hidden, classes).
struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl(const BertConfig& c, std::int64_t classes)
      : bert(register_module("bert", BertModel(c))),
        dropout(register_module("dropout", torch::nn::Dropout(c.hidden_dropout_prob))),
        head(register_module("head", mixprec::nn::Linear(c.hidden_size, classes))) {}
  template <class P = mixprec::FullPrecision>
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& mask) {
    const auto hidden = bert->template forward<P>(ids, mask);
    const auto weights = mask.to(hidden.scalar_type()).unsqueeze(-1);
    const auto pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1);
    return head(dropout(pooled));
  }
  BertModel bert;
  torch::nn::Dropout dropout;
  mixprec::nn::Linear head;
};
TORCH_MODULE(Classifier);

}  // namespace encoder
