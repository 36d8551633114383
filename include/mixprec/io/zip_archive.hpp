#pragma once
// The zip container of torch.save files: records stored uncompressed (PyTorch's writer aligns
// each to 64 bytes), found through the central directory, zip64 where a file or offset needs
// it. Every offset and size is checked against the file before it is used, records may not
// overlap (what they hold adds up to no more than the file), and each record is checked against
// its CRC-32 as it is read (LibTorch's own reader checks none: a flipped bit in a weight would
// load as a wrong number).

#include <mixprec/core/error.hpp>
#include <mixprec/io/byte_source.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace mixprec::detail {

class ZipArchive {
 public:
  struct Record {
    std::string name;
    std::uint64_t header = 0;  // of its local header, in the file
    std::uint64_t offset = 0;  // of its data, in the file
    std::uint64_t size = 0;
    std::uint32_t crc = 0;
    std::uint16_t method = 0;  // 0: stored, which is all torch.save writes (and all this reads)
  };

  /// The records of the zip file `source`; an Error where it is no zip file, or a damaged one.
  explicit ZipArchive(const ByteSource& source) : source_(source) {
    const auto end = find_end_record();
    read_central_directory(end);
  }

  const std::vector<Record>& records() const noexcept { return records_; }

  /// The record named `name`; null if there is none.
  const Record* find(const std::string& name) const {
    const auto it = index_.find(name);
    return it == index_.end() ? nullptr : &records_[it->second];
  }

  /// Reads `record` into `out` (record.size bytes) and checks its CRC-32.
  void read(const Record& record, void* out) const {
    if (record.method != 0) {
      damaged("record '" + record.name + "' is compressed (method " + std::to_string(record.method) +
              "); torch.save stores its records as they are: was the file packed again by "
              "another tool?");
    }
    source_.read(record.offset, out, record.size);
    // PyTorch's writer leaves the CRC 0 when told not to compute it
    // (torch.serialization.config.save.compute_crc32 = False): nothing to check then.
    if (record.crc == 0 && record.size > 0) return;
    Crc32 crc;
    crc.update(out, static_cast<std::size_t>(record.size));
    MIXPREC_CHECK(crc.value() == record.crc, "'", source_.name(), "' is damaged: record '",
                  record.name, "' does not match its CRC-32 (", record.size, " bytes): use "
                  "another copy of the file");
  }

  std::string read_string(const Record& record) const {
    std::string text(static_cast<std::size_t>(record.size), '\0');
    read(record, text.data());
    return text;
  }

 private:
  static constexpr std::uint32_t kLocalHeader = 0x04034b50;
  static constexpr std::uint32_t kCentralHeader = 0x02014b50;
  static constexpr std::uint32_t kEnd = 0x06054b50;
  static constexpr std::uint32_t kEnd64Locator = 0x07064b50;
  static constexpr std::uint32_t kEnd64 = 0x06064b50;

  struct End {
    std::uint64_t entries = 0, directory_size = 0, directory_offset = 0;
  };

  [[noreturn]] void damaged(const std::string& what) const {
    fail("'", source_.name(), "' is not a readable zip archive (torch.save writes one): ", what);
  }

  // The end-of-central-directory record: the last 22 bytes, unless a comment (up to 64 KiB)
  // follows it; its zip64 twin where it says so.
  End find_end_record() const {
    const auto size = source_.size();
    if (size < 22) damaged("it is shorter than the 22 bytes of a zip's end record");
    const auto tail_size = std::min<std::uint64_t>(size, 22 + 65535);
    const auto tail = source_.read_string(size - tail_size, tail_size);
    const auto* t = reinterpret_cast<const unsigned char*>(tail.data());
    for (auto at = tail_size - 22 + 1; at-- > 0;) {
      const unsigned char* e = t + at;
      if (load_le(e, 4) != kEnd || at + 22 + load_le(e + 20, 2) != tail_size) continue;
      if (load_le(e + 4, 2) != 0 || load_le(e + 6, 2) != 0 ||
          load_le(e + 8, 2) != load_le(e + 10, 2)) {
        damaged("it spans several disks");
      }
      End end{load_le(e + 10, 2), load_le(e + 12, 4), load_le(e + 16, 4)};
      if (end.entries == 0xFFFF || end.directory_size == 0xFFFFFFFF ||
          end.directory_offset == 0xFFFFFFFF) {
        end = zip64_end(size - tail_size + at);
      }
      return end;
    }
    damaged("it has no end-of-central-directory record (truncated, or not a zip file)");
  }

