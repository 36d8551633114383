#pragma once
// Reads the gzipped IDX files of (Fashion-)MNIST with zlib. Every header field is checked: a
// short or mislabelled file fails with a message instead of training on garbage.
//
// IDX format (http://yann.lecun.com/exdb/mnist/): a big-endian magic number 0x000008NN (0x08 =
// unsigned byte, NN = rank), NN big-endian uint32 dimensions, then the values in row-major order.

#include <torch/torch.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace fashion_mnist {

/// Per-pixel statistics of the Fashion-MNIST training set, after scaling to [0, 1].
inline constexpr double kPixelMean = 0.2860;
inline constexpr double kPixelStd = 0.3530;
inline constexpr int kImageSide = 28;
inline constexpr std::int64_t kClasses = 10;
/// Where Debian's dataset-fashion-mnist package puts the files.
inline constexpr std::string_view kDefaultDataDir = "/usr/share/datasets/fashion-mnist";
inline constexpr std::string_view kDataPackage = "dataset-fashion-mnist";

/// A data file is absent or unreadable; the message names the package that provides it.
class MissingDataError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A data file exists but does not hold what its name promises (bad magic, truncated, ...).
class CorruptDataError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

struct GzClose {
  void operator()(gzFile_s* file) const { gzclose(file); }
};
using GzFile = std::unique_ptr<gzFile_s, GzClose>;

inline std::string missing_message(const std::filesystem::path& path, std::string_view what) {
  return path.string() + ": " + std::string(what) +
         ". The Fashion-MNIST files come with the Debian package " + std::string(kDataPackage) +
         " (sudo apt-get install " + std::string(kDataPackage) +
         "), or pass --data DIR with the four *-ubyte.gz files";
}

/// Reads up to `size` bytes; fewer only at the end of the stream. Throws on a zlib error.
inline std::size_t read_bytes(gzFile_s* file, void* buffer, std::size_t size,
                              const std::filesystem::path& path) {
  std::size_t done = 0;
  while (done < size) {
    // gzread counts in unsigned int: read in chunks of at most 1 GiB.
    const auto chunk =
        static_cast<unsigned>(std::min<std::size_t>(size - done, std::size_t{1} << 30));
    const int got = gzread(file, static_cast<unsigned char*>(buffer) + done, chunk);
    if (got < 0) {
      int code = Z_OK;
      const char* message = gzerror(file, &code);
      throw CorruptDataError(path.string() + ": corrupt gzip stream (" + message + ")");
    }
    if (got == 0) {
      break;
    }
    done += static_cast<std::size_t>(got);
  }
  if (done < size) {
    // zlib reports a stream cut in the middle as a short read plus an error state.
    int code = Z_OK;
    const char* message = gzerror(file, &code);
    if (code != Z_OK) {
      throw CorruptDataError(path.string() + ": corrupt gzip stream (" + message + ")");
    }
  }
  return done;
}

inline std::uint32_t big_endian(const std::array<unsigned char, 4>& bytes) {
  return (std::uint32_t{bytes[0]} << 24) | (std::uint32_t{bytes[1]} << 16) |
         (std::uint32_t{bytes[2]} << 8) | std::uint32_t{bytes[3]};
}

inline std::string hex(std::uint32_t value) {
  std::array<char, 16> text{};
  std::snprintf(text.data(), text.size(), "0x%08x", value);
  return text.data();
}

}  // namespace detail

/// The header of an IDX file of unsigned bytes: its dimensions.
struct IdxHeader {
  std::vector<std::int64_t> dims;
};

