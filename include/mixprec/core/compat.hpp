#pragma once
/// Every difference between the LibTorch versions mixprec supports (1.13 to 2.x) lives here, with
/// the capability flags that follow from them; no other header tests the version.

#include <ATen/ATen.h>
#include <ATen/Version.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/version.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

/// True when the LibTorch in use is at least major.minor.
#define MIXPREC_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||          \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if MIXPREC_TORCH_AT_LEAST(2, 5)
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#endif

/// The c10d class that ProcessGroupGloo and ProcessGroupNCCL derive from (mixprec::ProcessGroup,
/// declared by distributed.hpp, which includes c10d): c10d::Backend in LibTorch 2.x,
/// c10d::ProcessGroup in 1.13.
#if TORCH_VERSION_MAJOR >= 2
#define MIXPREC_C10D_PROCESS_GROUP c10d::Backend
#else
#define MIXPREC_C10D_PROCESS_GROUP c10d::ProcessGroup
#endif

namespace mixprec {

/// The LibTorch version mixprec is built against, e.g. "2.13.0".
inline constexpr std::string_view torch_version = TORCH_VERSION;

/// True where the CPU kernels of this LibTorch compute fp16 (matmul, conv, softmax, Adam):
/// LibTorch >= 2.4. In 1.13 they only store it, CPU autocast accepts bf16 only, and the Half
/// policies refuse CPU models. 2.4 is where the device-typed autocast API and CPU fp16 autocast
/// meet; the Half policies need both.
inline constexpr bool cpu_half_math = MIXPREC_TORCH_AT_LEAST(2, 4);

/// True where ATen has the fused Adam/AdamW kernels on the CPU (LibTorch >= 2.4).
inline constexpr bool fused_adam_available = MIXPREC_TORCH_AT_LEAST(2, 4);

/// True where LayerNorm and GroupNorm take bf16/fp16 input with fp32 weights (LibTorch 2.x;
/// 1.13's CPU kernels refuse mixed dtypes): a precision map can keep them fp32 inside a Low model.
inline constexpr bool mixed_dtype_norms = TORCH_VERSION_MAJOR >= 2;

/// True where the Gloo backend reduces bf16 tensors (LibTorch 2.x; 1.13's cannot).
inline constexpr bool gloo_reduces_bf16 = TORCH_VERSION_MAJOR >= 2;
/// True where the Gloo backend has a reduce-scatter into a flat slice (`_reduce_scatter_base`,
/// LibTorch 2.x; built on its allreduce, so it saves memory, not bandwidth). 1.13's has none:
/// sharded gradients are allreduced there and each rank keeps its slice of the sum.
inline constexpr bool gloo_reduce_scatters = TORCH_VERSION_MAJOR >= 2;
/// True where LibTorch has the float8 dtypes (e4m3fn, e5m2) and an at::_scaled_mm that returns
/// one tensor (LibTorch >= 2.5): what MixedFP8 (fp8.hpp) needs.
inline constexpr bool has_fp8 = MIXPREC_TORCH_AT_LEAST(2, 5);
/// True where autograd runs a hook after a leaf's gradient is accumulated (LibTorch >= 2.1,
/// Python's register_post_accumulate_grad_hook): what TrainerOptions::step_in_backward needs.
inline constexpr bool post_accumulate_grad_hooks = MIXPREC_TORCH_AT_LEAST(2, 1);

namespace detail {

// The optimizer state key of a tensor: its TensorImpl address printed as a string in LibTorch
// 1.x (as c10::guts::to_string printed it), the address itself in 2.x. `Map` is the type of
// Optimizer::state().
template <class Map>
auto state_key(const at::Tensor& p) {
  using Key = typename std::decay_t<Map>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;
    key << p.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

// Autocast's switches: LibTorch 2.4 replaced the per-device functions by ones taking the device
// type (CPU and CUDA only here; autocast.hpp checks).
struct AutocastState {
  bool enabled;
  c10::ScalarType dtype;
};

inline AutocastState get_autocast_state(c10::DeviceType device) {
#if MIXPREC_TORCH_AT_LEAST(2, 4)
  return {at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
#else
  if (device == c10::DeviceType::CPU) {
    return {at::autocast::is_cpu_enabled(), at::autocast::get_autocast_cpu_dtype()};
  }
  return {at::autocast::is_enabled(), at::autocast::get_autocast_gpu_dtype()};
#endif
}

inline void set_autocast_state(c10::DeviceType device, AutocastState state) {
#if MIXPREC_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device, state.dtype);
  at::autocast::set_autocast_enabled(device, state.enabled);
#else
  if (device == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(state.dtype);
    at::autocast::set_cpu_enabled(state.enabled);
  } else {
    at::autocast::set_autocast_gpu_dtype(state.dtype);
    at::autocast::set_enabled(state.enabled);
  }
#endif
}

/// The CPU capability ATen's kernels dispatch to: "DEFAULT", "AVX2", "AVX512" on x86-64 (the
/// ATEN_CPU_CAPABILITY environment variable lowers it); empty where LibTorch cannot say (< 2.4,
/// which has no fused Adam kernel to agree with).
inline std::string aten_cpu_capability() {
#if MIXPREC_TORCH_AT_LEAST(2, 4)
  return at::get_cpu_capability();
#else
  return {};
#endif
}

// The sizes an autograd node recorded for one of its inputs (the shape of what its op made), or
// none: LibTorch 1.13 keeps them private, and a nested tensor's are a tensor. (A template, so
// that this header needs no autograd header.)
template <class InputMetadata>
std::optional<c10::SymIntArrayRef> recorded_sizes(const InputMetadata& metadata) {
#if TORCH_VERSION_MAJOR >= 2
  if (metadata.is_nested_tensor()) return std::nullopt;
  return metadata.shape_as_dim_vector();
#else
  (void)metadata;
  return std::nullopt;
#endif
}

// ATen's fused Adam (adamw = false) or AdamW kernel over one batch of same-device tensors; a
// no-op where fused_adam_available is false (callers check it first).
struct FusedAdamBatch {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
};

inline void fused_adam_kernel(bool adamw, FusedAdamBatch& b, double lr, double beta1, double beta2,
                              double weight_decay, double eps, bool amsgrad,
                              const std::optional<at::Tensor>& grad_scale) {
#if MIXPREC_TORCH_AT_LEAST(2, 4)
  if (adamw) {
    at::_fused_adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps,
                      lr, beta1, beta2, weight_decay, eps, amsgrad, /*maximize=*/false,
                      grad_scale, std::nullopt);
  } else {
    at::_fused_adam_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps,
                     lr, beta1, beta2, weight_decay, eps, amsgrad, /*maximize=*/false,
                     grad_scale, std::nullopt);
  }
#else
  (void)adamw, (void)b, (void)lr, (void)beta1, (void)beta2, (void)weight_decay, (void)eps,
      (void)amsgrad, (void)grad_scale;
#endif
}

// The float8 dtypes, and at::_scaled_mm: `a @ b * scale_a * scale_b` (a row-major, b
// column-major, the scales fp32 scalars, or [M, 1] and [1, N] for rowwise scaling) in
// out_dtype, with fast accumulation if asked. Undefined dtypes and an Error where has_fp8 is
// false (MixedFP8 does not compile there, so nothing reaches them).
#if MIXPREC_TORCH_AT_LEAST(2, 5)
inline constexpr c10::ScalarType float8_e4m3 = c10::ScalarType::Float8_e4m3fn;
inline constexpr c10::ScalarType float8_e5m2 = c10::ScalarType::Float8_e5m2;
inline at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                            const at::Tensor& scale_b, c10::ScalarType out_dtype,
                            bool use_fast_accum = false) {
  return at::_scaled_mm(a, b, scale_a, scale_b, std::nullopt, std::nullopt, out_dtype,
                        use_fast_accum);
}
// The value of an fp8 code of `dtype` (e4m3fn or e5m2), exact in fp32.
inline float float8_value(c10::ScalarType dtype, std::uint8_t code) {
  return dtype == float8_e4m3
             ? static_cast<float>(c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits()))
             : static_cast<float>(c10::Float8_e5m2(code, c10::Float8_e5m2::from_bits()));
}
#else
inline constexpr c10::ScalarType float8_e4m3 = c10::ScalarType::Undefined;
inline constexpr c10::ScalarType float8_e5m2 = c10::ScalarType::Undefined;
inline at::Tensor scaled_mm(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, c10::ScalarType, bool = false) {
  TORCH_CHECK(false, "mixprec: fp8 matrix products need LibTorch >= 2.5");
}
inline float float8_value(c10::ScalarType, std::uint8_t) {
  TORCH_CHECK(false, "mixprec: fp8 needs LibTorch >= 2.5");
}
#endif

