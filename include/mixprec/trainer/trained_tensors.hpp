#pragma once
// Which tensors a Trainer<P> trains: the model it claims, its parameters (each tensor once), the
// optimizer's groups and the masters made for them (MixedO2), param groups added later, and the
// gradients data parallel averages. One refresh for all of them, when the groups change.

#include <mixprec/core/autocast.hpp>
#include <mixprec/diagnostics/overflow.hpp>
#include <mixprec/diagnostics/gradient_stats.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/held_shards.hpp>
#include <mixprec/optim/master_weights.hpp>
#include <mixprec/precision/model_cast.hpp>
#include <mixprec/trainer/model_checks.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/trainer/gradient_hold.hpp>
#include <mixprec/trainer/setup.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mixprec::detail {

template <class P>
class TrainedTensors {
 public:
  /// Checks that `model` is a model Trainer<P> takes (model_checks.hpp) that no live Trainer
  /// trains and that `optimizer` holds its tensors (each in one group), and claims it; changes
  /// nothing else.
  TrainedTensors(const torch::nn::Module& model, const torch::optim::Optimizer& optimizer) {
    const auto named = model.named_parameters();
    MIXPREC_CHECK(named.size() > 0, "the model has no parameters: nothing to train");
    // Claimed before the dtype check: a model that a live O2/O3 Trainer has cast is that
    // Trainer's, not a Low model of the user's.
    const auto params = unique_tensors(model.parameters());
    claim_ = ModelClaim::acquire(params, P::name);
    check_model_dtypes<P>(model);
    check_fixed_untrained(model, optimizer_tensors(optimizer));
    if constexpr (P::master_weights) {
      MasterWeights::check_rebindable(params, optimizer);
      check_dense_gradients(model, optimizer_tensors(optimizer), P::name);
    } else {
      MasterWeights::check_params_of(params, optimizer);
    }
    device_types_ = autocast_device_types(params);
    params_ = params;
  }

  /// Casts the model as P says, makes the masters from its values (MixedO2) and lists each
  /// tensor once in the optimizer. Data parallel: after rank 0's values reached every rank.
  /// `shards`: a group that shards the optimizer state puts this rank's pieces (masters, under
  /// MixedO2) in the optimizer instead.
  void take(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
            StepGroup* shards = nullptr) {
    if (shards != nullptr) {
      shards_ = shards;
      take_sharded(model, optimizer, unique_tensors(optimizer_tensors(optimizer)), true);
      return;
    }
    check_not_held(model.named_parameters(), "Trainer");  // data parallel gathered its own
    if constexpr (P::cast_model) {
      std::vector<at::Tensor> fp32_values;
      if constexpr (P::master_weights) {
        for (const auto& p : params_) {
          fp32_values.push_back(p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
        }
      }
      cast_model(model, P::low_dtype, P::keep_batch_norm_fp32, P::name);
      if constexpr (P::master_weights) {
        masters_.emplace(params_, fp32_values, optimizer, storage_of<P>::masters);
      }
    }
    dedupe_param_groups(optimizer);  // the optimizer steps each tensor once
    // Adagrad's state, made by its constructor, fits the cast tensors (the masters' in bind).
    if constexpr (!P::master_weights) fit_construction_state(optimizer);
    record_binding(optimizer);
  }

  /// What changed in the optimizer since the Trainer bound it: nothing; only a param group's
  /// options (a new optimizer over the same tensors, under the policies without masters); or
  /// the tensors it steps (a param group added, a tensor replaced, a new optimizer assigned to
  /// the Trainer's optimizer variable). A comparison of identities, cheap enough for every step:
  /// an optimizer must never step tensors the Trainer did not bind (under MixedO2 a new
  /// optimizer over model->parameters() would step the bf16 model and not its masters).
  enum class Change { none, options, tensors };
  Change binding_change(const torch::optim::Optimizer& optimizer) const {
    const auto& groups = optimizer.param_groups();
    if (groups.size() != bound_options_.size()) return Change::tensors;
    auto change = Change::none;
    std::size_t k = 0;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      for (const auto& p : groups[g].params()) {
        if (k == bound_.size() || id_of(p) != bound_[k++]) return Change::tensors;
      }
      if (k != bound_ends_[g]) return Change::tensors;
      if (&groups[g].options() != bound_options_[g]) change = Change::options;
    }
    return change;
  }

