// The params structs across versions: a caller's struct of any known version read as this
// library's (the missing fields 0), and the defaults written for a given version's size.
#pragma once

#include <cstddef>
#include <cstdio>
#include <cstring>

#include "fp8kturbov.h"
#include "api/errors.h"

namespace fp8kturbov {

// A params struct size this library knows (`what` names it in the error): this header's, or that of
// an earlier version of the struct (`versions`, oldest first).
template <typename Params, size_t VERSIONS>
fp8kturbov_status_t check_struct_size(const char* entry, const char* what, size_t given,
                                      const size_t (&versions)[VERSIONS]) {
  bool known = given == sizeof(Params);
  char sizes[96];
  int used = 0;
  for (size_t v = 0; v < VERSIONS; ++v) {
    known = known || given == versions[v];
    if (versions[v] != sizeof(Params))  // a struct of one version lists only this header's size
      used += std::snprintf(sizes + used, sizeof sizes - used, "%zu (version %zu), ", versions[v], v + 1);
  }
  if (!known)
    return fail(FP8KTURBOV_STATUS_BAD_STRUCT_SIZE, entry,
                "%s = %zu, this library knows %s%zu", what, given, sizes, sizeof(Params));
  return FP8KTURBOV_STATUS_SUCCESS;
}

// The caller's params struct as this library's; the fields a smaller (earlier) struct lacks read
// as 0.
template <typename Params, size_t VERSIONS>
fp8kturbov_status_t read_params(const char* entry, const Params* params,
                                const size_t (&versions)[VERSIONS], Params* out) {
  if (params == nullptr) return fail(FP8KTURBOV_STATUS_NULL_POINTER, entry, "params is NULL");
  FP8KTURBOV_CHECK(check_struct_size<Params>(entry, "params->struct_size", params->struct_size, versions));
  *out = Params{};
  std::memcpy(out, params, params->struct_size);
  return FP8KTURBOV_STATUS_SUCCESS;
}

// The defaults of a params struct (every default lies in the first version of the struct, so a
// prefix of it is the defaults of that version).
inline void set_defaults(fp8kturbov_write_params_t* p) { p->v_bits = FP8KTURBOV_DEFAULT_V_BITS; }
inline void set_defaults(fp8kturbov_dequantize_params_t* p) { p->v_bits = FP8KTURBOV_DEFAULT_V_BITS; }
inline void set_defaults(fp8kturbov_prefill_params_t* p) { p->v_bits = FP8KTURBOV_DEFAULT_V_BITS; }
inline void set_defaults(fp8kturbov_decode_params_t* p) {
  p->v_bits = FP8KTURBOV_DEFAULT_V_BITS;
  p->sparse_v_threshold = FP8KTURBOV_DEFAULT_SPARSE_V_THRESHOLD;
}

// *_params_init_sized: the defaults of the struct version of `size` bytes, written over exactly
// `size` bytes of *params.
template <typename Params, size_t VERSIONS>
fp8kturbov_status_t init_params(const char* entry, Params* params, size_t size,
                                const size_t (&versions)[VERSIONS]) {
  if (params == nullptr) return fail(FP8KTURBOV_STATUS_NULL_POINTER, entry, "params is NULL");
  FP8KTURBOV_CHECK(check_struct_size<Params>(entry, "struct_size", size, versions));
  Params defaults{};
  set_defaults(&defaults);
  defaults.struct_size = size;
  std::memcpy(params, &defaults, size);
  return FP8KTURBOV_STATUS_SUCCESS;
}
constexpr size_t kWriteParamsVersions[] = {FP8KTURBOV_WRITE_PARAMS_V1_SIZE, FP8KTURBOV_WRITE_PARAMS_V2_SIZE};
constexpr size_t kDequantizeParamsVersions[] = {FP8KTURBOV_DEQUANTIZE_PARAMS_V1_SIZE};
constexpr size_t kDecodeParamsVersions[] = {FP8KTURBOV_DECODE_PARAMS_V1_SIZE, FP8KTURBOV_DECODE_PARAMS_V2_SIZE,
                                             FP8KTURBOV_DECODE_PARAMS_V3_SIZE, FP8KTURBOV_DECODE_PARAMS_V4_SIZE};
// The prefill struct has one version: this header's (an empty list of earlier ones).
constexpr size_t kPrefillParamsVersions[] = {sizeof(fp8kturbov_prefill_params_t)};
static_assert(offsetof(fp8kturbov_write_params_t, num_blocks) == FP8KTURBOV_WRITE_PARAMS_V1_SIZE,
              "the version-1 write struct ends where the checked-mode fields begin");
static_assert(offsetof(fp8kturbov_write_params_t, v_encoder) == FP8KTURBOV_WRITE_PARAMS_V2_SIZE,
              "the version-2 write struct ends where v_encoder begins");
static_assert(offsetof(fp8kturbov_dequantize_params_t, num_blocks) == FP8KTURBOV_DEQUANTIZE_PARAMS_V1_SIZE,
              "the version-1 dequantize struct ends where the checked-mode fields begin");
static_assert(offsetof(fp8kturbov_decode_params_t, num_blocks) == FP8KTURBOV_DECODE_PARAMS_V1_SIZE,
              "the version-1 decode struct ends where the checked-mode fields begin");
static_assert(offsetof(fp8kturbov_decode_params_t, sinks) == FP8KTURBOV_DECODE_PARAMS_V2_SIZE,
              "the version-2 decode struct ends where sinks begins");
static_assert(offsetof(fp8kturbov_decode_params_t, block_tables_stride) == FP8KTURBOV_DECODE_PARAMS_V3_SIZE,
              "the version-3 decode struct ends where block_tables_stride begins");
static_assert(offsetof(fp8kturbov_decode_params_t, append_key) == FP8KTURBOV_DECODE_PARAMS_V4_SIZE &&
                  sizeof(fp8kturbov_decode_params_t) > FP8KTURBOV_DECODE_PARAMS_V4_SIZE,
              "the version-4 decode struct ends where the append fields begin");

}  // namespace fp8kturbov
