/*
 * A C99 consumer of libfp8kturbov.so, compiled against fp8kturbov.h alone (no CUDA header on the
 * include path): versions, status strings, layout sizes, params defaults, one validation error
 * per entry point with its message, and zero-work calls. Nothing here launches a kernel, so it
 * runs the same with or without a GPU.
 *
 * Prints one line per failed check and "N passed, M failed"; exits 1 when a check failed.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "fp8kturbov.h"

static int g_passed = 0;
static int g_failed = 0;

static void check(int ok, const char* what, int line) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    printf("FAILED line %d: %s\n", line, what);
  }
}
#define CHECK(expr) check((expr) != 0, #expr, __LINE__)

/* The call returned `expected` and the thread's message starts with `entry` and holds `text`. */
static void check_failure(fp8kturbov_status_t got, fp8kturbov_status_t expected, const char* entry,
                          const char* text, int line) {
  const char* message = fp8kturbov_last_error_message();
  const size_t entry_len = strlen(entry);
  const int ok = got == expected && strncmp(message, entry, entry_len) == 0 &&
                 message[entry_len] == ':' && strstr(message, text) != NULL;
  check(ok, text, line);
  if (!ok)
    printf("  status %s (expected %s), message \"%s\"\n", fp8kturbov_status_string(got),
           fp8kturbov_status_string(expected), message);
}
#define CHECK_FAILURE(call, expected, entry, text) \
  check_failure((call), (expected), (entry), (text), __LINE__)