  End zip64_end(std::uint64_t end_offset) const {
    if (end_offset < 20) damaged("its zip64 end locator is missing");
    unsigned char locator[20];
    source_.read(end_offset - 20, locator, 20);
    if (load_le(locator, 4) != kEnd64Locator) damaged("its zip64 end locator is missing");
    const auto offset = load_le(locator + 8, 8);
    unsigned char e[56];
    if (!source_.holds(offset, 56)) damaged("its zip64 end record lies past the end of the file");
    source_.read(offset, e, 56);
    if (load_le(e, 4) != kEnd64) damaged("its zip64 end record is missing");
    if (load_le(e + 16, 4) != 0 || load_le(e + 20, 4) != 0 || load_le(e + 24, 8) != load_le(e + 32, 8)) {
      damaged("it spans several disks");
    }
    return {load_le(e + 32, 8), load_le(e + 40, 8), load_le(e + 48, 8)};
  }

  void read_central_directory(const End& end) {
    if (!source_.holds(end.directory_offset, end.directory_size)) {
      damaged("its central directory lies past the end of the file");
    }
    // Each entry takes at least 46 bytes: a count the directory cannot hold is damage, found
    // before anything is reserved for it.
    if (end.entries > end.directory_size / 46) {
      damaged("its end record announces more entries than its central directory holds");
    }
    const auto directory = source_.read_string(end.directory_offset, end.directory_size);
    const auto* d = reinterpret_cast<const unsigned char*>(directory.data());
    std::uint64_t at = 0;
    records_.reserve(static_cast<std::size_t>(end.entries));
    for (std::uint64_t i = 0; i < end.entries; ++i) {
      if (end.directory_size - at < 46 || load_le(d + at, 4) != kCentralHeader) {
        damaged("entry " + std::to_string(i) + " of its central directory is damaged");
      }
      const unsigned char* h = d + at;
      const auto name_size = load_le(h + 28, 2), extra_size = load_le(h + 30, 2);
      const auto comment_size = load_le(h + 32, 2);
      if (end.directory_size - at - 46 < name_size + extra_size + comment_size) {
        damaged("entry " + std::to_string(i) + " of its central directory runs past it");
      }
      Record record;
      record.name.assign(reinterpret_cast<const char*>(h + 46), static_cast<std::size_t>(name_size));
      const auto flags = load_le(h + 8, 2), method = load_le(h + 10, 2);
      record.crc = static_cast<std::uint32_t>(load_le(h + 16, 4));
      std::uint64_t compressed = load_le(h + 20, 4), size = load_le(h + 24, 4);
      std::uint64_t local = load_le(h + 42, 4);
      zip64_fields(h + 46 + name_size, extra_size, size, compressed, local, record.name);
      if ((flags & 1U) != 0) damaged("record '" + record.name + "' is encrypted");
      if (method == 0 && compressed != size) {
        damaged("record '" + record.name + "' is stored with two sizes, " +
                std::to_string(compressed) + " and " + std::to_string(size));
      }
      record.method = static_cast<std::uint16_t>(method);
      record.size = method == 0 ? size : compressed;  // the bytes in the file
      record.header = local;
      record.offset = data_offset(local, record.name);
      if (!source_.holds(record.offset, size)) {
        damaged("record '" + record.name + "' runs past the end of the file");
      }
      if (!index_.emplace(record.name, records_.size()).second) {
        damaged("it holds two records named '" + record.name + "'");
      }
      records_.push_back(std::move(record));
      at += 46 + name_size + extra_size + comment_size;
    }
    check_no_overlap(end.directory_offset);
  }

