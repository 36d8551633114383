#pragma once
/// Loss scalers: GradScaler (dynamic, PyTorch's algorithm and state_dict), StaticScaler (a fixed
/// scale) and NoScaler (scale 1). In your own loop they have PyTorch's GradScaler API, and all
/// three skip an optimizer step whose gradients hold inf or NaN, so a bad step never reaches the
/// weights. Under a Trainer a scaler only chooses the scale (the LossScaler concept); the
/// Trainer's step unscales, checks, clips and skips itself (detail::StepEngine).
///
///   mixprec::GradScaler scaler;                       // init_scale 65536, growth every 2000 steps
///   for (auto& batch : loader) {
///     optimizer.zero_grad();
///     auto loss = compute_loss(batch);                // under mixprec::autocast<P>() for O1
///     scaler.scale(loss).backward();
///     scaler.unscale_(optimizer);                     // optional: before clipping or inspecting grads
///     torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
///     if (!scaler.step(optimizer)) log_skip(scaler.get_scale());  // false: inf/NaN, step skipped
///     scaler.update();
///   }

#include <mixprec/core/concepts.hpp>
#include <mixprec/scaling/unscale.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Dict.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mixprec {

/// Settings of GradScaler; the defaults are PyTorch's.
struct GradScalerOptions {
  /// The first scale; PyTorch's 2^16.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// The scale is multiplied by this after `growth_interval` steps without inf/NaN.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// The scale is multiplied by this after a step with inf/NaN.
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(std::int64_t, growth_interval) = 2000;
  /// Overflowing steps tolerated before backing off (1: PyTorch; DeepSpeed and Megatron use 2).
  /// The count refills when the scale grows, as in Megatron-LM and DeepSpeed's default.
  TORCH_ARG(std::int64_t, hysteresis) = 1;
  /// Bounds of the scale; PyTorch has none (0 and +inf). The scale never grows to inf. Like the
  /// scale, they are fp32: 1e-4 bounds it at float(1e-4).
  TORCH_ARG(double, min_scale) = 0.0;
  TORCH_ARG(double, max_scale) = std::numeric_limits<double>::infinity();
  /// false: behaves as NoScaler (scale 1, inf/NaN steps still skipped), state_dict empty.
  TORCH_ARG(bool, enabled) = true;
  /// Unscale fp16 gradients in place. Off, as in PyTorch: only PureHalf<at::Half> needs it.
  TORCH_ARG(bool, allow_fp16_grads) = false;
};

/// Optional parts of an unscale_ call.
struct UnscaleOptions {
  /// Clip the unscaled gradients to this total L2 norm, fused into the unscale pass.
  TORCH_ARG(std::optional<double>, max_grad_norm) = std::nullopt;
};