/// Reads a gzipped IDX file of unsigned bytes of the given rank into a uint8 tensor of its shape.
/// `max_items` >= 0 reads only that many leading items (rows of the first dimension).
/// Throws MissingDataError when the file cannot be opened, CorruptDataError when its content is
/// not such an array: bad magic, wrong rank, a zero or huge dimension, truncated or trailing data.
inline torch::Tensor read_idx_gz(const std::filesystem::path& path, int rank,
                                 std::int64_t max_items = -1) {
  std::error_code ignored;
  if (!std::filesystem::is_regular_file(path, ignored)) {
    throw MissingDataError(detail::missing_message(path, "file not found"));
  }
  detail::GzFile file(gzopen(path.c_str(), "rb"));
  if (!file) {
    throw MissingDataError(detail::missing_message(path, "cannot open the file"));
  }
  gzbuffer(file.get(), 1u << 17);

  std::array<unsigned char, 4> word{};
  if (detail::read_bytes(file.get(), word.data(), word.size(), path) != word.size()) {
    throw CorruptDataError(path.string() + ": truncated: no IDX header");
  }
  const std::uint32_t magic = detail::big_endian(word);
  const std::uint32_t expected = 0x0800u | static_cast<std::uint32_t>(rank);
  if (magic != expected) {
    throw CorruptDataError(path.string() + ": bad magic number " + detail::hex(magic) +
                           " (expected " + detail::hex(expected) +
                           ": IDX of unsigned bytes, rank " + std::to_string(rank) + ")");
  }

  // 2^32 values is far above any MNIST-like set; the bound keeps a corrupt header from
  // requesting an absurd allocation before the size check can fail.
  constexpr std::int64_t kMaxValues = std::int64_t{1} << 32;
  std::vector<std::int64_t> dims;
  std::int64_t count = 1;
  for (int d = 0; d < rank; ++d) {
    if (detail::read_bytes(file.get(), word.data(), word.size(), path) != word.size()) {
      throw CorruptDataError(path.string() + ": truncated: IDX header ends in the dimensions");
    }
    const auto dim = static_cast<std::int64_t>(detail::big_endian(word));
    if (dim == 0 || dim > kMaxValues / count) {
      throw CorruptDataError(path.string() + ": implausible dimension " + std::to_string(dim) +
                             " in the IDX header");
    }
    dims.push_back(dim);
    count *= dim;
  }

  const std::int64_t stored_items = dims[0];
  const std::int64_t items = max_items >= 0 ? std::min(stored_items, max_items) : stored_items;
  const std::int64_t item_size = count / stored_items;
  dims[0] = items;
  torch::Tensor values = torch::empty(dims, torch::kUInt8);
  const auto wanted = static_cast<std::size_t>(items * item_size);
  const std::size_t got =
      detail::read_bytes(file.get(), values.data_ptr<std::uint8_t>(), wanted, path);
  if (got != wanted) {
    throw CorruptDataError(path.string() + ": truncated: the header announces " +
                           std::to_string(stored_items * item_size) + " values, the file holds " +
                           std::to_string(got));
  }
  if (items == stored_items) {
    unsigned char extra = 0;
    if (detail::read_bytes(file.get(), &extra, 1, path) != 0) {
      throw CorruptDataError(path.string() + ": trailing data after the " +
                             std::to_string(stored_items * item_size) + " announced values");
    }
  }
  return values;
}

/// One split of the data set: images as uint8 [N, 1, 28, 28] (kept as bytes: a quarter of the
/// memory of floats, so that the demo's peak-RSS column measures training, not the data set),
/// labels as int64 [N].
struct Split {
  torch::Tensor images;
  torch::Tensor labels;
  [[nodiscard]] std::int64_t size() const { return labels.size(0); }
};

/// Loads `<dir>/<prefix>-images-idx3-ubyte.gz` and the matching labels; prefix "train" or "t10k".
/// `max_items` >= 0 keeps only the leading items. Checks the images are 28x28, the two files
/// hold the same number of items and every label is a class index.
inline Split load_split(const std::filesystem::path& dir, std::string_view prefix,
                        std::int64_t max_items = -1) {
  const auto images_path = dir / (std::string(prefix) + "-images-idx3-ubyte.gz");
  const auto labels_path = dir / (std::string(prefix) + "-labels-idx1-ubyte.gz");
  // Both files are opened first, so that a missing one is reported before any long read.
  for (const auto& path : {images_path, labels_path}) {
    std::error_code ignored;
    if (!std::filesystem::is_regular_file(path, ignored)) {
      throw MissingDataError(detail::missing_message(path, "file not found"));
    }
  }
  // Full label file (small): its count must match the image file's header.
  torch::Tensor labels = read_idx_gz(labels_path, 1);
  torch::Tensor images = read_idx_gz(images_path, 3, max_items);
  if (images.size(1) != kImageSide || images.size(2) != kImageSide) {
    throw CorruptDataError(images_path.string() + ": images are " + std::to_string(images.size(1)) +
                           "x" + std::to_string(images.size(2)) + ", expected 28x28");
  }
  const std::int64_t items = images.size(0);
  if (labels.size(0) < items || (max_items < 0 && labels.size(0) != items)) {
    throw CorruptDataError(labels_path.string() + ": " + std::to_string(labels.size(0)) +
                           " labels for " + std::to_string(items) + " images");
  }
  labels = labels.narrow(0, 0, items);
  if (items > 0 && labels.max().item<int>() >= kClasses) {
    throw CorruptDataError(labels_path.string() + ": label " +
                           std::to_string(labels.max().item<int>()) +
                           " is not a class index (0..9)");
  }
  return {images.unsqueeze(1), labels.to(torch::kLong)};
}

/// Checks that the four data files are present, without reading them.
inline void check_data_files(const std::filesystem::path& dir) {
  for (const char* name : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                           "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}) {
    std::error_code ignored;
    if (!std::filesystem::is_regular_file(dir / name, ignored)) {
      throw MissingDataError(detail::missing_message(dir / name, "file not found"));
    }
  }
}

/// uint8 images to float in [0, 1], then standardized with the training set's mean and std.
inline torch::Tensor standardize(const torch::Tensor& images) {
  return images.to(torch::kFloat).div_(255.0).sub_(kPixelMean).div_(kPixelStd);
}

}  // namespace fashion_mnist
