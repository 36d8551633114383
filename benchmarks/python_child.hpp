#pragma once
// A long-lived Python process driven over a pipe, for the benchmarks that measure Python's side
// of a comparison: it prints "ready ..." first, then answers each command line with one line
// ("error ..." on failure). Interpreter start-up is paid once and not timed.

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace bench {

class PythonChild {
 public:
  /// Starts `python script args...`.
  PythonChild(const std::string& python, const std::string& script,
              const std::vector<std::string>& args = {})
      : description_(python) {
    description_.append(" ").append(script);
    int to_child[2];
    int from_child[2];
    if (pipe2(to_child, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    if (pipe2(from_child, O_CLOEXEC) != 0) {
      close(to_child[0]);
      close(to_child[1]);
      throw std::runtime_error("pipe2 failed");
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], STDOUT_FILENO);
    std::vector<std::string> words{python, script};
    words.insert(words.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    const int rc = posix_spawnp(&pid_, python.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(to_child[0]);
    close(from_child[1]);
    if (rc != 0) {
      close(to_child[1]);
      close(from_child[0]);
      std::string message = "cannot start ";
      message.append(description_).append(": ").append(std::strerror(rc));
      throw std::runtime_error(message);
    }
    to_ = fdopen(to_child[1], "w");
    from_ = fdopen(from_child[0], "r");
    try {
      ready_ = read_line();
      if (ready_.rfind("ready ", 0) != 0) {
        std::string message = description_;
        message.append(" did not start as expected; it said: ").append(ready_);
        throw std::runtime_error(message);
      }
    } catch (...) {
      close_and_wait();
      throw;
    }
  }

  ~PythonChild() { close_and_wait(); }

  PythonChild(const PythonChild&) = delete;
  PythonChild& operator=(const PythonChild&) = delete;

  /// "ready <torch version> <threads>", its first line.
  const std::string& ready() const noexcept { return ready_; }

  /// Sends one command line and returns the reply line; throws on an error reply or an exit.
  std::string request(const std::string& command) {
    if (std::fputs(command.c_str(), to_) < 0 || std::fputc('\n', to_) == EOF ||
        std::fflush(to_) != 0) {
      fail_exited();
    }
    auto reply = read_line();
    if (reply.rfind("error", 0) == 0) {
      std::string message = "the Python side failed on '";
      message.append(command).append("': ").append(reply);
      throw std::runtime_error(message);
    }
    return reply;
  }

 private:
  // Closing its stdin ends the child ("quit" first, for good measure); then it is reaped.
  void close_and_wait() noexcept {
    if (to_ != nullptr) {
      std::fputs("quit\n", to_);
      std::fclose(to_);
      to_ = nullptr;
    }
    if (from_ != nullptr) {
      std::fclose(from_);
      from_ = nullptr;
    }
    if (pid_ > 0) {
      int status = 0;
      waitpid(pid_, &status, 0);
      pid_ = -1;
    }
  }

  std::string read_line() {
    std::string line;
    int c = 0;
    while ((c = std::fgetc(from_)) != EOF && c != '\n') line.push_back(static_cast<char>(c));
    if (c == EOF && line.empty()) fail_exited();
    return line;
  }

  [[noreturn]] void fail_exited() const {
    std::string message = "the Python side (";
    message.append(description_)
        .append(") exited; it needs a Python whose torch is the LibTorch this was built against "
                "(the scripts set MIXPREC_PYTHON to it); its error is above");
    throw std::runtime_error(message);
  }

  std::string description_;
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
  std::string ready_;
};

}  // namespace bench
