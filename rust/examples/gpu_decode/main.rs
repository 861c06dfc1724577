//! fp8kturbov from Rust, as an engine calls it: the engine owns the device buffers (here through
//! the CUDA driver API), the library only launches kernels on them.
//!
//!  1. Gaussian bf16 K, V and queries on the host, copied to the device;
//!  2. the engine's `reshape_and_cache_fp8k_turbo{2,3,4}v` writes every cached position of four
//!     sequences (seq_lens 37, 1, 0, 100) into pages handed out in shuffled order, plus one
//!     padding token (slot -1, NaN data) that must write nothing;
//!  3. the decode runs twice: the engine's `paged_decode_attn_fp8k_turbo{2,3,4}v` (no
//!     workspace), then the generic `paged_decode_attn` with the split workspace of
//!     `paged_decode_workspace_bytes`;
//!  4. each output is compared with float64 attention over the original K and V: finite, zeros
//!     for seq_len 0, and a relative error per (sequence, query head) within the V width's
//!     tolerance.
//!
//! With `--save DIR` it also writes its inputs, the pools and both outputs to DIR as raw
//! little-endian files (`save.rs`), so that a test can compare them with the NumPy reference
//! (tests/test_rust_crate.py: the pools byte for byte, the outputs against its decode).
//!
//! Usage: gpu_decode [v_bits] [--save DIR]   (v_bits 2, 3 or 4; default 3)
//! Exit status: 0 passed, 1 a check or call failed, 2 bad usage, 77 no usable CUDA GPU.

mod cuda;
mod host;
mod save;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use fp8kturbov::{CacheLayout, DecodeParams};

const BLOCK_SIZE: u32 = 16;
const NUM_KV_HEADS: u32 = 2;
const NUM_Q_HEADS: u32 = 8;
const HEAD_DIM: u32 = 128;
const ROW: usize = (NUM_KV_HEADS * HEAD_DIM) as usize; // elements of one token's K (or V) row
const SEQ_LENS: [i32; 4] = [37, 1, 0, 100];
const MAX_BLOCKS_PER_SEQ: u32 = 7; // ceil(100 / 16)
const NUM_BLOCKS: u64 = 16; // pages in the pools; 12 are used

/// Tolerance on |out - ref|_2 / |ref|_2 per (sequence, query head), by V bits: those of
/// examples/c/paged_decode.c, whose comment derives them (the format's error, dominated by V's
/// 2^bits levels per 16-element group; a layout mistake gives errors near 1).
fn tolerance(v_bits: u32) -> f64 {
    [0.0, 0.0, 0.60, 0.30, 0.16][v_bits as usize]
}

/// Token t's rows, slots and tables of one batch.
struct Batch {
    key_bits: Vec<u16>,
    value_bits: Vec<u16>,
    key: Vec<f32>,
    value: Vec<f32>,
    slot_mapping: Vec<i64>,
    block_tables: Vec<i32>, // [num_seqs][MAX_BLOCKS_PER_SEQ]
    first_token: Vec<usize>,
    q_bits: Vec<u16>,
    q: Vec<f32>,
}

fn make_batch(rng: &mut host::Rng) -> Batch {
    let mut pages: Vec<i32> = (0..NUM_BLOCKS as i32).collect();
    for i in (1..pages.len()).rev() {
        pages.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize); // Fisher-Yates
    }
    let mut pages = pages.into_iter();
    let width = MAX_BLOCKS_PER_SEQ as usize;
    let mut batch = Batch {
        key_bits: vec![],
        value_bits: vec![],
        key: vec![],
        value: vec![],
        slot_mapping: vec![],
        block_tables: vec![0; SEQ_LENS.len() * width],
        first_token: vec![],
        q_bits: vec![],
        q: vec![],
    };
    for (s, &seq_len) in SEQ_LENS.iter().enumerate() {
        batch.first_token.push(batch.slot_mapping.len());
        let table = &mut batch.block_tables[s * width..(s + 1) * width];
        for p in 0..seq_len as usize {
            let block = p / BLOCK_SIZE as usize;
            if p % BLOCK_SIZE as usize == 0 {
                table[block] = pages.next().unwrap();
            }
            batch.slot_mapping.push(
                i64::from(table[block]) * i64::from(BLOCK_SIZE) + (p % BLOCK_SIZE as usize) as i64,
            );
            for _ in 0..ROW {
                let ((kb, k), (vb, v)) = (rng.bf16(), rng.bf16());
                batch.key_bits.push(kb);
                batch.key.push(k);
                batch.value_bits.push(vb);
                batch.value.push(v);
            }
        }
    }
    // The padding token, last: slot -1 writes nothing, whatever its data (NaN).
    batch.slot_mapping.push(-1);
    batch.key_bits.extend([0x7FC0; ROW]);
    batch.value_bits.extend([0x7FC0; ROW]);
    for _ in 0..SEQ_LENS.len() * (NUM_Q_HEADS * HEAD_DIM) as usize {
        let (bits, value) = rng.bf16();
        batch.q_bits.push(bits);
        batch.q.push(value);
    }
    batch
}

