#pragma once
// Reads the safetensors format (Hugging Face's): an 8-byte little-endian header length N, N bytes
// of JSON mapping each tensor's name to {"dtype", "shape", "data_offsets": [begin, end]} (and an
// optional "__metadata__" of strings), then the tensors' raw little-endian bytes, offsets counted
// from the end of the header. The tensors tile the data: sorted by (begin, end), each starts where
// the one before ends, so an empty tensor may share its offset with the next (Python's
// safetensors.torch.save_file writes that). Everything is checked before a tensor is made: a
// truncated, hostile or foreign file is a mixprec::Error that says what is wrong, never a read out
// of bounds.

#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace encoder {

static_assert(std::endian::native == std::endian::little,
              "safetensors holds little-endian data: this reader copies it as is");

namespace detail {

inline at::ScalarType safetensors_dtype(const std::string& name, const std::string& tensor) {
  static const std::map<std::string, at::ScalarType> dtypes{
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  const auto it = dtypes.find(name);
  MIXPREC_CHECK(it != dtypes.end(), "safetensors: tensor '", tensor, "' has dtype '", name,
                "', which this reader does not know (F64, F32, F16, BF16, I64, I32, I16, I8, U8, "
                "BOOL)");
  return it->second;
}

// A JSON number that is a non-negative integer no larger than `limit`, which `bound` names.
inline std::uint64_t safetensors_count(const nlohmann::json& value, const std::string& tensor,
                                       const char* what, std::uint64_t limit, const char* bound) {
  MIXPREC_CHECK(value.is_number_unsigned() ||
                    (value.is_number_integer() && value.get<std::int64_t>() >= 0),
                "safetensors: tensor '", tensor, "' has a ", what, " that is not a non-negative "
                "integer: ", value.dump());
  const auto n = value.get<std::uint64_t>();
  MIXPREC_CHECK(n <= limit, "safetensors: tensor '", tensor, "' has a ", what, " of ", n,
                ", more than ", bound);
  return n;
}

// The header's JSON. nlohmann keeps the last of a repeated key without a word; the format's own
// reader (Rust's serde) rejects a repeated field, and a repeated tensor name would leave the first
// tensor's bytes unclaimed: each object's keys are checked here, as the parser meets them.
inline nlohmann::json safetensors_header(const std::uint8_t* begin, const std::uint8_t* end,
                                         const std::string& source) {
  std::vector<std::set<std::string>> keys;  // of each object open at this point
  std::string tensor, repeated, repeated_in;
  int repeated_depth = 0;
  const auto check = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) {
      keys.emplace_back();
    } else if (event == Event::object_end) {
      keys.pop_back();
    } else if (event == Event::key) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (depth == 1) tensor = key;
      if (!keys.back().insert(key).second && repeated.empty()) {
        repeated = key;
        repeated_in = tensor;
        repeated_depth = depth;
      }
    }
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(begin, end, check);
  } catch (const nlohmann::json::exception& e) {
    mixprec::detail::fail("safetensors: the header of '", source, "' is not valid JSON: ",
                          e.what());
  }
  MIXPREC_CHECK(repeated.empty() || repeated_depth != 1, "safetensors: '", source,
                "' names tensor '", repeated, "' twice: a file holds each tensor once");
  MIXPREC_CHECK(repeated.empty(), "safetensors: the header of '", source, "' repeats '",
                repeated, "' in the entry of '", repeated_in, "'");
  MIXPREC_CHECK(header.is_object(), "safetensors: the header of '", source,
                "' is not a JSON object");
  return header;
}

}  // namespace detail

