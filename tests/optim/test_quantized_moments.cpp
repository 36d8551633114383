// Adam's moments in block formats (core/state_storage.hpp's Moments8bit, Moments4bit,
// MomentsFp8): the codes and scales of optim/block_quantize.hpp and the steps of
// optim/quantized_adam.hpp against torchao 0.18's (tests/optim/quantized_moments.py, in the
// Python of MIXPREC_PYTHON: the wheel's venv, torch 2.13), byte for byte.
#include <mixprec/mixprec.hpp>

#include "quantized_support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace test_quantized_moments {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;
using mp::MomentCoding;
using mp::MomentFormat;

namespace {

using test::bit_differences;
using test::codes_and_scales;
using test::Entries;
using test::kNoTorchao;

c10::impl::GenericDict run_python(const std::string& mode, const Entries& inputs) {
  return test::run_torchao(mode, inputs);
}

at::Tensor get(const c10::impl::GenericDict& dict, const std::string& key) {
  return test::entry(dict, key);
}

const char* format_key(MomentFormat f) {
  return f == MomentFormat::dynamic8 ? "q8" : (f == MomentFormat::dynamic4 ? "q4" : "fp8");
}

// Blocks whose largest magnitude is 1 (the scale 1, so x / scale is x) holding each entry of
// `map`, the midpoint of each pair of neighbours (the rounding's ties) and the fp32 values
// beside the midpoint.
at::Tensor ties_of(const float* map, int entries, std::int64_t block) {
  std::vector<float> values;
  for (int c = 0; c + 1 < entries; ++c) {
    const float mid = (map[c] + map[c + 1]) / 2.0F;
    for (const float v : {map[c], mid, std::nextafter(mid, -1.0F), std::nextafter(mid, 2.0F)}) {
      if (values.size() % static_cast<std::size_t>(block) == 0) values.push_back(1.0F);
      values.push_back(v);
    }
  }
  while (values.size() % static_cast<std::size_t>(block) != 0 || values.size() < 4096) {
    values.push_back(values.size() % 3 == 0 ? 1.0F : 0.25F);
  }
  return torch::tensor(values);
}

}  // namespace

TEST_CASE("block formats: the maps, codes, scales and decoded values are torchao's, byte for "
          "byte" * doctest::skip(kNoTorchao)) {
  torch::manual_seed(5);
  const auto inf = std::numeric_limits<float>::infinity();
  const auto& maps = mp::detail::quant_maps();
  // e4m3's values, the midpoints between them (ties to even), past 448 and 480, subnormals.
  std::vector<float> e4m3;
  for (int c = 0; c < 127; ++c) {
    const float v = mp::detail::quant::e4m3fn_values()[static_cast<std::size_t>(c)];
    const float next = c < 126 ? mp::detail::quant::e4m3fn_values()[static_cast<std::size_t>(c + 1)] : 480.0F;
    const float mid = (v + next) / 2.0F;
    for (const float x : {v, mid, std::nextafter(mid, 0.0F), std::nextafter(mid, inf)}) {
      e4m3.push_back(x);
      e4m3.push_back(-x);
    }
  }
  for (const float x : {464.0F, 470.0F, 479.9F, 480.0F, 1e6F, 1e-10F, inf, -inf}) e4m3.push_back(x);
  while (e4m3.size() % 256 != 0) e4m3.push_back(0.0F);
  const std::vector<std::pair<std::string, at::Tensor>> inputs = {
      {"random", torch::randn({8192}) * torch::exp(torch::randn({8192}) * 4)},
      {"normal", torch::randn({64, 64})},
      {"zeros", torch::zeros({4096})},
      {"huge", torch::cat({torch::randn({4095}) * 1e30, torch::tensor({3.4e38F})})},
      {"tiny", torch::cat({torch::randn({2048}) * 1e-30, torch::randn({2048}) * 1e-40})},
      {"negative", -torch::randn({4096}).abs()},
      {"mixed_blocks", torch::cat({torch::zeros({256}), torch::full({256}, 1e-13F),
                                   torch::randn({3584}) * 1e-3})},
      {"ties8s", ties_of(maps.signed8.data(), 256, 256)},
      {"ties8u", ties_of(maps.unsigned8.data(), 256, 256)},
      {"ties4s", ties_of(maps.signed4.data(), 16, 128)},
      {"ties4u", ties_of(maps.unsigned4.data(), 16, 128)},
      {"e4m3", torch::tensor(e4m3)},
      {"special", torch::cat({torch::full({256}, inf), torch::full({256}, std::nanf("")),
                              torch::randn({256}), torch::tensor({-inf}), torch::randn({255})})},
  };
  Entries entries = {{"block8", std::int64_t{256}}, {"block4", std::int64_t{128}},
                     {"blockfp8", std::int64_t{256}}};
  for (const auto& [name, x] : inputs) entries.emplace_back("x." + name, x.contiguous());
  const auto python = run_python("codec", entries);
  // The maps.
  const auto map_tensor = [](const auto& m) {
    return torch::from_blob(const_cast<float*>(m.data()), {static_cast<std::int64_t>(m.size())},
                            at::kFloat).clone();
  };
  CHECK(bit_differences(map_tensor(maps.signed8), get(python, "map.q8.s")) == 0);
  CHECK(bit_differences(map_tensor(maps.unsigned8), get(python, "map.q8.u")) == 0);
  CHECK(bit_differences(map_tensor(maps.signed4), get(python, "map.q4.s")) == 0);
  CHECK(bit_differences(map_tensor(maps.unsigned4), get(python, "map.q4.u")) == 0);
  std::int64_t compared = 0;
  for (const auto& [name, x] : inputs) {
    for (const auto coding : {MomentCoding{MomentFormat::dynamic8, 256},
                              MomentCoding{MomentFormat::dynamic4, 128},
                              MomentCoding{MomentFormat::fp8, 256}}) {
      for (const bool is_signed : {true, false}) {
        if (coding.format == MomentFormat::fp8 && !is_signed) continue;
        const auto key = std::string(format_key(coding.format)) + (is_signed ? ".s." : ".u.") + name;
        INFO(key);
        const auto rows = mp::detail::quantize_blocks(x, coding, is_signed);
        const auto [codes, scales] = codes_and_scales(rows, coding);
        const auto decoded = mp::detail::dequantize_blocks(rows, coding, is_signed);
        const auto codes_off = bit_differences(codes, get(python, key + ".codes"));
        const auto scales_off = bit_differences(scales, get(python, key + ".scale"));
        const auto decoded_off = bit_differences(decoded, get(python, key + ".decoded"));
        if (codes_off + scales_off + decoded_off != 0) {
          MESSAGE(key, ": ", codes_off, " codes, ", scales_off, " scales, ", decoded_off,
                  " decoded values differ from torchao's");
        }
        CHECK(codes_off == 0);
        CHECK(scales_off == 0);
        CHECK(decoded_off == 0);
        compared += codes.numel();
      }
    }
    // fp8 conversion alone (no scale): c10's float8_e4m3fn.
    std::vector<std::uint8_t> mine;
    const auto flat = x.contiguous().view({-1});
    for (std::int64_t i = 0; i < flat.numel(); ++i) {
      mine.push_back(mp::detail::quant::to_e4m3fn(flat.data_ptr<float>()[i]));
    }
    const auto theirs = get(python, "e4m3." + name);
    CHECK(bit_differences(torch::from_blob(mine.data(), {flat.numel()}, at::kByte).clone(), theirs) == 0);
  }
  MESSAGE("block formats vs torchao: ", compared, " codes compared, all equal");
}