namespace detail {

/// What the Trainer's step asks of the gradient passes beyond UnscaleOptions.
struct UnscalePlan {
  /// Clip the unscaled gradients to this total L2 norm, fused into the unscale pass.
  TORCH_ARG(std::optional<double>, max_grad_norm) = std::nullopt;
  /// Read each gradient from these parameters' .grad() (same order as the optimizer's
  /// parameters) and write it, unscaled, into the optimizer's; for fp32 master weights.
  TORCH_ARG(std::vector<at::Tensor>, grads_from) = {};
  /// More values whose inf/NaN also skips the step, e.g. the loss: a NaN loss can have finite
  /// gradients. Checked on the device, without a host synchronisation.
  TORCH_ARG(at::Tensor, also_check) = {};
  /// Called with the one-element fp32 inf flag (non-zero: inf/NaN) once the local checks are
  /// done, before the step-or-skip decision reads it: data-parallel training MAX-reduces it
  /// across ranks, so that every rank steps or skips alike.
  TORCH_ARG(std::function<void(at::Tensor&)>, agree) = nullptr;
  /// With clipping, called with the local sum of squares and inf/NaN flag before the norm is
  /// taken: sharded data parallel sums them over the ranks, each of which holds a slice.
  TORCH_ARG(std::function<void(double&, bool&)>, sum_over_ranks) = nullptr;
  /// Sharded data parallel, the device of the collectives: the checks, the sums and the
  /// agreement run even where this rank holds no gradient (its slices got none this step).
  TORCH_ARG(std::optional<at::Device>, collective_on) = std::nullopt;
};

/// What StepEngine::step_fused did.
struct FusedStepResult {
  bool stepped = false;                ///< false: inf/NaN, the optimizer step was skipped
  std::optional<double> grad_norm;     ///< the total unscaled gradient norm, when clipping
};

enum class Stage { ready, unscaled, stepped };

/// The dynamic-scale state that GradScaler::update advances.
struct ScaleState {
  float scale;
  std::int32_t growth_tracker;
  std::int64_t hysteresis_tracker;
};

/// `value` rounded to the fp32 scale; an Error unless that is a normal fp32 number, which also
/// keeps 1 / scale finite. Bounds and checks are applied to this fp32 value, never the double.
inline float checked_scale(double value, std::string_view what) {
  const auto scale = static_cast<float>(value);
  MIXPREC_CHECK(std::isnormal(scale) && scale > 0, what, " must be a positive normal fp32 value (",
                std::numeric_limits<float>::min(), " to ", std::numeric_limits<float>::max(),
                "), got ", value, ", which is ", scale, " in fp32, the scale's type");
  return scale;
}

/// The bounds of the scale as fp32, where they are applied.
inline float min_scale_fp32(const GradScalerOptions& o) { return static_cast<float>(o.min_scale()); }
inline float max_scale_fp32(const GradScalerOptions& o) { return static_cast<float>(o.max_scale()); }

/// One update of the scale: PyTorch's _amp_update_scale_ (fp32 scale, int32 tracker), with
/// hysteresis, bounds and the never-grow-to-inf guard of LibTorch >= 2.1.
inline ScaleState next_scale(ScaleState s, bool found_inf, const GradScalerOptions& o) {
  if (found_inf) {
    s.growth_tracker = 0;
    if (--s.hysteresis_tracker <= 0) {
      const auto backed_off = static_cast<float>(static_cast<double>(s.scale) * o.backoff_factor());
      s.scale = std::max(backed_off, min_scale_fp32(o));
    }
    return s;
  }
  if (s.growth_tracker + 1 < o.growth_interval()) {
    ++s.growth_tracker;
    return s;
  }
  s.growth_tracker = 0;
  s.hysteresis_tracker = o.hysteresis();
  const auto grown = static_cast<float>(static_cast<double>(s.scale) * o.growth_factor());
  if (std::isfinite(grown)) s.scale = std::min(grown, max_scale_fp32(o));
  return s;
}

/// Validates everything but init_scale, which load_state_dict replaces by a saved scale.
inline void check_dynamics(const GradScalerOptions& o) {
  MIXPREC_CHECK(o.growth_factor() > 1 && std::isfinite(o.growth_factor()),
                "GradScalerOptions::growth_factor must be finite and > 1, got ", o.growth_factor(),
                " (the scale grows by it after growth_interval clean steps)");
  MIXPREC_CHECK(o.backoff_factor() > 0 && o.backoff_factor() < 1,
                "GradScalerOptions::backoff_factor must be in (0, 1), got ", o.backoff_factor(),
                " (the scale shrinks by it after an overflow)");
  MIXPREC_CHECK(o.growth_interval() >= 1 && o.growth_interval() <= std::numeric_limits<std::int32_t>::max(),
                "GradScalerOptions::growth_interval must be in [1, 2^31), got ", o.growth_interval());
  MIXPREC_CHECK(o.hysteresis() >= 1, "GradScalerOptions::hysteresis must be >= 1, got ",
                o.hysteresis(), " (1 backs off at the first overflow, as PyTorch does)");
  // 0 is PyTorch's "no bound"; a positive bound that fp32 flushes to 0 (1e-46), or a subnormal
  // one (whose inverse is inf), would bound nothing.
  MIXPREC_CHECK(o.min_scale() == 0 || (o.min_scale() > 0 && std::isnormal(min_scale_fp32(o))),
                "GradScalerOptions::min_scale must be 0 or a positive normal fp32 value (at least ",
                std::numeric_limits<float>::min(), "), got ", o.min_scale());
  MIXPREC_CHECK(o.max_scale() == std::numeric_limits<double>::infinity() ||
                    (o.max_scale() > 0 && std::isnormal(max_scale_fp32(o))),
                "GradScalerOptions::max_scale must be +infinity or a normal fp32 value (at most ",
                std::numeric_limits<float>::max(), "), got ", o.max_scale());
  MIXPREC_CHECK(min_scale_fp32(o) <= max_scale_fp32(o), "GradScalerOptions needs min_scale <= "
                "max_scale, got ", o.min_scale(), " > ", o.max_scale());
}

/// `scale` checked against the bounds of `o`, compared in fp32 as the scale is stored.
inline void check_in_bounds(float scale, const GradScalerOptions& o, std::string_view what) {
  MIXPREC_CHECK(min_scale_fp32(o) <= scale && scale <= max_scale_fp32(o), what, " ", scale,
                " is outside [min_scale, max_scale] = [", min_scale_fp32(o), ", ",
                max_scale_fp32(o), "] (compared in fp32, the scale's type)");
}

inline void check_options(const GradScalerOptions& o) {
  check_dynamics(o);
  check_in_bounds(checked_scale(o.init_scale(), "GradScalerOptions::init_scale"), o,
                  "GradScalerOptions::init_scale");
}

/// What the three scalers share: per-optimizer stages, the inf checks, unscale_ and step.
class ScalerCore {
 public:
  /// loss * scale; the scale lives on the loss's device from the first call on.
  at::Tensor scale(const at::Tensor& loss) {
    MIXPREC_CHECK(loss.defined(), "scale() got an undefined tensor: pass the loss");
    MIXPREC_CHECK(at::isFloatingType(loss.scalar_type()),
                  "scale() needs a floating-point loss, got ", loss.scalar_type());
    if (!scaling_) return loss;
    if (!scale_.defined()) scale_ = at::full({}, host_scale_, loss.options().dtype(at::kFloat));
    return loss * scale_.to(loss.device());
  }

