#pragma once
// Writing a file atomically: to a temporary beside it, fsync, rename over the target, fsync the
// directory. A crash leaves the old file or the new one, never half of one.

#include <mixprec/core/error.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>

#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

namespace mixprec::detail {

inline void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MIXPREC_CHECK(fd >= 0, "cannot open '", path, "' to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  MIXPREC_CHECK(rc == 0, "fsync of '", path, "' failed: ", std::strerror(errno));
}

/// A file written to a temporary beside `path`; commit() moves it over `path` durably, and a
/// file destroyed before commit() leaves no trace.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path)
      : path_(std::move(path)), temporary_(path_ + ".tmp." + std::to_string(::getpid())) {
    fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    MIXPREC_CHECK(fd_ >= 0, "cannot write '", path_, "': cannot create '", temporary_, "': ",
                  std::strerror(errno), " (does the directory exist and is it writable?)");
  }
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(temporary_.c_str());
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  /// Appends bytes; false after a failure, whose errno error() keeps for commit() to report.
  /// Never throws, so that C code (LibTorch's zip writer) can call it.
  bool write(const void* data, std::size_t size) noexcept {
    const auto* bytes = static_cast<const char*>(data);
    while (size > 0 && error_ == 0) {
      const ::ssize_t n = ::write(fd_, bytes, size);
      if (n < 0) {
        if (errno != EINTR) error_ = errno;
        continue;
      }
      bytes += n;
      size -= static_cast<std::size_t>(n);
    }
    return error_ == 0;
  }

  /// The errno of the first failed write, 0 if none failed.
  int error() const noexcept { return error_; }

  /// Whether commit() renamed the file into place (the directory's fsync may still have failed).
  bool committed() const noexcept { return committed_; }

  /// Syncs the temporary and renames it over `path`.
  void commit() {
    MIXPREC_CHECK(error_ == 0, "cannot write '", path_, "': ", std::strerror(error_));
    MIXPREC_CHECK(::fsync(fd_) == 0, "cannot write '", path_, "': fsync failed: ",
                  std::strerror(errno));
    const int rc = ::close(fd_);  // where a file system reports deferred write errors
    fd_ = -1;
    MIXPREC_CHECK(rc == 0, "cannot write '", path_, "': ", std::strerror(errno));
    MIXPREC_CHECK(std::rename(temporary_.c_str(), path_.c_str()) == 0, "cannot write '", path_,
                  "': cannot rename '", temporary_, "' to it: ", std::strerror(errno));
    committed_ = true;
    const auto directory = std::filesystem::path(path_).parent_path();
    fsync_path(directory.empty() ? std::string(".") : directory.string());
  }

 private:
  std::string path_;
  std::string temporary_;
  int fd_ = -1;
  int error_ = 0;
  bool committed_ = false;
};

}  // namespace mixprec::detail
