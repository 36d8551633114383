#pragma once
// The index of a sharded checkpoint (index.json, docs/distributed.md "Sharded checkpoints"):
// which save the directory holds, its world size, policy and optimizer, every file with its
// size and checksum, the optimizer's param groups by tensor name, and every tensor (a model
// tensor, a master, a field of the optimizer's state, a rank's RNG state) with its dtype, shape
// and the pieces that hold it: [rank, first element, count] of the flattened tensor, each in
// that rank's shard under the tensor's name. Written by rank 0 from every rank's report;
// parsed and checked whole before a load reads any tensor.

#include <mixprec/core/error.hpp>
#include <mixprec/io/checkpoint_dir.hpp>
#include <mixprec/io/json.hpp>
#include <mixprec/io/safetensors_stream.hpp>
#include <mixprec/io/state_dict.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cinttypes>
#include <exception>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec::detail {

inline constexpr const char* kShardedFormat = "mixprec sharded checkpoint";
inline constexpr std::int64_t kShardedVersion = 1;

/// A piece of a tensor in a rank's shard: elements [from, from + count) of the flattened tensor.
struct IndexPiece {
  int rank = 0;
  std::int64_t from = 0;
  std::int64_t count = 0;
};

struct IndexTensor {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<std::int64_t> shape;
  std::vector<IndexPiece> pieces;  // sorted by `from` once checked
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (const auto s : shape) n *= s;
    return n;
  }
};

struct IndexFile {
  std::string name;
  int rank = -1;  // -1: the Trainer's state file
  FileDigest digest;
};

struct ShardIndex {
  std::string save;  // the save's id, in every file's name and every shard's metadata
  int world_size = 0;
  std::string policy, policy_settings, optimizer;
  std::vector<IndexFile> files;
  std::vector<std::vector<std::string>> groups;     // the optimizer's tensors by name
  std::map<std::string, std::string> aliases;       // a tied name -> the name it is saved under
  std::map<std::string, std::int64_t> steps;        // a tensor's optimizer state: its step
  std::map<std::string, IndexTensor> tensors;
  std::string summary;  // informative JSON members (counters, scaler, schedule), as written

  const IndexFile& shard_file(int rank) const {
    for (const auto& f : files) {
      if (f.rank == rank) return f;
    }
    fail("the index names no shard file of rank ", rank);
  }
};

/// An Error's message without its "mixprec: ", for one Error's message inside another's.
inline std::string inner_message(const std::exception& e) {
  const std::string text = e.what();
  return text.rfind("mixprec: ", 0) == 0 ? text.substr(9) : text;
}

inline std::string hex64(std::uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof text, "%016" PRIx64, value);
  return text;
}

inline std::string index_json(const ShardIndex& index) {
  std::string out = "{\n  \"format\": " + Json::quoted(kShardedFormat) +
                    ",\n  \"version\": " + std::to_string(kShardedVersion) +
                    ",\n  \"save\": " + Json::quoted(index.save) +
                    ",\n  \"world_size\": " + std::to_string(index.world_size) +
                    ",\n  \"policy\": " + Json::quoted(index.policy) +
                    ",\n  \"policy_settings\": " + Json::quoted(index.policy_settings) +
                    ",\n  \"optimizer\": " + Json::quoted(index.optimizer);
  out += index.summary;
  out += ",\n  \"files\": [";
  for (std::size_t i = 0; i < index.files.size(); ++i) {
    const auto& f = index.files[i];
    out += std::string(i ? "," : "") + "\n    {\"name\": " + Json::quoted(f.name) +
           (f.rank >= 0 ? ", \"rank\": " + std::to_string(f.rank) : std::string()) +
           ", \"bytes\": " + std::to_string(f.digest.bytes) + ", \"checksum\": \"" +
           hex64(f.digest.checksum) + "\"}";
  }
  out += "\n  ],\n  \"groups\": [";
  for (std::size_t g = 0; g < index.groups.size(); ++g) {
    out += std::string(g ? ", " : "") + "[";
    for (std::size_t i = 0; i < index.groups[g].size(); ++i) {
      out += (i ? ", " : "") + Json::quoted(index.groups[g][i]);
    }
    out += "]";
  }
  out += "],\n  \"aliases\": {";
  bool first = true;
  for (const auto& [alias, name] : index.aliases) {
    out += (first ? "" : ", ") + Json::quoted(alias) + ": " + Json::quoted(name);
    first = false;
  }
  out += "},\n  \"steps\": {";
  first = true;
  for (const auto& [name, step] : index.steps) {
    out += (first ? "" : ", ") + Json::quoted(name) + ": " + std::to_string(step);
    first = false;
  }
  out += "},\n  \"tensors\": {";
  first = true;
  for (const auto& [name, t] : index.tensors) {
    out += std::string(first ? "" : ",") + "\n    " + Json::quoted(name) + ": {\"dtype\": \"" +
           safetensors_dtype(t.dtype) + "\", \"shape\": [";
    for (std::size_t d = 0; d < t.shape.size(); ++d) {
      out += (d ? ", " : "") + std::to_string(t.shape[d]);
    }
    out += "], \"pieces\": [";
    for (std::size_t p = 0; p < t.pieces.size(); ++p) {
      out += std::string(p ? ", " : "") + "[" + std::to_string(t.pieces[p].rank) + ", " +
             std::to_string(t.pieces[p].from) + ", " + std::to_string(t.pieces[p].count) + "]";
    }
    out += "]}";
    first = false;
  }
  return out + "\n  }\n}\n";
}

