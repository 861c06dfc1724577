/*
 * fp8kturbov — a paged KV cache with K in FP8 E4M3 (one per-tensor scale) and V in TurboQuant
 * 2/3/4-bit Lloyd–Max codes (one E4M3 scale per 16 elements), and the operations on it: the
 * cache write (reshape_and_cache), paged decode attention, paged prefill attention and the
 * dequantize.
 *
 * The byte format is specified in docs/format.md. This header is plain C99 and needs no CUDA
 * header: streams are passed as an opaque pointer compatible with CUstream / cudaStream_t.
 *
 * Conventions for every entry point:
 *  - Pointers named *_cache, q, key, value, output, slot_mapping, block_tables, seq_lens and
 *    workspace are DEVICE pointers. k_cache must be 16-byte aligned and k_block_stride_bytes a
 *    multiple of 16; decode also needs v_cache and v_block_stride_bytes aligned to the width of
 *    its V loads (at most 8 bytes; the packed layouts always are).
 *  - Sizes named *_bytes are in bytes; *_stride without a unit suffix is in ELEMENTS.
 *  - Nothing allocates, synchronises or prints. Every launch is stream-ordered on `stream`
 *    (NULL = the legacy default stream) and can be captured in a CUDA graph.
 *  - All scalar arguments are validated on the host before anything is launched; on failure the
 *    call returns a status != FP8KTURBOV_STATUS_SUCCESS and fp8kturbov_last_error_message()
 *    names the argument and value at fault. Zero work (num_tokens == 0, num_seqs == 0) is a
 *    successful no-op that launches nothing.
 */
#ifndef FP8KTURBOV_H_
#define FP8KTURBOV_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define FP8KTURBOV_API __declspec(dllexport)
#else
#define FP8KTURBOV_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Versions ------------------------------------------------------------------------------ */
#define FP8KTURBOV_VERSION_MAJOR 0
#define FP8KTURBOV_VERSION_MINOR 5
#define FP8KTURBOV_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH */
#define FP8KTURBOV_VERSION \
  (FP8KTURBOV_VERSION_MAJOR * 10000 + FP8KTURBOV_VERSION_MINOR * 100 + FP8KTURBOV_VERSION_PATCH)
/* Bumped on any incompatible change of a signature, struct layout or enum value. */
#define FP8KTURBOV_ABI_VERSION 1

/* ---- Defaults and limits (each written here once; the *_params_init functions and the
 * fixed-argument launchers use them) ---------------------------------------------------------- */
/* fp8kturbov_decode_params_t::sparse_v_threshold of fp8kturbov_decode_params_init. */
#define FP8KTURBOV_DEFAULT_SPARSE_V_THRESHOLD 1e-3f
/* The default V code width (v_bits) of every *_params_init. */
#define FP8KTURBOV_DEFAULT_V_BITS 3
/* Query tokens per sequence of a multi-token decode (max_q_len) at most. */
#define FP8KTURBOV_MAX_QUERY_LEN 16

/* The library's FP8KTURBOV_VERSION and FP8KTURBOV_ABI_VERSION, for checks at load time. */
FP8KTURBOV_API int fp8kturbov_version(void);
FP8KTURBOV_API int fp8kturbov_abi_version(void);
/* The CUDA runtime the library was built with and links statically (CUDART_VERSION, 1000 * major +
 * 10 * minor: 12040 for 12.4): it runs with a driver of that CUDA major or newer. */
FP8KTURBOV_API int fp8kturbov_cuda_runtime_version(void);
/* The source commit the library was built from (`git describe --always --dirty`: an abbreviated
 * hash, "-dirty" with uncommitted changes), or "unknown"; a static string. */
FP8KTURBOV_API const char* fp8kturbov_build_commit(void);

