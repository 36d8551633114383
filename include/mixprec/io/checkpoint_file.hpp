#pragma once
// The checkpoint file: LibTorch's archive, then a trailer of three little-endian 64-bit words
// [magic, archive length, checksum of the archive]. LibTorch's zip reader checks no CRCs (a
// flipped bit in a tensor loads as a wrong weight) and throws types other than c10::Error for
// some damage, so a checkpoint is verified as a whole before LibTorch parses any of it.

#include <mixprec/io/atomic_file.hpp>
#include <mixprec/core/error.hpp>

#include <c10/util/Exception.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <new>
#include <string>
#include <system_error>

namespace mixprec::detail {

// The little-endian 64-bit word at `bytes`, whatever the host's byte order.
inline std::uint64_t load_le64(const unsigned char* bytes) noexcept {
  std::uint64_t word = 0;
  for (int i = 7; i >= 0; --i) word = (word << 8) | bytes[i];
  return word;
}

// A 64-bit checksum over little-endian 8-byte words, in four lanes so that the multiplications
// overlap (xxHash64's round). Each word enters its lane through a bijection, so any change within
// one word always changes the result; other damage escapes with a chance of about 2^-64.
class Checksum {
 public:
  void update(const void* data, std::size_t size) noexcept {
    const auto* bytes = static_cast<const unsigned char*>(data);
    length_ += size;
    while (size > 0) {
      if (pending_size_ == 0 && size >= kStripe) {
        consume(bytes);
        bytes += kStripe;
        size -= kStripe;
        continue;
      }
      const std::size_t n = std::min(size, kStripe - pending_size_);
      std::memcpy(pending_.data() + pending_size_, bytes, n);
      pending_size_ += n;
      bytes += n;
      size -= n;
      if (pending_size_ == kStripe) {
        consume(pending_.data());
        pending_size_ = 0;
      }
    }
  }

  std::uint64_t value() const noexcept {
    auto lanes = lanes_;
    std::array<unsigned char, kStripe> tail{};  // zero-padded; the length tells the padding apart
    std::memcpy(tail.data(), pending_.data(), pending_size_);
    for (std::size_t i = 0; i * 8 < pending_size_; ++i) {
      lanes[i] = round(lanes[i], load_le64(&tail[i * 8]));
    }
    std::uint64_t h = length_ * kPrime1;
    for (const auto lane : lanes) h = round(h, lane);
    h ^= h >> 33;  // xxHash64's avalanche
    h *= kPrime2;
    h ^= h >> 29;
    h *= kPrime3;
    return h ^ (h >> 32);
  }

  std::uint64_t length() const noexcept { return length_; }

 private:
  static constexpr std::size_t kStripe = 32;
  static constexpr std::uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
  static constexpr std::uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
  static constexpr std::uint64_t kPrime3 = 0x165667B19E3779F9ULL;

  static std::uint64_t round(std::uint64_t lane, std::uint64_t input) noexcept {
    lane += input * kPrime2;
    lane = (lane << 31) | (lane >> 33);
    return lane * kPrime1;
  }

  void consume(const unsigned char* stripe) noexcept {
    for (std::size_t i = 0; i < 4; ++i) lanes_[i] = round(lanes_[i], load_le64(stripe + 8 * i));
  }

