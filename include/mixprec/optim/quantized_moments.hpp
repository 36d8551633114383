#pragma once
/// Adam's and AdamW's moments in a block format (core/state_storage.hpp's Moments8bit,
/// Moments4bit, MomentsFp8) inside the user's optimizer: its AdamParamState / AdamWParamState
/// holds exp_avg and exp_avg_sq as uint8 tensors of rows (block_quantize.hpp: one row per
/// block, its codes then its fp32 scale), or, for a tensor torchao would leave unquantized
/// (under 4096 elements, or no multiple of the block), as plain tensors: fp32, or bf16 beside a
/// bf16 weight under StochasticRounding. The step count stays the state's own. So the state is
/// per tensor, checkpoints save it as LibTorch saves any optimizer, and a data-parallel rank's
/// piece of a tensor, made of whole blocks, holds the rows of its blocks.
///
/// quantized_adam_step steps every tensor with a gradient through quantized_adam.hpp's kernel,
/// in torchao's arithmetic; recode_moments converts a loaded state between formats.

#include <mixprec/core/error.hpp>
#include <mixprec/core/state_storage.hpp>
#include <mixprec/core/tensor_set.hpp>
#include <mixprec/optim/block_quantize.hpp>
#include <mixprec/optim/fused_adam.hpp>
#include <mixprec/optim/lean_masters.hpp>
#include <mixprec/optim/quantized_adam.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Type.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

namespace mixprec::detail {

/// A format's name in messages and checkpoints: "Moments8bit<256>"; "plain".
inline std::string moment_coding_name(MomentCoding coding) {
  switch (coding.format) {
    case MomentFormat::dynamic8: return "Moments8bit<" + std::to_string(coding.block) + ">";
    case MomentFormat::dynamic4: return "Moments4bit<" + std::to_string(coding.block) + ">";
    case MomentFormat::fp8: return "MomentsFp8<" + std::to_string(coding.block) + ">";
    case MomentFormat::plain: break;
  }
  return "plain";
}

/// The format moment_coding_name names; nullopt for a name it does not write.
inline std::optional<MomentCoding> moment_coding_named(std::string_view name) {
  if (name == "plain") return MomentCoding{};
  const std::pair<std::string_view, MomentFormat> formats[] = {
      {"Moments8bit<", MomentFormat::dynamic8}, {"Moments4bit<", MomentFormat::dynamic4},
      {"MomentsFp8<", MomentFormat::fp8}};
  for (const auto& [prefix, format] : formats) {
    if (name.substr(0, prefix.size()) != prefix || name.back() != '>') continue;
    const auto digits = name.substr(prefix.size(), name.size() - prefix.size() - 1);
    std::int64_t block = 0;
    for (const char c : digits) {
      if (c < '0' || c > '9' || block > kMaxMomentBlock) return std::nullopt;
      block = block * 10 + (c - '0');
    }
    if (digits.empty() || block < 1 || block > kMaxMomentBlock) return std::nullopt;
    if (format == MomentFormat::dynamic4 && block % 2 != 0) return std::nullopt;
    return MomentCoding{format, block};
  }
  return std::nullopt;
}

/// An Error unless `optimizer` can keep its moments in `coding`'s format: exactly
/// torch::optim::Adam or AdamW, without AMSGrad in any param group.
inline void check_quantizable_optimizer(const torch::optim::Optimizer& optimizer,
                                        std::string_view policy, MomentCoding coding) {
  const auto kind = adam_kind(optimizer);
  MIXPREC_CHECK(kind.has_value(), "Trainer<", policy, "> keeps Adam's moments in ",
                moment_coding_name(coding), " (torchao's low-bit optimizer states), which only "
                "torch::optim::Adam and AdamW keep (exactly those: a subclass could override "
                "step()); this optimizer is ", c10::demangle(typeid(optimizer).name()),
                ": use Adam or AdamW, or a storage with plain moments (e.g. "
                "StochasticRounding<> or RemainderMasters<at::BFloat16>)");
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    const auto& options = optimizer.param_groups()[g].options();
    const bool amsgrad = *kind == AdamKind::adam
                             ? static_cast<const torch::optim::AdamOptions&>(options).amsgrad()
                             : static_cast<const torch::optim::AdamWOptions&>(options).amsgrad();
    MIXPREC_CHECK(!amsgrad, "Trainer<", policy, "> keeps Adam's moments in ",
                  moment_coding_name(coding), ", where AMSGrad's max_exp_avg_sq has no format "
                  "(torchao's quantized states cannot take torch.maximum either); param group ",
                  g, " has amsgrad(true): turn it off, or use a storage with plain moments");
  }
}

