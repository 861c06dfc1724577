// Checked mode's device-side state, shared by every kernel.
#pragma once

#include <cstdint>

#include "fp8kturbov.h"  // fp8kturbov_index_error_t

namespace fp8kturbov {

// Checked mode (fp8kturbov.h): the pool capacity in pages (0 = unchecked) and the caller's device
// word that the kernels OR fp8kturbov_index_error_t bits into.
struct IndexCheck {
  uint64_t num_blocks;
  uint32_t* error_flags;

  __device__ bool enabled() const { return num_blocks != 0; }
  // A page id read from a block table (checked mode): int32, so a negative one is out of range.
  __device__ bool page_out_of_range(int32_t page) const { return page < 0 || uint64_t(page) >= num_blocks; }
  // A slot's page (slot / block_size, slot >= 0) that checked mode finds outside the pools.
  __device__ bool slot_page_out_of_range(uint64_t page) const { return enabled() && page >= num_blocks; }
  __device__ void report(fp8kturbov_index_error_t error) const { atomicOr(error_flags, uint32_t(error)); }
};

}  // namespace fp8kturbov
