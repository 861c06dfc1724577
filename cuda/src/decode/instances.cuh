// The decode kernel instances built for every (V bits, head dim): one row per variant. A launch
// runs the first row that serves it (DecodeVariant::serves), so rows go from the most specialised
// to the most general, and each row is built in two code-copy widths (the shape's widest V code
// copy, where the pool layout allows it, else 4 bytes). Adding a variant is adding a row.
#pragma once

#include <cstddef>
#include <tuple>

#include "decode/kernel.cuh"
#include "decode/merge.cuh"
#include "decode/variants.cuh"

namespace fp8kturbov {

using DecodeVariants = std::tuple<
    // multi-token, rotation, head groups, split shares
    DecodeVariant<false, false, false, LengthShares::kNever>,   // the default decode
    DecodeVariant<false, false, false, LengthShares::kAlways>,  // split slots shared by length
    DecodeVariant<false, false, true, LengthShares::kNever>,    // head groups
    DecodeVariant<false, false, true, LengthShares::kAlways>,   // head groups, slots shared by length
    // Several query tokens per sequence or rotated V: one instance for both, following the plan's
    // shares, so that the rows above keep neither the multi-token indexing nor the rotation.
    DecodeVariant<true, true, false, LengthShares::kByPlan>>;

// What a launch needs of its features.
struct DecodeFeatures {
  bool multi_token;  // DecodeArgs::query_start
  bool rotation;     // DecodeArgs::rotated_v
  bool head_groups;  // DecodePlan::stream_partials > 1
  bool length_shares;  // DecodePlan::length_shares
  bool wide_code_copy;  // DecodeArgs::v_code_copy_bytes allows the shape's widest code copy
};

// A decode kernel instance, its merge kernel and the dynamic shared memory it runs with.
struct DecodeInstance {
  const void* kernel;  // null where no built instance serves the features
  const void* merge;
  int smem_bytes;
};

// The instance of the first row (from row ROW on) that serves `features`.
template <int BITS, int HEAD_DIM, size_t ROW = 0>
DecodeInstance decode_instance(const DecodeFeatures& features) {
  if constexpr (ROW == std::tuple_size_v<DecodeVariants>) {
    return {nullptr, nullptr, 0};
  } else {
    using Variant = std::tuple_element_t<ROW, DecodeVariants>;
    if constexpr (Variant::built(BITS, HEAD_DIM)) {
      if (Variant::serves(features.multi_token, features.rotation, features.head_groups, features.length_shares)) {
        constexpr int kWideCopy = DecodeShape<BITS, HEAD_DIM>::kMaxCodeCopy;
        const void* kernel = features.wide_code_copy
                                 ? reinterpret_cast<const void*>(&paged_decode_kernel<BITS, HEAD_DIM, kWideCopy, Variant>)
                                 : reinterpret_cast<const void*>(&paged_decode_kernel<BITS, HEAD_DIM, 4, Variant>);
        return {kernel, reinterpret_cast<const void*>(&merge_splits_kernel<HEAD_DIM, typename Variant::Merge>),
                DecodeSmem<BITS, HEAD_DIM, Variant::kHeadGroups>::kBytes};
      }
    }
    return decode_instance<BITS, HEAD_DIM, ROW + 1>(features);
  }
}

}  // namespace fp8kturbov
