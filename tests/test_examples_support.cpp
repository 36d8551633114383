// The Fashion-MNIST demo's pure-C++ parts: IDX reader (with generated, broken files), command
// line, progress bar, SVG writer, result files and table.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../examples/fashion_mnist/cli.hpp"
#include "../examples/fashion_mnist/idx_dataset.hpp"
#include "../examples/fashion_mnist/progress.hpp"
#include "../examples/fashion_mnist/report.hpp"
#include "../examples/fashion_mnist/svg_plot.hpp"

namespace fm = fashion_mnist;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

namespace {

namespace fs = std::filesystem;

fs::path temp_dir() {
  const fs::path dir = fs::path(MIXPREC_TEST_TMPDIR) / "examples_support";
  fs::create_directories(dir);
  return dir;
}

void put_u32(std::vector<unsigned char>& bytes, std::uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) {
    bytes.push_back(static_cast<unsigned char>((value >> shift) & 0xffu));
  }
}

/// An IDX file image: magic, dimensions, then `values` (not necessarily as many as announced).
std::vector<unsigned char> idx(std::uint32_t magic, const std::vector<std::uint32_t>& dims,
                               const std::vector<unsigned char>& values) {
  std::vector<unsigned char> bytes;
  put_u32(bytes, magic);
  for (const auto d : dims) {
    put_u32(bytes, d);
  }
  bytes.insert(bytes.end(), values.begin(), values.end());
  return bytes;
}

/// Writes `bytes` gzipped to `name` (a path relative to the temporary directory).
fs::path write_gz(const fs::path& name, const std::vector<unsigned char>& bytes) {
  const fs::path path = temp_dir() / name;
  fs::create_directories(path.parent_path());
  gzFile file = gzopen(path.c_str(), "wb");
  REQUIRE(file != nullptr);
  if (!bytes.empty()) {
    REQUIRE(gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())) ==
            static_cast<int>(bytes.size()));
  }
  REQUIRE(gzclose(file) == Z_OK);
  return path;
}

std::vector<unsigned char> pattern(std::size_t n) {
  std::vector<unsigned char> values(n);
  for (std::size_t i = 0; i < n; ++i) {
    values[i] = static_cast<unsigned char>((i * 7) % 256);
  }
  return values;
}

/// Writes a split "<prefix>-{images-idx3,labels-idx1}-ubyte.gz" of `n` 28x28 images into `dir`
/// (relative to the temporary directory).
void write_split(const fs::path& dir, const std::string& prefix, std::uint32_t n,
                 std::vector<unsigned char> labels) {
  const auto images = idx(0x803, {n, 28, 28}, pattern(std::size_t{n} * 784));
  write_gz(dir / (prefix + "-images-idx3-ubyte.gz"), images);
  write_gz(dir / (prefix + "-labels-idx1-ubyte.gz"),
           idx(0x801, {static_cast<std::uint32_t>(labels.size())}, labels));
}

template <class Fn>
std::string corrupt_message(Fn&& fn) {
  try {
    fn();
  } catch (const fm::CorruptDataError& error) {
    return error.what();
  }
  FAIL("expected CorruptDataError");
  return {};
}

}  // namespace

TEST_CASE("examples_support: the IDX reader reads what was written, in shape and value") {
  const auto values = pattern(3 * 4 * 5);
  const auto path = write_gz("ok3.gz", idx(0x803, {3, 4, 5}, values));
  const torch::Tensor t = fm::read_idx_gz(path, 3);
  CHECK(t.scalar_type() == torch::kUInt8);
  CHECK(t.sizes() == torch::IntArrayRef({3, 4, 5}));
  const auto* data = t.data_ptr<std::uint8_t>();
  CHECK(std::equal(values.begin(), values.end(), data));

  SUBCASE("max_items reads a prefix") {
    const torch::Tensor head = fm::read_idx_gz(path, 3, 2);
    CHECK(head.sizes() == torch::IntArrayRef({2, 4, 5}));
    CHECK(torch::equal(head, t.narrow(0, 0, 2)));
    CHECK(fm::read_idx_gz(path, 3, 99).size(0) == 3);
  }
}

