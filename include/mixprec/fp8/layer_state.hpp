#pragma once
// The fp8 state of one Float8Linear under one Trainer: its recipe's settings, the casts of its
// operands (tensorwise, delayed or rowwise), the amaxes of the step in progress and, for delayed
// scaling, the amax histories and the scales they give.

#include <mixprec/core/compat.hpp>
#include <mixprec/fp8/block_recipes.hpp>
#include <mixprec/fp8/quantize.hpp>
#include <mixprec/optim/lean_kernels.hpp>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace mixprec::detail {

/// A recipe's settings at run time (recipes.hpp has their meaning).
struct Fp8Settings {
  bool delayed = false;
  int history = 0;
  int margin = 0;
  bool rowwise = false;
  bool power_of_2_scales = false;
  bool grad_output_e4m3 = false;
  bool weight_grad_fp8 = true;
  BlockFormat block = BlockFormat::none;  // the block-scaled recipes (block_recipes.hpp)
  std::int64_t block_size = 0;
  MxScale mx_scale = MxScale::floor;
  bool two_dim_weights = false, stochastic_gradients = false, hadamard = false;  // NVFP4

  template <class Recipe>
  static Fp8Settings of() {
    Fp8Settings s{Recipe::delayed,           Recipe::history,          Recipe::margin, Recipe::rowwise,
                  Recipe::power_of_2_scales, Recipe::grad_output_e4m3, Recipe::weight_grad_fp8};
    s.block = block_format_of<Recipe>();
    if constexpr (block_format_of<Recipe>() != BlockFormat::none) s.block_size = Recipe::block;
    if constexpr (block_format_of<Recipe>() == BlockFormat::mxfp8) s.mx_scale = Recipe::scale_mode;
    if constexpr (block_format_of<Recipe>() == BlockFormat::nvfp4) {
      s.two_dim_weights = Recipe::two_dim_weights;
      s.stochastic_gradients = Recipe::stochastic_gradients;
      s.hadamard = Recipe::hadamard;
    }
    return s;
  }
};

/// The six casts of a Float8Linear's step, in the order of Fp8Operands: the forward product's
/// input and weight, grad_input's grad_output, then the backward products' own casts, which
/// only rowwise recipes make (along the other axis, or the weight tensorwise).
enum class Fp8Cast {
  input,
  weight,
  grad_output,
  weight_for_grad_input,
  grad_output_for_grad_weight,
  input_for_grad_weight
};

inline Fp8Role role_of(Fp8Cast cast) {
  switch (cast) {
    case Fp8Cast::input:
    case Fp8Cast::input_for_grad_weight: return Fp8Role::input;
    case Fp8Cast::weight:
    case Fp8Cast::weight_for_grad_input: return Fp8Role::weight;
    default: return Fp8Role::grad_output;
  }
}

/// The fp8 state of one Float8Linear under one Trainer: per operand, the amax of the step in
/// progress and, for delayed scaling, the amax history and the scale it gives.
class Fp8LayerState : public torch::CustomClassHolder {
 public:
  struct Slot {
    at::Tensor pending;  // this step's amax (max over its micro-batches); undefined: none yet
    at::Tensor history;  // delayed: [History] fp32, newest first
    at::Tensor scale;    // delayed: the scale this step uses
  };

  explicit Fp8LayerState(const Fp8Settings& settings) : settings_(settings) {
    for (auto& slot : slots_) {
      if (settings_.delayed) {
        slot.history = at::zeros({settings_.history}, at::kFloat);
        slot.scale = at::ones({}, at::kFloat);
      }
    }
  }
  Fp8LayerState(bool delayed, int history, int margin)
      : Fp8LayerState(Fp8Settings{delayed, history, margin}) {}

  const Fp8Settings& settings() const noexcept { return settings_; }

  /// Whether the forward pass about to run records its amaxes: one with grad (a training
  /// step's); backward always does.
  void set_recording(bool on) noexcept { recording_ = on; }

  /// The fp8 format of an operand under this recipe.
  c10::ScalarType dtype(Fp8Role role) const {
    return role == Fp8Role::grad_output && !settings_.grad_output_e4m3 ? float8_e5m2 : float8_e4m3;
  }

  /// x in fp8 for `role` with one scale (tensorwise or delayed), its amax counted toward this
  /// step's where recorded.
  Fp8Tensor cast(Fp8Role role, const at::Tensor& x) {
    auto& slot = slots_[static_cast<int>(role)];
    const bool record = recording_ || role == Fp8Role::grad_output;
    at::Tensor scale;
    if (!settings_.delayed || record) {
      const auto amax = abs_max(x);
      if (record) slot.pending = slot.pending.defined() ? at::maximum(slot.pending, amax) : amax;
      if (!settings_.delayed) {
        scale = scale_from_amax(amax, fp8_max(dtype(role)), 0, settings_.power_of_2_scales);
      }
    }
    if (settings_.delayed) {
      if (slot.scale.device() != x.device()) move_to(x.device());
      scale = slot.scale;
    }
    return keep(static_cast<Fp8Cast>(role), quantize(x, scale, dtype(role)));
  }

  /// A 2-D x in fp8 for `cast` with one dynamic scale per row (`dim` 1) or per column (`dim` 0),
  /// or one for the whole tensor (`dim` empty), as the rowwise recipes cast; the largest of the
  /// amaxes counted toward this step's where recorded (the backward pass's casts of input and
  /// weight see what the forward pass's did).
  Fp8Tensor cast_rowwise(Fp8Cast cast, const at::Tensor& x, std::optional<std::int64_t> dim) {
    const auto role = role_of(cast);
    auto& slot = slots_[static_cast<int>(role)];
    const auto amax = dim ? abs_max(x, *dim) : abs_max(x);
    const bool forward = cast == Fp8Cast::input || cast == Fp8Cast::weight;
    if ((forward && recording_) || role == Fp8Role::grad_output) {
      const auto largest = amax.max().to(at::kFloat);
      slot.pending = slot.pending.defined() ? at::maximum(slot.pending, largest) : largest;
    }
    const auto scale = scale_from_amax(amax, fp8_max(dtype(role)), 0, settings_.power_of_2_scales);
    return keep(cast, quantize(x, scale, dtype(role)));
  }