// Reads the members of a parsed index, each checked: a damaged or foreign index is an Error
// naming it, never a read out of bounds later.
class IndexReader {
 public:
  explicit IndexReader(std::string path) : path_(std::move(path)) {}

  [[noreturn]] void damaged(const std::string& what) const {
    fail("checkpoint index '", path_, "' is damaged: ", what, ". It is written last and "
         "atomically by a save: restore the checkpoint directory from a copy; nothing was "
         "loaded");
  }
  const Json& member(const Json& object, const char* key) const {
    const auto* value = object.is_object() ? object.find(key) : nullptr;
    if (value == nullptr) damaged(std::string("it lacks \"") + key + "\"");
    return *value;
  }
  std::string text(const Json& object, const char* key) const {
    const auto& value = member(object, key);
    if (!value.is_string()) damaged(std::string("\"") + key + "\" is not a string");
    return value.text;
  }
  std::int64_t count(const Json& value, const std::string& what) const {
    std::uint64_t n = 0;
    if (!value.unsigned_integer(n) || n > static_cast<std::uint64_t>(INT64_MAX)) {
      damaged(what + " is not a count");
    }
    return static_cast<std::int64_t>(n);
  }
  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
};

/// The index at `path`, parsed and checked: every tensor's pieces tile it exactly (each
/// element in one piece), every piece's rank has a shard file.
inline ShardIndex parse_index(const std::string& text, const std::string& path) {
  const IndexReader r(path);
  const auto json = JsonParser::parse(text, "checkpoint index '" + path + "'");
  MIXPREC_CHECK(json.is_object() && json.find("format") != nullptr &&
                    json.find("format")->is_string() && json.find("format")->text == kShardedFormat,
                "'", path, "' is not the index of a mixprec sharded checkpoint (no \"format\": \"",
                kShardedFormat, "\")");
  const auto version = r.count(r.member(json, "version"), "\"version\"");
  MIXPREC_CHECK(version == kShardedVersion, "checkpoint index '", path, "' is of format version ",
                version, "; this mixprec reads version ", kShardedVersion, ": load it with the "
                "mixprec that wrote it");
  ShardIndex index;
  index.save = r.text(json, "save");
  index.world_size = static_cast<int>(r.count(r.member(json, "world_size"), "\"world_size\""));
  if (index.world_size < 1 || index.world_size > 1 << 20) r.damaged("\"world_size\" is out of range");
  index.policy = r.text(json, "policy");
  index.policy_settings = r.text(json, "policy_settings");
  index.optimizer = r.text(json, "optimizer");
  const auto& files = r.member(json, "files");
  if (!files.is_array()) r.damaged("\"files\" is not an array");
  std::vector<bool> has_shard(static_cast<std::size_t>(index.world_size), false);
  for (const auto& f : files.items) {
    IndexFile file;
    file.name = r.text(f, "name");
    if (file.name.find('/') != std::string::npos || file.name.empty() || file.name[0] == '.') {
      r.damaged("file name \"" + file.name + "\" is not a name in the directory");
    }
    if (const auto* rank = f.find("rank")) {
      file.rank = static_cast<int>(r.count(*rank, "a file's rank"));
      if (file.rank >= index.world_size || has_shard[static_cast<std::size_t>(file.rank)]) {
        r.damaged("rank " + std::to_string(file.rank) + " has no single shard file");
      }
      has_shard[static_cast<std::size_t>(file.rank)] = true;
    }
    file.digest.bytes = static_cast<std::uint64_t>(r.count(r.member(f, "bytes"), "a file's bytes"));
    const auto checksum = r.text(f, "checksum");
    if (checksum.size() != 16 || !hex_digits(checksum)) r.damaged("a checksum is not 16 hex digits");
    file.digest.checksum = std::stoull(checksum, nullptr, 16);
    index.files.push_back(std::move(file));
  }
  for (int rank = 0; rank < index.world_size; ++rank) {
    if (!has_shard[static_cast<std::size_t>(rank)]) {
      r.damaged("it names no shard file of rank " + std::to_string(rank) + " of " +
                std::to_string(index.world_size));
    }
  }
  const auto& groups = r.member(json, "groups");
  if (!groups.is_array()) r.damaged("\"groups\" is not an array");
  for (const auto& g : groups.items) {
    if (!g.is_array()) r.damaged("a param group is not an array of names");
    auto& names = index.groups.emplace_back();
    for (const auto& n : g.items) {
      if (!n.is_string()) r.damaged("a param group is not an array of names");
      names.push_back(n.text);
    }
  }
  for (const auto& [alias, name] : r.member(json, "aliases").members) {
    if (!name.is_string()) r.damaged("an alias is not a name");
    index.aliases[alias] = name.text;
  }
  for (const auto& [name, step] : r.member(json, "steps").members) {
    index.steps[name] = r.count(step, "the step of '" + name + "'");
  }
  for (const auto& [name, t] : r.member(json, "tensors").members) {
    IndexTensor tensor;
    tensor.dtype = file_dtype(r.text(t, "dtype"), &FileDtype::safetensors,
                              "tensor '" + name + "' of '" + path + "'", kSafetensorsDtypes);
    const auto& shape = r.member(t, "shape");
    if (!shape.is_array() || shape.items.size() > 16) r.damaged("the shape of '" + name + "'");
    for (const auto& s : shape.items) tensor.shape.push_back(r.count(s, "a size of '" + name + "'"));
    const auto& pieces = r.member(t, "pieces");
    if (!pieces.is_array()) r.damaged("the pieces of '" + name + "'");
    for (const auto& p : pieces.items) {
      if (!p.is_array() || p.items.size() != 3) r.damaged("a piece of '" + name + "'");
      IndexPiece piece{static_cast<int>(r.count(p.items[0], "a piece's rank")),
                       r.count(p.items[1], "a piece's start"), r.count(p.items[2], "a piece's count")};
      if (piece.rank >= index.world_size) r.damaged("a piece of '" + name + "' names rank " + std::to_string(piece.rank));
      tensor.pieces.push_back(piece);
    }
    // The pieces tile the tensor: sorted, each starts where the one before ends.
    std::sort(tensor.pieces.begin(), tensor.pieces.end(),
              [](const IndexPiece& a, const IndexPiece& b) { return a.from < b.from; });
    std::int64_t next = 0;
    for (const auto& p : tensor.pieces) {
      MIXPREC_CHECK(p.from == next && p.count > 0, "checkpoint '", path, "': the pieces of tensor '", name,
                    "' do not cover its ", tensor.numel(), " elements once each (elements [", next, ", ",
                    p.from, ") or from ", p.from, " on): the index cannot serve a load at any world size. "
                    "It mixes two saves or was edited: restore the directory from a copy; nothing was loaded");
      next += p.count;
    }
    MIXPREC_CHECK(next == tensor.numel(), "checkpoint '", path, "': the pieces of tensor '", name,
                  "' cover ", next, " of its ", tensor.numel(), " elements: the index cannot serve a load at any "
                  "world size. It mixes two saves or was edited: restore the directory from a copy; nothing "
                  "was loaded");
    index.tensors.emplace(name, std::move(tensor));
  }
  return index;
}

