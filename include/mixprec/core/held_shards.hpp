#pragma once
// Which parameters are held in shards outside a live Trainer, and this rank's piece of each:
// a unit built piece by piece (mixprec::ShardedBuild), or left so by a ZeRO-3 Trainer that has
// gone. Such a parameter keeps its identity, shape and dtype, and its data is a placeholder:
// every element reads NaN (one element per dtype and device, shared by all placeholders, so
// that holding a parameter costs no bytes of its size, and no in-place write can change it);
// its value is the ranks' pieces together, gathered on request. Here, below every subsystem,
// so that a cast (precision/), a load (io/) and data parallel (distributed/) all see it.

#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// The ranks that hold a parameter's pieces: distributed/ implements it over c10d.
class ShardGroup {
 public:
  virtual ~ShardGroup() = default;
  virtual int rank() const noexcept = 0;
  virtual int world_size() const noexcept = 0;
  /// `piece` of every rank, in rank order (the same shape and dtype on every rank). Collective.
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& piece) const = 0;
};

/// Where each rank's piece of a flattened tensor of `numel` elements lies: the tensor sits at
/// `offset` of a flat buffer cut into equal chunks of `chunk` elements, one per rank (ZeRO's
/// buckets), or alone at 0 with chunk = ceil(numel / world) (a unit built piece by piece).
struct ShardCut {
  std::int64_t offset = 0;
  std::int64_t chunk = 0;
  /// Rank `rank`'s elements [from, to) of the tensor (from >= to: none).
  std::pair<std::int64_t, std::int64_t> range(int rank, std::int64_t numel) const {
    const auto lo = chunk * rank - offset, hi = lo + chunk;
    return {std::clamp<std::int64_t>(lo, 0, numel), std::clamp<std::int64_t>(hi, 0, numel)};
  }
  static ShardCut even(std::int64_t numel, int world) {
    return {0, (numel + world - 1) / std::max(world, 1)};
  }
  bool operator==(const ShardCut& other) const noexcept {
    return offset == other.offset && chunk == other.chunk;
  }
};

/// A held parameter's piece on this rank.
struct HeldShard {
  std::shared_ptr<const ShardGroup> group;
  ShardCut cut;
  at::Tensor piece;  // this rank's elements, flat, in the parameter's dtype
  bool whole = false;  // gathered into the parameter for now (unshard); the piece is kept
  // Of the whole value, where one was cut (a build, a load): ranks that built or loaded
  // different values would otherwise train a mix of them. 0: unknown (a Trainer's pieces).
  std::uint64_t fingerprint = 0;
};

/// Held parameters' shards by the parameters' identities.
using HeldByParam = std::unordered_map<const void*, std::shared_ptr<HeldShard>>;

/// 64-bit FNV-1a over `value`'s bytes, its dtype and shape: equal on every rank exactly when the
/// values are.
inline std::uint64_t fingerprint(const at::Tensor& value) {
  const auto t = value.detach().contiguous().cpu();
  std::uint64_t h = 0xcbf29ce484222325ull;
  const auto mix = [&h](std::uint64_t word) {
    h ^= word;
    h *= 0x100000001b3ull;
  };
  mix(static_cast<std::uint64_t>(t.scalar_type()));
  for (const auto size : t.sizes()) mix(static_cast<std::uint64_t>(size));
  const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
  const auto n = t.nbytes();
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t word;
    std::memcpy(&word, bytes + i, 8);
    mix(word);
  }
  std::uint64_t tail = 0;
  std::memcpy(&tail, bytes + i, n - i);
  mix(tail);
  return h == 0 ? 1 : h;  // 0 means unknown
}

/// The fingerprint of a value after a cast to `dtype` (equal on every rank when it was before).
inline std::uint64_t recast_fingerprint(std::uint64_t fingerprint, c10::ScalarType dtype) {
  if (fingerprint == 0) return 0;
  const auto h = (fingerprint ^ static_cast<std::uint64_t>(dtype)) * 0x100000001b3ull;
  return h == 0 ? 1 : h;
}