/// The moment of a fresh state for a tensor `like` (or a rank's piece of one): zero rows of
/// `coding` where `rows` (the whole tensor is quantized), else zeros of `plain`.
inline at::Tensor fresh_moment(const at::Tensor& like, bool rows, MomentCoding coding,
                               c10::ScalarType plain) {
  if (rows) {
    return at::zeros({like.numel() / coding.block, row_bytes(coding.format, coding.block)},
                     like.options().dtype(at::kByte));
  }
  return at::zeros(like.sizes(), like.options().dtype(plain));
}

/// A moment's values in fp32, shaped like `like`: decoded from rows of `coding`, or a plain
/// tensor converted.
inline at::Tensor moment_values(const at::Tensor& moment, MomentCoding coding, bool is_signed,
                                const at::Tensor& like) {
  if (moment.scalar_type() != at::kByte) return moment.to(at::kFloat);
  MIXPREC_CHECK(coding.quantized(), "a moment of a tensor of shape ", like.sizes(), " is held "
                "as rows of bytes, but no block format is recorded for it (a checkpoint from "
                "another program?)");
  MIXPREC_CHECK(moment.dim() == 2 && moment.size(0) * coding.block == like.numel(),
                "a moment in ", moment_coding_name(coding), " of ", moment.sizes(), " does not fit "
                "a tensor of shape ", like.sizes(), " (was it saved for another model?)");
  return dequantize_blocks(moment, coding, is_signed).view(like.sizes()).to(like.device());
}

/// `values` (fp32) kept as `coding` keeps a tensor of `whole` elements: rows where it is
/// quantized, else plain fp32.
inline at::Tensor moment_coded(const at::Tensor& values, MomentCoding coding, bool is_signed,
                               std::int64_t whole) {
  if (coding.quantized() && quantizes(whole, coding.block)) {
    return quantize_blocks(values, coding, is_signed).to(values.device());
  }
  return values.to(at::kFloat);
}

/// Every Adam/AdamW moment of `optimizer` kept in `from` (a checkpoint's format) converted to
/// `to` (plain: fp32; bf16 is made by narrow_moments after). Does nothing where the two are the
/// same: the rows load as they were saved, bit for bit.
inline void recode_moments(torch::optim::Optimizer& optimizer, MomentCoding from, MomentCoding to) {
  if (from == to) return;
  at::NoGradGuard no_grad;
  auto& states = optimizer.state();
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = states.find(state_key<std::decay_t<decltype(states)>>(p));
      if (it == states.end()) continue;
      const auto convert = [&](const at::Tensor& m, bool is_signed) {
        if (!m.defined()) return m;
        return moment_coded(moment_values(m, from, is_signed, p), to, is_signed, p.numel());
      };
      if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
        s->exp_avg(convert(s->exp_avg(), true));
        s->exp_avg_sq(convert(s->exp_avg_sq(), false));
      } else if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
        w->exp_avg(convert(w->exp_avg(), true));
        w->exp_avg_sq(convert(w->exp_avg_sq(), false));
      }
    }
  }
}

/// Whether an optimizer state tensor is Adam's moment in a block format: uint8 rows, one per
/// block, as above), not a tensor shaped as its parameter.
inline bool is_moment_rows(const at::Tensor& field) {
  return field.scalar_type() == at::kByte && field.dim() == 2;
}

/// Where a piece's rows sit in its whole tensor's: the checkpoint tensor of a moment in a block
/// format is the rows of the whole tensor ([whole / block, row bytes], uint8), and a rank's
/// piece of `count` elements from element `from` (whole blocks: the layout rounds them) is a
/// range of its bytes.
struct RowsPiece {
  std::vector<std::int64_t> shape;
  std::int64_t from = 0;
  std::int64_t count = 0;
};
inline RowsPiece moment_rows_piece(const at::Tensor& rows, std::int64_t whole, std::int64_t from,
                                   std::int64_t count, const std::string& name) {
  const auto block = rows.size(0) > 0 ? count / rows.size(0) : 0;
  MIXPREC_CHECK(block > 0 && rows.size(0) * block == count && from % block == 0 &&
                    whole % block == 0,
                "cannot save '", name, "': its rows ", rows.sizes(), " are no whole blocks of "
                "the piece of ", count, " elements from ", from, " of a tensor of ", whole,
                " (was the state loaded for another layout?)");
  const auto width = rows.size(1);
  return {{whole / block, width}, from / block * width, rows.numel()};
}

