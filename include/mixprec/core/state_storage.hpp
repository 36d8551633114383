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
/// Or a block format, torchao 0.18's low-bit optimizer states (AdamW8bit, AdamW4bit, AdamWFp8)
/// bit for bit: Moments8bit<> (1 byte per moment and an fp32 scale per block of 256),
/// Moments4bit<> (half a byte, blocks of 128), MomentsFp8<> (float8_e4m3fn, blocks of 256). A
/// tensor under 4096 elements, or whose count is no multiple of the block, keeps plain moments
/// (fp32; bf16 for a bf16 tensor under StochasticRounding), as torchao does. Adam and AdamW only,
/// on the CPU, stepped by mixprec's one-pass kernel block by block (optim/quantized_adam.hpp).
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
#include <cstdint>
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

/// How a storage keeps Adam's moments between steps.
enum class MomentFormat {
  plain,     ///< a tensor of the storage's moment_dtype (float or bf16)
  dynamic8,  ///< Moments8bit: torchao's 8-bit dynamic map, one fp32 scale per block
  dynamic4,  ///< Moments4bit: its 4-bit maps, two codes a byte, one fp32 scale per block
  fp8,       ///< MomentsFp8: float8_e4m3fn codes, one fp32 scale per block
};

/// A storage's moments as a value: their format and block (0 for plain moments).
struct MomentCoding {
  MomentFormat format = MomentFormat::plain;
  std::int64_t block = 0;
  constexpr bool quantized() const noexcept { return format != MomentFormat::plain; }
  constexpr bool operator==(const MomentCoding&) const = default;
};

namespace detail {

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

/// The largest block of a block format (a block's values stay in the cache while it steps).
inline constexpr std::int64_t kMaxMomentBlock = 65536;

/// The decimal digits of a positive number, as a constexpr string_view (policy names).
template <std::int64_t N>
struct Digits {
  static constexpr std::size_t size = [] {
    std::size_t n = 1;
    for (auto v = N; v >= 10; v /= 10) ++n;
    return n;
  }();
  static constexpr std::array<char, size + 1> text = [] {
    std::array<char, size + 1> out{};
    auto v = N;
    for (std::size_t i = size; i-- > 0; v /= 10) out[i] = static_cast<char>('0' + v % 10);
    return out;
  }();
  static constexpr std::string_view value{text.data(), size};
};

/// A block format's members (Moments8bit, Moments4bit, MomentsFp8).
template <MomentFormat Format, std::int64_t Block, std::int64_t DefaultBlock>
struct MomentBlockFormat {
  static_assert(Block >= 1 && Block <= kMaxMomentBlock,
                "mixprec: a block format's block size is 1 to 65536 elements");
  static_assert(Format != MomentFormat::dynamic4 || Block % 2 == 0,
                "mixprec: Moments4bit keeps two codes a byte: its block size must be even");
  static constexpr MomentFormat format = Format;
  static constexpr std::int64_t block = Block;
  static constexpr bool default_block = Block == DefaultBlock;
};

}  // namespace detail

/// Adam's moments in 8 bits, torchao's AdamW8bit: a dynamic quantization map (signed for
/// exp_avg, unsigned for exp_avg_sq), one fp32 scale (the block's largest magnitude) per block.
template <std::int64_t Block = 256>
struct Moments8bit : detail::MomentBlockFormat<MomentFormat::dynamic8, Block, 256> {};
/// Adam's moments in 4 bits, torchao's AdamW4bit: its 4-bit maps (a signed dynamic map for
/// exp_avg, 16 linear steps for exp_avg_sq), two codes a byte, one fp32 scale per block.
template <std::int64_t Block = 128>
struct Moments4bit : detail::MomentBlockFormat<MomentFormat::dynamic4, Block, 128> {};
/// Adam's moments as float8_e4m3fn, torchao's AdamWFp8: one fp32 scale per block maps the
/// block's largest magnitude to 448.
template <std::int64_t Block = 256>
struct MomentsFp8 : detail::MomentBlockFormat<MomentFormat::fp8, Block, 256> {};

