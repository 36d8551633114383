#pragma once
/// StepLogger: what a run looks like, one line per optimizer step, from the reports on_step
/// receives: CSV or JSON lines with step, loss, lr, scale, skipped, grad_norm, samples_per_s.
///
///   mixprec::StepLogger log("train.csv", mixprec::StepLoggerOptions().batch_size(64));
///   mixprec::Trainer<mixprec::MixedO1<at::Half>> trainer(model, optimizer,
///       mixprec::TrainerOptions().on_step(log));
///
/// Copies share one log (on_step takes a copy). mixprec never writes to stdout on its own.

#include <mixprec/core/error.hpp>
#include <mixprec/trainer/options.hpp>

#include <ATen/ATen.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <system_error>
#include <utility>

namespace mixprec {

/// How a StepLogger writes its lines.
enum class LogFormat {
  csv,         ///< a header line, then `step,loss,lr,scale,skipped,grad_norm,samples_per_s`
  json_lines,  ///< one JSON object per line, the same keys; null for what is absent or not finite
};

/// Settings of a StepLogger (chainable, as LibTorch's options).
class StepLoggerOptions {
 public:
  /// CSV (default) or JSON lines.
  StepLoggerOptions& format(LogFormat value) { format_ = value; return *this; }
  LogFormat format() const noexcept { return format_; }
  /// Write every N-th optimizer step (1: each); a skipped step is written whatever N.
  StepLoggerOptions& every(std::int64_t value) { every_ = value; return *this; }
  std::int64_t every() const noexcept { return every_; }
  /// Samples per micro-batch, for samples_per_s (0, the default: the column stays empty).
  StepLoggerOptions& batch_size(std::int64_t value) { batch_size_ = value; return *this; }
  std::int64_t batch_size() const noexcept { return batch_size_; }
  /// A path: append to the file instead of replacing it (a resumed run), without a second
  /// CSV header where the file already has lines.
  StepLoggerOptions& append(bool value) { append_ = value; return *this; }
  bool append() const noexcept { return append_; }

 private:
  LogFormat format_ = LogFormat::csv;
  std::int64_t every_ = 1;
  std::int64_t batch_size_ = 0;
  bool append_ = false;
};

namespace detail {

// What the reports between two written lines add up to: this optimizer step's micro-batch
// losses (summed as tensors: no synchronisation until a line is written), and the micro-batches
// and time since the last line.
class StepTally {
 public:
  using Clock = std::chrono::steady_clock;

  /// Counts a report; true when it ends an optimizer step.
  bool add(const StepReport& report) {
    // The first micro-batch of a step: losses counted before it that no step ended belong to
    // micro-batches the Trainer dropped (load(), drop_accumulation()). The rate keeps them:
    // they were computed.
    if (report.micro_batch == 1) end_step();
    if (report.loss.defined()) {
      const auto loss = report.loss.detach().to(at::kDouble);
      loss_sum_ = loss_sum_.defined() ? loss_sum_ + loss : loss;
      ++losses_;
    }
    ++micro_batches_;
    return report.status != StepStatus::accumulating;
  }

  /// The mean loss of the optimizer step that ended (NaN if none was reported).
  double step_loss() const {
    return losses_ > 0 ? loss_sum_.item<double>() / static_cast<double>(losses_)
                       : std::numeric_limits<double>::quiet_NaN();
  }

  /// Micro-batches per second since the last line (or since this tally was made).
  double micro_batches_per_s(Clock::time_point now) const {
    const double seconds = std::chrono::duration<double>(now - since_).count();
    return seconds > 0 ? static_cast<double>(micro_batches_) / seconds
                       : std::numeric_limits<double>::quiet_NaN();
  }

  /// After an optimizer step: its losses are done with.
  void end_step() {
    loss_sum_ = at::Tensor();
    losses_ = 0;
  }

  /// After a line: the rate counts from here.
  void end_line(Clock::time_point now) {
    micro_batches_ = 0;
    since_ = now;
  }

 private:
  at::Tensor loss_sum_;
  std::int64_t losses_ = 0;
  std::int64_t micro_batches_ = 0;
  Clock::time_point since_ = Clock::now();
};

// The shortest text that reads back as `value` ("inf", "nan" as they are).
inline std::string number(double value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
  return std::string(buffer, result.ptr);
}

inline std::string number(float value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
  return std::string(buffer, result.ptr);
}

inline std::string fixed(double value, int decimals) {
  char buffer[64];
  const auto result =
      std::to_chars(buffer, buffer + sizeof buffer, value, std::chars_format::fixed, decimals);
  return std::string(buffer, result.ptr);
}

}  // namespace detail

/// Writes one line per optimizer step (StepLoggerOptions::every) to a stream or a file: the
/// step count, the mean loss of its micro-batches, the lr and loss scale it used, whether it
/// was skipped, the gradient norm (when clipping) and samples per second since the last line.
/// Pass it as TrainerOptions::on_step, or call it from your own on_step.
class StepLogger {
 public:
  /// Writes to `out`, which must outlive the logger and its copies.
  explicit StepLogger(std::ostream& out, StepLoggerOptions options = {})
      : state_(std::make_shared<State>(checked(options))) {
    state_->out = &out;
    header(/*file_has_lines=*/false);
  }

