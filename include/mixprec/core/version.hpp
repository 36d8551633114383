#pragma once
/// The library version; CMake reads the project version from these three lines.

#include <string_view>

#define MIXPREC_VERSION_MAJOR 0
#define MIXPREC_VERSION_MINOR 1
#define MIXPREC_VERSION_PATCH 0

namespace mixprec {

/// "MAJOR.MINOR.PATCH" of the headers in use.
inline constexpr std::string_view version = "0.1.0";

}  // namespace mixprec
