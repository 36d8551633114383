#pragma once
/// Weights from Python into a LibTorch model, by name, as PyTorch's `model.load_state_dict(...)`:
///
///   auto model = std::make_shared<Net>();                 // fp32, names as in Python
///   mixprec::load_weights(*model, "model.pt");             // torch.save(model.state_dict(), ...)
///   mixprec::load_weights(*model, "model.safetensors");    // safetensors' save_file / save_model
///   mixprec::Trainer<mixprec::MixedO2<at::BFloat16>> trainer(model, optimizer);
///   trainer.load_weights("finetuned.pt");                  // later: masters and model together
///
/// strict (the default) as PyTorch's strict=True: every parameter and buffer of the model has a
/// key, and every key names one; a norm layer's num_batches_tracked may be absent where Python's
/// BatchNorm fills it in (python_fills_num_batches_tracked). A shape that differs, a value that
/// changes kind (a float into an integer buffer) or does not fit the model's dtype (70000 into
/// fp16), or two keys of one tied tensor with different values are Errors even with
/// strict(false). One Error lists every
/// problem, and nothing is loaded unless all fit. Values are converted to each model tensor's
/// dtype (PyTorch's copy_); a tied tensor (registered under two names) takes either key. A
/// parameter held in shards (mixprec::ShardedBuild) keeps this rank's piece of its value, and a
/// safetensors file loads into such a model one tensor at a time.

#include <mixprec/core/error.hpp>
#include <mixprec/core/held_shards.hpp>
#include <mixprec/core/model_claim.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/io/byte_source.hpp>
#include <mixprec/io/safetensors.hpp>
#include <mixprec/io/state_dict.hpp>
#include <mixprec/io/torch_save.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include <cstring>
#include <memory>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mixprec {

/// How load_state_dict and load_weights match a state dict to a model.
struct LoadOptions {
  /// PyTorch's strict: every tensor of the model has a key and every key names one; false:
  /// those two kinds of mismatch are returned in LoadReport instead of thrown. Shapes, dtypes
  /// and tied tensors must fit either way.
  TORCH_ARG(bool, strict) = true;
  /// torch.save files: the entry of a saved dict that holds the state dict, as "model" in
  /// `torch.save({"model": model.state_dict(), "epoch": 3}, path)`; empty: the file is one.
  TORCH_ARG(std::string, key);
  /// The submodule to load into, by its path ("bert", "encoder.layer.0"): the state dict's
  /// names are relative to it, as with `model.bert.load_state_dict(...)`; empty: the model.
  TORCH_ARG(std::string, submodule);
};

/// What a load with strict(false) left out: PyTorch's `_IncompatibleKeys`.
struct LoadReport {
  std::vector<std::string> missing_keys;     ///< model tensors the state dict has no key for
  std::vector<std::string> unexpected_keys;  ///< keys of the state dict that name none of them
};

namespace detail {

// A model tensor and the names it is registered under (two or more: tied).
struct LoadTarget {
  at::Tensor tensor;
  std::vector<std::string> names;
};

// One copy a load makes: `source`, from the state dict under `name`, converted to `value` in
// the dtype of `target`.
struct LoadAssignment {
  std::string name;
  at::Tensor target, source, value;
  std::vector<std::string> tied;  // the other keys of a tied target the state dict has
};

struct LoadPlan {
  std::vector<LoadAssignment> assignments;
  LoadReport report;
  std::vector<std::string> problems;  // each fatal, strict or not
  std::string into;                   // "the model", "submodule 'bert'"
};

inline const torch::nn::Module& submodule_of(const torch::nn::Module& model, const std::string& path) {
  if (path.empty()) return model;
  const auto modules = model.named_modules("", /*include_self=*/false);
  if (const auto* found = modules.find(path)) return **found;
  std::string names;
  for (std::size_t i = 0; i < modules.size() && i < 20; ++i) {
    names += (i ? ", '" : "'") + modules[i].key() + "'";
  }
  fail("LoadOptions::submodule: the model has no submodule '", path, "' (its submodules: ",
       names.empty() ? std::string("none") : names, modules.size() > 20 ? ", ..." : "", ")");
}

// The parameters and buffers of `module`, each tensor once with all its names, in the order of
// named_parameters() then named_buffers().
inline std::vector<LoadTarget> load_targets(const torch::nn::Module& module) {
  std::vector<LoadTarget> targets;
  std::unordered_map<const void*, std::size_t> index;
  const auto add = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined()) return;  // as Python's state_dict() leaves out a None parameter or buffer
    const auto [it, fresh] = index.try_emplace(t.unsafeGetTensorImpl(), targets.size());
    if (fresh) targets.push_back({t, {}});
    targets[it->second].names.push_back(name);
  };
  for (const auto& item : module.named_parameters()) add(item.key(), item.value());
  for (const auto& item : module.named_buffers()) add(item.key(), item.value());
  return targets;
}