namespace {

struct AdamCase {
  std::string optimizer;  // torchao.optim's class
  MomentCoding coding;
  bool adamw = true;
  bool bf16 = false;  // bf16 weights, stochastically rounded
  double lr = 1e-2;
};

// The moment tensor a fresh state holds: rows of zeros where the tensor is quantized, else
// plain zeros (bf16 for a bf16 weight, as torchao keeps zeros_like(p)).
at::Tensor fresh_moment(std::int64_t numel, MomentCoding coding, c10::ScalarType plain) {
  if (mp::detail::quantizes(numel, coding.block)) {
    return torch::zeros({numel / coding.block, mp::detail::row_bytes(coding.format, coding.block)},
                        at::kByte);
  }
  return torch::zeros({numel}, plain);
}

// Steps `c.optimizer` of torchao and quantized_adam_update on the same tensors and gradients;
// compares every weight and moment after each step, bit for bit.
void check_steps_against_torchao(const AdamCase& c) {
  torch::manual_seed(17);
  const std::vector<std::int64_t> sizes = {8192, 4096, 100, 4100, 33 * 256};
  constexpr std::int64_t kSteps = 4;
  const auto dtype = c.bf16 ? at::kBFloat16 : at::kFloat;
  const double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  Entries entries = {{"optimizer", c.optimizer}, {"lr", c.lr}, {"beta1", beta1},
                     {"beta2", beta2}, {"eps", eps}, {"weight_decay", weight_decay},
                     {"amsgrad", false}, {"block", c.coding.block},
                     {"steps", kSteps}};
  std::vector<at::Tensor> params;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    params.push_back((torch::randn({sizes[k]}) * 0.5).to(dtype));
    entries.emplace_back("p." + std::to_string(k), params.back().clone());
  }
  std::vector<std::vector<at::Tensor>> grads(kSteps);
  auto keys = torch::zeros({kSteps, static_cast<std::int64_t>(sizes.size())}, at::kLong);
  for (std::int64_t s = 0; s < kSteps; ++s) {
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      // Magnitudes that differ per element, as gradients do; some exactly 0.
      auto g = torch::randn({sizes[k]}) * torch::exp(torch::randn({sizes[k]}) * 2) * 1e-2;
      g.masked_fill_(torch::rand({sizes[k]}) < 0.05, 0.0);
      grads[static_cast<std::size_t>(s)].push_back(g.to(dtype));
      entries.emplace_back("g." + std::to_string(s) + "." + std::to_string(k), g.to(dtype));
      keys[s][static_cast<std::int64_t>(k)] =
          static_cast<std::int64_t>(mp::detail::rounding_key(3, static_cast<std::uint64_t>(s), k));
    }
  }
  if (c.bf16) entries.emplace_back("sr_keys", keys);
  const auto python = run_python("adam", entries);
  // mixprec's kernel, tensor by tensor.
  struct State {
    at::Tensor m, v;
  };
  std::vector<State> states;
  for (const auto n : sizes) {
    states.push_back({fresh_moment(n, c.coding, dtype), fresh_moment(n, c.coding, dtype)});
  }
  std::int64_t compared = 0, differ = 0;
  for (std::int64_t s = 0; s < kSteps; ++s) {
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      auto& p = params[k];
      auto& st = states[k];
      const auto& g = grads[static_cast<std::size_t>(s)][k];
      auto step = mp::detail::TorchaoAdamStep::make(c.lr, beta1, beta2, eps, weight_decay, s + 1,
                                                    c.adamw);
      mp::detail::QuantizedAdamTensors t;
      t.numel = p.numel();
      if (c.bf16) {
        t.bf16 = static_cast<std::uint16_t*>(p.data_ptr());
        t.key = static_cast<std::uint32_t>(keys[s][static_cast<std::int64_t>(k)].item<std::int64_t>());
      } else {
        t.fp32 = p.data_ptr<float>();
      }
      t.grad = g.data_ptr();
      t.grad_bf16 = c.bf16;
      t.exp_avg = st.m.data_ptr();
      t.exp_avg_sq = st.v.data_ptr();
      const bool quantized = st.m.scalar_type() == at::kByte;
      t.moments = quantized ? c.coding : MomentCoding{};
      t.moments_bf16 = !quantized && c.bf16;
      mp::detail::quantized_adam_update(t, step, {});
      const auto prefix = std::to_string(s) + "." + std::to_string(k);
      INFO(c.optimizer, ", step ", s + 1, ", tensor ", k, " of ", p.numel(), " elements");
      const auto compare = [&](const char* what, const at::Tensor& mine, const at::Tensor& theirs) {
        const auto off = bit_differences(mine, theirs);
        if (off != 0) {
          MESSAGE(c.optimizer, " step ", s + 1, " tensor ", k, " (", p.numel(), "): ", std::string(what),
                  ": ", off, " of ", mine.numel(), " differ; largest difference ",
                  at::isFloatingType(mine.scalar_type())
                      ? (mine.to(at::kDouble) - theirs.to(at::kDouble)).abs().max().item<double>()
                      : -1.0);
        }
        differ += off;
        compared += mine.numel();
      };
      compare("weights", p, get(python, prefix + ".p").view({-1}));
      const std::vector<std::pair<const char*, at::Tensor>> moments = {
          {"exp_avg", st.m}, {"exp_avg_sq", st.v}};
      for (const auto& [name, tensor] : moments) {
        if (!tensor.defined()) continue;
        const auto key = prefix + "." + name;
        if (quantized) {
          const auto [codes, scales] = codes_and_scales(tensor, c.coding);
          compare(name, codes, get(python, key + ".codes"));
          compare(name, scales, get(python, key + ".scale"));
        } else {
          compare(name, tensor, get(python, key).view({-1}));
        }
      }
    }
  }
  MESSAGE(c.optimizer, std::string(c.bf16 ? " (bf16, stochastic rounding)" : ""),
          " vs torchao, ", kSteps, " steps: ", compared, " values compared, ", differ, " differ");
  CHECK(differ == 0);
}

}  // namespace

