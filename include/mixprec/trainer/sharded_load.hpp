#pragma once
// A sharded checkpoint read into a Trainer at any world size, sharded or not (a single process
// too): the constructor reads and checks everything a load needs without changing the Trainer
// (the files: sharded_files.hpp; every tensor the Trainer holds against the index, its param
// groups, its RNG state); apply() then reads this rank's ranges straight into its tensors: the
// pieces it holds of the laid-out tensors and the model tensors it holds whole, never a tensor
// it does not hold. The save: sharded_save.hpp.

#include <mixprec/core/error.hpp>
#include <mixprec/core/rng_states.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/io/checkpoint_dir.hpp>
#include <mixprec/io/checkpoint_file.hpp>
#include <mixprec/io/safetensors_stream.hpp>
#include <mixprec/optim/master_weights.hpp>
#include <mixprec/optim/quantized_moments.hpp>
#include <mixprec/optim/sharded_state.hpp>
#include <mixprec/trainer/ranks.hpp>
#include <mixprec/trainer/sharded_files.hpp>
#include <mixprec/trainer/sharded_index.hpp>
#include <mixprec/trainer/state.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace mixprec::detail {

class ShardedReader {
 public:
  /// Reads and checks the checkpoint in `dir` against the Trainer's `parts` (`masters`: an
  /// unsharded Trainer's; `bf16_moments`: its storage keeps the moments in bf16, and bf16 ones
  /// are read as they are, never whole in fp32; `moments`: the format it keeps Adam's moments
  /// in, which the directory's must be unless `recodes` (the caller converts them after
  /// apply(), from moments()); changes nothing. Every failure is an Error that names the file.
  ShardedReader(const std::string& dir, const CheckpointParts& parts, MasterWeights* masters,
                bool bf16_moments, MomentCoding moments = {}, bool recodes = false)
      : files_(dir, parts.data_parallel ? parts.data_parallel->rank() : 0,
               parts.data_parallel ? parts.data_parallel->world_size() : 1),
        dir_(dir), index_(files_.index()), parts_(parts), masters_(masters),
        group_(parts.data_parallel), names_(TensorNames::of(parts.model)),
        bf16_moments_(bf16_moments) {
    check_policy_settings(index_.policy, index_.policy_settings, parts.policy, dir_);
    moments_ = saved_moments();
    MIXPREC_CHECK(moments_ == moments || recodes, "checkpoint '", dir_, "' holds Adam's moments ",
                  described(moments_), ", this Trainer keeps them ", described(moments), ": a "
                  "sharded Trainer (or one without master weights) reads a directory's moments "
                  "only in their own format (its pieces are laid out for it); load it into a Trainer of the same format, "
                  "or into an unsharded Trainer with master weights (which converts them) and "
                  "save from there; nothing was loaded");
    const auto own_type = optimizer_type(parts.optimizer);
    MIXPREC_CHECK(index_.optimizer == own_type, "checkpoint '", dir_, "' was written with a ",
                  index_.optimizer, " optimizer, this Trainer steps a ", own_type,
                  ": load it into the same optimizer type; nothing was loaded");
    kind_ = sharded_kind(parts.optimizer);
    MIXPREC_CHECK(kind_.has_value(), "checkpoint '", dir_, "' holds the state of a ",
                  index_.optimizer, ", which this Trainer cannot read (no sharded optimizer)");
    read_group_options_of(parts.optimizer);
    if (group_ != nullptr && group_->sharded()) {
      plan_sharded();
    } else {
      plan_whole();
    }
    check_groups();
    check_model_names();
    read_rng();
    (void)counters();
  }

  /// The Trainer's small state: scaler, schedule, fp8, rounding, user values, counters.
  torch::serialize::InputArchive& state() { return files_.state(); }
  /// Its step counters and the scaler's state dict, checked.
  TrainerCounters counters() {
    at::Tensor c;
    MIXPREC_CHECK(state().try_read("mixprec.counters", c) && c.numel() == 3 &&
                      c.scalar_type() == at::kLong,
                  "checkpoint '", dir_, "' lacks the step counters");
    return {c[0].item<std::int64_t>(), c[1].item<std::int64_t>(), c[2].item<std::int64_t>()};
  }
  c10::IValue scaler_state() {
    c10::IValue state;
    MIXPREC_CHECK(files_.state().try_read("scaler", state) && state.isGenericDict(), "checkpoint '", dir_,
                  "' lacks the scaler state");
    return state;
  }
  const std::string& dir() const noexcept { return dir_; }
  /// The format of the directory's moments (plain where it records none).
  MomentCoding moments() const noexcept { return moments_; }