enum class DtypeKind { floating, complex, integral, boolean };
inline DtypeKind kind_of(at::ScalarType t) {
  if (t == at::kBool) return DtypeKind::boolean;
  if (at::isComplexType(t)) return DtypeKind::complex;
  if (at::isFloatingType(t)) return DtypeKind::floating;
  return DtypeKind::integral;
}

// Whether Python's load_state_dict takes `name`, a buffer of `module` that the state dict has no
// key for, as present: _NormBase._load_from_state_dict (BatchNorm, InstanceNorm with running
// statistics) puts its num_batches_tracked in when the state dict gives the module no version
// or one below 2 (the version that added it): a plain dict or safetensors has none. torch >= 2.2
// puts the module's own counter (pytorch#110850), so the buffer keeps its value; torch <= 2.1
// put a 0. A module here is a norm layer by its buffers: running_mean, running_var and
// num_batches_tracked, as LibTorch's BatchNorm and InstanceNorm, mixprec's wrappers of them and
// a port of a Python _NormBase register them.
inline bool python_fills_num_batches_tracked(const torch::nn::Module& module, const std::string& name,
                                             const ModuleVersions& versions) {
  static constexpr std::string_view kLeaf = "num_batches_tracked";
  if (name.size() < kLeaf.size() || name.compare(name.size() - kLeaf.size(), kLeaf.size(), kLeaf) != 0) {
    return false;
  }
  const auto prefix = name.substr(0, name.size() - kLeaf.size());  // "norm." or ""
  if (!prefix.empty() && prefix.back() != '.') return false;
  const auto buffers = module.named_buffers();
  for (const auto* leaf : {"running_mean", "running_var", "num_batches_tracked"}) {
    const auto* found = buffers.find(prefix + leaf);
    if (found == nullptr || !found->defined()) return false;
  }
  const auto path = prefix.empty() ? prefix : prefix.substr(0, prefix.size() - 1);
  const auto version = versions.find(path);
  return version == versions.end() || version->second < 2;
}

inline bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto x = a.detach().cpu().contiguous(), y = b.detach().cpu().contiguous();
  return x.nbytes() == 0 || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

// Whether a conversion between a signed and an unsigned integer dtype changed a value's sign:
// the round trip back restores the bits of such a value (uint8 200 -> int8 -56 -> 200), so
// same_bits alone would pass it. lt(0) runs on the signed side only (few kernels take uint64).
inline bool sign_changed(const at::Tensor& source, const at::Tensor& value) {
  const bool from_signed = at::isSignedType(source.scalar_type());
  if (from_signed == at::isSignedType(value.scalar_type())) return false;
  return (from_signed ? source : value).lt(0).any().item<bool>();
}

// Where a tensor's values are finite; fp8 through fp32 (its CPU kernels are few).
inline at::Tensor finite(const at::Tensor& t) {
  const bool narrow_float = at::isFloatingType(t.scalar_type()) && t.element_size() == 1;
  return at::isfinite(narrow_float ? t.to(at::kFloat) : t);
}

