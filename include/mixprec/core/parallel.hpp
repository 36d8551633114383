#pragma once
/// at::parallel_for as mixprec's CPU passes use it (the gradient passes: unscale, clip, inf/NaN
/// check; fp8 quantization), and a compile-time warning where it would run them on one thread.
///
/// at::parallel_for is a template in ATen's headers: where LibTorch's parallel backend is
/// OpenMP (AT_PARALLEL_OPENMP, the wheels' and Debian's), it is an `omp parallel` region in the
/// translation unit that calls it, so it runs in parallel only where that unit is compiled with
/// OpenMP. The mixprec::mixprec CMake target adds OpenMP::OpenMP_CXX; a build that only adds the
/// include path (Makefiles, Bazel, a header copied in) gets a plain loop instead: unscale_ over
/// 64M fp32 gradients took 1.84x a multiply at two threads without -fopenmp, 1.04x with it
/// (issue 46), and the gap grows with the cores. Compile with -fopenmp (MSVC: /openmp), or define
/// MIXPREC_NO_OPENMP_WARNING where one thread is what you want.

#include <ATen/Config.h>
#include <ATen/Parallel.h>

#if AT_PARALLEL_OPENMP && !defined(_OPENMP) && !defined(MIXPREC_NO_OPENMP_WARNING)
#if defined(_MSC_VER) && !defined(__clang__)
#pragma message("warning: mixprec: LibTorch's at::parallel_for uses OpenMP, but this file is compiled without OpenMP: mixprec's gradient passes (unscale, clip, inf/NaN check) will run on one thread. Compile with /openmp (CMake: link mixprec::mixprec), or define MIXPREC_NO_OPENMP_WARNING to accept one thread")
#else
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpedantic"  // clang: #warning is C++23; GCC says so anyway
#warning "mixprec: LibTorch's at::parallel_for uses OpenMP, but this file is compiled without OpenMP: mixprec's gradient passes (unscale, clip, inf/NaN check) will run on one thread. Compile with -fopenmp (CMake: link mixprec::mixprec), or define MIXPREC_NO_OPENMP_WARNING to accept one thread"
#pragma GCC diagnostic pop
#endif
#endif
