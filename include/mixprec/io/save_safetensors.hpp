#pragma once
/// Writes the safetensors format (Hugging Face's), for Python's safetensors.torch.load_file,
/// transformers' from_pretrained and PEFT: a model's or a StateDict's tensors under their names,
/// in any dtype LibTorch has that the format names (bool, int8-int64, uint8-uint64, fp16, bf16,
/// fp32, fp64, complex64, the fp8 and fp4 formats). The file is written atomically (a temporary
/// beside it, fsync, rename: a crash leaves the old file or the new one) and streamed tensor by
/// tensor: a tensor that is not contiguous, or not on the CPU, is copied on its own and let go
/// before the next, never the whole model at once.
///
///   mixprec::save_safetensors(*model, "model.safetensors");   // state_dict names, metadata pt
///   // Python: safetensors.torch.load_file("model.safetensors") has every tensor, bit for bit
///
/// The layout is safetensors.torch.save_file's, byte for byte where the metadata has at most one
/// entry (Python orders a larger one at random): the header's tensors sorted by dtype as the
/// format's writer sorts them, then by name; the header padded with spaces to 8 bytes.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/held_shards.hpp>
#include <mixprec/io/atomic_file.hpp>
#include <mixprec/io/safetensors.hpp>
#include <mixprec/io/state_dict.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mixprec {

/// What save_safetensors writes beside the tensors.
struct SafetensorsOptions {
  /// The header's "__metadata__" (strings only, in this order); none when empty. The default is
  /// what transformers' and PEFT's save_pretrained write, and what from_pretrained looks for.
  std::vector<std::pair<std::string, std::string>> metadata{{"format", "pt"}};
};