/// `source` in `dtype`: itself where the dtype is its own; else converted as PyTorch's copy_
/// converts, with a problem added for `name` where a value does not survive it (a finite value
/// that becomes inf, an integer that wraps). `in` names the tensor the value is for.
inline at::Tensor converted(const at::Tensor& source, at::ScalarType dtype, const std::string& name,
                            const char* in, std::vector<std::string>& problems) {
  if (source.scalar_type() == dtype) return source;
  auto value = source.detach().to(dtype);
  const auto kind = kind_of(dtype);
  std::ostringstream problem;
  if (kind == DtypeKind::floating || kind == DtypeKind::complex) {
    const auto lost = finite(source).logical_and(finite(value).logical_not());
    if (lost.any().item<bool>()) {
      const auto where = lost.reshape({-1}).nonzero()[0].item<std::int64_t>();
      const auto flat = source.detach().reshape({-1});
      problem << "'" << name << "' holds "
              << (kind == DtypeKind::complex ? flat[where].abs() : flat[where]).to(at::kDouble).item<double>()
              << " (element " << where << "), beyond the range of " << c10::toString(dtype)
              << ", the dtype of " << in << ": it would load as inf";
    }
  } else if (kind == DtypeKind::integral && (!same_bits(value.to(source.scalar_type()), source) ||
                                              sign_changed(source, value))) {
    problem << "'" << name << "' holds values that " << c10::toString(dtype) << ", the dtype of "
            << in << ", cannot hold (they would wrap around)";
  }
  if (!problem.str().empty()) problems.push_back(problem.str());
  return value;
}

// Matches the state dict to the model's tensors: names, shapes, kinds of dtype and tied tensors;
// `versions`: its modules' (a torch.save'd state_dict()'s _metadata). The values are not
// converted yet (converted()), nothing is changed.
inline LoadPlan plan_load(const torch::nn::Module& model, const StateDict& weights,
                          const LoadOptions& options, const ModuleVersions& versions = {}) {
  LoadPlan plan;
  plan.into = options.submodule().empty() ? "the model" : "submodule '" + options.submodule() + "'";
  const auto& into = submodule_of(model, options.submodule());
  const auto targets = load_targets(into);
  std::unordered_map<std::string, std::size_t> target_of;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    for (const auto& name : targets[i].names) target_of.emplace(name, i);
  }
  for (const auto& item : weights) {
    if (target_of.count(item.key()) == 0) plan.report.unexpected_keys.push_back(item.key());
  }
  for (const auto& target : targets) {
    std::vector<std::string> present;
    for (const auto& name : target.names) {
      if (weights.contains(name)) present.push_back(name);
    }
    if (present.empty()) {
      // Python puts these in before matching: present, and loaded into themselves (unchanged).
      for (const auto& name : target.names) {
        if (!python_fills_num_batches_tracked(into, name, versions)) plan.report.missing_keys.push_back(name);
      }
      continue;
    }
    const auto& name = present.front();
    const auto& source = weights[name];
    for (std::size_t i = 1; i < present.size(); ++i) {
      // A file read tensor by tensor compares them as it reads them (load_streamed).
      if (!source.is_meta() && !same_bits(weights[present[i]], source)) {
        plan.problems.push_back("'" + name + "' and '" + present[i] + "' name one tied tensor "
                                "of the model but hold different values");
      }
    }
    std::ostringstream problem;
    if (!source.defined()) {
      problem << "'" << name << "' is an undefined tensor";
    } else if (source.sizes() != target.tensor.sizes()) {
      problem << "'" << name << "' has shape " << source.sizes() << " in the state dict and "
              << target.tensor.sizes() << " in " << plan.into;
    } else if (kind_of(source.scalar_type()) != kind_of(target.tensor.scalar_type())) {
      problem << "'" << name << "' is " << source.scalar_type() << " in the state dict and "
              << target.tensor.scalar_type() << " in " << plan.into << " (values convert "
              << "between floating-point dtypes, and between integer ones where they fit, not "
              << "across kinds)";
    }
    if (!problem.str().empty()) {
      plan.problems.push_back(problem.str());
      continue;
    }
    plan.assignments.push_back({name, target.tensor, source, at::Tensor(),
                                std::vector<std::string>(present.begin() + 1, present.end())});
  }
  return plan;
}

inline std::string quoted_list(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) out += (i ? ", '" : "'") + names[i] + "'";
  return out;
}

