#pragma once
/// Reads the safetensors format (Hugging Face's): an 8-byte little-endian header length N, N
/// bytes of JSON mapping each tensor's name to {"dtype", "shape", "data_offsets": [begin, end]}
/// (and an optional "__metadata__" of strings), then the tensors' raw little-endian bytes,
/// offsets counted from the end of the header. The tensors tile the data: sorted by (begin,
/// end), each starts where the one before ends, so an empty tensor may share its offset with the
/// next (Python's safetensors.torch.save_file writes that). Everything is checked before a byte
/// of a tensor is read: a truncated, hostile or foreign file is a mixprec::Error that says what
/// is wrong, never a read out of bounds.

#include <mixprec/core/error.hpp>
#include <mixprec/io/byte_source.hpp>
#include <mixprec/io/json.hpp>
#include <mixprec/io/state_dict.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace mixprec {

static_assert(std::endian::native == std::endian::little,
              "mixprec: safetensors and torch.save files hold little-endian data, which the "
              "readers copy as it is");

namespace detail {

// The format's own limit (safetensors' MAX_HEADER_SIZE): a header length beyond it is damage.
inline constexpr std::uint64_t kSafetensorsMaxHeader = 100'000'000;

inline constexpr const char* kSafetensorsDtypes =
    "F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, C64, and from LibTorch 2.1 to 2.8 on "
    "F8_E4M3, F8_E5M2, F8_E4M3FNUZ, F8_E5M2FNUZ, U16, U32, U64, F8_E8M0, F4";

// A JSON number that is a whole number >= 0 no larger than `limit`, which `bound` names.
inline std::uint64_t safetensors_count(const Json& value, const std::string& tensor,
                                       const char* what, std::uint64_t limit, const char* bound) {
  std::uint64_t n = 0;
  MIXPREC_CHECK(value.unsigned_integer(n), "safetensors: tensor '", tensor, "' has a ", what,
                " that is not a non-negative integer: ", value.dump());
  MIXPREC_CHECK(n <= limit, "safetensors: tensor '", tensor, "' has a ", what, " of ", n,
                ", more than ", bound);
  return n;
}

// Names once in an object: Rust's serde, the format's own reader, refuses a repeated field, and
// a repeated tensor name would leave the first tensor's bytes unclaimed.
inline void check_unique_keys(const Json& object, const std::string& source, const char* tensor) {
  std::set<std::string> seen;
  for (const auto& [key, value] : object.members) {
    if (seen.insert(key).second) continue;
    if (tensor == nullptr) {
      fail("safetensors: '", source, "' names tensor '", key, "' twice: a file holds each "
           "tensor once");
    }
    fail("safetensors: the header of '", source, "' repeats '", key, "' in the entry of '",
         tensor, "'");
  }
}

// A shape with a 0 needs no byte, but its other sizes still have to be counted: Python refuses
// the shapes whose count overflows before the 0 comes (safetensors multiplies the sizes in
// order, in 64 bits: [2^62, 2^62, 0]) or whose contiguous strides overflow (torch computes
// stride i as the product of the later sizes, a 0 counted as 1, in an int64: [0, 2^62, 2^62]),
// and LibTorch's at::empty throws c10::Error on either. ([2^62, 0, 2^62] reads, as in Python.)
inline void check_empty_shape(const std::vector<std::int64_t>& shape, const std::string& name,
                              const std::string& source) {
  constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::uint64_t count = 1;
  for (const auto n : shape) {
    const auto size = static_cast<std::uint64_t>(n);
    MIXPREC_CHECK(size == 0 || count <= std::numeric_limits<std::uint64_t>::max() / size,
                  "safetensors: tensor '", name, "' of '", source, "' has shape ",
                  at::IntArrayRef(shape), ", whose sizes multiply past 64 bits before its 0 (the "
                  "format's own reader refuses it too): a damaged file");
    count *= size;
  }
  std::uint64_t stride = 1;
  for (std::size_t i = shape.size(); i-- > 1;) {
    const auto size = std::max<std::uint64_t>(static_cast<std::uint64_t>(shape[i]), 1);
    MIXPREC_CHECK(stride <= kMax / size, "safetensors: tensor '", name, "' of '", source,
                  "' has shape ", at::IntArrayRef(shape), ", whose strides (the products of the "
                  "later sizes) pass an int64: LibTorch cannot lay it out, even empty (nor can "
                  "Python's torch): a damaged file");
    stride *= size;
  }
}

struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin, end;
};