/// The number of failed (sequence, head) checks of one decode's output.
fn compare(name: &str, batch: &Batch, out_bits: &[u16], inv_sqrt_d: f32, v_bits: u32) -> usize {
    let attention = host::Attention {
        num_q_heads: NUM_Q_HEADS as usize,
        num_kv_heads: NUM_KV_HEADS as usize,
        head_dim: HEAD_DIM as usize,
        inv_sqrt_d: f64::from(inv_sqrt_d),
    };
    let (dim, per_seq) = (HEAD_DIM as usize, (NUM_Q_HEADS * HEAD_DIM) as usize);
    let (mut failures, mut worst) = (0, 0.0f64);
    for (s, &seq_len) in SEQ_LENS.iter().enumerate() {
        let tokens = batch.first_token[s] * ROW..(batch.first_token[s] + seq_len as usize) * ROW;
        let q = &batch.q[s * per_seq..(s + 1) * per_seq];
        let reference = attention.reference(q, &batch.key[tokens.clone()], &batch.value[tokens]);
        for h in 0..NUM_Q_HEADS as usize {
            let base = s * per_seq + h * dim;
            let out: Vec<f64> =
                out_bits[base..base + dim].iter().map(|&b| host::bf16_value(b).into()).collect();
            let want = &reference[h * dim..(h + 1) * dim];
            let err2: f64 = out.iter().zip(want).map(|(o, r)| (o - r) * (o - r)).sum();
            let ref2: f64 = want.iter().map(|r| r * r).sum();
            let problem = if out.iter().any(|o| !o.is_finite()) {
                Some("non-finite output".to_string())
            } else if seq_len == 0 {
                out.iter().any(|&o| o != 0.0).then(|| "seq_len 0 but not zero".to_string())
            } else {
                let relative = (err2 / ref2).sqrt();
                worst = worst.max(relative);
                (relative > tolerance(v_bits)).then(|| format!("relative error {relative:.4}"))
            };
            if let Some(problem) = problem {
                println!("FAILED: {name}, sequence {s} (seq_len {seq_len}), head {h}: {problem}");
                failures += 1;
            }
        }
    }
    let verdict = if failures == 0 { "ok" } else { "FAILED" };
    println!(
        "{name}: max relative error {worst:.4} (tolerance {:.2}): {verdict}",
        tolerance(v_bits)
    );
    failures
}