  std::array<std::uint64_t, 4> lanes_{kPrime1 + kPrime2, kPrime2, 0, ~kPrime1 + 1};
  std::array<unsigned char, kStripe> pending_{};
  std::size_t pending_size_ = 0;
  std::uint64_t length_ = 0;
};

inline constexpr std::array<char, 8> checkpoint_magic{'m', 'i', 'x', 'p', 'r', 'e', 'c', '1'};
inline constexpr std::size_t checkpoint_trailer_size = 24;

/// The message of any exception LibTorch throws, without c10's backtrace.
inline std::string message_of(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error ? error->what_without_backtrace() : e.what();
}

/// The trailer of archive bytes whose Checksum is `checksum`.
inline std::array<unsigned char, checkpoint_trailer_size> checkpoint_trailer(const Checksum& checksum) {
  std::array<unsigned char, checkpoint_trailer_size> trailer{};
  std::memcpy(trailer.data(), checkpoint_magic.data(), checkpoint_magic.size());
  const std::uint64_t words[] = {checksum.length(), checksum.value()};
  for (std::size_t w = 0; w < 2; ++w) {
    for (std::size_t i = 0; i < 8; ++i) {
      trailer[8 + 8 * w + i] = static_cast<unsigned char>(words[w] >> (8 * i));
    }
  }
  return trailer;
}

/// Writes `archive` and its trailer to `path` atomically.
inline void save_checkpoint(torch::serialize::OutputArchive& archive, const std::string& path) {
  AtomicFile file(path);
  Checksum checksum;
  try {
    // LibTorch calls this from C code (miniz): it must not throw. A short count makes LibTorch
    // throw, and commit() reports the cause.
    archive.save_to([&](const void* data, std::size_t size) -> std::size_t {
      checksum.update(data, size);
      return file.write(data, size) ? size : 0;
    });
  } catch (const std::exception& e) {
    fail("cannot write checkpoint '", path, "': ",
         file.error() != 0 ? std::strerror(file.error()) : message_of(e));
  }
  const auto trailer = checkpoint_trailer(checksum);
  file.write(trailer.data(), trailer.size());
  file.commit();
}

/// Writes archive bytes (OutputArchive::save_to's) and their trailer to `path` atomically.
inline void save_checkpoint_bytes(const std::string& bytes, const std::string& path) {
  AtomicFile file(path);
  Checksum checksum;
  checksum.update(bytes.data(), bytes.size());
  file.write(bytes.data(), bytes.size());
  const auto trailer = checkpoint_trailer(checksum);
  file.write(trailer.data(), trailer.size());
  file.commit();
}

/// The archive bytes of the checkpoint at `path`, verified against its trailer.
inline std::string read_checkpoint(const std::string& path) {
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  MIXPREC_CHECK(std::filesystem::exists(status), "cannot read checkpoint '", path, "': ",
                error ? error.message() : std::string("no such file"));
  MIXPREC_CHECK(std::filesystem::is_regular_file(status), "cannot read checkpoint '", path,
                "': not a regular file");
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  MIXPREC_CHECK(in.is_open(), "cannot read checkpoint '", path, "': ", std::strerror(errno));
  const std::streamoff size = in.tellg();
  MIXPREC_CHECK(size >= 0, "cannot read checkpoint '", path, "': cannot tell its size");
  std::string bytes;
  try {
    bytes.resize(static_cast<std::size_t>(size));
  } catch (const std::bad_alloc&) {
    fail("cannot read checkpoint '", path, "': ", size, " bytes do not fit in memory");
  }
  in.seekg(0);
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  MIXPREC_CHECK(in.good(), "cannot read checkpoint '", path, "': a read error");
  const auto* end = reinterpret_cast<const unsigned char*>(bytes.data() + bytes.size());
  MIXPREC_CHECK(bytes.size() >= checkpoint_trailer_size &&
                    std::memcmp(end - checkpoint_trailer_size, checkpoint_magic.data(),
                                checkpoint_magic.size()) == 0,
                "cannot read checkpoint '", path, "': it does not end in a mixprec checkpoint "
                "trailer (truncated, or not written by Trainer::save)");
  const std::size_t length = bytes.size() - checkpoint_trailer_size;
  MIXPREC_CHECK(load_le64(end - 16) == length, "cannot read checkpoint '", path,
                "': it is ", length, " bytes long but was written with ", load_le64(end - 16),
                " (truncated, or a partial copy)");
  Checksum checksum;
  checksum.update(bytes.data(), length);
  MIXPREC_CHECK(checksum.value() == load_le64(end - 8), "cannot read checkpoint '", path,
                "': it is corrupted (its checksum does not match its contents): use another copy");
  bytes.resize(length);
  return bytes;
}

}  // namespace mixprec::detail
