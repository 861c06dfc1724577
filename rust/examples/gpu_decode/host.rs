//! The host side of the example: bf16 values, deterministic Gaussian inputs, and float64
//! attention over the original (unquantised) K and V, as examples/c/paged_decode.c computes it.

/// float -> bf16 bits, rounded to nearest even (a NaN stays a quiet NaN).
pub fn bf16_bits(value: f32) -> u16 {
    let bits = value.to_bits();
    if value.is_nan() {
        return ((bits >> 16) | 0x0040) as u16;
    }
    ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
}

pub fn bf16_value(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// splitmix64 and Box-Muller: the same inputs on every run.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    pub fn gaussian(&mut self) -> f64 {
        (-2.0 * self.uniform().ln()).sqrt() * (std::f64::consts::TAU * self.uniform()).cos()
    }

    /// A Gaussian bf16 value: its bits (for the device) and the same value as f32 (for the host).
    pub fn bf16(&mut self) -> (u16, f32) {
        let bits = bf16_bits(self.gaussian() as f32);
        (bits, bf16_value(bits))
    }
}

/// One sequence's attention: `q` is [num_q_heads][head_dim], `k` and `v` are [seq_len][row] with
/// row = num_kv_heads * head_dim; query head h reads KV head h / (num_q_heads / num_kv_heads).
pub struct Attention {
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub inv_sqrt_d: f64,
}

impl Attention {
    /// out[h][d] = softmax_p((q_h . k_p) * inv_sqrt_d) . v_p[d], in float64; zeros for seq_len 0.
    pub fn reference(&self, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f64> {
        let (dim, row) = (self.head_dim, self.num_kv_heads * self.head_dim);
        let group = self.num_q_heads / self.num_kv_heads;
        let seq_len = k.len() / row;
        let mut out = vec![0.0; self.num_q_heads * dim];
        if seq_len == 0 {
            return out;
        }
        for h in 0..self.num_q_heads {
            let offset = h / group * dim;
            let qh = &q[h * dim..(h + 1) * dim];
            let scores: Vec<f64> = (0..seq_len)
                .map(|p| {
                    let kp = &k[p * row + offset..p * row + offset + dim];
                    let dot: f64 =
                        qh.iter().zip(kp).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
                    dot * self.inv_sqrt_d
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let denominator: f64 = weights.iter().sum();
            let oh = &mut out[h * dim..(h + 1) * dim];
            for (p, w) in weights.iter().enumerate() {
                let vp = &v[p * row + offset..p * row + offset + dim];
                for (o, &x) in oh.iter_mut().zip(vp) {
                    *o += w * f64::from(x) / denominator;
                }
            }
        }
        out
    }
}
