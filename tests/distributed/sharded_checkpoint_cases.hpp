// Sharded checkpoints (include/mixprec/trainer/sharded_save.hpp, sharded_load.hpp), with real
// ranks: saved on 3 ranks, loaded on 2, 1 and 4 (and unsharded, and in one plain process),
// bitwise, for ZeRO-1, 2, 3 under fp32 masters with a GradScaler, RemainderMasters<BFloat16>
// and PureHalf<BFloat16, StochasticRounding<>>; a rank killed at every phase of a save; damaged,
// missing and foreign files, a layout that cannot be served, a full disk; the streamed fp32
// export read by Python with load_state_dict(strict=True).
//
// Included by test_distributed.cpp after its helpers (the rank harness, UnitNet, batches), as
// part of the same translation unit: its cases run as ctest's test_sharded_checkpoint
// (`--file sharded_checkpoint_cases.hpp`).

namespace {

namespace ckpt {

namespace fs = std::filesystem;
using mp::detail::SavePhase;

// MixedO2<BFloat16> with a dynamic GradScaler, so that the scale and its tracker move.
struct ScaledZero : mp::MixedO2<at::BFloat16> {
  static constexpr std::string_view name = "ScaledZero";
  using scaler_type = mp::GradScaler;
};
using Remainder = mp::MixedO2<at::BFloat16, mp::RemainderMasters<at::BFloat16>>;
using Rounded = mp::PureHalf<at::BFloat16, mp::StochasticRounding<>>;

constexpr int kSaveSteps = 3;

template <class P>
mp::TrainerOptions options_of() {
  auto options = mp::TrainerOptions().max_grad_norm(0.5).lr_lambda(
      [](std::int64_t step) { return 1.0 / static_cast<double>(1 + step); });
  if constexpr (std::is_same_v<typename P::scaler_type, mp::GradScaler>) {
    options.scaler(mp::GradScalerOptions().init_scale(1 << 10).growth_interval(2));
  }
  return options;
}

mp::DistributedOptions sharding(Rank& r, int stage) {
  auto options = zero_options(r, std::min(stage, 2));
  if (stage == 3) options.shard_parameters(kUnits);
  return options;
}

// A model and its optimizer, trained (or loaded) by a Trainer<P>; `stage` -1: one plain
// process, 0: unsharded data parallel, 1-3: ZeRO's stages.
template <class P>
struct Setup {
  UnitNet net;
  torch::optim::AdamW optimizer;
  mp::Trainer<P> trainer;
  Setup(Rank* r, int stage, std::uint64_t seed)
      : net(dyadic_unit_net(seed)),
        optimizer(net->parameters(),
                  torch::optim::AdamWOptions(1.0 / 32).weight_decay(0.0625).eps(1.0 / 1024)),
        trainer(net, optimizer, stage < 0 ? options_of<P>() : options_of<P>().distributed(sharding(*r, stage))) {}
  // Step k of the run on this rank's rows (all rows in one process); an inf at step 1.
  void step(int k, int rank, int world) {
    const auto data = batches(kSaveSteps + 2, kZeroRows, /*inf_step=*/1);
    const auto rows = kZeroRows / world;
    const auto x = data[static_cast<std::size_t>(k)].x.narrow(0, rank * rows, rows);
    const auto y = data[static_cast<std::size_t>(k)].y.narrow(0, rank * rows, rows);
    trainer.step([&] { return (net->forward(trainer.cast_input(x)).to(torch::kFloat) - y).pow(2).mean(); });
  }
};

// What a checkpoint holds, read by one plain process: the parameters, the masters' fp32
// values, AdamW's state tensor by tensor with its step, the scaler's state, the lr, the
// counters, the CPU RNG state; then what one more step makes of it (the rounding's seed and
// count, the schedule), parameters and fp32 weights.
template <class P>
std::vector<torch::Tensor> contents(const std::string& path) {
  Setup<P> s(nullptr, -1, 77);
  if (path.size() > 8 && path.substr(path.size() - 8) == ".archive") {
    torch::load(s.trainer, path);  // the consolidated archive: the single-file reader
  } else {
    s.trainer.load(path);
  }
  auto result = snapshot(s.net->parameters());
  for (const auto& m : s.trainer.master_weights()) result.push_back(m.clone());
  for (const auto& group : s.optimizer.param_groups()) {
    result.push_back(torch::tensor({group.options().get_lr()}, torch::kDouble));
    for (const auto& p : group.params()) {
      auto* state = mp::detail::state_of(s.optimizer, p);
      if (state == nullptr) continue;
      auto& adamw = static_cast<torch::optim::AdamWParamState&>(*state);
      result.push_back(adamw.exp_avg().clone());
      result.push_back(adamw.exp_avg_sq().clone());
      result.push_back(torch::tensor({adamw.step()}));
    }
  }
  for (const auto& item : s.trainer.scaler().state_dict()) {
    const auto& v = item.value();
    result.push_back(torch::tensor({v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt())},
                                   torch::kDouble));
  }
  const auto stats = s.trainer.stats();
  result.push_back(torch::tensor({stats.steps, stats.skipped_steps, stats.micro_batches}));
  result.push_back(mp::detail::cpu_rng_state());
  s.step(kSaveSteps, 0, 1);
  for (const auto& p : s.net->parameters()) result.push_back(p.detach().clone());
  for (const auto& item : s.trainer.fp32_state_dict()) result.push_back(item.value().clone());
  return result;
}

// ---- resharding: 3 -> 2 -> 1 -> 4 ranks, every stage under three storages

struct Config {
  std::string name;
  int stage;
  std::function<void(Rank&, int stage, const fs::path& from, const fs::path& to)> run;
  std::function<std::vector<torch::Tensor>(const std::string&)> contents;
};

// Saved (`from` empty: trained kSaveSteps steps first) or loaded from `from`, then saved to
// `to` at once; on 2 ranks unsharded data parallel loads it too and writes one file.
template <class P>
void reshard(Rank& r, int stage, const fs::path& from, const fs::path& to) {
  Setup<P> s(&r, stage, 500 + static_cast<std::uint64_t>(r.rank));  // rank 0's values reach all
  mp::UserValues user{{"epoch", c10::IValue(std::int64_t{7})}};
  if (from.empty()) {
    for (int k = 0; k < kSaveSteps; ++k) s.step(k, r.rank, r.world);
  } else {
    user = s.trainer.load(from.string());
  }
  RANK_EXPECT(s.trainer.stats().steps == kSaveSteps, "at step " << s.trainer.stats().steps);
  RANK_EXPECT(user.count("epoch") == 1 && user.at("epoch").toInt() == 7, "the user's values");
  s.trainer.save(to.string(), user);
  RANK_EXPECT(fs::is_directory(to), "a sharded save writes a directory");
  if (from.empty()) {  // the reference, by another road: the consolidated archive (every rank
                       // gathers, rank 0 writes), read back by the single-file reader
    torch::serialize::OutputArchive archive;
    s.trainer.save(archive);
    if (r.rank == 0) archive.save_to((to.parent_path() / "consolidated_x3.archive").string());
  }
  if (r.world == 2 && !from.empty()) {  // unsharded data parallel, from the same directory
    Setup<P> plain(&r, 0, 900 + static_cast<std::uint64_t>(r.rank));
    plain.trainer.load(from.string());
    plain.trainer.save((to.parent_path() / "unsharded_x2.ckpt").string());
  }
}

template <class P>
Config config(const std::string& policy, int stage) {
  return {policy + "_zero" + std::to_string(stage), stage, reshard<P>, contents<P>};
}

const std::vector<Config>& configs() {
  static const std::vector<Config> all{
      config<ScaledZero>("fp32", 1),  config<ScaledZero>("fp32", 2),  config<ScaledZero>("fp32", 3),
      config<Remainder>("remainder", 1), config<Remainder>("remainder", 2), config<Remainder>("remainder", 3),
      config<Rounded>("rounded", 1),  config<Rounded>("rounded", 2),  config<Rounded>("rounded", 3),
  };
  return all;
}

const std::vector<int> kChain{3, 2, 1, 4};

// One link of the chain on r.world ranks: every configuration, loaded from the last link's
// directory and saved to this one's.
void case_reshard(Rank& r) {
  const auto root = fs::path(r.dir).parent_path();
  const auto at = std::find(kChain.begin(), kChain.end(), r.world);
  for (const auto& c : configs()) {
    const auto from = at == kChain.begin() ? fs::path() : root / c.name / ("x" + std::to_string(*(at - 1)));
    c.run(r, c.stage, from, root / c.name / ("x" + std::to_string(r.world)));
  }
}

// A tensor of a checkpoint read by rank-free means: the index and the shards' files.
torch::Tensor saved_tensor(const fs::path& dir, const std::string& name) {
  std::ifstream in(dir / "index.json");
  std::stringstream text;
  text << in.rdbuf();
  const auto index = mp::detail::parse_index(text.str(), (dir / "index.json").string());
  const auto& t = index.tensors.at(name);
  auto out = torch::empty({t.numel()}, t.dtype);
  for (const auto& piece : t.pieces) {
    mp::detail::SafetensorsFile file((dir / index.shard_file(piece.rank).name).string());
    auto part = out.narrow(0, piece.from, piece.count);
    file.read(*file.find(name), 0, part);
  }
  return out.view(t.shape);
}

bool has_tensor(const fs::path& dir, const std::string& name) {
  std::ifstream in(dir / "index.json");
  std::stringstream text;
  text << in.rdbuf();
  return mp::detail::parse_index(text.str(), "index").tensors.count(name) == 1;
}

// ---- a rank killed at each phase of a save

constexpr int kPhases = 8;

using KillPolicy = Remainder;  // ZeRO-3 units with lean masters and bf16 moments

// Rank 1 dies while the shards are written (phases before every rank agreed); rank 0 from
// then on, through its commit (a rank 1 that dies after agreeing would leave rank 0 to commit).
int victim_of(int phase) {
  return phase <= static_cast<int>(SavePhase::shard_written) ? 1 : 0;
}

// Saves A, trains a step, saves B (copies of each apart), then saves B again over A in `ckpt`
// with rank victim_of(phase) killed at `phase`: its survivor throws an Error that names the
// directory and says what it holds.
void case_kill_save(Rank& r, int phase) {
  const auto root = fs::path(r.dir).parent_path();
  Setup<KillPolicy> s(&r, 3, 700 + static_cast<std::uint64_t>(r.rank));
  for (int k = 0; k < 2; ++k) s.step(k, r.rank, r.world);
  const auto ckpt = (root / "ckpt").string();
  s.trainer.save(ckpt);
  s.trainer.save((root / "A").string());
  s.step(2, r.rank, r.world);
  s.trainer.save((root / "B").string());
  mp::detail::sharded_save_hook() = [phase](SavePhase now, int rank) {
    if (static_cast<int>(now) == phase && rank == victim_of(phase)) std::raise(SIGKILL);
  };
  try {
    s.trainer.save(ckpt);
    RANK_EXPECT(false, "no Error after a peer died at phase " << phase);
  } catch (const mp::Error& e) {
    const std::string message = e.what();
    std::cerr << "rank " << r.rank << ": " << message << "\n";
    RANK_EXPECT(message.find(ckpt) != std::string::npos, message);
    RANK_EXPECT(message.find("intact") != std::string::npos ||
                    message.find("the checkpoint its index names") != std::string::npos,
                message);
  }
}

// Every kill's directory loaded and saved again: what the crash left (a save's files without
// an index, a temporary) is removed, the save's four files stay.
void case_kill_cleanup(Rank& r) {
  const auto root = fs::path(r.dir).parent_path();
  for (int phase = 0; phase < kPhases; ++phase) {
    const auto ckpt = root / ("phase" + std::to_string(phase)) / "ckpt";
    Setup<KillPolicy> s(&r, 3, 800 + static_cast<std::uint64_t>(r.rank));
    s.trainer.load(ckpt.string());
    s.trainer.save(ckpt.string());
  }
}

// ---- bad input: every rank throws, nothing changes

using BadPolicy = ScaledZero;

// The state a failed load must leave as it was: this rank's parameters, pieces, their state.
std::vector<torch::Tensor> held(Setup<BadPolicy>& s) {
  auto result = snapshot(s.net->parameters());
  for (const auto& p : s.optimizer.param_groups()[0].params()) {
    result.push_back(p.detach().clone());
    if (auto* state = mp::detail::state_of(s.optimizer, p)) {
      result.push_back(static_cast<torch::optim::AdamWParamState&>(*state).exp_avg().clone());
    }
  }
  result.push_back(torch::tensor({s.trainer.scaler().get_scale()}, torch::kDouble));
  return result;
}

void copy_dir(const fs::path& from, const fs::path& to) {
  fs::remove_all(to);
  fs::copy(from, to, fs::copy_options::recursive);
}

std::string shard_name(const fs::path& dir, int rank) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    if (name.find(".rank0000" + std::to_string(rank)) != std::string::npos) return name;
  }
  return "?";
}