  // By their local headers' offsets, each record's data ends before the next record's header,
  // and the last before the central directory, as CPython's zipfile requires ("Overlapped
  // entries"). Records that overlap (a "quoted-overlap" zip bomb: each record's data holds the
  // records after it) hand the same bytes to many storages: a file of 0.5 MB read as 285 MB of
  // tensors. No zip writer makes them; torch.load reads them.
  void check_no_overlap(std::uint64_t directory_offset) const {
    std::vector<const Record*> order;
    order.reserve(records_.size());
    for (const auto& r : records_) order.push_back(&r);
    std::sort(order.begin(), order.end(), [](const Record* a, const Record* b) {
      return a->header < b->header;
    });
    for (std::size_t i = 0; i < order.size(); ++i) {
      const auto& r = *order[i];
      const bool last = i + 1 == order.size();
      const auto limit = last ? directory_offset : order[i + 1]->header;
      if (r.offset + r.size <= limit) continue;  // both within the file: no overflow
      damaged("record '" + r.name + "' (bytes [" + std::to_string(r.offset) + ", " +
              std::to_string(r.offset + r.size) + ")) runs into " +
              (last ? std::string("the central directory") : "record '" + order[i + 1]->name + "'") +
              " (at byte " + std::to_string(limit) + "): records overlap, which no zip writer "
              "makes and CPython's zipfile refuses (a zip bomb hands a small file's bytes to many "
              "tensors so); use another copy of the file");
    }
  }

  // The zip64 extra field (id 1) holds, in this order, the sizes and offset whose 32-bit fields
  // are 0xFFFFFFFF.
  void zip64_fields(const unsigned char* extra, std::uint64_t extra_size, std::uint64_t& size,
                    std::uint64_t& compressed, std::uint64_t& local, const std::string& name) const {
    if (size != 0xFFFFFFFF && compressed != 0xFFFFFFFF && local != 0xFFFFFFFF) return;
    for (std::uint64_t at = 0; at + 4 <= extra_size;) {
      const auto id = load_le(extra + at, 2), length = load_le(extra + at + 2, 2);
      if (at + 4 + length > extra_size) break;
      if (id == 1) {
        const unsigned char* f = extra + at + 4;
        std::uint64_t used = 0;
        for (auto* field : {&size, &compressed, &local}) {
          if (*field != 0xFFFFFFFF) continue;
          if (used + 8 > length) damaged("record '" + name + "' has a short zip64 field");
          *field = load_le(f + used, 8);
          used += 8;
        }
        return;
      }
      at += 4 + length;
    }
    damaged("record '" + name + "' lacks the zip64 field its sizes announce");
  }

  // Where a record's data starts: after its local header, whose name and extra field may differ
  // in length from the central directory's (PyTorch pads the local one to align the data).
  std::uint64_t data_offset(std::uint64_t local, const std::string& name) const {
    unsigned char h[30];
    if (!source_.holds(local, 30)) damaged("record '" + name + "' starts past the end of the file");
    source_.read(local, h, 30);
    if (load_le(h, 4) != kLocalHeader) damaged("record '" + name + "' has no local header");
    const auto name_size = load_le(h + 26, 2), extra_size = load_le(h + 28, 2);
    if (name_size != name.size() || source_.read_string(local + 30, name_size) != name) {
      damaged("record '" + name + "' has another name in its local header");
    }
    return local + 30 + name_size + extra_size;
  }

  const ByteSource& source_;
  std::vector<Record> records_;
  std::unordered_map<std::string, std::size_t> index_;
};

}  // namespace mixprec::detail
