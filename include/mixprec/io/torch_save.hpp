#pragma once
/// Reads the files of Python's `torch.save(model.state_dict(), path)`: a zip archive (zip_archive
/// .hpp) of one pickle, data.pkl (unpickler.hpp), and one record per storage. The same format from
/// torch 1.6 to 2.x (torch 2.x adds byteorder and .format_version records, and pickles the dtypes
/// without a storage class of their own, fp8 and uint16-64, as bytes with _rebuild_tensor_v3).
/// Tensors are rebuilt as torch.load rebuilds them, views of shared storages included (tied
/// weights stay one storage); every offset, size and stride is checked against its storage
/// first. Ints beyond 64 bits read anywhere ({"seed": torch.seed(), "model": ...}); only a
/// size, stride, offset or storage length must fit an int64. Any other pickled object (a whole
/// nn.Module, argparse.Namespace, a tensor subclass) is an Error, as under
/// torch.load(weights_only=True).

#include <mixprec/core/error.hpp>
#include <mixprec/io/byte_source.hpp>
#include <mixprec/io/checkpoint_file.hpp>
#include <mixprec/io/state_dict.hpp>
#include <mixprec/io/unpickler.hpp>
#include <mixprec/io/zip_archive.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace mixprec {
namespace detail {

inline constexpr const char* kTorchSaveDtypes =
    "the floating, integer, bool and complex dtypes; fp8 from LibTorch 2.1, uint16-64 from 2.3";

// The objects of torch.save's pickle: its rebuild functions, storage classes and dtypes.
class TorchSaveObjects final : public PickleObjects {
 public:
  TorchSaveObjects(const ZipArchive& zip, std::string prefix, std::string source)
      : zip_(zip), prefix_(std::move(prefix)), source_(std::move(source)) {}

  PickleRef global(const std::string& module, const std::string& name) override {
    const auto full = module + "." + name;
    const bool known =
        full == "collections.OrderedDict" || full == "torch._utils._rebuild_tensor_v2" ||
        full == "torch._utils._rebuild_tensor_v3" || full == "torch._utils._rebuild_parameter" ||
        full == "torch._utils._rebuild_parameter_with_state" || untyped(full) ||
        (module == "torch" && (dtype_named(name, &FileDtype::storage) != at::ScalarType::Undefined ||
                               dtype_named(name, &FileDtype::torch) != at::ScalarType::Undefined));
    if (!known) {
      fail("'", source_, "' pickles '", full, "', which mixprec does not read: it reads state "
           "dicts (dicts of tensors, in dicts, lists and tuples of numbers and strings), as "
           "torch.load(weights_only=True) does. ",
           module == "torch" && name.size() > 7 && name.substr(name.size() - 7) == "Storage"
               ? "Its tensors' type is not supported (it reads " + std::string(kTorchSaveDtypes) + ")"
               : std::string("Save model.state_dict() rather than the model or other Python objects"));
    }
    auto v = PickleValue::make(PickleValue::Kind::global);
    v->text = full;
    return v;
  }

  PickleRef reduce(const PickleValue& callable, const PickleValue& args) override {
    const auto& f = callable.text;
    const auto& a = args.items;
    if (f == "collections.OrderedDict") {
      check(a.empty(), "OrderedDict() with arguments");
      return PickleValue::make(PickleValue::Kind::dict);
    }
    if (f == "torch._utils._rebuild_tensor_v2" || f == "torch._utils._rebuild_tensor_v3") {
      const bool v3 = f.back() == '3';
      const std::size_t n = v3 ? 7 : 6;
      check((a.size() == n || a.size() == n + 1) && a[0]->kind == PickleValue::Kind::storage,
            f + " with other arguments than torch.save writes");
      check(a.size() == n || empty_or_none(*a[n]), "a tensor with Python attributes (metadata)");
      check(a[4]->kind == PickleValue::Kind::boolean && empty_or_none(*a[5]),
            f + " with backward hooks or no requires_grad flag");
      at::ScalarType dtype = a[0]->dtype;
      if (v3) {
        check(a[6]->kind == PickleValue::Kind::global && a[6]->text.rfind("torch.", 0) == 0,
              "_rebuild_tensor_v3 without a dtype");
        dtype = dtype_named(a[6]->text.substr(6), &FileDtype::torch);
        check(dtype != at::ScalarType::Undefined, "_rebuild_tensor_v3 without a dtype");
      }
      check(dtype != at::ScalarType::Undefined, "_rebuild_tensor_v2 of an untyped storage");
      auto t = PickleValue::make(PickleValue::Kind::tensor);
      t->tensor = rebuild(*a[0], dtype, *a[1], *a[2], *a[3]);
      return t;
    }
    if (f == "torch._utils._rebuild_parameter" || f == "torch._utils._rebuild_parameter_with_state") {
      const std::size_t n = f.back() == 'e' ? 4 : 3;
      check(a.size() == n && a[0]->kind == PickleValue::Kind::tensor &&
                a[1]->kind == PickleValue::Kind::boolean && empty_or_none(*a[2]) &&
                (n == 3 || empty_or_none(*a[3])),
            f + " with other arguments than a plain nn.Parameter has");
      auto t = PickleValue::make(PickleValue::Kind::tensor);
      t->tensor = a[0]->tensor;
      return t;
    }
    fail("'", source_, "' calls '", f, "', which is a class or dtype and not a function: a "
         "damaged or foreign pickle");
  }

