//! The params builders, the generic entry points and the engine's launchers through the real
//! library: defaults, the argument each refusal names, zero work as a successful no-op, and
//! without a GPU a CUDA error for every launch with work (never a success, never a crash).

mod common;

use std::mem::size_of;

use common::*;
use fp8kturbov::*;

#[test]
fn builders_start_from_the_librarys_defaults() {
    let write = *WriteParams::new().unwrap().as_raw();
    assert_eq!(write.struct_size, size_of::<sys::fp8kturbov_write_params_t>());
    assert_eq!(write.v_bits, sys::FP8KTURBOV_DEFAULT_V_BITS);
    assert!(write.key.is_null() && write.num_tokens == 0 && write.k_scale == 0.0);
    assert_eq!(write.v_encoder, VEncoder::MatchedNorm as u32);
    assert_eq!(write.v_rotation, VRotation::None as u32);
    let decode = *DecodeParams::new().unwrap().as_raw();
    assert_eq!(decode.struct_size, size_of::<sys::fp8kturbov_decode_params_t>());
    assert_eq!(decode.v_bits, sys::FP8KTURBOV_DEFAULT_V_BITS);
    assert_eq!(decode.sparse_v_threshold, sys::FP8KTURBOV_DEFAULT_SPARSE_V_THRESHOLD);
    assert!(decode.workspace.is_null() && decode.sliding_window == 0 && decode.max_q_len == 0);
    let prefill = *PrefillParams::new().unwrap().as_raw();
    assert_eq!(prefill.struct_size, size_of::<sys::fp8kturbov_prefill_params_t>());
    assert_eq!(prefill.v_bits, sys::FP8KTURBOV_DEFAULT_V_BITS);
    assert!(prefill.q.is_null() && prefill.lse.is_null() && prefill.query_start.is_null());
    assert_eq!((prefill.max_q_len, prefill.num_query_rows, prefill.soft_cap), (0, 0, 0.0));
    assert_eq!(prefill.v_rotation, VRotation::None as u32);
    let dequantize = *DequantizeParams::new().unwrap().as_raw();
    assert_eq!(dequantize.struct_size, size_of::<sys::fp8kturbov_dequantize_params_t>());
    assert_eq!(dequantize.v_bits, sys::FP8KTURBOV_DEFAULT_V_BITS);
}

#[test]
fn setters_write_the_named_fields() {
    let write = *valid_write().key(0x1000).v_encoder(VEncoder::Mse).as_raw();
    assert_eq!(write.key as usize, 0x1000);
    assert_eq!((write.key_stride, write.v_encoder), (N, sys::FP8KTURBOV_V_ENCODER_MSE));
    let decode = *valid_decode().v_rotation(VRotation::Hadamard).block_tables_stride(9).as_raw();
    assert_eq!(decode.v_rotation, sys::FP8KTURBOV_V_ROTATION_HADAMARD);
    assert_eq!((decode.block_tables_stride, decode.head_dim), (9, D));
    let prefill = valid_prefill().lse(0x2000).query_start(0x3000).max_q_len(64);
    let prefill = *prefill.v_rotation(VRotation::Hadamard).as_raw();
    assert_eq!((prefill.lse as usize, prefill.query_start as usize), (0x2000, 0x3000));
    assert_eq!((prefill.max_q_len, prefill.v_rotation), (64, sys::FP8KTURBOV_V_ROTATION_HADAMARD));
}