fn run(
    v_bits: u32,
    gpu: &mut cuda::Gpu,
    save_dir: Option<&Path>,
) -> Result<usize, Box<dyn std::error::Error>> {
    let layout = CacheLayout::new(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, v_bits)?;
    let batch = make_batch(&mut host::Rng::new(0x243F_6A88_85A3_08D3));
    let k_amax = batch.key.iter().fold(0.0f32, |m, k| m.max(k.abs()));
    let k_scale = k_amax / 448.0; // the largest |K| maps to E4M3's largest finite value
    let inv_sqrt_d = 1.0 / (HEAD_DIM as f32).sqrt();
    let num_tokens = batch.slot_mapping.len() as u32;
    let out_elems = SEQ_LENS.len() * (NUM_Q_HEADS * HEAD_DIM) as usize;

    let key = gpu.upload(&batch.key_bits)?;
    let value = gpu.upload(&batch.value_bits)?;
    let slot_mapping = gpu.upload(&batch.slot_mapping)?;
    let block_tables = gpu.upload(&batch.block_tables)?;
    let seq_lens = gpu.upload(&SEQ_LENS)?;
    let q = gpu.upload(&batch.q_bits)?;
    let k_pool = gpu.alloc(layout.k_pool_bytes() as usize, 0)?;
    let v_pool = gpu.alloc(layout.v_pool_bytes() as usize, 0)?;
    // 0xFFFF is a bf16 NaN: an output the kernel fails to write shows up.
    let output = gpu.alloc(out_elems * 2, 0xFF)?;
    let (row, stream) = (ROW as u32, 0); // the legacy default stream
    let (k_page, v_page, v_data) = (
        layout.k_block_stride_bytes(),
        layout.v_block_stride_bytes(),
        layout.v_data_section_bytes(),
    );

    let (write, decode): (WriteLauncher, DecodeLauncher) = match v_bits {
        2 => {
            (fp8kturbov::reshape_and_cache_fp8k_turbo2v, fp8kturbov::paged_decode_attn_fp8k_turbo2v)
        }
        3 => {
            (fp8kturbov::reshape_and_cache_fp8k_turbo3v, fp8kturbov::paged_decode_attn_fp8k_turbo3v)
        }
        _ => {
            (fp8kturbov::reshape_and_cache_fp8k_turbo4v, fp8kturbov::paged_decode_attn_fp8k_turbo4v)
        }
    };
    let mut out_bits = vec![0u16; out_elems];
    // SAFETY: every address is an allocation above of the size the header asks for.
    unsafe {
        write(
            key,
            value,
            k_pool,
            v_pool,
            slot_mapping,
            num_tokens,
            NUM_KV_HEADS,
            HEAD_DIM,
            BLOCK_SIZE,
            row,
            row,
            k_scale,
            k_page,
            v_page,
            v_data,
            stream,
        )?;
        decode(
            q,
            k_pool,
            v_pool,
            output,
            block_tables,
            seq_lens,
            MAX_BLOCKS_PER_SEQ,
            SEQ_LENS.len() as u32,
            NUM_Q_HEADS,
            NUM_KV_HEADS,
            HEAD_DIM,
            BLOCK_SIZE,
            inv_sqrt_d,
            k_scale,
            NUM_Q_HEADS * HEAD_DIM,
            v_page,
            v_data,
            0, // sliding_window: off
            stream,
        )?;
    }
    gpu.download(output, &mut out_bits)?;
    let mut failures =
        compare("engine decode, no workspace", &batch, &out_bits, inv_sqrt_d, v_bits);
    let engine_out_bits = out_bits.clone();

    let params = DecodeParams::new()?
        .cache_layout(&layout)
        .q(q)
        .k_cache(k_pool)
        .v_cache(v_pool)
        .output(output)
        .block_tables(block_tables)
        .seq_lens(seq_lens)
        .max_blocks_per_seq(MAX_BLOCKS_PER_SEQ)
        .num_seqs(SEQ_LENS.len() as u32)
        .num_q_heads(NUM_Q_HEADS)
        .inv_sqrt_d(inv_sqrt_d)
        .k_scale(k_scale)
        .q_stride(NUM_Q_HEADS * HEAD_DIM);
    let workspace_bytes = fp8kturbov::paged_decode_workspace_bytes(&params)?;
    let workspace = gpu.alloc(workspace_bytes as usize, 0)?;
    gpu.memset(output, 0xFF, out_elems * 2)?;
    // SAFETY: as above; the workspace holds workspace_bytes.
    unsafe {
        fp8kturbov::paged_decode_attn(
            &params.workspace(workspace).workspace_bytes(workspace_bytes),
            stream,
        )?
    };
    gpu.download(output, &mut out_bits)?;
    let name = format!("generic decode, workspace {workspace_bytes} bytes");
    failures += compare(&name, &batch, &out_bits, inv_sqrt_d, v_bits);

    if let Some(dir) = save_dir {
        let mut k_pool_bytes = vec![0u8; layout.k_pool_bytes() as usize];
        let mut v_pool_bytes = vec![0u8; layout.v_pool_bytes() as usize];
        gpu.download(k_pool, &mut k_pool_bytes)?;
        gpu.download(v_pool, &mut v_pool_bytes)?;
        let sizes = [
            ("v_bits", u64::from(v_bits)),
            ("num_blocks", NUM_BLOCKS),
            ("block_size", u64::from(BLOCK_SIZE)),
            ("num_kv_heads", u64::from(NUM_KV_HEADS)),
            ("num_q_heads", u64::from(NUM_Q_HEADS)),
            ("head_dim", u64::from(HEAD_DIM)),
            ("num_tokens", u64::from(num_tokens)),
            ("num_seqs", SEQ_LENS.len() as u64),
            ("max_blocks_per_seq", u64::from(MAX_BLOCKS_PER_SEQ)),
            ("k_block_stride_bytes", k_page),
            ("v_block_stride_bytes", v_page),
            ("v_data_section_bytes", v_data),
            ("k_scale_bits", u64::from(k_scale.to_bits())),
            ("inv_sqrt_d_bits", u64::from(inv_sqrt_d.to_bits())),
        ];
        save::meta(dir, &sizes)?;
        save::raw(dir, "key.bf16", &batch.key_bits)?;
        save::raw(dir, "value.bf16", &batch.value_bits)?;
        save::raw(dir, "slot_mapping.i64", &batch.slot_mapping)?;
        save::raw(dir, "block_tables.i32", &batch.block_tables)?;
        save::raw(dir, "seq_lens.i32", &SEQ_LENS)?;
        save::raw(dir, "q.bf16", &batch.q_bits)?;
        save::raw(dir, "k_pool.u8", &k_pool_bytes)?;
        save::raw(dir, "v_pool.u8", &v_pool_bytes)?;
        save::raw(dir, "output_engine.bf16", &engine_out_bits)?;
        save::raw(dir, "output_generic.bf16", &out_bits)?;
        println!("saved inputs, pools and outputs to {}", dir.display());
    }
    Ok(failures)
}

