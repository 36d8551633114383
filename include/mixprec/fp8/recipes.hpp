#pragma once
/// FP8 training: MixedFP8<Recipe> is MixedO2<BFloat16> whose mixprec::nn::Float8Linear layers
/// compute their three matrix products in float8, each operand with its own fp32 scale:
///
///   forward      output      = input (e4m3)       @ weight^T (e4m3)
///   backward     grad_input  = grad_output (e5m2) @ weight   (e4m3)
///                grad_weight = grad_output^T (e5m2) @ input  (e4m3)
///
/// e4m3 (max 448, 3 mantissa bits) for values, e5m2 (max 57344, 2 bits) for gradients, as
/// torchao and Transformer Engine do. An operand x goes to fp8 as saturate(x * scale), with
/// scale = fp8_max / amax; the product undoes both scales in fp32 and is rounded once to the
/// output dtype (bf16), the bias added after. The rest of the model computes in bf16, with fp32
/// master weights and no loss scaler (the per-tensor scales do its job). Declare the linear
/// layers that should run in fp8 as mixprec::nn::Float8Linear (torch::nn::Linear's parameters,
/// initialization and state_dict keys; under other policies it computes as mixprec::nn::Linear):
///
///   struct Block : torch::nn::Module {
///     mixprec::nn::Float8Linear fc1{512, 2048}, fc2{2048, 512};
///     ...
///   };
///   mixprec::Trainer<mixprec::MixedFP8<>> trainer(model, optimizer);            // tensorwise
///   mixprec::Trainer<mixprec::MixedFP8<mixprec::DelayedScaling<>>> delayed(...);  // TE's recipe
///   mixprec::Trainer<mixprec::MixedFP8<mixprec::RowwiseScaling>> rowwise(...);    // per row
///
/// The rowwise recipes (RowwiseScaling, RowwiseScalingWithGwHp: torchao's "rowwise" and
/// "rowwise_with_gw_hp") scale each row of an operand on its own, with power-of-2 scales and
/// e4m3 gradients; the second computes the weight gradient in bf16. The block-scaled recipes
/// (MXFP8Scaling, BlockwiseFP8Scaling, NVFP4Scaling: block_recipes.hpp) scale each block of
/// 16, 32 or 128 values along a product's inner dimension.
///
/// A precision map keeps chosen layers out of fp8 (`.add("head", Precision::low)`: bf16), as
/// torchao's module_filter_fn does. docs/fp8.md has the formats, recipes and numerics.

#include <mixprec/core/compat.hpp>
#include <mixprec/core/policy.hpp>
#include <mixprec/fp8/block_recipes.hpp>

#include <c10/util/BFloat16.h>

#include <string_view>
#include <type_traits>