  /// Counts the amax of a block-scaled cast (its largest block's) toward this step's, where
  /// recorded, as cast_rowwise does.
  void note_amax(Fp8Cast cast, const at::Tensor& amax) {
    const auto role = role_of(cast);
    const bool forward = cast == Fp8Cast::input || cast == Fp8Cast::weight;
    if ((forward && recording_) || role == Fp8Role::grad_output) {
      auto& slot = slots_[static_cast<int>(role)];
      const auto largest = amax.max().to(at::kFloat);
      slot.pending = slot.pending.defined() ? at::maximum(slot.pending, largest) : largest;
    }
  }

  /// NVFP4: the seed of this layer's random bits, its index among the Trainer's fp8 layers and
  /// the draws made so far (one per backward pass). rounding_state() is [seed, draws] (int64),
  /// what checkpoints keep.
  void set_rounding(std::uint64_t seed, std::uint64_t layer) {
    rounding_ = at::tensor({static_cast<std::int64_t>(seed), std::int64_t{0}}, at::kLong);
    rounding_layer_ = layer;
  }
  at::Tensor& rounding_state() noexcept { return rounding_; }
  std::uint64_t rounding_seed() const { return static_cast<std::uint64_t>(rounding_.data_ptr<std::int64_t>()[0]); }
  std::uint64_t rounding_draws() const { return static_cast<std::uint64_t>(rounding_.data_ptr<std::int64_t>()[1]); }
  /// The key of this backward pass's stochastic rounding of cast `which` (0: grad_input's
  /// grad_output, 1: grad_weight's); advance_rounding() after the pass.
  std::uint32_t rounding_key(int which) const {
    return detail::rounding_key(rounding_seed(), rounding_draws(),
                                2 * rounding_layer_ + static_cast<std::uint64_t>(which));
  }
  void advance_rounding() { rounding_.data_ptr<std::int64_t>()[1] += 1; }
  /// The key of this layer's random Hadamard signs (a draw index no backward pass reaches).
  std::uint32_t hadamard_key() const {
    return detail::rounding_key(rounding_seed(), ~std::uint64_t{0}, rounding_layer_);
  }

  /// This step's amaxes (undefined if no fp8 product ran).
  at::Tensor pending_amaxes() const {
    std::vector<at::Tensor> amaxes;
    for (const auto& slot : slots_) {
      if (slot.pending.defined()) amaxes.push_back(slot.pending.reshape({1}));
    }
    return amaxes.empty() ? at::Tensor() : at::cat(amaxes);
  }

  /// After the optimizer step: a step taken puts its amaxes into the histories and updates the
  /// scales (delayed); a skipped one drops them.
  void finish_step(bool stepped) {
    for (auto& slot : slots_) {
      if (settings_.delayed && stepped && slot.pending.defined()) {
        slot.history = at::roll(slot.history, 1);
        slot.history[0].copy_(slot.pending);
        const auto amax = slot.history.max();
        slot.scale = at::where(amax > 0,
                               scale_from_amax(amax, fp8_max(dtype(role_of_slot(slot))), settings_.margin),
                               slot.scale);
      }
      slot.pending = at::Tensor();
    }
  }

  bool delayed() const noexcept { return settings_.delayed; }
  int margin() const noexcept { return settings_.margin; }
  const Slot& slot(Fp8Role role) const { return slots_[static_cast<int>(role)]; }
  Slot& slot(Fp8Role role) { return slots_[static_cast<int>(role)]; }

  void keep_operands() {
    keep_operands_ = true;
    kept_ = {};
    operands_ = {};
  }
  const Fp8Operands& operands() const noexcept { return operands_; }

  // A copy of the first cast of each kind after keep_operands(), for last_operands().
  Fp8Tensor keep(Fp8Cast cast, Fp8Tensor result) {
    const auto index = static_cast<std::size_t>(cast);
    if (keep_operands_ && !kept_[index]) {
      kept_[index] = true;
      Fp8Tensor* targets[] = {&operands_.input,
                              &operands_.weight,
                              &operands_.grad_output,
                              &operands_.weight_for_grad_input,
                              &operands_.grad_output_for_grad_weight,
                              &operands_.input_for_grad_weight};
      const auto copy = [](const at::Tensor& t) { return t.defined() ? t.clone() : t; };
      *targets[index] = {copy(result.data), copy(result.scale), copy(result.tensor_scale)};
    }
    return result;
  }

 private:
  Fp8Role role_of_slot(const Slot& slot) const {
    return static_cast<Fp8Role>(&slot - slots_.data());
  }
  void move_to(c10::Device device) {
    for (auto& slot : slots_) {
      slot.history = slot.history.to(device);
      slot.scale = slot.scale.to(device);
    }
  }
  Fp8Settings settings_;
  bool recording_ = false;
  std::array<Slot, 3> slots_;
  bool keep_operands_ = false;
  std::array<bool, 6> kept_{};
  Fp8Operands operands_;
  at::Tensor rounding_ = at::zeros({2}, at::kLong);  // NVFP4: [seed, draws]
  std::uint64_t rounding_layer_ = 0;
};

}  // namespace mixprec::detail
