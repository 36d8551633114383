#pragma once
// The gradient passes of an optimizer step, which the scalers' unscale_ and step (ScalerCore)
// and the Trainer's step (StepEngine) run alike: each optimizer's gradients collected once (a
// tensor listed twice, as tied weights are, is one gradient) and all validated before any is
// touched; the unscale, check and clip passes over them; the check of extra values such as the
// loss; the hook through which data parallel ranks agree on the inf flag. It keeps no stage and
// no scale: its caller passes the scale in and keeps the records of the iteration.

#include <mixprec/core/error.hpp>
#include <mixprec/scaling/unscale.hpp>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec::detail {

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

/// The gradient passes and what they keep between steps: the de-duplication of the optimizer's
/// tensors and the lists built from it (no allocation per step), and the inf flag reused.
class GradPasses {
 public:
  /// Validates every gradient before touching any, so an Error leaves all state unchanged. Each
  /// tensor once: an optimizer built on model->parameters() lists tied weights once per name,
  /// and a tensor unscaled twice would be divided by the scale twice and counted twice in the norm.
  /// refuse_fp16: in-place fp16 gradients are an Error (scaled, without allow_fp16_grads).
  std::vector<GradPair> collect_grads(torch::optim::Optimizer& optimizer,
                                      const std::vector<at::Tensor>& grads_from, bool refuse_fp16) {
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
        MIXPREC_CHECK(!refuse_fp16 || dtype != at::kHalf,
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

  /// The gradient passes: (norm and finiteness) when clipping, then one scale pass by inv_scale
  /// (1 where nothing was scaled). Sets `known` where found_inf is known on the host without
  /// reading it back.
  std::optional<double> run_passes(std::vector<GradPair>& pairs, const UnscalePlan& options,
                                   at::Tensor& found_inf, std::optional<bool>& known,
                                   bool scaled, double inv_scale) {
    if (!options.max_grad_norm()) {
      const bool in_place_identity = !scaled &&
          std::all_of(pairs.begin(), pairs.end(), [](const GradPair& p) { return p.from.is_same(p.to); });
      if (in_place_identity) {  // NoScaler without clipping: a read-only check suffices
        known = detail::any_non_finite(pairs, options.also_check());
        if (*known) found_inf.fill_(1.0);
        return std::nullopt;
      }
      detail::unscale_pairs_(pairs, static_cast<float>(inv_scale), found_inf);
      check_also(options, found_inf);
      return std::nullopt;
    }
    // Fused clipping: the norm of the scaled gradients and their finiteness in one read pass,
    // then one write pass with (1/scale) * clip coefficient, as PyTorch's clip_grad_norm_ does.
    const auto stats = summed_stats(pairs, options);
    const double norm = std::sqrt(stats.sum_of_squares) * inv_scale;
    if (stats.non_finite) {
      found_inf.fill_(1.0);  // the step will be skipped: the gradients are left as they are
      known = true;
      return std::numeric_limits<double>::infinity();
    }
    const auto factor = static_cast<float>(inv_scale * clip_coefficient(norm, options));
    detail::unscale_pairs_(pairs, factor, found_inf);
    // Finite values times a factor <= 1 stay finite: the read pass has decided found_inf.
    if (factor <= 1.0F) known = false;
    return norm;
  }

  /// The norm's parts of `pairs`, summed over the ranks where the plan says so.
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

  static double clip_coefficient(double norm, const UnscalePlan& options) {
    return std::min(1.0, *options.max_grad_norm() / (norm + 1e-6));
  }

  /// Ors the inf/NaN of UnscalePlan::also_check (e.g. the loss) into found_inf, on the device.
  static void check_also(const UnscalePlan& options, at::Tensor& found_inf) {
    if (!options.also_check().defined()) return;
    found_inf.add_(at::isfinite(options.also_check()).logical_not().any().to(found_inf.options()))
        .clamp_max_(1.0);
  }

  /// The flag as every rank sees it, with what the host knew already (found_host) folded in.
  static void agree(const UnscalePlan& options, at::Tensor& found_inf,
                    std::optional<bool>& found_host) {
    if (!options.agree()) return;
    if (found_host.value_or(false)) found_inf.fill_(1.0);
    options.agree()(found_inf);
    found_host.reset();
  }

  /// A 0-dim fp32 zero on `device`: the previous iteration's flag, zeroed, once nothing else
  /// holds it (no allocation per step).
  at::Tensor new_found_inf(const at::Device& device) {
    if (spare_found_.defined() && spare_found_.device() == device &&
        spare_found_.use_count() == 1) {
      if (!device.is_cpu()) return spare_found_.zero_();
      *spare_found_.data_ptr<float>() = 0.0F;  // a store, not an op through the dispatcher
      return spare_found_;
    }
    spare_found_ = at::zeros({}, at::TensorOptions(at::kFloat).device(device));
    return spare_found_;
  }

 private:
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

  mutable GradIndex index_;  // collect_grads' cache
  std::vector<const at::Tensor*> params_;  // collect_grads' lists, reused
  std::vector<std::size_t> with_grad_;
  at::Tensor spare_found_;   // new_found_inf's flag, reused once no record holds it
};

}  // namespace mixprec::detail