  void build(const PickleValue& object, const PickleValue& state) override {
    // An OrderedDict's attributes: state_dict()'s _metadata (module versions, versions_of).
    check(object.kind == PickleValue::Kind::dict && state.kind == PickleValue::Kind::dict,
          std::string("BUILD of ") + object.describe() + " with " + state.describe());
  }

  PickleRef persistent_load(const PickleValue& pid) override {
    const auto& p = pid.items;
    check(pid.kind == PickleValue::Kind::tuple && p.size() == 5 &&
              p[0]->kind == PickleValue::Kind::string && p[0]->text == "storage" &&
              p[1]->kind == PickleValue::Kind::global && p[2]->kind == PickleValue::Kind::string &&
              p[3]->kind == PickleValue::Kind::string &&
              (p[4]->kind == PickleValue::Kind::integer || p[4]->kind == PickleValue::Kind::big_integer),
          "a persistent id other than ('storage', type, key, location, size)");
    MIXPREC_CHECK(p[4]->kind == PickleValue::Kind::integer && p[4]->integer >= 0, "'", source_,
                  "': storage '", p[2]->text, "' has a size of ", p[4]->int_text(), " elements, "
                  "not an int in [0, 2^63): a damaged file");
    const auto& type = p[1]->text;
    const bool bytes = untyped(type);
    const auto dtype = bytes ? at::ScalarType::Undefined
                             : dtype_named(type.substr(type.rfind('.') + 1), &FileDtype::storage);
    check(bytes || dtype != at::ScalarType::Undefined, "a storage of type " + type);
    const auto& key = p[2]->text;
    const auto numel = static_cast<std::uint64_t>(p[4]->integer);
    const std::uint64_t element = bytes ? 1 : at::elementSize(dtype);
    const auto* record = zip_.find(prefix_ + "data/" + key);
    MIXPREC_CHECK(record != nullptr, "'", source_, "' lacks the record of storage '", key,
                  "' (", prefix_, "data/", key, "): a damaged file");
    MIXPREC_CHECK(numel <= record->size / element && numel * element == record->size, "'",
                  source_, "': storage '", key, "' holds ", numel, " elements of ", element,
                  " bytes, but its record has ", record->size, " bytes: a damaged file");
    auto& storage = storages_[key];
    if (!storage) {
      storage = PickleValue::make(PickleValue::Kind::storage);
      storage->dtype = dtype;
      storage->integer = static_cast<std::int64_t>(numel);
      storage->tensor = at::empty({static_cast<std::int64_t>(record->size)}, at::kByte);
      zip_.read(*record, storage->tensor.data_ptr());
      if (dtype == at::kBool) {
        check_bool_bytes(storage->tensor.data_ptr(), static_cast<std::size_t>(record->size),
                         "'" + source_ + "': storage '" + key + "'");
      }
    }
    MIXPREC_CHECK(storage->dtype == dtype && storage->integer == static_cast<std::int64_t>(numel),
                  "'", source_, "' names storage '", key, "' with two types or sizes: a "
                  "damaged file");
    return storage;
  }

 private:
  void check(bool ok, const std::string& what) const {
    MIXPREC_CHECK(ok, "'", source_, "' pickles ", what, ", which mixprec does not read (a "
                  "damaged file, or not a state dict)");
  }

  static bool untyped(const std::string& full) {
    return full == "torch.storage.UntypedStorage" || full == "torch.UntypedStorage";
  }
  static bool empty_or_none(const PickleValue& v) {
    return v.kind == PickleValue::Kind::none ||
           (v.kind == PickleValue::Kind::dict && v.entries.empty());
  }
  // The dtype of a name in one column of file_dtypes(); Undefined where none has it, an Error
  // where this LibTorch lacks it.
  at::ScalarType dtype_named(const std::string& name, std::string_view FileDtype::*column) const {
    for (const auto& d : file_dtypes()) {
      if (d.*column != name || name.empty()) continue;
      MIXPREC_CHECK(d.type != at::ScalarType::Undefined, "'", source_, "' holds tensors of ",
                    "torch.", d.torch, ", which need LibTorch >= ", d.since, " (this is ",
                    torch_version, ")");
      return d.type;
    }
    return at::ScalarType::Undefined;
  }