/// What the quantized step updates in place of one optimizer tensor.
struct QuantizedTarget {
  std::optional<LeanTarget> lean;  ///< a lean master's bf16 weight and what is kept of it
  std::int64_t whole = 0;          ///< the elements of its whole tensor (0: the tensor's own)
};
using QuantizedTargets = std::function<QuantizedTarget(const at::Tensor&)>;

namespace quantized_step {

inline void check_moment(const at::Tensor& m, const at::Tensor& shape, bool rows,
                         MomentCoding coding, c10::ScalarType plain, const char* name) {
  const bool fits =
      m.defined() && m.device() == shape.device() && m.is_contiguous() &&
      (rows ? (m.scalar_type() == at::kByte && m.dim() == 2 &&
               m.size(0) * coding.block == shape.numel() &&
               m.size(1) == row_bytes(coding.format, coding.block))
            : (m.scalar_type() == plain && m.sizes() == shape.sizes()));
  MIXPREC_CHECK(fits, "the quantized Adam step: the optimizer state '", name, "' of a tensor of "
                "shape ", shape.sizes(), " is ", m.defined() ? m.toString() : std::string("undefined"),
                m.defined() ? " of shape " : "", m.defined() ? m.sizes() : at::IntArrayRef{},
                "; it needs ", rows ? "rows of " + moment_coding_name(coding) : std::string(c10::toString(plain)),
                " for it, contiguous (was the state loaded for another model or storage?)");
}

template <AdamKind Kind>
void step(torch::optim::Optimizer& optimizer, const QuantizedTargets& targets, float inv_scale,
          MomentCoding coding, bool bf16_plain) {
  using Options = typename AdamTypes<Kind>::Options;
  using State = typename AdamTypes<Kind>::State;
  struct Work {
    at::Tensor param, grad, weight;  // weight: the fp32 tensor, or the lean master's bf16 one
    std::optional<LeanTarget> lean;
    State* state;
    AdamHyper h;
    bool rows;
    c10::ScalarType plain;
  };
  std::vector<Work> work;
  auto& states = optimizer.state();
  // Every check before anything changes.
  const auto repeated = first_repeated(optimizer_tensors(optimizer));
  MIXPREC_CHECK(!repeated.defined(), "the quantized Adam step: a tensor of shape ",
                repeated.sizes(), " is listed twice in the optimizer: list each tensor once");
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    auto& group = optimizer.param_groups()[g];
    const auto h = adam_hyper<Options>(group.options());
    MIXPREC_CHECK(!h.amsgrad, "the quantized Adam step: param group ", g, " has amsgrad(true), "
                  "whose max_exp_avg_sq ", moment_coding_name(coding), " cannot keep: turn it "
                  "off, or use a storage with plain moments");
    for (auto& p : group.params()) {
      const auto& grad = p.grad();
      if (!grad.defined()) continue;
      const auto target = targets(p);
      Work w{p, grad, target.lean ? target.lean->model : p, target.lean, nullptr, h, false,
             at::kFloat};
      const auto& weight = w.weight;
      MIXPREC_CHECK(weight.device().is_cpu(), "the quantized Adam step runs on the CPU; a "
                    "parameter is on ", weight.device());
      MIXPREC_CHECK(!grad.is_sparse() && grad.sizes() == weight.sizes() &&
                        (grad.scalar_type() == at::kFloat ||
                         (w.lean && grad.scalar_type() == at::kBFloat16)),
                    "the quantized Adam step: the gradient of a parameter of shape ",
                    weight.sizes(), " is ", grad.scalar_type(), " of shape ", grad.sizes());
      MIXPREC_CHECK(w.lean || p.scalar_type() == at::kFloat, "the quantized Adam step: a "
                    "parameter of shape ", p.sizes(), " is ", p.scalar_type(), ", neither fp32 "
                    "nor a lean master");
      MIXPREC_CHECK(weight.is_contiguous(), "the quantized Adam step reads parameters as flat "
                    "arrays: a parameter of shape ", weight.sizes(), " has strides ",
                    weight.strides(), "; make it contiguous");
      const auto whole = target.whole > 0 ? target.whole : weight.numel();
      w.rows = quantizes(whole, coding.block);
      MIXPREC_CHECK(!w.rows || weight.numel() % coding.block == 0, "the quantized Adam step: a "
                    "piece of ", weight.numel(), " elements of a tensor of ", whole, " is no "
                    "whole number of blocks of ", coding.block, " (its layout must be rounded "
                    "to blocks)");
      w.plain = w.lean && bf16_plain ? at::kBFloat16 : at::kFloat;
      const auto it = states.find(state_key<decltype(states)>(p));
      if (it != states.end()) {
        auto* state = dynamic_cast<State*>(it->second.get());
        MIXPREC_CHECK(state != nullptr, "the quantized Adam step: the optimizer holds a state of "
                      "another optimizer type for a tensor of shape ", weight.sizes());
        check_moment(state->exp_avg(), weight, w.rows, coding, w.plain, "exp_avg");
        check_moment(state->exp_avg_sq(), weight, w.rows, coding, w.plain, "exp_avg_sq");
        w.state = state;
      }
      work.push_back(std::move(w));
    }
  }
  at::NoGradGuard no_grad;
  // The constants of each (param group's hyperparameters, step): ATen's pow and sqrt, once.
  std::map<std::tuple<double, double, double, double, double, std::int64_t>, TorchaoAdamStep> steps;
  for (auto& w : work) {
    if (w.state == nullptr) {  // as Adam::step creates it, in the storage's format
      auto state = std::make_unique<State>();
      state->step(0);
      state->exp_avg(fresh_moment(w.weight, w.rows, coding, w.plain));
      state->exp_avg_sq(fresh_moment(w.weight, w.rows, coding, w.plain));
      w.state = state.get();
      states[state_key<decltype(states)>(w.param)] = std::move(state);
    }
    w.state->step(w.state->step() + 1);
    const auto key = std::make_tuple(w.h.lr, w.h.beta1, w.h.beta2, w.h.eps, w.h.weight_decay,
                                     w.state->step());
    auto found = steps.find(key);
    if (found == steps.end()) {
      found = steps.emplace(key, TorchaoAdamStep::make(w.h.lr, w.h.beta1, w.h.beta2, w.h.eps,
                                                       w.h.weight_decay, w.state->step(),
                                                       Kind == AdamKind::adamw)).first;
    }
    auto s = found->second;
    s.inv_scale = inv_scale;
    const auto grad = w.grad.contiguous();
    QuantizedAdamTensors t;
    t.numel = w.weight.numel();
    t.grad = grad.data_ptr();
    t.grad_bf16 = grad.scalar_type() == at::kBFloat16;
    t.exp_avg = w.state->exp_avg().data_ptr();
    t.exp_avg_sq = w.state->exp_avg_sq().data_ptr();
    t.moments = w.rows ? coding : MomentCoding{};
    t.moments_bf16 = !w.rows && w.plain == at::kBFloat16;
    if (!w.lean) {
      t.fp32 = static_cast<float*>(w.param.data_ptr());
      quantized_adam_update(t, s, {});
      continue;
    }
    auto& kept = w.lean->kept;
    t.bf16 = static_cast<std::uint16_t*>(w.weight.data_ptr());
    t.key = kept.key;
    t.first = kept.first;
    if (kept.remainder.defined()) {
      t.remainder = static_cast<std::int16_t*>(kept.remainder.data_ptr());
      *kept.down_ties = quantized_adam_update(t, s, *kept.down_ties);
    } else {
      quantized_adam_update(t, s, {});
    }
  }
}

}  // namespace quantized_step

