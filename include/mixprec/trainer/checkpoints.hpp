#pragma once
// What survives a restart, as the Trainer's own methods: save() and load() to a path (atomic,
// with a checksum) or an archive of the caller's, the fp32 export, weights from Python's files
// (load_weights, load_state_dict: trainer/load_weights.hpp), and LibTorch's composition
// (`archive << trainer`, `torch::save(trainer, path)`, `torch::load(trainer, path)`). Trainer<P>
// derives from TrainerCheckpoints<P>, which reads its parts through friendship: the format is
// state.hpp, the data-parallel side ranks.hpp, a sharded run's directory sharded_save.hpp and
// sharded_load.hpp.

#include <mixprec/core/error.hpp>
#include <mixprec/core/policy.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/fp8/layers.hpp>
#include <mixprec/io/checkpoint_file.hpp>
#include <mixprec/trainer/fp32_export.hpp>
#include <mixprec/trainer/lean_step.hpp>
#include <mixprec/trainer/load_weights.hpp>
#include <mixprec/trainer/policy_identity.hpp>
#include <mixprec/trainer/ranks.hpp>
#include <mixprec/trainer/schedule.hpp>
#include <mixprec/trainer/setup.hpp>
#include <mixprec/trainer/sharded_load.hpp>
#include <mixprec/trainer/sharded_save.hpp>
#include <mixprec/trainer/state.hpp>

#include <torch/ordered_dict.h>
#include <torch/serialize.h>
#include <torch/serialize/archive.h>

#include <array>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace mixprec {

template <class P>
class Trainer;

namespace detail {

// Sharded, while a checkpoint reads or writes: ZeRO-3's units' weights whole (collective), and
// lean pieces holding their fp32 values (a load stows what it wrote; else they are dropped).
class WholeState {
 public:
  explicit WholeState(StepGroup* group) : group_(group) {
    if (group_ == nullptr) return;
    group_->gather_units();
    group_->inflate_pieces();
  }
  ~WholeState() {
    if (group_ == nullptr) return;
    group_->release_pieces(/*narrow=*/false);
    group_->release_units();
  }
  WholeState(const WholeState&) = delete;
  WholeState& operator=(const WholeState&) = delete;

 private:
  StepGroup* group_;
};

template <class P>
class TrainerCheckpoints {
 public:
  /// Writes model, optimizer (state and param-group options), scaler, master weights, counters
  /// and the RNG states (CPU, and each CUDA device's) to `path` atomically, with a checksum that
  /// load() verifies. Call between optimizer steps, not in the middle of an accumulation.
  /// Data parallel: every rank calls it; rank 0 writes (with every rank's CPU RNG state) and
  /// the others return once it has, with its Error if it failed.
  /// `user` goes into the same file (the epoch, the position in the data: anything an IValue
  /// holds), and load() returns it.
  /// Sharded (DistributedOptions::shard_optimizer_state): `path` is a directory, a sharded
  /// checkpoint (docs/distributed.md, "Sharded checkpoints"): each rank writes the pieces it
  /// holds into a file of its own, piece by piece, rank 0 the index last; complete and verified,
  /// or the previous checkpoint stays. load() takes it at any world size, sharded or not.
  /// With Adam's moments in a block format (Moments8bit, ...) each rank writes the rows of its
  /// pieces (whole blocks), and the checkpoint holds each moment as its whole tensor's rows.
  void save(const std::string& path, const UserValues& user = {}) const;

