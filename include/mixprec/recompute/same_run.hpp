#pragma once
// What the first run of a checkpointed block leaves for its recompute to be checked against
// (checkpoint_node.hpp runs the checks). A recompute that takes another path than the forward
// pass gives the gradients of another computation, silently. Python's torch.utils.checkpoint
// (use_reentrant=False) records the count, shapes, dtypes and devices of the tensors the block
// saves for backward and raises CheckpointError when the recompute saves others. LibTorch has no
// saved-tensor hooks for C++ code, but the graph a run builds shows as much and more: each op's
// kind and the shapes, dtypes and devices of what it produced (GraphShape). What no graph shows
// is checked beside it: a Checkpointed module's modes (ModuleModes: eval() before backward), the
// parameters' versions (an optimizer step before backward), and a few of the outputs' values
// (OutputSample: a number the block reads that changed). All of it is metadata or a few
// elements: nothing passes over the data.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/precision/own_outputs.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Type.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <typeindex>
#include <typeinfo>
#include <utility>
#include <vector>

namespace mixprec::detail {

/// How an Error names a checkpointed block: the name it was given (a Checkpointed module's path,
/// CheckpointOptions::name), else the type of its function (a lambda's names the function it
/// was written in).
struct BlockName {
  std::shared_ptr<const std::string> given;
  const std::type_info* function = nullptr;

  std::string describe() const {
    if (given != nullptr) return *given;
    return function != nullptr ? "block " + c10::demangle(function->name()) : "block";
  }
};

/// The shapes, dtype and device of a tensor.
struct TensorMeta {
  std::vector<std::int64_t> sizes;
  c10::ScalarType dtype;
  c10::Device device;

  static TensorMeta of(const at::Tensor& t) {
    return {t.sizes().vec(), t.scalar_type(), t.device()};
  }
  bool operator==(const TensorMeta& other) const {
    return sizes == other.sizes && dtype == other.dtype && device == other.device;
  }
};

/// The graph one run of a block built, node by node in the order walked from its outputs: each
/// node's kind (the op's backward) and the shapes, dtypes and devices of the tensors its op
/// produced (the node's inputs; LibTorch 1.13 keeps the shapes private: dtypes and devices
/// there). A module in another mode, another branch taken, another shape: another graph.
class GraphShape {
 public:
  void add(const torch::autograd::Node& node) {
    kinds_.emplace_back(typeid(node));
    starts_.push_back(meta_.size());
    meta_.push_back(static_cast<std::int64_t>(node.num_inputs()));
    for (std::uint32_t i = 0; i < node.num_inputs(); ++i) {
      const auto& m = node.input_metadata(i);
      meta_.push_back(static_cast<std::int64_t>(c10::typeMetaToScalarType(m.dtype())));
      meta_.push_back(static_cast<std::int64_t>(m.device().type()) * 1024 + m.device().index());
      const auto sizes = recorded_sizes(m);
      if (!sizes) {
        meta_.push_back(-1);  // its dtype and device only (LibTorch 1.13, a nested tensor)
        continue;
      }
      meta_.push_back(static_cast<std::int64_t>(sizes->size()));
      for (const auto& s : *sizes) meta_.push_back(s.is_symbolic() ? -2 : s.as_int_unchecked());
    }
  }

  std::size_t size() const noexcept { return kinds_.size(); }
  /// Room for a graph like `other` (a recompute's, like its first run's).
  void reserve_like(const GraphShape& other) {
    kinds_.reserve(other.kinds_.size());
    starts_.reserve(other.starts_.size());
    meta_.reserve(other.meta_.size());
  }
  bool operator==(const GraphShape& other) const {
    return kinds_ == other.kinds_ && meta_ == other.meta_;
  }

  /// Where `recomputed` first differs from this graph, in words.
  std::string difference(const GraphShape& recomputed) const {
    std::ostringstream out;
    out << "the forward pass built " << size() << " graph nodes, the recompute "
        << recomputed.size();
    std::size_t i = 0;
    while (i < size() && i < recomputed.size() && same_node(recomputed, i)) ++i;
    out << "; the first that differs, walking back from the outputs (node " << i + 1 << "): ";
    out << (i < size() ? describe(i) : "none") << " in the forward pass, "
        << (i < recomputed.size() ? recomputed.describe(i) : "none") << " in the recompute";
    return out.str();
  }

 private:
  std::size_t end(std::size_t i) const { return i + 1 < size() ? starts_[i + 1] : meta_.size(); }