/* ---- Status -------------------------------------------------------------------------------- */
/* Values are append-only. */
typedef enum fp8kturbov_status {
  FP8KTURBOV_STATUS_SUCCESS = 0,
  FP8KTURBOV_STATUS_INVALID_VALUE = 1,     /* a scalar argument out of its range */
  FP8KTURBOV_STATUS_NULL_POINTER = 2,      /* a required pointer is NULL while there is work */
  FP8KTURBOV_STATUS_MISALIGNED = 3,        /* a pointer or stride breaks an alignment rule */
  FP8KTURBOV_STATUS_NOT_SUPPORTED = 4,     /* a configuration this build does not contain */
  FP8KTURBOV_STATUS_BAD_STRUCT_SIZE = 5,   /* params.struct_size unknown to this library */
  FP8KTURBOV_STATUS_CUDA_ERROR = 6         /* the CUDA runtime refused the launch */
} fp8kturbov_status_t;

/* A static string naming the status ("FP8KTURBOV_STATUS_..."); never NULL. */
FP8KTURBOV_API const char* fp8kturbov_status_string(fp8kturbov_status_t status);
/* The detail message of the calling thread's last failed call ("" if none). Valid until this
 * thread's next call into the library. */
FP8KTURBOV_API const char* fp8kturbov_last_error_message(void);

/* Opaque stream handle: pass a CUstream or cudaStream_t (or NULL). */
typedef struct CUstream_st* fp8kturbov_stream_t;

/* ---- Checked mode ------------------------------------------------------------------------------ */
/*
 * Every params struct has two trailing fields, num_blocks and error_flags. With num_blocks = 0
 * (the default) nothing is checked on the device: an out-of-range page id or slot reads or writes
 * outside the pools, as in the original engine. With num_blocks > 0, the number of pages each
 * pool holds, the kernels check every page they are about to touch, skip what is out of range
 * and OR the bits below into the caller's device word *error_flags (required then; 4-byte
 * aligned). The caller zeroes the word, reads it once the stream has reached a point after the
 * launch, and zeroes it again; the library never reads it on the host (no synchronisation).
 * Values are append-only.
 */
typedef enum fp8kturbov_index_error {
  /* write / dequantize: a slot's page (slot / block_size) is >= num_blocks. The write skips the
   * token (nothing written); the dequantize gives its rows as zeros. */
  FP8KTURBOV_INDEX_ERROR_SLOT = 1,
  /* decode, prefill: a block-table entry of an attended position is < 0 or >= num_blocks. The positions
   * of that page are left out of the softmax (neither read nor counted). */
  FP8KTURBOV_INDEX_ERROR_BLOCK_TABLE = 2,
  /* decode, prefill: a seq_len < 0 or > max_blocks_per_seq * block_size. It is clamped to that range,
   * which is also what happens, unreported, with num_blocks = 0. */
  FP8KTURBOV_INDEX_ERROR_SEQ_LEN = 4,
  /* multi-token decode, prefill: query_start[s] < 0, query_start[s + 1] < query_start[s], a q_len above
   * max_q_len, or query_start[s + 1] > num_query_rows. The sequence's outputs are not written.
   * A q_len above the sequence's seq_len is reported too; its rows are computed as the causal
   * rule gives them (a row with no position to attend gets zeros). */
  FP8KTURBOV_INDEX_ERROR_QUERY_START = 8
} fp8kturbov_index_error_t;

/* struct_size: each params struct accepts the size of this header's struct and those of its
 * earlier versions (FP8KTURBOV_*_PARAMS_V1_SIZE: library 0.1, without the checked-mode fields;
 * FP8KTURBOV_{WRITE,DECODE}_PARAMS_V2_SIZE: library 0.2, without v_encoder / sinks, soft_cap
 * and the multi-token fields; FP8KTURBOV_DECODE_PARAMS_V3_SIZE: library 0.3, without
 * block_tables_stride; FP8KTURBOV_DECODE_PARAMS_V4_SIZE: library 0.4, without the append fields),
 * whose missing fields read as 0.
 *
 * Initialising a params struct: fp8kturbov_*_params_init writes the whole struct of the library
 * that runs it, which is only safe for a program built against that library's header (or a
 * newer one). fp8kturbov_*_params_init_sized(params, sizeof *params) writes exactly the caller's
 * struct_size bytes, with the defaults of that version: use it where the program may run with a
 * newer library than its header (a plugin, a system-wide install, another language's binding).
 * It returns FP8KTURBOV_STATUS_NULL_POINTER or _BAD_STRUCT_SIZE (an unknown size) writing
 * nothing, else SUCCESS; the last-error message changes on failure only. */

