#pragma once
/// The block-scaled recipes of MixedFP8 (recipes.hpp has the per-tensor and per-row ones): each
/// operand of each of a Float8Linear's three products is cast with one scale per small block of
/// values along that product's inner (summed) dimension, which is what Blackwell (MX, NVFP4)
/// and Hopper (1x128 blocks) GPUs compute natively.
///
///   MXFP8Scaling<MxScale::floor>   OCP MX 1.0: e4m3 values, a power-of-2 (e8m0) scale per 32
///                                  (torchao's MXFP8 training, scale mode FLOOR or RCEIL)
///   BlockwiseFP8Scaling            DeepSeek-V3: e4m3, fp32 scales per 1x128 block of
///                                  activations and gradients, per 128x128 tile of the weight
///   NVFP4Scaling<>                 NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149): e2m1
///                                  values, an e4m3 scale per 16 and one fp32 scale per tensor,
///                                  16x16 weight tiles, stochastic rounding of gradients and a
///                                  random Hadamard transform on the weight gradient's inputs
///
///   mixprec::Trainer<mixprec::MixedFP8<mixprec::MXFP8Scaling<>>> trainer(model, optimizer);
///
/// A layer's in and out features must be multiples of the block (32, 128 or 16), and so must the
/// rows (tokens) of a training step's input, which the weight gradient sums over; torchao refuses
/// the same shapes (its casts assert), mixprec with an Error. docs/fp8.md has the numerics.

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mixprec {

/// Which block-scaled format a recipe casts to (none: the per-tensor and per-row recipes).
enum class BlockFormat { none, mxfp8, blockwise_fp8, nvfp4 };

/// How an MX block's power-of-2 scale follows from its largest |x| (torchao's
/// ScaleCalculationMode): `floor` is the OCP spec's, 2^(floor(log2 amax) - 8), so that the
/// largest value may saturate at 448; `rceil` is cuBLAS's and Transformer Engine's,
/// 2^ceil(log2(amax / 448)), which never saturates.
enum class MxScale { floor, rceil };

/// MXFP8 (OCP MX 1.0) as torchao 0.18's MXFP8 training computes it: every operand of every
/// product e4m3, gradients too, with one e8m0 scale per 32 consecutive values along the
/// product's inner dimension (input and weight along in_features in the forward product,
/// grad_output and weight along out_features for grad_input, grad_output and input along the
/// rows for grad_weight: six casts per layer and step). `WeightGradHp`: grad_weight in bf16
/// (torchao's wgrad_with_hp), four casts.
template <MxScale Mode = MxScale::floor, bool WeightGradHp = false>
struct MXFP8Scaling {
  static constexpr bool delayed = false;
  static constexpr int history = 0;
  static constexpr int margin = 0;
  static constexpr bool rowwise = false;
  static constexpr bool power_of_2_scales = true;
  static constexpr bool grad_output_e4m3 = true;
  static constexpr bool weight_grad_fp8 = !WeightGradHp;
  static constexpr BlockFormat block_format = BlockFormat::mxfp8;
  static constexpr std::int64_t block = 32;
  static constexpr MxScale scale_mode = Mode;
  static constexpr std::string_view policy_name =
      Mode == MxScale::floor
          ? (WeightGradHp ? "MixedFP8<MXFP8Scaling<floor, WeightGradHp>>" : "MixedFP8<MXFP8Scaling<floor>>")
          : (WeightGradHp ? "MixedFP8<MXFP8Scaling<rceil, WeightGradHp>>" : "MixedFP8<MXFP8Scaling<rceil>>");
  /// The settings a checkpoint records (trainer/policy_identity.hpp).
  static std::vector<std::pair<std::string, std::string>> identity() {
    return {{"fp8", "mxfp8"},
            {"fp8_block", "32"},
            {"fp8_scale_mode", Mode == MxScale::floor ? "floor" : "rceil"},
            {"fp8_weight_grad", WeightGradHp ? "bf16" : "fp8"}};
  }
};

/// 1x128 / 128x128 blockwise fp8 (DeepSeek-V3's recipe; torchao's blockwise_fp8_training,
/// Transformer Engine's Float8BlockScaling): e4m3 everywhere, fp32 scales fp8_max / amax (not
/// powers of 2). Activations and gradients get one scale per 128 consecutive values along the
/// product's inner dimension (1x128 blocks; for grad_weight, 128 rows of one column), the
/// weight one per 128x128 tile, cast once and read by both products that use it: five casts
/// per layer and step.
struct BlockwiseFP8Scaling {
  static constexpr bool delayed = false;
  static constexpr int history = 0;
  static constexpr int margin = 0;
  static constexpr bool rowwise = false;
  static constexpr bool power_of_2_scales = false;
  static constexpr bool grad_output_e4m3 = true;
  static constexpr bool weight_grad_fp8 = true;
  static constexpr BlockFormat block_format = BlockFormat::blockwise_fp8;
  static constexpr std::int64_t block = 128;
  static constexpr std::string_view policy_name = "MixedFP8<BlockwiseFP8Scaling>";
  static std::vector<std::pair<std::string, std::string>> identity() {
    return {{"fp8", "blockwise"}, {"fp8_block", "1x128,128x128"}};
  }
};

/// NVFP4 training (NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv 2509.25149):
/// every operand e2m1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) with an e4m3
/// scale per 16 consecutive values along the product's inner dimension and one fp32 scale per
/// tensor, amax / (448 * 6). The paper's recipe, each part a switch (all on by default):
/// `TwoDimWeights`, the weight cast with one scale per 16x16 tile, so that the forward product
/// and grad_input read the same quantized weight; `StochasticGradients`, the output gradient
/// rounded stochastically (unbiased) in both backward products, from a generator seeded by
/// TrainerOptions::rounding_seed and saved in checkpoints; `Hadamard`, both inputs of the
/// grad_weight product multiplied by one 16x16 random Hadamard matrix along the rows they sum
/// over (the product is unchanged, the blocks' outliers are spread). The activations and
/// weights round to nearest. The paper keeps about 15% of the linear layers in bf16, most of
/// them the last ones: a precision map does that (advise() says which).
template <bool TwoDimWeights = true, bool StochasticGradients = true, bool Hadamard = true>
struct NVFP4Scaling {
  static constexpr bool delayed = false;
  static constexpr int history = 0;
  static constexpr int margin = 0;
  static constexpr bool rowwise = false;
  static constexpr bool power_of_2_scales = false;
  static constexpr bool grad_output_e4m3 = false;  // e2m1: not an fp8 format at all
  static constexpr bool weight_grad_fp8 = true;    // in NVFP4
  static constexpr BlockFormat block_format = BlockFormat::nvfp4;
  static constexpr std::int64_t block = 16;
  static constexpr bool two_dim_weights = TwoDimWeights;
  static constexpr bool stochastic_gradients = StochasticGradients;
  static constexpr bool hadamard = Hadamard;
  static constexpr std::string_view policy_name = "MixedFP8<NVFP4Scaling>";
  static std::vector<std::pair<std::string, std::string>> identity() {
    return {{"fp8", "nvfp4"},
            {"fp8_block", "16"},
            {"nvfp4_weight_blocks", TwoDimWeights ? "16x16" : "1x16"},
            {"nvfp4_gradient_rounding", StochasticGradients ? "stochastic" : "nearest"},
            {"nvfp4_hadamard", Hadamard ? "16" : "none"}};
  }
};

/// The recipe of NVIDIA's paper under its own name: MixedFP8<NVFP4Scaling<>>.
using NVFP4 = NVFP4Scaling<>;

namespace detail {

/// " (MXFP8)", " (blockwise fp8)", " (NVFP4)": for messages.
inline const char* block_format_name(BlockFormat format) {
  switch (format) {
    case BlockFormat::mxfp8: return " (MXFP8)";
    case BlockFormat::blockwise_fp8: return " (blockwise fp8)";
    case BlockFormat::nvfp4: return " (NVFP4)";
    default: return "";
  }
}

/// A recipe's block format (none for the recipes of recipes.hpp, which declare none).
template <class R>
constexpr BlockFormat block_format_of() {
  if constexpr (requires { R::block_format; }) {
    return R::block_format;
  } else {
    return BlockFormat::none;
  }
}

}  // namespace detail
}  // namespace mixprec
