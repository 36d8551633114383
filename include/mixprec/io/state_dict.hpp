#pragma once
/// mixprec::StateDict, what the weight readers return: tensors by name in the file's order, as
/// Python's `model.state_dict()` holds them. And the dtype names of Python's files.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <string_view>

namespace mixprec {

/// Tensors by name, in the order of the file: LibTorch's OrderedDict, as Module::named_parameters
/// returns (`for (const auto& item : dict) item.key(), item.value()`; `dict["fc.weight"]`).
using StateDict = torch::OrderedDict<std::string, at::Tensor>;

namespace detail {

// The version each module of a state dict was saved at, by module path ("" the root): Python's
// state_dict()._metadata, which a module's _load_from_state_dict reads (BatchNorm's version 2
// added num_batches_tracked). Only torch.save'd state_dict()s carry it.
using ModuleVersions = std::map<std::string, std::int64_t>;

// What a weights file holds: its tensors, and its modules' versions where it has them.
struct WeightsFile {
  StateDict tensors;
  ModuleVersions versions;
};

// The dtype that `name` means in one column of file_dtypes() (FileDtype::torch, ::safetensors
// or ::storage); an Error that names `what` where it is unknown, or this LibTorch lacks it.
template <class Column>
c10::ScalarType file_dtype(std::string_view name, Column column, const std::string& what,
                           const char* known) {
  for (const auto& d : file_dtypes()) {
    if (d.*column != name || name.empty()) continue;
    MIXPREC_CHECK(d.type != c10::ScalarType::Undefined, what, " has dtype ", name, ", which "
                  "needs LibTorch >= ", d.since, " (this is ", torch_version, ")");
    return d.type;
  }
  fail(what, " has dtype '", name, "', which mixprec does not read (", known, ")");
}

// The bytes of a bool tensor read from a file are 0 and 1: any other byte is no bool value in
// C++ (undefined behaviour where ATen reads it). Checked on the raw bytes, before ATen sees them.
inline void check_bool_bytes(const void* data, std::size_t size, const std::string& what) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < size; ++i) {
    MIXPREC_CHECK(bytes[i] <= 1, what, " is a bool tensor with the byte ",
                  static_cast<int>(bytes[i]), " at ", i, ", which is neither 0 nor 1: a damaged "
                  "file");
  }
}

}  // namespace detail
}  // namespace mixprec
