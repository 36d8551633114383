#pragma once
/// How a policy keeps its training state between optimizer steps: the second template argument
/// of MixedO2 and PureHalf. The optimizer always steps fp32 values; these say what stays in
/// memory between its steps.
///
/// | storage                        | policy                 | per bf16 parameter between steps      |
/// |--------------------------------|------------------------|----------------------------------------|
/// | Fp32Masters<> (MixedO2's)      | MixedO2<Low>           | Low weight + fp32 master (2 + 4 bytes) |
/// | RemainderMasters<>             | MixedO2<BFloat16, ...> | bf16 weight + int16 remainder (2 + 2)  |
/// | StochasticRounding<>           | PureHalf<BFloat16, ...>| bf16 weight (2), bf16 moments          |
/// | RoundToNearest (PureHalf's)    | PureHalf<Low>          | Low weight (2)                         |
///
/// Each takes the dtype of Adam's and AdamW's moments between steps (`float` or
/// `at::BFloat16`; float by default, bf16 for StochasticRounding): bf16 moments halve them (8 bytes per parameter to 4) and round each one to
/// bf16 after the step, as Transformer Engine's FusedAdam with exp_avg_dtype=bfloat16 does.
///
/// RemainderMasters keeps the fp32 master exactly, as the rounded bf16 weight plus the 16 bits it
/// lacks (Megatron-LM's store_param_remainders): the training is bit for bit MixedO2's.
/// StochasticRounding keeps no master: the optimizer's fp32 result is rounded into the bf16
/// weight up or down at random, with the probabilities that make the rounding unbiased, so that
/// updates smaller than half a bf16 ulp still move the weights on average (torchao's
/// `_AdamW(bf16_stochastic_round=True)`). Its random bits are a hash of (seed, step, tensor,
/// element): checkpoints carry the seed and the count, so a resumed run rounds as the
/// uninterrupted one, and every data parallel rank rounds alike.

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>

#include <array>
#include <cstddef>
#include <string_view>
#include <type_traits>

namespace mixprec {

/// What stays of a master weight between steps.
enum class MasterStorage {
  fp32,        ///< an fp32 copy (MixedO2's default)
  remainder,   ///< the bf16 weight plus a 16-bit remainder: the fp32 value, exactly
  stochastic,  ///< nothing: the step's fp32 result is rounded stochastically into the weight
  none,        ///< no master at all (PureHalf's default: the optimizer steps the Low weight)
};

namespace detail {

template <class Moments>
inline constexpr bool valid_moment_type =
    std::is_same_v<Moments, float> || std::is_same_v<Moments, at::BFloat16>;

template <class Moments>
struct MomentsOf {
  static_assert(valid_moment_type<Moments>,
                "mixprec: optimizer moments are kept as float or at::BFloat16, e.g. "
                "mixprec::RemainderMasters<at::BFloat16>");
  static constexpr c10::ScalarType dtype =
      std::is_same_v<Moments, float> ? c10::ScalarType::Float : c10::ScalarType::BFloat16;
  static constexpr std::string_view suffix = std::is_same_v<Moments, float> ? "" : "<BFloat16>";
};

struct StorageNames {
  static constexpr std::string_view fp32 = "Fp32Masters";
  static constexpr std::string_view remainder = "RemainderMasters";
  static constexpr std::string_view stochastic = "StochasticRounding";
};

/// The concatenation of static string_views, as one constexpr string_view (policy names).
template <const std::string_view&... Parts>
struct JoinedName {
  static constexpr std::size_t size = (Parts.size() + ... + 0);
  static constexpr std::array<char, size + 1> text = [] {
    std::array<char, size + 1> out{};
    std::size_t i = 0;
    ((void)[&] { for (const char c : Parts) out[i++] = c; }(), ...);
    return out;
  }();
  static constexpr std::string_view value{text.data(), size};
};

// The members every storage declares: what stays of the masters, the moments' dtype between
// steps, and its name in policy names ("RemainderMasters<BFloat16>").
template <MasterStorage Masters, class Moments, const std::string_view& Name>
struct StorageTag {
  static constexpr MasterStorage masters = Masters;
  static constexpr c10::ScalarType moment_dtype = MomentsOf<Moments>::dtype;
  static constexpr std::string_view name = JoinedName<Name, MomentsOf<Moments>::suffix>::value;
};

}  // namespace detail

/// fp32 master weights (MixedO2's default).
template <class Moments = float>
struct Fp32Masters
    : detail::StorageTag<MasterStorage::fp32, Moments, detail::StorageNames::fp32> {};

/// The fp32 master as the bf16 weight plus a 16-bit remainder (MixedO2<BFloat16> only).
template <class Moments = float>
struct RemainderMasters
    : detail::StorageTag<MasterStorage::remainder, Moments, detail::StorageNames::remainder> {};

/// No masters; the step's result rounded stochastically into the bf16 weight (PureHalf<BFloat16>).
/// Its moments are bf16 by default, as PureHalf's are (the optimizer's state is made like the
/// Low weight): 2 + 2 + 4 bytes per parameter with AdamW.
template <class Moments = at::BFloat16>
struct StochasticRounding
    : detail::StorageTag<MasterStorage::stochastic, Moments, detail::StorageNames::stochastic> {};

/// No masters; the optimizer steps the Low weight, rounded to nearest (PureHalf's default).
struct RoundToNearest {
  static constexpr MasterStorage masters = MasterStorage::none;
  // Float: the moments stay as the optimizer makes them (like the Low weight, under PureHalf).
  static constexpr c10::ScalarType moment_dtype = c10::ScalarType::Float;
  static constexpr std::string_view name = "RoundToNearest";
};

namespace detail {

/// P's storage, for policies that name one (MixedO2, PureHalf and those derived from them);
/// a custom policy without `storage` keeps what its flags say.
template <class P>
struct StorageOf {
  using type = std::conditional_t<P::master_weights, Fp32Masters<>, RoundToNearest>;
};
template <class P>
  requires requires { typename P::storage; }
struct StorageOf<P> {
  using type = typename P::storage;
};
template <class P>
using storage_of = typename StorageOf<P>::type;

/// The storage of P keeps less than MixedO2's fp32 masters and fp32 moments.
template <class P>
inline constexpr bool lean_state =
    storage_of<P>::masters == MasterStorage::remainder ||
    storage_of<P>::masters == MasterStorage::stochastic ||
    storage_of<P>::moment_dtype != c10::ScalarType::Float;

/// What sharded data parallel keeps of the optimizer's pieces that are masters of bf16 tensors.
struct PieceStorage {
  MasterStorage masters = MasterStorage::fp32;
  bool bf16_moments = false;  ///< Adam's and AdamW's moments rounded to bf16 between steps
  bool lean_masters() const noexcept {
    return masters == MasterStorage::remainder || masters == MasterStorage::stochastic;
  }
};

/// P's PieceStorage.
template <class P>
inline constexpr PieceStorage piece_storage_of{storage_of<P>::masters,
                                               storage_of<P>::moment_dtype == c10::ScalarType::BFloat16};

}  // namespace detail

}  // namespace mixprec
