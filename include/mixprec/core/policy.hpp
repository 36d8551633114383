#pragma once
/// The four precision policies; pick one as the template argument of mixprec::Trainer.
///
/// | policy            | Apex | params | compute              | fp32 masters | default scaler           |
/// |-------------------|------|--------|----------------------|--------------|--------------------------|
/// | FullPrecision     | O0   | fp32   | fp32                 | no           | NoScaler                 |
/// | MixedO1<Low>      | O1   | fp32   | per op (autocast)    | no           | GradScaler (Half), else none |
/// | MixedO2<Low>      | O2   | Low    | Low, BatchNorm fp32  | yes          | GradScaler (Half), else none |
/// | PureHalf<Low>     | O3   | Low    | Low                  | no           | NoScaler                 |
///
/// When to use which:
/// - FullPrecision: the reference; debugging numerics; the default.
/// - MixedO1: the safe first step, as torch.autocast does in Python; the model stays fp32.
/// - MixedO2: halves parameter and activation memory; fp32 masters keep small updates from vanishing.
/// - PureHalf: the cheapest and least safe; for measuring the speed ceiling, or bf16 fine-tuning.
/// `Low` is at::Half (default; needs loss scaling) or at::BFloat16 (fp32's range; no scaling).
/// MixedO2 and PureHalf take a second argument, how the training state is kept between steps
/// (state_storage.hpp): RemainderMasters<> halves MixedO2<BFloat16>'s masters without changing
/// a bit of its training; StochasticRounding<> lets PureHalf<BFloat16> train without them.
/// A custom policy derives from one of these and overrides members; it must keep PrecisionPolicy.

#include <mixprec/core/concepts.hpp>
#include <mixprec/core/state_storage.hpp>

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <string_view>
#include <type_traits>

