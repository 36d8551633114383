#pragma once
/// MasterWeights: fp32 copies of a model's low-precision parameters, which the optimizer updates
/// instead of the model (Apex O2). Small updates that would vanish when added to a bf16/fp16
/// weight accumulate in the fp32 master, and the model gets the rounded result after each step.
/// Under a lean storage (RemainderMasters, StochasticRounding) the masters hold data only
/// between inflate() and stow(): LeanMasters keeps what stays of them between steps.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/optim/lean_masters.hpp>
#include <mixprec/optim/optimizer_state.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/optimizer.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace mixprec {

namespace detail {

// Whether the optimizer has stepped state for `p` (LibTorch's Adagrad makes state at
// construction, which is not a step).
inline bool has_stepped_state_for(const torch::optim::Optimizer& optimizer, const at::Tensor& p) {
  const auto& states = optimizer.state();
  return has_stepped(optimizer) &&
         states.count(state_key<std::decay_t<decltype(states)>>(p)) == 1;
}

// The checks of MasterWeights' binding: every tensor the optimizer holds is a master
// (`is_master`) or one of `model_params`; a model tensor with a master (`master_of_model`) is
// not held beside it, nor stepped outside the Trainer; none is in two param groups.
template <class MasterOf, class IsMaster>
void check_master_groups(const std::vector<at::Tensor>& model_params,
                         const torch::optim::Optimizer& optimizer, IsMaster&& is_master,
                         MasterOf&& master_of_model) {
  const auto model = identities(model_params);
  const auto held = identities(optimizer_tensors(optimizer));
  std::unordered_map<const void*, std::size_t> group_of;
  const auto& groups = optimizer.param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const auto& p : groups[g].params()) {
      const void* id = p.unsafeGetTensorImpl();
      if (!is_master(id)) {
        MIXPREC_CHECK(model.count(id) == 1, "the optimizer holds a tensor of shape ", p.sizes(),
                      " that is not a parameter of the model: build it on model->parameters()");
        const at::Tensor* master = master_of_model(id);
        if (master != nullptr) {
          MIXPREC_CHECK(held.count(master->unsafeGetTensorImpl()) == 0, "param group ", g,
                        " holds a model tensor of shape ", p.sizes(), " that the optimizer "
                        "already trains through its fp32 master: put each tensor in one group");
          MIXPREC_CHECK(!has_stepped_state_for(optimizer, p), "the optimizer holds the model's ",
                        p.scalar_type(), " tensor of shape ", p.sizes(), " and has state for "
                        "it (it was stepped outside the Trainer): the Trainer steps the fp32 "
                        "master weights. Build the new optimizer on model->parameters() and "
                        "let the Trainer take it before any optimizer.step() of yours");
        }
      }
      const auto [it, inserted] = group_of.try_emplace(id, g);
      MIXPREC_CHECK(inserted || it->second == g, "a tensor of shape ", p.sizes(), " is in "
                    "param groups ", it->second, " and ", g, " of the optimizer (PyTorch "
                    "refuses this too): put each tensor in one group");
    }
  }
}

}  // namespace detail

class MasterWeights {
 public:
  /// Masters for the (already cast) parameters the optimizer holds, from `fp32_values` (the
  /// values of `model_params` before the cast, so the masters are exact); rebinds `optimizer`
  /// from the model's tensors to them. Pairing is by tensor identity: any parameter-group order,
  /// a subset of the model (frozen layers left out) and tied weights (one master, listed once
  /// per group afterwards) all work. fp32 parameters (kept BatchNorm) are their own masters.
  /// `storage`: fp32 (copies kept), remainder or stochastic (LeanMasters).
  MasterWeights(const std::vector<at::Tensor>& model_params,
                const std::vector<at::Tensor>& fp32_values, torch::optim::Optimizer& optimizer,
                MasterStorage storage = MasterStorage::fp32) {
    check_rebindable(model_params, optimizer);
    if (storage != MasterStorage::fp32) lean_.emplace(storage);
    bind(model_params, fp32_values, optimizer);
  }