  /// Restores a checkpoint written by save() of a Trainer of the same policy, model and
  /// optimizer: the optimizer's state and param-group options become the saved ones exactly,
  /// and an accumulation in progress is discarded. Anything else (a missing, truncated,
  /// corrupted or foreign file; another model or optimizer) throws mixprec::Error and changes
  /// nothing, but for a param group added since the last step: that is adopted first, as the
  /// next step() would adopt it. Data parallel: every rank loads the file (rank 0's path on a
  /// shared file system); if any rank cannot, every rank throws and none changes. Returns the
  /// user values saved with it (none: empty). Sharded: any checkpoint of the same model and
  /// optimizer, written at any world size, sharded or not; each rank keeps its slices of it.
  /// A directory is a sharded checkpoint (written by a sharded run's save() at any world size):
  /// each rank reads only the ranges it holds, after every file was checked (sizes, headers, and
  /// the checksums, shared out over the ranks); a missing, damaged or foreign file is an Error
  /// that names it, and nothing is loaded. Its moments load into a sharded Trainer only in the
  /// format they were saved in (plain, or the same block format); an unsharded Trainer with
  /// master weights converts them, as from a checkpoint file.
  UserValues load(const std::string& path);

  /// save() into an archive of the caller's (LibTorch's composition: `torch::save(trainer,
  /// path)` and `archive << trainer` go through here): the same contents, without the atomic
  /// file and its checksum, which the caller's archive does not have. Data parallel: every rank
  /// calls it, and every rank's archive holds all ranks' RNG states.
  void save(torch::serialize::OutputArchive& archive, const UserValues& user = {}) const;

  /// load() from an archive of the caller's (`torch::load(trainer, path)`, `archive >> trainer`).
  UserValues load(torch::serialize::InputArchive& archive);

  /// The fp32 weights of the model by state_dict name: the masters under MixedO2 (not their
  /// rounding in the model), the parameters cast to fp32 otherwise, and the buffers (floating
  /// ones in fp32). What an fp32 model for inference or another framework takes.
  /// Sharded: gathered from every rank's masters; collective (every rank calls it).
  torch::OrderedDict<std::string, at::Tensor> fp32_state_dict() const;

  /// Weights into the trained model by name, under mixprec::load_state_dict's rules (strict,
  /// shapes, dtypes, tied tensors: LoadOptions), with one Error and nothing changed unless all
  /// fit. Under MixedO2 each fp32 master weight takes the state dict's value exactly and the
  /// model its rounding, as after a step. The optimizer's state (Adam's moments, step counts)
  /// and the scaler stay as they are, as PyTorch's model.load_state_dict leaves them. Call it
  /// between optimizer steps. Data parallel: every rank loads the same weights (the next step's
  /// forward sees rank 0's buffers); refused where the optimizer state is sharded (load into
  /// the model before building the Trainer).
  LoadReport load_state_dict(const StateDict& weights, const LoadOptions& options = {});

  /// load_state_dict of the file at `path`: torch.save's or safetensors (read_state_dict).
  LoadReport load_weights(const std::string& path, const LoadOptions& options = {});

  /// Writes fp32_state_dict() to `path` atomically: WeightsFormat::libtorch as Module::save
  /// writes a model, so that `torch::load(fp32_model, path)` reads it into a model of the same
  /// architecture built in fp32; WeightsFormat::pickle as a tuple of (name, tensor) pairs, which
  /// Python reads with `model.load_state_dict(dict(torch.load(path)))`; WeightsFormat::
  /// safetensors tensor by tensor, never the whole model at once (Python:
  /// `model.load_state_dict(safetensors.torch.load_file(path))`).
  /// Sharded: collective. safetensors gathers one bucket at a time (at most a ZeRO-3 unit) and
  /// rank 0 writes it; the other formats gather everything on every rank first.
  void save_fp32(const std::string& path, WeightsFormat format = WeightsFormat::libtorch) const;

 private:
  const Trainer<P>& self() const { return static_cast<const Trainer<P>&>(*this); }
  Trainer<P>& self() { return static_cast<Trainer<P>&>(*this); }

  // Sharded: the optimizer and masters of an unsharded trainer (consolidate); else none.
  std::optional<ConsolidatedState> consolidated(bool values, bool state) const {
    const auto& t = self();
    if (!t.tensors_.sharded()) return std::nullopt;
    return consolidate(*t.data_parallel_, *t.optimizer_, P::master_weights, values, state);
  }

