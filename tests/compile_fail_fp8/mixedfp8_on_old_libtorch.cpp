// Under a LibTorch without fp8 (1.13), naming MixedFP8 fails to compile with a message that says
// what it needs; tests/CMakeLists.txt builds this file only there.
// expect: MixedFP8 needs LibTorch >= 2.5
#include <mixprec/fp8/linear.hpp>

constexpr auto name = mixprec::MixedFP8<>::name;