/// The parameters held in shards, process-wide, each with a weak reference that tells a live
/// tensor from a new one at a freed one's address; and their placeholders.
class HeldShards {
 public:
  /// A NaN of `dtype` on `device` expanded to `sizes`: no bytes of the tensor's size.
  static at::Tensor placeholder(at::IntArrayRef sizes, c10::ScalarType dtype, at::Device device) {
    return element(dtype, device).expand(sizes);
  }
  /// Whether `t` is such a placeholder.
  static bool is_placeholder(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage() || !at::isFloatingType(t.scalar_type())) return false;
    auto& r = instance();
    std::lock_guard<std::mutex> lock(r.mutex);
    const auto it = r.elements.find(key_of(t.scalar_type(), t.device()));
    return it != r.elements.end() && t.storage().is_alias_of(it->second.storage());
  }

  /// Holds `p` as `shard` says: `p`'s data becomes a placeholder of the piece's dtype. The
  /// registry keeps weak references: the caller owns the shard (a held unit's hooks do), and a
  /// model that goes takes its pieces with it.
  static std::shared_ptr<HeldShard> hold(const at::Tensor& p, HeldShard shard) {
    auto owned = std::make_shared<HeldShard>(std::move(shard));
    hold(p, owned);
    return owned;
  }
  /// The same with a shard owned already (held again).
  static void hold(const at::Tensor& p, const std::shared_ptr<HeldShard>& shard) {
    at::NoGradGuard no_grad;
    const auto dtype = shard->piece.scalar_type();
    auto& r = instance();
    {
      std::lock_guard<std::mutex> lock(r.mutex);
      std::erase_if(r.held, [](const auto& entry) {
        return entry.second.tensor.expired() || entry.second.shard.expired();
      });
      r.held.insert_or_assign(p.unsafeGetTensorImpl(), Entry{Weak(p.getIntrusivePtr()), shard});
    }
    shard->whole = false;
    p.set_data(placeholder(p.sizes(), dtype, p.device()));
  }
  /// `p`'s shard, or null where `p` is not held.
  static std::shared_ptr<HeldShard> find(const at::Tensor& p) {
    auto& r = instance();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.held.empty()) return nullptr;
    const auto it = r.held.find(p.unsafeGetTensorImpl());
    if (it == r.held.end() || it->second.tensor.lock().get() != p.unsafeGetTensorImpl()) {
      return nullptr;
    }
    return it->second.shard.lock();
  }
  /// Forgets `p` (its data as it is now) and returns its shard; null where it was not held.
  static std::shared_ptr<HeldShard> release(const at::Tensor& p) {
    auto shard = find(p);
    if (!shard) return nullptr;
    auto& r = instance();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.held.erase(p.unsafeGetTensorImpl());
    return shard;
  }

 private:
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Entry {
    Weak tensor;
    std::weak_ptr<HeldShard> shard;
  };
  struct Registry {
    std::mutex mutex;
    std::unordered_map<const void*, Entry> held;
    std::map<std::tuple<int, int, int>, at::Tensor> elements;  // by dtype and device
  };
  static std::tuple<int, int, int> key_of(c10::ScalarType dtype, at::Device device) {
    return {static_cast<int>(dtype), static_cast<int>(device.type()), device.index()};
  }
  static Registry& instance() {
    static auto* registry = new Registry();  // never destroyed: placeholders may outlive main
    return *registry;
  }
  static at::Tensor element(c10::ScalarType dtype, at::Device device) {
    auto& r = instance();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto& e = r.elements[key_of(dtype, device)];
    if (!e.defined()) {
      at::NoGradGuard no_grad;
      e = at::full({}, std::numeric_limits<double>::quiet_NaN(),
                   at::TensorOptions(dtype).device(device));
    }
    return e;
  }
};

/// `value` (any shape) cut for `group`: this rank's piece of its flattened elements, evenly,
/// and its fingerprint.
inline HeldShard cut_shard(const at::Tensor& value, std::shared_ptr<const ShardGroup> group) {
  at::NoGradGuard no_grad;
  HeldShard shard;
  shard.cut = ShardCut::even(value.numel(), group->world_size());
  const auto [from, to] = shard.cut.range(group->rank(), value.numel());
  shard.piece = value.detach().reshape({-1}).narrow(0, from, std::max<std::int64_t>(to - from, 0)).clone();
  shard.fingerprint = fingerprint(value);
  shard.group = std::move(group);
  return shard;
}