/// One Adam or AdamW step of `optimizer` (exactly torch::optim::Adam or AdamW) whose moments
/// are kept in `coding` (quantized where torchao quantizes; plain fp32 elsewhere, bf16 beside a
/// lean bf16 weight where `bf16_plain`), over `targets`, gradients divided by `grad_scale` (one
/// fp32 value; undefined: by 1). Everything is checked before anything changes.
inline void quantized_adam_step(torch::optim::Optimizer& optimizer, const QuantizedTargets& targets,
                                const at::Tensor& grad_scale, MomentCoding coding,
                                bool bf16_plain) {
  const auto kind = adam_kind(optimizer);
  MIXPREC_CHECK(kind.has_value(), "the quantized Adam step is Adam's or AdamW's: the optimizer "
                "must be exactly torch::optim::Adam or AdamW, got ",
                c10::demangle(typeid(optimizer).name()));
  MIXPREC_CHECK(coding.quantized(), "the quantized Adam step needs a block format");
  const float inv_scale =
      grad_scale.defined() ? static_cast<float>(1.0 / grad_scale.to(at::kCPU).item<double>()) : 1.0F;
  if (*kind == AdamKind::adam) {
    quantized_step::step<AdamKind::adam>(optimizer, targets, inv_scale, coding, bf16_plain);
  } else {
    quantized_step::step<AdamKind::adamw>(optimizer, targets, inv_scale, coding, bf16_plain);
  }
}

}  // namespace mixprec::detail