  static std::int64_t checked_int(const PickleValue& v, const char* what, const std::string& source) {
    const bool is_int = v.kind == PickleValue::Kind::integer || v.kind == PickleValue::Kind::big_integer;
    MIXPREC_CHECK(v.kind == PickleValue::Kind::integer && v.integer >= 0, "'", source, "': a "
                  "tensor's ", what, " is ", is_int ? v.int_text() : std::string(v.describe()),
                  ", not an int in [0, 2^63): a damaged file");
    return v.integer;
  }

  // storage[offset :] as a tensor of `sizes` and `strides` (in elements of dtype), once each
  // element it reaches is known to lie within the storage.
  at::Tensor rebuild(const PickleValue& storage, at::ScalarType dtype, const PickleValue& offset,
                     const PickleValue& sizes, const PickleValue& strides) const {
    MIXPREC_CHECK(sizes.kind == PickleValue::Kind::tuple && strides.kind == PickleValue::Kind::tuple &&
                      sizes.items.size() == strides.items.size() && sizes.items.size() <= 64,
                  "'", source_, "': a tensor's size and stride are not tuples of one length "
                  "(at most 64): a damaged file");
    if (dtype == at::kBool && storage.dtype != at::kBool) {
      check_bool_bytes(storage.tensor.data_ptr(), static_cast<std::size_t>(storage.tensor.numel()),
                       "'" + source_ + "': a storage read as bool");
    }
    const auto element = static_cast<std::int64_t>(at::elementSize(dtype));
    const std::int64_t elements = storage.tensor.numel() / element;
    const auto start = checked_int(offset, "storage offset", source_);
    std::vector<std::int64_t> size, stride;
    constexpr auto kMax = std::numeric_limits<std::int64_t>::max();
    // The element count as LibTorch's TensorImpl counts it (torch.load too): the sizes multiplied
    // in order in 64 unsigned bits, where an overflow counts even if a 0 comes after it
    // ([2^62, 4, 0] is refused, [2^62, 3, 0] and [0, 2^62, 2^62] read), and the count must fit
    // an int64. Refused here, it is an Error rather than LibTorch's c10::Error.
    std::uint64_t count = 1;
    bool overflow = false;
    for (std::size_t i = 0; i < sizes.items.size(); ++i) {
      size.push_back(checked_int(*sizes.items[i], "size", source_));
      stride.push_back(checked_int(*strides.items[i], "stride", source_));
      const auto n = static_cast<std::uint64_t>(size.back());
      if (n != 0 && count > std::numeric_limits<std::uint64_t>::max() / n) {
        overflow = true;  // not multiplied: that would wrap (UBSan's find)
      } else {
        count *= n;
      }
    }
    MIXPREC_CHECK(!overflow && count <= static_cast<std::uint64_t>(kMax), "'", source_, "': a "
                  "tensor of sizes ", at::IntArrayRef(size), " has more elements than LibTorch "
                  "counts (the sizes multiplied in order pass 64 bits, even before a 0): a damaged "
                  "file");
    const auto numel = static_cast<std::int64_t>(count);
    std::int64_t last = start;
    for (std::size_t i = 0; numel > 0 && i < size.size(); ++i) {
      const auto reach = size[i] - 1;
      MIXPREC_CHECK(stride[i] == 0 || reach <= (kMax - last) / stride[i], "'", source_,
                    "': a tensor reaches past any storage: a damaged file");
      last += reach * stride[i];
    }
    MIXPREC_CHECK(numel == 0 ? start <= elements : last < elements, "'", source_, "': a tensor ",
                  "of sizes ", at::IntArrayRef(size), ", strides ", at::IntArrayRef(stride),
                  " at offset ", start, " reaches past its storage of ", elements, " ",
                  c10::toString(dtype), " elements: a damaged file");
    auto t = at::empty({0}, at::TensorOptions(dtype));
    t.set_(storage.tensor.storage(), start, size, stride);
    return t;
  }

