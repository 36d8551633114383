#pragma once
// A Trainer's fp32 weights for inference or another framework: each parameter's fp32 value (its
// master's under MixedO2, not its Low rounding) by its state-dict name, written as Module::save
// writes a model, pickled for Python, or as safetensors streamed tensor by tensor (a sharded
// run's bucket by bucket, never the whole model on any rank).

#include <mixprec/io/atomic_file.hpp>
#include <mixprec/io/checkpoint_file.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/distributed/step_group.hpp>
#include <mixprec/io/safetensors_stream.hpp>
#include <mixprec/optim/master_weights.hpp>
#include <mixprec/trainer/ranks.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>
#include <torch/serialize.h>
#include <torch/serialize/archive.h>

#include <exception>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec {

/// The file formats of Trainer::save_fp32.
enum class WeightsFormat {
  libtorch,     ///< Module::save's archive: torch::load(fp32_model, path) in C++
  pickle,       ///< pickled (name, tensor) pairs: dict(torch.load(path)) in Python
  safetensors,  ///< safetensors, written tensor by tensor (sharded: bucket by bucket):
                ///< safetensors.torch.load_file(path) in Python, mixprec::read_safetensors
};

namespace detail {

// A model tensor's fp32 value: its master's under MixedO2, else itself cast (integers as is).
inline at::Tensor fp32_of(const at::Tensor& t, const MasterWeights* masters) {
  const auto master = masters ? masters->master_value(t) : at::Tensor();
  const auto& value = master.defined() ? master : t;
  if (!value.is_floating_point()) return value.detach().clone();
  return value.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
}

inline torch::OrderedDict<std::string, at::Tensor> fp32_state_dict(
    const torch::nn::Module& model, const MasterWeights* masters) {
  torch::OrderedDict<std::string, at::Tensor> result;
  for (const auto& item : model.named_parameters()) {
    result.insert(item.key(), fp32_of(item.value(), masters));
  }
  for (const auto& item : model.named_buffers()) {
    result.insert(item.key(), fp32_of(item.value(), masters));
  }
  return result;
}

// Module::save's layout (own parameters, own buffers, one archive per child), fp32 values.
inline void write_fp32_module(const torch::nn::Module& module, const MasterWeights* masters,
                              torch::serialize::OutputArchive& archive) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    archive.write(item.key(), fp32_of(item.value(), masters));
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    archive.write(item.key(), fp32_of(item.value(), masters), /*is_buffer=*/true);
  }
  for (const auto& child : module.named_children()) {
    torch::serialize::OutputArchive child_archive;
    write_fp32_module(*child.value(), masters, child_archive);
    archive.write(child.key(), child_archive);
  }
}

/// Every state-dict name of `model` (tied names each), with its fp32 export's dtype and shape.
inline std::vector<SafetensorsSpec> fp32_specs(const torch::nn::Module& model,
                                               const std::vector<std::string>& order) {
  std::unordered_map<std::string, at::Tensor> by_name;
  for (const auto& item : model.named_parameters()) by_name.emplace(item.key(), item.value());
  for (const auto& item : model.named_buffers()) by_name.emplace(item.key(), item.value());
  std::vector<SafetensorsSpec> specs;
  for (const auto& name : order) {
    const auto& t = by_name.at(name);
    specs.push_back({name, t.is_floating_point() ? at::kFloat : t.scalar_type(), t.sizes().vec()});
  }
  return specs;
}

