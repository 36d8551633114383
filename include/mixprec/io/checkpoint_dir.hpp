#pragma once
// The files of a sharded checkpoint directory, one save's set beside another's: each save has
// an id (16 hex digits), and its files are named by it, each rank's shard
// `<id>.rank00001-of-00004.safetensors` and the Trainer's small state `<id>.trainer.pt`.
// `index.json`, written last and atomically (temporary, fsync, rename), names the save the
// directory holds: a crash before its rename leaves the previous index, whose files are still
// there; the files of other saves are removed only after it. What a crash leaves behind (a
// save's files without an index, temporaries) is removed by the next save that completes.

#include <mixprec/core/error.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace mixprec::detail {

inline constexpr const char* kCheckpointIndex = "index.json";

/// A new save's id: 16 hex digits, random.
inline std::string new_save_id() {
  std::random_device device;
  const std::uint64_t bits = (static_cast<std::uint64_t>(device()) << 32) ^ device() ^
      static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(bits));
  return text;
}

/// Rank `rank`'s shard of save `id` at `world` ranks.
inline std::string shard_file_name(const std::string& id, int rank, int world) {
  char text[64];
  std::snprintf(text, sizeof text, ".rank%05d-of-%05d.safetensors", rank, world);
  return id + text;
}

/// The Trainer's small state (scaler, schedule, param groups' options, user values) of save `id`.
inline std::string state_file_name(const std::string& id) { return id + ".trainer.pt"; }

inline bool hex_digits(std::string_view text) {
  for (const char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return !text.empty();
}

inline bool digits(std::string_view text) {
  for (const char c : text) {
    if (c < '0' || c > '9') return false;
  }
  return !text.empty();
}

/// Whether `name` is a file a save writes: an id's shard or state file, or a temporary of one
/// or of the index (AtomicFile's `.tmp.<pid>`).
inline bool save_file_name(std::string_view name) {
  if (const auto tmp = name.find(".tmp."); tmp != std::string_view::npos) {
    if (!digits(name.substr(tmp + 5))) return false;
    name = name.substr(0, tmp);
    if (name == kCheckpointIndex) return true;
  }
  if (name.size() < 17 || name[16] != '.' || !hex_digits(name.substr(0, 16))) return false;
  const auto rest = name.substr(17);
  if (rest == "trainer.pt") return true;
  // rank00001-of-00004.safetensors
  return rest.size() == 30 && rest.substr(0, 4) == "rank" && digits(rest.substr(4, 5)) &&
         rest.substr(9, 4) == "-of-" && digits(rest.substr(13, 5)) &&
         rest.substr(18) == ".safetensors";
}

/// Removes from `dir` the files of every save but `keep` (and all temporaries); returns how
/// many. Other files are left alone.
inline std::size_t remove_other_saves(const std::filesystem::path& dir, const std::string& keep) {
  std::size_t removed = 0;
  std::error_code error;
  std::vector<std::filesystem::path> doomed;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const auto name = entry.path().filename().string();
    if (!save_file_name(name)) continue;
    const bool ours = name.rfind(keep + ".", 0) == 0 && name.find(".tmp.") == std::string::npos;
    if (!ours) doomed.push_back(entry.path());
  }
  for (const auto& path : doomed) {
    if (std::filesystem::remove(path, error)) ++removed;
  }
  return removed;
}

}  // namespace mixprec::detail
