#pragma once
// A sharded run's save (docs/distributed.md, "Sharded checkpoints"): each rank writes the pieces
// it holds into a shard file of its own, piece by piece (a model tensor's range, its fp32
// master, the optimizer state's fields, its RNG state), never a whole tensor it does not hold;
// rank 0 writes the Trainer's small state and, last, the index. The directory's files and its
// atomicity: io/checkpoint_dir.hpp; the index: sharded_index.hpp; the load: sharded_load.hpp.
//
// Every rank makes the same collectives in the same order; a rank whose part fails says so in
// them, and every rank throws. Files are removed only where every rank agreed the save failed:
// a rank that dies leaves its survivors unsure whether rank 0 committed, and a committed index
// must find its shards.

#include <mixprec/core/error.hpp>
#include <mixprec/core/rng_states.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/io/atomic_file.hpp>
#include <mixprec/io/checkpoint_dir.hpp>
#include <mixprec/io/checkpoint_file.hpp>
#include <mixprec/io/json.hpp>
#include <mixprec/io/safetensors_stream.hpp>
#include <mixprec/optim/quantized_moments.hpp>
#include <mixprec/optim/sharded_state.hpp>
#include <mixprec/trainer/sharded_index.hpp>
#include <mixprec/trainer/state.hpp>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// The phases of a sharded save, in order: the fault tests crash a rank at each.
enum class SavePhase {
  begun,          ///< the save's id agreed, no file written
  shard_partial,  ///< this rank's shard half written (its first tensor)
  shard_written,  ///< this rank's shard complete, under its name
  agreed,         ///< every rank's shard complete (after the vote)
  state_written,  ///< rank 0: the Trainer's state file written
  index_written,  ///< rank 0: the index written to its temporary, not renamed
  committed,      ///< rank 0: the index renamed into place: the new checkpoint is the one
  cleaned,        ///< rank 0: the files of earlier saves removed
};

/// Called at each phase on each rank where set (tests: a SIGKILL at one phase).
inline std::function<void(SavePhase, int rank)>& sharded_save_hook() {
  static std::function<void(SavePhase, int)> hook;
  return hook;
}

inline void reach(SavePhase phase, int rank) {
  if (const auto& hook = sharded_save_hook()) hook(phase, rank);
}

/// A tensor of the checkpoint as this rank holds it: elements [from, from + count) of the
/// flattened tensor `name`, whose value() is made when it is written (one at a time).
struct LocalPiece {
  std::string name;
  c10::ScalarType dtype;
  std::vector<std::int64_t> shape;
  std::int64_t from = 0;
  std::int64_t count = 0;
  std::function<at::Tensor()> value;
};

/// What this rank writes, and the steps of the optimizer state it holds pieces of.
struct LocalShard {
  std::vector<LocalPiece> pieces;
  std::vector<std::pair<std::string, std::int64_t>> steps;
};

inline at::Tensor flat(const at::Tensor& t) { return t.detach().reshape({-1}); }