#[test]
fn generic_entry_points_name_the_argument_at_fault() {
    let (write, decode) = ("fp8kturbov_reshape_and_cache", "fp8kturbov_paged_decode_attn");
    // SAFETY (every call): zero work, or host validation refuses the arguments.
    unsafe {
        assert_eq!(reshape_and_cache(&valid_write(), 0), Ok(()));
        assert_eq!(paged_decode_attn(&valid_decode(), 0), Ok(()));
        assert_eq!(dequantize(&valid_dequantize(), 0), Ok(()));
        let r = reshape_and_cache(&valid_write().k_scale(0.0), 0);
        assert_failure(r, Status::InvalidValue, write, "k_scale = 0");
        let r = reshape_and_cache(&valid_write().num_tokens(1), 0);
        assert_failure(r, Status::NullPointer, write, "key is NULL");
        let r = paged_decode_attn(&valid_decode().num_q_heads(3), 0);
        assert_failure(r, Status::InvalidValue, decode, "num_q_heads = 3");
        let r = paged_decode_attn(&valid_decode().v_bits(5), 0);
        assert_failure(r, Status::InvalidValue, decode, "v_bits = 5");
        let r = paged_decode_attn(&valid_decode().k_block_stride_bytes(u64::from(B * N) + 8), 0);
        assert_failure(r, Status::Misaligned, decode, "k_block_stride_bytes");
        let r = dequantize(&valid_dequantize().num_tokens(1), 0);
        assert_failure(r, Status::NullPointer, "fp8kturbov_dequantize", "k_cache is NULL");
    }
    let r = paged_decode_workspace_bytes(&valid_decode().head_dim(80).q_stride(HQ * 80));
    let entry = "fp8kturbov_paged_decode_workspace_bytes";
    assert_failure(r.map(drop), Status::NotSupported, entry, "head_dim = 80");
}

/// A prefill with work (one sequence, one query row), its pointers at 1 MiB-aligned addresses
/// that nothing allocated; all but `query_start`, the one the decode does not require.
fn prefill_with_work() -> PrefillParams {
    let [a, b, c, d, e, f] = [1u64, 2, 3, 4, 5, 6].map(|i| i << 20);
    valid_prefill()
        .q(a)
        .k_cache(b)
        .v_cache(c)
        .output(d)
        .block_tables(e)
        .seq_lens(f)
        .num_seqs(1)
        .max_q_len(1)
        .num_query_rows(1)
}

#[test]
fn the_prefill_names_the_argument_at_fault() {
    let (entry, workspace_entry) =
        ("fp8kturbov_paged_prefill_attn", "fp8kturbov_paged_prefill_workspace_bytes");
    let head_dim_512 = CacheLayout::new(8, B, HKV, 512, 3).unwrap();
    let head_dim_512 = valid_prefill().cache_layout(&head_dim_512).q_stride(HQ * 512);
    // SAFETY (every call): zero work, or host validation refuses the arguments.
    unsafe {
        assert_eq!(paged_prefill_attn(&valid_prefill(), 0), Ok(()));
        // max_q_len = 0: no sequence has a query row, so nothing is read.
        assert_eq!(paged_prefill_attn(&valid_prefill().num_seqs(1), 0), Ok(()));
        let r = paged_prefill_attn(&prefill_with_work(), 0);
        assert_failure(r, Status::NullPointer, entry, "query_start is NULL");
        let r = paged_prefill_attn(&prefill_with_work().query_start(7 << 20).lse((8 << 20) + 2), 0);
        assert_failure(r, Status::Misaligned, entry, "is not 4-byte aligned");
        // Unlike the decode's 16, a chunk is bounded by the positions of a block-table row.
        let r = paged_prefill_attn(&valid_prefill().max_q_len(4 * B + 1), 0);
        assert_failure(r, Status::InvalidValue, entry, &format!("max_q_len = {}", 4 * B + 1));
        let r = paged_prefill_attn(&head_dim_512, 0);
        assert_failure(r, Status::NotSupported, entry, "head_dim = 512");
    }
    // A host query of the device (its multiprocessors): without a GPU the same CUDA error as the
    // decode's.
    let longest_chunk = valid_prefill().num_seqs(1).max_q_len(4 * B).num_query_rows(4 * B);
    match no_gpu() {
        Some(reason) => assert_eq!(
            paged_prefill_workspace_bytes(&longest_chunk).err().map(|e| e.status()),
            Some(reason.status())
        ),
        None => assert!(paged_prefill_workspace_bytes(&longest_chunk).is_ok()),
    }
    let r = paged_prefill_workspace_bytes(&head_dim_512.num_seqs(1).max_q_len(1));
    assert_failure(r.map(drop), Status::NotSupported, workspace_entry, "head_dim = 512");
}

