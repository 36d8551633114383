// The weight readers (include/mixprec/io/): torch.save and safetensors files that the Python of
// MIXPREC_PYTHON writes at test time (tests/io/weights.py: torch 2.x and safetensors for the
// wheel's build, Debian's torch 1.13 for the system build), read back value for value; and
// every malformed input a test can name (truncations, flipped bits, hand-made pickles and zip
// archives), each an Error that says what is wrong. tests/fuzz/ looks for the ones missing here.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace test_readers {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;
using namespace std::string_literals;  // "...\x00..."s keeps its NUL bytes
using mp::detail::Json;

namespace {

// Debian's python3 (torch 1.13, the system build's Python) has no safetensors.
constexpr bool kNoSafetensorsPython = TORCH_VERSION_MAJOR < 2;

// The files of `weights.py files`, written once per process: one Python run for this file.
const std::string& python_files() {
  static const std::string directory = [] {
    const auto dir = test::temp_path("weights_files");
    std::filesystem::remove_all(dir);
    const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + MIXPREC_WEIGHTS_SCRIPT +
                         " files " + dir;
    if (std::system(command.c_str()) != 0) throw std::runtime_error("failed: " + command);
    return dir;
  }();
  return directory;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

Json manifest() {
  return mp::detail::JsonParser::parse(read_bytes(python_files() + "/manifest.json"), "manifest");
}

// The tensor the manifest describes: dtype, shape, strides, offset and values as Python had them.
void check_tensor(const at::Tensor& t, const Json& spec) {
  const auto numbers = [](const Json& array) {
    std::vector<std::int64_t> out;
    for (const auto& item : array.items) out.push_back(std::stoll(item.text));
    return out;
  };
  at::ScalarType dtype = at::ScalarType::Undefined;
  for (const auto& d : mp::detail::file_dtypes()) {
    if (d.torch == spec.find("dtype")->text) dtype = d.type;
  }
  CHECK(t.scalar_type() == dtype);
  CHECK(t.sizes() == at::IntArrayRef(numbers(*spec.find("shape"))));
  CHECK(t.strides() == at::IntArrayRef(numbers(*spec.find("stride"))));
  CHECK(t.storage_offset() == std::stoll(spec.find("offset")->text));
  std::vector<double> values;
  for (const auto& v : spec.find("values")->items) values.push_back(std::stod(v.text));
  const auto real = t.is_complex() ? at::view_as_real(t) : t;
  CHECK(torch::equal(real.to(at::kDouble).reshape({-1}),
                     torch::tensor(values, at::kDouble).reshape({-1})));
}

// ---- hand-made files

std::string le(std::uint64_t v, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

struct ZipRecord {
  std::string name, data;
};

// A zip archive as torch.save writes one: each record stored, with its CRC-32.
std::string zip_of(const std::vector<ZipRecord>& records) {
  std::string out, directory;
  for (const auto& r : records) {
    mp::detail::Crc32 crc;
    crc.update(r.data.data(), r.data.size());
    const auto offset = out.size();
    const auto sizes = le(crc.value(), 4) + le(r.data.size(), 4) + le(r.data.size(), 4);
    out += le(0x04034b50, 4) + le(20, 2) + le(0, 2) + le(0, 2) + le(0, 4) + sizes +
           le(r.name.size(), 2) + le(0, 2) + r.name + r.data;
    directory += le(0x02014b50, 4) + le(20, 2) + le(20, 2) + le(0, 2) + le(0, 2) + le(0, 4) +
                 sizes + le(r.name.size(), 2) + le(0, 2) + le(0, 2) + le(0, 2) + le(0, 2) +
                 le(0, 4) + le(offset, 4) + r.name;
  }
  const auto start = out.size();
  out += directory + le(0x06054b50, 4) + le(0, 2) + le(0, 2) + le(records.size(), 2) +
         le(records.size(), 2) + le(directory.size(), 4) + le(start, 4) + le(0, 2);
  return out;
}

// Pickle pieces (protocol 2).
std::string str(const std::string& s) { return "X" + le(s.size(), 4) + s; }
std::string integer(std::int64_t v) { return "\x8a\x08" + le(static_cast<std::uint64_t>(v), 8); }
std::string global(const std::string& module, const std::string& name) {
  return "c" + module + "\n" + name + "\n";
}
std::string tuple(const std::vector<std::int64_t>& values) {
  std::string out = "(";
  for (const auto v : values) out += integer(v);
  return out + "t";
}
std::string storage(const std::string& type, const std::string& key, std::int64_t numel) {
  return "(" + str("storage") + global(type == "UntypedStorage" ? "torch.storage" : "torch", type) +
         str(key) + str("cpu") + integer(numel) + "tQ";
}
// torch._utils._rebuild_tensor_v2(storage, offset, sizes, strides, False, {})
std::string tensor(const std::string& storage_pickle, std::int64_t offset,
                   const std::vector<std::int64_t>& sizes, const std::vector<std::int64_t>& strides) {
  return global("torch._utils", "_rebuild_tensor_v2") + "(" + storage_pickle + integer(offset) +
         tuple(sizes) + tuple(strides) + "\x89}tR";
}
// A state dict of one float tensor 'w' over the 2-float storage '0': the baseline that each
// malformed case changes in one place.
std::string state_dict(const std::string& value) { return "\x80\x02}(" + str("w") + value + "u."; }
const std::string kFloats = le(0x3fc00000, 4) + le(0xc0000000, 4);  // 1.5, -2
const std::string kGoodTensor = tensor(storage("FloatStorage", "0", 2), 0, {2}, {1});

std::string torch_save_file(const std::string& pickle, const std::string& data = kFloats) {
  return zip_of({{"archive/data.pkl", pickle}, {"archive/data/0", data}, {"archive/version", "3\n"}});
}

// LONG1 of the little-endian two's-complement `bytes` (as Python pickles an int beyond 32 bits).
std::string long1(const std::string& bytes) { return "\x8a" + le(bytes.size(), 1) + bytes; }
// LONG4 likewise, for ints of 256 bytes and more.
std::string long4(const std::string& bytes) { return "\x8b" + le(bytes.size(), 4) + bytes; }

// A "quoted-overlap" zip bomb (David Fifield's construction, stored): storages 0 to n-1, where
// the data of storage k is the local headers and data of storages k+1 to n-1, then `kernel`
// bytes; each CRC-32 right, each name in its local header. The pickle maps "s<k>" to storage k
// as uint8. The file holds the kernel once; its storages hold it n times.
std::string quoted_overlap(int n, std::size_t kernel) {
  const auto name = [](int k) { return "archive/data/" + std::to_string(k); };
  std::vector<std::string> blobs(static_cast<std::size_t>(n));
  std::string tail(kernel, '\x2a');
  std::vector<std::string> locals(static_cast<std::size_t>(n));
  for (int k = n - 1; k >= 0; --k) {
    blobs[static_cast<std::size_t>(k)] = tail;
    mp::detail::Crc32 crc;
    crc.update(tail.data(), tail.size());
    const auto sizes = le(crc.value(), 4) + le(tail.size(), 4) + le(tail.size(), 4);
    locals[static_cast<std::size_t>(k)] = le(0x04034b50, 4) + le(20, 2) + le(0, 2) + le(0, 2) +
                                          le(0, 4) + sizes + le(name(k).size(), 2) + le(0, 2) + name(k);
    tail = locals[static_cast<std::size_t>(k)] + tail;
  }
  std::string pickle = "\x80\x02}(";
  for (int k = 0; k < n; ++k) {
    const auto numel = static_cast<std::int64_t>(blobs[static_cast<std::size_t>(k)].size());
    pickle += str("s" + std::to_string(k)) +
              tensor(storage("ByteStorage", std::to_string(k), numel), 0, {numel}, {1});
  }
  pickle += "u.";
  // data.pkl and version first, as zip_of lays them out; then storage 0, which holds the rest.
  const auto file = zip_of({{"archive/data.pkl", pickle}, {"archive/version", "3\n"}});
  const auto end = file.size() - 22;  // the end record, without a comment
  const auto directory_at = static_cast<std::size_t>(
      mp::detail::load_le(reinterpret_cast<const unsigned char*>(file.data()) + end + 16, 4));
  std::string out = file.substr(0, directory_at);
  std::string directory = file.substr(directory_at, end - directory_at);
  std::uint64_t at = out.size();
  for (int k = 0; k < n; ++k) {
    const auto& blob = blobs[static_cast<std::size_t>(k)];
    mp::detail::Crc32 crc;
    crc.update(blob.data(), blob.size());
    directory += le(0x02014b50, 4) + le(20, 2) + le(20, 2) + le(0, 2) + le(0, 2) + le(0, 4) +
                 le(crc.value(), 4) + le(blob.size(), 4) + le(blob.size(), 4) + le(name(k).size(), 2) +
                 le(0, 2) + le(0, 2) + le(0, 2) + le(0, 2) + le(0, 4) + le(at, 4) + name(k);
    at += locals[static_cast<std::size_t>(k)].size();
  }
  out += locals[0] + blobs[0];
  const auto records = static_cast<std::uint64_t>(n) + 2;
  return out + directory + le(0x06054b50, 4) + le(0, 2) + le(0, 2) + le(records, 2) + le(records, 2) +
         le(directory.size(), 4) + le(out.size(), 4) + le(0, 2);
}

mp::StateDict parse(const std::string& bytes) {
  return mp::parse_torch_save(bytes.data(), bytes.size(), "test.pt");
}

std::string safetensors_bytes(const std::string& header, const std::string& data) {
  return le(header.size(), 8) + header + data;
}

std::string float_bytes(const std::vector<float>& values) {
  std::string bytes(values.size() * 4, '\0');
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

mp::StateDict parse_st(const std::string& bytes) {
  return mp::parse_safetensors(bytes.data(), bytes.size(), "test.safetensors");
}

struct Case {
  std::string input;
  std::string message;
};

// The message of the mixprec::Error that `f` throws; empty if it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const mp::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("torch.save: Python's files read back value for value: every dtype, views of shared "
          "storages, an OrderedDict, Parameters, protocol 4, a checkpoint's entry, pairs, zip64, no CRCs") {
  const auto files = manifest();
  std::size_t read = 0, tensors = 0;
  for (const auto& [file, expected] : files.members) {
    if (file.size() < 3 || file.substr(file.size() - 3) != ".pt" || expected.find("error")) continue;
    CAPTURE(file);
    const auto* key = expected.find("key");
    mp::StateDict dict;
    REQUIRE_NOTHROW(dict = mp::read_torch_save(python_files() + "/" + file, key ? key->text : ""));
    CHECK(dict.size() == expected.members.size() - (key ? 1 : 0));
    std::size_t i = 0;
    for (const auto& [name, spec] : expected.members) {
      if (name == "key") continue;
      CAPTURE(name);
      REQUIRE(dict.contains(name));
      CHECK(dict[i].key() == name);  // in the file's order
      check_tensor(dict[name], spec);
      ++i, ++tensors;
    }
    if (file == "views.pt") {  // one storage, as torch.load shares it
      CHECK(dict["tied"].is_same(dict["whole"]));
      CHECK(dict["column"].storage().data() == dict["whole"].storage().data());
      CHECK(dict["slice"].storage().data() == dict["whole"].storage().data());
    }
    ++read;
  }
  MESSAGE(read, " torch.save files of Python's torch: ", tensors, " tensors read as written");
  CHECK(read >= 9);
}

TEST_CASE("torch.save: the same state dict written by torch 1.13 and 2.13 reads alike, whichever LibTorch reads it") {
  // tests/fuzz/regressions/torch_save: Sequential(Linear(2, 2), BatchNorm1d(2)) saved by each
  // torch, as a state dict, with keep_vars=True and inside a checkpoint dict. 1.13 pickles typed
  // storages (FloatStorage, LongStorage); 2.13 adds .format_version, .storage_alignment and
  // byteorder records; each names its records' folder after the file. The checkpoint's state
  // dict holds a bf16, transposed 0.weight and one more tensor, "view", a view of 0.bias.
  const auto dir = std::filesystem::path(MIXPREC_WEIGHTS_SCRIPT).parent_path().parent_path() /
                   "fuzz" / "regressions" / "torch_save";
  for (const std::string kind : {"state_dict", "parameters", "checkpoint"}) {
    CAPTURE(kind);
    const std::string key = kind == "checkpoint" ? "model" : "";
    const auto old = mp::read_torch_save((dir / ("torch113_" + kind + ".pt")).string(), key);
    const auto now = mp::read_torch_save((dir / ("torch213_" + kind + ".pt")).string(), key);
    REQUIRE(old.size() == (kind == "checkpoint" ? 8U : 7U));  // the checkpoint adds a view
    REQUIRE(now.size() == old.size());
    for (std::size_t i = 0; i < old.size(); ++i) {
      CAPTURE(old[i].key());
      CHECK(now[i].key() == old[i].key());
      CHECK(test::identical(now[i].value(), old[i].value()));
    }
    CHECK(old["1.num_batches_tracked"].scalar_type() == at::kLong);
    if (kind == "checkpoint") {  // "view" is 0.bias[1:], one storage in either file
      for (const auto* dict : {&old, &now}) {
        CHECK((*dict)["view"].storage().data() == (*dict)["0.bias"].storage().data());
        CHECK((*dict)["view"].storage_offset() == 1);
      }
    }
    torch::nn::Sequential model(torch::nn::Linear(2, 2), torch::nn::BatchNorm1d(2));
    const auto report = mp::load_state_dict(*model, old, mp::LoadOptions().strict(false));
    CHECK(report.missing_keys.empty());
    CHECK(test::identical(model->named_parameters()["0.weight"], now["0.weight"].to(at::kFloat)));
  }
}

TEST_CASE("torch.save: the files mixprec does not read are Errors that say why and what to do") {
  const auto files = manifest();
  std::size_t refused = 0;
  for (const auto& [file, expected] : files.members) {
    const auto* error = expected.find("error");
    if (!error) continue;
    CAPTURE(file);
    CHECK_THROWS_WITH_AS(mp::read_torch_save(python_files() + "/" + file),
                         doctest::Contains(error->text.c_str()), mp::Error);
    CHECK_THROWS_WITH_AS(mp::read_state_dict(python_files() + "/" + file),
                         doctest::Contains(error->text.c_str()), mp::Error);
    ++refused;
  }
  CHECK(refused == 5);
  CHECK_THROWS_WITH_AS(mp::read_torch_save(python_files() + "/checkpoint.pt"),
                       doctest::Contains("entries that are not tensors named by strings: 'model' "
                                         "(a dict), 'epoch' (an int)"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::read_torch_save(python_files() + "/checkpoint.pt", "weights"),
                       doctest::Contains("has no entry 'weights'; its keys: 'model', 'epoch'"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::read_torch_save(python_files() + "/checkpoint.pt", "optimizer"),
                       doctest::Contains("under key 'optimizer' holds a dict with 2 entries that are not tensors"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(mp::read_torch_save(python_files() + "/no_such_file.pt"),
                       doctest::Contains(("cannot read '" + python_files() + "/no_such_file.pt'").c_str()), mp::Error);
}

TEST_CASE("torch.save: every truncation of a file, and a flipped bit in any record it reads, are Errors") {
  const auto bytes = read_bytes(python_files() + "/module.pt");
  REQUIRE(bytes.size() > 1000);
  REQUIRE_NOTHROW(parse(bytes));
  for (std::size_t size = 0; size < bytes.size(); ++size) {
    CAPTURE(size);
    CHECK_THROWS_AS(parse(bytes.substr(0, size)), mp::Error);
  }
  // The CRC-32 of each record: a flipped bit in a weight, its shape or the pickle is found.
  const mp::detail::MemorySource source(bytes.data(), bytes.size(), "module.pt");
  const mp::detail::ZipArchive zip(source);
  std::size_t flipped = 0;
  for (const auto& record : zip.records()) {
    const auto name = record.name.substr(record.name.find('/') + 1);
    if (name != "data.pkl" && name != "byteorder" && name.rfind("data/", 0) != 0) continue;
    CAPTURE(record.name);
    auto damaged = bytes;
    damaged[record.offset + record.size / 2] ^= 0x04;
    CHECK_THROWS_WITH_AS(parse(damaged), doctest::Contains("does not match its CRC-32"), mp::Error);
    ++flipped;
  }
  CHECK(flipped == 8 + (TORCH_VERSION_MAJOR >= 2 ? 1 : 0));  // pickle, 7 storages, byteorder
}

TEST_CASE("torch.save: hand-made pickles: a valid one, and each malformed one an Error that says what") {
  const auto good = parse(torch_save_file(state_dict(kGoodTensor)));
  REQUIRE(good.size() == 1);
  CHECK(torch::equal(good["w"], torch::tensor({1.5F, -2.0F})));
  const auto deep = std::string(70, ']') + std::string(69, 'a');
  const std::vector<Case> cases{
      {"\x80\x02I1\n.", "opcode 0x49, which torch.save does not write"},
      {"\x80\x02}N.", "STOP with the stack unfinished"},
      {"\x80\x02}.junk", "bytes after STOP"},
      {"\x80\x02s.", "pops from an empty stack"},
      {"\x80\x02}u.", "needs a MARK that is not there"},
      {"\x80\x02h\x05.", "reads memo entry 5, never written"},
      {"\x80\x02]q\x00h\x00" "a."s, "a container is put inside itself"},
      {"\x80\x02]q\x00]h\x00" "a0Na."s, "APPEND changes a container already inside another"},
      {"\x80\x02" + deep + ".", "containers nest deeper than 64"},
      {"\x80\x02X\xff\xff\xff\x7f", "it ends inside an opcode's argument"},
      {"\x80\x02\x8a\x09" + std::string(9, '\x01') + ".", "holds an int beyond 64 bits, not a state dict"},
      {"\x80\x02}(" + str("a") + "N" + str("a") + "Nu.", "a dict gets the key 'a' twice"},
      {"\x80\x02}()Nu.", "a dict key that is a tuple"},
      {"\x80\x02\x85.", "a TUPLE of more items than the stack holds"},
      {"\x80\x09.", "pickle protocol 9"},
      {"\x80\x02" + global("os", "system") + ".", "pickles 'os.system', which mixprec does not read"},
      {"\x80\x02" + global("torch", "QInt8Storage") + ".", "Its tensors' type is not supported"},
      {"\x80\x02N)R.", "REDUCE of something other than a function and a tuple"},
      {"\x80\x02" + global("collections", "OrderedDict") + "(Nt" "R.", "OrderedDict() with arguments"},
      {"\x80\x02" + global("torch", "FloatStorage") + ")R.", "which is a class or dtype and not a function"},
      {state_dict(str("x") + "Q"), "a persistent id other than ('storage', type, key, location, size)"},
      {state_dict(tensor(storage("FloatStorage", "7", 2), 0, {2}, {1})), "lacks the record of storage '7' (archive/data/7)"},
      {state_dict(tensor(storage("FloatStorage", "0", 3), 0, {3}, {1})), "storage '0' holds 3 elements of 4 bytes, but its record has 8 bytes"},
      {state_dict(tensor(storage("FloatStorage", "0", 2), 0, {3}, {1})), "reaches past its storage of 2 Float elements"},
      {state_dict(tensor(storage("FloatStorage", "0", 2), 1, {2}, {1})), "of sizes [2], strides [1] at offset 1 reaches past"},
      {state_dict(tensor(storage("FloatStorage", "0", 2), 0, {2, 2}, {std::int64_t{1} << 62, std::int64_t{1} << 62})),
       "a tensor reaches past any storage"},
      {state_dict(tensor(storage("FloatStorage", "0", 2), 0, {std::int64_t{1} << 40, std::int64_t{1} << 40}, {0, 0})),
       "has more elements than LibTorch counts"},
      {state_dict(tensor(storage("FloatStorage", "0", 2), 0, {-1}, {1})), "a tensor's size is -1, not an int in [0, 2^63)"},
      {state_dict(tensor(storage("FloatStorage", "0", 2), 0, {2, 1}, {1})), "size and stride are not tuples of one length"},
      {state_dict(tensor(storage("UntypedStorage", "0", 8), 0, {2}, {1})), "_rebuild_tensor_v2 of an untyped storage"},
      {state_dict(global("torch._utils", "_rebuild_tensor_v2") + "(" + storage("FloatStorage", "0", 2) +
                  integer(0) + tuple({2}) + tuple({1}) + "\x89}(" + str("h") + "Nu" "tR"),
       "with backward hooks or no requires_grad flag"},
      {state_dict(kGoodTensor + "}b"), "BUILD of a tensor with a dict"},
      {"\x80\x02}(" + str("w") + kGoodTensor + str("v") +
           tensor(storage("IntStorage", "0", 2), 0, {2}, {1}) + "u.", "names storage '0' with two types or sizes"},
      {"\x80\x02(" + str("w") + kGoodTensor + "\x86" + str("x") + "\x86l.", "opcode 0x6c"},
      {"\x80\x02](" + str("w") + kGoodTensor + "\x86N" "e.", "with an item that is None and not a (name, tensor) pair"},
      {"\x80\x02" + kGoodTensor + ".", "holds a tensor, not a state dict"},
      {"\x80\x02}(" + str("w") + kGoodTensor + "K\x03" "Nu.", "3 (None)"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.input);
    CHECK_THROWS_WITH_AS(parse(torch_save_file(c.input)), doctest::Contains(c.message.c_str()), mp::Error);
  }
  // A bool storage holds the bytes 0 and 1 only: any other byte is no bool.
  const auto bools = state_dict(tensor(storage("BoolStorage", "0", 2), 0, {2}, {1}));
  CHECK(torch::equal(parse(torch_save_file(bools, std::string("\x01\x00", 2)))["w"],
                     torch::tensor({true, false})));
  CHECK_THROWS_WITH_AS(parse(torch_save_file(bools, std::string("\x01\x02", 2))),
                       doctest::Contains("the byte 2 at 1, which is neither 0 nor 1"), mp::Error);
}

TEST_CASE("torch.save: ints beyond 64 bits read anywhere, as torch.load(weights_only=True) reads them; a size, "
          "stride, offset or storage length beyond an int64 is an Error that says which") {
  // Python's file: {"seed": torch.initial_seed() after manual_seed(2**64 - 1), "model": a
  // state_dict(), 2**64, -2**70, 2**63, 2**63 - 1, {2**65: [2**100, -2**63 - 1]}}.
  const auto path = python_files() + "/big_ints.pt";
  mp::StateDict model;
  REQUIRE_NOTHROW(model = mp::read_torch_save(path, "model"));
  CHECK(model.size() == 7);  // Linear(3, 4) and BatchNorm1d(4)
  CHECK(torch::equal(model["fc.weight"], mp::read_torch_save(python_files() + "/module.pt")["fc.weight"]));
  CHECK_THROWS_WITH_AS(mp::read_torch_save(path),
                       doctest::Contains("'seed' (an int beyond 64 bits), 'model' (a dict), 'big' (an int "
                                         "beyond 64 bits), 'negative' (an int beyond 64 bits), 'edge' (an "
                                         "int beyond 64 bits), 'just_below' (an int), 'nested' (a dict)"),
                       mp::Error);

  // {"model": {"w": a tensor}, <key>: <value>}, read with key "model".
  const auto checkpoint = [](const std::string& key, const std::string& value) {
    return torch_save_file("\x80\x02}(" + str("model") + "}(" + str("w") + kGoodTensor + "u" + key + value + "u.");
  };
  const auto model_of = [](const std::string& file) {
    return mp::parse_torch_save(file.data(), file.size(), "test.pt", "model");
  };
  const std::vector<std::string> ints{
      long1("\xff\xff\xff\xff\xff\xff\xff\xff\x00"s),  // 2**64 - 1: torch.seed()'s largest
      long1("\x00\x00\x00\x00\x00\x00\x00\x80\x00"s),  // 2**63
      long1("\x00\x00\x00\x00\x00\x00\x00\x00\xc0"s),  // -2**70
      long1("\xff\xff\xff\xff\xff\xff\xff\x7f\xff"s),  // -2**63 - 1
      long1(""),                                            // 0
      long1(std::string(200, '\x11')),
      long4(std::string(299, '\0') + "\x01"),                 // 2**2392, 300 bytes
      long4(std::string(70000, '\x5a')),
  };
  for (const auto& value : ints) {
    CAPTURE(value.size());
    mp::StateDict read;
    REQUIRE_NOTHROW(read = model_of(checkpoint(str("seed"), value)));
    CHECK(torch::equal(read["w"], torch::tensor({1.5F, -2.0F})));
    CHECK_NOTHROW(model_of(checkpoint(value, "N")));  // as a key of the checkpoint
  }
  // Inside a list and a dict of the checkpoint: [2**95 + ..., "x", -...], {2**64: None, 2**65: None}.
  CHECK_NOTHROW(model_of(checkpoint(str("list"), "](" + long1(std::string(12, '\x07')) + str("x") +
                                                     long4(std::string(9, '\xee')) + "e")));
  CHECK_NOTHROW(model_of(checkpoint(str("dict"), "}(" + long1(std::string(8, '\0') + "\x01") + "N" +
                                                     long1(std::string(8, '\0') + "\x02") + "Nu")));
  // Python's values as the messages print them, where a dict of tensors holds one.
  const auto keys_of = [](const std::string& key) {
    return parse(torch_save_file("\x80\x02}(" + str("w") + kGoodTensor + key + "Nu."));
  };
  CHECK_THROWS_WITH_AS(keys_of(long1("\x00\x00\x00\x00\x00\x00\x00\x00\x01"s)),
                       doctest::Contains("18446744073709551616 (None)"), mp::Error);
  CHECK_THROWS_WITH_AS(keys_of(long1("\x00\x00\x00\x00\x00\x00\x00\x00\xc0"s)),
                       doctest::Contains("-1180591620717411303424 (None)"), mp::Error);
  CHECK_THROWS_WITH_AS(keys_of(long4(std::string(299, '\0') + "\x01")),
                       doctest::Contains("an int of 300 bytes (None)"), mp::Error);
  // One value, one key: the bytes a writer may add in front of a sign say nothing.
  CHECK_THROWS_WITH_AS(keys_of("K\x05" "N" + long1("\x05" + std::string(11, '\0'))),
                       doctest::Contains("a dict gets the key 5 twice"), mp::Error);
  CHECK_THROWS_WITH_AS(keys_of(long1(std::string(8, '\0') + "\x01") + "N" + long1(std::string(8, '\0') + "\x01\x00\x00"s)),
                       doctest::Contains("a dict gets the key 18446744073709551616 twice"), mp::Error);
  CHECK_THROWS_WITH_AS(keys_of("J\xff\xff\xff\xff" "N" + long1(std::string(10, '\xff'))),
                       doctest::Contains("a dict gets the key -1 twice"), mp::Error);

  // Where LibTorch needs an int64: a size, a stride, the offset, a storage's length.
  const auto two_to_64 = long1(std::string(8, '\0') + "\x01");
  const auto rebuild = [](const std::string& storage_pickle, const std::string& offset,
                          const std::string& sizes, const std::string& strides) {
    return state_dict(global("torch._utils", "_rebuild_tensor_v2") + "(" + storage_pickle + offset +
                      sizes + strides + "\x89}tR");
  };
  const auto good_storage = storage("FloatStorage", "0", 2);
  const std::vector<Case> cases{
      {rebuild(good_storage, integer(0), "(" + two_to_64 + "t", tuple({1})),
       "a tensor's size is 18446744073709551616, not an int in [0, 2^63)"},
      {rebuild(good_storage, integer(0), tuple({2}), "(" + long1("\x00\x00\x00\x00\x00\x00\x00\x80\x00"s) + "t"),
       "a tensor's stride is 9223372036854775808, not an int in [0, 2^63)"},
      {rebuild(good_storage, long1("\x00\x00\x00\x00\x00\x00\x00\x00\xc0"s), tuple({2}), tuple({1})),
       "a tensor's storage offset is -1180591620717411303424, not an int in [0, 2^63)"},
      {rebuild("(" + str("storage") + global("torch", "FloatStorage") + str("0") + str("cpu") + two_to_64 + "tQ",
               integer(0), tuple({2}), tuple({1})),
       "storage '0' has a size of 18446744073709551616 elements, not an int in [0, 2^63)"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.message);
    CHECK_THROWS_WITH_AS(parse(torch_save_file(c.input)), doctest::Contains(c.message.c_str()), mp::Error);
  }
}

TEST_CASE("torch.save: sizes that overflow beside a 0 read where torch.load reads them, else an Error") {
  const auto big = std::int64_t{1} << 62;
  const auto read = [&](const std::vector<std::int64_t>& sizes) {
    return parse(torch_save_file(state_dict(tensor(storage("FloatStorage", "0", 2), 0, sizes, {1, 1, 1}))))["w"];
  };
  // What torch.load (2.13) does with torch.save of empty(0).as_strided(sizes, (1, 1, 1)): it
  // reads these (an empty tensor keeps the file's strides) ...
  const std::vector<std::vector<std::int64_t>> readable{
      {0, big, big}, {big, 0, big}, {big, 3, 0}, {3, big, 0}, {std::numeric_limits<std::int64_t>::max(), 2, 0}};
  for (const auto& sizes : readable) {
    CAPTURE(at::IntArrayRef(sizes));
    at::Tensor t;
    REQUIRE_NOTHROW(t = read(sizes));
    CHECK(t.sizes() == at::IntArrayRef(sizes));
    CHECK(t.numel() == 0);
  }
  // ... and refuses these: "numel: integer multiplication overflow", the count past 2^64 before the 0.
  CHECK_THROWS_WITH_AS(read({big, big, 0}), doctest::Contains("a tensor of sizes [4611686018427387904, "
                                                              "4611686018427387904, 0] has more elements than LibTorch counts"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(read({big, 4, 0}), doctest::Contains("has more elements than LibTorch counts"), mp::Error);
}

TEST_CASE("torch.save: records that overlap (a quoted-overlap zip bomb) are an Error, as CPython's zipfile refuses them") {
  const auto bomb = quoted_overlap(100, 50000);
  // What the storages would hold: each record's size, as the central directory gives it.
  std::uint64_t claimed = 0;
  for (std::size_t i = 0, at = bomb.find("PK\x01\x02"); i < 102; ++i, at = bomb.find("PK\x01\x02", at + 1)) {
    claimed += mp::detail::load_le(reinterpret_cast<const unsigned char*>(bomb.data()) + at + 24, 4);
  }
  MESSAGE("a zip file of ", bomb.size(), " bytes whose records claim ", claimed, " bytes (",
          claimed / bomb.size(), "x)");
  CHECK(claimed > 40 * bomb.size());
  const auto refused = error_of([&] { parse(bomb); });
  CHECK(refused.find("'test.pt' is not a readable zip archive (torch.save writes one): record "
                     "'archive/data/0' (bytes [") != std::string::npos);
  CHECK(refused.find("runs into record 'archive/data/1'") != std::string::npos);
  CHECK(refused.find("records overlap, which no zip writer makes and CPython's zipfile refuses") != std::string::npos);
  // Two records, the first running into the second's local header; the last into the directory.
  auto two = torch_save_file(state_dict(kGoodTensor));
  const auto directory = two.find("PK\x01\x02");
  const auto into_next = [&](std::string file, std::size_t entry, std::uint32_t size) {
    auto at = file.find("PK\x01\x02");
    for (std::size_t i = 0; i < entry; ++i) at = file.find("PK\x01\x02", at + 1);
    file.replace(at + 20, 8, le(size, 4) + le(size, 4));
    return file;
  };
  const auto pickle_size = state_dict(kGoodTensor).size();
  const auto into_data = error_of([&] { parse(into_next(two, 0, static_cast<std::uint32_t>(pickle_size + 1))); });
  CHECK(into_data.find("record 'archive/data.pkl' (bytes [") != std::string::npos);
  CHECK(into_data.find("runs into record 'archive/data/0'") != std::string::npos);
  const auto last_at = two.rfind("archive/version\x33\x0a"s);  // the last record's local name, then its data
  REQUIRE(last_at != std::string::npos);
  const auto into_directory = error_of([&] {
    parse(into_next(two, 2, static_cast<std::uint32_t>(directory - (last_at + 15) + 1)));
  });
  CHECK(into_directory.find("record 'archive/version' (bytes [") != std::string::npos);
  CHECK(into_directory.find("runs into the central directory") != std::string::npos);
  REQUIRE_NOTHROW(parse(two));
}

TEST_CASE("torch.save: every dtype of _rebuild_tensor_v3 (bytes and a dtype) reads, or names the LibTorch it needs") {
  std::size_t read = 0, refused = 0;
  for (const auto& d : mp::detail::file_dtypes()) {
    CAPTURE(d.torch);
    const auto size = static_cast<std::int64_t>(d.type == at::ScalarType::Undefined ? 1 : at::elementSize(d.type));
    const auto pickle = state_dict(global("torch._utils", "_rebuild_tensor_v3") + "(" +
                                   storage("UntypedStorage", "0", 2 * size) + integer(0) +
                                   tuple({2}) + tuple({1}) + "\x89}" +
                                   global("torch", std::string(d.torch)) + "tR");
    const auto file = torch_save_file(pickle, std::string(static_cast<std::size_t>(2 * size), '\0'));
    if (d.type == at::ScalarType::Undefined) {
      CHECK_THROWS_WITH_AS(parse(file), doctest::Contains(("which need LibTorch >= " + std::string(d.since)).c_str()),
                           mp::Error);
      ++refused;
      continue;
    }
    const auto t = parse(file)["w"];
    CHECK(t.scalar_type() == d.type);
    CHECK(t.sizes() == at::IntArrayRef({2}));
    CHECK(test::bytes_of(t).eq(0).all().item<bool>());
    ++read;
  }
  MESSAGE(read, " dtypes read, ", refused, " refused with the LibTorch version they need (this is ",
          mp::torch_version, ")");
  CHECK(read >= 12);
}

TEST_CASE("torch.save: damaged or foreign zip archives are Errors that say what is wrong") {
  const auto file = torch_save_file(state_dict(kGoodTensor));
  REQUIRE_NOTHROW(parse(file));
  const auto with = [&](std::size_t at, const std::string& bytes) {
    auto damaged = file;
    damaged.replace(at, bytes.size(), bytes);
    return damaged;
  };
  const auto directory = file.find("PK\x01\x02");
  const auto end = file.rfind("PK\x05\x06");
  const std::vector<Case> cases{
      {zip_of({{"data.pkl", state_dict(kGoodTensor)}}), "its records are not in one folder"},
      {zip_of({{"a/data.pkl", state_dict(kGoodTensor)}, {"b/data/0", kFloats}}), "its records are in folders 'a/' and 'b/data/0'"},
      {zip_of({{"a/version", "3\n"}}), "without a/data.pkl: not a torch.save file"},
      {zip_of({{"a/data.pkl", "x"}, {"a/data.pkl", "y"}}), "it holds two records named 'a/data.pkl'"},
      {zip_of({{"a/data.pkl", state_dict(kGoodTensor)}, {"a/data/0", kFloats}, {"a/byteorder", "big"}}),
       "written on a machine of byte order 'big'"},
      {zip_of({{"a/data.pkl", "x"}, {"a/constants.pkl", "x"}}), "a TorchScript or LibTorch archive"},
      {with(30, "b"), "has another name in its local header"},
      {with(directory + 8, le(1, 2)), "is encrypted"},
      {with(directory + 10, le(8, 2)), "is compressed (method 8)"},
      {with(directory + 20, le(7, 4)), "is stored with two sizes, 7 and"},
      {with(directory + 20, le(0xFFFFFFFF, 4)), "lacks the zip64 field its sizes announce"},
      {with(directory + 42, le(5000, 4)), "starts past the end of the file"},
      {with(end + 8, le(900, 2) + le(900, 2)), "announces more entries than its central directory holds"},
      {with(end + 16, le(file.size(), 4)), "its central directory lies past the end of the file"},
      {with(end + 8, le(2, 2)), "it spans several disks"},
      {with(end, "PK\x05\x07"), "it has no end-of-central-directory record"},
      {file + "trailing", "it has no end-of-central-directory record"},
      {std::string("PK\x03\x04", 4), "shorter than the 22 bytes of a zip's end record"},
      {"not a zip file at all", "is not a torch.save file (a zip archive)"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.message);
    CHECK_THROWS_WITH_AS(parse(c.input), doctest::Contains(c.message.c_str()), mp::Error);
  }
}

TEST_CASE("read_state_dict: torch.save or safetensors by the contents; anything else an Error that says what it is") {
  const auto tmp = std::filesystem::path(MIXPREC_TEST_TMPDIR);
  const auto write = [&](const std::string& name, const std::string& bytes) {
    const auto path = (tmp / name).string();
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    return path;
  };
  const auto st = write("format.bin", safetensors_bytes(
      R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", kFloats));
  CHECK(torch::equal(mp::read_state_dict(st)["w"], torch::tensor({1.5F, -2.0F})));
  CHECK_THROWS_WITH_AS(mp::read_state_dict(st, "model"),
                       doctest::Contains("is a safetensors file, which holds one state dict"), mp::Error);
  const auto pt = write("format.weights", torch_save_file(state_dict(kGoodTensor)));
  CHECK(torch::equal(mp::read_state_dict(pt)["w"], torch::tensor({1.5F, -2.0F})));
  // The trailer of a Trainer checkpoint (io/checkpoint_file.hpp) after a LibTorch archive: a zip.
  const auto checkpoint = write("format.ckpt", torch_save_file(state_dict(kGoodTensor)) + "mixprec1" +
                                                   std::string(16, '\0'));
  for (const auto& read : {mp::read_state_dict, mp::read_torch_save}) {
    CHECK_THROWS_WITH_AS(read(checkpoint, ""),
                         doctest::Contains("is a mixprec checkpoint (Trainer::save): load it with Trainer::load"),
                         mp::Error);
  }
  CHECK_THROWS_WITH_AS(mp::read_state_dict(write("format.txt", "weights, but not really")),
                       doctest::Contains("neither a torch.save file (a zip archive) nor a safetensors file"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(mp::read_state_dict(tmp.string()), doctest::Contains("not a regular file"), mp::Error);
}

TEST_CASE("safetensors: a valid file, tensors of several dtypes tiling the data, in the header's order") {
  auto data = float_bytes({1.5F, -2.0F, 3.25F, 0.0F, 7.0F, 8.0F}) + le(42, 8) +
              le(static_cast<std::uint64_t>(-7), 8);
  const auto tensors = parse_st(safetensors_bytes(
      R"({"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},)"
      R"( "ids": {"dtype": "I64", "shape": [2], "data_offsets": [24, 40]}, "e": {"dtype": "F32", "shape": [0, 5], "data_offsets": [40, 40]},)"
      R"( "\u00e9\ud83d\ude00": {"dtype": "U8", "shape": [], "data_offsets": [40, 41]}})",
      data + "\x09"));
  REQUIRE(tensors.size() == 4);
  CHECK(tensors[0].key() == "w");
  CHECK(tensors[3].key() == "\xc3\xa9\xf0\x9f\x98\x80");  // é and an emoji, from \u escapes
  CHECK(torch::equal(tensors["w"], torch::tensor({1.5F, -2.0F, 3.25F, 0.0F, 7.0F, 8.0F}).view({2, 3})));
  CHECK(torch::equal(tensors["ids"], torch::tensor({42, -7}, torch::kLong)));
  CHECK(tensors["e"].sizes() == at::IntArrayRef({0, 5}));
  // Empty tensors need no bytes, whatever their other sizes, in a file of none.
  const auto empties = parse_st(safetensors_bytes(
      R"({"e": {"dtype": "F32", "shape": [0, 5], "data_offsets": [0, 0]}, "f": {"dtype": "I8", "shape": [7, 0], "data_offsets": [0, 0]}})",
      ""));
  REQUIRE(empties.size() == 2);
  CHECK(empties["f"].sizes() == at::IntArrayRef({7, 0}));
  // Empty shapes whose other sizes pass 2^64 read where Python's safetensors 0.8 and torch read
  // them (the test below compares every verdict with Python's, where it has safetensors).
  for (const auto* shape : {"[4611686018427387904, 0, 4611686018427387904]", "[9223372036854775807, 2, 0]",
                            "[0, 9223372036854775807]"}) {
    CAPTURE(shape);
    mp::StateDict huge;
    REQUIRE_NOTHROW(huge = parse_st(safetensors_bytes(R"({"h": {"dtype": "F32", "shape": )" + std::string(shape) +
                                                       R"(, "data_offsets": [0, 0]}})", "")));
    CHECK(huge["h"].numel() == 0);
    const std::string text(shape);
    CHECK(huge["h"].dim() == std::count(text.begin(), text.end(), ',') + 1);
  }
}

TEST_CASE("safetensors: truncated, hostile or foreign files are an Error that says what is wrong") {
  const auto data = float_bytes({1, 2, 3, 4});
  const std::string good = R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}})";
  const auto valid = safetensors_bytes(good, data);
  CHECK_NOTHROW(parse_st(valid));
  for (std::size_t size = 0; size < valid.size(); ++size) {  // every truncation
    CAPTURE(size);
    CHECK_THROWS_AS(parse_st(valid.substr(0, size)), mp::Error);
  }
  const std::vector<Case> cases{
      {"{not json", "is not valid JSON: an object key that is not a string at byte 1"},
      {R"({"a": 1,})", "is not valid JSON: an object key that is not a string at byte 8"},
      {R"({"a": [1 2]})", "a missing ',' or ']' in an array"},
      {R"({"a": "\x"})", "an unknown escape in a string"},
      {"{\"a\x01\": 1}", "a control character inside a string"},
      {"{\"\xff\": 1}", "a byte that is not UTF-8"},
      {"{\"\xc3\": 1}", "a UTF-8 sequence cut short"},
      {"{\"\xed\xa0\x80\": 1}", "a byte sequence that is not UTF-8"},
      {R"({"\ud800x": 1})", "a high surrogate without its low one"},
      {R"({"a": 01})", "a missing ',' or '}' in an object"},
      {R"({"a": 1.})", "a number without digits after '.'"},
      {R"({"a": tru})", "an unknown word"},
      {R"({} {})", "text after the JSON value"},
      {std::string(70, '[') + std::string(70, ']'), "nesting deeper than 64"},
      {"[1, 2]", "is not a JSON object"},
      {R"({"a": {"dtype": "F32", "shape": [2, 2]}})", "lacks dtype, shape or data_offsets"},
      {R"({"a": [1]})", "the entry of tensor 'a' of 'test.safetensors' is not a JSON object"},
      {R"({"a": {"dtype": "Q8", "shape": [2, 2], "data_offsets": [0, 16]}})", "dtype 'Q8'"},
      {R"({"a": {"dtype": "F32", "shape": [2, -2], "data_offsets": [0, 16]}})", "not a non-negative integer: -2"},
      {R"({"a": {"dtype": "F32", "shape": [2, 2.0], "data_offsets": [0, 16]}})", "not a non-negative integer: 2.0"},
      {R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 16]}})", "needs more bytes than 'test.safetensors' holds"},
      {R"({"a": {"dtype": "F32", "shape": [0, 9223372036854775808], "data_offsets": [0, 0]}})", "a size of 9223372036854775808, more than a LibTorch size holds"},
      {R"({"a": {"dtype": "F32", "shape": [0, 18446744073709551616], "data_offsets": [0, 0]}})", "not a non-negative integer: 18446744073709551616"},
      {R"({"a": {"dtype": "F32", "shape": [4611686018427387904, 4611686018427387904, 0], "data_offsets": [0, 0]}})",
       "has shape [4611686018427387904, 4611686018427387904, 0], whose sizes multiply past 64 bits before its 0"},
      {R"({"a": {"dtype": "F32", "shape": [0, 4611686018427387904, 4611686018427387904], "data_offsets": [0, 0]}})",
       "has shape [0, 4611686018427387904, 4611686018427387904], whose strides (the products of the later sizes) pass an int64"},
      {R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})", "has data_offsets [0, 12] for 4 elements"},
      {R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [4, 20]}})", "more than the file holds"},
      {R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0]}})", "data_offsets that are not [begin, end]"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
       "tensors 'a' (bytes [0, 4)) and 'b' (bytes [0, 8))"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}, "c": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}})",
       "tensors 'a' (bytes [0, 8)) and 'b' (bytes [4, 12)) of 'test.safetensors' overlap"},
      {R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "e": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}})",
       "tensors 'a' (bytes [0, 16)) and 'e' (bytes [8, 8)) of 'test.safetensors' overlap"},
      {R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [4, 16]}})",
       "bytes [0, 4) of the data of 'test.safetensors' belong to no tensor (a gap at the start, before 'a')"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
       "bytes [4, 8) of the data of 'test.safetensors' belong to no tensor (a gap after tensor 'a', before 'b')"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", "8 bytes after its last tensor"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
       "'test.safetensors' names tensor 'a' twice"},
      {R"({"b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
       "names tensor 'b' twice"},
      {R"({"a": {"dtype": "F16", "shape": [4], "dtype": "F32", "data_offsets": [0, 16]}})",
       "repeats 'dtype' in the entry of 'a'"},
      {R"({"__metadata__": {"format": "pt", "step": 3}, "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
       "__metadata__ that is not an object of strings"},
      {R"({"__metadata__": {"f": "a", "f": "b"}, "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
       "repeats 'f' in the entry of '__metadata__'"},
      {R"({"a": {"dtype": 3, "shape": [2], "data_offsets": [0, 8]}})", "dtype that is not a string"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.input);
    CHECK_THROWS_WITH_AS(parse_st(safetensors_bytes(c.input, data)), doctest::Contains(c.message.c_str()),
                         mp::Error);
  }
  CHECK_THROWS_WITH_AS(parse_st(std::string(8, '\xff')), doctest::Contains("announces a header of"), mp::Error);
  CHECK_THROWS_WITH_AS(parse_st(le(200'000'000, 8) + std::string(200'000'000 / 1000, ' ')),
                       doctest::Contains("announces a header of 200000000 bytes but has"), mp::Error);
  CHECK_THROWS_WITH_AS(parse_st(le(100'000'001, 8) + std::string(100'000'001, ' ')),
                       doctest::Contains("more than the format's limit of 100000000"), mp::Error);
  const std::string bools = R"({"b": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}})";
  CHECK(torch::equal(parse_st(safetensors_bytes(bools, std::string("\x01\x00\x01", 3)))["b"],
                     torch::tensor({true, false, true})));
  CHECK_THROWS_WITH_AS(parse_st(safetensors_bytes(bools, std::string("\x01\x00\x07", 3))),
                       doctest::Contains("bool tensor with the byte 7 at 2"), mp::Error);
}

