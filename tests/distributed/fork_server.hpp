#pragma once
// Rank processes for the distributed tests, forked from a copy of the test binary made first
// thing in main(): LibTorch is loaded and initialized there, but no test case has run, no thread
// has started and no generator has moved. A rank forked from it starts as a rank exec'd from the
// binary would (the same arguments, a log of its own as stdout and stderr, exit() at the end),
// without loading and initializing LibTorch again: under AddressSanitizer against Debian's
// LibTorch 1.13 that took 1.6 s a rank, and the sharded cases alone start 92 ranks (docs/ci.md).
// The test process itself cannot be forked: by the time a case starts ranks, other cases have
// left Gloo's threads (and, unless OMP_NUM_THREADS=1, OpenMP's pool) in it.
//
// The test process is a child subreaper: the server forks a middle process that forks the rank
// and exits, so the rank becomes the test process's child, which waitpid()s and kills it as any
// child of its own.
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace test::fork_server {

// What a rank runs: its arguments in, its exit code out.
using Entry = int (*)(const std::vector<std::string>& args);

namespace detail {

struct Server {
  int socket = -1;  // the test process's end; -1: not started
};

inline Server& server() {
  static Server s;
  return s;
}

inline bool write_all(int fd, const void* data, std::size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::send(fd, bytes, size, MSG_NOSIGNAL);
    if (n <= 0) return false;
    bytes += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

inline bool read_all(int fd, void* data, std::size_t size) {
  auto* bytes = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = ::read(fd, bytes, size);
    if (n <= 0) return false;  // end of file: the other side is gone
    bytes += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

// A message: a count, then each string as its length and its bytes.
inline bool send_strings(int fd, const std::vector<std::string>& strings) {
  const auto count = static_cast<std::uint32_t>(strings.size());
  if (!write_all(fd, &count, sizeof count)) return false;
  for (const auto& s : strings) {
    const auto size = static_cast<std::uint32_t>(s.size());
    if (!write_all(fd, &size, sizeof size) || !write_all(fd, s.data(), s.size())) return false;
  }
  return true;
}

inline bool receive_strings(int fd, std::vector<std::string>& strings) {
  std::uint32_t count = 0;
  if (!read_all(fd, &count, sizeof count)) return false;
  strings.assign(count, {});
  for (auto& s : strings) {
    std::uint32_t size = 0;
    if (!read_all(fd, &size, sizeof size)) return false;
    s.resize(size);
    if (!read_all(fd, s.data(), size)) return false;
  }
  return true;
}

// The rank: stdout and stderr to the log, the entry, exit() with its code (atexit handlers and
// LeakSanitizer's check run, as at the end of main()).
[[noreturn]] inline void become_rank(const std::vector<std::string>& message, Entry entry) {
  const int log = ::open(message[0].c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log < 0 || ::dup2(log, 1) < 0 || ::dup2(log, 2) < 0) ::_exit(127);
  ::close(log);
  std::exit(entry(std::vector<std::string>(message.begin() + 1, message.end())));
}

// The server's loop: one rank per request, its pid back; gone when the test process is.
[[noreturn]] inline void serve(int socket, Entry entry) {
  for (;;) {
    std::vector<std::string> message;  // the log's path, then the rank's arguments
    if (!receive_strings(socket, message) || message.empty()) ::_exit(0);
    pid_t rank = -1;
    int handoff[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, handoff) == 0) {
      const pid_t middle = ::fork();
      if (middle == 0) {
        ::close(handoff[0]);
        const pid_t child = ::fork();
        if (child == 0) {
          ::close(handoff[1]);
          ::close(socket);
          become_rank(message, entry);
        }
        write_all(handoff[1], &child, sizeof child);
        ::_exit(0);
      }
      ::close(handoff[1]);
      if (middle > 0) {
        if (!read_all(handoff[0], &rank, sizeof rank)) rank = -1;
        // Once the middle process is reaped its child is the test process's (the subreaper's).
        ::waitpid(middle, nullptr, 0);
      }
      ::close(handoff[0]);
    }
    if (!write_all(socket, &rank, sizeof rank)) ::_exit(0);
  }
}

}  // namespace detail

// Forks the server; call it first in main(), before anything starts a thread. Returns false
// (and the tests fail at their first rank) where it could not.
inline bool start(Entry entry) {
  auto& s = detail::server();
  if (s.socket >= 0) return true;
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) return false;
  int ends[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0) return false;
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) {
    ::close(ends[0]);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(0);
    detail::serve(ends[1], entry);
  }
  ::close(ends[1]);
  s.socket = ends[0];
  return true;
}

// Starts a rank running entry(args), its stdout and stderr to `log` (created or truncated).
// Returns its pid, a child of this process, or -1 where the server is not running.
inline pid_t spawn(const std::string& log, const std::vector<std::string>& args) {
  auto& s = detail::server();
  if (s.socket < 0) return -1;
  std::vector<std::string> message{log};
  message.insert(message.end(), args.begin(), args.end());
  pid_t rank = -1;
  if (!detail::send_strings(s.socket, message) || !detail::read_all(s.socket, &rank, sizeof rank)) {
    return -1;
  }
  return rank;
}

}  // namespace test::fork_server
