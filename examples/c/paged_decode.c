/*
 * fp8kturbov from C, the way an inference engine uses it: the engine owns every device buffer (here
 * through the CUDA runtime API), the library only launches kernels on them.
 *
 *  1. random bf16 K, V and queries on the host (Gaussian), copied to the device;
 *  2. fp8kturbov_reshape_and_cache writes every cached position of five sequences (seq_lens 37,
 *     1, 0, 200, 16) into a paged pool whose pages are handed out in shuffled order, plus one
 *     padding token (slot -1, NaN data) that must write nothing;
 *  3. fp8kturbov_paged_decode_attn runs twice, with the split workspace of
 *     fp8kturbov_paged_decode_workspace_bytes and without one;
 *  4. each output is checked against float64 attention computed on the host from the original
 *     (unquantised) K and V: every value finite, zeros for seq_len 0, and a relative error per
 *     (sequence, query head) below the tolerance of the V width (see kTolerance).
 *
 * Usage: fp8kturbov_example [v_bits]      v_bits 2, 3 or 4 (default 3), compiled into the library
 * Exit status: 0 passed, 1 a check or call failed, 2 bad usage, 77 no usable CUDA GPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include <fp8kturbov.h>

enum {
  EXIT_PASSED = 0,
  EXIT_FAILED = 1,
  EXIT_USAGE = 2,
  EXIT_NO_GPU = 77 /* the usual "skipped" status of test drivers (CTest SKIP_RETURN_CODE) */
};

/* The model: 8 query heads sharing 2 KV heads (GQA group of 4), head_dim 128, 16 tokens a page. */
enum {
  BLOCK_SIZE = 16,
  NUM_KV_HEADS = 2,
  NUM_Q_HEADS = 8,
  HEAD_DIM = 128,
  ROW = NUM_KV_HEADS * HEAD_DIM, /* elements of one token's K (or V) row */
  NUM_SEQS = 5,
  MAX_BLOCKS_PER_SEQ = 13, /* ceil(200 / 16) */
  NUM_BLOCKS = 24          /* pages in the pool; 18 are used */
};
static const int32_t kSeqLens[NUM_SEQS] = {37, 1, 0, 200, 16};

/*
 * Tolerance on |out - ref|_2 / |ref|_2 per (sequence, query head), by V bits (index).
 * The reference uses the bf16 inputs before the cache's quantisation, so the error is that of the
 * format itself, dominated by V: a 16-element group of Gaussian values keeps 2^bits Lloyd-Max
 * levels and one E4M3 scale, a relative error per element of about 0.36 / 0.16 / 0.08 for 2 / 3 /
 * 4 bits; attention averages rows whose errors are independent, so the output keeps about the
 * same relative error. A model of exactly this example with the NumPy reference of the format
 * (1280 heads) gave a mean of 0.36 / 0.157 / 0.079 and a maximum of 0.47 / 0.20 / 0.10. FP8 K
 * (about 3% per element) moves the softmax weights by about 1%, the bf16 output rounding is
 * 0.4%, and the sparse-V skip (weights <= 1e-3 of the running maximum) is negligible here.
 * The tolerances leave a margin of about 1.3-1.5x over the worst case seen, while a layout
 * mistake (a wrong page, token, head or scale) gives errors near 1 or above (an unrelated row:
 * about sqrt(2)).
 */
static const double kTolerance[5] = {0.0, 0.0, 0.60, 0.30, 0.16};

/* ---- Helpers ------------------------------------------------------------------------------------ */

/* float -> bf16 bits, round to nearest even (NaN stays a quiet NaN). */
static uint16_t float_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x0040u);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

static float bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* Deterministic Gaussian numbers: splitmix64 and Box-Muller. */
static uint64_t g_rng_state = 0x243F6A8885A308D3u;

static uint64_t next_u64(void) {
  uint64_t z = (g_rng_state += 0x9E3779B97F4A7C15u);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
  return z ^ (z >> 31);
}

