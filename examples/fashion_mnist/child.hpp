#pragma once
// How the demo starts a child process: this program again (/proc/self/exe) with the parent's
// environment, plus what the parent decided once for the whole process tree (the fp16
// convolution decision in MIXPREC_FP16_CONV_WEIGHT_GRAD), so that no child decides again.

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace fashion_mnist {

/// `parent` (a null-terminated array of "NAME=value", as environ) with `name` set to `value`:
/// an earlier entry of `name` is replaced, the others kept in order.
inline std::vector<std::string> environment_with(char* const* parent, const std::string& name,
                                                 const std::string& value) {
  std::vector<std::string> env;
  const std::string prefix = name + "=";
  for (char* const* entry = parent; entry != nullptr && *entry != nullptr; ++entry) {
    if (std::string(*entry).rfind(prefix, 0) != 0) env.emplace_back(*entry);
  }
  env.push_back(prefix + value);
  return env;
}

/// Runs this program again with `args` (args[0]: the name it sees) and `env`; throws unless it
/// exits with status 0. `what` names the child in the message.
inline void run_self(std::vector<std::string> args, std::vector<std::string> env,
                     const std::string& what) {
  const auto pointers = [](std::vector<std::string>& strings) {
    std::vector<char*> p;
    for (auto& s : strings) p.push_back(s.data());
    p.push_back(nullptr);
    return p;
  };
  auto argv = pointers(args);
  auto envp = pointers(env);
  pid_t pid = 0;
  if (const int error = ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(),
                                      envp.data());
      error != 0) {
    throw std::runtime_error("cannot start a child process: " + std::string(std::strerror(error)));
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      throw std::runtime_error("waitpid failed: " + std::string(std::strerror(errno)));
    }
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw std::runtime_error(what + ": the child process failed (status " +
                             std::to_string(status) + ")");
  }
}

}  // namespace fashion_mnist
