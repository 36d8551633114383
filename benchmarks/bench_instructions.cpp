// Instructions per training step, counted by valgrind's callgrind: Trainer<FullPrecision>
// against the same loop written by hand, on models small enough that the Trainer's own work per
// step shows. Counts repeat exactly from run to run, where a 1 % timing on a shared machine is
// noise; they do not weigh memory traffic, so they measure the Trainer's overhead, not the
// speed of kernels (which both loops share).
//
//   ./build/default/benchmarks/bench_instructions [--smoke]
//
// The program runs itself under `valgrind --tool=callgrind` once per model (--child MODEL
// STEPS OUT): there, with one intra-op thread, both loops take their warm-up steps uncounted,
// then each runs STEPS steps with counting on, and callgrind writes one dump per loop.
#include <mixprec/mixprec.hpp>

#include "harness.hpp"
#include "models.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>
#include <valgrind/callgrind.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace bench_instructions {

namespace {

namespace models = bench::models;
constexpr std::uint64_t kSeed = 1234;
constexpr std::size_t kBatches = 8;
constexpr int kWarmup = 3;

struct Model {
  std::string name;   // --child argument
  std::string title;  // table row
  std::function<models::Bound()> bind;
};

models::Bound bind_mlp(std::shared_ptr<const std::vector<std::pair<at::Tensor, at::Tensor>>> data) {
  torch::manual_seed(kSeed);
  torch::nn::Sequential net(torch::nn::Linear(64, 128), torch::nn::ReLU(),
                            torch::nn::Linear(128, 10));
  models::Bound bound;
  bound.module = net.ptr();
  bound.loss = [net, data](std::size_t i) mutable {
    const auto& [x, y] = (*data)[i % data->size()];
    return torch::nn::functional::cross_entropy(net->forward(x), y);
  };
  return bound;
}

models::TaggerConfig tagger_config(bool tiny) {
  models::TaggerConfig c;  // small: d 32, 4 heads, seq 16, batch 8
  if (tiny) {
    c.d = 16;
    c.heads = 2;
    c.seq = 8;
    c.batch = 4;
  }
  return c;
}

std::vector<Model> all_models() {
  std::vector<Model> result;
  result.push_back({"mlp", "tiny MLP 64-128-10, batch 32", [] {
    torch::manual_seed(kSeed + 1);
    auto data = std::make_shared<std::vector<std::pair<at::Tensor, at::Tensor>>>();
    for (std::size_t i = 0; i < kBatches; ++i) {
      data->emplace_back(torch::randn({32, 64}), torch::randint(0, 10, {32}, at::kLong));
    }
    return bind_mlp(data);
  }});
  for (const bool tiny : {true, false}) {
    const auto c = tagger_config(tiny);
    std::string title = tiny ? "tiny tagger" : "small tagger";
    title.append(": d ").append(std::to_string(c.d)).append(", seq ").append(std::to_string(c.seq))
        .append(", batch ").append(std::to_string(c.batch));
    result.push_back({tiny ? "tiny-tagger" : "small-tagger", title, [c] {
      torch::manual_seed(kSeed + 1);
      auto data = std::make_shared<const std::vector<models::TokenBatch>>(
          models::token_batches(kBatches, c));
      return models::bind_tagger(kSeed, c, models::mixprec_softmax<mixprec::FullPrecision>, data);
    }});
  }
  return result;
}

// ---------------------------------------------------------------------------------------------
// The child, under callgrind.

int child_main(const std::string& name, int steps) {
  at::set_num_threads(1);  // one thread: counts that do not depend on scheduling
  const auto models_list = all_models();
  const Model* model = nullptr;
  for (const auto& m : models_list) model = m.name == name ? &m : model;
  if (model == nullptr) throw std::runtime_error("unknown model " + name);

  // The hand-written loop, twice: the second is the A/A control, the difference between two
  // identical loops (allocation addresses, and so the kernels' alignment paths, differ).
  struct Hand {
    models::Bound net;
    torch::optim::Adam optimizer;
    std::size_t cursor = 0;
    at::Tensor loss;
    explicit Hand(models::Bound bound)
        : net(std::move(bound)),
          optimizer(net.module->parameters(), torch::optim::AdamOptions(1e-3)) {}
    void operator()(int n) {
      for (int i = 0; i < n; ++i) {
        optimizer.zero_grad();
        loss = net.loss(cursor++);
        loss.backward();
        optimizer.step();
      }
    }
  };
  Hand hand(model->bind()), control(model->bind());

  auto trainer_net = model->bind();
  torch::optim::Adam trainer_optimizer(trainer_net.module->parameters(),
                                       torch::optim::AdamOptions(1e-3));
  mixprec::Trainer<mixprec::FullPrecision> trainer(trainer_net.module, trainer_optimizer);
  std::size_t trainer_cursor = 0;
  at::Tensor trainer_loss;
  auto trained = [&](int n) {
    for (int i = 0; i < n; ++i) {
      trainer_loss = trainer.step([&] { return trainer_net.loss(trainer_cursor); }).loss;
      ++trainer_cursor;
    }
  };

  CALLGRIND_START_INSTRUMENTATION;
  hand(kWarmup);
  trained(kWarmup);
  control(kWarmup);
  CALLGRIND_TOGGLE_COLLECT;
  hand(steps);
  CALLGRIND_TOGGLE_COLLECT;
  CALLGRIND_DUMP_STATS_AT("hand");
  CALLGRIND_TOGGLE_COLLECT;
  trained(steps);
  CALLGRIND_TOGGLE_COLLECT;
  CALLGRIND_DUMP_STATS_AT("trainer");
  CALLGRIND_TOGGLE_COLLECT;
  control(steps);
  CALLGRIND_TOGGLE_COLLECT;
  CALLGRIND_DUMP_STATS_AT("control");
  // The same weights, data and ops: the same losses (printed for the parent to compare).
  std::printf("losses %.9g %.9g\n", hand.loss.item<double>(), trainer_loss.item<double>());
  return 0;
}

// ---------------------------------------------------------------------------------------------
// The parent.

struct Counts {
  std::map<std::string, double> instructions;  // by dump name: "hand", "trainer"
  std::string losses;
};

// callgrind's dumps OUT.1, OUT.2, ...: the trigger's name and the total instruction count.
std::map<std::string, double> read_dumps(const std::filesystem::path& out) {
  std::map<std::string, double> result;
  for (int i = 1;; ++i) {
    std::ifstream file(out.string() + "." + std::to_string(i));
    if (!file) break;
    std::string line, name;
    double total = -1;
    while (std::getline(file, line)) {
      const std::string trigger = "desc: Trigger: Client Request: ";
      if (line.rfind(trigger, 0) == 0) name = line.substr(trigger.size());
      if (line.rfind("totals: ", 0) == 0) total = std::stod(line.substr(8));
    }
    if (!name.empty() && total >= 0) result[name] = total;
  }
  return result;
}

Counts count(const char* self, const std::string& model, int steps,
             const std::filesystem::path& dir) {
  const auto out = dir / ("callgrind." + model);
  const auto log = dir / ("child." + model + ".log");
  std::vector<std::string> args = {"valgrind", "--tool=callgrind", "--instr-atstart=no",
                                   "--collect-atstart=no", "--callgrind-out-file=" + out.string(),
                                   "--log-file=" + (dir / ("valgrind." + model + ".log")).string(),
                                   self, "--child", model, std::to_string(steps)};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, "valgrind", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error("cannot start valgrind (apt-get install valgrind)");
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw std::runtime_error("the callgrind child for " + model + " failed; see " + log.string());
  }
  Counts counts;
  counts.instructions = read_dumps(out);
  std::ifstream output(log);
  std::string line;
  while (std::getline(output, line)) {
    if (line.rfind("losses ", 0) == 0) counts.losses = line.substr(7);
  }
  if (counts.instructions.count("hand") == 0 || counts.instructions.count("trainer") == 0 ||
      counts.instructions.count("control") == 0) {
    throw std::runtime_error("callgrind wrote no counts for " + model);
  }
  return counts;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 4 && std::string(argv[1]) == "--child") {
      return child_main(argv[2], std::stoi(argv[3]));
    }
    const auto options = bench::parse_options(argc, argv);
    const int steps = options.smoke ? 2 : 20;
    const auto dir = std::filesystem::temp_directory_path() /
                     ("mixprec_bench_instructions." + std::to_string(getpid()));
    std::filesystem::create_directories(dir);
    std::printf("## bench_instructions: instructions per step, Trainer vs hand-written loop\n\n"
                "Command: `./build/default/benchmarks/bench_instructions%s`. Counted by "
                "`valgrind --tool=callgrind` (instructions executed, Ir), one intra-op thread, "
                "Adam, %d counted steps per loop after %d warm-up steps; the same weights and "
                "data in both loops. Target: Trainer<FullPrecision> at most 1 %% over the hand "
                "loop.\n\n| model | hand loop Ir/step | Trainer Ir/step | ratio Trainer / hand "
                "| over the hand loop | A/A control: a second hand loop over the first | same last loss "
                "| target | met |\n|---|---:|---:|---:|---:|---:|---|---|---|\n",
                options.smoke ? " --smoke" : "", steps, kWarmup);
    std::fflush(stdout);
    for (const auto& model : all_models()) {
      if (options.smoke && model.name != "mlp") continue;
      const auto counts = count(argv[0], model.name, steps, dir);
      const double hand = counts.instructions.at("hand") / steps;
      const double trainer = counts.instructions.at("trainer") / steps;
      const double ratio = trainer / hand;
      const auto space = counts.losses.find(' ');
      const bool same = space != std::string::npos &&
                        counts.losses.substr(0, space) == counts.losses.substr(space + 1);
      const double control = counts.instructions.at("control") / steps;
      std::printf("| %s | %.0f | %.0f | %.4f | %+.2f %% | %+.2f %% | %s (%s) | <= 1 %% | %s |\n",
                  model.title.c_str(), hand, trainer, ratio, (ratio - 1.0) * 100.0,
                  (control / hand - 1.0) * 100.0, same ? "yes" : "no", counts.losses.c_str(),
                  ratio <= 1.01 ? "yes" : "**no**");
      std::fflush(stdout);
    }
    std::filesystem::remove_all(dir);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "bench_instructions: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace bench_instructions
