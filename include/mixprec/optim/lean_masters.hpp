#pragma once
/// LeanMasters: what MasterWeights keeps of its fp32 masters between optimizer steps under a lean
/// storage (core/state_storage.hpp). The optimizer steps fp32 tensors; between steps those
/// tensors hold no data (each is a single NaN, expanded to the master's shape: any read of it
/// is NaN, never a plausible number), and the master lives on as
///   RemainderMasters:   the bf16 model weight + an int16 remainder (+ the rare ties that
///                       rounded down, by index): exactly the fp32 value;
///   StochasticRounding: the bf16 model weight alone; the step's fp32 result is rounded into
///                       it up or down at random (unbiased), with bits from rounding_key().
/// inflate() makes the fp32 values for a step (or a checkpoint); stow() puts them away.

#include <mixprec/core/error.hpp>
#include <mixprec/core/state_storage.hpp>
#include <mixprec/optim/lean_kernels.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace mixprec::detail {

class LeanMasters {
 public:
  explicit LeanMasters(MasterStorage storage) : storage_(storage) {
    TORCH_INTERNAL_ASSERT(storage == MasterStorage::remainder ||
                          storage == MasterStorage::stochastic);
  }

  MasterStorage storage() const noexcept { return storage_; }

  /// Takes the pair (`model`: bf16, `master`: its fp32 master, holding data) as the next index
  /// (indices are consecutive from 0); then stows it: the model keeps its value under
  /// StochasticRounding (already the master rounded to nearest), the remainder is split off
  /// under RemainderMasters. Its stochastic roundings take their bits as those of tensor
  /// `tensor` (default: its index) from element `first` on, of a tensor of `whole` elements
  /// (default: model's): a rank's slice of a tensor (sharded data parallel) rounds, and steps
  /// (lean_adam.hpp), as the whole tensor does unsharded.
  void add(const at::Tensor& model, at::Tensor& master,
           std::optional<std::uint64_t> tensor = std::nullopt, std::int64_t first = 0,
           std::int64_t whole = -1) {
    MIXPREC_CHECK(model.scalar_type() == at::kBFloat16, "lean master weights are for bf16 "
                  "model tensors; a tensor of shape ", model.sizes(), " is ",
                  model.scalar_type());
    entries_.push_back({});
    entries_.back().tensor = tensor.value_or(entries_.size() - 1);
    entries_.back().first = first;
    entries_.back().whole = whole < 0 ? model.numel() : whole;
    stow_one(entries_.size() - 1, model, master, /*stepped=*/false);
  }

  /// The number of optimizer steps rounded stochastically so far, and the seed of their bits.
  std::uint64_t rounds() const noexcept { return rounds_; }
  std::uint64_t seed() const noexcept { return seed_; }
  void set_rounding(std::uint64_t seed, std::uint64_t rounds) noexcept {
    seed_ = seed;
    rounds_ = rounds;
  }

  /// Whether pair `index`'s master holds its fp32 data now.
  bool inflated(std::size_t index) const { return entries_.at(index).inflated; }

  /// Pair `index`'s fp32 master value into `master` (a new tensor's data).
  void inflate(std::size_t index, const at::Tensor& model, at::Tensor& master) {
    auto& e = entries_.at(index);
    if (e.inflated) return;
    master.set_data(value(index, model));
    e.inflated = true;
  }

  /// Pair `index`'s master holds `value` (a tensor of its own, fp32, the master's shape): a
  /// checkpoint's value, to be stowed.
  void inflate_with(std::size_t index, at::Tensor& master, const at::Tensor& value) {
    auto& e = entries_.at(index);
    master.set_data(value);
    e.inflated = true;
  }

  /// Pair `index`'s fp32 master value, as a new tensor (the master itself left as it is).
  at::Tensor value(std::size_t index, const at::Tensor& model) const {
    const auto& e = entries_.at(index);
    at::NoGradGuard no_grad;
    const auto low = model.detach().contiguous();
    if (storage_ == MasterStorage::stochastic) return low.to(at::kFloat);
    auto out = at::empty(low.sizes(), low.options().dtype(at::kFloat));
    join_master(low, e.remainder, e.down_ties, out);
    return out;
  }