/// This rank's pieces of a sharded run: its pieces of the laid-out tensors (the model's value,
/// the master, the optimizer state), rank 0 the model's other tensors whole, each rank its RNG.
inline LocalShard local_shard(const CheckpointParts& parts, StepGroup& group,
                              const TensorNames& names) {
  LocalShard shard;
  const auto kind = *sharded_kind(parts.optimizer);
  const bool sgd = kind == ShardedKind::sgd;
  const auto slots = group.shard_slots();
  std::unordered_map<const void*, bool> laid_out;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const auto& slot = slots[i];
    laid_out[slot.param.unsafeGetTensorImpl()] = true;
    if (!slot.piece.defined()) continue;
    const auto& name = names(slot.param);
    const auto shape = slot.param.sizes().vec();
    const auto n = slot.piece.numel();
    const auto dtype = slot.param.scalar_type();
    // The model's value of the piece: a unit's is what a gather makes of the piece.
    std::function<at::Tensor()> model_value;
    if (slot.unit) {
      model_value = [&group, i, dtype] { return flat(group.piece_value(i)).to(dtype); };
    } else {
      model_value = [param = slot.param, from = slot.from, n] { return flat(param).narrow(0, from, n); };
    }
    shard.pieces.push_back({"model." + name, dtype, shape, slot.from, n, std::move(model_value)});
    if (slot.master) {
      shard.pieces.push_back({"master." + name, at::kFloat, shape, slot.from, n,
                              [&group, i] { return flat(group.piece_value(i)); }});
    }
    auto* state = state_of(parts.optimizer, slot.piece);
    if (state == nullptr) continue;
    shard.steps.emplace_back(name, state_step(*state, kind));
    const auto fields = state_fields(*state, kind);
    for (std::size_t k = 0; k < fields.size(); ++k) {
      if (fields[k] == nullptr || !fields[k]->defined()) continue;
      const auto field = *fields[k];
      const auto key = "optimizer." + name + "." + state_field_name(sgd, k);
      if (is_moment_rows(field)) {  // a block format's rows: the piece's rows of the tensor's
        const auto rows = moment_rows_piece(field, slot.param.numel(), slot.from, n, key);
        shard.pieces.push_back({key, at::kByte, rows.shape, rows.from, rows.count,
                                [field] { return flat(field); }});
        continue;
      }
      shard.pieces.push_back({key, field.scalar_type(), shape, slot.from, n,
                              [field] { return flat(field); }});
    }
  }
  if (group.rank() == 0) {  // the model's tensors outside the layout: the same on every rank
    for (const auto& [name, t] : names.tensors) {
      if (laid_out.count(t.unsafeGetTensorImpl()) == 1) continue;
      shard.pieces.push_back({"model." + name, t.scalar_type(), t.sizes().vec(), 0, t.numel(),
                              [tensor = t] { return flat(tensor); }});
    }
  }
  const auto rank = std::to_string(group.rank());
  const auto cpu = cpu_rng_state();
  shard.pieces.push_back({"rng." + rank + ".cpu", cpu.scalar_type(), {cpu.numel()}, 0,
                          cpu.numel(), [cpu] { return cpu; }});
  if (group.device().is_cuda()) {
    auto generator = cuda_generator(static_cast<std::size_t>(group.device().index()));
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(generator.mutex());
      state = generator.get_state();
    }
    shard.pieces.push_back({"rng." + rank + ".cuda", state.scalar_type(), {state.numel()}, 0,
                            state.numel(), [state] { return state; }});
  }
  return shard;
}

/// Writes `shard` to `path` piece by piece (each a flat tensor under its tensor's name); its
/// size and checksum.
inline FileDigest write_shard(const std::string& path, const LocalShard& shard,
                              const std::vector<std::pair<std::string, std::string>>& metadata,
                              int rank) {
  std::vector<SafetensorsSpec> specs;
  for (const auto& piece : shard.pieces) specs.push_back({piece.name, piece.dtype, {piece.count}});
  SafetensorsWriter writer(path, std::move(specs), metadata);
  at::NoGradGuard no_grad;
  for (const auto& piece : shard.pieces) {
    writer.write_next(piece.value());
    if (writer.written() == 1) reach(SavePhase::shard_partial, rank);
  }
  return writer.commit();
}

// A rank's report to rank 0: whether its shard was written (else why), the shard's digest,
// its pieces and steps. JSON text, gathered through the process group.
inline std::string shard_report(const LocalShard& shard, const FileDigest& digest,
                                const std::string& error) {
  std::string out = "{\"error\": " + Json::quoted(error) + ", \"bytes\": " +
                    std::to_string(digest.bytes) + ", \"checksum\": \"" + hex64(digest.checksum) +
                    "\", \"pieces\": [";
  for (std::size_t i = 0; i < shard.pieces.size(); ++i) {
    const auto& p = shard.pieces[i];
    out += std::string(i ? ", " : "") + "[" + Json::quoted(p.name) + ", \"" +
           safetensors_dtype(p.dtype) + "\", [";
    for (std::size_t d = 0; d < p.shape.size(); ++d) out += (d ? ", " : "") + std::to_string(p.shape[d]);
    out += "], " + std::to_string(p.from) + ", " + std::to_string(p.count) + "]";
  }
  out += "], \"steps\": [";
  for (std::size_t i = 0; i < shard.steps.size(); ++i) {
    out += std::string(i ? ", " : "") + "[" + Json::quoted(shard.steps[i].first) + ", " +
           std::to_string(shard.steps[i].second) + "]";
  }
  return out + "]}";
}

/// `text` of every rank, in rank order. Collective.
inline std::vector<std::string> all_gather_text(StepGroup& group, const std::string& text) {
  const auto lengths = group.all_gather(
      at::tensor({static_cast<std::int64_t>(text.size())}, at::kLong).to(group.device()));
  std::int64_t longest = 1;
  for (const auto& l : lengths) longest = std::max(longest, l.cpu().item<std::int64_t>());
  auto bytes = at::zeros({longest}, at::kByte);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  const auto all = group.all_gather(bytes.to(group.device()));
  std::vector<std::string> result;
  for (std::size_t r = 0; r < all.size(); ++r) {
    const auto cpu = all[r].cpu();
    result.emplace_back(static_cast<const char*>(cpu.data_ptr()),
                        static_cast<std::size_t>(lengths[r].cpu().item<std::int64_t>()));
  }
  return result;
}