  /// Divides the optimizer's gradients by the scale and records whether any is inf or NaN.
  void unscale_(torch::optim::Optimizer& optimizer) { (void)unscale_(optimizer, {}); }

  /// unscale_ with options; returns the total gradient norm (unscaled) when clipping.
  std::optional<double> unscale_(torch::optim::Optimizer& optimizer, const UnscaleOptions& options) {
    return unscale_planned(optimizer, UnscalePlan().max_grad_norm(options.max_grad_norm()));
  }

  /// Unscales if not done yet, then steps the optimizer unless its gradients hold inf or NaN.
  /// Returns whether it stepped. On a device this is the iteration's one host synchronisation
  /// (with clipping, the norm's read has taken its place).
  bool step(torch::optim::Optimizer& optimizer) {
    auto& entry = entry_of(optimizer);
    MIXPREC_CHECK(entry.stage != Stage::stepped,
                  "step() has already been called since the last update()");
    if (entry.stage == Stage::ready) unscale_(optimizer);
    if (!entry.found_inf.defined()) {
      entry.stage = Stage::ready;  // nothing was unscaled: the iteration can still go on
      detail::fail("step() found no gradients in this optimizer: call backward() on "
                   "scaler.scale(loss) before step()");
    }
    const bool finite = !found_of(entry);
    if (finite) {
      optimizer.step();
    } else {
      ++skipped_steps_;
    }
    entry.stage = Stage::stepped;
    return finite;
  }

  /// The current scale (1 for NoScaler). The scale is kept on the host and copied to the
  /// loss's device, so reading it never waits for the device.
  double get_scale() const { return scaling_ ? static_cast<double>(host_scale_) : 1.0; }

  /// Optimizer steps that this scaler's step() skipped because of inf or NaN, since
  /// construction (in your own loop; a Trainer's skipped steps are in Trainer::stats()).
  std::int64_t skipped_steps() const noexcept { return skipped_steps_; }

  /// Forgets this iteration's unscale_/step records without touching the scale, e.g. after an
  /// error between backward() and update() in your own loop.
  void reset_stages() noexcept { entries_.clear(); }

  // A copy would share the scale tensor with the original: move only.
  ScalerCore(const ScalerCore&) = delete;
  ScalerCore& operator=(const ScalerCore&) = delete;
  ScalerCore(ScalerCore&&) noexcept = default;
  ScalerCore& operator=(ScalerCore&&) noexcept = default;

 protected:
  ScalerCore(float init_scale, bool scaling, bool allow_fp16)
      : host_scale_(init_scale), scaling_(scaling), allow_fp16_(allow_fp16) {}

  std::optional<double> unscale_planned(torch::optim::Optimizer& optimizer,
                                        const UnscalePlan& options) {
    auto& entry = entry_of(optimizer);
    MIXPREC_CHECK(entry.stage != Stage::unscaled,
                  "unscale_() has already been called on this optimizer since the last update()");
    MIXPREC_CHECK(entry.stage != Stage::stepped, "unscale_() is being called after step(): call it "
                  "between backward() and step(), and update() once per iteration");
    check_unscale_call(options);
    auto pairs = collect_grads(optimizer, options.grads_from());
    std::optional<double> norm;
    if (!pairs.empty() || options.collective_on()) {
      auto found_inf = new_found_inf(pairs, options);
      try {
        norm = run_passes(pairs, options, found_inf, entry.found_host);
      } catch (...) {
        // Some gradients may be unscaled already: poison the step rather than risk a retry
        // unscaling them twice.
        entry.found_inf = found_inf.fill_(1.0);
        entry.found_host = true;
        entry.stage = Stage::unscaled;
        throw;
      }
      entry.found_inf = found_inf;
      agree(options, entry);
    }
    entry.stage = Stage::unscaled;
    return norm;
  }

