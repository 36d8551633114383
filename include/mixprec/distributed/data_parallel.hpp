#pragma once
/// DataParallel: averages gradients across processes on PyTorch's own distributed engine, c10d
/// (ProcessGroupGloo on the CPU, ProcessGroupNCCL on CUDA), as DistributedDataParallel does:
/// in buckets (25 MiB, the first 1 MiB, reverse parameter order) launched while the backward
/// pass still runs, in fp32 by default. A Trainer given TrainerOptions::distributed uses it:
///
///   auto group = mixprec::gloo_group(mixprec::LaunchEnvironment::from_env());  // torchrun's
///   mixprec::Trainer<mixprec::MixedO2<at::BFloat16>> trainer(
///       model, optimizer, mixprec::TrainerOptions().distributed(mixprec::DistributedOptions(group)));
///
/// Every rank must make the same calls (steps, saves, loads) in the same order: each is a
/// collective. A rank that dies makes the others' next collective throw mixprec::Error.

#include <mixprec/core/compat.hpp>
#include <mixprec/io/checkpoint_file.hpp>
#include <mixprec/optim/sharded_state.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/arg.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec {

/// The c10d process group type that ProcessGroupGloo and ProcessGroupNCCL derive from:
/// c10d::Backend in LibTorch 2.x, c10d::ProcessGroup in 1.13.
using ProcessGroup = MIXPREC_C10D_PROCESS_GROUP;

/// Settings of data-parallel training; DDP's defaults.
struct DistributedOptions {
  explicit DistributedOptions(c10::intrusive_ptr<ProcessGroup> group)
      : process_group_(std::move(group)) {}
  /// The ranks to average over.
  TORCH_ARG(c10::intrusive_ptr<ProcessGroup>, process_group);
  /// Bucket size in MiB of the reduced dtype; 0: one bucket per tensor.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// The first bucket (the last layers, whose gradients are ready first) is smaller, so that
  /// communication starts early in the backward pass.
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  /// The dtype gradients travel in: kFloat (default; under MixedO2 the fp32 master gradients
  /// are the result), or kBFloat16/kHalf, half the bytes, divided by the world size before the
  /// sum so that it cannot overflow, and rounded twice (docs/distributed.md).
  TORCH_ARG(c10::ScalarType, reduce_dtype) = at::kFloat;
  /// Launch each bucket as soon as its gradients are ready; false: all after the backward pass.
  TORCH_ARG(bool, overlap) = true;
  /// Copy rank 0's buffers (BatchNorm statistics) to every rank before each forward pass, as
  /// DDP's broadcast_buffers=True does.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// ZeRO stage 1 (DeepSpeed's stage 1, PyTorch's ZeroRedundancyOptimizer): each rank keeps the
  /// optimizer state and the fp32 master weights of 1/world_size of the parameters, the same
  /// slice of each gradient bucket, and steps only those; the updated parameters are then
  /// gathered to every rank. Under MixedO2 + AdamW that is 12/world_size bytes per parameter
  /// instead of 12. Adam, AdamW and SGD (docs/distributed.md); gradients reduce in fp32.
  TORCH_ARG(bool, shard_optimizer_state) = false;
};

namespace detail {

// Runs a collective and waits for it; any failure (a peer gone, a timeout, a dtype the backend
// refuses) becomes a mixprec::Error that names the rank and the operation.
template <class Launch>
void run_collective(int rank, const char* what, Launch&& launch) {
  try {
    auto work = launch();
    work->wait();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("rank ", rank, ": the ", what, " across ranks failed: ", message_of(e),
         ". A peer process has probably exited or stalled (every rank must make the same Trainer "
         "calls in the same order); this process group cannot continue");
  }
}

// FNV-1a over the names, dtypes, shapes and requires_grad of a module's tensors.
inline std::uint64_t module_fingerprint(const torch::nn::Module& module) {
  std::uint64_t hash = 14695981039346656037ULL;
  auto mix = [&](const void* data, std::size_t size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < size; ++i) hash = (hash ^ bytes[i]) * 1099511628211ULL;
  };
  auto mix_tensor = [&](const std::string& name, const at::Tensor& t, bool grad) {
    mix(name.data(), name.size());
    const auto dtype = static_cast<int>(t.scalar_type());
    mix(&dtype, sizeof dtype);
    for (const auto size : t.sizes()) mix(&size, sizeof size);
    mix(&grad, sizeof grad);
  };
  for (const auto& item : module.named_parameters()) {
    mix_tensor("p:" + item.key(), item.value(), item.value().requires_grad());
  }
  for (const auto& item : module.named_buffers()) mix_tensor("b:" + item.key(), item.value(), false);
  return hash;
}

}  // namespace detail

/// Gradient averaging across the ranks of a process group, with DDP's buckets and overlap;
/// the Trainer drives it (see TrainerOptions::distributed), a custom loop can too: bind(), then
/// per optimizer step prepare(true), backward, finish(), and agree() on the inf flag.
class DataParallel final : public detail::StepGroup {
 public:
  /// Checks that every rank holds a model of the same structure (an Error on every rank if
  /// not), then copies rank 0's parameters and buffers to every rank. Collective.
  DataParallel(torch::nn::Module& model, DistributedOptions options)
      : DataParallel(model, nullptr, std::move(options)) {}

  /// As above; with shard_optimizer_state, first checks that `optimizer` is one whose state
  /// can be sharded (an Error naming it otherwise).
  DataParallel(torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
               DistributedOptions options)
      : DataParallel(model, &optimizer, std::move(options)) {}