  const MasterWeights* masters_of(const std::optional<ConsolidatedState>& view) const {
    return view ? view->masters_or_null() : self().tensors_.masters();
  }

  CheckpointParts parts(const std::optional<ConsolidatedState>& view) const {
    const auto& t = self();
    return {policy_identity<P>(), *t.model_, view ? *view->optimizer : *t.optimizer_,
            masters_of(view), t.data_parallel_.get(), t.options_.fused_optimizer()};
  }

  template <class Read>
  LoadReport load_weights_from(const std::string& source, Read&& read, const LoadOptions& options) {
    auto& t = self();
    t.check_not_busy("load_weights");
    MIXPREC_CHECK(t.pending_ == 0, "load_weights() in the middle of an accumulation (",
                  t.pending_, " of ", t.options_.accumulation_steps(), " micro-batches): load "
                  "between optimizer steps; nothing was loaded");
    MIXPREC_CHECK(!t.tensors_.sharded(), "load_weights() with the optimizer state sharded "
                  "across ranks (DistributedOptions::shard_optimizer_state): load the weights "
                  "into the model before building the Trainer; nothing was loaded");
    auto report = load_into_trained(*t.model_, t.tensors_.masters(), read(), options, source);
    t.buffers_synced_ = false;
    return report;
  }

  void check_saveable(const UserValues& user) const {
    const auto& t = self();
    t.check_not_busy("save");
    t.schedule_.check_untouched();
    MIXPREC_CHECK(t.pending_ == 0, "save() in the middle of an accumulation (", t.pending_,
                  " of ", t.options_.accumulation_steps(), " micro-batches): save after a step");
    check_user_values(user);
  }

  void write(torch::serialize::OutputArchive& archive, const RankRngs& rngs,
             const UserValues& user, const std::optional<ConsolidatedState>& view) const {
    const auto& t = self();
    write_state(archive, parts(view), t.counters_, c10::IValue(t.scaler_.state_dict()), rngs,
                user);
    write_extras(archive);
  }

  // What a checkpoint holds beside the format's own parts: fp8's scaling state, stochastic
  // rounding's seed and count, the learning-rate schedule.
  void write_extras(torch::serialize::OutputArchive& archive) const {
    const auto& t = self();
    if constexpr (fp8_policy<P>) archive.write("mixprec.fp8", c10::IValue(t.fp8_.state_dict()));
    if constexpr (quantized_moments<P>) {  // the format of the moments' rows
      archive.write("mixprec.moments", c10::IValue(moment_coding_name(moment_coding_of<P>)));
    }
    if (const auto* lean = t.tensors_.lean()) {
      archive.write("mixprec.rounding",
                    at::tensor({static_cast<std::int64_t>(lean->seed()),
                                static_cast<std::int64_t>(lean->rounds())}, at::kLong));
    }
    t.schedule_.write(archive);
  }

  // Whether `path` is a sharded checkpoint: a directory on any rank (then every rank reads it
  // as one, and a rank whose path is none says so).
  bool sharded_at(const std::string& path) {
    const bool here = sharded_checkpoint_at(path);
    auto* group = self().data_parallel_.get();
    return group == nullptr ? here : group->any(here);
  }

  void save_sharded_checkpoint(const std::string& dir, const UserValues& user) const {
    const auto& t = self();
    const auto own = parts(std::nullopt);
    save_sharded(dir, own, *t.data_parallel_, [&](auto& archive, const auto& groups) {
      write_small_state(archive, own, t.counters_, c10::IValue(t.scaler_.state_dict()), user,
                        groups);
      write_extras(archive);
    });
  }