  /// Puts the checkpoint in place: the param groups' options, the optimizer's state (made anew),
  /// then this rank's ranges read into the tensors, then the RNG. Call after every rank checked
  /// (and, unsharded under a lean storage, inside LeanLoad). Reads that fail now (a file changed
  /// since it was checked) leave the Trainer partly loaded: the Error says so.
  void apply() {
    auto& optimizer = parts_.optimizer;
    auto& groups = optimizer.param_groups();
    for (std::size_t g = 0; g < groups.size(); ++g) groups[g].set_options(std::move(options_[g]));
    optimizer.state().clear();  // the old state goes before the new one is read: one at a time
    for (auto& [tensor, step] : states_) {
      set_state(optimizer, tensor, new_state(*kind_, step));
    }
    try {
      at::NoGradGuard no_grad;
      for (const auto& read : reads_) {
        auto target = read.target();
        files_.read_range(read.name, read.from, target);
        if (read.done) read.done(target);
      }
    } catch (const std::exception& e) {
      fail("checkpoint '", dir_, "': a read failed after every file was checked (did a file "
           "change meanwhile?): ", message_of(e), ". The Trainer is partly loaded: load a "
           "checkpoint again before training on");
    }
    if (group_ != nullptr && group_->sharded()) group_->release_pieces(/*narrow=*/true);
    rngs_.restore();
  }

 private:
  // One range of a checkpoint tensor into this rank's memory: `target` makes where it goes
  // (flat, `count` elements, any dtype), when it is read; `done` takes it then.
  struct Read {
    std::string name;
    std::int64_t from = 0;
    std::function<at::Tensor()> target;
    std::function<void(const at::Tensor&)> done;
  };

  void read_group_options_of(const torch::optim::Optimizer& optimizer) {
    torch::serialize::InputArchive groups_archive;
    MIXPREC_CHECK(state().try_read("optimizer.groups", groups_archive), "checkpoint '", dir_,
                  "' lacks the param groups' options");
    MIXPREC_CHECK(optimizer.param_groups().size() == index_.groups.size(), "checkpoint '", dir_,
                  "' holds an optimizer of ", index_.groups.size(), " param groups, this one has ",
                  optimizer.param_groups().size(), ": build the optimizer with the same param "
                  "groups; nothing was loaded");
    options_ = read_group_options(groups_archive, dir_, optimizer);
  }

  // A checkpoint tensor this Trainer reads, checked against `like` (`dtype`: the file's must
  // be it; nullopt: any floating dtype, converted as it is read).
  const IndexTensor& require(const std::string& name, at::IntArrayRef shape,
                             std::optional<c10::ScalarType> dtype) {
    const auto it = index_.tensors.find(name);
    MIXPREC_CHECK(it != index_.tensors.end(), "checkpoint '", dir_, "' lacks '", name, "', which "
                  "this Trainer holds: it was saved from another model or optimizer; load it "
                  "into the same; nothing was loaded");
    const auto& t = it->second;
    MIXPREC_CHECK(at::IntArrayRef(t.shape) == shape && (!dtype || t.dtype == *dtype) &&
                      (dtype || at::isFloatingType(t.dtype)),
                  "checkpoint '", dir_, "': its '", name, "' is ", t.dtype, at::IntArrayRef(t.shape),
                  ", this Trainer's is ", dtype ? *dtype : t.dtype, shape, ": it was saved from "
                  "another model; load it into the same; nothing was loaded");
    used_.insert(name);
    return t;
  }

  // The moments' format the state file records (mixprec.moments: written by a storage with a
  // block format); plain where it records none.
  MomentCoding saved_moments() {
    c10::IValue saved;
    if (!state().try_read("mixprec.moments", saved)) return {};
    const auto coding = saved.isString() ? moment_coding_named(saved.toStringRef()) : std::nullopt;
    MIXPREC_CHECK(coding.has_value(), "checkpoint '", dir_, "': mixprec.moments names no block "
                  "format of Adam's moments (Moments8bit<256>, ...); the file is damaged");
    return *coding;
  }
  static std::int64_t numel_of(at::IntArrayRef shape) {
    std::int64_t n = 1;
    for (const auto s : shape) n *= s;
    return n;
  }
  static std::string described(MomentCoding coding) {
    return coding.quantized() ? "in the block format " + moment_coding_name(coding)
                              : std::string("as plain tensors");
  }

