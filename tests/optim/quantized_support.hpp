#pragma once
// The helpers the block-format tests share: torchao's side in Python
// (tests/optim/quantized_moments.py) and bitwise comparisons.

#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

namespace test {

// torchao runs in the wheel's venv, next to LibTorch >= 2.5 (1.13's Python has no torchao).
inline constexpr bool kNoTorchao = !mixprec::has_fp8;

using Entries = std::vector<std::pair<std::string, c10::IValue>>;

/// ATen's thread count set for a scope and restored after it: a test that steps with two
/// threads must not leave the ones after it reducing in another order than their Python side.
class ThreadsFor {
 public:
  explicit ThreadsFor(int threads) : saved_(at::get_num_threads()) { at::set_num_threads(threads); }
  ~ThreadsFor() { at::set_num_threads(saved_); }
  ThreadsFor(const ThreadsFor&) = delete;
  ThreadsFor& operator=(const ThreadsFor&) = delete;

 private:
  int saved_;
};

/// `mode` of quantized_moments.py on `inputs`; its output dict.
inline c10::impl::GenericDict run_torchao(const std::string& mode, const Entries& inputs) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [key, value] : inputs) dict.insert(key, value);
  const auto input = temp_path("quantized_" + mode + ".pt");
  const auto output = temp_path("quantized_" + mode + ".out.pt");
  {
    const auto bytes = torch::pickle_save(c10::IValue(dict));
    std::ofstream(input, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  std::remove(output.c_str());
  const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + MIXPREC_QUANTIZED_SCRIPT + " " +
                       mode + " " + input + " " + output;
  REQUIRE(std::system(command.c_str()) == 0);
  std::ifstream in(output, std::ios::binary);
  const std::vector<char> saved((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return torch::pickle_load(saved).toGenericDict();
}

inline at::Tensor entry(const c10::impl::GenericDict& dict, const std::string& key) {
  INFO("key ", key);
  REQUIRE(dict.contains(key));
  return dict.at(key).toTensor();
}

/// The elements of a and b (same dtype and count) whose bits differ; NaNs of any payload alike.
inline std::int64_t bit_differences(const at::Tensor& a, const at::Tensor& b) {
  REQUIRE(a.numel() == b.numel());
  REQUIRE(a.scalar_type() == b.scalar_type());
  const auto x = a.contiguous().view({-1}), y = b.contiguous().view({-1});
  if (at::isFloatingType(a.scalar_type())) {
    const auto both_nan = x.isnan().logical_and(y.isnan());
    const auto as_int = [](const at::Tensor& t) {
      return t.element_size() == 4 ? t.view(at::kInt) : t.view(at::kShort);
    };
    return as_int(x).ne(as_int(y)).logical_and(both_nan.logical_not()).sum().item<std::int64_t>();
  }
  return x.ne(y).sum().item<std::int64_t>();
}

/// Rows of a block format split into their codes (flat, as torchao keeps them) and scales.
inline std::pair<at::Tensor, at::Tensor> codes_and_scales(const at::Tensor& rows,
                                                          mixprec::MomentCoding coding) {
  const auto bytes = mixprec::detail::code_bytes(coding.format, coding.block);
  const auto codes = rows.narrow(1, 0, bytes).contiguous().view({-1});
  const auto scales = rows.narrow(1, bytes, 4).contiguous().view(at::kFloat).view({-1});
  return {codes, scales};
}

}  // namespace test