// The engine launchers' signatures, one line each.
#[rustfmt::skip]
type WriteLauncher = unsafe fn(
    u64, u64, u64, u64, u64, u32, u32, u32, u32, u32, u32, f32, u64, u64, u64, u64,
) -> fp8kturbov::Result<()>;
#[rustfmt::skip]
type DecodeLauncher = unsafe fn(
    u64, u64, u64, u64, u64, u64, u32, u32, u32, u32, u32, u32, f32, f32, u32, u64, u64, u32, u64,
) -> fp8kturbov::Result<()>;

/// `[v_bits] [--save DIR]`, or None on anything else.
fn parse_args(args: &[String]) -> Option<(u32, Option<PathBuf>)> {
    let (mut v_bits, mut save_dir) = (None, None);
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--save" if save_dir.is_none() => save_dir = Some(PathBuf::from(args.next()?)),
            "2" | "3" | "4" if v_bits.is_none() => v_bits = arg.parse().ok(),
            _ => return None,
        }
    }
    Some((v_bits.unwrap_or(3), save_dir))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let Some((v_bits, save_dir)) = parse_args(&args[1..]) else {
        eprintln!("usage: {} [v_bits] [--save DIR]   (v_bits: 2, 3 or 4; default 3)", args[0]);
        return ExitCode::from(2);
    };
    println!(
        "fp8kturbov {} (ABI {}), crate built for ABI {}",
        fp8kturbov::version(),
        fp8kturbov::abi_version(),
        fp8kturbov::sys::FP8KTURBOV_ABI_VERSION
    );
    if let Err(err) = fp8kturbov::check_abi() {
        eprintln!("{err}");
        return ExitCode::from(1);
    }
    let mut gpu = match cuda::Gpu::open() {
        Ok(gpu) => gpu,
        Err(reason) => {
            println!("SKIPPED: no usable CUDA GPU ({reason})");
            return ExitCode::from(77);
        }
    };
    println!(
        "{NUM_Q_HEADS} query heads, {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, \
         block_size {BLOCK_SIZE}, V bits {v_bits}"
    );
    match run(v_bits, &mut gpu, save_dir.as_deref()) {
        Ok(0) => {
            println!("PASSED");
            ExitCode::SUCCESS
        }
        Ok(_) => {
            println!("FAILED");
            ExitCode::from(1)
        }
        Err(err) => {
            println!("FAILED: {err}");
            ExitCode::from(1)
        }
    }
}