/// Rank 0's index of the save `id` from every rank's report (their order is the ranks').
inline ShardIndex assemble_index(const std::string& id, const std::vector<std::string>& reports,
                                 const CheckpointParts& parts, const TensorNames& names,
                                 const std::vector<ShardSlot>& slots) {
  ShardIndex index;
  index.save = id;
  index.world_size = static_cast<int>(reports.size());
  index.policy = parts.policy.name;
  index.policy_settings = parts.policy.settings;
  index.optimizer = optimizer_type(parts.optimizer);
  index.aliases = names.aliases;
  for (const auto& slot : slots) {
    if (index.groups.size() <= slot.group) index.groups.resize(slot.group + 1);
    auto& group = index.groups[slot.group];
    if (group.size() <= slot.index) group.resize(slot.index + 1);
    group[slot.index] = names(slot.param);
  }
  for (std::size_t r = 0; r < reports.size(); ++r) {
    const auto json = JsonParser::parse(reports[r], "rank " + std::to_string(r) + "'s report");
    const int rank = static_cast<int>(r);
    IndexFile file{shard_file_name(id, rank, index.world_size), rank, {}};
    std::uint64_t bytes = 0;
    json.find("bytes")->unsigned_integer(bytes);
    file.digest = {bytes, std::stoull(json.find("checksum")->text, nullptr, 16)};
    index.files.push_back(file);
    for (const auto& p : json.find("pieces")->items) {
      auto& t = index.tensors[p.items[0].text];
      t.dtype = file_dtype(p.items[1].text, &FileDtype::safetensors, "a piece", kSafetensorsDtypes);
      t.shape.clear();
      for (const auto& s : p.items[2].items) t.shape.push_back(std::stoll(s.text));
      t.pieces.push_back({rank, std::stoll(p.items[3].text), std::stoll(p.items[4].text)});
    }
    for (const auto& s : json.find("steps")->items) {
      auto& step = index.steps[s.items[0].text];
      step = std::max<std::int64_t>(step, std::stoll(s.items[1].text));
    }
  }
  return index;
}

/// The index's informative members, from the Trainer's state file as written: the counters, the
/// scaler's state dict, the learning-rate schedule (load() reads them from that file).
inline std::string index_summary(const std::string& archive_bytes) {
  torch::serialize::InputArchive archive;
  archive.load_from(archive_bytes.data(), archive_bytes.size());
  std::string out;
  at::Tensor counters;
  if (archive.try_read("mixprec.counters", counters) && counters.numel() == 3) {
    out += ",\n  \"counters\": {\"steps\": " + std::to_string(counters[0].item<std::int64_t>()) +
           ", \"skipped_steps\": " + std::to_string(counters[1].item<std::int64_t>()) +
           ", \"micro_batches\": " + std::to_string(counters[2].item<std::int64_t>()) + "}";
  }
  c10::IValue scaler;
  if (archive.try_read("scaler", scaler) && scaler.isGenericDict()) {
    out += ",\n  \"scaler\": {";
    bool first = true;
    for (const auto& item : scaler.toGenericDict()) {
      if (!item.key().isString()) continue;
      const auto& v = item.value();
      const auto value = v.isDouble() ? Json::number(v.toDouble())
                         : v.isInt()  ? std::to_string(v.toInt())
                         : v.isBool() ? std::string(v.toBool() ? "true" : "false")
                                      : Json::quoted(v.tagKind());
      out += (first ? "" : ", ") + Json::quoted(item.key().toStringRef()) + ": " + value;
      first = false;
    }
    out += "}";
  }
  c10::IValue kind;
  at::Tensor count, base_lrs;
  if (archive.try_read("lr_schedule.kind", kind) && kind.isString() &&
      archive.try_read("lr_schedule.count", count) && archive.try_read("lr_schedule.base_lrs", base_lrs)) {
    out += ",\n  \"lr_schedule\": {\"kind\": " + Json::quoted(kind.toStringRef()) +
           ", \"count\": " + std::to_string(count.item<std::int64_t>()) + ", \"base_lrs\": [";
    for (std::int64_t i = 0; i < base_lrs.numel(); ++i) {
      out += (i ? ", " : "") + Json::number(base_lrs[i].item<double>());
    }
    out += "]}";
  }
  return out;
}