  // load(directory): everything read and checked on every rank, the vote, then the ranges.
  UserValues load_sharded_checkpoint(const std::string& dir) {
    auto& t = self();
    t.check_not_busy("load");
    t.adopt_optimizer_changes();
    return voted_load(t.data_parallel_.get(), dir, [&](auto& commit) {
      return checked_or_error(dir, [&] {
        // Sharded, the pieces are read as they are: the directory's moments must be in this
        // Trainer's format. Unsharded, LeanLoad converts them (with master weights).
        const bool recodes = !t.tensors_.sharded() && t.tensors_.masters() != nullptr;
        ShardedReader reader(dir, parts(std::nullopt), t.tensors_.masters(), narrow_moments_of<P>,
                             moment_coding_of<P>, recodes);
        auto small = read_small(reader.state(), dir, reader.scaler_state(), /*recipe_recorded=*/true);
        auto user = read_user_values(reader.state(), dir);
        commit();  // every rank has read and checked all of it
        if (t.tensors_.sharded()) {
          reader.apply();
        } else {
          LeanLoad<P> lean(t.tensors_.masters(), *t.optimizer_);
          reader.apply();
          lean.loaded(reader.moments());
        }
        apply_small(small, reader.counters());
        return user;
      });
    });
  }

  // What a checkpoint holds beside the tensors and the optimizer, read and checked: the scaler's
  // state (in a scaler of its own), the schedule, fp8's scaling state, the rounding.
  struct SmallState {
    typename P::scaler_type scaler;
    ScheduleState schedule;
    std::vector<std::pair<at::Tensor*, at::Tensor>> fp8;
    std::array<std::uint64_t, 2> rounding;
  };
  SmallState read_small(torch::serialize::InputArchive& archive, const std::string& source,
                        const c10::IValue& scaler_state, bool recipe_recorded) {
    auto& t = self();
    SmallState small{make_scaler<P>(t.options_), {}, {}, {}};
    small.scaler.load_state_dict(scaler_state.toGenericDict());
    small.schedule = t.schedule_.read(archive, source);
    if constexpr (fp8_policy<P>) {
      c10::IValue saved;
      archive.try_read("mixprec.fp8", saved);
      small.fp8 = t.fp8_.check_state(saved, source, recipe_recorded);
    }
    small.rounding = read_rounding(archive, source, t.options_.rounding_seed());
    return small;
  }
  // After the optimizer's state and options (which hold the lrs) are in place.
  void apply_small(SmallState& small, const TrainerCounters& counters) {
    auto& t = self();
    if (auto* lean = t.tensors_.lean()) lean->set_rounding(small.rounding[0], small.rounding[1]);
    Fp8Layers::apply_state(small.fp8);
    t.fp8_.finish_step(/*stepped=*/false);  // an accumulation's amaxes belong to another run
    t.scaler_ = std::move(small.scaler);
    t.schedule_.apply(small.schedule, *t.optimizer_);  // after the optimizer's options
    t.restart_from(counters);
  }

  // StochasticRounding's seed and count of rounded steps; a checkpoint without them (other
  // storages, whose settings the policy check compares first) leaves the seed and count 0.
  static std::array<std::uint64_t, 2> read_rounding(torch::serialize::InputArchive& archive,
                                                    const std::string& source,
                                                    std::uint64_t seed) {
    at::Tensor saved;
    if (!archive.try_read("mixprec.rounding", saved)) return {seed, 0};
    MIXPREC_CHECK(saved.scalar_type() == at::kLong && saved.numel() == 2, "checkpoint '",
                  source, "': mixprec.rounding is not the seed and count of stochastic "
                  "rounding (two int64 values); the file is damaged");
    return {static_cast<std::uint64_t>(saved[0].item<std::int64_t>()),
            static_cast<std::uint64_t>(saved[1].item<std::int64_t>())};
  }