void case_bad_inputs(Rank& r) {
  const auto root = fs::path(r.dir).parent_path();
  Setup<BadPolicy> s(&r, 2, 600 + static_cast<std::uint64_t>(r.rank));
  s.step(0, r.rank, r.world);
  const auto good = root / "good";
  s.trainer.save(good.string());
  s.trainer.save((root / "other").string());  // the same state, another save
  const auto fp32_at_save = values_of(s.trainer.fp32_state_dict());
  s.step(2, r.rank, r.world);
  const auto before = held(s);
  const auto fp32_before = values_of(s.trainer.fp32_state_dict());
  // Each broken copy, made by rank 0 while rank 1 waits.
  const auto prepare = [&](const std::string& name, const std::function<void(const fs::path&)>& damage) {
    const auto dir = root / name;
    if (r.rank == 0) {
      copy_dir(good, dir);
      damage(dir);
    }
    r.group->barrier()->wait();
    return dir;
  };
  const auto expect_refused = [&](const fs::path& dir, const std::vector<std::string>& any_of) {
    try {
      s.trainer.load(dir.string());
      RANK_EXPECT(false, "no Error for " << dir);
    } catch (const mp::Error& e) {
      const std::string message = e.what();
      std::cerr << "rank " << r.rank << ": " << message << "\n";
      bool found = message.find("another rank could not load") != std::string::npos;
      for (const auto& text : any_of) found = found || message.find(text) != std::string::npos;
      RANK_EXPECT(found, message);
    }
    RANK_EXPECT(identical(held(s), before), "a refused load changed the trainer");
    RANK_EXPECT(identical(values_of(s.trainer.fp32_state_dict()), fp32_before), "the fp32 weights changed");
  };
  // A shard missing.
  const auto missing_name = shard_name(good, 1);
  expect_refused(prepare("missing", [&](const fs::path& d) { fs::remove(d / missing_name); }),
                 {missing_name, "is missing"});
  // A shard damaged: one byte of its data flipped (its size and header intact).
  const auto damaged_name = shard_name(good, 0);
  expect_refused(prepare("damaged", [&](const fs::path& d) {
                   const auto path = d / damaged_name;
                   const auto size = fs::file_size(path);
                   std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
                   io.seekg(static_cast<std::streamoff>(size - 5));
                   const char c = static_cast<char>(io.get());
                   io.seekp(static_cast<std::streamoff>(size - 5));
                   io.put(static_cast<char>(c ^ 0x10));
                 }),
                 {damaged_name + "' is damaged"});
  // A shard of another run, under this save's name (the same size: the same model).
  expect_refused(prepare("foreign", [&](const fs::path& d) {
                   fs::copy_file(root / "other" / shard_name(root / "other", 1), d / shard_name(d, 1),
                                 fs::copy_options::overwrite_existing);
                 }),
                 {"belongs to save"});
  // An index whose pieces do not cover a tensor: no world size can be served from it.
  expect_refused(prepare("uncovered", [&](const fs::path& d) {
                   std::ifstream in(d / "index.json");
                   std::stringstream text;
                   text << in.rdbuf();
                   auto json = mp::detail::JsonParser::parse(text.str(), "index");
                   for (auto& member : json.members) {
                     if (member.first != "tensors") continue;
                     for (auto& tensor : member.second.members) {
                       auto& pieces = tensor.second.members.back().second.items;
                       if (pieces.size() > 1) {
                         pieces.erase(pieces.begin());
                         break;
                       }
                     }
                   }
                   std::ofstream(d / "index.json") << json.dump();
                 }),
                 {"cannot serve a load at any world size"});
  // Another policy's checkpoint.
  {
    Setup<Remainder> other(&r, 2, 600 + static_cast<std::uint64_t>(r.rank));
    try {
      other.trainer.load(good.string());
      RANK_EXPECT(false, "no Error for another policy");
    } catch (const mp::Error& e) {
      const std::string message = e.what();
      RANK_EXPECT(message.find("written by Trainer<ScaledZero>") != std::string::npos &&
                      message.find(good.string()) != std::string::npos,
                  message);
    }
  }
  // A full disk mid-save on rank 1 (RLIMIT_FSIZE: its shard's writes fail): every rank throws,
  // the directory keeps the previous checkpoint, which loads.
  {
    rlimit saved{};
    ::getrlimit(RLIMIT_FSIZE, &saved);
    const auto previous = std::signal(SIGXFSZ, SIG_IGN);
    if (r.rank == 1) {
      rlimit small = saved;
      small.rlim_cur = 2048;
      ::setrlimit(RLIMIT_FSIZE, &small);
    }
    try {
      s.trainer.save(good.string());
      RANK_EXPECT(false, "no Error for a full disk");
    } catch (const mp::Error& e) {
      const std::string message = e.what();
      std::cerr << "rank " << r.rank << ": " << message << "\n";
      RANK_EXPECT(message.find("intact") != std::string::npos, message);
      RANK_EXPECT(r.rank == 0 ? message.find("rank 1 could not write") != std::string::npos
                              : message.find("File too large") != std::string::npos &&
                                    message.find(".rank00001-of-00002.safetensors") != std::string::npos &&
                                    message.find("Free space") != std::string::npos,
                  message);
    }
    ::setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, previous);
    std::cerr.clear();  // the log's own writes failed past the limit too
    r.group->barrier()->wait();  // each rank has removed what it wrote
    RANK_EXPECT(std::distance(fs::directory_iterator(good), fs::directory_iterator()) == 4,
                "the failed save left files behind");
  }
  RANK_EXPECT(identical(held(s), before), "a failed save changed the trainer");
  s.trainer.load(good.string());
  RANK_EXPECT(s.trainer.stats().steps == 1, "loaded");
  RANK_EXPECT(identical(values_of(s.trainer.fp32_state_dict()), fp32_at_save), "the previous checkpoint");
}

