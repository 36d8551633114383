#pragma once
// Safetensors files larger than memory: a writer that takes the tensors' names, dtypes and shapes
// first (the header holds their offsets) and then their bytes one tensor at a time, in that
// order, into a file written atomically, and returns the file's size and checksum; and a reader
// that parses the header once and copies any range of a tensor's elements straight into the
// caller's memory. Sharded checkpoints and the streamed fp32 export are written and read so,
// never holding more than one tensor (or one range) at a time. Python's safetensors reads the
// files (`safetensors.torch.load_file`).

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/io/atomic_file.hpp>
#include <mixprec/io/byte_source.hpp>
#include <mixprec/io/checkpoint_file.hpp>
#include <mixprec/io/json.hpp>
#include <mixprec/io/safetensors.hpp>

#include <ATen/ATen.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// A file's size and the Checksum (checkpoint_file.hpp) of all its bytes.
struct FileDigest {
  std::uint64_t bytes = 0;
  std::uint64_t checksum = 0;
};

/// The digest of the file at `path`, read in blocks of 1 MiB (never the file at once).
inline FileDigest digest_file(const std::string& path) {
  FileSource source(path);
  Checksum checksum;
  std::vector<char> block(std::size_t{1} << 20);
  for (std::uint64_t offset = 0; offset < source.size();) {
    const auto n = std::min<std::uint64_t>(block.size(), source.size() - offset);
    source.read(offset, block.data(), n);
    checksum.update(block.data(), static_cast<std::size_t>(n));
    offset += n;
  }
  return {source.size(), checksum.value()};
}

/// The format's name of `dtype` ("F32", "BF16"); an Error for one it has none for.
inline std::string safetensors_dtype(c10::ScalarType dtype) {
  for (const auto& d : file_dtypes()) {
    if (d.type == dtype && !d.safetensors.empty()) return std::string(d.safetensors);
  }
  fail("safetensors has no dtype for ", dtype);
}

/// A tensor that a SafetensorsWriter will write.
struct SafetensorsSpec {
  std::string name;
  c10::ScalarType dtype;
  std::vector<std::int64_t> shape;
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (const auto s : shape) n *= s;
    return n;
  }
};

/// Writes the safetensors file `path` tensor by tensor: the header first, from `specs` (the
/// data in their order) and `metadata` (its __metadata__), then each tensor's bytes as
/// write_next() gets them; commit() syncs it and renames it into place. Destroyed before
/// commit(), it leaves no file.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<SafetensorsSpec> specs,
                    const std::vector<std::pair<std::string, std::string>>& metadata)
      : path_(std::move(path)), specs_(std::move(specs)), file_(path_) {
    std::string header = "{";
    bool first = true;
    if (!metadata.empty()) {
      header += "\"__metadata__\": {";
      for (std::size_t i = 0; i < metadata.size(); ++i) {
        header += (i ? ", " : "") + Json::quoted(metadata[i].first) + ": " +
                  Json::quoted(metadata[i].second);
      }
      header += "}";
      first = false;
    }
    std::uint64_t offset = 0;
    for (const auto& spec : specs_) {
      const auto bytes = static_cast<std::uint64_t>(spec.numel()) * at::elementSize(spec.dtype);
      header += (first ? "" : ", ") + Json::quoted(spec.name) + ": {\"dtype\": \"" +
                safetensors_dtype(spec.dtype) + "\", \"shape\": [";
      for (std::size_t d = 0; d < spec.shape.size(); ++d) {
        header += (d ? ", " : "") + std::to_string(spec.shape[d]);
      }
      header += "], \"data_offsets\": [" + std::to_string(offset) + ", " +
                std::to_string(offset + bytes) + "]}";
      offset += bytes;
      first = false;
    }
    header += "}";
    header.append((8 - header.size() % 8) % 8, ' ');  // the data 8-byte aligned, as Python's
    unsigned char length[8];
    for (int i = 0; i < 8; ++i) {
      length[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(header.size()) >> (8 * i));
    }
    append(length, 8);
    append(header.data(), header.size());
  }

  /// The next tensor's value: the dtype and number of elements its spec declared.
  void write_next(const at::Tensor& value) {
    MIXPREC_CHECK(next_ < specs_.size(), "'", path_, "': more tensors than declared");
    const auto& spec = specs_[next_];
    MIXPREC_CHECK(value.scalar_type() == spec.dtype && value.numel() == spec.numel(), "'",
                  path_, "': tensor '", spec.name, "' was declared ", spec.dtype, " of ",
                  spec.numel(), " elements, its value is ", value.scalar_type(), " of ",
                  value.numel());
    const auto bytes = value.device().is_cpu() ? value.contiguous() : value.cpu().contiguous();
    append(bytes.data_ptr(), static_cast<std::size_t>(bytes.numel()) * bytes.element_size());
    ++next_;
  }

  std::size_t written() const noexcept { return next_; }

  /// Syncs the file and renames it into place; its size and checksum.
  FileDigest commit() {
    MIXPREC_CHECK(next_ == specs_.size(), "'", path_, "': ", next_, " of ", specs_.size(),
                  " tensors written");
    file_.commit();
    return {checksum_.length(), checksum_.value()};
  }

 private:
  void append(const void* data, std::size_t size) {
    checksum_.update(data, size);
    MIXPREC_CHECK(file_.write(data, size), "cannot write '", path_, "': ",
                  std::strerror(file_.error()));
  }

  std::string path_;
  std::vector<SafetensorsSpec> specs_;
  AtomicFile file_;
  Checksum checksum_;
  std::size_t next_ = 0;
};

