// Compile-time contracts of the policies (static_asserts), plus their runtime-visible names.
#include <mixprec/mixprec.hpp>

#include <doctest/doctest.h>

#include <string_view>

namespace test_policy {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

struct StaticScaledO2 : mp::MixedO2<at::Half> {  // a user's custom policy
  static constexpr std::string_view name = "StaticScaledO2";
  using scaler_type = mp::StaticScaler;
};
struct NoName {
  static constexpr c10::ScalarType low_dtype = c10::ScalarType::Float;
  static constexpr bool autocast = false, cast_model = false, master_weights = false,
                        keep_batch_norm_fp32 = true;
  using scaler_type = mp::NoScaler;
};
struct RuntimeFlag : mp::FullPrecision {
  static inline bool autocast = false;  // not constexpr: cannot drive `if constexpr`
};
struct Fp32WithAutocast : mp::FullPrecision {
  static constexpr bool autocast = true;  // autocast to fp32 means nothing
};
struct CastAndAutocast : mp::MixedO2<at::BFloat16> {
  static constexpr bool autocast = true;
};
struct DoubleLow : mp::MixedO2<at::BFloat16> {
  static constexpr c10::ScalarType low_dtype = c10::ScalarType::Double;
};

static_assert(mp::PrecisionPolicy<mp::FullPrecision>);
static_assert(mp::PrecisionPolicy<mp::MixedO1<at::BFloat16>>);
static_assert(mp::PrecisionPolicy<mp::MixedO2<at::Half>>);
static_assert(mp::PrecisionPolicy<mp::PureHalf<at::BFloat16>>);
static_assert(mp::PrecisionPolicy<StaticScaledO2>);
static_assert(!mp::PrecisionPolicy<int>);
static_assert(!mp::PrecisionPolicy<NoName>);
static_assert(!mp::PrecisionPolicy<RuntimeFlag>);
static_assert(!mp::PrecisionPolicy<Fp32WithAutocast>);
static_assert(!mp::PrecisionPolicy<CastAndAutocast>);
static_assert(!mp::PrecisionPolicy<DoubleLow>);

static_assert(std::is_same_v<mp::O0, mp::FullPrecision>);
static_assert(std::is_same_v<mp::O2<at::BFloat16>, mp::MixedO2<at::BFloat16>>);
static_assert(std::is_same_v<mp::MixedO1<>, mp::MixedO1<at::Half>>);

// Default scalers: dynamic scaling exactly where fp16 gradients can underflow.
static_assert(std::is_same_v<mp::FullPrecision::scaler_type, mp::NoScaler>);
static_assert(std::is_same_v<mp::MixedO1<at::Half>::scaler_type, mp::GradScaler>);
static_assert(std::is_same_v<mp::MixedO2<at::Half>::scaler_type, mp::GradScaler>);
static_assert(std::is_same_v<mp::MixedO1<at::BFloat16>::scaler_type, mp::NoScaler>);
static_assert(std::is_same_v<mp::MixedO2<at::BFloat16>::scaler_type, mp::NoScaler>);
static_assert(std::is_same_v<mp::PureHalf<at::Half>::scaler_type, mp::NoScaler>);

static_assert(mp::compute_dtype<mp::MixedO1<at::BFloat16>> == c10::ScalarType::Float);
static_assert(mp::compute_dtype<mp::MixedO2<at::BFloat16>> == c10::ScalarType::BFloat16);
static_assert(mp::compute_dtype<mp::PureHalf<at::Half>> == c10::ScalarType::Half);

}  // namespace

TEST_CASE_TEMPLATE("every policy describes itself consistently", P, mp::FullPrecision,
                   mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>, mp::PureHalf<at::BFloat16>,
                   mp::MixedO1<at::Half>, mp::MixedO2<at::Half>, mp::PureHalf<at::Half>) {
  CHECK(mp::require_policy<P>);
  const std::string_view name = P::name;
  CHECK_FALSE(name.empty());
  if (P::low_dtype == c10::ScalarType::Float) {
    CHECK(name == "FullPrecision");
  } else {
    // The name ends in the low type, so logs say which half precision ran.
    const std::string_view low = P::low_dtype == c10::ScalarType::Half ? "<Half>" : "<BFloat16>";
    CHECK(name.substr(name.size() - low.size()) == low);
  }
  CHECK(P::master_weights == (P::cast_model && P::keep_batch_norm_fp32));
}

TEST_CASE("policy names are the ones logs and checkpoints use") {
  CHECK(mp::MixedO2<at::BFloat16>::name == "MixedO2<BFloat16>");
  CHECK(mp::MixedO1<>::name == "MixedO1<Half>");
  CHECK(mp::PureHalf<at::Half>::name == "PureHalf<Half>");
  CHECK(StaticScaledO2::name == "StaticScaledO2");
  CHECK(mp::version == "0.1.0");
}

}  // namespace test_policy