  /// A new optimizer over the same tensors (its options are new): checked as the constructor
  /// checks one, then bound.
  void adopt_options(const torch::optim::Optimizer& optimizer) {
    check_optimizer_constants<P>(optimizer);
    record_binding(optimizer);
  }

  /// The optimizer's tensors changed since the last refresh: a param group added after
  /// construction (progressive unfreezing), or a new optimizer over model->parameters()
  /// assigned to the Trainer's optimizer (a new learning rate, a reset of its state). Checked
  /// as the constructor checks the optimizer; under MixedO2 a model tensor that has a master
  /// is replaced by its master (the fp32 value the run has been training, not its bf16
  /// rounding), new fp32 tensors are cast per P and get masters from their current values.
  /// Nothing changes unless all of it can be done.
  void adopt(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
    check_optimizer_constants<P>(optimizer);  // a late group's eps, too
    check_fixed_untrained(model, optimizer_tensors(optimizer));
    const auto params = unique_tensors(model.parameters());
    if (shards_ != nullptr) {
      check_pieces_kept(optimizer);
      // The model tensors among the optimizer's (the others are pieces, or an Error of shard()).
      const auto ids = identities(params);
      std::vector<at::Tensor> fresh;
      for (const auto& p : unique_tensors(optimizer_tensors(optimizer))) {
        if (ids.count(p.unsafeGetTensorImpl()) == 1) fresh.push_back(p);
      }
      check_added_dtypes<P>(fresh);
      MIXPREC_CHECK(fresh.empty() || !shards_->shards_parameters(), "a param group was added to "
                    "the optimizer after the Trainer was built, with DistributedOptions::"
                    "shard_parameters, whose units are laid out once: put every parameter in "
                    "the optimizer before building the Trainer (freeze with requires_grad(false) "
                    "what is to be unfrozen later); nothing was changed");
      auto claim = ModelClaim::acquire(params, P::name, claim_.get());
      auto device_types = autocast_device_types(params);
      claim_ = std::move(claim);
      device_types_ = std::move(device_types);
      take_sharded(model, optimizer, fresh, false);
      params_ = params;
      return;
    }
    if (masters_) {
      masters_->check_bindable(params, optimizer);
    } else {
      MasterWeights::check_params_of(params, optimizer);
    }
    const auto fresh = masters_ ? masters_->unbound(optimizer)
                                : unique_tensors(optimizer_tensors(optimizer));
    std::vector<at::Tensor> fresh_fp32;  // the tensors to cast: not those the model has cast
    for (const auto& p : fresh) {
      if (!masters_ || p.scalar_type() == at::kFloat) fresh_fp32.push_back(p);
    }
    check_added_dtypes<P>(fresh_fp32);
    if (masters_) check_dense_gradients(model, fresh, P::name);
    auto claim = ModelClaim::acquire(params, P::name, claim_.get());
    auto device_types = autocast_device_types(params);
    // All checks passed.
    claim_ = std::move(claim);
    device_types_ = std::move(device_types);
    std::vector<at::Tensor> fp32_values;
    if (masters_) {
      for (const auto& p : fresh) fp32_values.push_back(p.detach().to(at::kFloat).clone());
    }
    if constexpr (P::cast_model) {
      cast_model(model, P::low_dtype, P::keep_batch_norm_fp32, P::name, &fresh);
    }
    if (masters_) masters_->bind(fresh, fp32_values, optimizer);
    dedupe_param_groups(optimizer);
    if (!masters_) fit_construction_state(optimizer);  // Adagrad: the new group's state
    params_ = params;
    record_binding(optimizer);
  }