  /// Throws unless `optimizer` has no state and holds only tensors of `model_params`, each in
  /// one param group.
  static void check_rebindable(const std::vector<at::Tensor>& model_params,
                               const torch::optim::Optimizer& optimizer) {
    MIXPREC_CHECK(!detail::has_stepped(optimizer),
                  "the optimizer already has state (it has stepped): build the Trainer before "
                  "the first step, so its state is created for the fp32 master weights");
    check_params_of(model_params, optimizer);
  }

  /// Throws unless every tensor `optimizer` holds is one of `model_params`, and none is in two
  /// param groups (PyTorch refuses that too).
  static void check_params_of(const std::vector<at::Tensor>& model_params,
                              const torch::optim::Optimizer& optimizer) {
    detail::check_master_groups(
        model_params, optimizer, [](const void*) { return false; },
        [](const void*) -> const at::Tensor* { return nullptr; });
  }

  /// Throws unless every tensor `optimizer` holds is a master, or one of `model_params`: one
  /// that has none yet (a param group added since), or one whose master the optimizer does not
  /// hold (a new optimizer built on model->parameters(): bind() puts the master in its place,
  /// which needs the optimizer to have no state for it); and none is in two param groups.
  void check_bindable(const std::vector<at::Tensor>& model_params,
                      const torch::optim::Optimizer& optimizer) const {
    detail::check_master_groups(
        model_params, optimizer,
        [this](const void* id) { return pair_of_master_.count(id) == 1; },
        [this](const void* id) { return master_of_model(id); });
  }