/* ---- V encoders ------------------------------------------------------------------------------ */
/* How the write chooses a group's codes and scale byte; the bytes format and the decoder are the
 * same for all (docs/format.md §3). Values are append-only. */
typedef enum fp8kturbov_v_encoder {
  /* §3.2, the original engine's "matched-norm" encoder: the default. */
  FP8KTURBOV_V_ENCODER_MATCHED_NORM = 0,
  /* The scale byte (and the codes it implies) with the least squared error after E4M3 rounding,
   * searched over the bytes 0x00..0x7E; bit-exact with the NumPy reference (encoder="mse").
   * It tries 127 scales per group where the default computes one. */
  FP8KTURBOV_V_ENCODER_MSE = 1,
  /* An option: the codes of the least angle to the group among those that the scale bytes
   * 0x01..0x7E imply, with the scale byte that keeps the group's projection on them
   * (|x|^2 / <codes' levels, x>), so that attention's averages are not shrunk; bit-exact with the
   * NumPy reference (encoder="projection"). It tries 126 scales per group. */
  FP8KTURBOV_V_ENCODER_PROJECTION = 2
} fp8kturbov_v_encoder_t;

/* ---- V rotation ------------------------------------------------------------------------------ */
/* The optional rotation of docs/format.md §6, fused into the write (each V head rotated before it
 * is quantised, in float32, no bf16 rounding in between) and into the decode (each output head
 * rotated back). A cache written rotated must be decoded rotated: the pools do not record it.
 * head_dim 128, 256 or 512 only. Values are append-only. */
typedef enum fp8kturbov_v_rotation {
  FP8KTURBOV_V_ROTATION_NONE = 0,     /* the default: V as given */
  FP8KTURBOV_V_ROTATION_HADAMARD = 1  /* y = S2 * (H/sqrt(D)) * S1 * x per head, §6's signs */
} fp8kturbov_v_rotation_t;

/* ---- Layout sizes (host only, no CUDA call) -------------------------------------------------- */
/* Each returns the size in BYTES, or 0 when an argument is invalid (head_dim not a multiple of
 * 16, bits not in {2, 3, 4}, a zero size, a row num_kv_heads*head_dim over 2^32 - 1, which
 * no entry point accepts). */
FP8KTURBOV_API uint64_t fp8kturbov_k_page_bytes(uint32_t block_size, uint32_t num_kv_heads,
                                                uint32_t head_dim);
FP8KTURBOV_API uint64_t fp8kturbov_v_data_section_bytes(uint32_t block_size,
                                                        uint32_t num_kv_heads,
                                                        uint32_t head_dim, uint32_t bits);
FP8KTURBOV_API uint64_t fp8kturbov_v_page_bytes(uint32_t block_size, uint32_t num_kv_heads,
                                                uint32_t head_dim, uint32_t bits);

/* ---- Cache write ----------------------------------------------------------------------------- */
/*
 * Writes num_tokens rows of K and V into the paged pools.
 *  key, value            bf16, token t's row of num_kv_heads*head_dim elements at
 *                        key + t*key_stride / value + t*value_stride (strides in ELEMENTS).
 *  k_cache, v_cache      uint8 pools (page p at p*k_block_stride_bytes / p*v_block_stride_bytes).
 *  slot_mapping          int64 [num_tokens], slot = page*block_size + offset; slot < 0 writes
 *                        nothing (padding).
 *  v_data_section_bytes  byte offset of the scale section inside a V page.
 * A slot's page must lie inside the pools: unless num_blocks is given (checked mode, above), the
 * library does not know their capacity.
 */