  /// unscale_ and step in one, for an optimizer whose own step divides the gradients, such as
  /// mixprec::fused_adam_step: the gradients are checked for inf/NaN (under master weights,
  /// copied from grads_from first) but not divided; unless they hold inf/NaN,
  /// `fused_step(grad_scale)` steps the optimizer, grad_scale being the one fp32 divisor it must
  /// apply: the scale, divided by the clip coefficient when clipping; undefined when that is 1.
  /// update() follows as usual. One host synchronisation, on the inf flag.
  template <class FusedStep>
  FusedStepResult step_fused(torch::optim::Optimizer& optimizer, const UnscalePlan& options,
                             FusedStep&& fused_step) {
    auto& entry = entry_of(optimizer);
    MIXPREC_CHECK(entry.stage == Stage::ready, "step_fused() unscales inside the optimizer's "
                  "step: call it instead of unscale_() and step(), once per iteration");
    check_unscale_call(options);
    auto pairs = collect_grads(optimizer, options.grads_from());
    MIXPREC_CHECK(!pairs.empty() || options.collective_on(), "step_fused() found no gradients "
                  "in this optimizer: call backward() on scaler.scale(loss) first");
    auto found_inf = new_found_inf(pairs, options);
    FusedStepResult result;
    at::Tensor grad_scale;
    const bool masters = !options.grads_from().empty();
    try {
      if (masters) {
        // The model's gradients into the optimizer's, checked, undivided (fp16/bf16 values are
        // finite in fp32: the check is exact).
        detail::unscale_pairs_(pairs, 1.0F, found_inf);
        for (auto& pair : pairs) pair.from = pair.to;
      }
      const double scale = scaling_ ? static_cast<double>(host_scale_) : 1.0;
      double clip = 1.0;
      if (options.max_grad_norm()) {
        // One read pass: the norm and finiteness (the loss's included).
        const auto stats = summed_stats(pairs, options);
        entry.found_host = stats.non_finite;
        if (stats.non_finite) found_inf.fill_(1.0);
        result.grad_norm = stats.non_finite ? std::numeric_limits<double>::infinity()
                                            : std::sqrt(stats.sum_of_squares) * inv_scale();
        if (!stats.non_finite) clip = clip_coefficient(*result.grad_norm, options);
      } else if (!masters) {
        // Finiteness alone (the loss's included).
        entry.found_host = detail::any_non_finite(pairs, options.also_check());
        if (*entry.found_host) found_inf.fill_(1.0);
      } else {
        check_also(options, found_inf);
      }
      if (clip < 1.0) {
        grad_scale = at::full({}, static_cast<float>(scale / clip),
                              at::TensorOptions(at::kFloat).device(found_inf.device()));
      } else if (scaling_) {
        grad_scale = scale_;
      }
    } catch (...) {
      entry.found_inf = found_inf.fill_(1.0);  // nothing was divided; the step must not run
      entry.found_host = true;
      entry.stage = Stage::stepped;
      throw;
    }
    entry.found_inf = found_inf;
    entry.stage = Stage::stepped;
    agree(options, entry);
    result.stepped = !found_of(entry);
    if (result.stepped) {
      std::forward<FusedStep>(fused_step)(grad_scale);
    } else {
      ++skipped_steps_;
    }
    return result;
  }

  void set_scale(float scale) {
    if (scale_.defined()) scale_.fill_(scale);  // a host value: no synchronisation
    host_scale_ = scale;
  }

  /// Whether any optimizer of this iteration had inf/NaN gradients; then the stages start
  /// over. step() has read each flag already; only an unscale_ without step() reads it here.
  bool take_found_inf(std::string_view caller) {
    bool any = false;
    bool recorded = false;
    for (auto& [optimizer, entry] : entries_) {
      if (!entry.found_inf.defined()) continue;
      recorded = true;
      any |= found_of(entry);
    }
    MIXPREC_CHECK(recorded, caller, " found no inf checks recorded in this iteration: call "
                  "step(optimizer) (or unscale_) after scale(loss).backward(), then update()");
    entries_.clear();
    return any;
  }

  at::Tensor scale_;  // 0-dim fp32 copy of host_scale_, made by the first scale() on the loss's device
  float host_scale_;  // the scale
  bool scaling_;
  bool allow_fp16_;
  std::int64_t skipped_steps_ = 0;

 private:
  struct Entry {
    Stage stage = Stage::ready;
    at::Tensor found_inf;            // undefined: no gradient seen
    std::optional<bool> found_host;  // found_inf on the host, once known
  };

  void check_unscale_call(const UnscalePlan& options) const {
    MIXPREC_CHECK(!scaling_ || scale_.defined(),
                  "unscale_() before scale(loss): the gradients were never scaled; call "
                  "scaler.scale(loss).backward() first");
    if (options.max_grad_norm()) {
      MIXPREC_CHECK(*options.max_grad_norm() > 0 && std::isfinite(*options.max_grad_norm()),
                    "max_grad_norm must be finite and > 0, got ", *options.max_grad_norm());
    }
  }

  // The flag as every rank sees it, with what the host knew already folded in.
  static void agree(const UnscalePlan& options, Entry& entry) {
    if (!options.agree()) return;
    if (entry.found_host.value_or(false)) entry.found_inf.fill_(1.0);
    options.agree()(entry.found_inf);
    entry.found_host.reset();
  }

  // Ors the inf/NaN of UnscalePlan::also_check (e.g. the loss) into found_inf, on the device.
  static void check_also(const UnscalePlan& options, at::Tensor& found_inf) {
    if (!options.also_check().defined()) return;
    found_inf.add_(at::isfinite(options.also_check()).logical_not().any().to(found_inf.options()))
        .clamp_max_(1.0);
  }


