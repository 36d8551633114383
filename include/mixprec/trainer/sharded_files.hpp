#pragma once
// The files of a sharded checkpoint as a load reads them: the index parsed and checked, every
// file there and of its recorded size, every shard's header of this save and of its rank, this
// rank's share of the checksums (each file's checksum checked once over the ranks, in blocks:
// never a file in memory), the Trainer's small state file; then any range of a tensor read from
// the pieces that hold it, straight into the caller's memory. What the Trainer reads of them:
// sharded_load.hpp.

#include <mixprec/core/error.hpp>
#include <mixprec/io/checkpoint_dir.hpp>
#include <mixprec/io/checkpoint_file.hpp>
#include <mixprec/io/safetensors_stream.hpp>
#include <mixprec/trainer/sharded_index.hpp>

#include <ATen/ATen.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// Whether `path` is a sharded checkpoint (a directory) rather than a single file.
inline bool sharded_checkpoint_at(const std::string& path) {
  std::error_code error;
  return std::filesystem::is_directory(path, error);
}

class CheckpointFiles {
 public:
  /// Checks the checkpoint in `dir` as rank `rank` of `world` (this rank's share of the
  /// checksums); every failure is an Error that names the file and says what to do.
  CheckpointFiles(std::string dir, int rank, int world) : dir_(std::move(dir)) {
    const auto root = std::filesystem::path(dir_);
    const auto index_path = (root / kCheckpointIndex).string();
    std::error_code error;
    MIXPREC_CHECK(std::filesystem::is_directory(root, error), "cannot read checkpoint '", dir_,
                  "': no such directory (another rank loads a sharded checkpoint, a directory: "
                  "every rank loads the same)");
    MIXPREC_CHECK(std::filesystem::exists(index_path, error), "cannot read checkpoint '", dir_,
                  "': the directory holds no '", kCheckpointIndex, "' (not a sharded checkpoint, "
                  "or its first save never finished: a save writes the index last)");
    std::ifstream in(index_path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    MIXPREC_CHECK(!in.bad(), "cannot read '", index_path, "'");
    index_ = parse_index(text.str(), index_path);
    check_files(rank, world);
    read_state_file();
  }

  const std::string& dir() const noexcept { return dir_; }
  const ShardIndex& index() const noexcept { return index_; }
  /// The Trainer's small state file, read (its trailer's checksum verified).
  torch::serialize::InputArchive& state() noexcept { return state_; }
  /// Whether the checkpoint holds tensor `name`.
  bool holds(const std::string& name) const { return index_.tensors.count(name) == 1; }

  /// Elements [from, from + into.numel()) of checkpoint tensor `name` into `into` (flat, any
  /// dtype: converted where it is not the file's), from the pieces that hold them.
  void read_range(const std::string& name, std::int64_t from, const at::Tensor& into) const {
    const auto& tensor = index_.tensors.at(name);
    const auto to = from + into.numel();
    for (const auto& piece : tensor.pieces) {
      const auto lo = std::max(from, piece.from), hi = std::min(to, piece.from + piece.count);
      if (lo >= hi) continue;
      const auto& shard = *shards_[static_cast<std::size_t>(piece.rank)];
      const auto& entry = *shard.find(name);
      auto part = into.narrow(0, lo - from, hi - lo);
      if (part.scalar_type() == entry.dtype && part.is_contiguous() && part.device().is_cpu()) {
        shard.read(entry, lo - piece.from, part);
      } else {
        auto bytes = at::empty({hi - lo}, entry.dtype);
        shard.read(entry, lo - piece.from, bytes);
        part.copy_(bytes);
      }
    }
  }

 private:
  std::string file_path(const std::string& name) const {
    return (std::filesystem::path(dir_) / name).string();
  }

  // Every file: there, of its size; every shard's header, of this save and rank; this rank's
  // share of the checksums (every file's checksum checked once over the ranks).
  void check_files(int rank, int world) {
    for (const auto& file : index_.files) {
      const auto path = file_path(file.name);
      const auto whose = file.rank >= 0 ? "shard file of rank " + std::to_string(file.rank) + " of " +
                                              std::to_string(index_.world_size)
                                        : std::string("Trainer state file");
      std::error_code error;
      const auto size = std::filesystem::file_size(path, error);
      MIXPREC_CHECK(!error, "checkpoint '", dir_, "': its ", whose, " '", path, "' is missing (",
                    error.message(), "): copy the whole checkpoint directory, every rank's "
                    "shard with the index; nothing was loaded");
      MIXPREC_CHECK(size == file.digest.bytes, "checkpoint '", dir_, "': its ", whose, " '",
                    path, "' is ", size, " bytes long, the index recorded ", file.digest.bytes,
                    " (truncated, or replaced by another file): restore it from a copy of the "
                    "whole directory; nothing was loaded");
    }
    for (int r = 0; r < index_.world_size; ++r) {
      const auto path = file_path(index_.shard_file(r).name);
      std::unique_ptr<SafetensorsFile> shard;
      try {
        shard = std::make_unique<SafetensorsFile>(path);
      } catch (const Error& e) {
        fail("checkpoint '", dir_, "': shard file '", path, "' is damaged: ", inner_message(e),
             ". Restore it from a copy of the whole directory; nothing was loaded");
      }
      const auto save = shard->metadata("save").value_or("(none)");
      const auto saved_rank = shard->metadata("rank").value_or("(none)");
      MIXPREC_CHECK(save == index_.save && saved_rank == std::to_string(r), "checkpoint '", dir_,
                    "': shard file '", path, "' belongs to save ", save, " (rank ", saved_rank,
                    "), the index names save ", index_.save, " (rank ", r, "): it comes from "
                    "another checkpoint or run. Copy the whole directory of one save; nothing "
                    "was loaded");
      shards_.push_back(std::move(shard));
    }
    for (const auto& [name, tensor] : index_.tensors) {
      for (const auto& piece : tensor.pieces) {
        const auto* entry = shards_[static_cast<std::size_t>(piece.rank)]->find(name);
        MIXPREC_CHECK(entry != nullptr && entry->dtype == tensor.dtype &&
                          entry->end - entry->begin ==
                              static_cast<std::uint64_t>(piece.count) * at::elementSize(tensor.dtype),
                      "checkpoint '", dir_, "': shard file '",
                      shards_[static_cast<std::size_t>(piece.rank)]->path(), "' does not hold the "
                      "piece of '", name, "' that the index names: restore the directory from a "
                      "copy; nothing was loaded");
      }
    }
    for (std::size_t k = 0; k < index_.files.size(); ++k) {
      if (static_cast<int>(k % static_cast<std::size_t>(world)) != rank) continue;
      const auto& file = index_.files[k];
      const auto path = file_path(file.name);
      const auto digest = digest_file(path);
      MIXPREC_CHECK(digest.checksum == file.digest.checksum, "checkpoint '", dir_, "': file '",
                    path, "' is damaged: its checksum is ", hex64(digest.checksum), ", the index "
                    "recorded ", hex64(file.digest.checksum), " (bytes changed on disk or in a "
                    "copy). Restore it from a copy of the whole directory; nothing was loaded");
    }
  }

  void read_state_file() {
    const IndexFile* state = nullptr;
    for (const auto& f : index_.files) {
      if (f.rank < 0) state = &f;
    }
    MIXPREC_CHECK(state != nullptr, "checkpoint index '", dir_, "/", kCheckpointIndex,
                  "' names no Trainer state file: restore the directory from a copy");
    const auto path = file_path(state->name);
    const auto bytes = read_checkpoint(path);
    try {
      state_.load_from(bytes.data(), bytes.size());
    } catch (const std::exception& e) {
      fail("cannot read checkpoint '", path, "': ", message_of(e));
    }
  }

  std::string dir_;
  ShardIndex index_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;  // by rank
  torch::serialize::InputArchive state_;
};

}  // namespace mixprec::detail