namespace detail {

template <class Moments>
inline constexpr bool valid_moment_type =
    std::is_same_v<Moments, float> || std::is_same_v<Moments, at::BFloat16>;

template <class Moments>
struct MomentsOf {
  static_assert(valid_moment_type<Moments>,
                "mixprec: optimizer moments are kept as float or at::BFloat16, or in a block "
                "format (Moments8bit<>, Moments4bit<>, MomentsFp8<>), e.g. "
                "mixprec::RemainderMasters<at::BFloat16>");
  static constexpr c10::ScalarType dtype =
      std::is_same_v<Moments, float> ? c10::ScalarType::Float : c10::ScalarType::BFloat16;
  static constexpr std::string_view suffix = std::is_same_v<Moments, float> ? "" : "<BFloat16>";
  static constexpr MomentFormat format = MomentFormat::plain;
  static constexpr std::int64_t block = 0;
};

struct FormatNames {
  static constexpr std::string_view open = "<";
  static constexpr std::string_view close = ">";
  static constexpr std::string_view q8 = "Moments8bit";
  static constexpr std::string_view q4 = "Moments4bit";
  static constexpr std::string_view fp8 = "MomentsFp8";
};

template <MomentFormat F>
inline constexpr const std::string_view& format_name =
    F == MomentFormat::dynamic8 ? FormatNames::q8
                                : (F == MomentFormat::dynamic4 ? FormatNames::q4 : FormatNames::fp8);

// "<Moments8bit>" for the default block, "<Moments8bit<128>>" for another.
template <MomentFormat F, std::int64_t Block, bool DefaultBlock>
struct FormatSuffix {
  static constexpr std::string_view value =
      JoinedName<FormatNames::open, format_name<F>, FormatNames::open, Digits<Block>::value,
                 FormatNames::close, FormatNames::close>::value;
};
template <MomentFormat F, std::int64_t Block>
struct FormatSuffix<F, Block, true> {
  static constexpr std::string_view value =
      JoinedName<FormatNames::open, format_name<F>, FormatNames::close>::value;
};

template <MomentFormat F, std::int64_t Block, std::int64_t Default>
struct MomentsOf<MomentBlockFormat<F, Block, Default>> {
  // A tensor that stays unquantized keeps fp32 moments (StorageTag makes them bf16 for a bf16
  // tensor under StochasticRounding, as torchao keeps them in the parameter's dtype).
  static constexpr c10::ScalarType dtype = c10::ScalarType::Float;
  static constexpr std::string_view suffix = FormatSuffix<F, Block, Block == Default>::value;
  static constexpr MomentFormat format = F;
  static constexpr std::int64_t block = Block;
};
template <std::int64_t Block>
struct MomentsOf<Moments8bit<Block>> : MomentsOf<typename Moments8bit<Block>::MomentBlockFormat> {};
template <std::int64_t Block>
struct MomentsOf<Moments4bit<Block>> : MomentsOf<typename Moments4bit<Block>::MomentBlockFormat> {};
template <std::int64_t Block>
struct MomentsOf<MomentsFp8<Block>> : MomentsOf<typename MomentsFp8<Block>::MomentBlockFormat> {};

struct StorageNames {
  static constexpr std::string_view fp32 = "Fp32Masters";
  static constexpr std::string_view remainder = "RemainderMasters";
  static constexpr std::string_view stochastic = "StochasticRounding";
};

// The members every storage declares: what stays of the masters, the moments' format and
// dtype between steps (a block format's: that of the tensors it leaves unquantized), and its
// name in policy names ("RemainderMasters<BFloat16>", "StochasticRounding<Moments8bit>").
template <MasterStorage Masters, class Moments, const std::string_view& Name>
struct StorageTag {
  static constexpr MasterStorage masters = Masters;
  static constexpr MomentFormat moment_format = MomentsOf<Moments>::format;
  static constexpr std::int64_t moment_block = MomentsOf<Moments>::block;
  static constexpr c10::ScalarType moment_dtype =
      moment_format != MomentFormat::plain && Masters == MasterStorage::stochastic
          ? c10::ScalarType::BFloat16
          : MomentsOf<Moments>::dtype;
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
/// Low weight): 2 + 2 + 4 bytes per parameter with AdamW; with Moments8bit<>, 2 + 2 + 2.03.
template <class Moments = at::BFloat16>
struct StochasticRounding
    : detail::StorageTag<MasterStorage::stochastic, Moments, detail::StorageNames::stochastic> {};

/// No masters; the optimizer steps the Low weight, rounded to nearest (PureHalf's default).
struct RoundToNearest {
  static constexpr MasterStorage masters = MasterStorage::none;
  static constexpr MomentFormat moment_format = MomentFormat::plain;
  static constexpr std::int64_t moment_block = 0;
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

/// The moments' format of a storage S (a user's storage without one: plain).
template <class S>
inline constexpr MomentCoding moment_coding_of_storage = [] {
  if constexpr (requires { S::moment_format; S::moment_block; }) {
    return MomentCoding{S::moment_format, S::moment_block};
  } else {
    return MomentCoding{};
  }
}();

/// P's moments' format between steps.
template <class P>
inline constexpr MomentCoding moment_coding_of = moment_coding_of_storage<storage_of<P>>;

/// P keeps Adam's moments in a block format (Moments8bit, Moments4bit, MomentsFp8).
template <class P>
inline constexpr bool quantized_moments = moment_coding_of<P>.quantized();

/// The storage of P keeps less than MixedO2's fp32 masters and fp32 moments.
template <class P>
inline constexpr bool lean_state =
    storage_of<P>::masters == MasterStorage::remainder ||
    storage_of<P>::masters == MasterStorage::stochastic ||
    storage_of<P>::moment_dtype != c10::ScalarType::Float || quantized_moments<P>;

/// What sharded data parallel keeps of the optimizer's pieces that are masters of bf16 tensors.
struct PieceStorage {
  MasterStorage masters = MasterStorage::fp32;
  bool bf16_moments = false;  ///< Adam's and AdamW's moments rounded to bf16 between steps
  MomentCoding moments = {};  ///< a block format's (then every tensor's moments are stepped so)
  bool lean_masters() const noexcept {
    return masters == MasterStorage::remainder || masters == MasterStorage::stochastic;
  }
};

/// P's PieceStorage.
template <class P>
inline constexpr PieceStorage piece_storage_of{
    storage_of<P>::masters, storage_of<P>::moment_dtype == c10::ScalarType::BFloat16,
    moment_coding_of<P>};

}  // namespace detail

}  // namespace mixprec