  /// The model tensors the optimizer holds that have no master yet, each once.
  std::vector<at::Tensor> unbound(const torch::optim::Optimizer& optimizer) const {
    std::vector<at::Tensor> result;
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        const void* id = p.unsafeGetTensorImpl();
        if (pair_of_master_.count(id) == 0 && pair_of_model_.count(id) == 0) result.push_back(p);
      }
    }
    return detail::unique_tensors(result);
  }

  /// Makes masters for the optimizer's tensors that have none, from their entries in
  /// `model_params`/`fp32_values`, and rebinds the optimizer to them (a model tensor that has
  /// a master already gets that one); the construction, a param group added later and a new
  /// optimizer (after check_bindable) go through here.
  void bind(const std::vector<at::Tensor>& model_params,
            const std::vector<at::Tensor>& fp32_values, torch::optim::Optimizer& optimizer) {
    MIXPREC_CHECK(fp32_values.size() == model_params.size(), "MasterWeights needs one fp32 "
                  "value per parameter, got ", fp32_values.size(), " for ", model_params.size());
    std::unordered_map<const void*, std::size_t> model_index;
    for (std::size_t i = 0; i < model_params.size(); ++i) {
      model_index.emplace(model_params[i].unsafeGetTensorImpl(), i);
    }
    detail::dedupe_param_groups(optimizer);
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) {
        if (pair_of_master_.count(p.unsafeGetTensorImpl()) == 1) continue;
        if (const auto it = pair_of_model_.find(p.unsafeGetTensorImpl());
            it != pair_of_model_.end()) {
          p = pairs_[it->second].master;
          continue;
        }
        const auto i = model_index.at(p.unsafeGetTensorImpl());
        const auto& model = model_params[i];
        const auto master = model.scalar_type() == at::kFloat
                                ? model
                                : fp32_values[i].detach().to(at::kFloat).clone().requires_grad_(
                                      model.requires_grad());
        pair_of_master_.emplace(master.unsafeGetTensorImpl(), pairs_.size());
        pair_of_model_.emplace(model.unsafeGetTensorImpl(), pairs_.size());
        auto& pair = pairs_.emplace_back(Pair{model, master, -1});
        if (lean_ && !master.is_same(model)) {
          pair.lean = static_cast<std::int64_t>(lean_count_++);
          lean_->add(pair.model, pair.master);
        }
        p = master;
      }
    }
    sources_.clear();
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        sources_.push_back(pairs_[pair_of_master_.at(p.unsafeGetTensorImpl())].model);
      }
    }
    detail::fit_construction_state(optimizer, [this](const at::Tensor& t) { return model_of(t); });
  }

  /// The model tensor a master replaced; undefined for any other tensor (an fp32 parameter, its
  /// own master, included).
  at::Tensor model_of(const at::Tensor& master) const {
    const auto it = pair_of_master_.find(master.unsafeGetTensorImpl());
    if (it == pair_of_master_.end()) return at::Tensor();
    const auto& pair = pairs_[it->second];
    return pair.model.is_same(pair.master) ? at::Tensor() : pair.model;
  }

  /// The fp32 tensors the optimizer updates, one per model tensor, in the order they were
  /// bound (the optimizer's order; a late param group's at the end). Under a lean storage they
  /// hold data only between inflate() and stow(): master_values() reads them any time.
  std::vector<at::Tensor> masters() const {
    std::vector<at::Tensor> result;
    for (const auto& pair : pairs_) result.push_back(pair.master);
    return result;
  }

  /// The masters' fp32 values, as masters() lists them: the masters themselves, or under a
  /// lean storage between steps, values made from what it keeps.
  std::vector<at::Tensor> master_values() const {
    std::vector<at::Tensor> result;
    for (const auto& pair : pairs_) result.push_back(value_of(pair));
    return result;
  }

  /// The fp32 value of a model tensor's master (see master_values()); undefined if it has none.
  at::Tensor master_value(const at::Tensor& model) const {
    const auto it = pair_of_model_.find(model.unsafeGetTensorImpl());
    return it == pair_of_model_.end() ? at::Tensor() : value_of(pairs_[it->second]);
  }

  /// The lean storage's state, where there is one (LeanMasters: its rounding seed and count).
  detail::LeanMasters* lean() noexcept { return lean_ ? &*lean_ : nullptr; }
  const detail::LeanMasters* lean() const noexcept { return lean_ ? &*lean_ : nullptr; }

  /// Lean storage: every master holds its fp32 value (for a step, or a checkpoint's load).
  void inflate() {
    if (!lean_) return;
    for (auto& pair : pairs_) {
      if (pair.lean >= 0) lean_->inflate(static_cast<std::size_t>(pair.lean), pair.model, pair.master);
    }
  }

  /// Lean storage: the masters put away again, the model written from them (a step taken:
  /// `stepped`; RemainderMasters' remainders are split again whatever the reason).
  void stow(bool stepped) {
    if (!lean_) return;
    for (auto& pair : pairs_) {
      if (pair.lean >= 0) {
        lean_->stow_one(static_cast<std::size_t>(pair.lean), pair.model, pair.master, stepped);
      }
    }
    if (stepped) lean_->finish_round();
  }

  /// Lean storage: the masters' fp32 data dropped, nothing written (a step skipped or failed:
  /// what is kept still holds the values from before it).
  void release() noexcept {
    if (!lean_) return;
    for (auto& pair : pairs_) {
      if (pair.lean >= 0 && lean_->inflated(static_cast<std::size_t>(pair.lean))) {
        try {
          lean_->release_one(static_cast<std::size_t>(pair.lean), pair.master);
        } catch (...) {  // a one-element tensor could not be made: the data stays, still right
        }
      }
    }
  }

  /// A lean master's model tensor and what LeanMasters keeps of it, for a step that updates
  /// them in place (lean_adam.hpp); nullopt for an fp32 master (or parameter).
  using LeanTarget = detail::LeanTarget;
  std::optional<LeanTarget> lean_target(const at::Tensor& master) {
    const auto it = pair_of_master_.find(master.unsafeGetTensorImpl());
    if (it == pair_of_master_.end() || pairs_[it->second].lean < 0) return std::nullopt;
    const auto& pair = pairs_[it->second];
    return LeanTarget{pair.model, lean_->in_place(static_cast<std::size_t>(pair.lean))};
  }

  /// Lean storage: each master's gradient is its model tensor's (the same tensor, bf16), for a
  /// one-pass step that reads it there (no fp32 copy). Masters whose model has none keep theirs.
  void alias_grads() {
    for (auto& pair : pairs_) {
      if (pair.lean >= 0 && pair.model.grad().defined()) {
        pair.master.mutable_grad() = pair.model.grad();
      }
    }
  }

  /// Sets the master of `model` to `value` (fp32), and the model to its rounding.
  void assign(const at::Tensor& model, const at::Tensor& value) {
    const auto it = pair_of_model_.find(model.unsafeGetTensorImpl());
    TORCH_INTERNAL_ASSERT(it != pair_of_model_.end());
    auto& pair = pairs_[it->second];
    at::NoGradGuard no_grad;
    if (pair.lean < 0) {
      pair.master.detach().copy_(value);
      return;
    }
    const auto index = static_cast<std::size_t>(pair.lean);
    const bool was_inflated = lean_->inflated(index);
    lean_->inflate(index, pair.model, pair.master);
    pair.master.detach().copy_(value);
    pair.model.detach().copy_(value);  // to nearest, as a load rounds
    if (!was_inflated) lean_->stow_one(index, pair.model, pair.master, /*stepped=*/false);
  }

  /// The master of a model tensor (itself for an fp32 one); undefined if it has none.
  at::Tensor master_of(const at::Tensor& model) const {
    const auto it = pair_of_model_.find(model.unsafeGetTensorImpl());
    return it == pair_of_model_.end() ? at::Tensor() : pairs_[it->second].master;
  }

  /// For each parameter the optimizer holds, in its order, the model tensor whose gradient
  /// feeds it: the Trainer unscales from them (detail::UnscalePlan::grads_from).
  const std::vector<at::Tensor>& grad_sources() const noexcept { return sources_; }

  /// Adds the model's gradients into the masters' fp32 gradients and sets the model's to none,
  /// so that gradients accumulated over micro-batches sum in fp32, not in the model's dtype (a
  /// master whose tensor no micro-batch reached keeps no gradient).
  void accumulate_grads() {
    for (const auto& pair : pairs_) {  // all checked before any is changed
      MIXPREC_CHECK(!pair.model.grad().defined() || !pair.model.grad().is_sparse(),
                    kSparseMessage);
    }
    at::NoGradGuard no_grad;
    for (auto& pair : pairs_) {
      if (pair.master.is_same(pair.model) || !pair.model.grad().defined()) continue;
      auto& master_grad = pair.master.mutable_grad();
      if (!master_grad.defined()) {  // the model's shape: a lean master holds no data now
        master_grad = at::zeros(pair.model.sizes(), pair.master.options().dtype(at::kFloat));
      }
      master_grad.add_(pair.model.grad());
      pair.model.mutable_grad().reset();
    }
  }

  /// Writes the masters, rounded, into the model's parameters (under a lean storage: stow(true)).
  void copy_to_model() {
    if (lean_) return stow(/*stepped=*/true);
    at::NoGradGuard no_grad;
    for (auto& pair : pairs_) {
      if (!pair.master.is_same(pair.model)) pair.model.copy_(pair.master);
    }
  }

 private:
  static constexpr const char* kSparseMessage =
      "fp32 master weights take dense gradients: a sparse gradient (an Embedding or "
      "EmbeddingBag with sparse(true)) cannot be trained under MixedO2; use sparse(false)";

  struct Pair {
    at::Tensor model;
    at::Tensor master;
    std::int64_t lean;  // its index in lean_, or -1 (fp32 storage; an fp32 parameter)
  };

  at::Tensor value_of(const Pair& pair) const {
    if (pair.lean < 0 || lean_->inflated(static_cast<std::size_t>(pair.lean))) return pair.master;
    return lean_->value(static_cast<std::size_t>(pair.lean), pair.model);
  }

  // The master of the model tensor `id`, or null where it has none.
  const at::Tensor* master_of_model(const void* id) const {
    const auto it = pair_of_model_.find(id);
    return it == pair_of_model_.end() ? nullptr : &pairs_[it->second].master;
  }

  std::vector<Pair> pairs_;
  std::unordered_map<const void*, std::size_t> pair_of_master_;  // master -> its index in pairs_
  std::unordered_map<const void*, std::size_t> pair_of_model_;   // model tensor -> the same
  std::vector<at::Tensor> sources_;
  std::optional<detail::LeanMasters> lean_;
  std::size_t lean_count_ = 0;
};

}  // namespace mixprec