static double uniform_open01(void) { /* in (0, 1) */
  return ((double)(next_u64() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double gaussian(void) {
  const double two_pi = 6.283185307179586;
  return sqrt(-2.0 * log(uniform_open01())) * cos(two_pi * uniform_open01());
}

/* A bf16 Gaussian value: the bits go to the device, the same value (as float) to the reference. */
static void random_bf16(uint16_t* bits, float* value) {
  *bits = float_to_bf16((float)gaussian());
  *value = bf16_to_float(*bits);
}

static void* xmalloc(size_t bytes) {
  void* p = malloc(bytes);
  if (p == NULL) {
    fprintf(stderr, "out of host memory (%lu bytes)\n", (unsigned long)bytes);
    exit(EXIT_FAILED);
  }
  return p;
}

/* Every CUDA and fp8kturbov call is checked; a failure prints the call and exits. */
static void check_cuda(cudaError_t err, const char* call, int line) {
  if (err != cudaSuccess) {
    fprintf(stderr, "line %d: %s failed: %s (%s)\n", line, call, cudaGetErrorName(err),
            cudaGetErrorString(err));
    exit(EXIT_FAILED);
  }
}
#define CUDA_CHECK(call) check_cuda((call), #call, __LINE__)

static void check_fp8kturbov(fp8kturbov_status_t status, const char* call, int line) {
  if (status != FP8KTURBOV_STATUS_SUCCESS) {
    fprintf(stderr, "line %d: %s failed: %s: %s\n", line, call, fp8kturbov_status_string(status),
            fp8kturbov_last_error_message());
    exit(EXIT_FAILED);
  }
}
#define FP8KTURBOV_CHECK(call) check_fp8kturbov((call), #call, __LINE__)

/* ---- The host reference --------------------------------------------------------------------------- */

/* out[h][d] = softmax_p((q_h . k_p) * inv_sqrt_d) . v_p[d] over the sequence's positions, in float64,
 * with query head h reading KV head h / (NUM_Q_HEADS / NUM_KV_HEADS). k and v hold the sequence's
 * rows [seq_len][ROW]; seq_len > 0. */
static void reference_attention(const float* q, const float* k, const float* v, int seq_len,
                                float inv_sqrt_d, double* out /* [NUM_Q_HEADS][HEAD_DIM] */) {
  double* scores = (double*)xmalloc((size_t)seq_len * sizeof(double));
  int h, p, d;
  for (h = 0; h < NUM_Q_HEADS; ++h) {
    const int kv = h / (NUM_Q_HEADS / NUM_KV_HEADS);
    const float* qh = q + h * HEAD_DIM;
    double max_score = -HUGE_VAL, denominator = 0.0;
    double* oh = out + h * HEAD_DIM;
    for (p = 0; p < seq_len; ++p) {
      const float* kp = k + (size_t)p * ROW + kv * HEAD_DIM;
      double dot = 0.0;
      for (d = 0; d < HEAD_DIM; ++d) dot += (double)qh[d] * kp[d];
      scores[p] = dot * inv_sqrt_d;
      if (scores[p] > max_score) max_score = scores[p];
    }
    for (d = 0; d < HEAD_DIM; ++d) oh[d] = 0.0;
    for (p = 0; p < seq_len; ++p) {
      const float* vp = v + (size_t)p * ROW + kv * HEAD_DIM;
      const double w = exp(scores[p] - max_score);
      denominator += w;
      for (d = 0; d < HEAD_DIM; ++d) oh[d] += w * vp[d];
    }
    for (d = 0; d < HEAD_DIM; ++d) oh[d] /= denominator;
  }
  free(scores);
}

/* ---- The example --------------------------------------------------------------------------------- */

int main(int argc, char** argv) {
  const float inv_sqrt_d = (float)(1.0 / sqrt((double)HEAD_DIM));
  uint32_t v_bits = 3;
  int device_count = 0, device = 0, cc_major = 0, cc_minor = 0, failures = 0;
  int s, h, d, p, pass;
  uint32_t num_tokens = 0, t;
  int32_t token_base[NUM_SEQS];
  int32_t block_tables[NUM_SEQS][MAX_BLOCKS_PER_SEQ];
  int32_t pages[NUM_BLOCKS];
  uint64_t k_page, v_page, v_data, workspace_bytes = 0;
  float k_amax = 0.0f, k_scale;
  uint16_t *key_bits, *value_bits, *q_bits, *out_bits;
  float *key, *value, *q;
  int64_t* slot_mapping;
  double* ref;
  cudaError_t probe;
  cudaStream_t stream;
  void *d_key, *d_value, *d_q, *d_out, *d_k_pool, *d_v_pool, *d_workspace = NULL;
  int64_t* d_slot_mapping;
  int32_t *d_block_tables, *d_seq_lens;
  fp8kturbov_write_params_t wp;
  fp8kturbov_decode_params_t dp;
  const size_t out_elems = (size_t)NUM_SEQS * NUM_Q_HEADS * HEAD_DIM;
  const size_t q_elems = (size_t)NUM_SEQS * NUM_Q_HEADS * HEAD_DIM;

  if (argc > 2 || (argc == 2 && (strlen(argv[1]) != 1 || argv[1][0] < '2' || argv[1][0] > '4'))) {
    fprintf(stderr, "usage: %s [v_bits]   (v_bits: 2, 3 or 4; default 3)\n", argv[0]);
    return EXIT_USAGE;
  }
  if (argc == 2) v_bits = (uint32_t)(argv[1][0] - '0');

  /* The header and the library must agree (host only, no GPU needed). */
  printf("fp8kturbov %d (ABI %d), header %d (ABI %d)\n", fp8kturbov_version(),
         fp8kturbov_abi_version(), FP8KTURBOV_VERSION, FP8KTURBOV_ABI_VERSION);
  if (fp8kturbov_abi_version() != FP8KTURBOV_ABI_VERSION) {
    fprintf(stderr, "ABI mismatch between fp8kturbov.h and the loaded library\n");
    return EXIT_FAILED;
  }

  probe = cudaGetDeviceCount(&device_count);
  if (probe != cudaSuccess || device_count == 0) {
    printf("SKIPPED: no usable CUDA GPU (%s)\n",
           probe != cudaSuccess ? cudaGetErrorString(probe) : "no device");
    return EXIT_NO_GPU;
  }
  CUDA_CHECK(cudaSetDevice(device));
  CUDA_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, device));
  printf("device %d: compute capability %d.%d; %d query heads, %d KV heads, head_dim %d, "
         "block_size %d, V bits %u\n",
         device, cc_major, cc_minor, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
         (unsigned)v_bits);

  /* Page sizes (host only): K and V pools are arrays of pages of these sizes. */
  k_page = fp8kturbov_k_page_bytes(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM);
  v_page = fp8kturbov_v_page_bytes(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, v_bits);
  v_data = fp8kturbov_v_data_section_bytes(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, v_bits);
  if (k_page == 0 || v_page == 0 || v_data == 0) {
    fprintf(stderr, "page size query returned 0\n");
    return EXIT_FAILED;
  }

  /* Block tables: pages handed out in a shuffled order (Fisher-Yates), unused entries 0. */
  for (p = 0; p < NUM_BLOCKS; ++p) pages[p] = p;
  for (p = NUM_BLOCKS - 1; p > 0; --p) {
    const int j = (int)(next_u64() % (uint64_t)(p + 1));
    const int32_t tmp = pages[p];
    pages[p] = pages[j];
    pages[j] = tmp;
  }
  memset(block_tables, 0, sizeof block_tables);
  p = 0;
  for (s = 0; s < NUM_SEQS; ++s) {
    int b;
    token_base[s] = (int32_t)num_tokens;
    num_tokens += (uint32_t)kSeqLens[s];
    for (b = 0; b * BLOCK_SIZE < kSeqLens[s]; ++b) block_tables[s][b] = pages[p++];
  }
  ++num_tokens; /* the padding token, last */

  /* Host data: token t's K and V rows, its slot, and one query per sequence. */
  key_bits = (uint16_t*)xmalloc((size_t)num_tokens * ROW * sizeof(uint16_t));
  value_bits = (uint16_t*)xmalloc((size_t)num_tokens * ROW * sizeof(uint16_t));
  key = (float*)xmalloc((size_t)num_tokens * ROW * sizeof(float));
  value = (float*)xmalloc((size_t)num_tokens * ROW * sizeof(float));
  slot_mapping = (int64_t*)xmalloc((size_t)num_tokens * sizeof(int64_t));
  q_bits = (uint16_t*)xmalloc(q_elems * sizeof(uint16_t));
  q = (float*)xmalloc(q_elems * sizeof(float));
  out_bits = (uint16_t*)xmalloc(out_elems * sizeof(uint16_t));
  ref = (double*)xmalloc(out_elems * sizeof(double));
  for (s = 0; s < NUM_SEQS; ++s) {
    for (p = 0; p < kSeqLens[s]; ++p) {
      const size_t row = (size_t)(token_base[s] + p) * ROW;
      slot_mapping[token_base[s] + p] =
          (int64_t)block_tables[s][p / BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE;
      for (d = 0; d < ROW; ++d) {
        random_bf16(&key_bits[row + d], &key[row + d]);
        random_bf16(&value_bits[row + d], &value[row + d]);
        if (fabsf(key[row + d]) > k_amax) k_amax = fabsf(key[row + d]);
      }
    }
  }
  slot_mapping[num_tokens - 1] = -1; /* padding: writes nothing, whatever its data */
  for (d = 0; d < ROW; ++d) {
    const size_t row = (size_t)(num_tokens - 1) * ROW;
    key_bits[row + d] = value_bits[row + d] = 0x7FC0u; /* NaN */
    key[row + d] = value[row + d] = bf16_to_float(0x7FC0u);
  }
  for (t = 0; t < q_elems; ++t) random_bf16(&q_bits[t], &q[t]);
  /* The per-tensor K scale maps the largest |K| to E4M3's largest finite value, 448. */
  k_scale = k_amax / 448.0f;

  /* Device buffers: owned by the caller (the engine), never by the library. */
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_CHECK(cudaMalloc(&d_key, (size_t)num_tokens * ROW * sizeof(uint16_t)));
  CUDA_CHECK(cudaMalloc(&d_value, (size_t)num_tokens * ROW * sizeof(uint16_t)));
  CUDA_CHECK(cudaMalloc((void**)&d_slot_mapping, (size_t)num_tokens * sizeof(int64_t)));
  CUDA_CHECK(cudaMalloc(&d_k_pool, (size_t)(NUM_BLOCKS * k_page)));
  CUDA_CHECK(cudaMalloc(&d_v_pool, (size_t)(NUM_BLOCKS * v_page)));
  CUDA_CHECK(cudaMalloc(&d_q, q_elems * sizeof(uint16_t)));
  CUDA_CHECK(cudaMalloc(&d_out, out_elems * sizeof(uint16_t)));
  CUDA_CHECK(cudaMalloc((void**)&d_block_tables, sizeof block_tables));
  CUDA_CHECK(cudaMalloc((void**)&d_seq_lens, sizeof kSeqLens));
  CUDA_CHECK(cudaMemcpyAsync(d_key, key_bits, (size_t)num_tokens * ROW * sizeof(uint16_t),
                             cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(d_value, value_bits, (size_t)num_tokens * ROW * sizeof(uint16_t),
                             cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(d_slot_mapping, slot_mapping, (size_t)num_tokens * sizeof(int64_t),
                             cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(d_q, q_bits, q_elems * sizeof(uint16_t), cudaMemcpyHostToDevice,
                             stream));
  CUDA_CHECK(cudaMemcpyAsync(d_block_tables, block_tables, sizeof block_tables,
                             cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(d_seq_lens, kSeqLens, sizeof kSeqLens, cudaMemcpyHostToDevice,
                             stream));
  CUDA_CHECK(cudaMemsetAsync(d_k_pool, 0, (size_t)(NUM_BLOCKS * k_page), stream));
  CUDA_CHECK(cudaMemsetAsync(d_v_pool, 0, (size_t)(NUM_BLOCKS * v_page), stream));

  /* 1. Cache write: every token in one launch. (cudaStream_t and the library's stream handle are
   *    the same type, struct CUstream_st *.) */
  fp8kturbov_write_params_init(&wp);
  wp.key = d_key;
  wp.value = d_value;
  wp.k_cache = d_k_pool;
  wp.v_cache = d_v_pool;
  wp.slot_mapping = d_slot_mapping;
  wp.num_tokens = num_tokens;
  wp.num_kv_heads = NUM_KV_HEADS;
  wp.head_dim = HEAD_DIM;
  wp.block_size = BLOCK_SIZE;
  wp.key_stride = ROW;
  wp.value_stride = ROW;
  wp.k_scale = k_scale;
  wp.v_bits = v_bits;
  wp.k_block_stride_bytes = k_page;
  wp.v_block_stride_bytes = v_page;
  wp.v_data_section_bytes = v_data;
  FP8KTURBOV_CHECK(fp8kturbov_reshape_and_cache(&wp, stream));

  /* 2. Decode attention, one query token per sequence. */
  fp8kturbov_decode_params_init(&dp); /* sparse_v_threshold 1e-3, as engines run it */
  dp.q = d_q;
  dp.k_cache = d_k_pool;
  dp.v_cache = d_v_pool;
  dp.output = d_out;
  dp.block_tables = d_block_tables;
  dp.seq_lens = d_seq_lens;
  dp.max_blocks_per_seq = MAX_BLOCKS_PER_SEQ;
  dp.num_seqs = NUM_SEQS;
  dp.num_q_heads = NUM_Q_HEADS;
  dp.num_kv_heads = NUM_KV_HEADS;
  dp.head_dim = HEAD_DIM;
  dp.block_size = BLOCK_SIZE;
  dp.inv_sqrt_d = inv_sqrt_d;
  dp.k_scale = k_scale;
  dp.q_stride = NUM_Q_HEADS * HEAD_DIM;
  dp.v_bits = v_bits;
  dp.k_block_stride_bytes = k_page;
  dp.v_block_stride_bytes = v_page;
  dp.v_data_section_bytes = v_data;
  /* The workspace size depends on the shape and the device only: query it once, keep the buffer. */
  FP8KTURBOV_CHECK(fp8kturbov_paged_decode_workspace_bytes(&dp, &workspace_bytes));
  if (workspace_bytes > 0) CUDA_CHECK(cudaMalloc(&d_workspace, (size_t)workspace_bytes));

  /* The float64 reference from the original K and V. */
  for (s = 0; s < NUM_SEQS; ++s) {
    double* rs = ref + (size_t)s * NUM_Q_HEADS * HEAD_DIM;
    if (kSeqLens[s] == 0) {
      for (d = 0; d < NUM_Q_HEADS * HEAD_DIM; ++d) rs[d] = 0.0;
    } else {
      reference_attention(q + (size_t)s * NUM_Q_HEADS * HEAD_DIM,
                          key + (size_t)token_base[s] * ROW, value + (size_t)token_base[s] * ROW,
                          kSeqLens[s], inv_sqrt_d, rs);
    }
  }

  for (pass = 0; pass < 2; ++pass) {
    const int split = pass == 0;
    double max_rel = 0.0, sum_rel = 0.0;
    int heads = 0, pass_failures = 0;
    dp.workspace = split ? d_workspace : NULL;
    dp.workspace_bytes = split ? workspace_bytes : 0;
    /* 0xFFFF is a bf16 NaN: every output the kernel fails to write shows up. */
    CUDA_CHECK(cudaMemsetAsync(d_out, 0xFF, out_elems * sizeof(uint16_t), stream));
    FP8KTURBOV_CHECK(fp8kturbov_paged_decode_attn(&dp, stream));
    CUDA_CHECK(cudaMemcpyAsync(out_bits, d_out, out_elems * sizeof(uint16_t),
                               cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));

    for (s = 0; s < NUM_SEQS; ++s) {
      for (h = 0; h < NUM_Q_HEADS; ++h) {
        const size_t base = ((size_t)s * NUM_Q_HEADS + h) * HEAD_DIM;
        double err2 = 0.0, ref2 = 0.0, rel;
        int finite = 1, zero = 1;
        for (d = 0; d < HEAD_DIM; ++d) {
          const float o = bf16_to_float(out_bits[base + d]);
          const double diff = (double)o - ref[base + d];
          if (!isfinite(o)) finite = 0;
          if (o != 0.0f) zero = 0;
          err2 += diff * diff;
          ref2 += ref[base + d] * ref[base + d];
        }
        if (!finite) {
          printf("FAILED: sequence %d, head %d: non-finite output\n", s, h);
          ++pass_failures;
          continue;
        }
        if (kSeqLens[s] == 0) {
          if (!zero) {
            printf("FAILED: sequence %d (seq_len 0), head %d: output not zero\n", s, h);
            ++pass_failures;
          }
          continue;
        }
        rel = sqrt(err2 / ref2);
        ++heads;
        sum_rel += rel;
        if (rel > max_rel) max_rel = rel;
        if (!(rel <= kTolerance[v_bits])) {
          printf("FAILED: sequence %d (seq_len %d), head %d: relative error %.4f > %.2f\n", s,
                 kSeqLens[s], h, rel, kTolerance[v_bits]);
          ++pass_failures;
        }
      }
    }
    printf("decode, workspace %lu bytes: %d heads, relative error mean %.4f, max %.4f "
           "(tolerance %.2f): %s\n",
           (unsigned long)dp.workspace_bytes, heads, heads ? sum_rel / heads : 0.0, max_rel,
           kTolerance[v_bits], pass_failures ? "FAILED" : "ok");
    failures += pass_failures;
  }

  CUDA_CHECK(cudaFree(d_workspace));
  CUDA_CHECK(cudaFree(d_seq_lens));
  CUDA_CHECK(cudaFree(d_block_tables));
  CUDA_CHECK(cudaFree(d_out));
  CUDA_CHECK(cudaFree(d_q));
  CUDA_CHECK(cudaFree(d_v_pool));
  CUDA_CHECK(cudaFree(d_k_pool));
  CUDA_CHECK(cudaFree(d_slot_mapping));
  CUDA_CHECK(cudaFree(d_value));
  CUDA_CHECK(cudaFree(d_key));
  CUDA_CHECK(cudaStreamDestroy(stream));
  free(ref);
  free(out_bits);
  free(q);
  free(q_bits);
  free(slot_mapping);
  free(value);
  free(key);
  free(value_bits);
  free(key_bits);

  printf("%s\n", failures ? "FAILED" : "PASSED");
  return failures ? EXIT_FAILED : EXIT_PASSED;
}