// One Error with every problem (missing and unexpected keys too, under strict), or nothing.
inline void check_plan(const LoadPlan& plan, const LoadOptions& options, const std::string& source) {
  std::vector<std::string> all;
  const auto& r = plan.report;
  if (options.strict() && !r.missing_keys.empty()) {
    const auto n = r.missing_keys.size();
    all.push_back(std::to_string(n) + " of " + plan.into + "'s tensors " +
                  (n == 1 ? "has" : "have") + " no key (missing keys: " +
                  quoted_list(r.missing_keys) + ")");
  }
  if (options.strict() && !r.unexpected_keys.empty()) {
    const auto n = r.unexpected_keys.size();
    all.push_back(std::to_string(n) + (n == 1 ? " key names" : " keys name") + " no tensor of " +
                  plan.into + " (unexpected keys: " + quoted_list(r.unexpected_keys) + ")");
  }
  all.insert(all.end(), plan.problems.begin(), plan.problems.end());
  if (all.empty()) return;
  std::string message;
  for (std::size_t i = 0; i < all.size(); ++i) message += (i ? "; " : "") + all[i];
  const bool keys_only = plan.problems.empty();
  fail("cannot load ", source, " into ", plan.into, ": ", message, ". Nothing was loaded",
       keys_only ? " (LoadOptions().strict(false) loads the keys that match, as PyTorch's "
                   "strict=False, and returns the others in LoadReport)" : "");
}

// Every value in its target's dtype, checked; then one Error, or nothing.
inline void convert_all(LoadPlan& plan, const LoadOptions& options, const std::string& source) {
  for (auto& a : plan.assignments) {
    a.value = converted(a.source, a.target.scalar_type(), a.name, plan.into.c_str(), plan.problems);
  }
  check_plan(plan, options, source);
}

inline void copy_values(const std::vector<LoadAssignment>& assignments) {
  at::NoGradGuard no_grad;
  for (const auto& a : assignments) {
    // Held in shards (mixprec::ShardedBuild): this rank keeps its piece of the value.
    if (const auto shard = HeldShards::find(a.target); shard && !shard->whole) {
      assign_held(*shard, a.value);
      continue;
    }
    a.target.copy_(a.value);
  }
}

// Whether a tensor of `module` is held in shards.
inline bool holds_any(const torch::nn::Module& module) {
  for (const auto& p : module.parameters()) {
    if (HeldShards::is_placeholder(p) && HeldShards::find(p)) return true;
  }
  return false;
}

// load_weights of a safetensors file into a model that holds parameters in shards, one tensor
// in memory at a time: planned from the header's names, shapes and dtypes; then each tensor
// read, compared with its tied keys, converted and checked, a held target keeping only this
// rank's piece of it; then, if everything fits, each target takes its value.
inline LoadReport load_streamed(torch::nn::Module& model, const ByteSource& source,
                                const LoadOptions& options) {
  const auto index = index_safetensors(source);
  StateDict meta;
  std::unordered_map<std::string, const SafetensorsEntry*> entry_of;
  for (const auto& e : index.entries) {
    meta.insert(e.name, at::empty(e.shape, at::TensorOptions(e.dtype).device(at::kMeta)));
    entry_of.emplace(e.name, &e);
  }
  auto plan = plan_load(model, meta, options);
  check_plan(plan, options, "'" + source.name() + "'");  // names, shapes, kinds: before reading
  const auto read = [&](const std::string& name) {
    return read_safetensors_entry(source, index, *entry_of.at(name));
  };
  std::vector<std::pair<std::shared_ptr<HeldShard>, HeldShard>> pieces;
  for (auto& a : plan.assignments) {
    const auto value = read(a.name);
    for (const auto& other : a.tied) {
      if (!same_bits(read(other), value)) {
        plan.problems.push_back("'" + a.name + "' and '" + other + "' name one tied tensor of "
                                "the model but hold different values");
      }
    }
    auto converted_value = converted(value, a.target.scalar_type(), a.name, plan.into.c_str(),
                                     plan.problems);
    if (const auto shard = HeldShards::find(a.target); shard && !shard->whole) {
      HeldShard piece = *shard;
      assign_held(piece, converted_value);  // the whole value goes with this iteration
      pieces.emplace_back(shard, std::move(piece));
    } else {
      a.value = std::move(converted_value);
    }
  }
  check_plan(plan, options, "'" + source.name() + "'");
  at::NoGradGuard no_grad;
  for (auto& [shard, piece] : pieces) *shard = std::move(piece);
  for (const auto& a : plan.assignments) {
    if (a.value.defined()) a.target.copy_(a.value);
  }
  return std::move(plan.report);
}

