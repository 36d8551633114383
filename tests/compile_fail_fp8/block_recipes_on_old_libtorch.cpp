// Under a LibTorch without fp8 (1.13), naming MixedFP8 with a block-scaled recipe (MXFP8,
// blockwise fp8, NVFP4) fails to compile with the message that says what it needs, as the
// other recipes do; tests/CMakeLists.txt builds this file only there.
// expect: MixedFP8 needs LibTorch >= 2.5
#include <mixprec/fp8/linear.hpp>

constexpr auto mx = mixprec::MixedFP8<mixprec::MXFP8Scaling<mixprec::MxScale::rceil>>::name;
constexpr auto blockwise = mixprec::MixedFP8<mixprec::BlockwiseFP8Scaling>::name;
constexpr auto nvfp4 = mixprec::MixedFP8<mixprec::NVFP4>::name;
