#pragma once
/// What advise() is asked and what it answers: AdviseOptions; the verdicts per layer
/// (LayerAdvice), per Float8Linear (Fp8LayerAdvice) and for the model (Advice), with what Advice
/// derives from them (the PrecisionMap it proposes, the layers to keep in fp32, the check of a
/// policy: accepts, require); and the table that prints them.

#include <mixprec/core/concepts.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/policy.hpp>
#include <mixprec/fp8/recipes.hpp>
#include <mixprec/precision/precision_map.hpp>

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iomanip>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace mixprec {

/// Settings of advise().
struct AdviseOptions {
  /// loss_fn calls, each a forward and a backward pass in fp32 (no optimizer step).
  TORCH_ARG(std::int64_t, steps) = 3;
  /// A layer is fp16-safe when its largest activation times this stays within fp16's 65504
  /// (room for the weights to grow), and the loss scales offered keep its largest gradient
  /// times this within it (room for the partial sums of the gradients' reductions).
  TORCH_ARG(double, headroom) = 8.0;
  /// The fraction of a layer's nonzero activations, or gradient elements, that may fall below
  /// fp16's smallest subnormal (2^-24, scaled by the loss scale for gradients) and be lost.
  TORCH_ARG(double, underflow_tolerance) = 1e-3;
  /// The fraction of an fp8 operand's nonzero elements (a Float8Linear's input, weight or
  /// output gradient) that may round to 0 under tensorwise scaling, where its largest |x| maps
  /// to e4m3's 448 (e5m2's 57344 for gradients): below 2^-10 (2^-17) after scaling.
  TORCH_ARG(double, fp8_underflow_tolerance) = 1e-2;
  /// The share of the Float8Linear layers (the last ones, in named_modules() order) that
  /// NVFP4 keeps in bf16: NVIDIA's recipe keeps about 15% of the linear layers, most of them
  /// at the end of the network, where 4-bit weight gradients err most (arXiv 2509.25149).
  TORCH_ARG(double, nvfp4_bf16_share) = 0.15;
};

/// What the fp32 steps showed of one fp8 operand of a Float8Linear: under tensorwise scaling,
/// and as the rowwise recipes cast it (e4m3, power-of-2 scales).
struct Fp8OperandAdvice {
  double amax = 0.0;       ///< the largest |x|, which the scale maps to the format's max
  double flushed = 0.0;    ///< fraction of its nonzero elements that would round to 0
  double subnormal = 0.0;  ///< fraction that would be subnormal (fewer than 3 or 2 mantissa bits)
  /// Fractions that would round to 0 with one scale per row (along the last dimension), per
  /// column (along the others), and with one power-of-2 scale for the whole tensor.
  double flushed_rows = 0.0, flushed_columns = 0.0, flushed_power_of_2 = 0.0;
  /// Fractions that would round to 0 in the block-scaled recipes' casts along the last
  /// dimension: MXFP8 (FLOOR, blocks of 32), blockwise fp8 (1x128), NVFP4 (1x16); -1 where that
  /// dimension is no multiple of the block.
  double flushed_mxfp8 = 0.0, flushed_blockwise = 0.0, flushed_nvfp4 = 0.0;
};

/// Whether MixedFP8 can hold one mixprec::nn::Float8Linear, per recipe: no operand loses more
/// than AdviseOptions::fp8_underflow_tolerance to 0 in any of the casts the recipe makes of it.
struct Fp8LayerAdvice {
  std::string name;  ///< its named_modules() path
  Fp8OperandAdvice input, weight, grad_output;  ///< e4m3, e4m3, e5m2 (tensorwise)
  bool fp8 = true;               ///< TensorwiseScaling (DelayedScaling is judged by it too)
  std::string reason;            ///< why not, when not
  bool rowwise = true;           ///< RowwiseScaling: rows and columns of each operand
  std::string rowwise_reason;
  bool rowwise_with_gw_hp = true;  ///< RowwiseScalingWithGwHp: rows; the weight also as a whole
  std::string rowwise_with_gw_hp_reason;
  /// The block-scaled recipes: the features must be multiples of the block and no operand lose
  /// more than the tolerance in its cast along the last dimension; NVFP4 keeps its share of the
  /// last layers in bf16 (AdviseOptions::nvfp4_bf16_share) and judges the shapes only.
  bool mxfp8 = true, blockwise = true, nvfp4 = true;
  std::string mxfp8_reason, blockwise_reason, nvfp4_reason;

  /// The verdict for MixedFP8<Recipe>.
  template <class Recipe>
  bool holds() const {
    constexpr auto block = detail::block_format_of<Recipe>();
    if constexpr (block == BlockFormat::mxfp8) {
      return mxfp8;
    } else if constexpr (block == BlockFormat::blockwise_fp8) {
      return blockwise;
    } else if constexpr (block == BlockFormat::nvfp4) {
      return nvfp4;
    } else if constexpr (!Recipe::rowwise) {
      return fp8;
    } else if constexpr (Recipe::weight_grad_fp8) {
      return rowwise;
    } else {
      return rowwise_with_gw_hp;
    }
  }
};

/// What the fp32 steps showed of one layer.
struct LayerAdvice {
  std::string name;                 ///< module path ("block.fc2"), NamedScope, or op name
  std::int64_t activations = 0;     ///< output elements seen (all steps)
  double activation_max = 0.0;      ///< the largest |output|
  double activation_tiny = 0.0;     ///< fraction of nonzero outputs below 2^-24 (0 in fp16)
  std::int64_t gradients = 0;       ///< gradient elements of its parameters (all steps)
  double gradient_max = 0.0;        ///< the largest |gradient| of its parameters
  double gradient_min = 0.0;        ///< the smallest nonzero |gradient| (0: none)
  /// log2 of the loss scales at which fp16 holds its gradients: the largest without overflow,
  /// the smallest that keeps all but underflow_tolerance of them (no gradients: no bounds).
  std::optional<int> scale_log2_min, scale_log2_max;
  bool non_finite = false;          ///< the fp32 run itself produced inf/NaN here
  bool fp16 = true;                 ///< fp16 holds its activations and gradients
  bool bf16 = true;                 ///< bf16 holds its activations
  bool fp16_outputs = true;         ///< fp16 holds its activations (fp16 may still fail on gradients)
  bool module = false;              ///< a module of the model (its name a named_modules() path)
  std::string fp16_reason, bf16_reason;  ///< why not, when not
};

/// The result of advise().
struct Advice {
  std::int64_t steps = 0;           ///< the fp32 steps run
  c10::DeviceType device = c10::DeviceType::CPU;
  std::vector<LayerAdvice> layers;  ///< in the order the forward pass first used them
  bool fp32_finite = true;          ///< no inf/NaN in the fp32 run itself
  bool fp16_safe = true;            ///< every layer fits fp16, and one loss scale fits them all
  bool bf16_safe = true;            ///< every layer fits bf16
  /// The loss scales (powers of 2) at which fp16 holds every layer's gradients; both 0 if none.
  double init_scale_min = 0.0, init_scale_max = 0.0;
  /// PyTorch's 65536 moved into [init_scale_min, init_scale_max]; 0 when that is empty.
  double init_scale = 0.0;
  std::string recommended;          ///< a policy type, e.g. "MixedO2<BFloat16>"
  std::vector<std::string> reasons; ///< why that policy, and what to watch
  /// On a CPU whose fp16 convolution weight gradients are oneDNN's reference loop
  /// (CpuCapabilities::fp16_conv_weight_grad_slow): the model's convolutions that would take it.
  std::vector<std::string> slow_fp16_convolutions;
  /// On a CPU: bf16 computes slower than fp32 there (CpuCapabilities::bf16_slow, no bf16
  /// hardware that LibTorch uses); a reason then says what a bf16 recommendation costs.
  bool slow_bf16 = false;
  /// The model's mixprec::nn::Float8Linear layers (those that ran), and whether fp8 holds each.
  std::vector<Fp8LayerAdvice> fp8_layers;

  /// The PrecisionMap (for MixedFP8<Recipe>) that keeps in bf16 the Float8Linear layers fp8
  /// cannot hold under that recipe.
  template <class Recipe = TensorwiseScaling>
  PrecisionMap fp8_precision_map() const {
    PrecisionMap map;
    for (const auto& layer : fp8_layers) {
      if (!layer.template holds<Recipe>()) map.add(layer.name, Precision::low);
    }
    return map;
  }

  /// The layers to keep in fp32 to train in `low` (at::kHalf or at::kBFloat16).
  std::vector<std::string> keep_fp32(c10::ScalarType low) const {
    std::vector<std::string> result;
    for (const auto& layer : layers) {
      if (low == c10::ScalarType::Half ? !layer.fp16 : !layer.bf16) result.push_back(layer.name);
    }
    return result;
  }

  /// The PrecisionMap that keeps in fp32 the modules `low` (at::kHalf or at::kBFloat16) cannot
  /// hold. A module whose outputs `low` cannot hold keeps them in fp32 (Output::own), and the
  /// next module the forward pass used reads them in fp32 too and hands its own back in `low`
  /// (it is taken as their reader: check it for a model whose data flow branches). Op names,
  /// NamedScopes and the model's own parameters ("(model)") are not submodules and are left out.
  /// Apply it to a model whose modules it names are mixprec::nn::Mappable (apply_precision_map
  /// says which are not).
  PrecisionMap precision_map(c10::ScalarType low) const {
    PrecisionMap map;
    bool reads_fp32 = false;  // the previous module left its outputs in fp32
    for (const auto& layer : layers) {
      if (!layer.module || layer.name.empty() || layer.name.front() == '(') continue;
      const bool half = low == c10::ScalarType::Half;
      const bool holds = half ? layer.fp16 : layer.bf16;
      // bf16 fails on outputs alone (beyond its range, or inf/NaN already in fp32).
      const bool outputs_fit = half ? layer.fp16_outputs && !layer.non_finite : layer.bf16;
      if (!holds || reads_fp32) {
        map.keep_fp32(layer.name, outputs_fit ? Output::surroundings : Output::own);
      }
      reads_fp32 = !outputs_fit;
    }
    return map;
  }

  /// Whether the fp32 steps allow policy P as it is (no layer kept in fp32): its low dtype must
  /// hold every layer; for Half, a scaler must exist whose scale fits the gradients (for a
  /// policy without a dynamic scaler, scale 1).
  template <class P>
  bool accepts() const {
    return reason_against<P>().empty();
  }

  /// An Error unless accepts<P>(), saying which layers break and what to use instead.
  template <class P>
  void require() const {
    const auto why = reason_against<P>();
    MIXPREC_CHECK(why.empty(), "advise(): ", P::name, " is not safe for this model: ", why,
                  ". Recommended: ", recommended, " (", reasons.empty() ? "" : reasons.front(),
                  ")");
  }

 private:
  template <class P>
  std::string reason_against() const {
    static_assert(require_policy<P>);
    std::ostringstream why;
    if (!fp32_finite) {
      why << "the fp32 run itself produced inf/NaN";
      return why.str();
    }
    if constexpr (P::low_dtype == c10::ScalarType::Float) {
      return "";
    } else {
      constexpr bool half = P::low_dtype == c10::ScalarType::Half;
      const auto keep = keep_fp32(P::low_dtype);
      if (!keep.empty()) {
        why << "layer" << (keep.size() == 1 ? " " : "s ");
        for (std::size_t i = 0; i < keep.size(); ++i) {
          const auto& layer = *std::find_if(layers.begin(), layers.end(),
                                            [&](const LayerAdvice& l) { return l.name == keep[i]; });
          why << (i ? "; " : "") << "'" << layer.name << "' ("
              << (half ? layer.fp16_reason : layer.bf16_reason) << ")";
        }
        return why.str();
      }
      if constexpr (half) {
        if (init_scale_max == 0) {
          why << "no loss scale keeps every layer's gradients within fp16";
        } else if (std::is_same_v<typename P::scaler_type, NoScaler> &&
                   (init_scale_min > 1 || init_scale_max < 1)) {
          why << "it does not scale the loss, but fp16 holds the gradients at loss scales "
              << init_scale_min << " to " << init_scale_max << " only";
        }
      }
      return why.str();
    }
  }
};

namespace detail {

inline std::string power_of_two(int k) {
  std::ostringstream out;
  out << "2^" << k;
  return out.str();
}

inline std::string short_number(double x) {
  std::ostringstream out;
  out << std::setprecision(3) << x;
  return out.str();
}

}  // namespace detail

/// The table of layers, the verdicts and the recommendation.
inline std::ostream& operator<<(std::ostream& out, const Advice& advice) {
  std::ostringstream text;
  std::size_t width = 5;
  for (const auto& l : advice.layers) width = std::max(width, l.name.size());
  const int w = static_cast<int>(width);
  text << "mixprec::advise: " << advice.steps << " fp32 step" << (advice.steps == 1 ? "" : "s")
       << " on " << c10::DeviceTypeName(advice.device) << "\n  " << std::left << std::setw(w)
       << "layer" << std::right << std::setw(11) << "max |x|" << std::setw(10) << "x<2^-24"
       << std::setw(11) << "max |g|" << std::setw(11) << "min |g|" << std::setw(17)
       << "fp16 loss scale" << "  fp16  bf16\n";
  for (const auto& l : advice.layers) {
    std::string scales = "-";
    if (l.scale_log2_min || l.scale_log2_max) {
      scales = (l.scale_log2_min ? detail::power_of_two(*l.scale_log2_min) : std::string("any")) +
               ".." + (l.scale_log2_max ? detail::power_of_two(*l.scale_log2_max) : std::string("any"));
    }
    std::ostringstream tiny;
    tiny << std::fixed << std::setprecision(2) << 100 * l.activation_tiny << '%';
    text << "  " << std::left << std::setw(w) << l.name << std::right << std::setw(11)
         << (l.activations ? detail::short_number(l.activation_max) : "-") << std::setw(10)
         << (l.activations ? tiny.str() : "-") << std::setw(11)
         << (l.gradients ? detail::short_number(l.gradient_max) : "-") << std::setw(11)
         << (l.gradients ? detail::short_number(l.gradient_min) : "-") << std::setw(17) << scales
         << "  " << std::left << std::setw(6) << (l.fp16 ? "ok" : "fp32") << std::setw(4)
         << (l.bf16 ? "ok" : "fp32") << std::right << '\n';
  }
  for (const auto& l : advice.layers) {
    if (!l.fp16) text << "  keep " << l.name << " in fp32 under fp16: " << l.fp16_reason << '\n';
    if (!l.bf16) text << "  keep " << l.name << " in fp32 under bf16: " << l.bf16_reason << '\n';
  }
  text << "  fp16: " << (advice.fp16_safe ? "safe" : "not safe");
  if (advice.init_scale_max > 0) {
    text << "; loss scales " << advice.init_scale_min << " to " << advice.init_scale_max
         << " hold the gradients (init_scale " << advice.init_scale << ")";
  }
  text << "\n  bf16: " << (advice.bf16_safe ? "safe" : "not safe") << "\n  recommended: "
       << advice.recommended << '\n';
  for (const auto& reason : advice.reasons) text << "    - " << reason << '\n';
  if (!advice.fp8_layers.empty()) {
    // Per operand: its largest |x| / the % of nonzero elements that round to 0 / that are
    // subnormal, with the largest mapped to the format's max (tensorwise scaling).
    std::size_t fp8_width = 5;
    for (const auto& l : advice.fp8_layers) fp8_width = std::max(fp8_width, l.name.size());
    const int fw = static_cast<int>(fp8_width);
    const auto operand = [](const Fp8OperandAdvice& o) {
      std::ostringstream cell;
      cell << detail::short_number(o.amax) << " " << std::fixed << std::setprecision(2)
           << 100 * o.flushed << "% " << 100 * o.subnormal << "%";
      return cell.str();
    };
    text << "  fp8 (MixedFP8, tensorwise scaling): per operand max |x|, % of nonzero rounding to "
         << "0, % subnormal; the verdict per recipe\n  " << std::left << std::setw(fw) << "layer"
         << std::setw(24) << "  input (e4m3)" << std::setw(24) << "  weight (e4m3)"
         << std::setw(24) << "  grad_output (e5m2)"
         << "  tensorwise  rowwise  gw_hp  mxfp8  blockwise  nvfp4\n";
    const auto verdict = [](bool ok, int cells) {
      std::ostringstream cell;
      cell << std::left << std::setw(cells) << (ok ? "ok" : "bf16");
      return cell.str();
    };
    for (const auto& l : advice.fp8_layers) {
      text << "  " << std::setw(fw) << l.name << "  " << std::setw(22) << operand(l.input) << "  "
           << std::setw(22) << operand(l.weight) << "  " << std::setw(22)
           << operand(l.grad_output) << "  " << verdict(l.fp8, 12) << verdict(l.rowwise, 9)
           << verdict(l.rowwise_with_gw_hp, 7) << verdict(l.mxfp8, 7) << verdict(l.blockwise, 11)
           << (l.nvfp4 ? "ok" : "bf16") << '\n';
    }
    text << std::right;
    for (const auto& l : advice.fp8_layers) {
      if (!l.fp8) text << "  keep " << l.name << " in bf16 under MixedFP8: " << l.reason << '\n';
      if (!l.rowwise) {
        text << "  keep " << l.name << " in bf16 under MixedFP8<RowwiseScaling>: "
             << l.rowwise_reason << '\n';
      }
      if (!l.rowwise_with_gw_hp) {
        text << "  keep " << l.name << " in bf16 under MixedFP8<RowwiseScalingWithGwHp>: "
             << l.rowwise_with_gw_hp_reason << '\n';
      }
      if (!l.mxfp8) text << "  keep " << l.name << " in bf16 under MixedFP8<MXFP8Scaling>: " << l.mxfp8_reason << '\n';
      if (!l.blockwise) {
        text << "  keep " << l.name << " in bf16 under MixedFP8<BlockwiseFP8Scaling>: "
             << l.blockwise_reason << '\n';
      }
      if (!l.nvfp4) text << "  keep " << l.name << " in bf16 under MixedFP8<NVFP4Scaling>: " << l.nvfp4_reason << '\n';
    }
  }
  return out << text.str();
}

}  // namespace mixprec
