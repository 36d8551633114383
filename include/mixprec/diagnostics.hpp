#pragma once
/// Diagnostics: where an inf/NaN came from (NonFiniteOpFinder, Overflow), the gradients'
/// ranges per layer (GradientStats), and advise(), which records a few steps and recommends a
/// policy and a precision map.

#include <mixprec/diagnostics/non_finite.hpp>
#include <mixprec/diagnostics/advise.hpp>