inline SafetensorsEntry safetensors_entry(const std::string& name, const Json& value,
                                          std::uint64_t data_size, const std::string& source) {
  MIXPREC_CHECK(value.is_object(), "safetensors: the entry of tensor '", name, "' of '", source,
                "' is not a JSON object");
  check_unique_keys(value, source, name.c_str());
  const auto* dtype = value.find("dtype");
  const auto* shape = value.find("shape");
  const auto* offsets = value.find("data_offsets");
  MIXPREC_CHECK(dtype && shape && offsets, "safetensors: tensor '", name, "' of '", source,
                "' lacks dtype, shape or data_offsets");
  MIXPREC_CHECK(dtype->is_string(), "safetensors: tensor '", name, "' has a dtype that is not a "
                "string");
  SafetensorsEntry entry{name,
                         file_dtype(dtype->text, &FileDtype::safetensors,
                                    "safetensors: tensor '" + name + "'", kSafetensorsDtypes),
                         {}, 0, 0};
  MIXPREC_CHECK(shape->is_array() && shape->items.size() <= 16, "safetensors: tensor '", name,
                "' has a shape that is not an array of at most 16 sizes");
  // Each size fits LibTorch's int64; the element count, unless a size is 0, is checked against
  // the data size as it grows: no overflow. ([0, 5] needs no byte, in a file of none.)
  const std::uint64_t element = at::elementSize(entry.dtype);
  for (const auto& dim : shape->items) {
    entry.shape.push_back(static_cast<std::int64_t>(safetensors_count(
        dim, name, "size", static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()),
        "a LibTorch size holds")));
  }
  if (dtype->text == "F4") {
    // Two fp4 values a byte of LibTorch's Float4_e2m1fn_x2: the header counts values.
    MIXPREC_CHECK(!entry.shape.empty() && entry.shape.back() % 2 == 0, "safetensors: tensor '",
                  name, "' of '", source, "' is F4 of shape ", shape->dump(), ", whose last "
                  "size is not even: fp4 values come two to a byte");
    entry.shape.back() /= 2;
  }
  std::uint64_t elements = 1;
  if (std::find(entry.shape.begin(), entry.shape.end(), 0) != entry.shape.end()) {
    check_empty_shape(entry.shape, name, source);
    elements = 0;
  }
  for (const auto n : entry.shape) {
    if (elements == 0) break;
    const auto count = static_cast<std::uint64_t>(n);
    MIXPREC_CHECK(elements <= data_size / element / count, "safetensors: tensor '", name,
                  "' of shape ", shape->dump(), " needs more bytes than '", source, "' holds");
    elements *= count;
  }
  MIXPREC_CHECK(offsets->is_array() && offsets->items.size() == 2, "safetensors: tensor '", name,
                "' has data_offsets that are not [begin, end]");
  entry.begin = safetensors_count(offsets->items[0], name, "data offset", data_size,
                                  "the file holds");
  entry.end = safetensors_count(offsets->items[1], name, "data offset", data_size,
                                "the file holds");
  MIXPREC_CHECK(entry.begin <= entry.end && entry.end - entry.begin == elements * element,
                "safetensors: tensor '", name, "' of '", source, "' has data_offsets [",
                entry.begin, ", ", entry.end, "] for ", elements, " elements of ", element,
                " bytes");
  return entry;
}

// The format's rule: sorted by (begin, end), the tensors tile the data, without gaps or
// overlaps; an empty tensor sorts before a non-empty one at its offset.
inline void check_tiling(std::vector<SafetensorsEntry> entries, std::uint64_t data_size,
                         const std::string& source) {
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  std::uint64_t next = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const auto& entry : entries) {
    // Sorted and tiled so far, only the tensor that ends at `next` can hold bytes past `begin`.
    MIXPREC_CHECK(entry.begin >= next, "safetensors: tensors '", previous->name, "' (bytes [",
                  previous->begin, ", ", previous->end, ")) and '", entry.name, "' (bytes [",
                  entry.begin, ", ", entry.end, ")) of '", source, "' overlap: each byte of the "
                  "data belongs to one tensor");
    MIXPREC_CHECK(entry.begin == next, "safetensors: bytes [", next, ", ", entry.begin,
                  ") of the data of '", source, "' belong to no tensor (a gap ",
                  previous != nullptr ? "after tensor '" + previous->name + "'"
                                      : std::string("at the start"),
                  ", before '", entry.name, "'): the tensors must tile the data");
    next = entry.end;
    previous = &entry;
  }
  MIXPREC_CHECK(next == data_size, "safetensors: '", source, "' has ", data_size - next,
                " bytes after its last tensor");
}