/* The call succeeded and left no message. */
#define CHECK_SUCCESS(call)                                                                 \
  check((call) == FP8KTURBOV_STATUS_SUCCESS && fp8kturbov_last_error_message()[0] == '\0', \
        #call, __LINE__)

/* A layout every entry point accepts: B = 16 tokens, 2 KV heads of D = 128, 4 query heads. */
enum { B = 16, HKV = 2, HQ = 4, D = 128, N = HKV * D };
#define K_PAGE ((uint64_t)B * N)
#define V_DATA(bits) ((uint64_t)B * N * (bits) / 8)
#define V_PAGE(bits) (V_DATA(bits) + (uint64_t)B * N / 16)

static void test_versions(void) {
  CHECK(fp8kturbov_version() == FP8KTURBOV_VERSION);
  CHECK(fp8kturbov_version() == FP8KTURBOV_VERSION_MAJOR * 10000 + FP8KTURBOV_VERSION_MINOR * 100 +
                                    FP8KTURBOV_VERSION_PATCH);
  CHECK(fp8kturbov_abi_version() == FP8KTURBOV_ABI_VERSION);
}

static void test_status_strings(void) {
#define STATUS(name) {name, #name}
  static const struct {
    fp8kturbov_status_t status;
    const char* name;
  } statuses[] = {STATUS(FP8KTURBOV_STATUS_SUCCESS),       STATUS(FP8KTURBOV_STATUS_INVALID_VALUE),
                  STATUS(FP8KTURBOV_STATUS_NULL_POINTER),  STATUS(FP8KTURBOV_STATUS_MISALIGNED),
                  STATUS(FP8KTURBOV_STATUS_NOT_SUPPORTED), STATUS(FP8KTURBOV_STATUS_BAD_STRUCT_SIZE),
                  STATUS(FP8KTURBOV_STATUS_CUDA_ERROR)};
#undef STATUS
  size_t i;
  for (i = 0; i < sizeof statuses / sizeof statuses[0]; ++i)
    CHECK(strcmp(fp8kturbov_status_string(statuses[i].status), statuses[i].name) == 0);
  CHECK(fp8kturbov_status_string((fp8kturbov_status_t)99) != NULL);
}

static void test_sizes(void) {
  /* FORMAT §2, §3: K page B·n; V data B·n·b/8; V page 9/7/5 · B·n/16 for 4/3/2 bits. */
  static const uint64_t sixteenths[5] = {0, 0, 5, 7, 9};
  uint32_t bits;
  CHECK(fp8kturbov_k_page_bytes(B, HKV, D) == K_PAGE);
  for (bits = 2; bits <= 4; ++bits) {
    CHECK(fp8kturbov_v_data_section_bytes(B, HKV, D, bits) == V_DATA(bits));
    CHECK(fp8kturbov_v_page_bytes(B, HKV, D, bits) == sixteenths[bits] * B * N / 16);
    CHECK(fp8kturbov_v_page_bytes(B, HKV, D, bits) == V_PAGE(bits));
  }
  CHECK(fp8kturbov_k_page_bytes(B, HKV, 100) == 0);
  CHECK(fp8kturbov_k_page_bytes(0, HKV, D) == 0);
  CHECK(fp8kturbov_v_data_section_bytes(B, HKV, D, 5) == 0);
  CHECK(fp8kturbov_v_page_bytes(B, HKV, D, 1) == 0);
}

/* Valid parameters (packed pages, 3-bit V, NULL pointers, zero work). */
/* The token-row fields that the write and the dequantize structs share, for the layout above. */
#define SET_TOKEN_ROWS(p)                \
  do {                                   \
    (p).num_kv_heads = HKV;              \
    (p).head_dim = D;                    \
    (p).block_size = B;                  \
    (p).key_stride = N;                  \
    (p).value_stride = N;                \
    (p).k_scale = 1.0f;                  \
    (p).k_block_stride_bytes = K_PAGE;   \
    (p).v_block_stride_bytes = V_PAGE(3); \
    (p).v_data_section_bytes = V_DATA(3); \
  } while (0)

static fp8kturbov_write_params_t valid_write(void) {
  fp8kturbov_write_params_t p;
  fp8kturbov_write_params_init(&p);
  SET_TOKEN_ROWS(p);
  return p;
}

static fp8kturbov_dequantize_params_t valid_dequantize(void) {
  fp8kturbov_dequantize_params_t p;
  fp8kturbov_dequantize_params_init(&p);
  SET_TOKEN_ROWS(p);
  return p;
}

static fp8kturbov_decode_params_t valid_decode(void) {
  fp8kturbov_decode_params_t p;
  fp8kturbov_decode_params_init(&p);
  p.max_blocks_per_seq = 4;
  p.num_q_heads = HQ;
  p.num_kv_heads = HKV;
  p.head_dim = D;
  p.block_size = B;
  p.inv_sqrt_d = 0.088388f;
  p.k_scale = 1.0f;
  p.q_stride = HQ * D;
  p.v_block_stride_bytes = V_PAGE(3);
  p.v_data_section_bytes = V_DATA(3);
  return p;
}

static void test_params_init(void) {
  fp8kturbov_write_params_t w;
  fp8kturbov_decode_params_t d;
  memset(&w, 0xab, sizeof w);
  memset(&d, 0xab, sizeof d);
  fp8kturbov_write_params_init(&w);
  fp8kturbov_decode_params_init(&d);
  CHECK(w.struct_size == sizeof w);
  CHECK(w.v_bits == 3);
  CHECK(w.key == NULL && w.slot_mapping == NULL && w.num_tokens == 0 && w.k_scale == 0.0f);
  CHECK(w.k_block_stride_bytes == 0 && w.v_data_section_bytes == 0);
  CHECK(d.struct_size == sizeof d);
  CHECK(d.v_bits == 3);
  CHECK(d.sparse_v_threshold == 1e-3f);
  CHECK(d.q == NULL && d.seq_lens == NULL && d.num_seqs == 0 && d.sliding_window == 0);
  CHECK(d.inv_sqrt_d == 0.0f && d.k_block_stride_bytes == 0);
}

static void test_generic_entry_points(void) {
  const char* write = "fp8kturbov_reshape_and_cache";
  const char* decode = "fp8kturbov_paged_decode_attn";
  fp8kturbov_write_params_t w = valid_write();
  fp8kturbov_decode_params_t d = valid_decode();

  CHECK_SUCCESS(fp8kturbov_reshape_and_cache(&w, NULL));
  CHECK_SUCCESS(fp8kturbov_paged_decode_attn(&d, NULL));

  w.k_scale = 0.0f;
  CHECK_FAILURE(fp8kturbov_reshape_and_cache(&w, NULL), FP8KTURBOV_STATUS_INVALID_VALUE, write,
                "k_scale = 0");
  w = valid_write();
  w.num_tokens = 1; /* work, and every pointer NULL */
  CHECK_FAILURE(fp8kturbov_reshape_and_cache(&w, NULL), FP8KTURBOV_STATUS_NULL_POINTER, write,
                "key is NULL");
  w = valid_write();
  w.struct_size = sizeof w + 8;
  CHECK_FAILURE(fp8kturbov_reshape_and_cache(&w, NULL), FP8KTURBOV_STATUS_BAD_STRUCT_SIZE, write,
                "struct_size");
  CHECK_FAILURE(fp8kturbov_reshape_and_cache(NULL, NULL), FP8KTURBOV_STATUS_NULL_POINTER, write,
                "params is NULL");

  d.num_q_heads = 3;
  CHECK_FAILURE(fp8kturbov_paged_decode_attn(&d, NULL), FP8KTURBOV_STATUS_INVALID_VALUE, decode,
                "num_q_heads = 3");
  d = valid_decode();
  d.v_bits = 5;
  CHECK_FAILURE(fp8kturbov_paged_decode_attn(&d, NULL), FP8KTURBOV_STATUS_INVALID_VALUE, decode,
                "v_bits = 5");
  d = valid_decode();
  d.k_block_stride_bytes = K_PAGE + 8;
  CHECK_FAILURE(fp8kturbov_paged_decode_attn(&d, NULL), FP8KTURBOV_STATUS_MISALIGNED, decode,
                "k_block_stride_bytes");

  /* A success clears the message of the failure before it. */
  d = valid_decode();
  CHECK_SUCCESS(fp8kturbov_paged_decode_attn(&d, NULL));
}

static void test_fixed_bits_entry_points(void) {
  /* Zero work with NULL pointers: a successful no-op. */
  CHECK_SUCCESS(fp8kturbov_reshape_and_cache_fp8k_turbo2v(NULL, NULL, NULL, NULL, NULL, 0, HKV, D,
                                                          B, N, N, 1.0f, K_PAGE, V_PAGE(2),
                                                          V_DATA(2), NULL));
  CHECK_SUCCESS(fp8kturbov_paged_decode_attn_fp8k_turbo4v(NULL, NULL, NULL, NULL, NULL, NULL, 4, 0,
                                                          HQ, HKV, D, B, 0.088388f, 1.0f, HQ * D,
                                                          V_PAGE(4), V_DATA(4), 0, NULL));

  CHECK_FAILURE(fp8kturbov_reshape_and_cache_fp8k_turbo2v(NULL, NULL, NULL, NULL, NULL, 0, HKV, D,
                                                          B, N - 1, N, 1.0f, K_PAGE, V_PAGE(2),
                                                          V_DATA(2), NULL),
                FP8KTURBOV_STATUS_INVALID_VALUE, "fp8kturbov_reshape_and_cache_fp8k_turbo2v",
                "key_stride = 255");
  CHECK_FAILURE(fp8kturbov_reshape_and_cache_fp8k_turbo3v(NULL, NULL, NULL, NULL, NULL, 0, HKV,
                                                          100, B, N, N, 1.0f, K_PAGE, V_PAGE(3),
                                                          V_DATA(3), NULL),
                FP8KTURBOV_STATUS_INVALID_VALUE, "fp8kturbov_reshape_and_cache_fp8k_turbo3v",
                "head_dim = 100");
  CHECK_FAILURE(fp8kturbov_reshape_and_cache_fp8k_turbo4v(NULL, NULL, (void*)(uintptr_t)8, NULL,
                                                          NULL, 0, HKV, D, B, N, N, 1.0f, K_PAGE,
                                                          V_PAGE(4), V_DATA(4), NULL),
                FP8KTURBOV_STATUS_MISALIGNED, "fp8kturbov_reshape_and_cache_fp8k_turbo4v",
                "k_cache");
  CHECK_FAILURE(fp8kturbov_paged_decode_attn_fp8k_turbo2v(NULL, NULL, NULL, NULL, NULL, NULL, 4, 0,
                                                          HQ, HKV, 80, B, 0.1f, 1.0f, HQ * 80,
                                                          V_PAGE(2), V_DATA(2), 0, NULL),
                FP8KTURBOV_STATUS_NOT_SUPPORTED, "fp8kturbov_paged_decode_attn_fp8k_turbo2v",
                "head_dim = 80");
  CHECK_FAILURE(fp8kturbov_paged_decode_attn_fp8k_turbo3v(NULL, NULL, NULL, NULL, NULL, NULL, 4, 0,
                                                          HQ, HKV, D, B, (float)NAN, 1.0f, HQ * D,
                                                          V_PAGE(3), V_DATA(3), 0, NULL),
                FP8KTURBOV_STATUS_INVALID_VALUE, "fp8kturbov_paged_decode_attn_fp8k_turbo3v",
                "inv_sqrt_d = nan");
  CHECK_FAILURE(fp8kturbov_paged_decode_attn_fp8k_turbo4v(NULL, NULL, NULL, NULL, NULL, NULL, 0, 0,
                                                          HQ, HKV, D, B, 0.1f, 1.0f, HQ * D,
                                                          V_PAGE(4), V_DATA(4), 0, NULL),
                FP8KTURBOV_STATUS_INVALID_VALUE, "fp8kturbov_paged_decode_attn_fp8k_turbo4v",
                "max_blocks_per_seq = 0");
}

static void test_dequantize_entry_point(void) {
  const char* name = "fp8kturbov_dequantize";
  fp8kturbov_dequantize_params_t p = valid_dequantize();
  CHECK(p.struct_size == sizeof p && p.v_bits == 3);
  CHECK_SUCCESS(fp8kturbov_dequantize(&p, NULL));
  p.value_stride = N - 1;
  CHECK_FAILURE(fp8kturbov_dequantize(&p, NULL), FP8KTURBOV_STATUS_INVALID_VALUE, name,
                "value_stride = ");
  p = valid_dequantize();
  p.num_tokens = 1; /* work, and every pointer NULL */
  CHECK_FAILURE(fp8kturbov_dequantize(&p, NULL), FP8KTURBOV_STATUS_NULL_POINTER, name,
                "k_cache is NULL");
  p = valid_dequantize();
  p.struct_size = sizeof p - 8;
  CHECK_FAILURE(fp8kturbov_dequantize(&p, NULL), FP8KTURBOV_STATUS_BAD_STRUCT_SIZE, name,
                "struct_size");
}

int main(void) {
  test_versions();
  test_status_strings();
  test_sizes();
  test_params_init();
  test_generic_entry_points();
  test_fixed_bits_entry_points();
  test_dequantize_entry_point();
  printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