  // The block format of the checkpoint's moments; plain where it records none (every other
  // storage's checkpoints, and those written before block formats existed).
  static MomentCoding read_moments(torch::serialize::InputArchive& archive,
                                   const std::string& source) {
    c10::IValue saved;
    if (!archive.try_read("mixprec.moments", saved)) return {};
    const auto coding = saved.isString() ? moment_coding_named(saved.toStringRef()) : std::nullopt;
    MIXPREC_CHECK(coding.has_value(), "checkpoint '", source, "': mixprec.moments names no block "
                  "format of Adam's moments (Moments8bit<256>, ...); the file is damaged");
    return *coding;
  }

  // load(path) and load(archive): a param group added since the last step (or a new optimizer)
  // is adopted first, as step() would (the checkpoint of a run that had adopted it holds its
  // masters and state, which must not be dropped); then the data-parallel vote around
  // `load_checked_with(commit)`.
  template <class Load>
  UserValues load_with(const std::string& source, Load&& load_checked_with) {
    auto& t = self();
    t.check_not_busy("load");
    t.adopt_optimizer_changes();
    const WholeState whole(t.data_parallel_.get());
    return voted_load(t.data_parallel_.get(), source, [&](auto& commit) {
      return checked_or_error(source, [&] { return load_checked_with(commit); });
    });
  }

  // Reads and checks everything (the scaler's state too, in a scaler of its own) before
  // commit(); then changes the trainer.
  template <class Commit>
  UserValues load_checked(torch::serialize::InputArchive& archive, const std::string& source,
                          Commit& commit) {
    auto& t = self();
    auto view = consolidated(/*values=*/false, /*state=*/false);
    auto loaded = read_state(archive, source, parts(view));
    const auto moments = read_moments(archive, source);
    auto small = read_small(archive, source, loaded.scaler_state, loaded.policy_settings);
    commit();  // every rank has read and checked all of it
    if (view) {  // sharded: read into the full view, then each rank takes its slices
      apply_state(loaded, *view->optimizer);
      recode_moments(*view->optimizer, moments, moment_coding_of<P>);
      t.data_parallel_->scatter_state(*view->optimizer);
      t.data_parallel_->stow_loaded_pieces();
    } else {
      LeanLoad<P> lean(t.tensors_.masters(), *t.optimizer_);  // the masters' values land in fp32 data
      apply_state(loaded, *t.optimizer_);
      lean.loaded(moments);
    }
    apply_small(small, loaded.counters);
    return std::move(loaded.user);
  }
};

template <class P>
void TrainerCheckpoints<P>::save(const std::string& path, const UserValues& user) const {
  check_saveable(user);
  if (self().tensors_.sharded()) return save_sharded_checkpoint(path, user);
  const WholeState whole(self().data_parallel_.get());
  const auto rngs = gather_rngs(self().data_parallel_.get());
  const auto view = consolidated(/*values=*/true, /*state=*/true);
  write_on_rank0(self().data_parallel_.get(), path, [&] {
    write_state_file(path, [&](auto& archive) { write(archive, rngs, user, view); });
  });
}

template <class P>
UserValues TrainerCheckpoints<P>::load(const std::string& path) {
  if (sharded_at(path)) return load_sharded_checkpoint(path);
  return load_with(path, [&](auto& commit) {
    auto archive = read_state_file(path);
    return load_checked(archive, path, commit);
  });
}

template <class P>
void TrainerCheckpoints<P>::save(torch::serialize::OutputArchive& archive, const UserValues& user) const {
  check_saveable(user);
  const WholeState whole(self().data_parallel_.get());
  const auto rngs = gather_rngs(self().data_parallel_.get());
  const auto view = consolidated(/*values=*/true, /*state=*/true);
  try {
    write(archive, rngs, user, view);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("cannot write the checkpoint archive: ", message_of(e));
  }
}

template <class P>
UserValues TrainerCheckpoints<P>::load(torch::serialize::InputArchive& archive) {
  return load_with("the archive", [&](auto& commit) {
    return load_checked(archive, "the archive", commit);
  });
}

template <class P>
torch::OrderedDict<std::string, at::Tensor> TrainerCheckpoints<P>::fp32_state_dict() const {
  const WholeState whole(self().data_parallel_.get());
  const auto view = consolidated(/*values=*/true, /*state=*/false);
  return detail::fp32_state_dict(*self().model_, masters_of(view));
}

template <class P>
LoadReport TrainerCheckpoints<P>::load_state_dict(const StateDict& weights, const LoadOptions& options) {
  return load_weights_from("the state dict", [&] { return detail::WeightsFile{weights, {}}; }, options);
}

template <class P>
LoadReport TrainerCheckpoints<P>::load_weights(const std::string& path, const LoadOptions& options) {
  return load_weights_from("'" + path + "'", [&] { return detail::read_weights(path, options.key()); },
                           options);
}

template <class P>
void TrainerCheckpoints<P>::save_fp32(const std::string& path, WeightsFormat format) const {
  self().check_not_busy("save_fp32");
  if (format == WeightsFormat::safetensors) {
    return detail::save_fp32_streamed(path, *self().model_, self().tensors_.masters(),
                                      self().tensors_.sharded() ? self().data_parallel_.get()
                                                                : nullptr);
  }
  const WholeState whole(self().data_parallel_.get());
  const auto view = consolidated(/*values=*/true, /*state=*/false);
  detail::save_fp32(path, format, *self().model_, masters_of(view));
}

// Runs LibTorch's archive I/O; what it throws about the user's file becomes a mixprec::Error.
template <class Io>
void archive_io(const char* call, bool reading, const std::string& source, Io&& io) {
  try {
    io();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(call, ": cannot ", reading ? "read " : "write ", source, " as a Trainer archive "
         "(missing, truncated or corrupt file, or no space): ", message_of(e),
         "; nothing was changed");
  }
}

// How torch::load/save's arguments name what they read or write: a path, or a stream.
template <class First, class... Rest>
std::string archive_source(const First& first, const Rest&...) {
  if constexpr (std::is_convertible_v<const First&, std::string_view>) {
    return "'" + std::string(std::string_view(first)) + "'";
  } else {
    return "the stream";
  }
}

}  // namespace detail