  /// Whether the optimizer holds this rank's pieces (sharded data parallel).
  bool sharded() const noexcept { return shards_ != nullptr; }

  /// The model's parameters, each tensor once.
  const std::vector<at::Tensor>& params() const noexcept { return params_; }
  /// The fp32 masters (MixedO2); null for the other policies.
  MasterWeights* masters() noexcept { return masters_ ? &*masters_ : nullptr; }
  const MasterWeights* masters() const noexcept { return masters_ ? &*masters_ : nullptr; }
  /// The lean storage of the masters (RemainderMasters, StochasticRounding); else null.
  /// Sharded: the group's lean pieces'.
  LeanMasters* lean() noexcept {
    if (shards_ != nullptr) return shards_->lean_rounding();
    return masters_ ? masters_->lean() : nullptr;
  }
  const LeanMasters* lean() const noexcept {
    if (shards_ != nullptr) return shards_->lean_rounding();
    return masters_ ? masters_->lean() : nullptr;
  }
  /// The parameters' device types: autocast engages on each.
  const std::vector<c10::DeviceType>& device_types() const noexcept { return device_types_; }
  /// Every parameter is on the CPU.
  bool cpu_only() const noexcept {
    for (const auto d : device_types_) {
      if (d != c10::DeviceType::CPU) return false;
    }
    return true;
  }

  /// PyTorch's zero_grad(set_to_none=True), its default: a tensor the next step does not reach
  /// keeps no gradient, and the optimizer skips it (Adam's moments and weight decay do not move
  /// it). The model's tensors, the optimizer's (masters, sharded pieces) and every master. Done
  /// after each optimizer step too: a stray optimizer.step() of the user's (the habit of
  /// Python's `scaler.step(opt)`) then finds no gradient to apply a second time.
  void clear_grads(const torch::optim::Optimizer& optimizer) {
    held_.clear(params_, optimizer, masters());
  }
  /// The model tensors' gradients only.
  void clear_model_grads() const { detail::clear_grads(params_); }
  /// After an optimizer step, the gradients of the model tensors that the optimizer stepped
  /// through another tensor (an fp32 master, sharded pieces), which hold the step's gradient:
  /// what a model tensor has there is a stand-in (scaled Low values, or this rank's own).
  void clear_stand_in_grads() const {
    if (shards_ != nullptr) return detail::clear_grads(params_);
    if (!masters_) return;
    for (const auto& p : params_) {
      const auto master = masters_->master_of(p);
      if (master.defined() && !master.is_same(p)) p.mutable_grad().reset();
    }
  }
  /// Between micro-batches: the partial sums out of reach of an optimizer (GradientHold).
  void hold_grads(const torch::optim::Optimizer& optimizer) {
    held_.hold(params_, optimizer, masters());
  }
  void release_grads() { held_.release(); }

  /// The name of a model parameter that has a gradient, or empty: after loss_fn, with every
  /// gradient cleared or held before it, one means that loss_fn ran a backward pass itself.
  std::string first_with_grad(const torch::nn::Module& model) const {
    for (const auto& p : params_) {
      if (!p.grad().defined()) continue;
      for (const auto& item : model.named_parameters()) {
        if (item.value().is_same(p)) return item.key();
      }
      return "?";
    }
    return {};
  }

  /// Whether a parameter has been frozen or unfrozen since bind().
  bool trainable_changed() const {
    std::size_t k = 0;
    for (const auto& p : params_) {
      if (!p.requires_grad()) continue;
      if (k == trainable_.size() || trainable_[k] != id_of(p)) return true;
      ++k;
    }
    return k != trainable_.size();
  }

