#pragma once
/// ProgressLine: where a long run is, for a person watching it. On a terminal one line redrawn
/// in place (at most every ProgressOptions::refresh seconds); into a file, a pipe or a CI log
/// (not a terminal) a plain line every ProgressOptions::interval seconds instead, never a
/// carriage return or an escape code.
///
///   mixprec::ProgressLine progress(total_steps, mixprec::ProgressOptions().batch_size(64));
///   options.on_step([&](const mixprec::StepReport& r) { log(r); progress(r); });
///   ...
///   progress.finish();  // the last line, ended
///
/// Writes to std::cerr unless given a stream: mixprec never writes to stdout on its own.

#include <mixprec/core/error.hpp>
#include <mixprec/trainer/options.hpp>
#include <mixprec/trainer/step_log.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>

#if defined(_WIN32)
#include <io.h>
#else
#include <unistd.h>
#endif

namespace mixprec {

/// Settings of a ProgressLine (chainable).
class ProgressOptions {
 public:
  /// Samples per micro-batch, for the samples/s figure (0, the default: none shown).
  ProgressOptions& batch_size(std::int64_t value) { batch_size_ = value; return *this; }
  std::int64_t batch_size() const noexcept { return batch_size_; }
  /// On a terminal: redraw at most every this many seconds (0: every optimizer step).
  ProgressOptions& refresh(double seconds) { refresh_ = seconds; return *this; }
  double refresh() const noexcept { return refresh_; }
  /// Not a terminal: a line every this many seconds (0: every optimizer step), and the last.
  ProgressOptions& interval(double seconds) { interval_ = seconds; return *this; }
  double interval() const noexcept { return interval_; }
  /// Whether the stream is a terminal. Unset: std::cerr, std::clog and std::cout are asked
  /// (isatty); any other stream is not one.
  ProgressOptions& terminal(std::optional<bool> value) { terminal_ = value; return *this; }
  std::optional<bool> terminal() const noexcept { return terminal_; }

 private:
  std::int64_t batch_size_ = 0;
  double refresh_ = 0.2;
  double interval_ = 30.0;
  std::optional<bool> terminal_;
};

/// The progress of a run from its StepReports: step (of total), loss, lr, scale, skipped steps,
/// samples/s and the time left. Copies share one line (on_step takes a copy).
class ProgressLine {
 public:
  /// `total_steps`: the optimizer steps the run will make (0: unknown; no percentage, no ETA).
  explicit ProgressLine(std::int64_t total_steps = 0, ProgressOptions options = {})
      : ProgressLine(std::cerr, total_steps, options) {}

  /// Writes to `out`, which must outlive the line and its copies.
  ProgressLine(std::ostream& out, std::int64_t total_steps, ProgressOptions options = {})
      : state_(std::make_shared<State>(out, total_steps, checked(options))) {
    state_->terminal = options.terminal().value_or(is_terminal(out));
  }

  /// Whether this line redraws in place (the stream is a terminal).
  bool terminal() const noexcept { return state_->terminal; }

  /// The on_step callback.
  void operator()(const StepReport& report) const {
    auto& s = *state_;
    // A resumed run starts at its checkpoint's step, and a load() may take the run back: the
    // time left counts from there.
    const auto before = report.step - (report.status == StepStatus::accumulating ? 0 : 1);
    if (s.first_step < 0 || before < s.last_before) {
      s.first_step = before;
      s.start = Clock::now();
    }
    s.last_before = before;
    if (!s.tally.add(report)) return;
    if (report.status == StepStatus::skipped) ++s.skipped;
    const auto now = Clock::now();
    const double wait = s.terminal ? s.options.refresh() : s.options.interval();
    const bool last = s.total > 0 && report.step >= s.total;
    const double since = std::chrono::duration<double>(now - s.last_drawn).count();
    if (last || !s.drawn || since >= wait) draw(report, now);
    s.tally.end_step();
  }

  /// Ends the line on a terminal (a newline after the last redraw); nothing otherwise.
  void finish() const {
    auto& s = *state_;
    if (s.terminal && s.drawn && !s.finished) *s.out << '\n' << std::flush;
    s.finished = true;
  }

 private:
  using Clock = std::chrono::steady_clock;

  struct State {
    State(std::ostream& o, std::int64_t t, ProgressOptions p)
        : out(&o), total(t), options(p), start(Clock::now()) {}
    std::ostream* out;
    std::int64_t total;
    ProgressOptions options;
    Clock::time_point start;
    Clock::time_point last_drawn{};
    detail::StepTally tally;
    std::int64_t skipped = 0;
    std::int64_t first_step = -1;  // the optimizer steps made before the first report
    std::int64_t last_before = -1;  // ... before the latest report
    bool terminal = false;
    bool drawn = false;
    bool finished = false;
  };

  static ProgressOptions checked(const ProgressOptions& options) {
    MIXPREC_CHECK(options.batch_size() >= 0, "ProgressOptions::batch_size must be >= 0, got ",
                  options.batch_size());
    MIXPREC_CHECK(options.refresh() >= 0 && options.interval() >= 0 &&
                      std::isfinite(options.refresh()) && std::isfinite(options.interval()),
                  "ProgressOptions: refresh and interval must be finite seconds >= 0, got ",
                  options.refresh(), " and ", options.interval());
    return options;
  }

  static bool is_terminal(const std::ostream& out) {
    int fd = -1;
    if (&out == &std::cout) fd = 1;
    if (&out == &std::cerr || &out == &std::clog) fd = 2;
#if defined(_WIN32)
    return fd >= 0 && _isatty(fd) != 0;
#else
    return fd >= 0 && isatty(fd) != 0;
#endif
  }

  static std::string duration(double seconds) {
    const auto s = static_cast<std::int64_t>(std::llround(seconds));
    std::ostringstream text;
    if (s >= 3600) text << s / 3600 << 'h' << (s % 3600) / 60 << 'm';
    else if (s >= 60) text << s / 60 << 'm' << s % 60 << 's';
    else text << s << 's';
    return text.str();
  }

  void draw(const StepReport& report, Clock::time_point now) const {
    auto& s = *state_;
    std::ostringstream text;
    text << "step " << report.step;
    if (s.total > 0) {
      text << '/' << s.total << " (" << (100 * report.step) / s.total << "%)";
    }
    text << "  loss " << detail::number(static_cast<float>(s.tally.step_loss()))
         << "  lr " << detail::number(report.lr) << "  scale " << detail::number(report.scale);
    if (s.skipped > 0) text << "  skipped " << s.skipped;
    if (s.options.batch_size() > 0) {
      const double rate = s.tally.micro_batches_per_s(now) * static_cast<double>(s.options.batch_size());
      if (std::isfinite(rate)) text << "  " << detail::fixed(rate, 0) << " samples/s";
    }
    const double elapsed = std::chrono::duration<double>(now - s.start).count();
    if (s.total > report.step && report.step > s.first_step) {
      const double left = elapsed / static_cast<double>(report.step - s.first_step) *
                          static_cast<double>(s.total - report.step);
      text << "  eta " << duration(left);
    } else {
      text << "  " << duration(elapsed);
    }
    // A terminal's line is redrawn: back to its start, the text, the rest of the old one
    // erased (ESC [ K). Elsewhere each line stands on its own.
    if (s.terminal) {
      *s.out << '\r' << text.str() << "\x1b[K" << std::flush;
    } else {
      *s.out << text.str() << '\n' << std::flush;
    }
    s.drawn = true;
    s.last_drawn = now;
    s.tally.end_line(now);
  }

  std::shared_ptr<State> state_;
};

}  // namespace mixprec