// ---- the streamed fp32 export, for Python

void case_export(Rank& r) {
  const auto root = fs::path(r.dir).parent_path();
  Setup<Remainder> s(&r, 3, 400 + static_cast<std::uint64_t>(r.rank));
  for (int k = 0; k < 2; ++k) s.step(k, r.rank, r.world);
  s.trainer.save_fp32((root / "model.safetensors").string(), mp::WeightsFormat::safetensors);
  s.trainer.save_fp32((root / "reference.pkl").string(), mp::WeightsFormat::pickle);
  s.trainer.save((root / "ckpt").string());  // its masters, read in Python from the index
}

// ---- tests/netns_test.sh: saved with rank 0 on one "host", resumed with rank 0 on the other

// ZeRO-3 over the veth pair: two steps, the save, and (rank 0) what the resumed run must find.
void case_netns_save(Rank& r) {
  Setup<ScaledZero> s(&r, 3, 300 + static_cast<std::uint64_t>(r.rank));
  for (int k = 0; k < 2; ++k) s.step(k, r.rank, r.world);
  s.trainer.save(r.dir + "/netns_ckpt");
  auto values = values_of(s.trainer.fp32_state_dict());
  values.push_back(torch::tensor({s.trainer.stats().steps}));
  values.push_back(torch::tensor({s.trainer.scaler().get_scale()}, torch::kDouble));
  if (r.rank == 0) torch::save(values, r.dir + "/netns_saved.pt");
}