// The block-scaled product (at::_scaled_mm_v2: a list of decoding scales per operand, each with
// its ScalingType and swizzle as ints, ATen/BlasBackend.h's enums) and the dtypes of its scales
// and fp4 operands, where this LibTorch has them (2.9 and later); Undefined dtypes and an
// Error elsewhere (the callers ask has_block_scaled_mm first).
#if __has_include(<ATen/ops/_scaled_mm_v2.h>)
inline constexpr bool has_block_scaled_mm = true;
inline constexpr c10::ScalarType float8_e8m0 = c10::ScalarType::Float8_e8m0fnu;
inline constexpr c10::ScalarType float4_e2m1x2 = c10::ScalarType::Float4_e2m1fn_x2;
inline at::Tensor block_scaled_mm(const at::Tensor& a, const at::Tensor& b,
                                  const std::vector<at::Tensor>& scale_a,
                                  const std::vector<std::int64_t>& recipe_a,
                                  const std::vector<std::int64_t>& swizzle_a,
                                  const std::vector<at::Tensor>& scale_b,
                                  const std::vector<std::int64_t>& recipe_b,
                                  const std::vector<std::int64_t>& swizzle_b,
                                  c10::ScalarType out_dtype) {
  return at::_scaled_mm_v2(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b,
                           std::nullopt, out_dtype);
}
#else
inline constexpr bool has_block_scaled_mm = false;
inline constexpr c10::ScalarType float8_e8m0 = c10::ScalarType::Undefined;
inline constexpr c10::ScalarType float4_e2m1x2 = c10::ScalarType::Undefined;
inline at::Tensor block_scaled_mm(const at::Tensor&, const at::Tensor&,
                                  const std::vector<at::Tensor>&, const std::vector<std::int64_t>&,
                                  const std::vector<std::int64_t>&, const std::vector<at::Tensor>&,
                                  const std::vector<std::int64_t>&, const std::vector<std::int64_t>&,
                                  c10::ScalarType) {
  TORCH_CHECK(false, "mixprec: block-scaled matrix products need LibTorch >= 2.9");
}
#endif