  /// Puts pair `index`'s master away, after writing the model from it: its rounding and
  /// remainder (RemainderMasters, always), or its stochastic rounding (StochasticRounding, when
  /// `stepped`: else the model holds the value already). A master without data is left as is.
  void stow_one(std::size_t index, const at::Tensor& model, at::Tensor& master, bool stepped) {
    auto& e = entries_.at(index);
    if (!e.inflated) return;
    at::NoGradGuard no_grad;
    const auto value = master.detach().contiguous();
    const bool write = storage_ == MasterStorage::remainder || stepped;
    if (write) {
      auto low = model.is_contiguous() ? model.detach()
                                       : at::empty(model.sizes(), model.options());
      if (storage_ == MasterStorage::remainder) {
        auto rem = at::empty(model.sizes(), model.options().dtype(at::kShort));
        e.down_ties = split_master(value, low, rem);
        e.remainder = rem;
      } else {
        stochastic_round(value, low, rounding_key(seed_, rounds_, e.tensor), e.first);
      }
      if (!low.is_same(model)) model.detach().copy_(low);
    }
    release_one(index, master);
  }

  /// Drops pair `index`'s fp32 data without writing anything (a skipped step: the values did
  /// not change).
  void release_one(std::size_t index, at::Tensor& master) {
    auto& e = entries_.at(index);
    master.set_data(placeholder(master));
    e.inflated = false;
  }

  /// What a one-pass step (lean_adam.hpp) updates in place of pair `index`'s master: its
  /// remainder (undefined under StochasticRounding), its ties that rounded down, and the key of
  /// this step's stochastic rounding.
  struct InPlace {
    at::Tensor remainder;
    std::vector<std::int64_t>* down_ties;
    std::uint32_t key;
    std::int64_t first;  // the index of element 0 in its whole tensor (the rounding's too)
    std::int64_t whole;  // that tensor's numel
  };
  InPlace in_place(std::size_t index) {
    auto& e = entries_.at(index);
    return {e.remainder, &e.down_ties, rounding_key(seed_, rounds_, e.tensor), e.first, e.whole};
  }

  /// After the stow of a step taken: the next step rounds with other bits.
  void finish_round() noexcept { ++rounds_; }

  /// Bytes held between steps beside the model weights (the remainders and the tie lists).
  std::int64_t stowed_bytes() const {
    std::int64_t bytes = 0;
    for (const auto& e : entries_) {
      if (e.remainder.defined()) bytes += e.remainder.numel() * 2;
      bytes += static_cast<std::int64_t>(e.down_ties.size() * sizeof(std::int64_t));
    }
    return bytes;
  }

  /// A master between steps: one NaN, expanded to the master's shape (no storage of its own).
  static at::Tensor placeholder(const at::Tensor& master) {
    return at::full({}, std::numeric_limits<float>::quiet_NaN(),
                    master.options().dtype(at::kFloat))
        .expand(master.sizes());
  }

 private:
  struct Entry {
    at::Tensor remainder;                 // RemainderMasters: int16, the model's shape
    std::vector<std::int64_t> down_ties;  // its ties that rounded down (remainder +32768)
    bool inflated = true;                 // added with data
    std::uint64_t tensor = 0;             // whose rounding bits (rounding_key)
    std::int64_t first = 0;               // its first element's index in that tensor
    std::int64_t whole = 0;               // that tensor's numel
  };

  MasterStorage storage_;
  std::vector<Entry> entries_;
  std::uint64_t seed_ = 0;
  std::uint64_t rounds_ = 0;
};

/// A lean master's bf16 tensor (the model's weight, or a rank's slice of it) and what
/// LeanMasters keeps of it, for a step that updates them in place (lean_adam.hpp).
struct LeanTarget {
  at::Tensor model;
  LeanMasters::InPlace kept;
};

}  // namespace mixprec::detail
