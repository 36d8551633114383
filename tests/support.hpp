#pragma once
// Helpers shared by the test files.

#include <mixprec/fp8/linear.hpp>

#include <c10/util/Flags.h>
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

// c10's flag: LibTorch's CPU allocator fills each new block with a NaN pattern.
C10_DECLARE_bool(caffe2_cpu_allocator_do_junk_fill);

namespace test {

/// Linear(inputs, 8) -> BatchNorm1d(8) -> ReLU -> Linear(8, 3), named fc1, norm, fc2: a model
/// with a module MixedO2 keeps in fp32, for the tests of loading and of bad inputs.
struct LinearNormNet : torch::nn::Module {
  explicit LinearNormNet(std::int64_t inputs) {
    fc1 = register_module("fc1", torch::nn::Linear(inputs, 8));
    norm = register_module("norm", torch::nn::BatchNorm1d(8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc2->forward(torch::relu(norm->forward(fc1->forward(x))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};

/// While alive, memory LibTorch allocates on the CPU holds NaN until written, every time (not
/// by the chance of what the allocator hands back): a test that must not read uninitialised
/// memory as values fails for certain. Checks that the flag takes effect.
class NanFilledAllocations {
 public:
  NanFilledAllocations() : was_(FLAGS_caffe2_cpu_allocator_do_junk_fill) {
    FLAGS_caffe2_cpu_allocator_do_junk_fill = true;
    if (!torch::empty({16}).isnan().all().item<bool>()) {
      throw std::runtime_error("caffe2_cpu_allocator_do_junk_fill did not fill with NaN");
    }
  }
  NanFilledAllocations(const NanFilledAllocations&) = delete;
  NanFilledAllocations& operator=(const NanFilledAllocations&) = delete;
  ~NanFilledAllocations() { FLAGS_caffe2_cpu_allocator_do_junk_fill = was_; }

 private:
  bool was_;
};

/// Runs `body(Recipe{})` where this LibTorch has fp8 (mixprec::has_fp8). The body is a generic
/// lambda, so that nothing naming MixedFP8 is compiled under LibTorch 1.13, where such cases are
/// skipped (`* doctest::skip(!mixprec::has_fp8)`).
template <class Recipe = mixprec::TensorwiseScaling, class Body>
void with_fp8(Body&& body) {
  if constexpr (mixprec::has_fp8) body(Recipe{});
}

/// with_fp8 for several recipes at once: body(Recipes{}...) where LibTorch has fp8.
template <class... Recipes, class Body>
void with_fp8_recipes(Body&& body) {
  if constexpr (mixprec::has_fp8) body(Recipes{}...);
}

/// Whether this build runs under AddressSanitizer (GCC and clang define __SANITIZE_ADDRESS__ or
/// report the feature): for the few cases that doctest::skip there.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool address_sanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool address_sanitizer = true;
#else
inline constexpr bool address_sanitizer = false;
#endif
#else
inline constexpr bool address_sanitizer = false;
#endif

/// Whether this LibTorch's optimizers can be assigned (`opt = torch::optim::AdamW(...)`, as a
/// Python user replaces an optimizer): from 2.x; 1.13's are not move-assignable, and the cases
/// that assign one are skipped there.
inline constexpr bool optimizers_assignable = std::is_move_assignable_v<torch::optim::AdamW>;

/// `opt = Opt(params, options)` where this LibTorch compiles it (a template, so that 1.13 does
/// not instantiate the assignment; the callers are skipped there).
template <class Opt, class Options>
void assign_new(Opt& opt, std::vector<at::Tensor> params, const Options& options) {
  if constexpr (std::is_move_assignable_v<Opt>) opt = Opt(std::move(params), options);
}

/// A copy of every parameter, for before/after comparisons.
inline std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> copies;
  for (const auto& p : params) copies.push_back(p.detach().clone());
  return copies;
}

/// The Python references' fingerprint of a list of tensors (tests/parity_fp8.py,
/// tests/parity_block.py): sum(x_i * (i % 251 + 1)) over the tensors flattened in order, in
/// fp64, with the same ATen ops as theirs, so that equal tensors give equal doubles.
inline double fingerprint(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  for (const auto& t : tensors) flat.push_back(t.detach().reshape({-1}).to(at::kDouble));
  const auto all = torch::cat(flat);
  const auto index = torch::arange(all.numel(), torch::TensorOptions(at::kDouble));
  return (all * (torch::remainder(index, 251) + 1)).sum().item<double>();
}

/// A tensor's bytes, in its logical order: what "bitwise" compares (+0 and -0 differ, a NaN
/// equals the same NaN, unlike at::equal).
inline at::Tensor bytes_of(const at::Tensor& t) {
  return t.detach().cpu().contiguous().reshape({-1}).view(at::kByte);
}

/// Bitwise equality of two tensors: dtype, shape and every bit.
inline bool identical(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         bytes_of(a).equal(bytes_of(b));
}

/// Bitwise equality of two tensor lists.
inline bool identical(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!identical(a[i], b[i])) return false;
  }
  return true;
}

/// Largest |a - b| over two tensor lists, in fp64.
inline double max_abs_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, (a[i].to(at::kDouble) - b[i].to(at::kDouble)).abs().max().item<double>());
  }
  return m;
}

/// Adam's moments and step counts keyed by state object, whatever the state key type of the
/// LibTorch version (std::string in 1.13, void* later).
struct AdamMoments {
  std::map<const void*, std::vector<at::Tensor>> tensors;
  std::map<const void*, std::int64_t> steps;
  bool operator==(const AdamMoments& other) const {
    if (steps != other.steps || tensors.size() != other.tensors.size()) return false;
    for (const auto& [key, value] : tensors) {
      auto it = other.tensors.find(key);
      if (it == other.tensors.end() || !identical(value, it->second)) return false;
    }
    return true;
  }
};

inline AdamMoments adam_moments(torch::optim::Optimizer& optimizer) {
  AdamMoments m;
  for (auto& entry : optimizer.state()) {
    const auto& state = static_cast<const torch::optim::AdamParamState&>(*entry.second);
    m.tensors[&state] = {state.exp_avg().clone(), state.exp_avg_sq().clone()};
    m.steps[&state] = state.step();
  }
  return m;
}

/// A trunk and two heads; head `b` joins the output only where `use_b` says (a branch taken on
/// some steps only, a head trained on one task of several). tests/parity.py has its twin.
struct Branchy : torch::nn::Module {
  Branchy() {
    trunk = register_module("trunk", torch::nn::Linear(16, 32));
    a = register_module("a", torch::nn::Linear(32, 4));
    b = register_module("b", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x, bool use_b) {
    const auto h = torch::relu(trunk->forward(x));
    return use_b ? a->forward(h) + b->forward(h) : a->forward(h);
  }
  torch::nn::Linear trunk{nullptr}, a{nullptr}, b{nullptr};
};

/// Writes bytes to a file under the test temporary directory; returns its path.
inline std::string temp_path(const std::string& name) {
  // Appended rather than `std::string(...) + "/" + name`, on which GCC 12 at -O3 warns
  // falsely (-Warray-bounds) depending on what else the file inlines.
  std::string path(MIXPREC_TEST_TMPDIR);
  path += '/';
  path += name;
  return path;
}

}  // namespace test
