#pragma once
// What survives a restart: a Trainer's checkpoint format (written; read and checked without
// changing anything; then applied) and the file around it. Data parallel's part (every rank's
// RNG state, sharded state consolidated, the vote) is ranks.hpp; the fp32 export fp32_export.hpp.

#include <mixprec/io/atomic_file.hpp>
#include <mixprec/io/checkpoint_file.hpp>
#include <mixprec/trainer/fp32_export.hpp>
#include <mixprec/trainer/policy_identity.hpp>
#include <mixprec/core/rng_states.hpp>
#include <mixprec/trainer/ranks.hpp>
#include <mixprec/optim/sharded_state.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/optim/master_weights.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Type.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>
#include <torch/serialize.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <typeinfo>
#include <utility>
#include <vector>

namespace mixprec {

/// The user's own values saved in a Trainer's checkpoint (the epoch, the position in the data),
/// by name: anything an IValue holds (ints, doubles, bools, strings, tensors, lists of them).
using UserValues = std::map<std::string, c10::IValue>;

namespace detail {

/// The optimizer's C++ type, as checkpoints record it: "torch::optim::AdamW".
inline std::string optimizer_type(const torch::optim::Optimizer& optimizer) {
  return c10::demangle(typeid(optimizer).name());
}

/// Adam's or AdamW's amsgrad option; nullopt for the other optimizers.
inline std::optional<bool> amsgrad_of(const torch::optim::OptimizerOptions& options) {
  if (const auto* adam = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
    return adam->amsgrad();
  }
  if (const auto* adamw = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    return adamw->amsgrad();
  }
  return std::nullopt;
}

/// The counters a checkpoint keeps.
struct TrainerCounters {
  std::int64_t steps = 0;          // optimizer steps taken or skipped
  std::int64_t skipped_steps = 0;  // of which skipped
  std::int64_t micro_batches = 0;  // step() calls
};

/// The parts of a Trainer that its checkpoint holds.
struct CheckpointParts {
  PolicyIdentity policy;
  torch::nn::Module& model;
  torch::optim::Optimizer& optimizer;
  const MasterWeights* masters;  // null: none
  StepGroup* data_parallel;   // null: one process
  bool fused_optimizer;
};

inline void check_user_values(const UserValues& user) {
  for (const auto& [key, value] : user) {
    MIXPREC_CHECK(!key.empty() && !value.isNone(), "save(): user value '", key, "' needs a "
                  "non-empty name and a value (an int, double, bool, string, tensor or a list "
                  "of them)");
  }
}

inline void write_user_values(torch::serialize::OutputArchive& archive, const UserValues& user) {
  c10::List<std::string> keys;
  for (const auto& [key, value] : user) {
    archive.write("user." + key, value);
    keys.push_back(key);
  }
  archive.write("mixprec.user_keys", c10::IValue(keys));
}

inline void write_state(torch::serialize::OutputArchive& archive,
                             const CheckpointParts& parts, const TrainerCounters& counters,
                             const c10::IValue& scaler_state, const RankRngs& rngs,
                             const UserValues& user) {
  archive.write("mixprec.policy", c10::IValue(parts.policy.name));
  archive.write("mixprec.policy_settings", c10::IValue(parts.policy.settings));
  archive.write("mixprec.optimizer", c10::IValue(optimizer_type(parts.optimizer)));
  archive.write("mixprec.fused_optimizer", c10::IValue(parts.fused_optimizer));
  archive.write("mixprec.counters", at::tensor({counters.steps, counters.skipped_steps,
                                                counters.micro_batches}, at::kLong));
  // ZeRO-3: the units' weights are whole only while the Trainer writes the archive; one the
  // caller saves later (torch::save(trainer, path)) must hold copies, not the released tensors.
  const bool released_after = parts.data_parallel != nullptr && parts.data_parallel->shards_parameters();
  for (const auto& item : parts.model.named_parameters()) {
    const auto value = item.value().detach();
    archive.write("model." + item.key(), released_after ? value.clone() : value);
  }
  for (const auto& item : parts.model.named_buffers()) {
    archive.write("model." + item.key(), item.value(), /*is_buffer=*/true);
  }
  // The fp32 values: a lean storage's masters hold none between steps.
  const auto masters =
      parts.masters ? parts.masters->master_values() : std::vector<at::Tensor>{};
  for (std::size_t i = 0; i < masters.size(); ++i) {
    archive.write("masters." + std::to_string(i), masters[i].detach());
  }
  torch::serialize::OutputArchive optimizer_archive;
  parts.optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  // LibTorch 1.13 does not restore param-group options (a scheduler's lr): record them, and
  // the group sizes, which load() checks before it touches the optimizer.
  torch::serialize::OutputArchive groups_archive;
  std::vector<std::int64_t> group_sizes;
  for (std::size_t g = 0; g < parts.optimizer.param_groups().size(); ++g) {
    const auto& group = parts.optimizer.param_groups()[g];
    group_sizes.push_back(static_cast<std::int64_t>(group.params().size()));
    torch::serialize::OutputArchive options_archive;
    group.options().serialize(options_archive);
    groups_archive.write(std::to_string(g), options_archive);
  }
  groups_archive.write("sizes", at::tensor(group_sizes, at::kLong));
  archive.write("optimizer.groups", groups_archive);
  archive.write("scaler", scaler_state);
  const auto own = RngStates::capture();
  archive.write("rng.cpu", own.cpu);
  for (std::size_t r = 1; r < rngs.cpu.size(); ++r) {
    archive.write("rng.cpu.rank" + std::to_string(r), rngs.cpu[r].cpu());
  }
  for (std::size_t r = 1; r < rngs.cuda.size(); ++r) {
    archive.write("rng.cuda.rank" + std::to_string(r), rngs.cuda[r].cpu());
  }
  for (const auto& [device, state] : own.cuda) {
    archive.write("rng.cuda." + std::to_string(device), state);
  }
  write_user_values(archive, user);
}

/// A checkpoint read and checked against the trainer's parts; nothing has changed yet.
struct LoadedState {
  bool policy_settings = false;  // whether the checkpoint recorded them (written since they exist)
  TrainerCounters counters;
  std::vector<std::pair<at::Tensor, at::Tensor>> assignments;  // (target, value): model, masters
  c10::IValue scaler_state;                                    // a dict
  RngStates rngs;
  torch::serialize::InputArchive optimizer;
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> group_options;
  UserValues user;
};

inline at::Tensor read_tensor(torch::serialize::InputArchive& archive, const std::string& key,
                              const at::Tensor& like, bool is_buffer) {
  at::Tensor value;
  MIXPREC_CHECK(archive.try_read(key, value, is_buffer), "the checkpoint lacks '", key, "'");
  MIXPREC_CHECK(value.sizes() == like.sizes() && value.scalar_type() == like.scalar_type(),
                "the checkpoint's '", key, "' is ", value.scalar_type(), value.sizes(),
                ", the trainer's ", like.scalar_type(), like.sizes());
  return value;
}

// The CPU state this rank resumes with, and CUDA's where the checkpoint and this machine both
// have the device (a run resumed on a machine without CUDA, or with fewer devices, keeps its
// own for the rest). Checked by setting each on a clone of its generator.
inline RngStates read_rngs(torch::serialize::InputArchive& archive, const std::string& path,
                           const StepGroup* group) {
  RngStates rngs;
  MIXPREC_CHECK(archive.try_read("rng.cpu", rngs.cpu), "'", path, "' lacks the RNG state");
  const int rank = group ? group->rank() : 0;
  if (rank > 0) {  // this rank's own, where saved
    at::Tensor own;
    if (archive.try_read("rng.cpu.rank" + std::to_string(rank), own)) {
      rngs.cpu = own;
    } else {  // resumed on more ranks than saved: a stream of its own, not rank 0's
      try {
        rngs.cpu = derived_rng_state(rngs.cpu, rank);
      } catch (const c10::Error&) {
        fail("'", path, "' holds an invalid RNG state");
      }
    }
  }
  try {  // a state of the wrong size would fail only after everything else was loaded
    at::make_generator<at::CPUGeneratorImpl>().set_state(rngs.cpu);
  } catch (const c10::Error&) {
    fail("'", path, "' holds an invalid RNG state");
  }
  // CUDA device d's state, checked on a clone of its generator.
  auto add_cuda = [&](std::size_t d, const at::Tensor& state, const std::string& whose) {
    try {
      cuda_generator(d).clone().set_state(state);
    } catch (const c10::Error&) {
      fail("'", path, "' holds an invalid CUDA RNG state for ", whose);
    }
    rngs.cuda.emplace_back(d, state);
  };
  // Data parallel, rank > 0 on CUDA: its own state for its device instead of rank 0's.
  at::Tensor own_cuda;
  if (rank > 0 && group->device().is_cuda() &&
      archive.try_read("rng.cuda.rank" + std::to_string(rank), own_cuda)) {
    add_cuda(static_cast<std::size_t>(group->device().index()), own_cuda,
             "rank " + std::to_string(rank));
    return rngs;
  }
  for (std::size_t d = 0; d < cuda_devices(); ++d) {
    at::Tensor state;
    if (archive.try_read("rng.cuda." + std::to_string(d), state)) {
      add_cuda(d, state, "device " + std::to_string(d));
    }
  }
  return rngs;
}

// Each param group's options as saved, checked against the optimizer's groups (the same type,
// the same amsgrad setting); the caller has checked that the groups hold the same tensors.
inline std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> read_group_options(
    torch::serialize::InputArchive& groups_archive, const std::string& path,
    const torch::optim::Optimizer& optimizer) {
  const auto& groups = optimizer.param_groups();
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> result;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::InputArchive options_archive;
    MIXPREC_CHECK(groups_archive.try_read(std::to_string(g), options_archive), "'", path,
                  "' lacks the options of param group ", g);
    auto& options = result.emplace_back(groups[g].options().clone());
    try {
      options->serialize(options_archive);
    } catch (const std::exception& e) {
      fail("checkpoint '", path, "' holds options of another optimizer type for param group ",
           g, ": ", message_of(e));
    }
    // AMSGrad keeps a state tensor more and steps by another rule: not an option a checkpoint
    // may switch silently.
    const auto saved_amsgrad = amsgrad_of(*options);
    const auto own_amsgrad = amsgrad_of(groups[g].options());
    MIXPREC_CHECK(saved_amsgrad == own_amsgrad, "checkpoint '", path, "' was written with "
                  "amsgrad(", saved_amsgrad.value_or(false) ? "true" : "false", ") in param group ",
                  g, ", this optimizer has amsgrad(", own_amsgrad.value_or(false) ? "true" : "false",
                  "): build it with the same options");
  }
  return result;
}

// The optimizer's archive and its param groups' options, checked against the optimizer's groups.
inline void read_optimizer(torch::serialize::InputArchive& archive, const std::string& path,
                           const torch::optim::Optimizer& optimizer, LoadedState& loaded) {
  torch::serialize::InputArchive groups_archive;
  at::Tensor saved_sizes;
  MIXPREC_CHECK(archive.try_read("optimizer", loaded.optimizer) &&
                    archive.try_read("optimizer.groups", groups_archive) &&
                    groups_archive.try_read("sizes", saved_sizes) &&
                    saved_sizes.scalar_type() == at::kLong && saved_sizes.dim() == 1,
                "'", path, "' lacks the optimizer state");
  const auto& groups = optimizer.param_groups();
  std::vector<std::int64_t> sizes;
  for (const auto& group : groups) {
    sizes.push_back(static_cast<std::int64_t>(group.params().size()));
  }
  const auto* saved_begin = saved_sizes.data_ptr<std::int64_t>();
  const std::vector<std::int64_t> saved(saved_begin, saved_begin + saved_sizes.numel());
  MIXPREC_CHECK(saved == sizes, "checkpoint '", path, "' holds an optimizer with param groups "
                "of sizes ", at::IntArrayRef(saved), ", this one has ", at::IntArrayRef(sizes),
                ": build the optimizer with the same param groups");
  loaded.group_options = read_group_options(groups_archive, path, optimizer);
}

inline UserValues read_user_values(torch::serialize::InputArchive& archive,
                                   const std::string& path) {
  UserValues user;
  c10::IValue user_keys;  // none in a checkpoint written before user values existed
  if (!archive.try_read("mixprec.user_keys", user_keys)) return user;
  MIXPREC_CHECK(user_keys.isList(), "'", path, "' holds a damaged list of user values");
  const auto keys = user_keys.toList();
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const c10::IValue key = keys.get(i);
    MIXPREC_CHECK(key.isString(), "'", path, "' holds a damaged list of user values");
    c10::IValue value;
    MIXPREC_CHECK(archive.try_read("user." + key.toStringRef(), value), "'", path,
                  "' lacks user value '", key.toStringRef(), "'");
    user.emplace(key.toStringRef(), std::move(value));
  }
  return user;
}