/// The fp32 export as safetensors, streamed: rank 0 writes; sharded, every rank gathers the
/// laid-out tensors' fp32 values one bucket at a time (never the whole model), and rank 0
/// writes each tensor of the bucket under each of its names; the other tensors, which every
/// rank holds whole, follow. Collective with `group`.
inline void save_fp32_streamed(const std::string& path, const torch::nn::Module& model,
                               const MasterWeights* masters, StepGroup* group) {
  const bool writes = group == nullptr || group->rank() == 0;
  const auto slots = group != nullptr ? group->shard_slots() : std::vector<ShardSlot>{};
  // The names of each tensor, and the data's order: the laid-out tensors bucket by bucket.
  std::unordered_map<const void*, std::vector<std::string>> names_of;
  std::vector<at::Tensor> tensors;
  const auto add = [&](const std::string& name, const at::Tensor& t) {
    auto& names = names_of[t.unsafeGetTensorImpl()];
    if (names.empty()) tensors.push_back(t);
    names.push_back(name);
  };
  for (const auto& item : model.named_parameters()) add(item.key(), item.value());
  for (const auto& item : model.named_buffers()) add(item.key(), item.value());
  std::vector<std::string> order;
  std::unordered_map<const void*, bool> laid_out;
  for (const auto& slot : slots) {
    laid_out[slot.param.unsafeGetTensorImpl()] = true;
    for (const auto& name : names_of.at(slot.param.unsafeGetTensorImpl())) order.push_back(name);
  }
  for (const auto& t : tensors) {
    if (laid_out.count(t.unsafeGetTensorImpl()) == 0) {
      for (const auto& name : names_of.at(t.unsafeGetTensorImpl())) order.push_back(name);
    }
  }
  std::optional<SafetensorsWriter> writer;
  std::exception_ptr failure;
  const auto attempt = [&](auto&& io) {
    if (!writes || failure) return;
    try {
      io();
    } catch (...) {
      failure = std::current_exception();
    }
  };
  attempt([&] { writer.emplace(path, fp32_specs(model, order), std::vector<std::pair<std::string, std::string>>{{"format", "pt"}}); });
  at::NoGradGuard no_grad;
  for (std::size_t first = 0; first < slots.size();) {
    const auto bucket = slots[first].bucket;
    auto last = first;
    while (last < slots.size() && slots[last].bucket == bucket) ++last;
    const auto full = group->gather_fp32(bucket);  // collective: every rank, whatever rank 0's state
    attempt([&] {
      for (auto i = first; i < last; ++i) {
        const auto& slot = slots[i];
        const auto value = full.narrow(0, slot.offset, slot.param.numel());
        for (std::size_t k = 0; k < names_of.at(slot.param.unsafeGetTensorImpl()).size(); ++k) {
          writer->write_next(value);
        }
      }
    });
    first = last;
  }
  attempt([&] {
    for (const auto& t : tensors) {
      if (laid_out.count(t.unsafeGetTensorImpl()) == 1) continue;
      const auto value = fp32_of(t, masters);
      for (std::size_t k = 0; k < names_of.at(t.unsafeGetTensorImpl()).size(); ++k) {
        writer->write_next(value);
      }
    }
    writer->commit();
  });
  write_on_rank0(group, path, [&] {
    if (failure) std::rethrow_exception(failure);
  });
}

inline void save_fp32(const std::string& path, WeightsFormat format,
                      const torch::nn::Module& model, const MasterWeights* masters) {
  if (format == WeightsFormat::safetensors) return save_fp32_streamed(path, model, masters, nullptr);
  try {
    AtomicFile file(path);
    if (format == WeightsFormat::pickle) {
      // Pairs in a tuple, not a dict: LibTorch tags a dict's type with a global that
      // Python's torch.load(weights_only=True), its default since 2.6, refuses.
      std::vector<c10::IValue> pairs;
      for (const auto& item : fp32_state_dict(model, masters)) {
        pairs.emplace_back(
            c10::ivalue::Tuple::create({c10::IValue(item.key()), c10::IValue(item.value())}));
      }
      const auto bytes =
          torch::pickle_save(c10::IValue(c10::ivalue::Tuple::create(std::move(pairs))));
      file.write(bytes.data(), bytes.size());
    } else {
      torch::serialize::OutputArchive archive;
      write_fp32_module(model, masters, archive);
      archive.save_to([&](const void* data, std::size_t size) -> std::size_t {
        return file.write(data, size) ? size : 0;
      });
    }
    file.commit();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("cannot write fp32 weights to '", path, "': ", message_of(e));
  }
}

}  // namespace detail

}  // namespace mixprec
