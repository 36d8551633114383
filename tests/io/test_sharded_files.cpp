// The files of sharded checkpoints (include/mixprec/io/safetensors_stream.hpp, checkpoint_dir.hpp):
// safetensors written tensor by tensor and read back by ranges, a write that fails mid-file (a
// full disk, simulated with RLIMIT_FSIZE), the names of a save's files and the removal of
// other saves' files. The Trainer's sharded save and load: tests/distributed/.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <sys/resource.h>

#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace test_sharded_files {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;
namespace fs = std::filesystem;
using mp::detail::SafetensorsSpec;
using mp::detail::SafetensorsWriter;

namespace {

fs::path fresh(const std::string& name) {
  const fs::path dir = test::temp_path(name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_CASE("sharded files: safetensors written tensor by tensor read back whole and by ranges") {
  const auto dir = fresh("sharded_files_roundtrip");
  const auto path = (dir / "shard.safetensors").string();
  const auto a = torch::arange(12, torch::kFloat).reshape({3, 4}) / 3;
  const auto b = (torch::arange(7, torch::kFloat) * 1.5).to(torch::kBFloat16);
  const auto c = torch::tensor({std::int64_t{-3}, std::int64_t{1} << 40}, torch::kLong);
  const auto empty = torch::zeros({0}, torch::kFloat);
  SafetensorsWriter writer(path,
                           {{"a", at::kFloat, {3, 4}}, {"tricky \"name\"\n", at::kBFloat16, {7}},
                            {"empty", at::kFloat, {0}}, {"c", at::kLong, {2}}},
                           {{"save", "0123456789abcdef"}, {"rank", "1"}});
  writer.write_next(a);
  writer.write_next(b);
  writer.write_next(empty);
  CHECK_THROWS_WITH_AS(writer.write_next(c.to(at::kInt)), doctest::Contains("declared Long of 2 elements"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(writer.commit(), doctest::Contains("3 of 4 tensors written"), mp::Error);
  writer.write_next(c);
  const auto digest = writer.commit();
  CHECK(digest.bytes == fs::file_size(path));
  const auto again = mp::detail::digest_file(path);
  CHECK(again.bytes == digest.bytes);
  CHECK(again.checksum == digest.checksum);
  // The whole file through the strict reader (tiling, header, dtypes).
  const auto dict = mp::read_safetensors(path);
  REQUIRE(dict.size() == 4);
  CHECK(test::identical(dict["a"], a));
  CHECK(test::identical(dict["tricky \"name\"\n"], b));
  CHECK(test::identical(dict["c"], c));
  // By ranges, into memory of the caller's.
  mp::detail::SafetensorsFile file(path);
  CHECK(file.metadata("save") == "0123456789abcdef");
  CHECK_FALSE(file.metadata("nothing").has_value());
  const auto* entry = file.find("a");
  REQUIRE(entry != nullptr);
  auto middle = torch::empty({5}, torch::kFloat);
  file.read(*entry, 3, middle);
  CHECK(test::identical(middle, a.reshape({-1}).narrow(0, 3, 5)));
  CHECK_THROWS_WITH_AS(file.read(*entry, 10, middle), doctest::Contains("cannot be read"), mp::Error);
  auto wrong = torch::empty({2}, torch::kDouble);
  CHECK_THROWS_WITH_AS(file.read(*entry, 0, wrong), doctest::Contains("cannot be read"), mp::Error);
  // A flipped byte changes the digest.
  {
    std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(static_cast<std::streamoff>(digest.bytes - 3));
    io.put('\x7f');
  }
  CHECK(mp::detail::digest_file(path).checksum != digest.checksum);
}

TEST_CASE("sharded files: a write that fails mid-file (a full disk) is an Error naming the file, and leaves none") {
  const auto dir = fresh("sharded_files_full");
  const auto path = (dir / "big.safetensors").string();
  // RLIMIT_FSIZE makes write(2) fail past the limit (EFBIG) where SIGXFSZ is ignored: a write
  // that fails in the middle of the file, as on a full disk, for this process only.
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
  const auto previous = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = saved;
  small.rlim_cur = 64 * 1024;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  std::string message;
  try {
    SafetensorsWriter writer(path, {{"x", at::kFloat, {100000}}}, {});
    writer.write_next(torch::ones({100000}));
    writer.commit();
  } catch (const mp::Error& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previous);
  MESSAGE("the Error: ", message);
  CHECK(message.find(path) != std::string::npos);
  CHECK(message.find("File too large") != std::string::npos);
  CHECK(listing(dir).empty());  // neither the file nor its temporary
}

TEST_CASE("sharded files: a save's file names, and only other saves' files are removed") {
  namespace d = mp::detail;
  const auto id = d::new_save_id();
  CHECK(id.size() == 16);
  CHECK(d::new_save_id() != id);
  CHECK(d::shard_file_name("0123456789abcdef", 2, 12) == "0123456789abcdef.rank00002-of-00012.safetensors");
  CHECK(d::save_file_name("0123456789abcdef.rank00002-of-00012.safetensors"));
  CHECK(d::save_file_name("0123456789abcdef.trainer.pt"));
  CHECK(d::save_file_name("0123456789abcdef.trainer.pt.tmp.4711"));
  CHECK(d::save_file_name("index.json.tmp.4711"));
  CHECK_FALSE(d::save_file_name("index.json"));
  CHECK_FALSE(d::save_file_name("notes.txt"));
  CHECK_FALSE(d::save_file_name("0123456789ABCDEF.trainer.pt"));
  CHECK_FALSE(d::save_file_name("0123456789abcdef.rank2-of-12.safetensors"));
  CHECK_FALSE(d::save_file_name("index.json.tmp.x"));
  const auto dir = fresh("sharded_files_names");
  const std::string keep = "aaaaaaaaaaaaaaaa", old = "bbbbbbbbbbbbbbbb";
  for (const auto& name : {d::shard_file_name(keep, 0, 2), d::shard_file_name(keep, 1, 2),
                           d::state_file_name(keep), d::shard_file_name(old, 0, 1),
                           d::state_file_name(old), d::shard_file_name(keep, 1, 2) + ".tmp.99",
                           std::string("index.json"), std::string("index.json.tmp.12"),
                           std::string("README.md")}) {
    std::ofstream(dir / name) << "x";
  }
  CHECK(d::remove_other_saves(dir, keep) == 4);
  CHECK(listing(dir) == std::vector<std::string>{"README.md", d::shard_file_name(keep, 0, 2),
                                                 d::shard_file_name(keep, 1, 2),
                                                 d::state_file_name(keep), "index.json"});
}

TEST_CASE("sharded files: JSON strings with control characters are written so that they parse back") {
  const std::string name = "a\tb\nc\x01\"\\";
  const auto text = mp::detail::Json::quoted(name);
  CHECK(text.find('\n') == std::string::npos);
  CHECK(mp::detail::JsonParser::parse(text, "quoted").text == name);
}

}  // namespace test_sharded_files