typedef struct fp8kturbov_write_params {
  size_t struct_size; /* sizeof(fp8kturbov_write_params_t) of the caller's header */
  const void* key;
  const void* value;
  void* k_cache;
  void* v_cache;
  const int64_t* slot_mapping;
  uint32_t num_tokens;
  uint32_t num_kv_heads;
  uint32_t head_dim;
  uint32_t block_size;
  uint32_t key_stride;   /* elements */
  uint32_t value_stride; /* elements */
  float k_scale;         /* finite, > 0 */
  uint32_t v_bits;       /* 2, 3 or 4 */
  uint64_t k_block_stride_bytes;
  uint64_t v_block_stride_bytes;
  uint64_t v_data_section_bytes;
  uint64_t num_blocks;   /* checked mode: pages per pool; 0 = unchecked */
  uint32_t* error_flags; /* checked mode: device word of fp8kturbov_index_error_t bits */
  uint32_t v_encoder;    /* fp8kturbov_v_encoder_t; default matched-norm */
  uint32_t v_rotation;   /* fp8kturbov_v_rotation_t; default none */
} fp8kturbov_write_params_t;
#define FP8KTURBOV_WRITE_PARAMS_V1_SIZE 104
#define FP8KTURBOV_WRITE_PARAMS_V2_SIZE 120

/* Fills *params with the defaults (struct_size set, v_bits = 3, everything else zero). */
FP8KTURBOV_API void fp8kturbov_write_params_init(fp8kturbov_write_params_t* params);
/* The same for a struct of struct_size bytes: sizeof(fp8kturbov_write_params_t) of the caller's
 * header, this one's or an earlier one's (see struct_size above). See "Initialising a params
 * struct" below. */
FP8KTURBOV_API fp8kturbov_status_t fp8kturbov_write_params_init_sized(
    fp8kturbov_write_params_t* params, size_t struct_size);
FP8KTURBOV_API fp8kturbov_status_t fp8kturbov_reshape_and_cache(
    const fp8kturbov_write_params_t* params, fp8kturbov_stream_t stream);

/* The original engine's launchers, argument for argument (V bits in the name). */
#define FP8KTURBOV_DECLARE_WRITE(BITS)                                                          \
  FP8KTURBOV_API fp8kturbov_status_t fp8kturbov_reshape_and_cache_fp8k_turbo##BITS##v(          \
      const void* key, const void* value, void* k_cache, void* v_cache,                        \
      const int64_t* slot_mapping, uint32_t num_tokens, uint32_t num_kv_heads,                 \
      uint32_t head_dim, uint32_t block_size, uint32_t key_stride, uint32_t value_stride,      \
      float k_scale, uint64_t k_block_stride_bytes, uint64_t v_block_stride_bytes,             \
      uint64_t v_data_section_bytes, fp8kturbov_stream_t stream);
FP8KTURBOV_DECLARE_WRITE(2)
FP8KTURBOV_DECLARE_WRITE(3)
FP8KTURBOV_DECLARE_WRITE(4)
#undef FP8KTURBOV_DECLARE_WRITE

