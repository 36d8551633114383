#pragma once
// The LibTorch version in use, for the few code paths that differ between 1.13 and 2.x.

#include <ATen/core/Tensor.h>
#include <torch/version.h>

#include <sstream>
#include <string>
#include <type_traits>

/// True when the LibTorch in use is at least major.minor.
#define MIXPREC_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||          \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace mixprec::detail {

// LibTorch 1.13's CPU kernels store float16 but compute nothing in it (mm, conv, softmax,
// layer_norm, Adam all throw); 2.x computes it, and CPU autocast accepts it. 2.4 is where the
// device-typed autocast API and CPU fp16 autocast meet; the Half policies need both.
inline constexpr bool cpu_half_math = MIXPREC_TORCH_AT_LEAST(2, 4);

// The optimizer state key of a tensor: its TensorImpl address printed as a string in LibTorch
// 1.x (as c10::guts::to_string printed it), the address itself in 2.x. `Map` is the type of
// Optimizer::state().
template <class Map>
auto state_key(const at::Tensor& p) {
  using Key = typename std::decay_t<Map>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;
    key << p.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

}  // namespace mixprec::detail