// The other layout (the launcher puts rank 0 in the other namespace): the same state, bit for
// bit, and the run goes on alike on both ranks.
void case_netns_resume(Rank& r) {
  Setup<ScaledZero> s(&r, 3, 310 + static_cast<std::uint64_t>(r.rank));
  s.trainer.load(r.dir + "/netns_ckpt");
  auto values = values_of(s.trainer.fp32_state_dict());
  values.push_back(torch::tensor({s.trainer.stats().steps}));
  values.push_back(torch::tensor({s.trainer.scaler().get_scale()}, torch::kDouble));
  std::vector<torch::Tensor> saved;
  torch::load(saved, r.dir + "/netns_saved.pt");
  RANK_EXPECT(identical(values, saved), "the resumed state differs from the saved one");
  s.step(2, r.rank, r.world);
  RANK_EXPECT(same_on_every_rank(r, values_of(s.trainer.fp32_state_dict())), "ranks differ");
}

const std::map<std::string, std::function<void(Rank&)>>& cases() {
  static const auto all = [] {
    std::map<std::string, std::function<void(Rank&)>> m{
        {"ckpt_reshard", case_reshard},
        {"ckpt_kill_cleanup", case_kill_cleanup},
        {"ckpt_bad_inputs", case_bad_inputs},
        {"ckpt_export", case_export},
        {"ckpt_netns_save", case_netns_save},
        {"ckpt_netns_resume", case_netns_resume},
    };
    for (int phase = 0; phase < kPhases; ++phase) {
      m["ckpt_kill_" + std::to_string(phase)] = [phase](Rank& r) { case_kill_save(r, phase); };
    }
    return m;
  }();
  return all;
}

}  // namespace ckpt