/// `archive << trainer`, and so `torch::save(trainer, path)`: Trainer::save(archive).
template <class P>
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const Trainer<P>& trainer) {
  trainer.save(archive);
  return archive;
}

/// `archive >> trainer`, and so `torch::load(trainer, path)`: Trainer::load(archive).
template <class P>
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           Trainer<P>& trainer) {
  trainer.load(archive);
  return archive;
}

}  // namespace mixprec

namespace torch {

/// `torch::load(trainer, path)`: LibTorch's, with a file it cannot read (missing, truncated,
/// corrupt) a mixprec::Error as Trainer::load(path) gives, the trainer unchanged. More
/// specialised than LibTorch's template, so overload resolution picks it for a Trainer.
template <class P, class... LoadFromArgs>
void load(mixprec::Trainer<P>& trainer, LoadFromArgs&&... args) {
  serialize::InputArchive archive;
  mixprec::detail::archive_io("torch::load(trainer, ...)", /*reading=*/true,
                              mixprec::detail::archive_source(args...),
                              [&] { archive.load_from(std::forward<LoadFromArgs>(args)...); });
  archive >> trainer;
}

/// `torch::save(trainer, path)`: LibTorch's, with a failed write a mixprec::Error.
template <class P, class... SaveToArgs>
void save(const mixprec::Trainer<P>& trainer, SaveToArgs&&... args) {
  serialize::OutputArchive archive(std::make_shared<jit::CompilationUnit>());
  archive << trainer;
  mixprec::detail::archive_io("torch::save(trainer, ...)", /*reading=*/false,
                              mixprec::detail::archive_source(args...),
                              [&] { archive.save_to(std::forward<SaveToArgs>(args)...); });
}

}  // namespace torch