  // Validates every gradient before touching any, so an Error leaves all state unchanged. Each
  // tensor once: an optimizer built on model->parameters() lists tied weights once per name,
  // and a tensor unscaled twice would be divided by the scale twice and counted twice in the norm.
  std::vector<GradPair> collect_grads(torch::optim::Optimizer& optimizer,
                                      const std::vector<at::Tensor>& grads_from) {
    auto& params = params_;  // kept between steps with its capacity: no allocation per step
    params.clear();
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) params.push_back(&p);
    }
    MIXPREC_CHECK(grads_from.empty() || grads_from.size() == params.size(),
                  "grads_from has ", grads_from.size(),
                  " tensors but the optimizer has ", params.size(), " parameters");
    const bool in_place = grads_from.empty();
    const auto& index = grad_index(optimizer, params);
    for (const auto& [i, j] : index.repeats) {
      MIXPREC_CHECK(in_place || grads_from[i].is_same(grads_from[j]),
                    "grads_from[", j, "] and grads_from[", i, "] differ, but "
                    "both are for the same optimizer tensor (listed twice): repeat its source");
    }
    auto& with_grad = with_grad_;
    with_grad.clear();
    for (const auto i : index.first) {
      const at::Tensor& grad = (in_place ? *params[i] : grads_from[i]).grad();
      if (!grad.defined()) continue;
      const auto dtype = grad.scalar_type();
      MIXPREC_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 ||
                        dtype == at::kDouble,
                    "unscale_() found a gradient of dtype ", dtype,
                    "; gradients must be Float, Double, Half or BFloat16");
      MIXPREC_CHECK(grad.is_sparse() || grad.is_non_overlapping_and_dense() ||
                        at::has_internal_overlap(grad) != at::MemOverlap::Yes,
                    "gradient ", i, " of shape ", grad.sizes(), " is an expanded view whose "
                    "elements share memory: unscaling it would scale shared values more than "
                    "once; give the parameter a gradient of its own (e.g. grad.contiguous())");
      if (in_place) {
        MIXPREC_CHECK(!scaling_ || dtype != at::kHalf || allow_fp16_,
                      "Attempting to unscale fp16 gradients in place: dividing them in fp16 "
                      "flushes the small values that loss scaling protects. Keep fp32 "
                      "parameters (MixedO1), or fp32 master weights (MixedO2); for "
                      "PureHalf<at::Half> opt in with GradScalerOptions().allow_fp16_grads(true)");
      } else {
        MIXPREC_CHECK(!grad.is_sparse(), "sparse gradients cannot be copied into master "
                      "weights; use a dense embedding (sparse=false) with MixedO2");
        MIXPREC_CHECK(grad.sizes() == params[i]->sizes(), "grads_from[", i,
                      "] has shape ", grad.sizes(), " but the optimizer's parameter has shape ",
                      params[i]->sizes());
      }
      with_grad.push_back(i);
    }
    std::vector<GradPair> pairs;
    pairs.reserve(with_grad.size());
    for (const auto i : with_grad) {
      if (in_place) {
        auto grad = params[i]->grad();
        // Repeated indices of a sparse gradient would be counted twice by the norm, and could
        // overflow fp16 when summed later: the parameter gets the coalesced gradient.
        if (grad.is_sparse() && !grad.is_coalesced()) {
          grad = grad.coalesce();
          params[i]->mutable_grad() = grad;
        }
        pairs.push_back({grad, grad});
      } else {
        auto& master_grad = params[i]->mutable_grad();
        if (!master_grad.defined()) master_grad = at::empty_like(*params[i]);
        pairs.push_back({grads_from[i].grad(), master_grad});
      }
    }
    return pairs;
  }

  // collect_grads' de-duplication, a function of the tensors listed and the groups' sizes alone,
  // rebuilt only when they change: each tensor's first listing, and each repeat with its first.
  struct GradIndex {
    std::vector<const void*> listed;   // every tensor listed, group after group
    std::vector<std::size_t> sizes;    // the groups' sizes
    std::vector<std::size_t> first;
    std::vector<std::pair<std::size_t, std::size_t>> repeats;
  };

  const GradIndex& grad_index(const torch::optim::Optimizer& optimizer,
                              const std::vector<const at::Tensor*>& params) const {
    const auto& groups = optimizer.param_groups();
    bool same = index_.listed.size() == params.size() &&
                index_.sizes.size() == groups.size();
    for (std::size_t g = 0; same && g < groups.size(); ++g) {
      same = index_.sizes[g] == groups[g].params().size();
    }
    for (std::size_t i = 0; same && i < params.size(); ++i) {
      same = index_.listed[i] == params[i]->unsafeGetTensorImpl();
    }
    if (same) return index_;
    GradIndex index;
    std::vector<std::size_t> group_of;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      index.sizes.push_back(groups[g].params().size());
      group_of.insert(group_of.end(), groups[g].params().size(), g);
    }
    std::unordered_map<const void*, std::size_t> first;  // a tensor's first index in params
    for (std::size_t i = 0; i < params.size(); ++i) {
      index.listed.push_back(params[i]->unsafeGetTensorImpl());
      const auto [seen, inserted] = first.try_emplace(index.listed.back(), i);
      if (inserted) {
        index.first.push_back(i);
        continue;
      }
      const auto j = seen->second;
      MIXPREC_CHECK(group_of[i] == group_of[j], "a tensor of shape ", params[i]->sizes(),
                    " is in param groups ", group_of[j], " and ", group_of[i], " of the "
                    "optimizer (PyTorch refuses this too): put each tensor in one group");
      index.repeats.emplace_back(i, j);
    }
    index_ = std::move(index);
    return index_;
  }

  // The gradient passes: (norm and finiteness) when clipping, then one scale pass. Sets `known`
  // where found_inf is known on the host without reading it back.
  std::optional<double> run_passes(std::vector<GradPair>& pairs, const UnscalePlan& options,
                                   at::Tensor& found_inf, std::optional<bool>& known) {
    if (!options.max_grad_norm()) {
      const bool in_place_identity = !scaling_ &&
          std::all_of(pairs.begin(), pairs.end(), [](const GradPair& p) { return p.from.is_same(p.to); });
      if (in_place_identity) {  // NoScaler without clipping: a read-only check suffices
        known = detail::any_non_finite(pairs, options.also_check());
        if (*known) found_inf.fill_(1.0);
        return std::nullopt;
      }
      detail::unscale_pairs_(pairs, static_cast<float>(inv_scale()), found_inf);
      check_also(options, found_inf);
      return std::nullopt;
    }
    // Fused clipping: the norm of the scaled gradients and their finiteness in one read pass,
    // then one write pass with (1/scale) * clip coefficient, as PyTorch's clip_grad_norm_ does.
    const auto stats = summed_stats(pairs, options);
    const double inv = inv_scale();
    const double norm = std::sqrt(stats.sum_of_squares) * inv;
    if (stats.non_finite) {
      found_inf.fill_(1.0);  // the step will be skipped: the gradients are left as they are
      known = true;
      return std::numeric_limits<double>::infinity();
    }
    const auto factor = static_cast<float>(inv * clip_coefficient(norm, options));
    detail::unscale_pairs_(pairs, factor, found_inf);
    // Finite values times a factor <= 1 stay finite: the read pass has decided found_inf.
    if (factor <= 1.0F) known = false;
    return norm;
  }

  // The norm's parts of `pairs`, summed over the ranks where the plan says so.
  static GradStats summed_stats(const std::vector<GradPair>& pairs, const UnscalePlan& options) {
    auto stats = pairs.empty() ? GradStats{} : detail::grad_stats(pairs, options.also_check());
    if (pairs.empty() && options.also_check().defined()) {
      stats.non_finite = !at::isfinite(options.also_check()).all().item<bool>();
    }
    if (options.sum_over_ranks()) {
      options.sum_over_ranks()(stats.sum_of_squares, stats.non_finite);
      stats.non_finite |= !(stats.sum_of_squares <= std::numeric_limits<double>::max());
    }
    return stats;
  }

  // inv_scale = float(1 / double(scale)), as PyTorch computes it.
  double inv_scale() const {
    return scaling_ ? static_cast<double>(static_cast<float>(1.0 / static_cast<double>(host_scale_)))
                    : 1.0;
  }

  static double clip_coefficient(double norm, const UnscalePlan& options) {
    return std::min(1.0, *options.max_grad_norm() / (norm + 1e-6));
  }

  // A 0-dim fp32 zero on the scale's device (the gradients' without scaling): the previous
  // iteration's flag, zeroed, once nothing else holds it (no allocation per step).
  at::Tensor new_found_inf(const std::vector<GradPair>& pairs, const UnscalePlan& options) {
    const auto device = scaling_         ? scale_.device()
                        : !pairs.empty() ? pairs.front().to.device()
                                         : *options.collective_on();
    if (spare_found_.defined() && spare_found_.device() == device &&
        spare_found_.use_count() == 1) {
      if (!device.is_cpu()) return spare_found_.zero_();
      *spare_found_.data_ptr<float>() = 0.0F;  // a store, not an op through the dispatcher
      return spare_found_;
    }
    spare_found_ = at::zeros({}, at::TensorOptions(at::kFloat).device(device));
    return spare_found_;
  }

  // The entry's inf flag on the host, read back (a synchronisation on a device) only if unknown.
  static bool found_of(Entry& entry) {
    if (!entry.found_host) entry.found_host = entry.found_inf.item<float>() != 0.0F;
    return *entry.found_host;
  }

  // This iteration's records, one per optimizer (a vector: one or two optimizers, and clearing
  // it keeps its capacity, so a step allocates nothing here).
  Entry& entry_of(const torch::optim::Optimizer& optimizer) {
    for (auto& [key, entry] : entries_) {
      if (key == &optimizer) return entry;
    }
    return entries_.emplace_back(&optimizer, Entry{}).second;
  }

  std::vector<std::pair<const torch::optim::Optimizer*, Entry>> entries_;
  mutable GradIndex index_;  // collect_grads' cache
  std::vector<const at::Tensor*> params_;  // collect_grads' lists, reused
  std::vector<std::size_t> with_grad_;
  at::Tensor spare_found_;   // new_found_inf's flag, reused once no record holds it
};