// A dtype as Python's files name it: torch's name ("float32", as in torch.float32, which
// torch.save's _rebuild_tensor_v3 pickles), safetensors' ("F32"; empty where it has none), the
// legacy storage class torch.save pickles for it ("FloatStorage"; empty for the dtypes it saves as
// untyped bytes), LibTorch's ScalarType (Undefined where this LibTorch lacks it) and the LibTorch
// version that has it.
struct FileDtype {
  std::string_view torch, safetensors, storage;
  c10::ScalarType type;
  std::string_view since;
};

inline const std::vector<FileDtype>& file_dtypes() {
  using c10::ScalarType;
  [[maybe_unused]] constexpr auto none = ScalarType::Undefined;
  static const std::vector<FileDtype> dtypes{
      {"float64", "F64", "DoubleStorage", ScalarType::Double, "1.13"},
      {"float32", "F32", "FloatStorage", ScalarType::Float, "1.13"},
      {"float16", "F16", "HalfStorage", ScalarType::Half, "1.13"},
      {"bfloat16", "BF16", "BFloat16Storage", ScalarType::BFloat16, "1.13"},
      {"int64", "I64", "LongStorage", ScalarType::Long, "1.13"},
      {"int32", "I32", "IntStorage", ScalarType::Int, "1.13"},
      {"int16", "I16", "ShortStorage", ScalarType::Short, "1.13"},
      {"int8", "I8", "CharStorage", ScalarType::Char, "1.13"},
      {"uint8", "U8", "ByteStorage", ScalarType::Byte, "1.13"},
      {"bool", "BOOL", "BoolStorage", ScalarType::Bool, "1.13"},
      {"complex64", "C64", "ComplexFloatStorage", ScalarType::ComplexFloat, "1.13"},
      {"complex128", "", "ComplexDoubleStorage", ScalarType::ComplexDouble, "1.13"},
#if MIXPREC_TORCH_AT_LEAST(2, 1)
      {"float8_e4m3fn", "F8_E4M3", "", ScalarType::Float8_e4m3fn, "2.1"},
      {"float8_e5m2", "F8_E5M2", "", ScalarType::Float8_e5m2, "2.1"},
#else
      {"float8_e4m3fn", "F8_E4M3", "", none, "2.1"},
      {"float8_e5m2", "F8_E5M2", "", none, "2.1"},
#endif
#if MIXPREC_TORCH_AT_LEAST(2, 2)
      {"float8_e4m3fnuz", "F8_E4M3FNUZ", "", ScalarType::Float8_e4m3fnuz, "2.2"},
      {"float8_e5m2fnuz", "F8_E5M2FNUZ", "", ScalarType::Float8_e5m2fnuz, "2.2"},
#else
      {"float8_e4m3fnuz", "F8_E4M3FNUZ", "", none, "2.2"},
      {"float8_e5m2fnuz", "F8_E5M2FNUZ", "", none, "2.2"},
#endif
#if MIXPREC_TORCH_AT_LEAST(2, 7)
      {"float8_e8m0fnu", "F8_E8M0", "", ScalarType::Float8_e8m0fnu, "2.7"},
#else
      {"float8_e8m0fnu", "F8_E8M0", "", none, "2.7"},
#endif
#if MIXPREC_TORCH_AT_LEAST(2, 8)
      // Two fp4 values a byte: safetensors' shape counts values (its last size doubled).
      {"float4_e2m1fn_x2", "F4", "", ScalarType::Float4_e2m1fn_x2, "2.8"},
#else
      {"float4_e2m1fn_x2", "F4", "", none, "2.8"},
#endif
#if MIXPREC_TORCH_AT_LEAST(2, 3)
      {"uint16", "U16", "", ScalarType::UInt16, "2.3"},
      {"uint32", "U32", "", ScalarType::UInt32, "2.3"},
      {"uint64", "U64", "", ScalarType::UInt64, "2.3"},
#else
      {"uint16", "U16", "", none, "2.3"},
      {"uint32", "U32", "", none, "2.3"},
      {"uint64", "U64", "", none, "2.3"},
#endif
  };
  return dtypes;
}

}  // namespace detail
}  // namespace mixprec