/// Reads everything into temporaries and checks that it fits `parts`; changes nothing.
inline LoadedState read_state(torch::serialize::InputArchive& archive,
                                        const std::string& path, const CheckpointParts& parts) {
  c10::IValue policy_name, policy_settings;
  MIXPREC_CHECK(archive.try_read("mixprec.policy", policy_name) && policy_name.isString(),
                "'", path, "' is not a mixprec checkpoint (no policy recorded)");
  LoadedState loaded;
  if (archive.try_read("mixprec.policy_settings", policy_settings)) {
    MIXPREC_CHECK(policy_settings.isString(), "'", path, "' holds a damaged policy record");
    check_policy_settings(policy_name.toStringRef(), policy_settings.toStringRef(), parts.policy,
                          path);
    loaded.policy_settings = true;
  } else {  // written before the settings were recorded: by name, as then
    MIXPREC_CHECK(policy_name.toStringRef() == parts.policy.name, "checkpoint '", path, "' was "
                  "written by Trainer<", policy_name.toStringRef(), ">, this is Trainer<",
                  parts.policy.name, ">: load it with the same policy");
  }
  // Adam's and AdamW's options and state have the same fields: only the recorded type tells
  // them apart (a checkpoint from before it was recorded loads as it did).
  c10::IValue optimizer_name;
  const auto own_type = optimizer_type(parts.optimizer);
  if (archive.try_read("mixprec.optimizer", optimizer_name)) {
    MIXPREC_CHECK(optimizer_name.isString() && optimizer_name.toStringRef() == own_type,
                  "checkpoint '", path, "' was written with a ",
                  optimizer_name.isString() ? optimizer_name.toStringRef() : std::string("?"),
                  " optimizer, this Trainer steps a ", own_type,
                  ": load it into the same optimizer type");
  }
  at::Tensor counters;
  MIXPREC_CHECK(archive.try_read("mixprec.counters", counters) && counters.numel() == 3 &&
                    counters.scalar_type() == at::kLong,
                "'", path, "' lacks the step counters");
  loaded.counters = {counters[0].item<std::int64_t>(), counters[1].item<std::int64_t>(),
                     counters[2].item<std::int64_t>()};
  for (const auto& item : parts.model.named_parameters()) {
    loaded.assignments.emplace_back(
        item.value(), read_tensor(archive, "model." + item.key(), item.value(), false));
  }
  for (const auto& item : parts.model.named_buffers()) {
    loaded.assignments.emplace_back(
        item.value(), read_tensor(archive, "model." + item.key(), item.value(), true));
  }
  const auto masters = parts.masters ? parts.masters->masters() : std::vector<at::Tensor>{};
  for (std::size_t i = 0; i < masters.size(); ++i) {
    loaded.assignments.emplace_back(
        masters[i], read_tensor(archive, "masters." + std::to_string(i), masters[i], false));
  }
  at::Tensor extra;
  MIXPREC_CHECK(!archive.try_read("masters." + std::to_string(masters.size()), extra),
                "checkpoint '", path, "' holds more than the ", masters.size(), " master "
                "weights of this trainer: it was saved with more param groups; add them to the "
                "optimizer before load()");
  MIXPREC_CHECK(archive.try_read("scaler", loaded.scaler_state) &&
                    loaded.scaler_state.isGenericDict(),
                "'", path, "' lacks the scaler state");
  loaded.rngs = read_rngs(archive, path, parts.data_parallel);
  read_optimizer(archive, path, parts.optimizer, loaded);
  loaded.user = read_user_values(archive, path);
  return loaded;
}

