#pragma once
// Writing a file atomically: to a temporary beside it, fsync, rename over the target, fsync the
// directory. A crash leaves the old file or the new one, never half of one.

#include <mixprec/error.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>

#include <fcntl.h>
#include <unistd.h>

namespace mixprec::detail {

inline void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  MIXPREC_CHECK(fd >= 0, "cannot open '", path, "' to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  MIXPREC_CHECK(rc == 0, "fsync of '", path, "' failed: ", std::strerror(errno));
}

/// Calls write(temporary_path), then moves the temporary over `path` durably.
inline void write_atomically(const std::string& path,
                             const std::function<void(const std::string&)>& write) {
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  try {
    write(temporary);
    fsync_path(temporary);
    MIXPREC_CHECK(std::rename(temporary.c_str(), path.c_str()) == 0, "cannot rename '",
                  temporary, "' to '", path, "': ", std::strerror(errno));
  } catch (...) {
    std::remove(temporary.c_str());
    throw;
  }
  auto directory = std::filesystem::path(path).parent_path();
  fsync_path(directory.empty() ? std::string(".") : directory.string());
}

}  // namespace mixprec::detail