/// The tensors of a safetensors file held in `bytes`, by name; `source` names it in errors.
inline std::map<std::string, at::Tensor> parse_safetensors(const std::uint8_t* bytes,
                                                           std::size_t size,
                                                           const std::string& source) {
  MIXPREC_CHECK(size >= 8, "safetensors: '", source, "' has ", size, " bytes, fewer than the "
                "8 of its header length: not a safetensors file, or truncated");
  std::uint64_t header_size = 0;
  std::memcpy(&header_size, bytes, 8);
  MIXPREC_CHECK(header_size <= size - 8, "safetensors: '", source, "' announces a header of ",
                header_size, " bytes but has ", size - 8, " after its length: truncated, or not "
                "a safetensors file");
  const auto header = detail::safetensors_header(bytes + 8, bytes + 8 + header_size, source);
  const std::uint64_t data_size = size - 8 - header_size;
  const std::uint8_t* data = bytes + 8 + header_size;
  struct Entry {
    std::string name;
    at::ScalarType dtype;
    std::vector<std::int64_t> shape;
    std::uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      MIXPREC_CHECK(value.is_object() && std::all_of(value.begin(), value.end(),
                                                     [](const auto& v) { return v.is_string(); }),
                    "safetensors: '", source, "' has a __metadata__ that is not an object of "
                    "strings");
      continue;
    }
    MIXPREC_CHECK(value.is_object() && value.contains("dtype") && value.contains("shape") &&
                      value.contains("data_offsets"),
                  "safetensors: tensor '", name, "' of '", source, "' lacks dtype, shape or "
                  "data_offsets");
    MIXPREC_CHECK(value["dtype"].is_string(), "safetensors: tensor '", name, "' has a dtype "
                  "that is not a string");
    Entry entry{name, detail::safetensors_dtype(value["dtype"].get<std::string>(), name), {}, 0, 0};
    MIXPREC_CHECK(value["shape"].is_array() && value["shape"].size() <= 16, "safetensors: "
                  "tensor '", name, "' has a shape that is not an array of at most 16 sizes");
    // Each size fits LibTorch's int64; the element count, unless a size is 0, is checked against
    // the data size as it grows: no overflow. ([0, 5] needs no byte, in a file of none.)
    const std::uint64_t element = at::elementSize(entry.dtype);
    for (const auto& dim : value["shape"]) {
      entry.shape.push_back(static_cast<std::int64_t>(detail::safetensors_count(
          dim, name, "size", static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()),
          "a LibTorch size holds")));
    }
    std::uint64_t elements = 1;
    if (std::find(entry.shape.begin(), entry.shape.end(), 0) != entry.shape.end()) {
      elements = 0;
    }
    for (const auto n : entry.shape) {
      if (elements == 0) break;
      const auto count = static_cast<std::uint64_t>(n);
      MIXPREC_CHECK(elements <= data_size / element / count, "safetensors: tensor '", name,
                    "' of shape ", value["shape"].dump(), " needs more bytes than '", source,
                    "' holds");
      elements *= count;
    }
    const auto& offsets = value["data_offsets"];
    MIXPREC_CHECK(offsets.is_array() && offsets.size() == 2, "safetensors: tensor '", name,
                  "' has data_offsets that are not [begin, end]");
    entry.begin = detail::safetensors_count(offsets[0], name, "data offset", data_size,
                                            "the file holds");
    entry.end = detail::safetensors_count(offsets[1], name, "data offset", data_size,
                                          "the file holds");
    MIXPREC_CHECK(entry.begin <= entry.end && entry.end - entry.begin == elements * element,
                  "safetensors: tensor '", name, "' of '", source, "' has data_offsets [",
                  entry.begin, ", ", entry.end, "] for ", elements, " elements of ", element,
                  " bytes");
    entries.push_back(std::move(entry));
  }
  // The format's rule: sorted by (begin, end), the tensors tile the data, without gaps or
  // overlaps; an empty tensor sorts before a non-empty one at its offset.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  std::uint64_t next = 0;
  const Entry* previous = nullptr;
  for (const auto& entry : entries) {
    // Sorted and tiled so far, only the tensor that ends at `next` can hold bytes past `begin`.
    MIXPREC_CHECK(entry.begin >= next, "safetensors: tensors '", previous->name, "' (bytes [",
                  previous->begin, ", ", previous->end, ")) and '", entry.name, "' (bytes [",
                  entry.begin, ", ", entry.end, ")) of '", source, "' overlap: each byte of the "
                  "data belongs to one tensor");
    MIXPREC_CHECK(entry.begin == next, "safetensors: bytes [", next, ", ", entry.begin,
                  ") of the data of '", source, "' belong to no tensor (a gap ",
                  previous != nullptr ? "after tensor '" + previous->name + "'" : std::string("at the start"),
                  ", before '", entry.name, "'): the tensors must tile the data");
    next = entry.end;
    previous = &entry;
  }
  MIXPREC_CHECK(next == data_size, "safetensors: '", source, "' has ", data_size - next,
                " bytes after its last tensor");
  std::map<std::string, at::Tensor> tensors;
  for (const auto& entry : entries) {
    auto t = at::empty(entry.shape, at::TensorOptions(entry.dtype));
    if (entry.end > entry.begin) std::memcpy(t.data_ptr(), data + entry.begin, entry.end - entry.begin);
    tensors.emplace(entry.name, std::move(t));
  }
  return tensors;
}

/// The tensors of the safetensors file at `path`, by name.
inline std::map<std::string, at::Tensor> read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  MIXPREC_CHECK(in, "safetensors: cannot open '", path, "'");
  const auto size = static_cast<std::size_t>(in.tellg());
  std::vector<std::uint8_t> bytes(size);
  in.seekg(0);
  MIXPREC_CHECK(in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size)),
                "safetensors: cannot read '", path, "'");
  return parse_safetensors(bytes.data(), bytes.size(), path);
}

}  // namespace encoder