/// The gradient passes of a Trainer's step: scale the loss, then unscale, check, clip, agree
/// across ranks and step or skip, with the scale of the policy's LossScaler, which chooses the
/// scale and nothing else. Move only, as the scalers.
class StepEngine final : public ScalerCore {
 public:
  /// allow_fp16: unscale fp16 gradients in place (a policy that casts the model without masters).
  explicit StepEngine(bool allow_fp16) : ScalerCore(1.0F, false, allow_fp16) {}

  /// Uses `scale` (the scaler's get_scale()) from now on; scale 1 multiplies and divides
  /// nothing. An Error, before anything changes, unless it is a positive normal fp32 value.
  void use_scale(double value) {
    const auto scale = checked_scale(value, "the scaler's get_scale()");
    if (scale == host_scale_ && scaling_ == (scale != 1.0F)) return;
    scaling_ = scale != 1.0F;
    set_scale(scale);
  }

  using ScalerCore::scale;
  using ScalerCore::step;
  using ScalerCore::step_fused;
  using ScalerCore::unscale_planned;
  using ScalerCore::reset_stages;
};

/// A number of a state dict: Python saves whole-valued floats as ints in hand-written dicts.
inline double state_number(const c10::impl::GenericDict& dict, const char* key) {
  MIXPREC_CHECK(dict.contains(key), "state dict lacks the key '", key, "'");
  const auto value = dict.at(key);
  MIXPREC_CHECK(value.isDouble() || value.isInt(), "state dict key '", key,
                "' must be a number, got ", value.tagKind());
  return value.isDouble() ? value.toDouble() : static_cast<double>(value.toInt());
}

