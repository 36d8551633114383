#pragma once
// The bytes of a weights file, read at offsets: a file on disk or a buffer in memory, every read
// checked against the size first, so that no offset or length read from a file can reach past
// its end. The readers (safetensors, zip) take a ByteSource and read each tensor straight into
// its own memory: a model's file is never held twice. And the zip format's CRC-32.

#include <mixprec/core/error.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

namespace mixprec::detail {

/// Bytes read at offsets; `name` says where they come from in errors.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  std::uint64_t size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }

  /// Whether [offset, offset + length) lies within the source.
  bool holds(std::uint64_t offset, std::uint64_t length) const noexcept {
    return offset <= size_ && length <= size_ - offset;
  }

  /// Copies [offset, offset + length) to `out`; an Error where that range is not all there.
  void read(std::uint64_t offset, void* out, std::uint64_t length) const {
    MIXPREC_CHECK(holds(offset, length), "'", name_, "' is ", size_, " bytes long: bytes [",
                  offset, ", ", offset, " + ", length, ") are past its end (truncated?)");
    if (length > 0) read_within(offset, out, length);
  }

  std::string read_string(std::uint64_t offset, std::uint64_t length) const {
    std::string text;
    MIXPREC_CHECK(holds(offset, length), "'", name_, "' is ", size_, " bytes long: bytes [",
                  offset, ", ", offset, " + ", length, ") are past its end (truncated?)");
    text.resize(static_cast<std::size_t>(length));
    read(offset, text.data(), length);
    return text;
  }

 protected:
  ByteSource(std::string name, std::uint64_t size) : name_(std::move(name)), size_(size) {}
  virtual void read_within(std::uint64_t offset, void* out, std::uint64_t length) const = 0;

 private:
  std::string name_;
  std::uint64_t size_;
};

/// A buffer the caller keeps alive.
class MemorySource final : public ByteSource {
 public:
  MemorySource(const void* data, std::size_t size, std::string name)
      : ByteSource(std::move(name), size), data_(static_cast<const unsigned char*>(data)) {}

 private:
  void read_within(std::uint64_t offset, void* out, std::uint64_t length) const override {
    std::memcpy(out, data_ + offset, static_cast<std::size_t>(length));
  }
  const unsigned char* data_;
};

/// A regular file, read with pread(2).
class FileSource final : public ByteSource {
 public:
  explicit FileSource(const std::string& path) : ByteSource(path, file_size(path)) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    MIXPREC_CHECK(fd_ >= 0, "cannot read '", path, "': ", std::strerror(errno));
  }
  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;
  ~FileSource() override { ::close(fd_); }

 private:
  static std::uint64_t file_size(const std::string& path) {
    std::error_code error;
    const auto status = std::filesystem::status(path, error);
    MIXPREC_CHECK(std::filesystem::exists(status), "cannot read '", path, "': ",
                  error ? error.message() : std::string("no such file"));
    MIXPREC_CHECK(std::filesystem::is_regular_file(status), "cannot read '", path,
                  "': not a regular file");
    const auto size = std::filesystem::file_size(path, error);
    MIXPREC_CHECK(!error, "cannot read '", path, "': ", error.message());
    return size;
  }

  void read_within(std::uint64_t offset, void* out, std::uint64_t length) const override {
    auto* bytes = static_cast<char*>(out);
    while (length > 0) {
      const auto n = ::pread(fd_, bytes, static_cast<std::size_t>(std::min<std::uint64_t>(length, 1U << 30)),
                             static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      MIXPREC_CHECK(n > 0, "cannot read '", name(), "' at byte ", offset, ": ",
                    n == 0 ? "it ended early (it shrank while being read?)" : std::strerror(errno));
      bytes += n;
      offset += static_cast<std::uint64_t>(n);
      length -= static_cast<std::uint64_t>(n);
    }
  }
  int fd_ = -1;
};

/// The little-endian unsigned number of `n` bytes at `p`.
inline std::uint64_t load_le(const unsigned char* p, int n) noexcept {
  std::uint64_t value = 0;
  for (int i = n - 1; i >= 0; --i) value = (value << 8) | p[i];
  return value;
}

/// The CRC-32 of zip files (polynomial 0xEDB88320), eight bytes a step (slicing-by-8), so that
/// checking a model's weights costs little beside reading them.
class Crc32 {
 public:
  void update(const void* data, std::size_t size) noexcept {
    const auto& t = tables();
    const auto* p = static_cast<const unsigned char*>(data);
    std::uint32_t c = ~crc_;
    for (; size >= 8; size -= 8, p += 8) {
      const std::uint32_t a = c ^ static_cast<std::uint32_t>(load_le(p, 4));
      const auto b = static_cast<std::uint32_t>(load_le(p + 4, 4));
      c = t[7][a & 0xFF] ^ t[6][(a >> 8) & 0xFF] ^ t[5][(a >> 16) & 0xFF] ^ t[4][a >> 24] ^
          t[3][b & 0xFF] ^ t[2][(b >> 8) & 0xFF] ^ t[1][(b >> 16) & 0xFF] ^ t[0][b >> 24];
    }
    for (; size > 0; --size, ++p) c = t[0][(c ^ *p) & 0xFF] ^ (c >> 8);
    crc_ = ~c;
  }
  std::uint32_t value() const noexcept { return crc_; }

 private:
  using Tables = std::array<std::array<std::uint32_t, 256>, 8>;
  static const Tables& tables() noexcept {
    static const Tables t = [] {
      Tables made{};
      for (std::uint32_t i = 0; i < 256; ++i) {
        std::uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1U) ? 0xEDB88320U ^ (c >> 1) : c >> 1;
        made[0][i] = c;
      }
      for (std::size_t k = 1; k < 8; ++k) {
        for (std::size_t i = 0; i < 256; ++i) {
          made[k][i] = (made[k - 1][i] >> 8) ^ made[0][made[k - 1][i] & 0xFF];
        }
      }
      return made;
    }();
    return t;
  }
  std::uint32_t crc_ = 0;
};

}  // namespace mixprec::detail
