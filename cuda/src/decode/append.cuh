// The decode's fused append (DecodeArgs::append): the new tokens' K and V written into the cache by
// the decode launch itself, before its copies read them, in the bytes of the cache write
// (reshape_and_cache.cuh): the same loads, encoders, rotation and stores.
//
// Which CTA writes what. Each CTA writes the new tokens inside its own attended range, for the KV
// heads it reads, and then reads them back: a CTA never depends on another's writes. The CTAs that
// share a token (chunks of a GQA group, head-group streams) write the same bytes.
#pragma once

#include "format.cuh"
#include "kernel_args.h"
#include "reshape_and_cache.cuh"
#include "decode/ptx.cuh"
#include "decode/traits.cuh"

namespace fp8kturbov {

// Shared memory the append may borrow before the copy pipeline starts (the ring): the codebook
// table, then one 16-element V group per thread for the searching encoders' warp search.
template <int BITS>
struct AppendScratch {
  CodebookTable<BITS> codebook;
  alignas(16) float values[kDecodeThreads][kGroupElems];
};

// A searching encoder's warp search of a group in shared memory (all 32 lanes call it). Out of
// line: inlined beside the decode's tile loop, the two searches cost some append instances spills
// there.
template <int BITS>
__device__ __noinline__ EncodedGroup<BITS> search_v_group(fp8kturbov_v_encoder_t encoder, const float (&x)[kGroupElems],
                                                        const CodebookTable<BITS>& table) {
  return encoder == FP8KTURBOV_V_ENCODER_MSE
             ? encode_v_group_by<BITS, FP8KTURBOV_V_ENCODER_MSE, kSearchWarpLanes>(x, table)
             : encode_v_group_by<BITS, FP8KTURBOV_V_ENCODER_PROJECTION, kSearchWarpLanes>(x, table);
}

// The new tokens of query rows [first_row, first_row + num_tokens), KV heads [first_kv_head,
// first_kv_head + num_heads), written by the CTA's kDecodeThreads threads: work item
// (token, head, group), group fastest, so that a head's groups lie in consecutive aligned lanes
// as the rotation needs (HEAD_DIM / 16 divides 32). `scratch`: shared memory for the codebook table
// and the searching encoders' groups (whose warp search also takes CTA barriers). Ends with a fence
// that orders the writes before the CTA's tensor copies (the async proxy) that follow the caller's
// next CTA barrier. ROTATABLE: an instance that may meet a rotated cache (a.rotated_v).
template <int BITS, int HEAD_DIM, bool ROTATABLE>
__device__ __forceinline__ void append_new_tokens(const DecodeArgs& a, AppendScratch<BITS>& scratch, uint32_t first_row,
                                                  uint32_t num_tokens, uint32_t first_kv_head, uint32_t num_heads) {
  constexpr uint32_t kGroups = HEAD_DIM / kGroupElems;
  static_assert(32 % kGroups == 0 || !ROTATABLE, "a rotated head's groups lie in one warp");
  const AppendArgs& ap = a.append;
  const uint32_t row_elems = a.num_kv_heads * HEAD_DIM;  // < 2^32, validated
  const VPageLayout layout{uint64_t(row_elems) * BITS / 8, row_elems / kGroupElems, a.v_data_section_bytes};
  const uint32_t lane = threadIdx.x % 32;
  const bool searching = ap.v_encoder != FP8KTURBOV_V_ENCODER_MATCHED_NORM;  // kernel-uniform

  // Item `item`'s input: its row and the element offset of its group in the row.
  struct Source {
    uint32_t row, elem;
  };
  auto source_of = [&](uint32_t item) {
    const uint32_t head = first_kv_head + item / kGroups % num_heads;
    return Source{first_row + item / kGroups / num_heads, head * HEAD_DIM + item % kGroups * kGroupElems};
  };
  // Its destination from its slot; page < 0: nothing is written (a negative slot, FORMAT §4; in
  // checked mode a page past the pools, which `report` reports).
  struct Destination {
    int64_t page;
    uint32_t offset;
  };
  auto destination_of = [&](uint32_t item, int64_t slot, bool report) {
    if (slot < 0) return Destination{-1, 0};
    const Destination d{slot / a.block_size, uint32_t(slot % a.block_size)};
    if (!a.index_check.slot_page_out_of_range(uint64_t(d.page))) return d;
    if (report && item % kGroups == 0) a.index_check.report(FP8KTURBOV_INDEX_ERROR_SLOT);
    return Destination{-1, 0};
  };

  const uint32_t items = num_tokens * num_heads * kGroups;
  for (uint32_t base = 0; base < items; base += kDecodeThreads) {  // CTA-uniform
    const uint32_t item = base + threadIdx.x;
    const bool active = item < items;
    // The slot and both input groups are requested before anything waits on them (a thread past
    // the last item loads item 0's, which exists), the codebook table copied while they are in
    // flight: one memory round trip.
    const Source src = source_of(active ? item : 0);
    const int64_t slot = __ldg(ap.slot_mapping + src.row);
    const Bf16Group k_in = load_bf16_group(ap.key + src.row * ap.key_stride + src.elem, ap.key_vector_loads);
    const Bf16Group v_in = load_bf16_group(ap.value + src.row * ap.value_stride + src.elem, ap.value_vector_loads);
    if (base == 0) load_codebook<BITS>(scratch.codebook);  // a CTA barrier
    // The threads of a head share its token, hence its destination: they write, rotate and skip
    // together.
    const Destination dst = active ? destination_of(item, slot, true) : Destination{-1, 0};
    if (dst.page >= 0) {
      float k[kGroupElems], x[kGroupElems];
      widen_bf16_group(k_in, k);
      widen_bf16_group(v_in, x);
      store_k_group(ap.k_cache + uint64_t(dst.page) * a.k_block_stride_bytes + uint64_t(dst.offset) * row_elems + src.elem,
                    k, ap.k_inv_scale);
      if constexpr (ROTATABLE)
        if (a.rotated_v) rotate_head<HEAD_DIM>(x);
      if (searching) {  // the warp search below
#pragma unroll
        for (int i = 0; i < kGroupElems; ++i) scratch.values[threadIdx.x][i] = x[i];
      } else {
        store_v_group<BITS>(ap.v_cache + uint64_t(dst.page) * a.v_block_stride_bytes, layout, dst.offset,
                            src.elem / kGroupElems, encode_v_group<BITS>(x, scratch.codebook));
      }
    }
    if (searching) {  // a warp per group, as the write's small launches
      __syncthreads();
      const uint32_t round_items = min(uint32_t(kDecodeThreads), items - base);
      for (uint32_t j = threadIdx.x / 32; j < round_items; j += kDecodeWarps) {
        const Source u = source_of(base + j);  // warp-uniform
        const Destination d = destination_of(base + j, __ldg(ap.slot_mapping + u.row), false);
        if (d.page < 0) continue;
        const EncodedGroup<BITS> enc = search_v_group<BITS>(ap.v_encoder, scratch.values[j], scratch.codebook);
        if (lane == 0)
          store_v_group<BITS>(ap.v_cache + uint64_t(d.page) * a.v_block_stride_bytes, layout, d.offset,
                              u.elem / kGroupElems, enc);
      }
      __syncthreads();  // the groups are refilled by the next round
    }
  }
  fence_writes_before_tensor_copies();
}

}  // namespace fp8kturbov
