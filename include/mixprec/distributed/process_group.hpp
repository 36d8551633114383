#pragma once
/// Process groups from a launcher's environment: torchrun's variables (RANK, WORLD_SIZE,
/// MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE) or scripts/launch's, which are the
/// same. Gloo needs its headers (Debian: libgloo-dev), NCCL a CUDA LibTorch; the CMake target
/// mixprec::distributed defines MIXPREC_C10D_GLOO / MIXPREC_C10D_NCCL where it finds them (not
/// Torch's USE_C10D_*, which the CUDA wheel defines on every program, headers found or not).
///
///   auto env = mixprec::LaunchEnvironment::from_env();
///   auto group = mixprec::gloo_group(env);            // every rank, collectively
///   trainer_options.distributed(mixprec::DistributedOptions(group));

#include <mixprec/distributed/options.hpp>
#include <mixprec/io/checkpoint_file.hpp>  // message_of
#include <mixprec/core/error.hpp>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef MIXPREC_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef MIXPREC_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace mixprec {

/// Where this process stands in a launch, as torchrun describes it.
struct LaunchEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  std::uint16_t master_port = 29500;
  /// torchrun's agent serves the store (TORCHELASTIC_USE_AGENT_STORE=True): every rank is a
  /// client; otherwise rank 0 serves it.
  bool agent_store = false;
  /// TORCHELASTIC_RESTART_COUNT: a restarted launch uses fresh store keys.
  int restart_count = 0;

  /// Reads the variables; without RANK and WORLD_SIZE, a single process (rank 0 of 1).
  /// Malformed values are an Error that names the variable.
  static LaunchEnvironment from_env() {
    LaunchEnvironment env;
    const char* rank = std::getenv("RANK");
    const char* world = std::getenv("WORLD_SIZE");
    MIXPREC_CHECK((rank == nullptr) == (world == nullptr), "the launch environment sets ",
                  rank ? "RANK but not WORLD_SIZE" : "WORLD_SIZE but not RANK",
                  ": start the processes with torchrun or scripts/launch, which set both");
    if (rank == nullptr) return env;
    env.world_size = integer("WORLD_SIZE", world, 1, 1 << 20);
    env.rank = integer("RANK", rank, 0, env.world_size - 1);
    if (const char* local = std::getenv("LOCAL_RANK")) {
      env.local_rank = integer("LOCAL_RANK", local, 0, 1 << 20);
    }
    const char* addr = std::getenv("MASTER_ADDR");
    const char* port = std::getenv("MASTER_PORT");
    MIXPREC_CHECK(addr != nullptr && port != nullptr, "RANK and WORLD_SIZE are set but ",
                  addr ? "MASTER_PORT" : "MASTER_ADDR", " is not: set MASTER_ADDR and "
                  "MASTER_PORT to rank 0's host and a free port (torchrun does)");
    env.master_addr = addr;
    env.master_port = static_cast<std::uint16_t>(integer("MASTER_PORT", port, 1, 65535));
    if (const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE")) {
      env.agent_store = std::string(agent) == "True" || std::string(agent) == "1";
    }
    if (const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT")) {
      env.restart_count = integer("TORCHELASTIC_RESTART_COUNT", restarts, 0, 1 << 30);
    }
    return env;
  }

 private:
  static int integer(const char* name, const char* text, long low, long high) {
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    MIXPREC_CHECK(end != text && *end == '\0' && value >= low && value <= high, "the launch "
                  "environment's ", name, "='", text, "' is not an integer in [", low, ", ",
                  high, "]");
    return static_cast<int>(value);
  }
};