  /// Every trainable model tensor's gradient is averaged into its master's (MixedO2) or its
  /// own. First the ranks compare their models tensor by tensor: ranks that froze different
  /// tensors of the same shapes would otherwise average one tensor's gradient with another's.
  void bind(StepGroup& group, const torch::nn::Module& model) {
    group.check_same_model(model);
    std::vector<at::Tensor> params, holders;
    std::vector<TensorId> trainable;
    for (const auto& p : params_) {
      if (!p.requires_grad()) continue;
      const auto master = masters_ ? masters_->master_of(p) : at::Tensor();
      params.push_back(p);
      holders.push_back(master.defined() ? master : p);
      trainable.push_back(id_of(p));
    }
    group.bind(params, holders);
    trainable_ = std::move(trainable);
  }

 private:
  // What binding_change() compares against: every tensor the optimizer holds, by identity, the
  // end of each group among them, and each group's options object.
  void record_binding(const torch::optim::Optimizer& optimizer) {
    bound_.clear();
    bound_ends_.clear();
    bound_options_.clear();
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) bound_.push_back(id_of(p));
      bound_ends_.push_back(bound_.size());
      bound_options_.push_back(&group.options());
    }
  }

  // Sharded: the optimizer still holds every piece this rank steps, in its group (a new
  // optimizer would hold model tensors instead, which would have to be laid out again).
  void check_pieces_kept(const torch::optim::Optimizer& optimizer) const {
    const auto& groups = optimizer.param_groups();
    bool kept = groups.size() >= bound_ends_.size();
    std::size_t k = 0;
    for (std::size_t g = 0; kept && g < bound_ends_.size(); ++g) {
      const auto& params = groups[g].params();
      const auto count = bound_ends_[g] - k;
      kept = params.size() >= count;
      for (std::size_t i = 0; kept && i < count; ++i) kept = id_of(params[i]) == bound_[k + i];
      k = bound_ends_[g];
    }
    MIXPREC_CHECK(kept, "the optimizer no longer holds the tensors the Trainer bound (a new "
                  "optimizer was assigned to it, or a param group's tensors were replaced): "
                  "with DistributedOptions::shard_optimizer_state each rank's optimizer holds "
                  "its slices, which a new optimizer cannot take over; change the options of "
                  "its param groups instead (e.g. the learning rate), or save, build a new "
                  "Trainer with a new optimizer and load");
  }

  // Sharded: casts the model (`whole`) or `fresh` (the optimizer's model tensors not yet
  // sharded) as P says, and hands `fresh` to the group with their fp32 values, from which the
  // pieces that are masters are made (a detached tensor keeps the fp32 storage that the cast's
  // set_data replaces: no copy of the model).
  void take_sharded(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                    const std::vector<at::Tensor>& fresh, bool whole) {
    std::vector<std::pair<at::Tensor, at::Tensor>> pairs;
    for (const auto& p : fresh) {
      pairs.emplace_back(p, P::master_weights ? p.detach() : at::Tensor());
    }
    if constexpr (P::cast_model) {
      cast_model(model, P::low_dtype, P::keep_batch_norm_fp32, P::name,
                 whole ? nullptr : &fresh);
    }
    dedupe_param_groups(optimizer);
    shards_->shard(optimizer, pairs, P::master_weights, piece_storage_of<P>);
    record_binding(optimizer);
  }

  StepGroup* shards_ = nullptr;              // sharded data parallel: the group
  std::shared_ptr<ModelClaim> claim_;        // no other Trainer may train the model meanwhile
  std::vector<at::Tensor> params_;           // model.parameters(), each tensor once
  std::vector<TensorId> bound_;              // the optimizer's tensors, as bound
  std::vector<std::size_t> bound_ends_;      // each group's end in bound_
  std::vector<const void*> bound_options_;   // each group's options object
  GradientHold held_;                        // the partial sums between micro-batches
  std::optional<MasterWeights> masters_;     // MixedO2
  std::vector<c10::DeviceType> device_types_;
  std::vector<TensorId> trainable_;          // the tensors data parallel averages (bind)
};

}  // namespace mixprec::detail
