#pragma once
// A Trainer's fp32 weights for inference or another framework: each parameter's fp32 value (its
// master's under MixedO2, not its Low rounding) by its state-dict name, written as Module::save
// writes a model or pickled for Python.

#include <mixprec/io/atomic_file.hpp>
#include <mixprec/io/checkpoint_file.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/optim/master_weights.hpp>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>
#include <torch/serialize.h>
#include <torch/serialize/archive.h>

#include <exception>
#include <string>
#include <vector>

namespace mixprec {

/// The file formats of Trainer::save_fp32.
enum class WeightsFormat {
  libtorch,  ///< Module::save's archive: torch::load(fp32_model, path) in C++
  pickle,    ///< pickled (name, tensor) pairs: dict(torch.load(path)) in Python
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

inline void save_fp32(const std::string& path, WeightsFormat format,
                      const torch::nn::Module& model, const MasterWeights* masters) {
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
