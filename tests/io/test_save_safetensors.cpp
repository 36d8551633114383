// save_safetensors (include/mixprec/io/save_safetensors.hpp): every dtype read back bit for bit
// by mixprec's reader and by Python's safetensors.torch.load_file (tests/io/
// safetensors_roundtrip.py, in the Python of MIXPREC_PYTHON), the same bytes as Python's
// save_file, a model's state_dict names, atomic and streamed writes, and the Errors.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <c10/util/intrusive_ptr.h>
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace test_save_safetensors {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

// Debian's python3 (torch 1.13, the system build's Python) has no safetensors.
constexpr bool kNoSafetensorsPython = TORCH_VERSION_MAJOR < 2;

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A tensor of random bytes in `dtype` (0/1 for bool), of shape [3, 5].
at::Tensor random_bits(at::ScalarType dtype) {
  const auto size = static_cast<std::int64_t>(at::elementSize(dtype));
  auto raw = torch::randint(0, 256, {3, 5 * size}, torch::kByte);
  if (dtype == at::kBool) raw = raw.remainder(2);
  return raw.view(dtype);
}

// Every dtype this LibTorch has that the format names, as random bits; views of one storage
// (a transpose, an offset slice, an expanded row), a 0-d and an empty tensor.
mp::StateDict every_dtype() {
  torch::manual_seed(11);
  mp::StateDict tensors;
  for (const auto& d : mp::detail::file_dtypes()) {
    if (d.type == c10::ScalarType::Undefined || d.safetensors.empty()) continue;
    tensors.insert("t_" + std::string(d.torch), random_bits(d.type));
  }
  const auto base = torch::randn({4, 6});
  tensors.insert("view.transposed", base.t());
  tensors.insert("view.slice", base.narrow(0, 1, 2).narrow(1, 2, 3));
  tensors.insert("view.expanded", base[0].expand({3, 6}));
  tensors.insert("scalar", torch::tensor(2.5, torch::kFloat64));
  tensors.insert("empty", torch::empty({0, 3}));
  tensors.insert("name with \"quotes\", a \\ and a tab\t", torch::ones({2}, torch::kInt16));
  return tensors;
}

void check_same(const mp::StateDict& read, const mp::StateDict& written) {
  REQUIRE(read.size() == written.size());
  for (const auto& item : written) {
    INFO(item.key());
    REQUIRE(read.contains(item.key()));
    CHECK(test::identical(read[item.key()], item.value()));
  }
}

struct TwoLayers : torch::nn::Module {
  TwoLayers() {
    embed = register_module("embed", torch::nn::Embedding(10, 4));
    norm = register_module("norm", torch::nn::BatchNorm1d(4));
    out = register_module("out", torch::nn::Linear(4, 10));
    out->weight = register_parameter("tied", embed->weight);  // one tensor, two names
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  torch::nn::Linear out{nullptr};
};

}  // namespace

TEST_CASE("save_safetensors: every dtype, views, 0-d and empty tensors read back bit for bit") {
  const auto tensors = every_dtype();
  const auto path = test::temp_path("save_every_dtype.safetensors");
  mp::save_safetensors(tensors, path);
  check_same(mp::read_safetensors(path), tensors);
  // The data starts 8-byte aligned, as Python's writer pads the header.
  const auto bytes = file_bytes(path);
  std::uint64_t header = 0;
  for (int b = 7; b >= 0; --b) header = header << 8 | static_cast<unsigned char>(bytes[b]);
  CHECK((8 + header) % 8 == 0);
  CHECK(bytes.substr(8, 30) == "{\"__metadata__\":{\"format\":\"pt\"");
}

TEST_CASE("save_safetensors: Python's load_file reads every tensor bit for bit, and save_file "
          "writes the same bytes; mixprec writes Python's file again byte for byte" *
          doctest::skip(kNoSafetensorsPython)) {
  const auto dir = test::temp_path("save_safetensors_python");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto tensors = every_dtype();
  // Python's save_file refuses tensors that share memory: one view of `base` here.
  tensors.erase("view.slice");
  tensors.erase("view.expanded");
  mp::save_safetensors(tensors, dir + "/mixprec.safetensors");
  const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + MIXPREC_SAFETENSORS_SCRIPT +
                       " " + dir;
  REQUIRE(std::system(command.c_str()) == 0);
  const auto mine = file_bytes(dir + "/mixprec.safetensors");
  const auto again = file_bytes(dir + "/python_again.safetensors");
  MESSAGE("mixprec's file " << mine.size() << " bytes, Python's save_file of what load_file "
          "read " << again.size() << " bytes");
  CHECK(mine == again);
  // Python's tensors in every dtype it has: read, then written again, the same bytes.
  const auto python = mp::read_safetensors(dir + "/python.safetensors");
  CHECK(python.size() >= 12);
  mp::save_safetensors(python, dir + "/mixprec_again.safetensors");
  CHECK(file_bytes(dir + "/mixprec_again.safetensors") == file_bytes(dir + "/python.safetensors"));
}

TEST_CASE("save_safetensors: a model under its state_dict names, a tied weight under both, "
          "loaded back by name") {
  torch::manual_seed(2);
  TwoLayers model;
  model.norm->forward(torch::randn({8, 4}));  // running statistics that are not the defaults
  const auto path = test::temp_path("save_model.safetensors");
  mp::save_safetensors(model, path, {{{"format", "pt"}, {"step", "7"}}});
  const auto read = mp::read_safetensors(path);
  std::vector<std::string> keys;
  for (const auto& item : read) keys.push_back(item.key());
  for (const auto& item : model.named_parameters()) {
    INFO(item.key());
    REQUIRE(read.contains(item.key()));
    CHECK(test::identical(read[item.key()], item.value()));
  }
  for (const auto& item : model.named_buffers()) {
    REQUIRE(read.contains(item.key()));
    CHECK(test::identical(read[item.key()], item.value()));
  }
  CHECK(read.size() == model.named_parameters().size() + model.named_buffers().size());
  CHECK(read.contains("tied"));
  CHECK(read.contains("embed.weight"));
  TwoLayers fresh;
  mp::load_weights(fresh, path);
  CHECK(test::identical(fresh.out->bias, model.out->bias));
  CHECK(test::identical(fresh.norm->running_var, model.norm->running_var));
}

TEST_CASE("save_safetensors: streamed, one tensor at a time; atomic: a failed write leaves the "
          "old file") {
  const auto path = test::temp_path("save_streamed.safetensors");
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  std::vector<Weak> made;
  std::int64_t alive_at_next = 0;
  std::vector<mp::detail::SafetensorsSlot> slots;
  for (int i = 0; i < 4; ++i) {
    slots.push_back({"t" + std::to_string(i), at::kFloat, {256, 64}, [&made, &alive_at_next] {
                       for (const auto& w : made) alive_at_next += w.expired() ? 0 : 1;
                       auto t = torch::ones({64, 256}).t();  // each copied to be contiguous
                       made.emplace_back(t.getIntrusivePtr());
                       return t;
                     }});
  }
  mp::detail::write_safetensors(path, std::move(slots), {});
  CHECK(made.size() == 4);
  CHECK(alive_at_next == 0);  // each tensor and its copy gone before the next was made
  CHECK(mp::read_safetensors(path).size() == 4);

  // A write that fails half way (a tensor that cannot be made): the old file stays, no
  // temporary is left beside it.
  const auto before = file_bytes(path);
  std::vector<mp::detail::SafetensorsSlot> failing;
  failing.push_back({"a", at::kFloat, {2}, [] { return torch::zeros({2}); }});
  failing.push_back({"b", at::kFloat, {2}, []() -> at::Tensor { throw std::runtime_error("gone"); }});
  CHECK_THROWS_WITH(mp::detail::write_safetensors(path, std::move(failing), {}), "gone");
  CHECK(file_bytes(path) == before);
  std::size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(test::temp_path(""))) {
    files += entry.path().filename().string().rfind("save_streamed.safetensors", 0) == 0;
  }
  CHECK(files == 1);
}

TEST_CASE("save_safetensors: what the format cannot hold is an Error before the file is "
          "touched") {
  const auto path = test::temp_path("save_refused.safetensors");
  mp::save_safetensors(mp::StateDict({{"kept", torch::ones({2})}}), path);
  const auto before = file_bytes(path);
  const auto refused = [&](const mp::StateDict& tensors, const std::string& message,
                           const mp::SafetensorsOptions& options = {}) {
    CHECK_THROWS_WITH_AS(mp::save_safetensors(tensors, path, options),
                         doctest::Contains(message.c_str()), mp::Error);
    CHECK(file_bytes(path) == before);
  };
  refused(mp::StateDict({{"ok", torch::ones({2})}, {"c", torch::ones({2}, torch::kComplexDouble)}}),
          "tensor 'c' is ComplexDouble, for which the safetensors format has no name");
  refused(mp::StateDict({{"s", torch::eye(3).to_sparse()}}), "tensor 's' is not a dense tensor");
  refused(mp::StateDict({{"ok", torch::ones({2})}}), "the metadata names 'a' twice",
          {{{"a", "1"}, {"a", "2"}}});
}

}  // namespace test_save_safetensors