inline std::int64_t state_integer(const c10::impl::GenericDict& dict, const char* key) {
  MIXPREC_CHECK(dict.contains(key), "state dict lacks the key '", key, "'");
  const auto value = dict.at(key);
  MIXPREC_CHECK(value.isInt(), "state dict key '", key, "' must be an integer, got ",
                value.tagKind());
  return value.toInt();
}

}  // namespace detail

/// Dynamic loss scaling, PyTorch's GradScaler in C++: same algorithm, errors and state_dict keys.
class GradScaler : public detail::ScalerCore {
 public:
  explicit GradScaler(GradScalerOptions options = {})
      : ScalerCore(static_cast<float>(options.init_scale()), options.enabled(),
                   options.allow_fp16_grads()),
        options_(std::move(options)),
        growth_tracker_(0),
        hysteresis_tracker_(options_.hysteresis()) {
    detail::check_options(options_);
  }

  /// Advances the scale from this iteration's inf checks (summed over optimizers).
  /// On the host, from the inf flag that step() read: PyTorch's _amp_update_scale_ (bit for
  /// bit, tests/scaling/test_amp_kernels.cpp) without a device round trip of its own.
  void update() {
    const bool found_inf = take_found_inf("update()");
    if (!options_.enabled()) return;
    advance(found_inf);
  }

  /// The LossScaler step, as a Trainer calls it: advances the scale as update() does, from
  /// `found_inf` (this iteration's gradients held inf or NaN) instead of this scaler's records.
  void update_scale(bool found_inf) {
    reset_stages();
    if (!options_.enabled()) return;
    advance(found_inf);
  }

  /// Sets the scale (a normal fp32 value within [min_scale, max_scale]); leaves the growth
  /// tracker alone, as PyTorch does.
  void update(double new_scale) {
    const auto scale = detail::checked_scale(new_scale, "update(new_scale)");
    detail::check_in_bounds(scale, options_, "update(new_scale)");
    reset_stages();
    if (options_.enabled()) set_scale(scale);
  }

  bool is_enabled() const noexcept { return options_.enabled(); }
  /// The options as constructed; load_state_dict replaces the growth settings, not init_scale.
  const GradScalerOptions& options() const noexcept { return options_; }

  /// Steps since the last growth or overflow (PyTorch's _growth_tracker).
  std::int64_t growth_tracker() const noexcept { return growth_tracker_; }

  /// Overflows still tolerated before the next backoff; 0 or less backs off at the next one.
  std::int64_t hysteresis_tracker() const noexcept { return hysteresis_tracker_; }

  /// PyTorch's keys (scale, growth_factor, backoff_factor, growth_interval, _growth_tracker)
  /// plus hysteresis and _hysteresis_tracker; empty when disabled.
  c10::impl::GenericDict state_dict() const {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    if (!options_.enabled()) return dict;
    dict.insert("scale", get_scale());
    dict.insert("growth_factor", options_.growth_factor());
    dict.insert("backoff_factor", options_.backoff_factor());
    dict.insert("growth_interval", options_.growth_interval());
    dict.insert("_growth_tracker", growth_tracker());
    dict.insert("hysteresis", options_.hysteresis());
    dict.insert("_hysteresis_tracker", hysteresis_tracker_);
    return dict;
  }