/// Puts a checked checkpoint in place: the optimizer's state and options, the tensors, the RNGs.
inline void apply_state(LoadedState& loaded, torch::optim::Optimizer& optimizer) {
  // The optimizer loads in place, and LibTorch's load() only adds state: start from none,
  // and put the previous state (the same objects) and options back if it throws.
  auto& groups = optimizer.param_groups();
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> previous_options;
  for (const auto& group : groups) previous_options.push_back(group.options().clone());
  auto previous_state = std::move(optimizer.state());
  optimizer.state().clear();
  try {
    optimizer.load(loaded.optimizer);
  } catch (...) {
    optimizer.state() = std::move(previous_state);
    for (std::size_t g = 0; g < groups.size(); ++g) {
      groups[g].set_options(std::move(previous_options[g]));
    }
    throw;
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    groups[g].set_options(std::move(loaded.group_options[g]));
  }
  at::NoGradGuard no_grad;
  for (auto& [target, value] : loaded.assignments) target.copy_(value);
  loaded.rngs.restore();
}

// Writes the archive `fill` fills to `path` atomically, with its checksum.
template <class Fill>
void write_state_file(const std::string& path, Fill&& fill) {
  try {
    torch::serialize::OutputArchive archive;
    fill(archive);
    save_checkpoint(archive, path);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("cannot write checkpoint '", path, "': ", message_of(e));
  }
}

// The archive of a checkpoint file whose checksum holds.
inline torch::serialize::InputArchive read_state_file(const std::string& path) {
  const auto bytes = read_checkpoint(path);
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(bytes.data(), bytes.size());
  } catch (const std::exception& e) {
    fail("cannot read checkpoint '", path, "': ", message_of(e));
  }
  return archive;
}

// Whatever LibTorch throws while reading an archive becomes a mixprec::Error naming it.
template <class Read>
UserValues checked_or_error(const std::string& source, Read&& read) {
  try {
    return read();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // c10::Error, or torch::jit::ErrorReport, which is not
    fail("checkpoint '", source, "' does not fit this trainer: ", message_of(e));
  }
}

}  // namespace detail

}  // namespace mixprec