TEST_CASE("safetensors: shapes whose sizes overflow beside a 0 are refused where Python's safetensors and torch "
          "refuse them, and read where they read" * doctest::skip(kNoSafetensorsPython)) {
  const auto files = manifest();
  const auto* shapes = files.find("safetensors_shapes");
  REQUIRE(shapes != nullptr);
  std::size_t read = 0, refused = 0;
  for (const auto& item : shapes->items) {
    const auto shape = item.find("shape")->dump();
    const auto& python = item.find("python")->text;
    CAPTURE(shape);
    CAPTURE(python);
    const auto bytes = safetensors_bytes(R"({"t": {"dtype": "F32", "shape": )" + shape +
                                             R"(, "data_offsets": [0, 0]}})", "");
    if (python == "read") {
      mp::StateDict dict;
      REQUIRE_NOTHROW(dict = parse_st(bytes));
      CHECK(dict["t"].numel() == 0);
      std::vector<std::int64_t> sizes;
      for (const auto& n : item.find("shape")->items) sizes.push_back(std::stoll(n.text));
      CHECK(dict["t"].sizes() == at::IntArrayRef(sizes));
      ++read;
    } else {
      CHECK_THROWS_WITH_AS(parse_st(bytes), doctest::Contains("a damaged file"), mp::Error);
      ++refused;
    }
  }
  MESSAGE(read, " shapes read and ", refused, " refused, as Python's safetensors.torch.load does");
  CHECK(read >= 3);
  CHECK(refused >= 5);
}