  // A moment of a tensor of `shape` the directory holds as rows of its block format: this
  // rank's `like` (elements [from, from + like.numel()), whole blocks) read as its rows.
  void read_rows(const std::string& key, at::IntArrayRef shape, const at::Tensor& like,
                 std::int64_t from, std::size_t k) {
    const auto whole = numel_of(shape);
    const auto block = moments_.block, width = row_bytes(moments_.format, block);
    const auto n = like.numel();
    MIXPREC_CHECK(n % block == 0 && from % block == 0, "checkpoint '", dir_, "': '", key, "' "
                  "holds rows of ", moment_coding_name(moments_), ", but this Trainer's piece of ",
                  n, " elements from ", from, " is no whole number of its blocks; nothing was "
                  "loaded");
    require(key, {whole / block, width}, at::kByte);
    auto& optimizer = parts_.optimizer;
    reads_.push_back({key, from / block * width, [&optimizer, like, k, kind = *kind_, n, block, width] {
                        auto* state = state_of(optimizer, like);
                        auto& slot = *state_fields(*state, kind)[k];
                        slot = at::empty({n / block, width}, like.options().dtype(at::kByte));
                        return slot.view({-1});
                      }, {}});
  }

  void read_fields(const std::string& name, at::IntArrayRef shape, const at::Tensor& like,
                   std::int64_t from) {
    const auto step = index_.steps.find(name);
    if (step == index_.steps.end()) return;  // no state yet (not stepped)
    states_.emplace_back(like, step->second);
    const bool sgd = *kind_ == ShardedKind::sgd;
    for (std::size_t k = 0; k < kShardedFields; ++k) {
      const char* field = state_field_name(sgd, k);
      if (field == nullptr) continue;
      const auto key = "optimizer." + name + "." + field;
      if (index_.tensors.count(key) == 0) {
        MIXPREC_CHECK(sgd || k == 2, "checkpoint '", dir_, "' lacks '", key, "' beside the step "
                      "of '", name, "'; restore the directory from a copy; nothing was loaded");
        continue;
      }
      if (!sgd && k < 2 && moments_.quantized() && quantizes(numel_of(shape), moments_.block)) {
        read_rows(key, shape, like, from, k);
        continue;
      }
      const auto saved = require(key, shape, std::nullopt).dtype;
      const auto dtype = bf16_moments_ && saved == at::kBFloat16 ? saved : like.scalar_type();
      auto& optimizer = parts_.optimizer;
      const auto n = like.numel();
      reads_.push_back({key, from, [&optimizer, like, k, kind = *kind_, n, dtype] {
                          auto* state = state_of(optimizer, like);
                          auto& slot = *state_fields(*state, kind)[k];
                          slot = at::empty(like.sizes(), like.options().dtype(dtype));
                          return slot.view({n});
                        }, {}});
    }
  }