/// The Trainer's small state (what is not a tensor of the model or the optimizer's state):
/// policy, optimizer type, counters, param groups' options (and, for the single-file reader's
/// sake, their sizes unsharded), scaler, user values. The Trainer adds its schedule, fp8 and
/// rounding state.
inline void write_small_state(torch::serialize::OutputArchive& archive, const CheckpointParts& parts,
                              const TrainerCounters& counters, const c10::IValue& scaler_state,
                              const UserValues& user, const std::vector<std::vector<std::string>>& groups) {
  archive.write("mixprec.policy", c10::IValue(parts.policy.name));
  archive.write("mixprec.policy_settings", c10::IValue(parts.policy.settings));
  archive.write("mixprec.optimizer", c10::IValue(optimizer_type(parts.optimizer)));
  archive.write("mixprec.fused_optimizer", c10::IValue(parts.fused_optimizer));
  archive.write("mixprec.counters", at::tensor({counters.steps, counters.skipped_steps,
                                                counters.micro_batches}, at::kLong));
  torch::serialize::OutputArchive groups_archive;
  std::vector<std::int64_t> sizes;
  for (std::size_t g = 0; g < parts.optimizer.param_groups().size(); ++g) {
    sizes.push_back(g < groups.size() ? static_cast<std::int64_t>(groups[g].size()) : 0);
    torch::serialize::OutputArchive options_archive;
    parts.optimizer.param_groups()[g].options().serialize(options_archive);
    groups_archive.write(std::to_string(g), options_archive);
  }
  groups_archive.write("sizes", at::tensor(sizes, at::kLong));
  archive.write("optimizer.groups", groups_archive);
  archive.write("scaler", scaler_state);
  write_user_values(archive, user);
}

// Creates `dir` (every rank, for its own shard) and checks that a save may write there: not a
// file, and an index there is a mixprec checkpoint's (rank 0: the one that replaces it).
inline void prepare_directory(const std::filesystem::path& dir, int rank) {
  std::error_code error;
  MIXPREC_CHECK(!std::filesystem::exists(dir, error) || std::filesystem::is_directory(dir, error),
                "cannot save the sharded checkpoint '", dir.string(), "': it is a file (a "
                "single-file checkpoint?); a sharded run saves a directory: choose another path "
                "or remove the file. Nothing was written");
  std::filesystem::create_directories(dir, error);
  MIXPREC_CHECK(std::filesystem::is_directory(dir), "cannot save the sharded checkpoint '",
                dir.string(), "': cannot create the directory: ", error.message(), ". Nothing "
                "was written");
  if (rank != 0) return;
  const auto index = dir / kCheckpointIndex;
  if (!std::filesystem::exists(index, error)) return;
  std::ifstream in(index);
  std::stringstream text;
  text << in.rdbuf();
  MIXPREC_CHECK(text.str().find(kShardedFormat) != std::string::npos, "cannot save the sharded "
                "checkpoint '", dir.string(), "': its '", kCheckpointIndex, "' is not a mixprec "
                "checkpoint's index, which a save would replace: save into an empty directory "
                "or one of mixprec's checkpoints. Nothing was written");
}