TEST_CASE("safetensors: every dtype of the format reads, or names the LibTorch it needs") {
  std::size_t read = 0, refused = 0;
  for (const auto& d : mp::detail::file_dtypes()) {
    if (d.safetensors.empty()) continue;
    CAPTURE(d.safetensors);
    // Two values: F4 packs them into one byte (LibTorch's Float4_e2m1fn_x2, shape [1]).
    const bool f4 = std::string(d.safetensors) == "F4";
    const auto size = d.type == at::ScalarType::Undefined ? 1 : at::elementSize(d.type);
    const auto data = f4 ? size : 2 * size;
    const auto header = R"({"t": {"dtype": ")" + std::string(d.safetensors) +
                        R"(", "shape": [2], "data_offsets": [0, )" + std::to_string(data) + "]}}";
    const auto bytes = safetensors_bytes(header, std::string(data, '\0'));
    if (d.type == at::ScalarType::Undefined) {
      CHECK_THROWS_WITH_AS(parse_st(bytes), doctest::Contains(("needs LibTorch >= " + std::string(d.since)).c_str()),
                           mp::Error);
      ++refused;
      continue;
    }
    const auto t = parse_st(bytes)["t"];
    CHECK(t.scalar_type() == d.type);
    CHECK(t.numel() == (f4 ? 1 : 2));
    ++read;
  }
  MESSAGE(read, " safetensors dtypes read, ", refused, " refused with the LibTorch they need");
  // Every name kSafetensorsDtypes lists: 11, 7 from LibTorch 2.1, F8_E8M0 and F4 (2.7, 2.8).
  CHECK(read + refused == 20);
}

TEST_CASE("safetensors: the files of Python's safetensors.torch.save_file, empty tensors sharing offsets in any order" *
          doctest::skip(kNoSafetensorsPython)) {
  const auto files = manifest();
  std::size_t read = 0, tensors = 0, empty = 0;
  for (const auto& [file, expected] : files.members) {
    if (file.find(".safetensors") == std::string::npos) continue;
    CAPTURE(file);
    mp::StateDict dict;
    REQUIRE_NOTHROW(dict = mp::read_safetensors(python_files() + "/" + file));
    CHECK(dict.size() == expected.members.size());
    for (const auto& [name, spec] : expected.members) {
      CAPTURE(name);
      REQUIRE(dict.contains(name));
      check_tensor(dict[name], spec);
      ++tensors;
      empty += dict[name].numel() == 0 ? 1 : 0;
    }
    ++read;
  }
  MESSAGE(read, " files of Python's safetensors: ", tensors, " tensors (", empty, " empty) read as written");
  CHECK(read == 7);
}

}  // namespace test_readers