const std::map<std::string, std::function<void(Rank&)>>& sharded_checkpoint_cases() {
  return ckpt::cases();
}

}  // namespace

TEST_CASE("sharded checkpoint: saved on 3 ranks, loaded on 2, 1 and 4, unsharded and in one process, bitwise (ZeRO-1/2/3; fp32 masters + GradScaler, RemainderMasters, StochasticRounding)") {
  namespace fs = std::filesystem;
  const auto root = fresh_dir("ckpt_reshard");
  for (const int world : ckpt::kChain) {
    INFO("the link on ", world, " ranks");
    require_all_passed(run_ranks("ckpt_reshard", world, std::chrono::seconds(240),
                                 root / ("link_x" + std::to_string(world))));
  }
  for (const auto& c : ckpt::configs()) {
    CAPTURE(c.name);
    const auto original = c.contents((root / c.name / "x3").string());
    CHECK(original.size() > 40);
    CHECK(identical(c.contents((root / c.name / "consolidated_x3.archive").string()), original));
    for (const int world : {2, 1, 4}) {
      CAPTURE(world);
      CHECK(identical(c.contents((root / c.name / ("x" + std::to_string(world))).string()), original));
    }
    CHECK(identical(c.contents((root / c.name / "unsharded_x2.ckpt").string()), original));
    // Each rank's RNG state: its own while the save had its rank; else derived from rank 0's.
    const auto x3 = root / c.name / "x3", x2 = root / c.name / "x2", x1 = root / c.name / "x1",
               x4 = root / c.name / "x4";
    CHECK(identical(ckpt::saved_tensor(x2, "rng.1.cpu"), ckpt::saved_tensor(x3, "rng.1.cpu")));
    CHECK_FALSE(ckpt::has_tensor(x1, "rng.1.cpu"));
    const auto rank0 = ckpt::saved_tensor(x3, "rng.0.cpu");
    CHECK(identical(ckpt::saved_tensor(x4, "rng.0.cpu"), rank0));
    for (int rank = 1; rank < 4; ++rank) {
      CHECK(identical(ckpt::saved_tensor(x4, "rng." + std::to_string(rank) + ".cpu"),
                      mp::detail::derived_rng_state(rank0, rank)));
    }
    CHECK_FALSE(identical(ckpt::saved_tensor(x4, "rng.1.cpu"), ckpt::saved_tensor(x4, "rng.2.cpu")));
  }
}

