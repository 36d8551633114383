#pragma once
// Owns what data parallel does with parameters held in shards (core/held_shards.hpp: built by a
// ShardedBuild, or left so by an earlier ZeRO-3 Trainer) when a Trainer takes their model:
// every rank must hold the same parameters so, cut for this group alike, from the same values;
// the units' trainable ones are taken as they are, for ShardedOptimizer::shard to lay out from
// their pieces (one parameter gathered at a time), and the others are gathered whole.

#include <mixprec/core/error.hpp>
#include <mixprec/core/held_shards.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/distributed/collectives.hpp>
#include <mixprec/distributed/sharded_units.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// The shards of the held parameters a Trainer's units take, by identity: out of the registry
/// (the Trainer's cast changes their placeholders only, not their pieces, from which the fp32
/// masters are made), and back into it, in the parameters' dtypes now, unless consumed (the
/// Trainer was not built after all).
class TakenShards {
 public:
  TakenShards() = default;
  ~TakenShards() { restore(); }
  TakenShards(const TakenShards&) = delete;
  TakenShards& operator=(const TakenShards&) = delete;

  void add(const at::Tensor& p, std::shared_ptr<HeldShard> shard) {
    by_param_.emplace(p.unsafeGetTensorImpl(), shard);
    taken_.emplace_back(p, std::move(shard));
  }
  const HeldByParam& by_param() const noexcept { return by_param_; }
  /// In the model's order.
  const std::vector<std::pair<at::Tensor, std::shared_ptr<HeldShard>>>& taken() const noexcept {
    return taken_;
  }
  bool empty() const noexcept { return taken_.empty(); }
  /// Laid out: nothing to give back.
  void consumed() noexcept {
    taken_.clear();
    by_param_.clear();
  }

 private:
  void restore() noexcept {
    try {
      at::NoGradGuard no_grad;
      for (auto& [p, shard] : taken_) {
        if (!HeldShards::is_placeholder(p) || !shard->piece.defined()) continue;
        shard->piece = shard->piece.to(p.scalar_type());
        HeldShards::hold(p, shard);  // its unit's hooks own it still
      }
    } catch (...) {
    }
    consumed();
  }

  HeldByParam by_param_;
  std::vector<std::pair<at::Tensor, std::shared_ptr<HeldShard>>> taken_;
};

/// DataParallel's construction, after check_same_model() (which compares which parameters are
/// held on each rank): an Error on every rank, before anything changes, unless every rank's
/// shards are cut alike for this group, from the same values (where known: a build or a load). Then the units' trainable ones go to `taken`, and the
/// others are gathered whole and held no more. Collective.
inline void take_held(const Collectives& comm, torch::nn::Module& model, const UnitPlan& plan,
                      TakenShards& taken) {
  const auto named = unique_named(model.named_parameters());
  constexpr std::int64_t kFields = 6;  // held, fingerprint, offset, chunk, world, rank
  auto mine = at::zeros({static_cast<std::int64_t>(named.size()) * kFields}, at::kLong);
  auto* row = mine.data_ptr<std::int64_t>();
  bool held_here = false;
  std::vector<std::shared_ptr<HeldShard>> shards;
  for (std::size_t k = 0; k < named.size(); ++k) {
    const auto& p = named[k].second;
    auto shard = HeldShards::find(p);
    if (shard) check_intact(p, *shard, "'" + named[k].first + "'");
    if (shard && shard->whole) shard = nullptr;  // gathered (unshard()): an ordinary parameter
    if (shard) {
      auto* f = row + k * kFields;
      std::int64_t bits = 0;
      std::memcpy(&bits, &shard->fingerprint, sizeof bits);
      f[0] = 1;
      f[1] = bits;
      f[2] = shard->cut.offset;
      f[3] = shard->cut.chunk;
      f[4] = shard->group->world_size();
      f[5] = shard->group->rank();
      held_here = true;
    }
    shards.push_back(std::move(shard));
  }
  // check_same_model() saw every rank hold the same parameters in shards: most hold none.
  if (!held_here) return;
  std::vector<at::Tensor> all;
  for (const auto& t : comm.all_gather(mine.to(comm.device()))) all.push_back(t.cpu().contiguous());
  for (std::size_t k = 0; k < named.size(); ++k) {
    const auto& name = named[k].first;
    const auto field = [&](int r, int f) {
      return all[static_cast<std::size_t>(r)].data_ptr<std::int64_t>()[k * kFields + f];
    };
    for (int r = 0; r < comm.world_size(); ++r) {
      MIXPREC_CHECK(field(r, 0) == field(0, 0), "parameter '", name, "' is held in shards on rank ",
                    field(r, 0) ? r : 0, " and whole on rank ", field(r, 0) ? 0 : r, ": build the "
                    "model alike on every rank (the same modules under a ShardedBuild, and "
                    "unshard() on every rank or none); nothing was changed");
      if (field(0, 0) == 0) continue;
      MIXPREC_CHECK(field(r, 4) == comm.world_size() && field(r, 5) == r, "parameter '", name,
                    "' is held in shards cut for rank ", field(r, 5), " of ", field(r, 4),
                    " on rank ", r, " of the Trainer's ", comm.world_size(), ": build it (or "
                    "train it before) with the process group the Trainer trains over; nothing "
                    "was changed");
      MIXPREC_CHECK(field(r, 2) == field(0, 2) && field(r, 3) == field(0, 3), "parameter '",
                    name, "' is held in shards cut differently on ranks 0 and ", r, "; nothing "
                    "was changed");
      const bool known = field(r, 1) != 0 && field(0, 1) != 0;
      MIXPREC_CHECK(!known || field(r, 1) == field(0, 1), "parameter '", name, "' was built or "
                    "loaded with other values on rank ", r, " than on rank 0 (each rank keeps "
                    "its piece of the value it built: seed every rank alike before the model's "
                    "ShardedBuild, and load the same file on every rank); nothing was changed");
    }
  }
  // All checks passed: every rank takes and gathers the same parameters, in the same order.
  for (std::size_t k = 0; k < named.size(); ++k) {
    const auto& p = named[k].second;
    if (shards[k] == nullptr) {
      HeldShards::release(p);  // registered, but whole (unshard()): an ordinary parameter
      continue;
    }
    if (plan.unit_of.count(p.unsafeGetTensorImpl()) == 1) {
      taken.add(p, HeldShards::release(p));
    } else {
      unshard_param(p, *shards[k]);  // frozen, or in no unit the Trainer shards
      HeldShards::release(p);
      shards[k]->piece = at::Tensor();  // whole now: its unit's hooks hold no piece of it
    }
  }
}

}  // namespace mixprec::detail