namespace mixprec {

class GradScaler;
class StaticScaler;
class NoScaler;

namespace detail {

template <class>
inline constexpr bool dependent_false = false;

template <class Low>
struct LowPrecision {
  static_assert(dependent_false<Low>,
                "mixprec: the low-precision type of a policy must be at::Half or at::BFloat16, "
                "e.g. mixprec::MixedO2<at::BFloat16>; for fp32 use mixprec::FullPrecision");
};

template <>
struct LowPrecision<at::Half> {
  static constexpr c10::ScalarType dtype = c10::ScalarType::Half;
  static constexpr std::string_view o1 = "MixedO1<Half>";
  static constexpr std::string_view o2 = "MixedO2<Half>";
  static constexpr std::string_view o3 = "PureHalf<Half>";
  static constexpr std::string_view low_name = "Half";
  using dynamic_scaler = GradScaler;  // fp16's range is too narrow for unscaled gradients
};

template <>
struct LowPrecision<at::BFloat16> {
  static constexpr c10::ScalarType dtype = c10::ScalarType::BFloat16;
  static constexpr std::string_view o1 = "MixedO1<BFloat16>";
  static constexpr std::string_view o2 = "MixedO2<BFloat16>";
  static constexpr std::string_view o3 = "PureHalf<BFloat16>";
  static constexpr std::string_view low_name = "BFloat16";
  using dynamic_scaler = NoScaler;  // bf16 has fp32's exponent range
};

/// A policy whose mixprec::nn::Float8Linear layers compute in fp8 (MixedFP8, fp8.hpp).
template <class P>
inline constexpr bool fp8_policy = requires { typename P::recipe; };

struct PolicyNames {
  static constexpr std::string_view o2 = "MixedO2<";
  static constexpr std::string_view o3 = "PureHalf<";
  static constexpr std::string_view comma = ", ";
  static constexpr std::string_view close = ">";
};

/// "MixedO2<BFloat16>" for the default storage, else "MixedO2<BFloat16, RemainderMasters>".
template <class Low, class Storage, class Default, const std::string_view& Family,
          const std::string_view& Plain>
inline constexpr std::string_view storage_policy_name =
    std::is_same_v<Storage, Default>
        ? Plain
        : JoinedName<Family, LowPrecision<Low>::low_name, PolicyNames::comma, Storage::name,
                     PolicyNames::close>::value;

/// Members shared by the three low-precision families.
template <class Low>
struct LowPrecisionPolicy {
  using low_type = Low;
  static constexpr c10::ScalarType low_dtype = LowPrecision<Low>::dtype;
};

}  // namespace detail

/// O0: everything in fp32. The reference and the default.
struct FullPrecision {
  using low_type = float;
  static constexpr std::string_view name = "FullPrecision";
  static constexpr c10::ScalarType low_dtype = c10::ScalarType::Float;
  static constexpr bool autocast = false;
  static constexpr bool cast_model = false;
  static constexpr bool master_weights = false;
  static constexpr bool keep_batch_norm_fp32 = true;
  using scaler_type = NoScaler;
};

/// O1: fp32 parameters; LibTorch autocast picks each op's precision during the forward pass.
template <class Low = at::Half>
struct MixedO1 : detail::LowPrecisionPolicy<Low> {
  static constexpr std::string_view name = detail::LowPrecision<Low>::o1;
  static constexpr bool autocast = true;
  static constexpr bool cast_model = false;
  static constexpr bool master_weights = false;
  static constexpr bool keep_batch_norm_fp32 = true;
  using scaler_type = typename detail::LowPrecision<Low>::dynamic_scaler;
};

/// O2: Low parameters and inputs, BatchNorm in fp32 (LayerNorm and GroupNorm in Low), fp32
/// master weights for the optimizer. `Storage` (state_storage.hpp): Fp32Masters<> keeps them
/// as fp32 copies; RemainderMasters<> (bf16 only) as a 16-bit remainder beside the weight, the
/// same values in half the bytes; either with bf16 moments (`<at::BFloat16>`).
template <class Low = at::Half, class Storage = Fp32Masters<>>
struct MixedO2 : detail::LowPrecisionPolicy<Low> {
  static_assert(Storage::masters == MasterStorage::fp32 ||
                    Storage::masters == MasterStorage::remainder,
                "mixprec: MixedO2 keeps master weights: its storage is Fp32Masters<> or "
                "RemainderMasters<> (stochastic rounding, with no masters, is "
                "PureHalf<at::BFloat16, StochasticRounding<>>)");
  static_assert(Storage::masters != MasterStorage::remainder ||
                    std::is_same_v<Low, at::BFloat16>,
                "mixprec: RemainderMasters needs bf16 weights: a bf16 value is the top 16 bits "
                "of an fp32 one, so 16 more bits make the master exactly; an fp16 weight is not "
                "part of its fp32 master's bits. Use MixedO2<at::Half> (fp32 masters) or "
                "MixedO2<at::BFloat16, RemainderMasters<>>");
  using storage = Storage;
  static constexpr std::string_view name =
      detail::storage_policy_name<Low, Storage, Fp32Masters<>, detail::PolicyNames::o2,
                                  detail::LowPrecision<Low>::o2>;
  static constexpr bool autocast = false;
  static constexpr bool cast_model = true;
  static constexpr bool master_weights = true;
  static constexpr bool keep_batch_norm_fp32 = true;
  using scaler_type = typename detail::LowPrecision<Low>::dynamic_scaler;
};

/// O3: everything in Low, no masters, no scaling: the speed ceiling, not a safe default.
/// `Storage`: RoundToNearest (the optimizer steps the Low weight), or StochasticRounding<>
/// (bf16 only): the optimizer steps an fp32 copy made for the step, rounded back into the
/// weight stochastically, so that updates below half an ulp still move it on average.
template <class Low = at::Half, class Storage = RoundToNearest>
struct PureHalf : detail::LowPrecisionPolicy<Low> {
  static_assert(Storage::masters == MasterStorage::none ||
                    Storage::masters == MasterStorage::stochastic,
                "mixprec: PureHalf keeps no master weights: its storage is RoundToNearest or "
                "StochasticRounding<> (remainder masters are MixedO2<at::BFloat16, "
                "RemainderMasters<>>)");
  static_assert(Storage::masters != MasterStorage::stochastic ||
                    std::is_same_v<Low, at::BFloat16>,
                "mixprec: StochasticRounding is for bf16 weights (fp16's narrow range needs "
                "loss scaling and fp32 masters: use MixedO2<at::Half>)");
  using storage = Storage;
  static constexpr std::string_view name =
      detail::storage_policy_name<Low, Storage, RoundToNearest, detail::PolicyNames::o3,
                                  detail::LowPrecision<Low>::o3>;
  static constexpr bool autocast = false;
  static constexpr bool cast_model = true;
  // Stochastic rounding steps an fp32 copy of each weight, made for the step (MasterWeights).
  static constexpr bool master_weights = Storage::masters == MasterStorage::stochastic;
  static constexpr bool keep_batch_norm_fp32 = false;
  using scaler_type = NoScaler;
};

/// Apex's names for the same policies.
using O0 = FullPrecision;
template <class Low = at::Half>
using O1 = MixedO1<Low>;
template <class Low = at::Half, class Storage = Fp32Masters<>>
using O2 = MixedO2<Low, Storage>;
template <class Low = at::Half, class Storage = RoundToNearest>
using O3 = PureHalf<Low, Storage>;

/// The dtype of P's model outside autocast: Low for MixedO2/PureHalf, whose Trainer::cast_input
/// casts floating batches to it; Float for FullPrecision/MixedO1, whose cast_input passes batches
/// unchanged (a model in fp32 takes fp32 input; under MixedO1 autocast picks each op's dtype, as
/// in Python, where torch.autocast casts no input either).
template <class P>
inline constexpr c10::ScalarType compute_dtype = P::cast_model ? P::low_dtype : c10::ScalarType::Float;

static_assert(PrecisionPolicy<FullPrecision>);
static_assert(PrecisionPolicy<MixedO1<>> && PrecisionPolicy<MixedO2<>> && PrecisionPolicy<PureHalf<>>);

}  // namespace mixprec