// The launchers' signatures, one line each (rustfmt would give every type a line).
#[rustfmt::skip]
type WriteLauncher = unsafe fn(
    u64, u64, u64, u64, u64, u32, u32, u32, u32, u32, u32, f32, u64, u64, u64, u64,
) -> Result<()>;
#[rustfmt::skip]
type DecodeLauncher = unsafe fn(
    u64, u64, u64, u64, u64, u64, u32, u32, u32, u32, u32, u32, f32, f32, u32, u64, u64, u32, u64,
) -> Result<()>;

/// The engine's launchers with their V bits.
const WRITES: [(u32, WriteLauncher); 3] = [
    (2, reshape_and_cache_fp8k_turbo2v),
    (3, reshape_and_cache_fp8k_turbo3v),
    (4, reshape_and_cache_fp8k_turbo4v),
];
const DECODES: [(u32, DecodeLauncher); 3] = [
    (2, paged_decode_attn_fp8k_turbo2v),
    (3, paged_decode_attn_fp8k_turbo3v),
    (4, paged_decode_attn_fp8k_turbo4v),
];

/// The arguments the tests vary; the others come from the valid layout of the launcher's V bits.
#[derive(Clone, Copy)]
struct Args {
    pointers: [u64; 6], // the launcher's device pointers, in order
    count: u32,         // num_tokens / num_seqs
    head_dim: u32,
    key_stride: u32,
    max_blocks_per_seq: u32,
    inv_sqrt_d: f32,
}

const VALID: Args = Args {
    pointers: [0; 6],
    count: 0,
    head_dim: D,
    key_stride: N,
    max_blocks_per_seq: 4,
    inv_sqrt_d: INV_SQRT_D,
};

/// # Safety
/// As for the launcher.
unsafe fn write((v_bits, launcher): (u32, WriteLauncher), a: Args) -> Result<()> {
    let l = layout(v_bits);
    let [key, value, k_cache, v_cache, slot_mapping, _] = a.pointers;
    let (k_page, v_page) = (l.k_block_stride_bytes(), l.v_block_stride_bytes());
    let (v_data, row) = (l.v_data_section_bytes(), HKV * a.head_dim);
    launcher(
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        a.count,
        HKV,
        a.head_dim,
        B,
        a.key_stride,
        row,
        1.0,
        k_page,
        v_page,
        v_data,
        0,
    )
}

/// # Safety
/// As for the launcher.
unsafe fn decode((v_bits, launcher): (u32, DecodeLauncher), a: Args) -> Result<()> {
    let l = layout(v_bits);
    let [q, k_cache, v_cache, output, block_tables, seq_lens] = a.pointers;
    let (v_page, v_data, q_stride) =
        (l.v_block_stride_bytes(), l.v_data_section_bytes(), HQ * a.head_dim);
    launcher(
        q,
        k_cache,
        v_cache,
        output,
        block_tables,
        seq_lens,
        a.max_blocks_per_seq,
        a.count,
        HQ,
        HKV,
        a.head_dim,
        B,
        a.inv_sqrt_d,
        1.0,
        q_stride,
        v_page,
        v_data,
        0,
        0,
    )
}