namespace mixprec {

/// Dynamic tensorwise scaling (torchao's default): each operand's scale from its own amax, at
/// each use. Nothing to keep between steps; an outlier in a tensor coarsens that tensor only.
struct TensorwiseScaling {
  static constexpr bool delayed = false;
  static constexpr int history = 0;
  static constexpr int margin = 0;
  static constexpr bool rowwise = false;            // one scale per tensor
  static constexpr bool power_of_2_scales = false;  // fp8_max / amax as it is
  static constexpr bool grad_output_e4m3 = false;   // e5m2
  static constexpr bool weight_grad_fp8 = true;
  static constexpr std::string_view policy_name = "MixedFP8<TensorwiseScaling>";
};

/// Delayed scaling (Transformer Engine's DelayedScaling, amax_compute_algo "max"): each operand
/// of each layer keeps the amaxes of its last `History` optimizer steps; a step uses the scale
/// fp8_max / max(history) / 2^Margin computed after the step before (1 until a nonzero amax was
/// seen), so values beyond the history's range saturate at fp8_max. An inf/NaN amax skips the
/// step, and the history does not take it.
template <int History = 16, int Margin = 0>
struct DelayedScaling {
  static_assert(History >= 1, "mixprec: DelayedScaling's History must be at least 1");
  static_assert(Margin >= 0 && Margin < 64, "mixprec: DelayedScaling's Margin must be in [0, 64)");
  static constexpr bool delayed = true;
  static constexpr int history = History;
  static constexpr int margin = Margin;
  static constexpr bool rowwise = false;
  static constexpr bool power_of_2_scales = false;
  static constexpr bool grad_output_e4m3 = false;
  static constexpr bool weight_grad_fp8 = true;
  static constexpr std::string_view policy_name = "MixedFP8<DelayedScaling>";
};

/// Dynamic rowwise scaling (torchao's recipe "rowwise"): every operand of every product gets
/// one scale per row along that product's inner dimension, so an outlier coarsens its own row
/// only. The scales are rounded down to powers of 2 (dividing by one is exact), and every
/// operand is e4m3, the output gradient too. The backward products cast input, weight and
/// grad_output again along their other axis (an fp8 cast along rows cannot serve columns):
/// six casts per layer and step, and the layer keeps its bf16 input and weight for backward.
struct RowwiseScaling {
  static constexpr bool delayed = false;
  static constexpr int history = 0;
  static constexpr int margin = 0;
  static constexpr bool rowwise = true;             // one scale per row of the inner dimension
  static constexpr bool power_of_2_scales = true;   // 2^floor(log2(fp8_max / amax))
  static constexpr bool grad_output_e4m3 = true;    // not e5m2
  static constexpr bool weight_grad_fp8 = true;     // false: grad_weight in bf16
  static constexpr std::string_view policy_name = "MixedFP8<RowwiseScaling>";
};

/// torchao's recipe "rowwise_with_gw_hp" (gw_hp: the weight gradient in high precision): the
/// forward product as RowwiseScaling; grad_input from grad_output rowwise and the weight with
/// one scale (both e4m3, power-of-2 scales); grad_weight = grad_output^T @ input in bf16, no
/// fp8. Each operand is cast along one axis only; torchao's most accurate fp8 recipe.
struct RowwiseScalingWithGwHp {
  static constexpr bool delayed = false;
  static constexpr int history = 0;
  static constexpr int margin = 0;
  static constexpr bool rowwise = true;
  static constexpr bool power_of_2_scales = true;
  static constexpr bool grad_output_e4m3 = true;
  static constexpr bool weight_grad_fp8 = false;
  static constexpr std::string_view policy_name = "MixedFP8<RowwiseScalingWithGwHp>";
};

namespace detail {
template <class R>
inline constexpr bool fp8_recipe_members = requires {
  typename std::bool_constant<R::delayed>;
  typename std::integral_constant<int, R::history>;
  typename std::integral_constant<int, R::margin>;
  typename std::bool_constant<R::rowwise>;
  typename std::bool_constant<R::power_of_2_scales>;
  typename std::bool_constant<R::grad_output_e4m3>;
  typename std::bool_constant<R::weight_grad_fp8>;
};
// A recipe: its settings, in a combination that Float8Linear computes. Delayed scaling's
// histories give one plain scale per tensor (e5m2 gradients); a bf16 weight gradient needs the
// bf16 input, which only the rowwise products keep for backward.
template <class R>
constexpr bool fp8_recipe() {
  if constexpr (fp8_recipe_members<R>) {
    // A block recipe scales per block, neither delayed nor per row.
    if constexpr (block_format_of<R>() != BlockFormat::none) {
      return !R::delayed && !R::rowwise;
    }
    return (!R::delayed || (!R::rowwise && !R::power_of_2_scales && !R::grad_output_e4m3)) &&
           (R::weight_grad_fp8 || R::rowwise);
  } else {
    return false;
  }
}
}  // namespace detail

/// MixedO2<BFloat16> with its Float8Linear layers in fp8 (see the top of this header).
/// Needs LibTorch >= 2.5 (has_fp8): under 1.13 naming it fails to compile.
template <class Recipe = TensorwiseScaling>
struct MixedFP8 : MixedO2<at::BFloat16> {
  static_assert(has_fp8 || detail::dependent_false<Recipe>,
                "mixprec: MixedFP8 needs LibTorch >= 2.5 (the float8 dtypes and at::_scaled_mm); "
                "this LibTorch is older: use mixprec::MixedO2<at::BFloat16>");
  static_assert(detail::fp8_recipe<Recipe>(),
                "mixprec: MixedFP8's recipe must be mixprec::TensorwiseScaling, "
                "mixprec::DelayedScaling<History, Margin>, mixprec::RowwiseScaling, "
                "mixprec::RowwiseScalingWithGwHp, mixprec::MXFP8Scaling<Mode>, "
                "mixprec::BlockwiseFP8Scaling or mixprec::NVFP4Scaling<...>");
  static constexpr std::string_view name = Recipe::policy_name;
  using recipe = Recipe;  // MixedO2<BFloat16>'s settings otherwise (its scaler: NoScaler)
};

}  // namespace mixprec