// Loading into a model a live Trainer trains: its masters would overwrite the weights at the
// next step, or its checkpoints disagree with them.
inline void check_unclaimed(const torch::nn::Module& model, const LoadOptions& options) {
  std::vector<at::Tensor> params;
  for (const auto& p : submodule_of(model, options.submodule()).parameters()) params.push_back(p);
  const auto policy = ModelClaim::claimant(unique_tensors(params));
  MIXPREC_CHECK(policy.empty(), "this model is trained by a live Trainer<", policy, ">: load "
                "weights through it, trainer.load_weights(path) or trainer.load_state_dict(dict), "
                "so that its fp32 master weights follow (loaded into the model alone, they would be "
                "overwritten at the next step); nothing was loaded");
}

// A file that is no zip archive: an Error unless it looks like safetensors, which `key` cannot
// pick an entry of.
inline void check_safetensors_source(const ByteSource& source, const std::string& key) {
  refuse_known_foreign(source);
  unsigned char start[9] = {};
  if (source.size() >= 9) source.read(0, start, 9);
  MIXPREC_CHECK(source.size() >= 9 && load_le(start, 8) <= source.size() - 8 && start[8] == '{',
                "'", source.name(), "' is neither a torch.save file (a zip archive) nor a "
                "safetensors file (a header length, then '{')");
  MIXPREC_CHECK(key.empty(), "LoadOptions::key ('", key, "') picks an entry of a torch.save'd "
                "dict; '", source.name(), "' is a safetensors file, which holds one state dict");
}

inline WeightsFile read_weights(const ByteSource& source, const std::string& key) {
  if (looks_like_zip(source)) return read_torch_save(source, key);  // refuses checkpoints too
  check_safetensors_source(source, key);
  return {read_safetensors(source), {}};
}

/// The tensors of the file at `path` and its modules' versions (read_state_dict).
inline WeightsFile read_weights(const std::string& path, const std::string& key) {
  return read_weights(FileSource(path), key);
}

}  // namespace detail

/// The state dict in the file at `path`, by its contents: torch.save's zip archive
/// (read_torch_save, with `key`) or safetensors (read_safetensors).
inline StateDict read_state_dict(const std::string& path, const std::string& key = "") {
  return detail::read_weights(detail::FileSource(path), key).tensors;
}

/// Copies `weights` into `model`'s parameters and buffers of the same names (PyTorch's
/// `model.load_state_dict(weights, strict)`), converted to their dtypes; an Error listing every
/// problem, and nothing copied, unless all fit (see LoadOptions). For a model that no live
/// Trainer trains (build the Trainer after, or use Trainer::load_state_dict).
inline LoadReport load_state_dict(torch::nn::Module& model, const StateDict& weights,
                                  const LoadOptions& options = {}) {
  detail::check_unclaimed(model, options);
  auto plan = detail::plan_load(model, weights, options);
  detail::convert_all(plan, options, "the state dict");
  detail::copy_values(plan.assignments);
  return std::move(plan.report);
}

/// load_state_dict of the file at `path`: torch.save's or safetensors (read_state_dict), with
/// the modules' versions a torch.save'd state_dict() records, as Python's load_state_dict reads
/// them (a BatchNorm of version 2 must have its num_batches_tracked).
inline LoadReport load_weights(torch::nn::Module& model, const std::string& path,
                               const LoadOptions& options = {}) {
  detail::check_unclaimed(model, options);
  // Parameters held in shards (mixprec::ShardedBuild): a safetensors file streams into them,
  // a tensor at a time; a torch.save file's pickle is read whole, as below.
  if (detail::holds_any(detail::submodule_of(model, options.submodule()))) {
    const detail::FileSource source(path);
    if (!detail::looks_like_zip(source)) {
      detail::check_safetensors_source(source, options.key());
      return detail::load_streamed(model, source, options);
    }
  }
  const auto file = detail::read_weights(path, options.key());
  auto plan = detail::plan_load(model, file.tensors, options, file.versions);
  detail::convert_all(plan, options, "'" + path + "'");
  detail::copy_values(plan.assignments);
  return std::move(plan.report);
}

}  // namespace mixprec
