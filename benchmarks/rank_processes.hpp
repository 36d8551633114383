#pragma once
// Data-parallel ranks as processes of their own, for the benchmarks that measure them: started
// together, each with its command line and a few environment variables of its own, and waited
// for with a deadline. A rank that fails makes the others pointless (they would wait in their
// next collective until Gloo's timeout), so the rest are killed at once; and while they run, the
// machine's available memory is watched: the ranks of a model too large for it are killed
// before the kernel's OOM killer picks a process of someone else.

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

namespace bench {

/// MemAvailable of /proc/meminfo in MiB (what can be allocated without swapping); 0 where absent.
inline double available_mib() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (meminfo >> key) {
    if (key == "MemAvailable:") {
      meminfo >> kib;
      return kib / 1024.0;
    }
    meminfo.ignore(1 << 10, '\n');
  }
  return 0;
}

/// How a set of rank processes ended.
struct RanksOutcome {
  bool all_ok = false;           // every rank exited with status 0
  bool machine_memory = false;   // killed: the machine's available memory ran low
  bool deadline = false;         // killed: still running at the deadline
  std::vector<int> statuses;     // waitpid's status of each rank (-1: killed by us)
};

struct RankProcess {
  std::vector<std::string> argv;                            // argv[0]: the program's path
  std::vector<std::pair<std::string, std::string>> env;     // set on top of this environment
  std::string log;  // where its stdout and stderr go; empty: this process's
};

/// Starts every process, waits for all of them; kills the others as soon as one exits
/// non-zero, or all of them when MemAvailable falls under `reserve_mib` or at `deadline`.
inline RanksOutcome run_ranks(const std::vector<RankProcess>& ranks, double reserve_mib,
                              std::chrono::seconds deadline) {
  RanksOutcome outcome;
  std::vector<pid_t> pids;
  for (const auto& rank : ranks) {
    std::vector<std::string> env_text;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry(*e);
      bool replaced = false;
      for (const auto& [key, value] : rank.env) replaced = replaced || entry.rfind(key + "=", 0) == 0;
      if (!replaced) env_text.push_back(entry);
    }
    for (const auto& [key, value] : rank.env) env_text.push_back(key + "=" + value);
    std::vector<char*> envp;
    for (auto& e : env_text) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = rank.argv;
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    if (!rank.log.empty()) {
      posix_spawn_file_actions_addopen(&actions, 1, rank.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      posix_spawn_file_actions_adddup2(&actions, 1, 2);
    }
    pid_t pid = 0;
    if (posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), envp.data()) != 0) pid = 0;
    posix_spawn_file_actions_destroy(&actions);
    pids.push_back(pid);
  }
  outcome.statuses.assign(pids.size(), -1);
  std::size_t left = 0;
  for (const auto pid : pids) left += pid != 0 ? 1 : 0;
  bool failed = left < pids.size();
  const auto end = std::chrono::steady_clock::now() + deadline;
  const auto kill_all = [&] {
    for (auto& pid : pids) {
      if (pid == 0) continue;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      pid = 0;
    }
    left = 0;
  };
  while (left > 0) {
    for (std::size_t i = 0; i < pids.size(); ++i) {
      if (pids[i] == 0) continue;
      int status = 0;
      if (::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        outcome.statuses[i] = status;
        pids[i] = 0;
        --left;
        failed = failed || !WIFEXITED(status) || WEXITSTATUS(status) != 0;
      }
    }
    if (left == 0) break;
    if (failed) {
      kill_all();
    } else if (available_mib() < reserve_mib) {
      outcome.machine_memory = true;
      failed = true;
      kill_all();
    } else if (std::chrono::steady_clock::now() > end) {
      outcome.deadline = true;
      failed = true;
      kill_all();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  outcome.all_ok = !failed;
  return outcome;
}

}  // namespace bench