TEST_CASE("examples_support: a missing file names the Debian package") {
  const auto path = temp_dir() / "does-not-exist.gz";
  try {
    (void)fm::read_idx_gz(path, 1);
    FAIL("expected MissingDataError");
  } catch (const fm::MissingDataError& error) {
    const std::string message = error.what();
    CHECK(contains(message, path.string()));
    CHECK(contains(message, "sudo apt-get install dataset-fashion-mnist"));
  }
  CHECK_THROWS_AS(fm::check_data_files(temp_dir() / "no-such-dir"), fm::MissingDataError);
  CHECK_THROWS_AS((void)fm::load_split(temp_dir() / "no-such-dir", "train"), fm::MissingDataError);
}

TEST_CASE("examples_support: corrupt IDX files fail with a clear message") {
  SUBCASE("bad magic number") {
    const auto path = write_gz("bad_magic.gz", idx(0x12345678, {3}, {1, 2, 3}));
    const auto message = corrupt_message([&] { (void)fm::read_idx_gz(path, 1); });
    CHECK(contains(message, "bad magic number 0x12345678"));
    CHECK(contains(message, "expected 0x00000801"));
  }
  SUBCASE("an images file where labels are expected (wrong rank)") {
    const auto path = write_gz("wrong_rank.gz", idx(0x803, {1, 2, 2}, {1, 2, 3, 4}));
    CHECK(contains(corrupt_message([&] { (void)fm::read_idx_gz(path, 1); }), "bad magic"));
  }
  SUBCASE("values that are not unsigned bytes") {
    const auto path = write_gz("floats.gz", idx(0x0d01, {1}, {0, 0, 0, 0}));
    CHECK(contains(corrupt_message([&] { (void)fm::read_idx_gz(path, 1); }), "bad magic"));
  }
  SUBCASE("an empty file") {
    const auto path = write_gz("empty.gz", {});
    CHECK(contains(corrupt_message([&] { (void)fm::read_idx_gz(path, 1); }), "truncated"));
  }
  SUBCASE("header cut inside the dimensions") {
    auto bytes = idx(0x803, {3, 4, 5}, {});
    bytes.resize(10);
    const auto path = write_gz("short_header.gz", bytes);
    CHECK(contains(corrupt_message([&] { (void)fm::read_idx_gz(path, 3); }), "truncated"));
  }
  SUBCASE("fewer values than announced") {
    const auto path = write_gz("short_data.gz", idx(0x803, {3, 4, 5}, pattern(59)));
    const auto message = corrupt_message([&] { (void)fm::read_idx_gz(path, 3); });
    CHECK(contains(message, "truncated"));
    CHECK(contains(message, "60 values"));
    CHECK(contains(message, "holds 59"));
  }
  SUBCASE("more values than announced") {
    const auto path = write_gz("long_data.gz", idx(0x801, {3}, {1, 2, 3, 4}));
    CHECK(contains(corrupt_message([&] { (void)fm::read_idx_gz(path, 1); }), "trailing data"));
  }
  SUBCASE("a zero dimension") {
    const auto path = write_gz("zero_dim.gz", idx(0x803, {0, 28, 28}, {}));
    CHECK(contains(corrupt_message([&] { (void)fm::read_idx_gz(path, 3); }),
                   "implausible dimension"));
  }
  SUBCASE("an absurd size does not allocate") {
    const auto path = write_gz("huge.gz", idx(0x803, {0xffffffffu, 0xffffffffu, 28}, {}));
    CHECK(contains(corrupt_message([&] { (void)fm::read_idx_gz(path, 3); }),
                   "implausible dimension"));
  }
  SUBCASE("a gzip stream cut in the middle") {
    const auto good = write_gz("cut_source.gz", idx(0x803, {20, 28, 28}, pattern(20 * 784)));
    std::ifstream in(good, std::ios::binary);
    std::string compressed((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    REQUIRE(compressed.size() > 40);
    const auto cut = temp_dir() / "cut.gz";
    std::ofstream(cut, std::ios::binary)
        .write(compressed.data(), static_cast<std::streamsize>(compressed.size() / 2));
    const auto message = corrupt_message([&] { (void)fm::read_idx_gz(cut, 3); });
    CHECK((contains(message, "truncated") || contains(message, "corrupt gzip")));
  }
}

TEST_CASE("examples_support: load_split checks that images and labels belong together") {
  write_split("split_ok", "train", 3, {0, 9, 4});
  const auto dir = temp_dir() / "split_ok";
  const fm::Split split = fm::load_split(dir, "train");
  CHECK(split.size() == 3);
  CHECK(split.images.sizes() == torch::IntArrayRef({3, 1, 28, 28}));
  CHECK(split.labels.scalar_type() == torch::kLong);
  CHECK(split.labels.equal(torch::tensor({0, 9, 4}, torch::kLong)));
  CHECK(split.images[1][0][0][0].item<int>() == (784 * 7) % 256);

  const fm::Split head = fm::load_split(dir, "train", 2);
  CHECK(head.size() == 2);
  CHECK(head.labels.equal(torch::tensor({0, 9}, torch::kLong)));

  SUBCASE("counts differ") {
    const auto bad = temp_dir() / "split_count";
    write_split("split_count", "t10k", 3, {1, 2});
    CHECK(contains(corrupt_message([&] { (void)fm::load_split(bad, "t10k"); }),
                   "2 labels for 3 images"));
  }
  SUBCASE("a label out of range") {
    const auto bad = temp_dir() / "split_label";
    write_split("split_label", "t10k", 2, {1, 10});
    CHECK(contains(corrupt_message([&] { (void)fm::load_split(bad, "t10k"); }), "label 10"));
  }
  SUBCASE("images of the wrong size") {
    const auto bad = temp_dir() / "split_size";
    write_gz("split_size/x-images-idx3-ubyte.gz", idx(0x803, {1, 4, 4}, pattern(16)));
    write_gz("split_size/x-labels-idx1-ubyte.gz", idx(0x801, {1}, {3}));
    CHECK(contains(corrupt_message([&] { (void)fm::load_split(bad, "x"); }), "expected 28x28"));
  }
}

TEST_CASE("examples_support: standardize maps bytes to [0, 1], then mean 0.2860, std 0.3530") {
  const auto bytes = torch::tensor({0, 255, 73}, torch::kUInt8);
  const auto x = fm::standardize(bytes);
  CHECK(x.scalar_type() == torch::kFloat);
  const double eps = 1e-6;
  CHECK(x[0].item<double>() == doctest::Approx(-0.2860 / 0.3530).epsilon(eps));
  CHECK(x[1].item<double>() == doctest::Approx((1 - 0.2860) / 0.3530).epsilon(eps));
  CHECK(x[2].item<double>() == doctest::Approx((73 / 255.0 - 0.2860) / 0.3530).epsilon(eps));
}

TEST_CASE("examples_support: the installed Fashion-MNIST labels, where present") {
  const fs::path dir(fm::kDefaultDataDir);
  // The scripts install the package; a run without it must not pass as if it had checked.
  if (!fs::exists(dir / "t10k-labels-idx1-ubyte.gz")) {
    const auto message = "Fashion-MNIST is not installed in " + dir.string() +
                         ": install it with `apt-get install dataset-fashion-mnist` (scripts/ do)";
    FAIL(message);
  }
  CHECK_NOTHROW(fm::check_data_files(dir));
  const auto labels = fm::read_idx_gz(dir / "t10k-labels-idx1-ubyte.gz", 1);
  REQUIRE(labels.size(0) == 10000);
  CHECK(torch::bincount(labels.to(torch::kLong)).equal(torch::full({10}, 1000, torch::kLong)));
}

TEST_CASE("examples_support: command-line defaults and --smoke") {
  const fm::Config defaults = fm::parse_args({});
  CHECK(defaults.policy == "all");
  CHECK(defaults.device == "cpu");
  CHECK(defaults.dtype == (mixprec::detail::cpu_half_math ? "both" : "bf16"));
  CHECK(defaults.output == "docs/demo_loss.svg");
  CHECK_FALSE(defaults.smoke);
  CHECK(defaults.result_file.empty());

  const fm::Config smoke = fm::parse_args({"--smoke"});
  CHECK(smoke.train_size == 512);
  CHECK(smoke.test_size == 1000);
  CHECK(smoke.epochs == 2);
  // Explicit sizes win over --smoke, before or after it.
  CHECK(fm::parse_args({"--epochs", "5", "--smoke"}).epochs == 5);
  CHECK(fm::parse_args({"--smoke", "--train-size=300"}).train_size == 300);
}

TEST_CASE("examples_support: command-line values, aliases and errors") {
  const fm::Config c =
      fm::parse_args({"--epochs=4", "--train-size", "1000", "--policy", "O2", "--seed", "7",
                      "--output", "x.svg", "--lr", "0.1", "--batch-size", "32", "--data", "/d"});
  CHECK(c.epochs == 4);
  CHECK(c.train_size == 1000);
  CHECK(c.policy == "MixedO2");
  CHECK(c.seed == 7);
  CHECK(c.output == "x.svg");
  CHECK(c.lr == 0.1);
  CHECK(c.batch_size == 32);
  CHECK(c.data_dir == "/d");
  CHECK(fm::parse_args({"--policy", "PureHalf"}).policy == "PureHalf");
  CHECK(fm::parse_args({"--policy", "O0"}).policy == "FullPrecision");
  CHECK(fm::parse_args({"--help"}).help);
  CHECK(fm::parse_args({"-h"}).help);
  CHECK(fm::parse_args({"--device", "cuda"}).dtype == "fp16");
  CHECK(fm::parse_args({"--device", "cuda", "--dtype", "bf16"}).dtype == "bf16");

  for (const std::vector<std::string>& bad :
       std::vector<std::vector<std::string>>{{"--bogus"},
                                             {"extra"},
                                             {"--epochs"},
                                             {"--epochs", "0"},
                                             {"--epochs", "-1"},
                                             {"--epochs", "two"},
                                             {"--epochs", "3x"},
                                             {"--train-size", "60001"},
                                             {"--test-size", "10001"},
                                             {"--lr", "0"},
                                             {"--lr", "nan"},
                                             {"--policy", "O4"},
                                             {"--policy", "mixedo1"},
                                             {"--device", "tpu"},
                                             {"--dtype", "fp8"},
                                             {"--smoke=1"},
                                             {"--result-file", "/tmp/x"}}) {
    CAPTURE(bad.front());
    CHECK_THROWS_AS(fm::parse_args(bad), fm::CliError);
  }
  if constexpr (mixprec::detail::cpu_half_math) {
    CHECK(fm::parse_args({"--dtype", "fp16"}).dtype == "fp16");  // LibTorch 2.x: fp16 on the CPU
  } else {
    try {
      (void)fm::parse_args({"--dtype", "fp16"});
      FAIL("fp16 on the CPU must be refused by LibTorch 1.13");
    } catch (const fm::CliError& error) {
      CHECK(contains(error.what(), "not implemented for 'Half'"));
      CHECK(contains(error.what(), "--device cuda"));
    }
  }
  // A child trains one policy in one dtype.
  CHECK_THROWS_AS(fm::parse_args({"--policy", "O1", "--dtype", "both", "--result-file", "/tmp/x"}),
                  fm::CliError);
  const std::string help = fm::usage("demo");
  for (const char* flag : {"--epochs", "--train-size", "--policy", "--device", "--output", "--seed",
                           "--smoke", "--help", "--advise", "--gradient-stats",
                           "dataset-fashion-mnist"}) {
    CHECK(contains(help, flag));
  }
}

TEST_CASE("examples_support: the child's arguments reproduce the parent's settings") {
  fm::Config parent = fm::parse_args({"--smoke", "--seed", "9", "--lr", "0.0123456789", "--data",
                                      "/some dir", "--batch-size", "16", "--dtype", "bf16",
                                      "--gradient-stats", "25"});
  const auto args = fm::child_args(parent, "MixedO1", "/tmp/result");
  const fm::Config child = fm::parse_args(args);
  CHECK(child.policy == "MixedO1");
  CHECK(child.result_file == "/tmp/result");
  CHECK(child.epochs == parent.epochs);
  CHECK(child.train_size == parent.train_size);
  CHECK(child.test_size == parent.test_size);
  CHECK(child.batch_size == parent.batch_size);
  CHECK(child.lr == parent.lr);
  CHECK(child.seed == parent.seed);
  CHECK(child.device == parent.device);
  CHECK(child.dtype == parent.dtype);
  CHECK(child.data_dir == parent.data_dir);
  CHECK(child.output == "none");
  CHECK(child.gradient_stats == 25);
}

TEST_CASE("examples_support: progress bar pieces") {
  CHECK(fm::format_duration(0) == "0:00");
  CHECK(fm::format_duration(65) == "1:05");
  CHECK(fm::format_duration(59.6) == "1:00");
  CHECK(fm::format_duration(3725) == "1:02:05");
  CHECK(fm::format_duration(-1) == "--:--");
  CHECK(fm::format_duration(std::numeric_limits<double>::quiet_NaN()) == "--:--");

  CHECK(fm::eta_seconds(10, 1, 4) == doctest::Approx(30));
  CHECK(fm::eta_seconds(10, 0, 4) < 0);
  CHECK(fm::eta_seconds(10, 4, 4) == 0);

  CHECK(fm::render_bar(5, 10, 10) == "[#####-----]");
  CHECK(fm::render_bar(0, 10, 4) == "[----]");
  CHECK(fm::render_bar(12, 10, 4) == "[####]");
  CHECK(fm::render_bar(1, 0, 3) == "[---]");

  const std::string line = fm::progress_line("MixedO1<BFloat16>", 50, 100, 10, "loss 0.5", 10);
  CHECK(line == "MixedO1<BFloat16> [#####-----]  50% 50/100 loss 0.5 0:10 ETA 0:10");
}

TEST_CASE("examples_support: the progress bar draws only on a terminal") {
  std::ostringstream log;
  {
    fm::ProgressBar bar(log, "P", 10, /*interactive=*/false);
    bar.update(5, "x");
    bar.message("epoch 1 done");
  }
  CHECK(log.str() == "epoch 1 done\n");

  std::ostringstream terminal;
  {
    fm::ProgressBar bar(terminal, "P", 10, /*interactive=*/true);
    bar.update(5, "x");
    bar.message("epoch 1 done");
    bar.update(10, "y");  // the last update is always drawn
  }
  const std::string out = terminal.str();
  CHECK(out.starts_with("\rP ["));
  CHECK(contains(out, "\r\x1b[Kepoch 1 done\n"));
  CHECK(contains(out, "100% 10/10 y"));
  CHECK(out.ends_with("\r\x1b[K"));  // the destructor leaves a clean line
}

TEST_CASE("examples_support: SVG helpers") {
  CHECK(fm::svg::escape("MixedO2<BFloat16> & \"x\"") ==
        "MixedO2&lt;BFloat16&gt; &amp; &quot;x&quot;");

  const auto unit = fm::svg::nice_ticks(0, 1, 5);
  REQUIRE(unit.size() == 6);
  for (std::size_t i = 0; i < unit.size(); ++i) {
    CHECK(unit[i] == doctest::Approx(0.2 * static_cast<double>(i)));
  }
  CHECK((fm::svg::nice_ticks(1, 2811, 6) == std::vector<double>{500, 1000, 1500, 2000, 2500}));
  const auto around_zero = fm::svg::nice_ticks(-0.3, 0.3, 3);
  CHECK(std::find(around_zero.begin(), around_zero.end(), 0.0) != around_zero.end());
  CHECK(fm::svg::nice_ticks(1, 1, 5).empty());
  CHECK(fm::svg::nice_ticks(0, std::numeric_limits<double>::infinity(), 5).empty());

  const std::vector<double> raw{1, 3, 2, 5};
  CHECK(fm::svg::smooth_ema(raw, 0) == raw);
  for (const double v : fm::svg::smooth_ema({2, 2, 2}, 0.9)) {
    CHECK(v == doctest::Approx(2));  // bias correction: no ramp up from 0
  }
  const auto with_nan = fm::svg::smooth_ema({1, std::nan(""), 1}, 0.5);
  CHECK(std::isnan(with_nan[1]));
  CHECK(with_nan[2] == doctest::Approx(1));

  fm::svg::Series many{"s", {}, {}};
  for (int i = 0; i < 1000; ++i) {
    many.x.push_back(i);
    many.y.push_back(i * 2.0);
  }
  const auto few = fm::svg::downsample(many, 10);
  REQUIRE(few.x.size() == 10);
  CHECK(few.x.front() == 0);
  CHECK(few.x.back() == 999);
  CHECK(few.y.back() == 1998);
  CHECK(fm::svg::downsample(few, 100).x.size() == 10);
}

TEST_CASE("examples_support: an SVG figure with linear and log panels") {
  fm::svg::Panel loss{"Loss", "step", "loss", false, "a note", {}};
  loss.series.push_back({"FullPrecision", {1, 2, 3}, {2.3, 1.0, 0.5}});
  loss.series.push_back({"MixedO1<BFloat16>", {1, 2, 3}, {2.3, std::nan(""), 0.6}});
  fm::svg::Panel scale{"Scale", "step", "scale", true, "", {}};
  scale.series.push_back({"FullPrecision", {1, 2, 3}, {1, 1, 1}});  // a flat line on a log axis
  scale.series.push_back({"GradScaler", {1, 2, 3}, {65536, 32768, 0}});
  fm::svg::Panel empty{"Nothing", "x", "y", false, "", {}};
  const std::string svg = fm::svg::render({"Title & co", {loss, scale, empty}, 800, 300});

  CHECK(svg.starts_with("<?xml"));
  CHECK(svg.ends_with("</svg>\n"));
  CHECK(contains(svg, "Title &amp; co"));
  CHECK(contains(svg, "MixedO1&lt;BFloat16&gt;"));
  CHECK(contains(svg, "a note"));
  CHECK_FALSE(contains(svg, "nan"));
  CHECK_FALSE(contains(svg, "inf"));
  std::size_t polylines = 0;
  for (auto at = svg.find("<polyline"); at != std::string::npos;
       at = svg.find("<polyline", at + 1)) {
    ++polylines;
  }
  // Loss: one line plus one broken by the NaN in two; scale: two (the 0 is dropped on log).
  CHECK(polylines == 5);
  CHECK(contains(svg, ">1e+05<"));  // log ticks: powers of ten up to the next above 65536
}

TEST_CASE("examples_support: result files round-trip, broken ones are refused") {
  fm::PolicyResult r;
  r.policy = "MixedO2<BFloat16>";
  r.test_accuracy = 0.8765;
  r.seconds_per_epoch = 12.25;
  r.peak_rss_mib = 420.5;
  r.training_peak_mib = -1;
  r.steps = 3;
  r.skipped_steps = 1;
  r.final_scale = 32768;
  r.losses = {2.3, std::numeric_limits<double>::quiet_NaN(), 0.1 + 0.2};
  r.scales = {65536, 32768, 32768};
  std::stringstream file;
  fm::write_result(file, r);
  const fm::PolicyResult back = fm::read_result(file);
  CHECK(back.policy == r.policy);
  CHECK(back.test_accuracy == r.test_accuracy);
  CHECK(back.seconds_per_epoch == r.seconds_per_epoch);
  CHECK(back.peak_rss_mib == r.peak_rss_mib);
  CHECK(back.training_peak_mib == r.training_peak_mib);
  CHECK(back.steps == 3);
  CHECK(back.skipped_steps == 1);
  CHECK(back.final_scale == 32768);
  REQUIRE(back.losses.size() == 3);
  CHECK(back.losses[0] == 2.3);
  CHECK(std::isnan(back.losses[1]));
  CHECK(back.losses[2] == 0.1 + 0.2);  // 17 digits: exact
  CHECK(back.scales == r.scales);

  std::istringstream empty("");
  CHECK_THROWS_WITH_AS(fm::read_result(empty), doctest::Contains("not a result file"),
                       std::runtime_error);
  const std::string text = file.str();
  std::istringstream truncated(text.substr(0, text.size() / 2));
  CHECK_THROWS_WITH_AS(fm::read_result(truncated), doctest::Contains("result file: "),
                       std::runtime_error);
  std::istringstream unknown(std::string(fm::kResultHeader) + "\nbogus 1\nend\n");
  CHECK_THROWS_WITH_AS(fm::read_result(unknown), doctest::Contains("unknown key 'bogus'"),
                       std::runtime_error);
}

TEST_CASE("examples_support: /proc status parsing and the table") {
  std::istringstream status("Name:\tx\nVmPeak:\t  999 kB\nVmHWM:\t  2048 kB\nVmRSS:\t 1024 kB\n");
  CHECK(fm::status_kib(status, "VmHWM:") == 2048);
  std::istringstream none("Name:\tx\n");
  CHECK(fm::status_kib(none, "VmHWM:") == -1);
  // Linux has /proc: this process's peak is a positive size (failure is -1).
  CHECK(fm::self_status_mib("VmHWM:") > 0);
  CHECK(fm::self_status_mib("NoSuchKey:") == -1);

  fm::PolicyResult a;
  a.policy = "FullPrecision";
  a.test_accuracy = 0.9;
  a.seconds_per_epoch = 10;
  a.peak_rss_mib = 400;
  a.training_peak_mib = 20;
  fm::PolicyResult b = a;
  b.policy = "MixedO1<BFloat16>";
  b.test_accuracy = 0.8975;
  b.seconds_per_epoch = 5;
  b.training_peak_mib = -1;
  const std::string table = fm::format_table({a, b});
  CHECK(contains(table, "| FullPrecision | 90.00% | +0.00 pp | 10.00 | 1.00x | 400.0 | 20.0 |"));
  CHECK(contains(table, "| MixedO1<BFloat16> | 89.75% | -0.25 pp | 5.00 | 2.00x | 400.0 | n/a |"));
}
