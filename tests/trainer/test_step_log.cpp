// What writes a run's reports (trainer/step_log.hpp, trainer/progress.hpp): the StepLogger's
// CSV and JSON lines against the reports they came from, a resumed run's log appended, and the
// ProgressLine on a terminal (redrawn) and elsewhere (plain lines, no control characters).
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace test_step_log {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::vector<std::string> fields_of(const std::string& line) {
  std::vector<std::string> fields;
  std::istringstream in(line);
  for (std::string field; std::getline(in, field, ',');) fields.push_back(field);
  if (!line.empty() && line.back() == ',') fields.emplace_back();
  return fields;
}

// Trains `steps` optimizer steps of two micro-batches (the third step's second one has an inf
// loss: skipped), clipping at 1, lr halved every 2 steps; each report goes to `sink` and is
// kept.
template <class Sink>
std::vector<mp::StepReport> train(std::int64_t steps, Sink&& sink, bool clip = true) {
  torch::manual_seed(9);
  auto net = torch::nn::Sequential(torch::nn::Linear(6, 12), torch::nn::Tanh(),
                                   torch::nn::Linear(12, 3));
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  std::vector<mp::StepReport> reports;
  auto options = mp::TrainerOptions()
                     .accumulation_steps(2)
                     .lr_lambda([](std::int64_t k) { return std::ldexp(1.0, -static_cast<int>(k / 2)); })
                     .on_step([&](const mp::StepReport& r) {
                       reports.push_back(r);
                       sink(r);
                     });
  if (clip) options.max_grad_norm(1.0);
  mp::Trainer<mp::FullPrecision> trainer(net, sgd, options);
  const auto x = torch::randn({16, 6});
  const auto y = torch::randint(0, 3, {16}, at::kLong);
  for (std::int64_t i = 0; i < 2 * steps; ++i) {
    trainer.step([&] {
      const auto rows = x.slice(0, 8 * (i % 2), 8 * (i % 2 + 1));
      auto loss = torch::nn::functional::cross_entropy(net->forward(rows),
                                                       y.slice(0, 8 * (i % 2), 8 * (i % 2 + 1)));
      return i == 5 ? loss * std::numeric_limits<double>::infinity() : loss;
    });
  }
  return reports;
}

std::string temp(const std::string& name) {
  return (std::filesystem::path(MIXPREC_TEST_TMPDIR) / name).string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

TEST_CASE("StepLogger CSV: one line per optimizer step with its reports' values") {
  std::ostringstream out;
  mp::StepLogger log(out, mp::StepLoggerOptions().batch_size(8));
  const auto reports = train(5, log);
  const auto lines = lines_of(out.str());
  REQUIRE(lines.size() == 6U);
  CHECK(lines[0] == "step,loss,lr,scale,skipped,grad_norm,samples_per_s");
  for (std::size_t k = 0; k < 5; ++k) {
    CAPTURE(lines[k + 1]);
    const auto& first = reports[2 * k];
    const auto& last = reports[2 * k + 1];
    const auto fields = fields_of(lines[k + 1]);
    REQUIRE(fields.size() == 7U);
    CHECK(std::stoll(fields[0]) == last.step);
    const double loss = (first.loss.item<double>() + last.loss.item<double>()) / 2;
    if (k == 2) {
      CHECK(fields[1] == "inf");
      CHECK(fields[4] == "1");
      CHECK_FALSE(std::isfinite(std::stod(fields[5])));  // the norm the step found: inf/NaN
    } else {
      CHECK(std::stod(fields[1]) == loss);  // the shortest text that reads back exactly
      CHECK(fields[4] == "0");
      CHECK(std::stod(fields[5]) == *last.grad_norm);
    }
    CHECK(std::stod(fields[2]) == last.lr);
    CHECK(std::stod(fields[3]) == last.scale);
    CHECK(std::stod(fields[6]) > 0);
  }
  CHECK(reports[9].lr == 0.1 * 0.25);  // the schedule's fifth step
}

TEST_CASE("StepLogger JSON lines: every N-th step and each skipped one; null for what is absent") {
  std::ostringstream out;
  mp::StepLogger log(out, mp::StepLoggerOptions().format(mp::LogFormat::json_lines).every(2));
  train(4, log, /*clip=*/false);
  const auto lines = lines_of(out.str());
  REQUIRE(lines.size() == 3U);  // steps 2 and 4, and skipped step 3
  CHECK(lines[0].rfind("{\"step\":2,\"loss\":", 0) == 0);
  CHECK(lines[0].find("\"lr\":0.1,\"scale\":1,\"skipped\":false,\"grad_norm\":null,"
                      "\"samples_per_s\":null}") != std::string::npos);
  CHECK(lines[1] == "{\"step\":3,\"loss\":null,\"lr\":0.05,\"scale\":1,\"skipped\":true,"
                    "\"grad_norm\":null,\"samples_per_s\":null}");
  CHECK(lines[2].rfind("{\"step\":4,", 0) == 0);
}

TEST_CASE("StepLogger to a file: a resumed run appends without a second header") {
  const auto path = temp("step_log.csv");
  train(2, mp::StepLogger(path));
  train(3, mp::StepLogger(path, mp::StepLoggerOptions().append(true)));
  const auto lines = lines_of(read_file(path));
  REQUIRE(lines.size() == 6U);
  CHECK(lines[0].rfind("step,", 0) == 0);
  CHECK(lines[3].rfind("1,", 0) == 0);  // the second run's first step
  train(1, mp::StepLogger(path));       // without append: replaced
  CHECK(lines_of(read_file(path)).size() == 2U);
}

TEST_CASE("StepLogger and ProgressLine: bad settings and paths are Errors") {
  std::ostringstream out;
  CHECK_THROWS_WITH_AS(mp::StepLogger(temp("no_such_dir/log.csv")),
                       doctest::Contains("cannot open"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::StepLogger(out, mp::StepLoggerOptions().every(0)),
                       doctest::Contains("every must be >= 1"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::StepLogger(out, mp::StepLoggerOptions().batch_size(-1)),
                       doctest::Contains("batch_size must be >= 0"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::ProgressLine(out, 10, mp::ProgressOptions().interval(-1)),
                       doctest::Contains("must be finite seconds >= 0"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::ProgressLine(out, 10, mp::ProgressOptions().batch_size(-2)),
                       doctest::Contains("batch_size must be >= 0"), mp::Error);
  CHECK(out.str().empty());
}

TEST_CASE("StepLogger: a line that cannot be written is an Error; the step was taken, its "
          "gradients cleared and the schedule advanced all the same") {
  torch::manual_seed(9);
  auto net = torch::nn::Linear(4, 2);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  std::ostringstream out;
  mp::StepLogger log(out);
  std::vector<double> lrs;
  mp::Trainer<mp::FullPrecision> trainer(
      net, sgd,
      mp::TrainerOptions()
          .lr_lambda([](std::int64_t k) { return std::ldexp(1.0, -static_cast<int>(k)); })
          .on_step([&](const mp::StepReport& r) {
            lrs.push_back(r.lr);
            log(r);
          }));
  const auto x = torch::randn({8, 4});
  const auto loss_fn = [&] { return net->forward(x).pow(2).mean(); };
  trainer.step(loss_fn);
  out.setstate(std::ios::badbit);  // as a full disk leaves a stream
  CHECK_THROWS_WITH_AS(trainer.step(loss_fn), doctest::Contains("could not be written"), mp::Error);
  CHECK(trainer.stats().steps == 2);
  for (const auto& p : net->parameters()) CHECK_FALSE(p.grad().defined());  // none for a 2nd update
  out.clear();
  trainer.step(loss_fn);
  CHECK(lrs == std::vector<double>{0.1, 0.05, 0.025});  // not 0.05 twice
  CHECK(lines_of(out.str()).size() == 3);  // the header, steps 1 and 3
}

TEST_CASE("ProgressLine: plain lines where the output is not a terminal, a redrawn line where it is") {
  SUBCASE("not a terminal (a string stream, as a file or a CI log): no \\r, no escape codes") {
    std::ostringstream out;
    mp::ProgressLine progress(out, 4, mp::ProgressOptions().interval(0).batch_size(8));
    CHECK_FALSE(progress.terminal());
    train(4, progress);
    progress.finish();
    const auto text = out.str();
    CHECK(text.find('\r') == std::string::npos);
    CHECK(text.find('\x1b') == std::string::npos);
    const auto lines = lines_of(text);
    REQUIRE(lines.size() == 4U);
    CHECK(lines[1].rfind("step 2/4 (50%)  loss ", 0) == 0);
    CHECK(lines[2].find("skipped 1") != std::string::npos);
    CHECK(lines[1].find(" samples/s  eta ") != std::string::npos);
  }
  SUBCASE("not a terminal, a long interval: the first step and the last") {
    std::ostringstream out;
    mp::ProgressLine progress(out, 4, mp::ProgressOptions().interval(1e9));
    train(4, progress);
    const auto lines = lines_of(out.str());
    REQUIRE(lines.size() == 2U);
    CHECK(lines[1].rfind("step 4/4 (100%)", 0) == 0);
  }
  SUBCASE("a terminal: redrawn in place, ended by finish()") {
    std::ostringstream out;
    mp::ProgressLine progress(out, 0, mp::ProgressOptions().terminal(true).refresh(0));
    train(3, progress);
    progress.finish();
    progress.finish();  // once
    const auto text = out.str();
    CHECK(text.rfind("\rstep 1  loss ", 0) == 0);
    CHECK(text.find("\rstep 3  loss ") != std::string::npos);
    CHECK(text.find("\x1b[K") != std::string::npos);
    CHECK(lines_of(text).size() == 1U);  // one line, ended once
    CHECK(text.back() == '\n');
  }
}

TEST_CASE("StepLogger and ProgressLine follow the Trainer's resets: the micro-batches load() or "
          "drop_accumulation() dropped are not in the logged loss") {
  // The reference: the Trainer's own reports. Before the fix, the micro-batch that load()
  // discarded (its loss 1000 times the others) stayed in the tally: the line of the step after
  // load() logged 378.26 where the mean of its two micro-batches was 1.13.
  torch::manual_seed(9);
  auto net = torch::nn::Sequential(torch::nn::Linear(6, 12), torch::nn::Tanh(), torch::nn::Linear(12, 3));
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  std::ostringstream log_out, progress_out;
  mp::StepLogger log(log_out);
  mp::ProgressLine progress(progress_out, 0, mp::ProgressOptions().interval(0));
  std::vector<mp::StepReport> reports;
  mp::Trainer<mp::FullPrecision> trainer(
      net, sgd, mp::TrainerOptions().accumulation_steps(2).on_step([&](const mp::StepReport& r) {
        reports.push_back(r);
        log(r);
        progress(r);
      }));
  const auto x = torch::randn({8, 6});
  const auto y = torch::randint(0, 3, {8}, at::kLong);
  const auto micro = [&](double factor) {
    return trainer.step([&] { return torch::nn::functional::cross_entropy(net->forward(x), y) * factor; });
  };
  const auto path = temp("step_log_reset.ckpt");
  micro(1);
  micro(1);
  trainer.save(path);
  micro(1000);  // dropped by the load() below
  trainer.load(path);
  micro(1);
  micro(1);
  micro(1000);  // dropped by drop_accumulation()
  CHECK(trainer.drop_accumulation() == 1);
  micro(1);
  micro(1);
  std::vector<std::int64_t> micro_batches;
  for (const auto& r : reports) micro_batches.push_back(r.micro_batch);
  CHECK(micro_batches == std::vector<std::int64_t>{1, 2, 1, 1, 2, 1, 1, 2});
  const auto lines = lines_of(log_out.str());
  const auto progress_lines = lines_of(progress_out.str());
  REQUIRE(lines.size() == 4U);  // the header and steps 1, 2 (after load()) and 3
  REQUIRE(progress_lines.size() == 3U);
  for (const std::size_t k : {1U, 2U}) {
    CAPTURE(k);
    // The two micro-batches of the step the line ends, as the Trainer reported them.
    const auto& first = reports[3 * k];
    const auto& last = reports[3 * k + 1];
    const double mean = (first.loss.item<double>() + last.loss.item<double>()) / 2;
    const auto fields = fields_of(lines[k + 1]);
    REQUIRE(fields.size() == 7U);
    CHECK(std::stoll(fields[0]) == last.step);
    CHECK(std::stod(fields[1]) == mean);
    CHECK(progress_lines[k].rfind("step " + std::to_string(last.step) + "  loss " +
                                      mp::detail::number(static_cast<float>(mean)) + " ",
                                  0) == 0);
  }
}

}  // namespace test_step_log