/* ---- Paged decode attention ------------------------------------------------------------------ */
/*
 * One query token per sequence (or, with query_start, up to 16) attends to its cached positions.
 *  q             bf16, query row r, query head h at q + r*q_stride + h*head_dim (q_stride in
 *                ELEMENTS, >= num_q_heads*head_dim). Row r is sequence r, or with query_start
 *                the rows listed there.
 *  output        bf16, dense [rows][num_q_heads][head_dim] (rows = num_seqs, or num_query_rows);
 *                a row with no position to attend (seq_len 0) gets zeros.
 *  block_tables  int32 [num_seqs][max_blocks_per_seq], page ids; with block_tables_stride
 *                (params only), rows that many entries apart, of which the decode reads the
 *                first max_blocks_per_seq.
 *  seq_lens      int32 [num_seqs], cached positions per sequence (the new token included),
 *                0 <= seq_len <= max_blocks_per_seq*block_size.
 *  max_blocks_per_seq  the pages per sequence that the decode may read. The split plan is sized
 *                for that many positions, not for seq_lens (device memory, which the host does
 *                not read): an engine whose table rows are sized for its longest context passes
 *                the row width as block_tables_stride and, as max_blocks_per_seq, the pages of
 *                the batch's longest sequence, so that short batches get a plan for their length.
 *  block_tables_stride  (params only) int32 entries between rows of block_tables,
 *                >= max_blocks_per_seq; 0 = max_blocks_per_seq.
 *  inv_sqrt_d    softmax scale (score = (q . k) * inv_sqrt_d).
 *  sliding_window  0 = off, else only the last sliding_window positions are attended.
 *  sparse_v_threshold  (params only) the V row of a position whose unnormalised weight
 *                exp(score - running max) is <= the threshold may be skipped (it still counts in
 *                the denominator). 0 = exact; the fixed-argument launchers use 1e-3.
 *  sinks         (params only) NULL, or device float32 [num_q_heads]: one logit per query head, in
 *                score units (after inv_sqrt_d and soft_cap), that joins the softmax denominator
 *                only: out = sum_p e^(s_p - m) v_p / (sum_p e^(s_p - m) + e^(sink_h - m)).
 *  soft_cap      (params only) > 0: every score becomes soft_cap * tanh(score / soft_cap) before
 *                the softmax (logit soft-capping); 0 = off. Finite.
 *  query_start   (params only) multi-token decode, for speculative and chunked decode: NULL (one
 *                row per sequence), or device int32 [num_seqs + 1], non-decreasing from 0:
 *                sequence s owns query rows query_start[s] .. query_start[s + 1] - 1, q_len =
 *                query_start[s + 1] - query_start[s] <= min(max_q_len, seq_len) tokens (0 is
 *                allowed). Its token i (row query_start[s] + i) is position seq_len - q_len + i
 *                and attends the positions before end = seq_len - q_len + i + 1 (causal inside
 *                the chunk); the sliding window counts back from that end.
 *  max_q_len     (params only, with query_start) 1..16, the largest q_len; it sizes the grid and
 *                the workspace. Ignored without query_start.
 *  num_query_rows  (params only, with query_start) rows of q and output, query_start[num_seqs];
 *                checked mode keeps every row inside it. Ignored without query_start.
 *  append_*      (params only) the fused append: NULL append_slot_mapping (the default) = off.
 *                Otherwise the decode writes each query row's new token into the cache before
 *                any of it is attended, in the bytes fp8kturbov_write would write (K through
 *                k_scale, V with v_encoder and v_rotation): row r of append_key and append_value
 *                (bf16, [rows][num_kv_heads*head_dim], rows append_key_stride and
 *                append_value_stride ELEMENTS apart, each >= num_kv_heads*head_dim, 2-byte
 *                aligned) goes to slot append_slot_mapping[r] (int64 [rows], 8-byte aligned;
 *                < 0 writes nothing), row r being query row r (the sequence, or with query_start
 *                token i of its sequence, at position seq_len - q_len + i). One launch then does
 *                what fp8kturbov_write followed by this decode does, provided each slot is the one
 *                that block_tables gives its position (the decode reads the token where the table
 *                points). The pools are written through k_cache and v_cache, which must then be
 *                writable. A row whose position is < 0 (q_len > seq_len) is not written; checked
 *                mode skips a slot whose page is >= num_blocks (FP8KTURBOV_INDEX_ERROR_SLOT).
 *  workspace     (params only) caller-owned device scratch of workspace_bytes bytes, 16-byte
 *                aligned. With enough of it (fp8kturbov_paged_decode_workspace_bytes) the context
 *                is split across CTAs so that few sequences still fill the GPU, and a second
 *                kernel merges the splits; with less (or none: the fixed-argument launchers) each
 *                (sequence, KV head) runs in one CTA. The result is deterministic for a given
 *                shape, device and workspace size. The workspace is only used by work on `stream`.
 * Query head h reads KV head h / (num_q_heads / num_kv_heads). Block-table entries of attended
 * positions must be pages inside the pools: checked mode (above) verifies them.
 */