TEST_CASE("quantized Adam and AdamW: each step's weights, codes and scales are torchao's "
          "(AdamW8bit, Adam8bit, AdamW4bit, AdamWFp8), bit for bit" * doctest::skip(kNoTorchao)) {
  const test::ThreadsFor threads(2);  // the chunks stepped in parallel
  check_steps_against_torchao({"AdamW8bit", {MomentFormat::dynamic8, 256}});
  check_steps_against_torchao({"Adam8bit", {MomentFormat::dynamic8, 256}, /*adamw=*/false});
  check_steps_against_torchao({"AdamW4bit", {MomentFormat::dynamic4, 128}});
  check_steps_against_torchao({"Adam4bit", {MomentFormat::dynamic4, 128}, false});
  check_steps_against_torchao({"AdamWFp8", {MomentFormat::fp8, 256}});
  check_steps_against_torchao({"AdamFp8", {MomentFormat::fp8, 256}, false});
  // A large lr: the lerp's weight 1 - beta is small either way; Adam's decay term and
  // bf16 weights with stochastic rounding.
  check_steps_against_torchao({"AdamW8bit", {MomentFormat::dynamic8, 256}, true, /*bf16=*/true});
  check_steps_against_torchao({"AdamW4bit", {MomentFormat::dynamic4, 128}, true, true, 0.1});
}

}  // namespace test_quantized_moments