 private:
  DataParallel(torch::nn::Module& model, const torch::optim::Optimizer* optimizer,
               DistributedOptions options)
      : options_(std::move(options)), state_(std::make_shared<State>()) {
    MIXPREC_CHECK(options_.process_group(), "DistributedOptions got a null process group");
    if (options_.shard_optimizer_state()) {
      MIXPREC_CHECK(options_.reduce_dtype() == at::kFloat, "DistributedOptions::"
                    "shard_optimizer_state reduces gradients in fp32 (each rank keeps its slice "
                    "of the fp32 sums): leave reduce_dtype at kFloat, got ",
                    options_.reduce_dtype());
      if (optimizer != nullptr) detail::check_shardable(*optimizer);
    }
    MIXPREC_CHECK(options_.bucket_cap_mb() >= 0 && options_.first_bucket_cap_mb() >= 0,
                  "DistributedOptions: bucket sizes must be >= 0 MiB, got ",
                  options_.first_bucket_cap_mb(), " and ", options_.bucket_cap_mb());
    const auto dtype = options_.reduce_dtype();
    MIXPREC_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                  "DistributedOptions::reduce_dtype must be kFloat, kBFloat16 or kHalf, got ",
                  dtype);
    MIXPREC_CHECK(gloo_reduces_bf16 || dtype != at::kBFloat16 ||
                      group().getBackendName() != "gloo",
                  "DistributedOptions::reduce_dtype(kBFloat16): LibTorch ", torch_version,
                  "'s Gloo backend cannot reduce bf16; reduce in kFloat (the default) or kHalf");
    state_->group = options_.process_group();
    state_->sharded = options_.shard_optimizer_state();
    state_->reduce_dtype = dtype;
    state_->rank = group().getRank();
    state_->world = group().getSize();
    const auto params = model.parameters();
    if (!params.empty()) device_ = params.front().device();
    check_same_model(model);
    broadcast_from_rank0(model, /*parameters=*/true);
  }

 public:
  ~DataParallel() override { unbind(); }
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int rank() const noexcept override { return state_->rank; }
  /// The model's device, where the collectives' tensors live (NCCL reduces CUDA tensors only).
  at::Device device() const noexcept override { return device_; }
  int world_size() const noexcept override { return state_->world; }
  const DistributedOptions& options() const noexcept { return options_; }
  bool broadcast_buffers() const noexcept override { return options_.broadcast_buffers(); }

  /// An Error on every rank unless every rank's model has the same tensors: names, shapes,
  /// dtypes and requires_grad, parameter by parameter and buffer by buffer. Collective (one
  /// all_gather); the constructor runs it, and the Trainer whenever it rebinds the gradients
  /// (a parameter frozen or unfrozen).
  void check_same_model(const torch::nn::Module& model) override {
    const auto mine = static_cast<std::int64_t>(detail::module_fingerprint(model));
    const auto n = static_cast<std::int64_t>(model.named_parameters().size() +
                                             model.named_buffers().size());
    const auto all = all_gather(at::tensor({mine, n}, at::kLong).to(device()));
    std::vector<int> differ;
    for (int r = 0; r < world_size(); ++r) {
      if (!all[static_cast<std::size_t>(r)].cpu().equal(all.front().cpu())) differ.push_back(r);
    }
    MIXPREC_CHECK(differ.empty(), "rank ", rank(), ": the models of ranks ",
                  at::IntArrayRef(std::vector<std::int64_t>(differ.begin(), differ.end())),
                  " differ from rank 0's in their parameters or buffers (names, shapes, dtypes "
                  "or requires_grad): build the same model, and freeze the same parameters, on "
                  "every rank");
  }

  /// Reduces the gradients of `params` (leaf tensors, each once): after finish(),
  /// `holders[i].grad()` is the average over ranks of params[i]'s gradient (plus what
  /// holders[i].grad() had accumulated, when holders[i] is another tensor, an fp32 master).
  /// Replaces an earlier binding. Collective: every rank must bind the same shapes.
  void bind(const std::vector<at::Tensor>& params,
            const std::vector<at::Tensor>& holders) override {
    MIXPREC_CHECK(params.size() == holders.size(), "DataParallel::bind needs one holder per "
                  "parameter, got ", holders.size(), " for ", params.size());
    std::int64_t total = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      MIXPREC_CHECK(params[i].requires_grad() && params[i].is_leaf(), "DataParallel reduces the "
                    "gradients of leaf tensors that require grad; tensor ", i, " of shape ",
                    params[i].sizes(), " is not one");
      MIXPREC_CHECK(params[i].device() == params.front().device(), "DataParallel: the model "
                    "spans devices ", params.front().device(), " and ", params[i].device(),
                    "; use one device per process, as DDP does");
      MIXPREC_CHECK(holders[i].sizes() == params[i].sizes(), "DataParallel::bind: holder ", i,
                    " has shape ", holders[i].sizes(), ", its parameter ", params[i].sizes());
      total += params[i].numel();
    }
    // The same tensors on every rank, or the buckets would not match.
    const auto counts = all_equal(static_cast<std::int64_t>(params.size()), total);
    MIXPREC_CHECK(counts, "rank ", rank(), ": the ranks train different parameter sets (",
                  params.size(), " tensors, ", total, " elements here): freeze and unfreeze the "
                  "same parameters on every rank");
    unbind();
    auto& s = *state_;
    if (s.sharded) {
      // The layout is the optimizer's (shard()); a parameter it does not hold is not reduced.
      for (const auto& p : params) {
        const auto it = slot_of_.find(p.unsafeGetTensorImpl());
        if (it != slot_of_.end()) hook(it->second);
      }
      return;
    }
    s.slots.clear();
    s.buckets.clear();
    lay_out(params, holders);
    for (std::size_t i = 0; i < s.slots.size(); ++i) hook(i);
  }

  /// Whether the optimizer steps this rank's shard only (DistributedOptions::shard_optimizer_state).
  bool sharded() const noexcept override { return state_->sharded; }

  /// Sharded: lays out the optimizer's tensors listed in `fresh` (model tensors, each with its
  /// fp32 value from before the model's cast, needed where `copies` and the tensor is not
  /// fp32) in new buckets after the existing ones, each bucket split into world_size equal
  /// slices, and replaces each of them in the optimizer by this rank's piece of it: an fp32
  /// copy (a master weight) where `copies` and the tensor is not fp32, a view of it otherwise;
  /// a tensor with no element in this rank's slices leaves the optimizer. Every other tensor
  /// the optimizer holds must be a piece already. Collective; bind() hooks the gradients next.
  void shard(torch::optim::Optimizer& optimizer,
             const std::vector<std::pair<at::Tensor, at::Tensor>>& fresh, bool copies) override {
    auto& s = *state_;
    MIXPREC_CHECK(s.sharded, "DataParallel::shard() needs DistributedOptions::shard_optimizer_state");
    detail::check_shardable(optimizer);
    MIXPREC_CHECK(optimizer_ == nullptr || optimizer_ == &optimizer, "DataParallel::shard(): "
                  "the optimizer is not the one sharded before");
    std::unordered_map<const void*, std::size_t> fresh_index;
    std::int64_t total = 0;
    for (std::size_t i = 0; i < fresh.size(); ++i) {
      const auto& t = fresh[i].first;
      fresh_index.emplace(t.unsafeGetTensorImpl(), i);
      MIXPREC_CHECK(t.is_contiguous(), "shard_optimizer_state: a parameter of shape ", t.sizes(),
                    " is not contiguous; make it so before building the Trainer");
      MIXPREC_CHECK(slot_of_.count(t.unsafeGetTensorImpl()) == 0, "a param group added to the "
                    "optimizer holds a model tensor of shape ", t.sizes(), " that it already "
                    "trains (sharded, in an earlier group): put each tensor in one group");
      MIXPREC_CHECK(!copies || t.scalar_type() == at::kFloat || fresh[i].second.defined(),
                    "DataParallel::shard(): no fp32 value for a ", t.scalar_type(), " tensor");
      total += t.numel();
    }
    // In the optimizer's order, grouped as it groups them (what an unsharded optimizer holds).
    std::vector<std::vector<std::size_t>> order(optimizer.param_groups().size());
    std::vector<std::size_t> group_of(fresh.size(), order.size());
    for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
      for (const auto& p : detail::unique_tensors(optimizer.param_groups()[g].params())) {
        const void* id = p.unsafeGetTensorImpl();
        if (piece_slot_.count(id) == 1) continue;
        const auto it = fresh_index.find(id);
        MIXPREC_CHECK(it != fresh_index.end(), "the optimizer holds a tensor of shape ",
                      p.sizes(), " that is not a parameter of the model: build it on "
                      "model->parameters()");
        MIXPREC_CHECK(group_of[it->second] == order.size(), "a tensor of shape ", p.sizes(),
                      " is in param groups ", group_of[it->second], " and ", g, " of the "
                      "optimizer (PyTorch refuses this too): put each tensor in one group");
        group_of[it->second] = g;
        order[g].push_back(it->second);
      }
    }
    MIXPREC_CHECK(all_equal(static_cast<std::int64_t>(fresh.size()), total), "rank ", rank(),
                  ": the ranks' optimizers hold different tensors (", fresh.size(), " tensors, ",
                  total, " elements here): build the same optimizer on every rank");
    // All checks passed.
    unbind();
    optimizer_ = &optimizer;
    groups_.resize(order.size());
    std::vector<at::Tensor> params, holders;
    std::vector<std::pair<std::size_t, std::size_t>> places;
    for (std::size_t g = 0; g < order.size(); ++g) {
      for (const auto i : order[g]) {
        params.push_back(fresh[i].first);
        holders.push_back(fresh[i].first);
        places.emplace_back(g, groups_[g].size());
        groups_[g].push_back(fresh[i].first);
      }
    }
    const auto first_slot = s.slots.size();
    const auto first_bucket = s.buckets.size();
    lay_out(params, holders);
    at::NoGradGuard no_grad;
    for (auto b = first_bucket; b < s.buckets.size(); ++b) {
      auto& bucket = s.buckets[b];
      bucket.chunk = (bucket.numel + s.world - 1) / s.world;
      bucket.padded = bucket.chunk * s.world;
      const auto lo = bucket.chunk * s.rank, hi = lo + bucket.chunk;
      for (const auto i : bucket.slots) {
        auto& slot = s.slots[i];
        const auto k = params.size() - 1 - (i - first_slot);  // lay_out went backwards
        slot.group = places[k].first;
        slot.index = places[k].second;
        slot_of_[slot.param.unsafeGetTensorImpl()] = i;
        const auto from = std::max(lo, slot.offset), to = std::min(hi, slot.offset + slot.param.numel());
        if (from >= to) continue;
        slot.piece_from = from - slot.offset;
        const auto& value = fresh[fresh_index.at(slot.param.unsafeGetTensorImpl())].second;
        slot.copy = copies && slot.param.scalar_type() != at::kFloat;
        slot.piece = slot.copy ? value.detach().to(at::kFloat).reshape({-1}).narrow(0, slot.piece_from, to - from).clone()
                               : slot.param.detach().view({-1}).narrow(0, slot.piece_from, to - from);
        piece_slot_[slot.piece.unsafeGetTensorImpl()] = i;
      }
    }
    allocate_flats(at::TensorOptions(at::kFloat).device(device()));
    for (std::size_t g = 0; g < order.size(); ++g) {
      std::vector<at::Tensor> pieces;
      for (const auto& p : detail::unique_tensors(optimizer.param_groups()[g].params())) {
        const void* id = p.unsafeGetTensorImpl();
        if (piece_slot_.count(id) == 1) {
          pieces.push_back(p);
          continue;
        }
        const auto& piece = s.slots[slot_of_.at(id)].piece;
        if (piece.defined()) pieces.push_back(piece);
      }
      optimizer.param_groups()[g].params() = std::move(pieces);
    }
  }

  /// Sharded, after a micro-batch whose gradients did not travel: they are added into the
  /// buckets (fp32), and the model's gradients set to none.
  void accumulate() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto& s = *state_;
    if (!s.sharded) return;
    for (const auto& slot : s.slots) {
      const auto& grad = slot.param.grad();
      MIXPREC_CHECK(!grad.defined() || !grad.is_sparse(), "DataParallel reduces dense "
                    "gradients: a tensor of shape ", slot.param.sizes(), " has a sparse one (an "
                    "Embedding with sparse(true)); use sparse(false)");
    }
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < s.slots.size(); ++i) {
      auto& slot = s.slots[i];
      if (!slot.param.grad().defined()) continue;
      s.fill(i);
      slot.accumulated = true;
      slot.param.mutable_grad().reset();
    }
  }

  /// Sharded, after an optimizer step: every rank's updated pieces, rounded to the model's
  /// dtype, into every rank's model (one all_gather per bucket, in the model's dtype where the
  /// bucket holds one).
  void gather_parameters() override {
    auto& s = *state_;
    if (!s.sharded) return;
    at::NoGradGuard no_grad;
    for (auto& bucket : s.buckets) {
      auto full = gather_bucket(bucket, bucket_dtype(bucket), [](const Slot& slot) {
        return slot.piece;
      });
      for (const auto i : bucket.slots) {
        auto& slot = s.slots[i];
        slot.param.detach().view({-1}).copy_(full.narrow(0, slot.offset, slot.param.numel()));
      }
    }
  }

  /// Sums the clipping norm's parts over the ranks (each holds those of its slices).
  void sum_over_shards(double& sum_of_squares, bool& non_finite) override {
    auto parts = at::tensor({sum_of_squares, non_finite ? 1.0 : 0.0}, at::kDouble).to(device());
    std::vector<at::Tensor> tensors{parts};
    detail::run_collective(rank(), "gradient norm allreduce", [&] {
      return group().allreduce(tensors);
    });
    const auto sums = parts.cpu();
    sum_of_squares = sums[0].item<double>();
    non_finite = sums[1].item<double>() != 0.0;
  }

  std::vector<std::vector<at::Tensor>> sharded_groups() const override { return groups_; }

  /// Every laid-out tensor's fp32 value (its master's where the pieces are copies), by the
  /// optimizer's groups. Collective.
  std::vector<std::vector<at::Tensor>> gather_values() override {
    auto result = empty_like_groups();
    auto& s = *state_;
    at::NoGradGuard no_grad;
    for (auto& bucket : s.buckets) {
      const auto full = gather_bucket(bucket, at::kFloat, [](const Slot& slot) { return slot.piece; });
      for (const auto i : bucket.slots) {
        const auto& slot = s.slots[i];
        result[slot.group][slot.index] =
            full.narrow(0, slot.offset, slot.param.numel()).view(slot.param.sizes()).clone();
      }
    }
    return result;
  }

  /// `full`, an optimizer of the user's type whose groups hold one full tensor per
  /// sharded_groups() entry, gets every rank's state of its pieces and the param groups'
  /// options. Collective.
  void gather_state(torch::optim::Optimizer& full) override {
    auto& s = *state_;
    const auto kind = *detail::sharded_kind(full);
    // Per slot: whether its pieces have state, its step, which fields are set (equal on every
    // rank that holds a piece of it; 0 on the others).
    auto meta = at::zeros({static_cast<std::int64_t>(s.slots.size()), 3}, at::kLong);
    auto* m = meta.data_ptr<std::int64_t>();
    for (std::size_t i = 0; i < s.slots.size(); ++i) {
      const auto& piece = s.slots[i].piece;
      auto* state = piece.defined() ? detail::state_of(*optimizer_, piece) : nullptr;
      if (state == nullptr) continue;
      m[3 * i] = 1;
      m[3 * i + 1] = detail::state_step(*state, kind);
      const auto fields = detail::state_fields(*state, kind);
      for (std::size_t k = 0; k < fields.size(); ++k) {
        if (fields[k] != nullptr && fields[k]->defined()) m[3 * i + 2] |= std::int64_t{1} << k;
      }
    }
    auto combined = meta.clone();
    for (const auto& other : all_gather(meta.to(device()))) {
      combined = at::maximum(combined, other.cpu());
    }
    const auto* c = combined.data_ptr<std::int64_t>();
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < s.slots.size(); ++i) {
      if (c[3 * i] == 0) continue;
      const auto& slot = s.slots[i];
      detail::set_state(full, full.param_groups()[slot.group].params()[slot.index],
                        detail::new_state(kind, c[3 * i + 1]));
    }
    for (std::size_t k = 0; k < detail::kShardedFields; ++k) {
      for (auto& bucket : s.buckets) {
        bool any = false;
        for (const auto i : bucket.slots) any = any || ((c[3 * i + 2] >> k) & 1) != 0;
        if (!any) continue;
        const auto values = gather_bucket(bucket, at::kFloat, [&](const Slot& slot) {
          auto* state = slot.piece.defined() ? detail::state_of(*optimizer_, slot.piece) : nullptr;
          if (state == nullptr) return at::Tensor();
          auto* field = detail::state_fields(*state, kind)[k];
          return field != nullptr && field->defined() ? *field : at::Tensor();
        });
        for (const auto i : bucket.slots) {
          if (((c[3 * i + 2] >> k) & 1) == 0) continue;
          const auto& slot = s.slots[i];
          const auto& target = full.param_groups()[slot.group].params()[slot.index];
          *detail::state_fields(*detail::state_of(full, target), kind)[k] =
              values.narrow(0, slot.offset, slot.param.numel()).view(target.sizes()).to(target.scalar_type(), false, true);
        }
      }
    }
    detail::copy_group_options(*optimizer_, full);
  }

  /// After `full` (as in gather_state) was loaded: this rank's pieces get their slices of its
  /// tensors (the copies; the views see the model's) and of its state, the optimizer its
  /// param groups' options.
  void scatter_state(torch::optim::Optimizer& full) override {
    auto& s = *state_;
    const auto kind = *detail::sharded_kind(full);
    at::NoGradGuard no_grad;
    auto& states = optimizer_->state();
    states.clear();
    for (auto& slot : s.slots) {
      if (!slot.piece.defined()) continue;
      const auto& source = full.param_groups()[slot.group].params()[slot.index];
      const auto slice = [&](const at::Tensor& t) {
        return t.reshape({-1}).narrow(0, slot.piece_from, slot.piece.numel());
      };
      if (slot.copy) slot.piece.copy_(slice(source));
      auto* loaded = detail::state_of(full, source);
      if (loaded == nullptr) continue;
      auto state = detail::new_state(kind, detail::state_step(*loaded, kind));
      const auto from = detail::state_fields(*loaded, kind);
      const auto to = detail::state_fields(*state, kind);
      for (std::size_t k = 0; k < detail::kShardedFields; ++k) {
        if (from[k] != nullptr && from[k]->defined()) {
          *to[k] = slice(*from[k]).to(slot.piece.scalar_type(), false, true);
        }
      }
      detail::set_state(*optimizer_, slot.piece, std::move(state));
    }
    detail::copy_group_options(full, *optimizer_);
  }

  /// Before a backward pass: `sync` on the micro-batch after which gradients are reduced
  /// (the last of an accumulation); before the others nothing is communicated. `first`: the
  /// first micro-batch of an optimizer step (sharded: the accumulation starts over).
  void prepare(bool sync, bool first = true) override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto& s = *state_;
    if (first) {
      for (auto& slot : s.slots) slot.accumulated = false;
    }
    s.active = sync && !s.slots.empty();
    s.next = 0;
    s.twice = false;
    s.overlap = options_.overlap();
    for (auto& slot : s.slots) slot.ready = false;
    for (auto& bucket : s.buckets) {
      bucket.pending = bucket.slots.size();
      bucket.work.reset();
    }
  }

  /// After the backward pass of a prepare(true): reduces what is left (a parameter that got no
  /// gradient on this rank counts as zeros), waits, and writes the averages into the holders'
  /// gradients. A tensor with no gradient on any rank keeps its undefined gradient, as in one
  /// process.
  void finish() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto& s = *state_;
    if (!s.active) return;
    s.active = false;
    MIXPREC_CHECK(!s.twice, "rank ", s.rank, ": a parameter's gradient was accumulated again "
                  "after its bucket had been copied (backward() ran twice before the step, e.g. "
                  "inside loss_fn): its second part would be missing from the average; return "
                  "one loss and let the Trainer run the backward pass");
    bool all_local = true;
    for (std::size_t i = 0; i < s.slots.size(); ++i) {
      if (!s.slots[i].ready) {
        s.fill(i);
        s.slots[i].ready = true;
        --s.buckets[s.slots[i].bucket].pending;
      }
    }
    auto& last = s.buckets.back();
    auto used = last.flat.narrow(0, last.padded, static_cast<std::int64_t>(s.slots.size()));
    std::vector<float> local_used(s.slots.size());
    for (std::size_t i = 0; i < s.slots.size(); ++i) {
      local_used[i] = s.has_gradient(i) ? 1.0F : 0.0F;
      all_local = all_local && local_used[i] != 0.0F;
    }
    used.copy_(at::from_blob(local_used.data(), {static_cast<std::int64_t>(local_used.size())},
                             at::kFloat));
    s.launch_ready(/*include_last=*/true);
    for (std::size_t b = 0; b < s.buckets.size(); ++b) {
      auto& bucket = s.buckets[b];
      detail::run_collective(s.rank, "gradient allreduce", [&] { return bucket.work; });
      bucket.work.reset();
      if (options_.reduce_dtype() == at::kFloat) {
        bucket.flat.narrow(0, 0, bucket.numel).div_(s.world);
      }
    }
    // Whether another rank had a gradient matters only where this one had none: read the
    // counts (a host copy) only then.
    std::vector<float> global_used;
    if (!all_local) {
      auto counts = used.to(at::kFloat).cpu();
      global_used.assign(counts.data_ptr<float>(), counts.data_ptr<float>() + counts.numel());
    }
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < s.slots.size(); ++i) {
      auto& slot = s.slots[i];
      slot.accumulated = false;
      if (s.sharded) {
        // This rank's slice of the average is its piece's gradient; a tensor no rank had a
        // gradient for has none, and the optimizer skips it.
        if (!slot.piece.defined()) continue;
        if (!all_local && global_used[i] == 0.0F) {
          slot.piece.mutable_grad().reset();
          continue;
        }
        auto value = s.view(i).narrow(0, slot.piece_from, slot.piece.numel());
        slot.piece.mutable_grad() = slot.piece.scalar_type() == value.scalar_type()
                                        ? value
                                        : value.to(slot.piece.scalar_type());
        continue;
      }
      if (!all_local && global_used[i] == 0.0F) continue;
      const auto value = s.view(i).view(slot.holder.sizes());
      auto& grad = slot.holder.mutable_grad();
      if (grad.defined()) {
        grad.copy_(value);
      } else {
        grad = value.to(slot.holder.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      }
    }
  }

  /// MAX-reduces a one-element inf flag, so that every rank steps or skips alike.
  void agree(at::Tensor& found_inf) {
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::MAX;
    std::vector<at::Tensor> tensors{found_inf};
    detail::run_collective(rank(), "inf/NaN agreement", [&] {
      return group().allreduce(tensors, options);
    });
  }

  /// A step's agreement: MAX-reduces `found_inf` so that every rank steps or skips alike, and
  /// checks in the same allreduce (MAX over [found_inf, calls, -calls]) that every rank is at
  /// the same step() call. A rank that went on after its step() threw is one call ahead: its
  /// gradients were averaged with the others' previous step, and every rank gets this Error
  /// before anything steps.
  void agree_step(at::Tensor& found_inf, std::int64_t calls) override {
    const auto mine = static_cast<double>(calls % (std::int64_t{1} << 24));  // exact in fp32
    auto flags = at::cat({found_inf.reshape({1}).to(at::kFloat),
                          at::tensor({mine, -mine}, at::kFloat).to(found_inf.device())});
    agree(flags);
    found_inf.copy_(flags.narrow(0, 0, 1).reshape(found_inf.sizes()));
    const auto seen = flags.narrow(0, 1, 2).cpu();
    const double most = seen[0].item<double>(), least = -seen[1].item<double>();
    MIXPREC_CHECK(most == mine && least == mine, "rank ", rank(), ": the ranks are at "
                  "different steps (this rank's step() call ", calls, "; the ranks' calls, "
                  "modulo 2^24, range from ", least, " to ", most, "): a rank went on after its "
                  "step() threw, so its gradients were averaged with another step's. Every rank "
                  "must make the same Trainer calls; restart all ranks from the last checkpoint");
  }

  /// Whether `local` is true on any rank.
  bool any(bool local) override {
    auto flag = at::full({1}, local ? 1.0F : 0.0F, at::kFloat).to(device());
    agree(flag);
    return flag.item<float>() != 0.0F;
  }

  /// `value` of every rank, in rank order (same shape and dtype on every rank).
  std::vector<at::Tensor> all_gather(const at::Tensor& value) override {
    const auto bits = as_bits(value.contiguous());
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < world_size(); ++r) outputs[0].push_back(at::empty_like(bits));
    std::vector<at::Tensor> inputs{bits};
    detail::run_collective(rank(), "all_gather", [&] { return group().allgather(outputs, inputs); });
    for (auto& t : outputs[0]) t = from_bits(t, value);
    return outputs[0];
  }

  /// A copy is a copy of bits: 16-bit floats travel as bytes, which every backend takes
  /// (LibTorch 1.13's Gloo refuses bf16, and int16).
  static at::Tensor as_bits(const at::Tensor& t) {
    const auto dtype = t.scalar_type();
    return dtype == at::kBFloat16 || dtype == at::kHalf ? t.reshape({-1}).view(at::kByte) : t;
  }
  /// The inverse of as_bits, to the dtype and shape of `like`.
  static at::Tensor from_bits(const at::Tensor& bits, const at::Tensor& like) {
    return bits.scalar_type() == like.scalar_type() ? bits
                                                    : bits.view(like.scalar_type()).view(like.sizes());
  }

  /// Copies rank 0's buffers to every rank (or, with `parameters`, its parameters too).
  void broadcast_from_rank0(torch::nn::Module& model, bool parameters = false) override {
    std::vector<at::Tensor> tensors;
    if (parameters) {
      for (const auto& p : model.parameters()) tensors.push_back(p);
    }
    for (const auto& b : model.buffers()) tensors.push_back(b);
    tensors = detail::unique_tensors(tensors);
    // One flat tensor per dtype: Gloo broadcasts one tensor per call.
    std::vector<c10::ScalarType> dtypes;
    for (const auto& t : tensors) {
      if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) == dtypes.end()) {
        dtypes.push_back(t.scalar_type());
      }
    }
    at::NoGradGuard no_grad;
    for (const auto dtype : dtypes) {
      std::vector<at::Tensor> group_tensors;
      for (const auto& t : tensors) {
        if (t.scalar_type() == dtype) group_tensors.push_back(t);
      }
      const auto flat_like = flatten(group_tensors);
      std::vector<at::Tensor> flat{as_bits(flat_like)};
      c10d::BroadcastOptions options;
      options.rootRank = 0;
      detail::run_collective(rank(), "broadcast from rank 0", [&] {
        return group().broadcast(flat, options);
      });
      std::int64_t offset = 0;
      for (auto& t : group_tensors) {
        t.copy_(from_bits(flat[0], flat_like).narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
  }

 private:
  struct Slot {
    at::Tensor param;
    at::Tensor holder;
    std::size_t bucket;
    std::int64_t offset;
    bool ready;
    // Sharded: this rank's piece of the tensor (undefined: none), the optimizer's tensor in its
    // place; where it starts in the flattened tensor; whether it is an fp32 copy (a master) or
    // a view of the model's tensor; its place in the optimizer's groups; whether earlier
    // micro-batches of the step left their sum in the bucket.
    at::Tensor piece = {};
    std::int64_t piece_from = 0;
    bool copy = false;
    std::size_t group = 0;
    std::size_t index = 0;
    bool accumulated = false;
  };
  struct Bucket {
    std::vector<std::size_t> slots;
    std::int64_t numel = 0;
    std::int64_t padded = 0;  // numel; sharded: rounded up to world * chunk
    std::int64_t chunk = 0;   // sharded: each rank's slice
    at::Tensor flat;
    std::size_t pending = 0;
    c10::intrusive_ptr<c10d::Work> work;
  };
  // What the hooks reach; they hold it weakly, so a hook outliving its DataParallel (the model
  // kept after the Trainer) does nothing.
  struct State {
    std::mutex mutex;
    std::vector<Slot> slots;
    std::vector<Bucket> buckets;
    c10::intrusive_ptr<ProcessGroup> group;
    c10::ScalarType reduce_dtype = at::kFloat;
    std::size_t next = 0;  // the first bucket not launched: buckets launch in order on every rank
    bool active = false;
    bool twice = false;  // a gradient arrived again after its slot was copied
    bool overlap = true;
    bool sharded = false;
    int rank = 0;
    int world = 1;

    at::Tensor view(std::size_t i) {
      const auto& slot = slots[i];
      return buckets[slot.bucket].flat.narrow(0, slot.offset, slot.param.numel());
    }
    bool has_gradient(std::size_t i) const {
      const auto& slot = slots[i];
      return slot.param.grad().defined() || slot.accumulated ||
             (!slot.holder.is_same(slot.param) && slot.holder.grad().defined());
    }
    // The slot's gradient (the holder's accumulated one plus the parameter's) into its bucket.
    void fill(std::size_t i) {
      auto& slot = slots[i];
      const auto& grad = slot.param.grad();
      const auto& held = slot.holder.is_same(slot.param) ? at::Tensor() : slot.holder.grad();
      MIXPREC_CHECK(!(grad.defined() && grad.is_sparse()) && !(held.defined() && held.is_sparse()),
                    "DataParallel reduces dense gradients: a tensor of shape ", slot.param.sizes(),
                    " has a sparse one (an Embedding with sparse(true)); use sparse(false)");
      auto target = view(i);
      if (sharded) {  // the micro-batches before this one are in the bucket already
        if (grad.defined()) {
          slot.accumulated ? target.add_(grad.reshape({-1})) : target.copy_(grad.reshape({-1}));
        } else if (!slot.accumulated) {
          target.zero_();
        }
        return;
      }
      if (!grad.defined() && !held.defined()) {
        target.zero_();
        return;
      }
      const auto value = !held.defined() ? grad : (grad.defined() ? held + grad : held);
      // A 16-bit sum of N ranks' values could overflow: divide first, in the gradient's own
      // precision, so that the value rounds to 16 bits once.
      target.copy_((reduce_dtype == at::kFloat ? value : value / world).reshape({-1}));
    }
    void launch_ready(bool include_last) {
      while (next < buckets.size() && buckets[next].pending == 0 &&
             (include_last || next + 1 < buckets.size())) {
        std::vector<at::Tensor> tensors{buckets[next].flat};
        try {
          buckets[next].work = group->allreduce(tensors);
        } catch (const std::exception& e) {
          detail::fail("rank ", rank, ": launching the allreduce of gradient bucket ", next, " failed: ",
               detail::message_of(e));
        }
        ++next;
      }
    }
    void ready(std::size_t i) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!active) return;
      if (slots[i].ready) {
        twice = true;
        return;
      }
      fill(i);
      slots[i].ready = true;
      // The last bucket waits for finish(), which adds the per-slot gradient flags to it.
      if (--buckets[slots[i].bucket].pending == 0 && overlap) launch_ready(false);
    }
  };
  struct Hook : torch::autograd::FunctionPostHook {
    Hook(const std::shared_ptr<State>& state, std::size_t slot) : state_(state), slot_(slot) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      if (auto state = state_.lock()) state->ready(slot_);
      return outputs;
    }
    std::weak_ptr<State> state_;
    std::size_t slot_;
  };

  ProcessGroup& group() { return *options_.process_group(); }

  // Slots for `params` (their `holders` receive the averages when not sharded), in new buckets
  // after the existing ones; reverse order: the backward pass produces the last layers'
  // gradients first.
  void lay_out(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& holders) {
    auto& s = *state_;
    const auto element = static_cast<double>(at::elementSize(options_.reduce_dtype()));
    double limit = (s.buckets.empty() ? options_.first_bucket_cap_mb() : options_.bucket_cap_mb()) *
                   1024.0 * 1024.0;
    double bytes = 0;
    const auto first_bucket = s.buckets.size();
    for (std::size_t k = params.size(); k-- > 0;) {
      const double size = static_cast<double>(params[k].numel()) * element;
      if (s.buckets.size() == first_bucket || (bytes > 0 && bytes + size > limit)) {
        if (s.buckets.size() > first_bucket) limit = options_.bucket_cap_mb() * 1024.0 * 1024.0;
        s.buckets.emplace_back();
        bytes = 0;
      }
      auto& bucket = s.buckets.back();
      s.slots.push_back({params[k], holders[k], s.buckets.size() - 1, bucket.numel, false});
      bucket.slots.push_back(s.slots.size() - 1);
      bucket.numel += params[k].numel();
      bytes += size;
    }
    const auto options = at::TensorOptions(options_.reduce_dtype())
                             .device(params.empty() ? device() : params.front().device());
    for (auto b = first_bucket; b < s.buckets.size(); ++b) s.buckets[b].padded = s.buckets[b].numel;
    allocate_flats(options);
  }

  // The buckets' flat tensors; the last one also carries, per slot, whether the rank has a
  // gradient for it.
  void allocate_flats(const at::TensorOptions& options) {
    auto& s = *state_;
    for (std::size_t b = 0; b < s.buckets.size(); ++b) {
      const auto extra = b + 1 == s.buckets.size() ? static_cast<std::int64_t>(s.slots.size()) : 0;
      s.buckets[b].flat = at::zeros({s.buckets[b].padded + extra}, options);
    }
  }

  void hook(std::size_t i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(state_->slots[i].param);
    hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<Hook>(state_, i)));
    accumulators_.push_back(std::move(accumulator));
  }

  // The model's dtype where every tensor of the bucket has it, else fp32.
  c10::ScalarType bucket_dtype(const Bucket& bucket) const {
    const auto dtype = state_->slots[bucket.slots.front()].param.scalar_type();
    for (const auto i : bucket.slots) {
      if (state_->slots[i].param.scalar_type() != dtype) return at::kFloat;
    }
    return dtype;
  }

  // The bucket's flat values (padded) from every rank's slice, in `dtype`: each rank fills its
  // slice with `part(slot)` of its pieces (undefined: zeros).
  template <class Part>
  at::Tensor gather_bucket(const Bucket& bucket, c10::ScalarType dtype, Part&& part) {
    auto& s = *state_;
    auto mine = at::zeros({bucket.chunk}, at::TensorOptions(dtype).device(device()));
    for (const auto i : bucket.slots) {
      const auto& slot = s.slots[i];
      if (!slot.piece.defined()) continue;
      const auto value = part(slot);
      if (!value.defined()) continue;
      mine.narrow(0, slot.offset + slot.piece_from - bucket.chunk * s.rank, slot.piece.numel())
          .copy_(value.reshape({-1}));
    }
    return at::cat(all_gather(mine));
  }

  std::vector<std::vector<at::Tensor>> empty_like_groups() const {
    std::vector<std::vector<at::Tensor>> result(groups_.size());
    for (std::size_t g = 0; g < groups_.size(); ++g) result[g].resize(groups_[g].size());
    return result;
  }

  void unbind() {
    for (std::size_t i = 0; i < accumulators_.size(); ++i) {
      accumulators_[i]->del_post_hook(hook_keys_[i]);
    }
    accumulators_.clear();
    hook_keys_.clear();
  }

  // Whether two counts are the same on every rank (one all_gather).
  bool all_equal(std::int64_t a, std::int64_t b) {
    const auto all = all_gather(at::tensor({a, b}, at::kLong).to(device()));
    for (const auto& t : all) {
      if (!t.cpu().equal(all.front().cpu())) return false;
    }
    return true;
  }

  static at::Tensor flatten(const std::vector<at::Tensor>& tensors) {
    std::vector<at::Tensor> flat;
    for (const auto& t : tensors) flat.push_back(t.detach().reshape({-1}));
    return at::cat(flat);
  }

  DistributedOptions options_;
  std::shared_ptr<State> state_;
  at::Device device_ = at::Device(at::kCPU);
  std::vector<decltype(torch::autograd::impl::grad_accumulator(at::Tensor()))> accumulators_;
  std::vector<std::uintptr_t> hook_keys_;
  // Sharded: the optimizer, the model tensors laid out by its groups, the slot of each model
  // tensor and of each piece.
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::vector<std::vector<at::Tensor>> groups_;
  std::unordered_map<const void*, std::size_t> slot_of_;
  std::unordered_map<const void*, std::size_t> piece_slot_;
};

namespace detail {
template <>
struct StepGroupFactory<DistributedOptions> {
  static std::unique_ptr<StepGroup> make(torch::nn::Module& model,
                                         const torch::optim::Optimizer& optimizer,
                                         const DistributedOptions& options) {
    return std::make_unique<DataParallel>(model, optimizer, options);
  }
};
}  // namespace detail

}  // namespace mixprec