/// The whole value of a parameter of `sizes` held as `shard` (flat pieces of every rank put
/// together), in the pieces' dtype. Collective over the shard's group.
inline at::Tensor gather_shard(const HeldShard& shard, at::IntArrayRef sizes) {
  at::NoGradGuard no_grad;
  const auto& group = *shard.group;
  std::int64_t numel = 1;
  for (const auto s : sizes) numel *= s;
  std::int64_t longest = 0;
  for (int r = 0; r < group.world_size(); ++r) {
    const auto [from, to] = shard.cut.range(r, numel);
    longest = std::max(longest, to - from);
  }
  auto mine = at::zeros({longest}, shard.piece.options());
  if (shard.piece.numel() > 0) mine.narrow(0, 0, shard.piece.numel()).copy_(shard.piece);
  const auto all = group.all_gather(mine);
  std::vector<at::Tensor> parts;
  for (int r = 0; r < group.world_size(); ++r) {
    const auto [from, to] = shard.cut.range(r, numel);
    if (to > from) parts.push_back(all[static_cast<std::size_t>(r)].narrow(0, 0, to - from));
  }
  auto whole = parts.empty() ? at::empty({0}, shard.piece.options()) : at::cat(parts);
  MIXPREC_CHECK(whole.numel() == numel, "a parameter held in shards of shape ", sizes,
                " gathered ", whole.numel(), " elements: its pieces do not fit together");
  return whole.view(sizes);
}

/// Casts a held parameter: its piece and its placeholder take `dtype` (as a whole one's values
/// would round).
inline void cast_held(const at::Tensor& p, c10::ScalarType dtype) {
  at::NoGradGuard no_grad;
  if (auto shard = HeldShards::find(p); shard && !shard->whole) {
    if (shard->piece.defined()) shard->piece = shard->piece.to(dtype);
    shard->fingerprint = recast_fingerprint(shard->fingerprint, dtype);
  }
  p.set_data(HeldShards::placeholder(p.sizes(), dtype, p.device()));
}

/// A held parameter takes `value` (its shape, the parameter's dtype): this rank keeps its piece.
inline void assign_held(HeldShard& shard, const at::Tensor& value) {
  at::NoGradGuard no_grad;
  const auto v = value.detach();
  const auto [from, to] = shard.cut.range(shard.group->rank(), v.numel());
  shard.piece = v.reshape({-1}).narrow(0, from, std::max<std::int64_t>(to - from, 0)).clone();
  shard.fingerprint = fingerprint(v);
}

/// A held parameter whole on this rank (its data gathered from every rank's piece); it stays
/// registered, so that reshard_param() can hold it again. Collective.
inline void unshard_param(const at::Tensor& p, HeldShard& shard) {
  if (shard.whole) return;
  at::NoGradGuard no_grad;
  p.set_data(gather_shard(shard, p.sizes()).to(p.scalar_type()));
  shard.whole = true;
}

/// The inverse: `p` a placeholder again; `recut`: its piece cut anew from its data (which may
/// have changed while whole: a load, a cast), else the piece it had. Local.
inline void reshard_param(const at::Tensor& p, HeldShard& shard, bool recut) {
  if (!shard.whole) return;
  at::NoGradGuard no_grad;
  if (recut) assign_held(shard, p);
  p.set_data(HeldShards::placeholder(p.sizes(), p.scalar_type(), p.device()));
  shard.whole = false;
}

/// An Error unless `p`, held as `shard` says, still has its placeholder (or is gathered whole):
/// LibTorch's module->to(dtype) or to(device) replaces a placeholder by its NaN values in full,
/// which would train as NaN. `name` names the parameter.
inline void check_intact(const at::Tensor& p, const HeldShard& shard, const std::string& name) {
  MIXPREC_CHECK(shard.whole || HeldShards::is_placeholder(p), "parameter ", name, " of shape ",
                p.sizes(), " is held in shards across ranks, but its data was replaced (LibTorch's "
                "module->to(dtype) or to(device) casts its NaN placeholder, not its value): to cast "
                "a model held in shards use mixprec::cast_floating, which casts the pieces; the "
                "parameter now holds NaN, build the model again");
}

/// An Error naming the first of `params` (named) that is held in shards: `what` cannot take
/// it, `fix` says what can.
template <class Named>
void check_not_held(const Named& named, const char* what) {
  for (const auto& item : named) {
    MIXPREC_CHECK(!HeldShards::is_placeholder(item.value()), what, ": parameter '", item.key(),
                  "' is held in shards across ranks (built in a mixprec::ShardedBuild, or left "
                  "so by a ZeRO-3 Trainer): gather its weights first with mixprec::unshard(model) "
                  "on every rank, or train it with DistributedOptions::shard_parameters naming "
                  "its unit; nothing was changed");
  }
}

}  // namespace mixprec::detail