/// A safetensors file's tensors, checked, without their data (read_safetensors_entry reads
/// one): a model held in shards loads tensor by tensor.
struct SafetensorsIndex {
  std::vector<SafetensorsEntry> entries;  // in the header's order
  std::uint64_t data_start = 0;
};

inline SafetensorsIndex index_safetensors(const ByteSource& source) {
  const auto& name = source.name();
  MIXPREC_CHECK(source.size() >= 8, "safetensors: '", name, "' has ", source.size(), " bytes, "
                "fewer than the 8 of its header length: not a safetensors file, or truncated");
  unsigned char length[8];
  source.read(0, length, 8);
  const std::uint64_t header_size = load_le(length, 8);
  MIXPREC_CHECK(header_size <= source.size() - 8, "safetensors: '", name, "' announces a "
                "header of ", header_size, " bytes but has ", source.size() - 8, " after its "
                "length: truncated, or not a safetensors file");
  MIXPREC_CHECK(header_size <= kSafetensorsMaxHeader, "safetensors: '", name, "' announces a "
                "header of ", header_size, " bytes, more than the format's limit of ",
                kSafetensorsMaxHeader);
  const auto header = JsonParser::parse(source.read_string(8, header_size),
                                        "safetensors: the header of '" + name + "'");
  MIXPREC_CHECK(header.is_object(), "safetensors: the header of '", name,
                "' is not a JSON object");
  check_unique_keys(header, name, nullptr);
  SafetensorsIndex index;
  index.data_start = 8 + header_size;
  const std::uint64_t data_size = source.size() - index.data_start;
  for (const auto& [key, value] : header.members) {
    if (key == "__metadata__") {
      MIXPREC_CHECK(value.is_object() &&
                        std::all_of(value.members.begin(), value.members.end(),
                                    [](const auto& m) { return m.second.is_string(); }),
                    "safetensors: '", name, "' has a __metadata__ that is not an object of "
                    "strings");
      check_unique_keys(value, name, "__metadata__");
      continue;
    }
    index.entries.push_back(safetensors_entry(key, value, data_size, name));
  }
  check_tiling(index.entries, data_size, name);
  return index;
}

/// One tensor of an indexed safetensors file.
inline at::Tensor read_safetensors_entry(const ByteSource& source, const SafetensorsIndex& index,
                                         const SafetensorsEntry& entry) {
  auto t = at::empty(entry.shape, at::TensorOptions(entry.dtype));
  const auto bytes = entry.end - entry.begin;
  source.read(index.data_start + entry.begin, t.data_ptr(), bytes);
  if (entry.dtype == at::kBool) {
    check_bool_bytes(t.data_ptr(), static_cast<std::size_t>(bytes),
                     "safetensors: tensor '" + entry.name + "' of '" + source.name() + "'");
  }
  return t;
}

/// The tensors of the safetensors bytes of `source`, in the header's order.
inline StateDict read_safetensors(const ByteSource& source) {
  const auto index = index_safetensors(source);
  StateDict tensors;
  for (const auto& entry : index.entries) {
    tensors.insert(entry.name, read_safetensors_entry(source, index, entry));
  }
  return tensors;
}

}  // namespace detail

/// The tensors of a safetensors file held in memory, by name in the header's order; `source`
/// names it in errors.
inline StateDict parse_safetensors(const void* bytes, std::size_t size, const std::string& source) {
  return detail::read_safetensors(detail::MemorySource(bytes, size, source));
}

/// The tensors of the safetensors file at `path`, by name in the header's order.
inline StateDict read_safetensors(const std::string& path) {
  return detail::read_safetensors(detail::FileSource(path));
}

}  // namespace mixprec