  /// Loads a state_dict from C++ or from Python's GradScaler; validates before changing anything.
  /// Every state the scaler can reach loads, a scale that underflowed to 0 included (PyTorch's
  /// does too); min_scale and max_scale stay this scaler's own and bound the saved scale.
  void load_state_dict(const c10::impl::GenericDict& dict) {
    if (!options_.enabled()) return;
    MIXPREC_CHECK(!dict.empty(), "load_state_dict() got an empty state dict, possibly saved "
                  "from a disabled scaler");
    auto options = options_;
    options.growth_factor(detail::state_number(dict, "growth_factor"))
        .backoff_factor(detail::state_number(dict, "backoff_factor"))
        .growth_interval(detail::state_integer(dict, "growth_interval"));
    if (dict.contains("hysteresis")) options.hysteresis(detail::state_integer(dict, "hysteresis"));
    detail::check_dynamics(options);
    // A saved scale is a state, not a choice: backoff reaches subnormal values and 0.
    const double saved = detail::state_number(dict, "scale");
    const auto scale = static_cast<float>(saved);
    MIXPREC_CHECK(saved >= 0 && std::isfinite(scale) && (scale > 0) == (saved > 0),
                  "state dict has scale ", saved, ", which is ", scale, " in fp32; a GradScaler's "
                  "scale is a finite fp32 value >= 0");
    detail::check_in_bounds(scale, options, "the state dict's scale");
    const auto tracker = detail::state_integer(dict, "_growth_tracker");
    MIXPREC_CHECK(tracker >= 0 && tracker < options.growth_interval(), "state dict has "
                  "_growth_tracker ", tracker, " outside [0, growth_interval)");
    const auto hysteresis_tracker = dict.contains("_hysteresis_tracker")
                                        ? detail::state_integer(dict, "_hysteresis_tracker")
                                        : options.hysteresis();
    MIXPREC_CHECK(hysteresis_tracker <= options.hysteresis(), "state dict has "
                  "_hysteresis_tracker ", hysteresis_tracker, " above hysteresis ",
                  options.hysteresis());
    options_ = options;
    set_scale(scale);
    growth_tracker_ = tracker;
    hysteresis_tracker_ = hysteresis_tracker;
  }

 private:
  void advance(bool found_inf) {
    detail::ScaleState state{host_scale_, static_cast<std::int32_t>(growth_tracker_),
                             hysteresis_tracker_};
    state = detail::next_scale(state, found_inf, options_);
    set_scale(state.scale);
    growth_tracker_ = state.growth_tracker;
    hysteresis_tracker_ = state.hysteresis_tracker;
  }

  GradScalerOptions options_;
  std::int64_t growth_tracker_;
  std::int64_t hysteresis_tracker_;
};

/// A fixed loss scale: the scale never changes by itself; update(new_scale) sets it.
class StaticScaler : public detail::ScalerCore {
 public:
  explicit StaticScaler(double scale = 1.0, bool allow_fp16_grads = false)
      : ScalerCore(detail::checked_scale(scale, "StaticScaler's scale"), true, allow_fp16_grads) {}
  /// From GradScalerOptions, as the Trainer builds scalers: init_scale is the fixed scale, and
  /// the dynamic settings, which it would ignore, must keep their defaults.
  explicit StaticScaler(const GradScalerOptions& options)
      : StaticScaler(static_only(options).init_scale(), options.allow_fp16_grads()) {}

  /// Ends the iteration; the scale stays.
  void update() { (void)take_found_inf("update()"); }
  /// The LossScaler step: the scale stays.
  void update_scale(bool /*found_inf*/) { reset_stages(); }

  /// Sets the scale (a normal fp32 value).
  void update(double new_scale) {
    const auto scale = detail::checked_scale(new_scale, "update(new_scale)");
    reset_stages();
    set_scale(scale);
  }

  bool is_enabled() const noexcept { return true; }

  /// {"scale": the scale}.
  c10::impl::GenericDict state_dict() const {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    dict.insert("scale", get_scale());
    return dict;
  }

  /// Loads the scale of a StaticScaler's (or a GradScaler's) state dict.
  void load_state_dict(const c10::impl::GenericDict& dict) {
    set_scale(detail::checked_scale(detail::state_number(dict, "scale"), "state dict's scale"));
  }

 private:
  static const GradScalerOptions& static_only(const GradScalerOptions& o) {
    const GradScalerOptions d;
    MIXPREC_CHECK(o.enabled() && o.growth_factor() == d.growth_factor() &&
                      o.backoff_factor() == d.backoff_factor() &&
                      o.growth_interval() == d.growth_interval() &&
                      o.hysteresis() == d.hysteresis() && o.min_scale() == d.min_scale() &&
                      o.max_scale() == d.max_scale(),
                  "StaticScaler keeps its scale fixed: of GradScalerOptions it uses init_scale and "
                  "allow_fp16_grads only, and would ignore enabled(false), growth_factor, "
                  "backoff_factor, growth_interval, hysteresis, min_scale and max_scale; leave "
                  "them at their defaults, or use GradScaler (dynamic) or NoScaler (no scaling)");
    return o;
  }
};

/// No scaling: scale() returns the loss itself; step() still skips inf/NaN gradients.
class NoScaler : public detail::ScalerCore {
 public:
  NoScaler() : ScalerCore(1.0, false, true) {}
  /// Accepts the options the Trainer passes to every scaler; only their defaults make sense.
  explicit NoScaler(const GradScalerOptions&) : NoScaler() {}

  void update() { (void)take_found_inf("update()"); }
  /// The LossScaler step: the scale stays 1.
  void update_scale(bool /*found_inf*/) { reset_stages(); }
  void update(double new_scale) {
    MIXPREC_CHECK(false, "NoScaler has no scale to set (got update(", new_scale,
                  ")); use StaticScaler or GradScaler");
  }
  bool is_enabled() const noexcept { return false; }
  c10::impl::GenericDict state_dict() const {
    return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
  }
  /// Ignores the dict, as a disabled PyTorch GradScaler does.
  void load_state_dict(const c10::impl::GenericDict&) {}
};

static_assert(LossScaler<GradScaler> && LossScaler<StaticScaler> && LossScaler<NoScaler>);

}  // namespace mixprec