  /// Writes to the file at `path` (replaced, or appended to with StepLoggerOptions::append).
  explicit StepLogger(const std::string& path, StepLoggerOptions options = {})
      : state_(std::make_shared<State>(checked(options))) {
    bool has_lines = false;
    if (options.append()) {
      std::ifstream existing(path, std::ios::binary | std::ios::ate);
      has_lines = existing.good() && existing.tellg() > 0;
    }
    state_->file.open(path, options.append() ? std::ios::app : std::ios::trunc);
    MIXPREC_CHECK(state_->file.is_open(), "StepLogger: cannot open '", path, "' for writing (",
                  std::strerror(errno), "): check that its directory exists and is writable");
    state_->out = &state_->file;
    header(has_lines);
  }

  /// The on_step callback: counts the report, and writes a line when it ends a step to write.
  void operator()(const StepReport& report) const {
    auto& s = *state_;
    if (!s.tally.add(report)) return;
    const bool skipped = report.status == StepStatus::skipped;
    if (skipped || report.step % s.options.every() == 0) write_line(report, skipped);
    s.tally.end_step();
  }

 private:
  struct State {
    explicit State(StepLoggerOptions o) : options(o) {}
    StepLoggerOptions options;
    std::ofstream file;
    std::ostream* out = nullptr;
    detail::StepTally tally;
  };

  static StepLoggerOptions checked(const StepLoggerOptions& options) {
    MIXPREC_CHECK(options.every() >= 1, "StepLoggerOptions::every must be >= 1, got ",
                  options.every());
    MIXPREC_CHECK(options.batch_size() >= 0, "StepLoggerOptions::batch_size must be >= 0 "
                  "(0: no samples_per_s), got ", options.batch_size());
    return options;
  }

  void header(bool file_has_lines) const {
    if (state_->options.format() == LogFormat::csv && !file_has_lines) {
      *state_->out << "step,loss,lr,scale,skipped,grad_norm,samples_per_s\n" << std::flush;
    }
  }

  void write_line(const StepReport& report, bool skipped) const {
    auto& s = *state_;
    const auto now = detail::StepTally::Clock::now();
    const double loss = s.tally.step_loss();
    std::string rate;
    if (s.options.batch_size() > 0) {
      const double per_s = s.tally.micro_batches_per_s(now);
      if (std::isfinite(per_s)) {
        rate = detail::fixed(per_s * static_cast<double>(s.options.batch_size()), 1);
      }
    }
    const bool json = s.options.format() == LogFormat::json_lines;
    // JSON has no inf or NaN: those are null there, and "inf"/"nan" in CSV.
    const auto value = [json](double v) {
      return json && !std::isfinite(v) ? std::string("null") : detail::number(v);
    };
    const auto optional = [&](const std::string& text) {
      return text.empty() && json ? std::string("null") : text;
    };
    const std::string grad_norm = report.grad_norm ? value(*report.grad_norm) : "";
    auto& out = *s.out;
    if (json) {
      out << "{\"step\":" << report.step << ",\"loss\":" << value(loss)
          << ",\"lr\":" << value(report.lr) << ",\"scale\":" << value(report.scale)
          << ",\"skipped\":" << (skipped ? "true" : "false")
          << ",\"grad_norm\":" << optional(grad_norm)
          << ",\"samples_per_s\":" << optional(rate) << "}\n";
    } else {
      out << report.step << ',' << value(loss) << ',' << value(report.lr) << ','
          << value(report.scale) << ',' << (skipped ? 1 : 0) << ',' << grad_norm << ',' << rate
          << '\n';
    }
    out.flush();  // a killed run keeps its lines
    MIXPREC_CHECK(out.good(), "StepLogger: the line of optimizer step ", report.step,
                  " could not be written (a full disk, a closed stream?): the log would go on "
                  "without it. The step itself was taken; fix the output and clear() the stream, "
                  "or log elsewhere");
    s.tally.end_line(now);
  }

  std::shared_ptr<State> state_;
};

}  // namespace mixprec