typedef struct fp8kturbov_decode_params {
  size_t struct_size; /* sizeof(fp8kturbov_decode_params_t) of the caller's header */
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* output;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  uint32_t max_blocks_per_seq;
  uint32_t num_seqs;
  uint32_t num_q_heads;
  uint32_t num_kv_heads;
  uint32_t head_dim;
  uint32_t block_size;
  float inv_sqrt_d;
  float k_scale; /* finite, > 0 */
  uint32_t q_stride; /* elements */
  uint32_t v_bits;   /* 2, 3 or 4 */
  uint64_t k_block_stride_bytes; /* 0 = packed (block_size*num_kv_heads*head_dim) */
  uint64_t v_block_stride_bytes;
  uint64_t v_data_section_bytes;
  uint32_t sliding_window;
  float sparse_v_threshold; /* >= 0; default 1e-3 */
  void* workspace;          /* may be NULL */
  uint64_t workspace_bytes;
  uint64_t num_blocks;   /* checked mode: pages per pool; 0 = unchecked */
  uint32_t* error_flags; /* checked mode: device word of fp8kturbov_index_error_t bits */
  const float* sinks;    /* NULL = no sinks; 4-byte aligned */
  float soft_cap;        /* >= 0; 0 = off */
  const int32_t* query_start; /* NULL = one query row per sequence; 4-byte aligned */
  uint32_t max_q_len;         /* 1..16 with query_start */
  uint32_t num_query_rows;    /* rows of q and output with query_start */
  uint32_t v_rotation;        /* fp8kturbov_v_rotation_t the cache was written with; default none */
  uint64_t block_tables_stride; /* int32 entries between rows of block_tables; 0 = max_blocks_per_seq */
  const void* append_key;             /* fused append: bf16 new K rows, or NULL */
  const void* append_value;           /* fused append: bf16 new V rows, or NULL */
  const int64_t* append_slot_mapping; /* fused append: int64 slot per query row; NULL = off */
  uint32_t append_key_stride;         /* elements between rows of append_key */
  uint32_t append_value_stride;       /* elements between rows of append_value */
  uint32_t v_encoder;                 /* fp8kturbov_v_encoder_t of the appended V; default matched-norm */
} fp8kturbov_decode_params_t;
#define FP8KTURBOV_DECODE_PARAMS_V1_SIZE 144
#define FP8KTURBOV_DECODE_PARAMS_V2_SIZE 160
#define FP8KTURBOV_DECODE_PARAMS_V3_SIZE 200
#define FP8KTURBOV_DECODE_PARAMS_V4_SIZE 208

/* Fills *params with the defaults (struct_size set, v_bits = 3, sparse_v_threshold = 1e-3,
 * everything else zero). */
FP8KTURBOV_API void fp8kturbov_decode_params_init(fp8kturbov_decode_params_t* params);
/* The same for a struct of struct_size bytes (see fp8kturbov_write_params_init_sized). */
FP8KTURBOV_API fp8kturbov_status_t fp8kturbov_decode_params_init_sized(
    fp8kturbov_decode_params_t* params, size_t struct_size);
FP8KTURBOV_API fp8kturbov_status_t fp8kturbov_paged_decode_attn(
    const fp8kturbov_decode_params_t* params, fp8kturbov_stream_t stream);
/* Workspace BYTES with which `params` (pointers and workspace fields ignored) runs its full plan
 * on the current device (context splits, head groups: docs/api.md); 0 when neither would help.
 * Validates the scalars like the launch; a host query (device attributes), no synchronisation. */
FP8KTURBOV_API fp8kturbov_status_t fp8kturbov_paged_decode_workspace_bytes(
    const fp8kturbov_decode_params_t* params, uint64_t* workspace_bytes);

/* The original engine's launchers, argument for argument: packed K pages, sparse-V threshold
 * 1e-3. */
#define FP8KTURBOV_DECLARE_DECODE(BITS)                                                         \
  FP8KTURBOV_API fp8kturbov_status_t fp8kturbov_paged_decode_attn_fp8k_turbo##BITS##v(         \
      const void* q, const void* k_cache, const void* v_cache, void* output,                   \
      const int32_t* block_tables, const int32_t* seq_lens, uint32_t max_blocks_per_seq,       \
      uint32_t num_seqs, uint32_t num_q_heads, uint32_t num_kv_heads, uint32_t head_dim,       \
      uint32_t block_size, float inv_sqrt_d, float k_scale, uint32_t q_stride,                 \
      uint64_t v_block_stride_bytes, uint64_t v_data_section_bytes, uint32_t sliding_window,   \
      fp8kturbov_stream_t stream);
FP8KTURBOV_DECLARE_DECODE(2)
FP8KTURBOV_DECLARE_DECODE(3)
FP8KTURBOV_DECLARE_DECODE(4)
#undef FP8KTURBOV_DECLARE_DECODE

