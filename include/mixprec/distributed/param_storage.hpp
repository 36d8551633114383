#pragma once
// A parameter's storage released to no bytes and allocated again, its sizes kept, so that the
// references autograd saved to it stay valid while a sharded unit's weights are elsewhere; and
// an alias to write the gathered values through without touching its version counter (which
// would make those saved references stale).

#include <mixprec/core/error.hpp>
#include <mixprec/core/held_shards.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cstddef>
#include <string>

namespace mixprec::detail {

inline std::size_t storage_bytes_of(const at::Tensor& p) {
  return static_cast<std::size_t>(p.numel()) * p.element_size();
}

/// Whether `p`'s storage is released (and `p` has elements).
inline bool storage_released(const at::Tensor& p) {
  return p.numel() > 0 && p.storage().nbytes() == 0;
}

/// An Error unless `p` owns its storage whole: contiguous, from its start, to its end.
inline void check_own_storage(const at::Tensor& p, const std::string& name) {
  if (HeldShards::is_placeholder(p)) return;  // held in shards: it gets storage of its own
  MIXPREC_CHECK(p.is_contiguous() && p.storage_offset() == 0 &&
                    p.storage().nbytes() == storage_bytes_of(p),
                "DistributedOptions::shard_parameters: parameter '", name, "' of shape ",
                p.sizes(), " shares its storage with other tensors (a view or a slice of a "
                "larger tensor), whose bytes a sharded unit cannot release: register it as a "
                "tensor of its own");
}

/// `p`'s bytes freed; its sizes, strides and identity unchanged. A placeholder of a parameter
/// held in shards first gets a storage of its own (allocated, never written: no page of it is
/// touched).
inline void release_storage(const at::Tensor& p) {
  if (storage_released(p)) return;
  if (HeldShards::is_placeholder(p)) {
    at::NoGradGuard no_grad;
    p.set_data(at::empty(p.sizes(), p.options()));
  }
  auto* impl = p.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, p.device()));
  impl->set_nbytes(static_cast<std::size_t>(0));
}

/// `p`'s bytes allocated again (their values unset) where they were released.
inline void allocate_storage(const at::Tensor& p) {
  if (!storage_released(p)) return;
  auto* impl = p.storage().unsafeGetStorageImpl();
  const auto bytes = storage_bytes_of(p);
  impl->set_data_ptr_noswap(impl->allocator()->allocate(bytes));
  impl->set_nbytes(bytes);
}

/// A tensor over `p`'s bytes with a version counter of its own.
inline at::Tensor storage_alias(const at::Tensor& p) {
  at::NoGradGuard no_grad;
  return at::empty({0}, p.options()).set_(p.storage(), p.storage_offset(), p.sizes(), p.strides());
}

}  // namespace mixprec::detail