/// The names a checkpoint gives a model's tensors: each tensor once, under its first name in
/// named_parameters() then named_buffers() (a tied weight's other names are aliases).
struct TensorNames {
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // each once, parameters first
  std::map<std::string, std::string> aliases;
  std::unordered_map<const void*, std::string> name_of;

  static TensorNames of(const torch::nn::Module& model) {
    TensorNames names;
    const auto add = [&](const std::string& name, const at::Tensor& t) {
      const auto [it, fresh] = names.name_of.emplace(t.unsafeGetTensorImpl(), name);
      if (fresh) {
        names.tensors.emplace_back(name, t);
      } else {
        names.aliases[name] = it->second;
      }
    };
    for (const auto& item : model.named_parameters()) add(item.key(), item.value());
    for (const auto& item : model.named_buffers()) add(item.key(), item.value());
    return names;
  }

  /// The name of a model tensor; an Error for a tensor of no name (never one of the model's).
  const std::string& operator()(const at::Tensor& t) const {
    const auto it = name_of.find(t.unsafeGetTensorImpl());
    MIXPREC_CHECK(it != name_of.end(), "a sharded checkpoint met a trained tensor of shape ",
                  t.sizes(), " that is not the model's");
    return it->second;
  }
};

/// The name of field `k` of the optimizer state (optim/sharded_state.hpp's order) in a
/// checkpoint: Adam's and AdamW's moments, SGD's momentum.
inline const char* state_field_name(bool sgd, std::size_t k) {
  static const char* const adam[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return sgd ? (k == 0 ? "momentum_buffer" : nullptr) : adam[k];
}

}  // namespace mixprec::detail