/// The rendezvous store of a launch: a TCPStore at MASTER_ADDR:MASTER_PORT (served by rank 0,
/// or by torchrun's agent), under a prefix per restart. Collective: waits for every rank
/// up to `timeout`.
inline c10::intrusive_ptr<c10d::Store> launch_store(
    const LaunchEnvironment& env, std::chrono::milliseconds timeout = std::chrono::minutes(5)) {
  c10d::TCPStoreOptions options;
  options.port = env.master_port;
  options.isServer = env.rank == 0 && !env.agent_store;
  options.numWorkers = static_cast<std::size_t>(env.world_size);
  options.waitWorkers = !env.agent_store;
  options.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
  } catch (const std::exception& e) {
    detail::fail("rank ", env.rank, ": cannot reach the rendezvous store at ", env.master_addr,
                 ":", env.master_port, " (", options.isServer ? "serving" : "as a client", "): ",
                 detail::message_of(e), ". Check MASTER_ADDR/MASTER_PORT and that every rank "
                 "starts within the timeout");
  }
  return c10::make_intrusive<c10d::PrefixStore>(
      "/worker/attempt_" + std::to_string(env.restart_count) + "/mixprec/", store);
}

namespace detail {
// A write to the socket of a peer that died raises SIGPIPE, whose default action ends the
// process before Gloo can report the failure. Python ignores SIGPIPE from its start, so Gloo's
// errors reach PyTorch users as exceptions; the same here, unless the program chose a handler.
inline void ignore_default_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    std::signal(SIGPIPE, SIG_IGN);
  }
}
}  // namespace detail

#ifdef MIXPREC_C10D_GLOO
/// A Gloo process group over `store` (CPU tensors). A peer lost mid-collective is an Error in
/// the others, not their death by SIGPIPE: SIGPIPE is ignored if its action was the default,
/// as in Python. Collectives that wait longer than
/// `timeout` (a dead or stalled peer) throw. Loopback addresses use the loopback device;
/// otherwise GLOO_SOCKET_IFNAME, or the interface of this host's name, as PyTorch does.
inline c10::intrusive_ptr<ProcessGroup> gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
    std::chrono::milliseconds timeout = std::chrono::minutes(5),
    const std::string& address = "127.0.0.1") {
  detail::ignore_default_sigpipe();
  try {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    if (const char* interface = std::getenv("GLOO_SOCKET_IFNAME")) {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
    } else if (address.rfind("127.", 0) == 0 || address == "localhost") {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(address));
    } else {
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, options);
  } catch (const std::exception& e) {
    detail::fail("rank ", rank, ": cannot create the Gloo process group of ", world_size,
                 " ranks: ", detail::message_of(e));
  }
}

/// gloo_group from a launch environment: its store, its rank and world size.
inline c10::intrusive_ptr<ProcessGroup> gloo_group(
    const LaunchEnvironment& env, std::chrono::milliseconds timeout = std::chrono::minutes(5)) {
  return gloo_group(launch_store(env, timeout), env.rank, env.world_size, timeout,
                    env.master_addr);
}
#endif

#ifdef MIXPREC_C10D_NCCL
inline constexpr bool nccl_available = true;
#else
inline constexpr bool nccl_available = false;
#endif

/// An NCCL process group over `store` (CUDA tensors; one device per rank, usually LOCAL_RANK).
/// Where LibTorch has no NCCL (nccl_available false: a CPU build), an Error.
inline c10::intrusive_ptr<ProcessGroup> nccl_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
    std::chrono::milliseconds timeout = std::chrono::minutes(5)) {
#ifdef MIXPREC_C10D_NCCL
  try {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, options);
  } catch (const std::exception& e) {
    detail::fail("rank ", rank, ": cannot create the NCCL process group of ", world_size,
                 " ranks: ", detail::message_of(e));
  }
#else
  (void)store;
  (void)timeout;
  detail::fail("rank ", rank, ": nccl_group() of ", world_size, " ranks: this LibTorch (",
               torch_version, ") was built without NCCL (a CPU build); use gloo_group(), "
               "or a CUDA build of LibTorch");
#endif
}

/// nccl_group from a launch environment.
inline c10::intrusive_ptr<ProcessGroup> nccl_group(
    const LaunchEnvironment& env, std::chrono::milliseconds timeout = std::chrono::minutes(5)) {
  return nccl_group(launch_store(env, timeout), env.rank, env.world_size, timeout);
}

}  // namespace mixprec