TEST_CASE("sharded checkpoint: a rank killed at each phase of a save leaves a checkpoint that loads, the previous one or the new one") {
  namespace fs = std::filesystem;
  const auto root = fresh_dir("ckpt_kill");
  for (int phase = 0; phase < ckpt::kPhases; ++phase) {
    CAPTURE(phase);
    const auto dir = root / ("phase" + std::to_string(phase));
    const auto outcomes = run_ranks("ckpt_kill_" + std::to_string(phase), 2, std::chrono::seconds(120),
                                    dir / "ranks");
    const auto victim = static_cast<std::size_t>(ckpt::victim_of(phase));
    for (std::size_t r = 0; r < outcomes.size(); ++r) {
      INFO("rank ", r, ": ", ending(outcomes[r]), "; log:\n", outcomes[r].log);
      if (r == victim) {
        CHECK((WIFSIGNALED(outcomes[r].status) && WTERMSIG(outcomes[r].status) == SIGKILL));
      } else {
        CHECK((WIFEXITED(outcomes[r].status) && WEXITSTATUS(outcomes[r].status) == 0));
      }
    }
    const bool committed = phase >= static_cast<int>(mp::detail::SavePhase::committed);
    const auto loaded = ckpt::contents<ckpt::KillPolicy>((dir / "ckpt").string());
    const auto expected = ckpt::contents<ckpt::KillPolicy>((dir / (committed ? "B" : "A")).string());
    CHECK(identical(loaded, expected));
    if (phase == static_cast<int>(mp::detail::SavePhase::shard_partial)) {
      bool temporary = false;  // the victim's half-written shard
      for (const auto& entry : fs::directory_iterator(dir / "ckpt")) {
        temporary = temporary || entry.path().filename().string().find(".tmp.") != std::string::npos;
      }
      CHECK(temporary);
    }
  }
  require_all_passed(run_ranks("ckpt_kill_cleanup", 2, std::chrono::seconds(240), root / "cleanup"));
  for (int phase = 0; phase < ckpt::kPhases; ++phase) {
    CAPTURE(phase);
    const auto dir = root / ("phase" + std::to_string(phase)) / "ckpt";
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
    CHECK(names.size() == 4);  // index.json, 2 shards, the Trainer's state
  }
}