/// This rank's part of a sharded save into `dir`, with the Trainer's small state that
/// `write_small` writes (rank 0). Collective; every rank throws if any rank failed, and then
/// `dir` holds the checkpoint it held before (complete, or none).
template <class WriteSmall>
void save_sharded(const std::string& dir, const CheckpointParts& parts, StepGroup& group,
                  WriteSmall&& write_small) {
  const int rank = group.rank(), world = group.world_size();
  const std::filesystem::path root(dir);
  const auto where = "checkpoint '" + dir + "'";
  // A collective that fails (a peer died) leaves this rank unsure what rank 0 did: its files
  // stay where they are (the next save that completes removes what no index names).
  const auto collective = [&](bool committed_maybe, auto&& run) {
    try {
      return run();
    } catch (const Error& e) {
      fail("rank ", rank, ": the sharded save of ", where, " failed: ", inner_message(e),
           committed_maybe ? ". The directory holds the checkpoint its index names, complete: "
                             "this one if rank 0 committed it, else the previous one"
                           : ". The previous checkpoint in the directory is intact");
    }
  };
  // 1. The save's id (rank 0's draw) and a directory every rank can write into.
  std::exception_ptr failure;
  try {
    prepare_directory(root, rank);
  } catch (...) {
    failure = std::current_exception();
  }
  const auto draw = rank == 0 ? std::stoull(new_save_id(), nullptr, 16) : 0;
  const std::vector<at::Tensor> opened = collective(false, [&] {
    return group.all_gather(at::tensor({failure ? std::int64_t{1} : std::int64_t{0},
                                        static_cast<std::int64_t>(draw)}, at::kLong).to(group.device()));
  });
  if (failure) std::rethrow_exception(failure);
  for (int r = 0; r < world; ++r) {
    MIXPREC_CHECK(opened[static_cast<std::size_t>(r)].cpu()[0].item<std::int64_t>() == 0, "rank ",
                  rank, ": rank ", r, " cannot save ", where, " (its Error says why); nothing "
                  "was written");
  }
  const auto id = hex64(static_cast<std::uint64_t>(opened[0].cpu()[1].item<std::int64_t>()));
  reach(SavePhase::begun, rank);
  // 2. This rank's shard.
  const auto names = TensorNames::of(parts.model);
  const auto shard_path = (root / shard_file_name(id, rank, world)).string();
  LocalShard shard;
  FileDigest digest;
  std::string error;
  try {
    shard = local_shard(parts, group, names);
    digest = write_shard(shard_path, shard,
                         {{"format", kShardedFormat}, {"save", id}, {"rank", std::to_string(rank)},
                          {"world_size", std::to_string(world)}},
                         rank);
  } catch (const std::exception& e) {
    error = inner_message(e);
  }
  if (error.empty()) reach(SavePhase::shard_written, rank);
  // 3. Every rank's report: any failure fails all (each removes its own shard).
  const std::vector<std::string> reports =
      collective(false, [&] { return all_gather_text(group, shard_report(shard, digest, error)); });
  for (int r = 0; r < world; ++r) {
    const auto report = JsonParser::parse(reports[static_cast<std::size_t>(r)], "a rank's report");
    const auto& failed = report.find("error")->text;
    if (failed.empty()) continue;
    std::error_code ignored;
    std::filesystem::remove(shard_path, ignored);
    if (r == rank) {
      fail("rank ", rank, ": cannot write its shard '", shard_path, "' of the sharded ", where,
           ": ", failed, ". Free space on that file system, or save elsewhere, and save again; "
           "the previous checkpoint in the directory is intact");
    }
    fail("rank ", rank, ": rank ", r, " could not write its shard of the sharded ", where, " (",
         failed, "); the previous checkpoint in the directory is intact");
  }
  reach(SavePhase::agreed, rank);
  // 4. Rank 0: the Trainer's state, then the index, the commit; then the other saves' files go.
  std::string commit_error;
  bool committed = false;
  if (rank == 0) {
    const auto state_path = (root / state_file_name(id)).string();
    try {
      auto index = assemble_index(id, reports, parts, names, group.shard_slots());
      torch::serialize::OutputArchive archive;
      write_small(archive, index.groups);
      std::string bytes;
      archive.save_to([&bytes](const void* data, std::size_t size) -> std::size_t {
        bytes.append(static_cast<const char*>(data), size);
        return size;
      });
      save_checkpoint_bytes(bytes, state_path);
      index.files.push_back({state_file_name(id), -1, digest_file(state_path)});
      index.summary = index_summary(bytes);
      reach(SavePhase::state_written, rank);
      const auto text = index_json(index);
      AtomicFile file((root / kCheckpointIndex).string());
      file.write(text.data(), text.size());
      reach(SavePhase::index_written, rank);
      try {
        file.commit();
      } catch (...) {
        if (!file.committed()) throw;  // renamed: the directory's fsync failed, the index is in place
      }
      committed = true;
    } catch (const std::exception& e) {
      commit_error = inner_message(e);
      if (!committed) {
        std::error_code ignored;
        std::filesystem::remove(state_path, ignored);
      }
    }
    if (committed) {
      reach(SavePhase::committed, rank);
      remove_other_saves(root, id);  // what remains (a file in use elsewhere) goes next time
      reach(SavePhase::cleaned, rank);
    }
  }
  // 5. Rank 0's verdict: before the commit, a failure removes every rank's shard.
  const std::vector<at::Tensor> verdict = collective(true, [&] {
    return group.all_gather(at::tensor({committed ? std::int64_t{1} : std::int64_t{0}}, at::kLong)
                                .to(group.device()));
  });
  if (verdict[0].cpu().item<std::int64_t>() == 1) return;
  std::error_code ignored;
  std::filesystem::remove(shard_path, ignored);
  MIXPREC_CHECK(rank != 0, "rank 0: cannot write the index of the sharded ", where, ": ",
                commit_error, ". Free space on that file system, or save elsewhere, and save "
                "again; the previous checkpoint in the directory is intact");
  fail("rank ", rank, ": rank 0 could not write the index of the sharded ", where, " (its Error "
       "says why); the previous checkpoint in the directory is intact");
}

}  // namespace mixprec::detail