  bool same_node(const GraphShape& other, std::size_t i) const {
    return kinds_[i] == other.kinds_[i] &&
           std::equal(meta_.begin() + static_cast<std::ptrdiff_t>(starts_[i]),
                      meta_.begin() + static_cast<std::ptrdiff_t>(end(i)),
                      other.meta_.begin() + static_cast<std::ptrdiff_t>(other.starts_[i]),
                      other.meta_.begin() + static_cast<std::ptrdiff_t>(other.end(i)));
  }

  // "NativeBatchNormBackward0 (its op made [16, 32] Float, [32] Float, [32] Float)"
  std::string describe(std::size_t i) const {
    auto kind = c10::demangle(kinds_[i].name());
    for (const std::string_view prefix : {"torch::autograd::generated::", "torch::autograd::"}) {
      if (kind.rfind(prefix, 0) == 0) kind = kind.substr(prefix.size());
    }
    std::ostringstream out;
    out << kind << " (its op made";
    auto k = starts_[i];
    const auto inputs = meta_[k++];
    for (std::int64_t j = 0; j < inputs; ++j) {
      const auto dtype = static_cast<c10::ScalarType>(meta_[k++]);
      ++k;  // the device: printed where it differs from the other run's, below, never alone
      const auto dims = meta_[k++];
      out << (j == 0 ? " " : ", ");
      for (std::int64_t d = 0; d < dims; ++d) out << (d == 0 ? "[" : ", ") << meta_[k++];
      out << (dims == 0 ? "[] " : dims > 0 ? "] " : "") << c10::toString(dtype);
    }
    out << (inputs == 0 ? " nothing)" : ")");
    return out.str();
  }

  std::vector<std::type_index> kinds_;
  std::vector<std::size_t> starts_;  // where each node's entries begin in meta_
  // Per node: its number of inputs, then per input: dtype, device, number of dims (-1: not
  // known) and the sizes.
  std::vector<std::int64_t> meta_;
};

/// A few values of each output, byte for byte: up to kCount elements spread over it, the first
/// and last among them. A recompute computes the same values bit for bit on the CPU (the same
/// kernels on the same data, threads and random state: tests/recompute trains bitwise), so
/// another value means the block read something that changed between the two runs, which no
/// metadata shows. Only where an output is on the CPU: a GPU's kernels need not repeat bit for
/// bit (atomics), and reading values there would wait for the device.
class OutputSample {
 public:
  static constexpr std::int64_t kCount = 16;

  /// The sample of `outputs` (those that require grad, in order).
  static OutputSample of(const torch::autograd::variable_list& outputs) {
    OutputSample sample;
    sample.threads_ = at::get_num_threads();
    for (const auto& out : outputs) {
      const auto n = sampled(out) ? std::min(out.numel(), kCount) : 0;
      sample.counts_.push_back(n);
      sample.dtypes_.push_back(out.defined() ? out.scalar_type() : c10::ScalarType::Undefined);
      if (n == 0) continue;
      const Elements elements(out);
      for (std::int64_t j = 0; j < n; ++j) {
        const auto* at = elements[position(out.numel(), n, j)];
        sample.bytes_.insert(sample.bytes_.end(), at, at + elements.size);
      }
    }
    return sample;
  }

  /// Empty where `recomputed` (the recompute's outputs that require grad, of the first run's
  /// shapes and dtypes) holds the same values where this sample was taken; else where not, in
  /// words. Not compared where the intra-op thread count changed between the two runs (ATen's
  /// reductions split their work by it).
  std::string difference(const torch::autograd::variable_list& recomputed) const {
    if (at::get_num_threads() != threads_) return {};
    std::size_t offset = 0;
    for (std::size_t i = 0; i < counts_.size() && i < recomputed.size(); ++i) {
      const auto& out = recomputed[i];
      const auto n = counts_[i];
      if (n == 0 || !sampled(out) || out.scalar_type() != dtypes_[i]) {
        offset += static_cast<std::size_t>(n) * c10::elementSize(dtypes_[i]);
        continue;
      }
      const Elements elements(out);
      for (std::int64_t j = 0; j < n; ++j, offset += elements.size) {
        const auto p = position(out.numel(), n, j);
        if (std::memcmp(elements[p], bytes_.data() + offset, elements.size) == 0) continue;
        std::ostringstream words;
        words << "output " << i << " (shape " << out.sizes() << "), element " << p << " of "
              << out.numel() << ": " << value(bytes_.data() + offset, dtypes_[i])
              << " in the forward pass, " << value(elements[p], dtypes_[i]) << " in the recompute";
        return words.str();
      }
    }
    return {};
  }