/* ---- Paged prefill attention ------------------------------------------------------------------- */
/*
 * Chunked prefill and long verify over the cache: each sequence's chunk of query tokens attends
 * the cached positions before it and itself (causal), on tensor cores. The chunk's own K and V
 * must be in the cache first (fp8kturbov_reshape_and_cache).
 *  q, block_tables, seq_lens, block_size, the pools, inv_sqrt_d, k_scale, sliding_window, sinks,
 *  soft_cap, v_rotation, checked mode: as the decode's (fp8kturbov_decode_params_t).
 *  query_start   device int32 [num_seqs + 1], non-decreasing from 0 (required): sequence s owns
 *                query rows query_start[s] .. query_start[s + 1] - 1, its chunk of q_len tokens;
 *                token i is position seq_len - q_len + i and attends the positions before
 *                seq_len - q_len + i + 1 (the window counts back from there). q_len <= seq_len; a
 *                row whose position is < 0 has no position to attend.
 *  max_q_len     the largest q_len (>= 1; 0 with num_seqs = 0 or nothing to do): it sizes the grid.
 *                A sequence with a longer chunk is not computed (checked mode reports it,
 *                FP8KTURBOV_INDEX_ERROR_QUERY_START).
 *  num_query_rows  rows of q, output and lse, query_start[num_seqs]; checked mode keeps every
 *                sequence's rows inside it.
 *  output        bf16, dense [num_query_rows][num_q_heads][head_dim]; a row with no position to
 *                attend gets zeros.
 *  lse           NULL, or device float32 [num_query_rows][num_q_heads] (4-byte aligned): the
 *                natural log of each row's softmax denominator, log(sum_p e^score_p + e^sink_h),
 *                so that output = sum_p e^(score_p - lse) v_p (the sink term only with sinks);
 *                -inf for a row with no position to attend. With it a caller merges this
 *                attention with another one over other positions (cascade attention).
 *  workspace     caller-owned device scratch (16-byte aligned) of
 *                fp8kturbov_paged_prefill_workspace_bytes bytes, or NULL. With it, where the grid
 *                of (query tile, KV head) CTAs would leave the GPU short of a wave (short chunks over
 *                long contexts), the context is split across CTAs and a second kernel merges the
 *                splits; and where a chunk takes 8 or more 128-row query tiles per KV head (sm_90a), a first
 *                kernel dequantizes each tile of the context once into it for all of them. With
 *                less, the plan drops what does not fit, the splits before the expanded context,
 *                down to each CTA dequantizing and attending its rows' whole range. The result is
 *                deterministic for a given shape, device and workspace size.
 * head_dim 64, 128 or 256 (512: FP8KTURBOV_STATUS_NOT_SUPPORTED). sm_80 and newer.
 */
typedef struct fp8kturbov_prefill_params {
  size_t struct_size; /* sizeof(fp8kturbov_prefill_params_t) of the caller's header */
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* output;
  float* lse;                  /* NULL = not written */
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start;  /* required; 4-byte aligned */
  uint32_t max_blocks_per_seq;
  uint32_t num_seqs;
  uint32_t num_q_heads;
  uint32_t num_kv_heads;
  uint32_t head_dim;
  uint32_t block_size;
  float inv_sqrt_d;
  float k_scale;     /* finite, > 0 */
  uint32_t q_stride; /* elements */
  uint32_t v_bits;   /* 2, 3 or 4 */
  uint64_t k_block_stride_bytes; /* 0 = packed (block_size*num_kv_heads*head_dim) */
  uint64_t v_block_stride_bytes;
  uint64_t v_data_section_bytes;
  uint64_t block_tables_stride;  /* int32 entries between rows of block_tables; 0 = max_blocks_per_seq */
  uint32_t sliding_window;
  float soft_cap;                /* >= 0; 0 = off */
  const float* sinks;            /* NULL = no sinks; 4-byte aligned */
  uint32_t v_rotation;           /* fp8kturbov_v_rotation_t the cache was written with; default none */
  uint32_t max_q_len;
  uint32_t num_query_rows;
  void* workspace;               /* may be NULL */
  uint64_t workspace_bytes;
  uint64_t num_blocks;   /* checked mode: pages per pool; 0 = unchecked */
  uint32_t* error_flags; /* checked mode: device word of fp8kturbov_index_error_t bits */
} fp8kturbov_prefill_params_t;