TEST_CASE("sharded checkpoint: a missing, damaged or foreign shard, an index no world size can serve, another policy, a full disk: an Error naming the file on every rank, nothing changed") {
  require_all_passed(run_ranks("ckpt_bad_inputs", 2, std::chrono::seconds(240),
                               fresh_dir("ckpt_bad_inputs") / "ranks"));
}

TEST_CASE("sharded checkpoint: the fp32 export streamed from 3 ZeRO-3 ranks loads in Python with load_state_dict(strict=True), equal to the gathered export; Python reassembles the masters from the index") {
  namespace fs = std::filesystem;
  const auto dir = fresh_dir("ckpt_export");
  require_all_passed(run_ranks("ckpt_export", 3, std::chrono::seconds(240), dir / "ranks"));
  // The streamed file in C++ too: every name of the model, each value the gathered export's.
  const auto streamed = mp::read_safetensors((dir / "model.safetensors").string());
  const auto script = fs::path(MIXPREC_PARITY_SCRIPT).parent_path() / "distributed" / "sharded_export.py";
  const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + script.string() + " " +
                       (dir / "model.safetensors").string() + " " + (dir / "reference.pkl").string() +
                       " " + (dir / "ckpt").string();
  CHECK(streamed.size() == 10);
  REQUIRE(std::system(command.c_str()) == 0);
}