 private:
  static bool sampled(const at::Tensor& t) {
    return t.defined() && t.device().is_cpu() && t.layout() == c10::kStrided && !t.is_nested() &&
           t.has_storage() && t.numel() > 0 && t.data_ptr() != nullptr;
  }
  // The j-th of n positions spread over `numel` elements (flat, in row-major order).
  static std::int64_t position(std::int64_t numel, std::int64_t n, std::int64_t j) {
    if (j == n - 1) return numel - 1;
    return n == 1 ? 0 : j * ((numel - 1) / (n - 1));
  }
  // The bytes of a tensor's element at a flat position (row-major), whatever the strides.
  struct Elements {
    explicit Elements(const at::Tensor& t)
        : data(static_cast<const std::uint8_t*>(t.data_ptr())),
          sizes(t.sizes()),
          strides(t.strides()),
          size(static_cast<std::size_t>(t.element_size())) {}
    const std::uint8_t* operator[](std::int64_t p) const {
      std::int64_t offset = 0;
      for (auto d = sizes.size(); d-- > 0;) {
        offset += (p % sizes[d]) * strides[d];
        p /= sizes[d];
      }
      return data + offset * static_cast<std::int64_t>(size);
    }
    const std::uint8_t* data;
    c10::IntArrayRef sizes, strides;
    std::size_t size;
  };
  static c10::Scalar value(const std::uint8_t* bytes, c10::ScalarType dtype) {
    auto t = at::empty({1}, at::TensorOptions().dtype(dtype));
    std::memcpy(t.data_ptr(), bytes, c10::elementSize(dtype));
    return t.item();
  }

  int threads_ = 0;
  std::vector<std::int64_t> counts_;
  std::vector<c10::ScalarType> dtypes_;
  std::vector<std::uint8_t> bytes_;
};

/// The training flags of modules a block runs and of their submodules, in apply()'s order: a
/// Checkpointed module's, or those named by CheckpointOptions::keep_buffers. Recorded by the
/// forward pass and compared before the recompute: a forward that reads is_training() computes
/// otherwise, and not every mode shows in the graph (batch_norm builds the same node in
/// training and in eval mode).
class ModuleModes {
 public:
  static ModuleModes of(std::vector<std::shared_ptr<const torch::nn::Module>> roots) {
    ModuleModes modes;
    for (const auto& root : roots) {
      root->apply([&](const torch::nn::Module& m) { modes.training_.push_back(m.is_training()); });
    }
    modes.roots_ = std::move(roots);
    return modes;
  }

  /// Empty where every module is in the mode it was in; else the first that changed (the
  /// outermost: model->eval() changes a module and all below it), in words.
  std::string changes() const {
    std::size_t k = 0;
    bool same = true;
    for (const auto& root : roots_) {
      root->apply([&](const torch::nn::Module& m) {
        same = same && k < training_.size() && training_[k] == m.is_training();
        ++k;
      });
    }
    if (same && k == training_.size()) return {};
    std::size_t i = 0, changed = 0, count = 0;
    std::string first;
    for (const auto& root : roots_) {
      root->apply([&](const std::string& path, const torch::nn::Module& m) {
        ++count;
        const bool was = i < training_.size() && training_[i++];
        if (m.is_training() == was || changed++ > 0) return;
        first = (path.empty() ? "module " + holder_name(m)
                              : "submodule '" + path + "' (" + holder_name(m) + ")") +
                " was in " + (was ? "training" : "eval") + " mode in the forward pass and is in " +
                (m.is_training() ? "training" : "eval") + " mode now";
      });
    }
    if (count != training_.size()) return "its modules are not those of the forward pass";
    if (changed == 0) return {};
    return first + " (" + std::to_string(changed) + " of its " + std::to_string(count) +
           " modules changed mode)";
  }

  /// The name of `tensor` among the parameters of the modules, or empty.
  std::string parameter_name(const at::Tensor& tensor) const {
    for (const auto& root : roots_) {
      for (const auto& item : root->named_parameters()) {
        if (item.value().unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl()) return item.key();
      }
    }
    return {};
  }

 private:
  std::vector<std::shared_ptr<const torch::nn::Module>> roots_;
  std::vector<bool> training_;
};

/// The version counters of the leaves (parameters) a run reached, in order.
inline std::vector<std::int64_t> leaf_versions(const torch::autograd::edge_list& leaves) {
  std::vector<std::int64_t> versions;
  versions.reserve(leaves.size());
  for (const auto& edge : leaves) {
    const auto* leaf = static_cast<const torch::autograd::AccumulateGrad*>(edge.function.get());
    versions.push_back(leaf->variable.defined() ? leaf->variable._version() : 0);
  }
  return versions;
}

/// What the first run of a block leaves to compare its recompute with.
struct RunRecord {
  std::vector<TensorMeta> outputs;  // those that require grad
  GraphShape graph;
  OutputSample sample;
  std::vector<std::int64_t> versions;  // of the leaves reached
};

}  // namespace mixprec::detail