// The __metadata__ strings of a safetensors file whose header index_safetensors has checked
// (an object of strings), in the header's order.
inline std::vector<std::pair<std::string, std::string>> safetensors_metadata(
    const ByteSource& source, const SafetensorsIndex& index) {
  const auto header = JsonParser::parse(source.read_string(8, index.data_start - 8),
                                        "safetensors: the header of '" + source.name() + "'");
  std::vector<std::pair<std::string, std::string>> result;
  for (const auto& [key, value] : header.members) {
    if (key != "__metadata__") continue;
    for (const auto& m : value.members) result.emplace_back(m.first, m.second.text);
  }
  return result;
}

/// A safetensors file read by ranges: its header parsed and checked once (a damaged or foreign
/// file is an Error naming it), then any elements of a tensor copied into the caller's memory.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path)
      : source_(std::make_unique<FileSource>(path)),
        header_(index_safetensors(*source_)),
        metadata_(safetensors_metadata(*source_, header_)) {
    for (std::size_t i = 0; i < header_.entries.size(); ++i) {
      index_.emplace(header_.entries[i].name, i);
    }
  }

  const std::string& path() const noexcept { return source_->name(); }
  const std::vector<SafetensorsEntry>& entries() const noexcept { return header_.entries; }

  /// The entry of tensor `name`, or null.
  const SafetensorsEntry* find(const std::string& name) const {
    const auto it = index_.find(name);
    return it == index_.end() ? nullptr : &header_.entries[it->second];
  }

  /// The __metadata__ value of `key`, or nullopt.
  std::optional<std::string> metadata(const std::string& key) const {
    for (const auto& [k, v] : metadata_) {
      if (k == key) return v;
    }
    return std::nullopt;
  }

  /// Elements [from, from + out.numel()) of `entry`'s tensor, flattened, into `out`: a
  /// contiguous CPU tensor of the entry's dtype.
  void read(const SafetensorsEntry& entry, std::int64_t from, const at::Tensor& out) const {
    const auto element = static_cast<std::uint64_t>(at::elementSize(entry.dtype));
    const auto count = static_cast<std::uint64_t>(out.numel());
    MIXPREC_CHECK(out.scalar_type() == entry.dtype && out.is_contiguous() && out.device().is_cpu() &&
                      from >= 0 &&
                      (static_cast<std::uint64_t>(from) + count) * element <= entry.end - entry.begin,
                  "'", path(), "': elements [", from, ", ", from + out.numel(), ") of tensor '",
                  entry.name, "' (", entry.dtype, ", ", (entry.end - entry.begin) / element,
                  " elements) cannot be read into a ", out.scalar_type(), " tensor");
    source_->read(header_.data_start + entry.begin + static_cast<std::uint64_t>(from) * element,
                  out.data_ptr(), count * element);
  }

 private:
  std::unique_ptr<FileSource> source_;
  SafetensorsIndex header_;
  std::vector<std::pair<std::string, std::string>> metadata_;
  std::unordered_map<std::string, std::size_t> index_;
};

}  // namespace mixprec::detail