  // Sharded: each piece this rank holds (a master's value, a unit's model value, the optimizer
  // state) and the model tensors it holds whole.
  void plan_sharded() {
    const auto slots = group_->shard_slots();
    std::unordered_set<const void*> released;
    for (const auto& slot : slots) {
      if (slot.unit) released.insert(slot.param.unsafeGetTensorImpl());
    }
    plan_model(released);
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const auto& slot = slots[i];
      const auto& name = names_(slot.param);
      const auto shape = slot.param.sizes();
      own_groups_[{slot.group, slot.index}] = name;
      if (!slot.piece.defined()) continue;
      const auto n = slot.piece.numel();
      if (slot.master) {
        require("master." + name, shape, at::kFloat);
        auto* group = group_;
        reads_.push_back({"master." + name, slot.from, [n] { return at::empty({n}, at::kFloat); },
                          [group, i](const at::Tensor& value) { group->assign_piece(i, value); }});
      } else if (slot.copy) {  // a unit's piece in the model's dtype
        require("model." + name, shape, slot.param.scalar_type());
        reads_.push_back({"model." + name, slot.from, [piece = slot.piece] { return piece.detach(); }, {}});
      }
      read_fields(name, shape, slot.piece, slot.from);
    }
  }

  // Unsharded: the model whole, the masters whole, the optimizer state whole.
  void plan_whole() {
    plan_model({});
    const auto& groups = parts_.optimizer.param_groups();
    for (std::size_t g = 0; g < groups.size(); ++g) {
      for (std::size_t i = 0; i < groups[g].params().size(); ++i) {
        const auto& p = groups[g].params()[i];
        const auto model = masters_ ? masters_->model_of(p) : at::Tensor();
        const auto& name = names_(model.defined() ? model : p);
        own_groups_[{g, i}] = name;
        if (model.defined()) {  // a master of another tensor (under a lean storage, inflated)
          require("master." + name, p.sizes(), at::kFloat);
          reads_.push_back({"master." + name, 0, [p] { return p.detach().view({-1}); }, {}});
        }
        read_fields(name, p.sizes(), p, 0);
      }
    }
  }

  // The model's tensors this rank holds whole (not `released`: a ZeRO-3 unit's).
  void plan_model(const std::unordered_set<const void*>& released) {
    for (const auto& [name, t] : names_.tensors) {
      require("model." + name, t.sizes(), t.scalar_type());
      if (released.count(t.unsafeGetTensorImpl()) == 1) continue;  // its pieces: plan_sharded
      reads_.push_back(
          {"model." + name, 0, [tensor = t] { return tensor.detach().view({-1}); }, {}});
    }
  }

  // The optimizer's param groups hold the tensors the checkpoint's held, by name, in order.
  void check_groups() const {
    std::vector<std::vector<std::string>> own(index_.groups.size());
    for (const auto& [place, name] : own_groups_) {
      if (place.first >= own.size()) own.resize(place.first + 1);
      auto& group = own[place.first];
      if (group.size() <= place.second) group.resize(place.second + 1);
      group[place.second] = name;
    }
    for (std::size_t g = 0; g < std::max(own.size(), index_.groups.size()); ++g) {
      const auto* saved = g < index_.groups.size() ? &index_.groups[g] : nullptr;
      const auto* mine = g < own.size() ? &own[g] : nullptr;
      if (saved && mine && *saved == *mine) continue;
      fail("checkpoint '", dir_, "' holds an optimizer whose param group ", g, " holds ",
           saved ? saved->size() : 0, " tensors", saved && !saved->empty() ? " (from '" + saved->front() + "')" : "",
           ", this one's holds ", mine ? mine->size() : 0,
           mine && !mine->empty() ? " (from '" + mine->front() + "')" : "",
           ": build the optimizer with the same param groups; nothing was loaded");
    }
  }

  // Every model tensor of the checkpoint is one of this model's (a model of fewer tensors would
  // silently drop what it lacks), and a tied name is tied here too.
  void check_model_names() const {
    for (const auto& [name, t] : index_.tensors) {
      if (name.rfind("model.", 0) != 0 || used_.count(name) == 1) continue;
      fail("checkpoint '", dir_, "' holds '", name, "', which this model lacks: it was saved "
           "from another model; load it into the same; nothing was loaded");
    }
    for (const auto& [alias, name] : index_.aliases) {
      const auto it = names_.aliases.find(alias);
      MIXPREC_CHECK(it != names_.aliases.end() && it->second == name, "checkpoint '", dir_,
                    "': its '", alias, "' is tied to '", name, "', this model's is not: load it "
                    "into the same model; nothing was loaded");
    }
  }

  // This rank's CPU RNG state: its own where the save had its rank, else one derived from rank
  // 0's (a run resumed on more ranks); CUDA's of its device where the save had it.
  void read_rng() {
    const int rank = group_ ? group_->rank() : 0;
    const auto read_small = [&](const std::string& name) {
      const auto& t = index_.tensors.at(name);
      auto value = at::empty({t.numel()}, t.dtype);
      files_.read_range(name, 0, value);
      return value;
    };
    const auto own = "rng." + std::to_string(rank) + ".cpu";
    const auto rank0 = std::string("rng.0.cpu");
    MIXPREC_CHECK(index_.tensors.count(rank0) == 1, "checkpoint '", dir_, "' lacks the RNG "
                  "state of rank 0; restore the directory from a copy");
    try {
      rngs_.cpu = index_.tensors.count(own) == 1 ? read_small(own)
                                                 : derived_rng_state(read_small(rank0), rank);
      at::make_generator<at::CPUGeneratorImpl>().set_state(rngs_.cpu);
    } catch (const c10::Error&) {
      fail("checkpoint '", dir_, "' holds an invalid RNG state for rank ", rank);
    }
    const auto cuda = "rng." + std::to_string(rank) + ".cuda";
    if (group_ != nullptr && group_->device().is_cuda() && index_.tensors.count(cuda) == 1) {
      const auto device = static_cast<std::size_t>(group_->device().index());
      auto state = read_small(cuda);
      try {
        cuda_generator(device).clone().set_state(state);
      } catch (const c10::Error&) {
        fail("checkpoint '", dir_, "' holds an invalid CUDA RNG state for rank ", rank);
      }
      rngs_.cuda.emplace_back(device, state);
    }
  }

  CheckpointFiles files_;
  std::string dir_;
  const ShardIndex& index_;
  CheckpointParts parts_;
  MasterWeights* masters_;
  StepGroup* group_;
  TensorNames names_;
  bool bf16_moments_;
  MomentCoding moments_;  // the directory's
  std::optional<ShardedKind> kind_;
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options_;
  std::vector<Read> reads_;
  std::vector<std::pair<at::Tensor, std::int64_t>> states_;  // (optimizer tensor, step)
  std::map<std::pair<std::size_t, std::size_t>, std::string> own_groups_;
  std::set<std::string> used_;  // the checkpoint's tensors this Trainer reads
  RngStates rngs_;
};

}  // namespace mixprec::detail