/* Fills *params with the defaults (struct_size set, v_bits = 3, everything else zero). */
FP8KTURBOV_API void fp8kturbov_prefill_params_init(fp8kturbov_prefill_params_t* params);
/* The same for a struct of struct_size bytes (see fp8kturbov_write_params_init_sized). */
FP8KTURBOV_API fp8kturbov_status_t fp8kturbov_prefill_params_init_sized(
    fp8kturbov_prefill_params_t* params, size_t struct_size);
FP8KTURBOV_API fp8kturbov_status_t fp8kturbov_paged_prefill_attn(
    const fp8kturbov_prefill_params_t* params, fp8kturbov_stream_t stream);
/* Workspace BYTES with which `params` (pointers and workspace fields ignored) runs its full plan
 * on the current device (0 where neither splitting nor dequantizing the context once would help;
 * it grows with num_query_rows, and with num_seqs · num_kv_heads · max_blocks_per_seq for chunks of
 * 8 or more query tiles). Validates the scalars like the launch; a host query (device attributes), no
 * synchronisation. */
FP8KTURBOV_API fp8kturbov_status_t fp8kturbov_paged_prefill_workspace_bytes(
    const fp8kturbov_prefill_params_t* params, uint64_t* workspace_bytes);

/* ---- Dequantize (pages -> bf16) ------------------------------------------------------------ */
/*
 * Reads num_tokens slots of the paged pools back into bf16 rows, the inverse of the write:
 *   K element = E4M3(byte) * k_scale                       (FORMAT §2)
 *   V element = level[code] * E4M3(scale byte of its group)  (FORMAT §3)
 * each product computed in float and rounded to bf16 (round to nearest even). For prefill through
 * a standard attention kernel, for debugging and for offload.
 *  slot_mapping   int64 [num_tokens], slot = page*block_size + offset, as in the write; slot < 0
 *                 gives a row of zeros.
 *  key, value     bf16 outputs: token t's row of num_kv_heads*head_dim elements at
 *                 key + t*key_stride / value + t*value_stride (strides in ELEMENTS).
 * The pools and their layout follow the same rules as the write's, checked mode included.
 */
typedef struct fp8kturbov_dequantize_params {
  size_t struct_size; /* sizeof(fp8kturbov_dequantize_params_t) of the caller's header */
  const void* k_cache;
  const void* v_cache;
  const int64_t* slot_mapping;
  void* key;
  void* value;
  uint32_t num_tokens;
  uint32_t num_kv_heads;
  uint32_t head_dim;
  uint32_t block_size;
  uint32_t key_stride;   /* elements */
  uint32_t value_stride; /* elements */
  float k_scale;         /* finite, > 0 */
  uint32_t v_bits;       /* 2, 3 or 4 */
  uint64_t k_block_stride_bytes;
  uint64_t v_block_stride_bytes;
  uint64_t v_data_section_bytes;
  uint64_t num_blocks;   /* checked mode: pages per pool; 0 = unchecked */
  uint32_t* error_flags; /* checked mode: device word of fp8kturbov_index_error_t bits */
} fp8kturbov_dequantize_params_t;
#define FP8KTURBOV_DEQUANTIZE_PARAMS_V1_SIZE 104

/* Fills *params with the defaults (struct_size set, v_bits = 3, everything else zero). */
FP8KTURBOV_API void fp8kturbov_dequantize_params_init(fp8kturbov_dequantize_params_t* params);
/* The same for a struct of struct_size bytes (see fp8kturbov_write_params_init_sized). */
FP8KTURBOV_API fp8kturbov_status_t fp8kturbov_dequantize_params_init_sized(
    fp8kturbov_dequantize_params_t* params, size_t struct_size);
FP8KTURBOV_API fp8kturbov_status_t fp8kturbov_dequantize(
    const fp8kturbov_dequantize_params_t* params, fp8kturbov_stream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* FP8KTURBOV_H_ */