#[test]
fn engine_launchers_name_the_argument_at_fault() {
    let [write2, write3, write4] = WRITES;
    let [decode2, decode3, decode4] = DECODES;
    // SAFETY (every call): zero work, or host validation refuses the arguments.
    unsafe {
        for launcher in WRITES {
            assert_eq!(write(launcher, VALID), Ok(()));
        }
        for launcher in DECODES {
            assert_eq!(decode(launcher, VALID), Ok(()));
        }
        let r = write(write2, Args { key_stride: N - 1, ..VALID });
        let entry = "fp8kturbov_reshape_and_cache_fp8k_turbo2v";
        assert_failure(r, Status::InvalidValue, entry, &format!("key_stride = {}", N - 1));
        let r = write(write3, Args { head_dim: 100, ..VALID });
        let entry = "fp8kturbov_reshape_and_cache_fp8k_turbo3v";
        assert_failure(r, Status::InvalidValue, entry, "head_dim = 100");
        let r = write(write4, Args { pointers: [0, 0, 8, 0, 0, 0], ..VALID });
        let entry = "fp8kturbov_reshape_and_cache_fp8k_turbo4v";
        assert_failure(r, Status::Misaligned, entry, "k_cache");
        let r = decode(decode2, Args { head_dim: 80, ..VALID });
        let entry = "fp8kturbov_paged_decode_attn_fp8k_turbo2v";
        assert_failure(r, Status::NotSupported, entry, "head_dim = 80");
        let r = decode(decode3, Args { inv_sqrt_d: f32::NAN, ..VALID });
        let entry = "fp8kturbov_paged_decode_attn_fp8k_turbo3v";
        assert_failure(r, Status::InvalidValue, entry, "inv_sqrt_d = nan");
        let r = decode(decode4, Args { max_blocks_per_seq: 0, ..VALID });
        let entry = "fp8kturbov_paged_decode_attn_fp8k_turbo4v";
        assert_failure(r, Status::InvalidValue, entry, "max_blocks_per_seq = 0");
    }
}

/// Why the machine has no usable GPU, from the library's own host query; `None` with a GPU.
fn no_gpu() -> Option<Error> {
    paged_decode_workspace_bytes(&valid_decode().num_seqs(1)).err()
}

#[test]
fn without_a_gpu_every_launch_with_work_fails_with_a_cuda_error() {
    let Some(reason) = no_gpu() else {
        // Made-up device addresses would be launched on a real GPU: GPU tests cover that case.
        eprintln!("skipped: a GPU is usable");
        return;
    };
    assert_eq!(reason.status(), Some(Status::CudaError), "{reason}");
    // 1 MiB-aligned addresses that nothing allocated: only the launch itself can refuse them.
    let [a, b, c, d, e, f] = [1u64, 2, 3, 4, 5, 6].map(|i| i << 20);
    let work = Args { pointers: [a, b, c, d, e, f], count: 1, ..VALID };
    // SAFETY: without a GPU nothing is launched.
    let mut results = unsafe {
        let w = valid_write().key(a).value(b).k_cache(c).v_cache(d).slot_mapping(e).num_tokens(1);
        let p = valid_decode().q(a).k_cache(b).v_cache(c).output(d).block_tables(e);
        let q = valid_dequantize().k_cache(a).v_cache(b).slot_mapping(c).key(d).value(e);
        let prefill = prefill_with_work().query_start(7 << 20);
        vec![
            ("reshape_and_cache".to_string(), reshape_and_cache(&w, 0)),
            ("paged_decode_attn".to_string(), paged_decode_attn(&p.seq_lens(f).num_seqs(1), 0)),
            ("paged_prefill_attn".to_string(), paged_prefill_attn(&prefill, 0)),
            ("dequantize".to_string(), dequantize(&q.num_tokens(1), 0)),
        ]
    };
    for (bits, launcher) in WRITES {
        let name = format!("reshape_and_cache_fp8k_turbo{bits}v");
        // SAFETY: as above.
        results.push((name, unsafe { write((bits, launcher), work) }));
    }
    for (bits, launcher) in DECODES {
        let name = format!("paged_decode_attn_fp8k_turbo{bits}v");
        // SAFETY: as above.
        results.push((name, unsafe { decode((bits, launcher), work) }));
    }
    for (entry, result) in results {
        assert_failure(result, Status::CudaError, &format!("fp8kturbov_{entry}"), "cuda");
    }
}
