#pragma once
/// The contracts of mixprec: PrecisionPolicy (what a policy type declares) and LossScaler (what the
/// Trainer needs from a scaler). Both are checked by static_assert in tests/test_concepts.cpp.

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <concepts>
#include <string_view>
#include <type_traits>

namespace mixprec {
namespace detail {

template <class P>
concept HasPolicyName = requires {
  { P::name } -> std::convertible_to<std::string_view>;
};

// The integral_constant forces low_dtype to be a constant expression, as `if constexpr` needs.
template <class P>
concept HasLowDtype = requires {
  typename std::integral_constant<c10::ScalarType, P::low_dtype>;
};

template <class P>
concept HasPolicyFlags = requires {
  typename std::bool_constant<P::autocast>;
  typename std::bool_constant<P::cast_model>;
  typename std::bool_constant<P::master_weights>;
  typename std::bool_constant<P::keep_batch_norm_fp32>;
};

template <class P>
concept HasScalerType = requires { typename P::scaler_type; };

template <class P>
concept ConsistentPolicy =
    HasLowDtype<P> && HasPolicyFlags<P> &&
    (P::low_dtype == c10::ScalarType::Float || P::low_dtype == c10::ScalarType::Half ||
     P::low_dtype == c10::ScalarType::BFloat16) &&
    ((P::low_dtype == c10::ScalarType::Float) == (!P::autocast && !P::cast_model)) &&
    !(P::autocast && P::cast_model) && (!P::master_weights || P::cast_model);

}  // namespace detail

/// A precision policy: a tag type with the constexpr settings listed in policy.hpp.
template <class P>
concept PrecisionPolicy = detail::HasPolicyName<P> && detail::HasLowDtype<P> &&
                          detail::HasPolicyFlags<P> && detail::HasScalerType<P> &&
                          detail::ConsistentPolicy<P>;

namespace detail {

// Spells out which part of the PrecisionPolicy contract a type misses, one message each.
template <class P>
struct PolicyCheck {
  static_assert(HasPolicyName<P>,
                "mixprec: a precision policy needs `static constexpr std::string_view name`");
  static_assert(HasLowDtype<P>,
                "mixprec: a precision policy needs `static constexpr c10::ScalarType low_dtype` "
                "(kFloat, kHalf or kBFloat16)");
  static_assert(HasPolicyFlags<P>,
                "mixprec: a precision policy needs the constexpr bools autocast, cast_model, "
                "master_weights and keep_batch_norm_fp32");
  static_assert(HasScalerType<P>,
                "mixprec: a precision policy needs `using scaler_type = ...` (GradScaler, "
                "StaticScaler or NoScaler)");
  static_assert(!(HasLowDtype<P> && HasPolicyFlags<P>) || ConsistentPolicy<P>,
                "mixprec: inconsistent precision policy: low_dtype is kFloat exactly when neither "
                "autocast nor cast_model is set, autocast excludes cast_model, and "
                "master_weights requires cast_model");
  static constexpr bool value = PrecisionPolicy<P>;
};

}  // namespace detail

/// `static_assert(mixprec::require_policy<P>)` in a template: fails naming what P lacks.
template <class P>
inline constexpr bool require_policy = detail::PolicyCheck<P>::value;

/// A loss scaler, as the Trainer uses it: exactly the calls a Trainer<P> makes on its
/// `P::scaler_type`. The scaler chooses the scale; the Trainer multiplies the loss by it, unscales,
/// checks for inf/NaN (agreed across ranks), clips and steps or skips, then reports whether the
/// gradients held inf/NaN. The state dict goes into the Trainer's checkpoints.
///   get_scale()             the scale to use for the next step: a positive normal fp32 value
///                           (anything else is an Error at that step, before anything changes)
///   update_scale(found_inf) after each optimizer step or skip: found_inf is true when the
///                           step was skipped for inf/NaN gradients (or loss)
///   state_dict()            the scaler's state, as a dict of IValues
///   load_state_dict(dict)   restores it; throw (mixprec::Error) on a dict it cannot take, and
///                           change nothing then
/// The Trainer default-constructs it, or constructs it from TrainerOptions::scaler's
/// GradScalerOptions where that is set (which needs a constructor taking them). GradScaler,
/// StaticScaler and NoScaler satisfy it and add PyTorch's GradScaler API for your own loops.
template <class S>
concept LossScaler = std::movable<S> &&
                     requires(S& scaler, const S& const_scaler, bool found_inf,
                              const c10::impl::GenericDict& state) {
  { const_scaler.get_scale() } -> std::convertible_to<double>;
  scaler.update_scale(found_inf);
  { const_scaler.state_dict() } -> std::same_as<c10::impl::GenericDict>;
  scaler.load_state_dict(state);
};

}  // namespace mixprec