  const ZipArchive& zip_;
  std::string prefix_;  // "archive/": every record's directory
  std::string source_;
  std::map<std::string, PickleRef> storages_;
};

// The object a torch.save file holds.
inline PickleRef read_torch_save_object(const ByteSource& source) {
  const auto& name = source.name();
  const ZipArchive zip(source);
  const auto& records = zip.records();
  MIXPREC_CHECK(!records.empty() && records[0].name.find('/') != std::string::npos, "'", name,
                "' is a zip archive but not one of torch.save: its records are not in one folder");
  const auto prefix = records[0].name.substr(0, records[0].name.find('/') + 1);
  for (const auto& r : records) {
    MIXPREC_CHECK(r.name.rfind(prefix, 0) == 0, "'", name, "' is a zip archive but not one of "
                  "torch.save: its records are in folders '", prefix, "' and '", r.name, "'");
  }
  MIXPREC_CHECK(zip.find(prefix + "constants.pkl") == nullptr &&
                    zip.find(prefix + "code/__torch__.py") == nullptr,
                "'", name, "' is a TorchScript or LibTorch archive (torch.jit.save, torch::save), "
                "not a torch.save file: read it with torch::jit::load or torch::load");
  const auto* pickle = zip.find(prefix + "data.pkl");
  MIXPREC_CHECK(pickle != nullptr, "'", name, "' is a zip archive without ", prefix,
                "data.pkl: not a torch.save file");
  if (const auto* order = zip.find(prefix + "byteorder")) {
    const auto text = zip.read_string(*order);
    MIXPREC_CHECK(text == "little", "'", name, "' was written on a machine of byte order '",
                  text, "': mixprec reads little-endian files");
  }
  TorchSaveObjects objects(zip, prefix, name);
  return Unpickler::load(zip.read_string(*pickle), "the pickle of '" + name + "'", objects);
}

inline StateDict tensors_of(const PickleValue& dict, const std::string& source, const std::string& key) {
  StateDict result;
  std::vector<std::string> others, dicts;
  for (const auto& [k, v] : dict.entries) {
    const auto name = k->kind == PickleValue::Kind::string ? "'" + k->text + "'" : k->int_text();
    if (k->kind == PickleValue::Kind::string && v->kind == PickleValue::Kind::tensor) {
      result.insert(k->text, v->tensor);
      continue;
    }
    others.push_back(name + " (" + v->describe() + ")");
    if (v->kind == PickleValue::Kind::dict) dicts.push_back(name);
  }
  if (!others.empty()) {
    std::string list, nested;
    for (std::size_t i = 0; i < others.size() && i < 20; ++i) list += (i ? ", " : "") + others[i];
    if (others.size() > 20) list += " and " + std::to_string(others.size() - 20) + " more";
    for (std::size_t i = 0; i < dicts.size(); ++i) nested += (i ? ", " : "") + dicts[i];
    fail("'", source, "'", key.empty() ? "" : " under key '" + key + "'", " holds a dict with ",
         others.size(), " entries that are not tensors named by strings: ", list, ". A state "
         "dict maps names to tensors", dicts.empty() ? std::string(".") :
         std::string(": a checkpoint of several parts? Name the entry that holds the state dict "
                     "with LoadOptions().key(...) or read_torch_save(path, key); dicts here: ") + nested);
  }
  return result;
}

// The version each module saved its tensors at, from a state_dict()'s _metadata ({module path:
// {"version": n, ...}}, what Python's _load_from_state_dict reads): none for a plain dict, and
// none for a module it does not name or an entry without an int "version" (Python's None).
inline ModuleVersions versions_of(const PickleValue& dict) {
  ModuleVersions versions;
  const auto is = [](const PickleRef& v, PickleValue::Kind kind) { return v->kind == kind; };
  if (!dict.state) return versions;
  for (const auto& [attribute, metadata] : dict.state->entries) {
    if (!is(attribute, PickleValue::Kind::string) || attribute->text != "_metadata" ||
        !is(metadata, PickleValue::Kind::dict)) {
      continue;
    }
    for (const auto& [path, local] : metadata->entries) {
      if (!is(path, PickleValue::Kind::string) || !is(local, PickleValue::Kind::dict)) continue;
      for (const auto& [name, value] : local->entries) {
        if (is(name, PickleValue::Kind::string) && name->text == "version" &&
            is(value, PickleValue::Kind::integer)) {
          versions[path->text] = value->integer;
        }
      }
    }
  }
  return versions;
}

/// The state dict a torch.save file holds: the saved dict of tensors itself (state_dict()'s
/// OrderedDict, or a dict), the one under `key` of a saved dict ({"model": ..., "epoch": ...}),
/// or a list or tuple of (name, tensor) pairs (Trainer::save_fp32's WeightsFormat::pickle);
/// with its modules' versions where it is a state_dict() (the pairs have none).
inline WeightsFile state_dict_of(const PickleValue& root, const std::string& source,
                                 const std::string& key) {
  const PickleValue* value = &root;
  if (!key.empty()) {
    MIXPREC_CHECK(root.kind == PickleValue::Kind::dict, "'", source, "' holds ", root.describe(),
                  ", not a dict with the key '", key, "'");
    value = nullptr;
    std::string keys;
    for (const auto& [k, v] : root.entries) {
      if (k->kind == PickleValue::Kind::string && k->text == key) value = v.get();
      if (k->kind == PickleValue::Kind::string) keys += (keys.empty() ? "'" : ", '") + k->text + "'";
    }
    MIXPREC_CHECK(value != nullptr, "'", source, "' has no entry '", key, "'; its keys: ", keys);
  }
  if (value->kind == PickleValue::Kind::dict) return {tensors_of(*value, source, key), versions_of(*value)};
  if (value->kind == PickleValue::Kind::list || value->kind == PickleValue::Kind::tuple) {
    StateDict result;
    for (const auto& pair : value->items) {
      MIXPREC_CHECK(pair->kind == PickleValue::Kind::tuple && pair->items.size() == 2 &&
                        pair->items[0]->kind == PickleValue::Kind::string &&
                        pair->items[1]->kind == PickleValue::Kind::tensor,
                    "'", source, "' holds ", value->describe(), " with an item that is ",
                    pair->describe(), " and not a (name, tensor) pair: a state dict is a dict of "
                    "tensors or a sequence of (name, tensor) pairs");
      const auto& name = pair->items[0]->text;
      MIXPREC_CHECK(!result.contains(name), "'", source, "' names tensor '", name, "' twice");
      result.insert(name, pair->items[1]->tensor);
    }
    return {std::move(result), {}};
  }
  fail("'", source, "'", key.empty() ? "" : " under key '" + key + "'", " holds ",
       value->describe(), ", not a state dict (a dict of tensors by name)");
}

// Whether the bytes at the start of a file are those of a zip archive (torch.save's format).
inline bool looks_like_zip(const ByteSource& source) {
  if (source.size() < 4) return false;
  unsigned char magic[4];
  source.read(0, magic, 4);
  return load_le(magic, 4) == 0x04034b50;
}

// Files that are none of the readers' formats, with what to do instead; nothing if unknown.
inline void refuse_known_foreign(const ByteSource& source) {
  const auto& name = source.name();
  if (source.size() >= checkpoint_trailer_size) {
    char magic[8];
    source.read(source.size() - checkpoint_trailer_size, magic, 8);
    MIXPREC_CHECK(std::memcmp(magic, checkpoint_magic.data(), 8) != 0, "'", name, "' is a mixprec "
                  "checkpoint (Trainer::save): load it with Trainer::load; Trainer::fp32_state_dict() "
                  "or save_fp32() give its weights");
  }
  if (source.size() >= 2) {
    unsigned char start[2];
    source.read(0, start, 2);
    MIXPREC_CHECK(!(start[0] == 0x80 && start[1] <= 5), "'", name, "' is in the legacy format of "
                  "torch.save (torch < 1.6, or _use_new_zipfile_serialization=False), which mixprec "
                  "does not read: load it in Python and torch.save it again (the zip format)");
  }
}

inline WeightsFile read_torch_save(const ByteSource& source, const std::string& key) {
  // First: a Trainer checkpoint is a zip archive too (LibTorch's), with mixprec's trailer.
  refuse_known_foreign(source);
  if (!looks_like_zip(source)) {
    fail("'", source.name(), "' is not a torch.save file (a zip archive)");
  }
  const auto root = read_torch_save_object(source);
  return state_dict_of(*root, source.name(), key);
}

}  // namespace detail

/// The state dict of a torch.save file held in memory (see read_torch_save); `source` names it.
inline StateDict parse_torch_save(const void* bytes, std::size_t size, const std::string& source,
                                  const std::string& key = "") {
  return detail::read_torch_save(detail::MemorySource(bytes, size, source), key).tensors;
}

/// The state dict of Python's `torch.save(model.state_dict(), path)` (torch 1.6 to 2.x), tensors
/// in the file's order and dtypes, as torch.load gives them (on the CPU). `key`: the entry of a
/// saved dict that holds it, for `torch.save({"model": model.state_dict(), "epoch": 3}, path)`.
inline StateDict read_torch_save(const std::string& path, const std::string& key = "") {
  return detail::read_torch_save(detail::FileSource(path), key).tensors;
}

}  // namespace mixprec