namespace detail {

/// One tensor of a file being written: what the header says of it, and how to get its values
/// when its turn comes (a model's parameter itself; a merged weight computed then).
struct SafetensorsSlot {
  std::string name;
  at::ScalarType dtype;
  std::vector<std::int64_t> shape;
  std::function<at::Tensor()> values;
};

// The format writer's order of dtypes (its Dtype enum; the header lists tensors from the last of
// these to the first, by name within one): Python writes exactly this order, measured with every
// dtype of safetensors 0.8.
inline int safetensors_dtype_rank(std::string_view code) {
  static constexpr std::string_view order[] = {
      "BOOL", "F4", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
      "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"};
  for (std::size_t i = 0; i < std::size(order); ++i) {
    if (order[i] == code) return static_cast<int>(i);
  }
  return -1;
}

/// The format's name of `dtype` ("BF16"), or an Error that names `tensor`.
inline std::string_view safetensors_code(at::ScalarType dtype, const std::string& tensor) {
  for (const auto& d : file_dtypes()) {
    if (d.type == dtype && !d.safetensors.empty()) return d.safetensors;
  }
  fail("save_safetensors: tensor '", tensor, "' is ", dtype, ", for which the safetensors "
       "format has no name (it has ", kSafetensorsDtypes, "): convert it first (complex128 as "
       "at::view_as_real, say), or leave it out");
}

// JSON text of a string as the format's writer (serde_json) escapes it: quote, backslash and
// control characters; other bytes, UTF-8 included, as they are.
inline std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char code[8];
          std::snprintf(code, sizeof code, "\\u%04x", static_cast<unsigned>(c));
          out += code;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

/// The header's shape of a tensor: F4 counts fp4 values, two to a byte of LibTorch's
/// Float4_e2m1fn_x2, so its last size is doubled (as Python writes it).
inline std::vector<std::int64_t> safetensors_shape(const at::Tensor& t, std::string_view code) {
  std::vector<std::int64_t> shape(t.sizes().begin(), t.sizes().end());
  if (code == "F4" && !shape.empty()) shape.back() *= 2;
  return shape;
}

/// Writes `slots` to `path` atomically: the header first (from the slots, no tensor touched),
/// then each slot's values in the header's order, one tensor at a time. Each slot's values must
/// have the dtype and shape it announced.
inline void write_safetensors(const std::string& path, std::vector<SafetensorsSlot> slots,
                              const SafetensorsOptions& options) {
  std::vector<std::string_view> codes;
  for (const auto& slot : slots) codes.push_back(safetensors_code(slot.dtype, slot.name));
  std::vector<std::size_t> order(slots.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const auto ra = safetensors_dtype_rank(codes[a]), rb = safetensors_dtype_rank(codes[b]);
    return ra != rb ? ra > rb : slots[a].name < slots[b].name;
  });
  for (std::size_t k = 1; k < order.size(); ++k) {
    MIXPREC_CHECK(slots[order[k]].name != slots[order[k - 1]].name, "save_safetensors: two "
                  "tensors are named '", slots[order[k]].name, "': a file holds each name once");
  }
  std::string header = "{";
  if (!options.metadata.empty()) {
    header += "\"__metadata__\":{";
    for (std::size_t i = 0; i < options.metadata.size(); ++i) {
      const auto& [key, value] = options.metadata[i];
      for (std::size_t j = 0; j < i; ++j) {
        MIXPREC_CHECK(options.metadata[j].first != key, "save_safetensors: the metadata "
                      "names '", key, "' twice");
      }
      header += (i ? "," : "") + json_string(key) + ":" + json_string(value);
    }
    header += "}";
  }
  std::uint64_t offset = 0;
  std::vector<std::uint64_t> sizes(slots.size());
  for (const auto i : order) {
    const auto& slot = slots[i];
    std::uint64_t count = 1;
    for (const auto n : slot.shape) {
      MIXPREC_CHECK(n >= 0, "save_safetensors: tensor '", slot.name, "' has a negative size");
      count *= static_cast<std::uint64_t>(n);
    }
    // F4: two values a byte (its shape counts values); any other: the element's size.
    sizes[i] = codes[i] == "F4" ? count / 2 : count * at::elementSize(slot.dtype);
    header += (header.size() > 1 ? "," : "") + json_string(slot.name) + ":{\"dtype\":\"" +
              std::string(codes[i]) + "\",\"shape\":[";
    for (std::size_t d = 0; d < slot.shape.size(); ++d) {
      header += (d ? "," : "") + std::to_string(slot.shape[d]);
    }
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(offset + sizes[i]) + "]}";
    offset += sizes[i];
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  MIXPREC_CHECK(header.size() <= kSafetensorsMaxHeader, "save_safetensors: the header of '",
                path, "' would take ", header.size(), " bytes, more than the format's limit of ",
                kSafetensorsMaxHeader, " (names too long, or too many tensors): split the model "
                "into several files");

  AtomicFile file(path);
  unsigned char length[8];
  for (int b = 0; b < 8; ++b) length[b] = static_cast<unsigned char>(header.size() >> (8 * b));
  file.write(length, 8);
  file.write(header.data(), header.size());
  for (const auto i : order) {
    auto& slot = slots[i];
    auto t = slot.values();
    MIXPREC_CHECK(t.defined() && t.scalar_type() == slot.dtype &&
                      safetensors_shape(t, codes[i]) == slot.shape,
                  "save_safetensors: tensor '", slot.name, "' changed while the file was "
                  "written (its dtype or shape is not what the header says)");
    t = t.detach();
    if (!t.device().is_cpu()) t = t.to(at::kCPU);
    t = t.contiguous();
    if (sizes[i] > 0) file.write(t.data_ptr(), static_cast<std::size_t>(sizes[i]));
    slot.values = nullptr;  // the copy, if one was made, goes now
  }
  file.commit();
}

/// A slot for a tensor that exists: checked now (dense, strided, not a placeholder of a
/// parameter held in shards), its values read when its turn comes.
inline SafetensorsSlot tensor_slot(const std::string& name, const at::Tensor& t) {
  MIXPREC_CHECK(t.defined(), "save_safetensors: tensor '", name, "' is undefined");
  MIXPREC_CHECK(t.layout() == at::kStrided && !t.is_quantized(), "save_safetensors: tensor '",
                name, "' is not a dense tensor (", t.layout(), "): convert it first (to_dense(), "
                "dequantize())");
  MIXPREC_CHECK(!HeldShards::is_placeholder(t), "save_safetensors: parameter '", name, "' is "
                "held in shards across ranks (this rank has a piece of it): call "
                "mixprec::unshard(model) first, or save with the Trainer's checkpoint");
  MIXPREC_CHECK(t.device().type() != c10::DeviceType::Meta, "save_safetensors: tensor '", name,
                "' is on the meta device: it has no values to write");
  const auto code = safetensors_code(t.scalar_type(), name);
  return {name, t.scalar_type(), safetensors_shape(t, code), [t] { return t; }};
}

}  // namespace detail

/// Writes `tensors` to the safetensors file `path` under their names (see the top of this
/// header). Errors, before the file is touched: a dtype the format has no name for (complex128,
/// quantized types), a sparse tensor, a parameter held in shards.
inline void save_safetensors(const StateDict& tensors, const std::string& path,
                             const SafetensorsOptions& options = {}) {
  std::vector<detail::SafetensorsSlot> slots;
  for (const auto& item : tensors) slots.push_back(detail::tensor_slot(item.key(), item.value()));
  detail::write_safetensors(path, std::move(slots), options);
}

/// Writes the parameters and buffers of `model` under their state_dict names
/// ("encoder.layer.0.attention.self.query.weight"), as Python's
/// safetensors.torch.save_model(model) does. A tensor registered under two names (tied
/// weights) is written under each (Python's load_file reads both; save_model would keep one).
inline void save_safetensors(const torch::nn::Module& model, const std::string& path,
                             const SafetensorsOptions& options = {}) {
  std::vector<detail::SafetensorsSlot> slots;
  for (const auto& item : model.named_parameters()) {
    slots.push_back(detail::tensor_slot(item.key(), item.value()));
  }
  for (const auto& item : model.named_buffers()) {
    slots.push_back(detail::tensor_slot(item.key(), item.value()));
  }
  detail::write_safetensors(path, std::move(slots), options);
}

}  // namespace mixprec
