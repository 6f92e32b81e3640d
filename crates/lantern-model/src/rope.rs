//! Rotary position embeddings.
//!
//! Tables are built per step for the positions in the batch, never for the whole context
//! (a 131k-position table per layer is gigabytes for nothing).

use crate::error::{ModelError, Result};
use crate::source::{keys, WeightSource};

/// How the rotated pairs are laid out inside a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopePairs {
    /// `(x[2i], x[2i+1])`: GGUF-converted Llama weights are permuted so that pairs sit next
    /// to each other (llama.cpp's "normal" rope mode).
    Adjacent,
    /// `(x[i], x[i + d/2])`: the Hugging Face "rotate_half" layout (GGUF NeoX mode, Gemma).
    Halves,
}

/// How the file scales RoPE beyond its trained context (`{arch}.rope.scaling.*`; Llama 3's
/// scaling instead comes as `rope_freqs.weight`, per-frequency divisors).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by the factor.
    Linear(f32),
    /// YaRN (as transformers' `_compute_yarn_parameters` and llama.cpp's `rope_yarn`):
    /// frequencies blend between interpolated (divided by `factor`) and original by a ramp
    /// over the dimensions, and cos/sin are multiplied by `attention_factor`.
    Yarn {
        factor: f32,
        original_context: usize,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: f32,
        /// Round the ramp's ends outwards to whole dimensions (both do by default).
        truncate: bool,
    },
    /// LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): one set of per-frequency divisors for
    /// contexts up to `original_context` tokens and one beyond (`rope_factors_short.weight`,
    /// `rope_factors_long.weight`; the decoder picks one by the context it serves, as
    /// llama.cpp does), and cos/sin multiplied by `attention_factor`.
    LongRope {
        original_context: usize,
        attention_factor: f32,
    },
}

/// LongRoPE's divisors for contexts beyond the original one.
pub const LONG_FACTORS: &str = "rope_factors_long.weight";
/// LongRoPE's divisors for contexts up to the original one.
pub const SHORT_FACTORS: &str = "rope_factors_short.weight";

/// The architecture whose YaRN bounds are not rounded by default.
const GPT_OSS: &str = "gpt-oss";

impl RopeScaling {
    pub fn read(src: &dyn WeightSource, arch: &str) -> Result<Self> {
        let key = |k: &str| format!("{arch}.rope.scaling.{k}");
        let factor = src.opt_f32(&key("factor"))?;
        let long_rope = src.has_tensor(LONG_FACTORS) || src.has_tensor(SHORT_FACTORS);
        let scaling = match src.opt_string(&key("type"))? {
            // llama.cpp's converter writes LongRoPE as the two tensors and
            // `rope.scaling.attn_factor`, without a type.
            None | Some("none") if long_rope => Self::LongRope {
                original_context: src.get_usize(&key("original_context_length"))?,
                attention_factor: src.opt_f32(&key("attn_factor"))?.unwrap_or(1.0),
            },
            None | Some("none") => Self::None,
            Some("linear") => Self::Linear(factor.unwrap_or(1.0)),
            Some("yarn") => {
                let factor = factor.unwrap_or(1.0);
                // llama.cpp: `0.1 ln(factor) + 1` times the file's multipliers.
                let implied = || -> Result<f32> {
                    let mut a = if factor > 1.0 {
                        0.1 * factor.ln() + 1.0
                    } else {
                        1.0
                    };
                    for k in ["yarn_attn_factor", "attn_factor"] {
                        a *= src.opt_f32(&key(k))?.unwrap_or(1.0);
                    }
                    Ok(a)
                };
                Self::Yarn {
                    factor,
                    original_context: src.get_usize(&key("original_context_length"))?,
                    beta_fast: src.opt_f32(&key("yarn_beta_fast"))?.unwrap_or(32.0),
                    beta_slow: src.opt_f32(&key("yarn_beta_slow"))?.unwrap_or(1.0),
                    attention_factor: match src.opt_f32(keys::ROPE_ATTENTION_FACTOR)? {
                        Some(a) => a,
                        None => implied()?,
                    },
                    // gpt-oss was trained with YaRN's ramp bounds as computed (its
                    // config's `truncate: false`), which GGUF files do not say;
                    // llama.cpp rounds them for every model.
                    truncate: src
                        .opt_bool(keys::ROPE_YARN_TRUNCATE)?
                        .unwrap_or(arch != GPT_OSS),
                }
            }
            Some(other) => {
                return Err(ModelError::InvalidConfig(format!(
                    "RoPE scaling `{other}` is not supported (supported: none, linear, yarn)"
                )))
            }
        };
        let bad = |what: &str| {
            Err(ModelError::InvalidConfig(format!(
                "RoPE scaling {what} must be positive and finite"
            )))
        };
        let positive = |x: f32| x.is_finite() && x > 0.0;
        match &scaling {
            Self::Linear(f) | Self::Yarn { factor: f, .. } if !positive(*f) => bad("factor"),
            Self::Yarn {
                original_context: 0,
                ..
            }
            | Self::LongRope {
                original_context: 0,
                ..
            } => bad("original_context_length"),
            Self::Yarn {
                beta_fast,
                beta_slow,
                ..
            } if !positive(*beta_fast) || !positive(*beta_slow) => bad("beta_fast/beta_slow"),
            Self::Yarn {
                attention_factor, ..
            }
            | Self::LongRope {
                attention_factor, ..
            } if !positive(*attention_factor) => bad("attention factor"),
            _ => Ok(scaling),
        }
    }
}

/// Inverse frequencies of one rotary embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    inv_freq: Vec<f32>,
    rotary_dim: usize,
    pairs: RopePairs,
    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    magnitude: f32,
}

impl Rope {
    /// `freq_factors` (Llama 3's `rope_freqs`, LongRoPE's chosen set) divide the
    /// frequencies; `scaling` as the file gives it.
    pub fn new(
        rotary_dim: usize,
        base: f32,
        pairs: RopePairs,
        freq_factors: Option<&[f32]>,
        scaling: &RopeScaling,
    ) -> Self {
        let half = rotary_dim / 2;
        let original: Vec<f32> = (0..half)
            .map(|i| {
                let f = 1.0 / base.powf((2 * i) as f32 / rotary_dim as f32);
                f / freq_factors
                    .and_then(|ff| ff.get(i))
                    .copied()
                    .unwrap_or(1.0)
            })
            .collect();
        let (inv_freq, magnitude) = match *scaling {
            RopeScaling::None => (original, 1.0),
            RopeScaling::Linear(factor) => (original.iter().map(|f| f / factor).collect(), 1.0),
            RopeScaling::LongRope {
                attention_factor, ..
            } => (original, attention_factor),
            RopeScaling::Yarn {
                factor,
                original_context,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => {
                let (low, high) = yarn_ramp(
                    rotary_dim,
                    base,
                    original_context,
                    beta_fast,
                    beta_slow,
                    truncate,
                );
                let span = if high == low { 0.001 } else { high - low };
                let inv_freq = original
                    .iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        let ramp = ((i as f32 - low) / span).clamp(0.0, 1.0);
                        f / factor * ramp + f * (1.0 - ramp)
                    })
                    .collect();
                (inv_freq, attention_factor)
            }
        };
        Self {
            inv_freq,
            rotary_dim,
            pairs,
            magnitude,
        }
    }

    /// cos/sin for each position, `[positions, rotary_dim / 2]` each.
    pub fn table(&self, positions: &[usize]) -> RopeTable {
        let half = self.rotary_dim / 2;
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos() * self.magnitude);
                sin.push(angle.sin() * self.magnitude);
            }
        }
        RopeTable {
            cos,
            sin,
            half,
            pairs: self.pairs,
        }
    }
}

/// The frequency indices where YaRN's ramp starts and ends: below `low` frequencies stay,
/// above `high` they are interpolated. The dimension whose wavelength fits `rotations`
/// times into the original context, computed in f64 like transformers (python floats) so
/// that the rounding lands where theirs does.
fn yarn_ramp(
    rotary_dim: usize,
    base: f32,
    original_context: usize,
    beta_fast: f32,
    beta_slow: f32,
    truncate: bool,
) -> (f32, f32) {
    let dim = rotary_dim as f64;
    let correction = |rotations: f32| {
        dim * (original_context as f64 / (rotations as f64 * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * (base as f64).ln())
    };
    let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    (low.max(0.0) as f32, high.min(dim - 1.0) as f32)
}

/// cos/sin of the positions of one step.
pub struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    pairs: RopePairs,
}

impl RopeTable {
    /// `[positions, half]` cosines.
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// `[positions, half]` sines.
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }

    /// Rotated pairs per head (half the rotary dimension).
    pub fn half(&self) -> usize {
        self.half
    }

    pub fn pairs(&self) -> RopePairs {
        self.pairs
    }

    /// Rotates the queries `q` (`[tokens, q_heads, head_dim]`) and keys `k` (`[tokens,
    /// k_heads, head_dim]`) of the same tokens in place, in one pass over token chunks
    /// (one sharing of the step's threads, where [`Self::apply`] twice would take two and
    /// leave the keys, a third of the values or less, to one thread).
    pub fn apply_qk(
        &self,
        (q, q_heads): (&mut [f32], usize),
        (k, k_heads): (&mut [f32], usize),
        head_dim: usize,
    ) {
        let (q_row, k_row) = (q_heads * head_dim, k_heads * head_dim);
        let num_tokens = q.len() / q_row.max(1);
        let both = q_row + k_row;
        let tokens = lantern_quant::share::chunk_len(num_tokens * both, both) / both.max(1);
        let (half, pairs) = (self.half, self.pairs);
        let k = lantern_quant::share::SharedMut::new(k);
        lantern_quant::share::for_each_chunk(q, tokens * q_row, &|c, q| {
            let t0 = c * tokens;
            let n = q.len() / q_row.max(1);
            let angles = t0 * half..;
            let (cos, sin) = (&self.cos[angles.clone()], &self.sin[angles]);
            rotate(q, cos, sin, half, q_heads, head_dim, pairs);
            // SAFETY: chunks hold disjoint tokens.
            let k = unsafe { k.range(t0 * k_row, n * k_row) };
            rotate(k, cos, sin, half, k_heads, head_dim, pairs);
        });
    }

    /// Rotates `x`: `[tokens, heads, head_dim]`, in place.
    pub fn apply(&self, x: &mut [f32], heads: usize, head_dim: usize) {
        let row = heads * head_dim;
        let tokens = lantern_quant::share::chunk_len(x.len(), row) / row.max(1);
        let (half, pairs) = (self.half, self.pairs);
        lantern_quant::share::for_each_chunk(x, tokens * row, &|c, x| {
            let angles = c * tokens * half..;
            let (cos, sin) = (&self.cos[angles.clone()], &self.sin[angles]);
            rotate(x, cos, sin, half, heads, head_dim, pairs);
        });
    }
}

lantern_quant::per_level! {
    /// Rotates every head of every token of `x` (`[tokens, heads, head_dim]`) by the
    /// token's row of `cos`/`sin` (`half` values each).
    fn rotate(
        x: &mut [f32],
        cos: &[f32],
        sin: &[f32],
        half: usize,
        heads: usize,
        head_dim: usize,
        pairs: RopePairs,
    ) {
        for (t, token) in x.chunks_exact_mut(heads * head_dim).enumerate() {
            let cos = &cos[t * half..(t + 1) * half];
            let sin = &sin[t * half..(t + 1) * half];
            for head in token.chunks_exact_mut(head_dim) {
                match pairs {
                    RopePairs::Adjacent => {
                        for ((pair, &c), &s) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
                            let (x0, x1) = (pair[0], pair[1]);
                            pair[0] = x0 * c - x1 * s;
                            pair[1] = x0 * s + x1 * c;
                        }
                    }
                    RopePairs::Halves => {
                        let (lo, hi) = head.split_at_mut(half);
                        for (((x0, x1), &c), &s) in lo.iter_mut().zip(hi).zip(cos).zip(sin) {
                            let (a, b) = (*x0, *x1);
                            *x0 = a * c - b * s;
                            *x1 = a * s + b * c;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::Value;
    use candle_core::quantized::{GgmlDType, QTensor};

    #[test]
    fn position_zero_is_identity() {
        let rope = Rope::new(4, 10000.0, RopePairs::Adjacent, None, &RopeScaling::None);
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        rope.table(&[0]).apply(&mut x, 1, 4);
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0]);
    }

    /// A step's tokens rotated together (in chunks, on several threads) get the bits each
    /// gets alone, in both pair layouts.
    #[test]
    fn many_tokens_rotate_as_each_alone() {
        let (heads, head_dim, tokens) = (9, 64, 300);
        let positions: Vec<usize> = (0..tokens).map(|t| 7 * t + 3).collect();
        for pairs in [RopePairs::Adjacent, RopePairs::Halves] {
            let rope = Rope::new(head_dim, 10000.0, pairs, None, &RopeScaling::None);
            let x: Vec<f32> = (0..tokens * heads * head_dim)
                .map(|i| ((i % 97) as f32 * 0.37).sin() + 0.01)
                .collect();
            let mut all = x.clone();
            rope.table(&positions).apply(&mut all, heads, head_dim);
            for (t, &p) in positions.iter().enumerate() {
                let row = t * heads * head_dim..(t + 1) * heads * head_dim;
                let mut alone = x[row.clone()].to_vec();
                rope.table(&[p]).apply(&mut alone, heads, head_dim);
                assert_eq!(alone, all[row], "{pairs:?}, token {t}");
            }
        }
    }

    /// Queries and keys rotated in one pass (`apply_qk`, chunked over tokens on several
    /// threads) get the bits each gets from `apply` on its own, in both pair layouts
    /// and with a partial rotary dimension.
    #[test]
    fn queries_and_keys_together_rotate_as_each_alone() {
        let (q_heads, k_heads, head_dim, tokens) = (9, 3, 64, 300);
        let positions: Vec<usize> = (0..tokens).map(|t| 5 * t + 1).collect();
        for (pairs, rotary) in [
            (RopePairs::Adjacent, 64),
            (RopePairs::Halves, 64),
            (RopePairs::Halves, 32),
        ] {
            let rope = Rope::new(rotary, 10000.0, pairs, None, &RopeScaling::None);
            let table = rope.table(&positions);
            let wave = |n: usize, f: f32| -> Vec<f32> {
                (0..n).map(|i| ((i % 89) as f32 * f).sin() + 0.01).collect()
            };
            let q = wave(tokens * q_heads * head_dim, 0.37);
            let k = wave(tokens * k_heads * head_dim, 0.61);
            let (mut q_alone, mut k_alone) = (q.clone(), k.clone());
            table.apply(&mut q_alone, q_heads, head_dim);
            table.apply(&mut k_alone, k_heads, head_dim);
            let (mut q_both, mut k_both) = (q, k);
            table.apply_qk((&mut q_both, q_heads), (&mut k_both, k_heads), head_dim);
            assert_eq!(q_both, q_alone, "{pairs:?} {rotary}: queries");
            assert_eq!(k_both, k_alone, "{pairs:?} {rotary}: keys");
        }
    }

    #[test]
    fn rotation_preserves_dot_products_of_equal_offsets() {
        // RoPE makes q·k depend on the position difference only.
        let rope = Rope::new(8, 100.0, RopePairs::Halves, None, &RopeScaling::None);
        let q0: Vec<f32> = (0..8).map(|i| (i as f32 * 0.3).sin()).collect();
        let k0: Vec<f32> = (0..8).map(|i| (i as f32 * 0.7).cos()).collect();
        let dot_at = |pq: usize, pk: usize| {
            let (mut q, mut k) = (q0.clone(), k0.clone());
            rope.table(&[pq]).apply(&mut q, 1, 8);
            rope.table(&[pk]).apply(&mut k, 1, 8);
            q.iter().zip(&k).map(|(a, b)| a * b).sum::<f32>()
        };
        assert!((dot_at(5, 2) - dot_at(13, 10)).abs() < 1e-4);
    }

    #[test]
    fn yarn_keeps_fast_frequencies_and_interpolates_slow_ones() {
        let yarn = RopeScaling::Yarn {
            factor: 4.0,
            original_context: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 0.1 * 4f32.ln() + 1.0,
            truncate: true,
        };
        let plain = Rope::new(128, 1e6, RopePairs::Halves, None, &RopeScaling::None);
        let scaled = Rope::new(128, 1e6, RopePairs::Halves, None, &yarn);
        // Wavelengths far below the context rotate as before, far above it are divided
        // by the factor, and in between lie between the two.
        assert_eq!(scaled.inv_freq[0], plain.inv_freq[0]);
        let last = plain.inv_freq.len() - 1;
        assert!((scaled.inv_freq[last] - plain.inv_freq[last] / 4.0).abs() < 1e-12);
        for (s, p) in scaled.inv_freq.iter().zip(&plain.inv_freq) {
            assert!(*s <= *p && *s >= p / 4.0 * 0.999_99);
        }
        assert!(scaled.magnitude > 1.0);
        let mut x = vec![1.0f32; 128];
        scaled.table(&[0]).apply(&mut x, 1, 128);
        assert!(x.iter().all(|&v| (v - scaled.magnitude).abs() < 1e-6));
    }

    /// Metadata only, as a GGUF file's keys.
    struct Metadata(std::collections::HashMap<String, Value>);

    impl WeightSource for Metadata {
        fn metadata(&self, key: &str) -> Option<&Value> {
            self.0.get(key)
        }
        fn tensor_info(&self, _: &str) -> Option<(Vec<usize>, GgmlDType)> {
            None
        }
        fn tensor_names(&self) -> Vec<String> {
            Vec::new()
        }
        fn tensor(&mut self, name: &str) -> Result<QTensor> {
            Err(ModelError::MissingTensor { name: name.into() })
        }
    }

    fn yarn_file(extra: &[(&str, Value)]) -> Metadata {
        let mut keys: std::collections::HashMap<String, Value> = [
            ("qwen2.rope.scaling.type", Value::String("yarn".into())),
            ("qwen2.rope.scaling.factor", Value::F32(4.0)),
            ("qwen2.rope.scaling.original_context_length", Value::U32(32)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        keys.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
        Metadata(keys)
    }

    fn attention_factor(file: &Metadata) -> f32 {
        match RopeScaling::read(file, "qwen2").unwrap() {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn gguf_attention_factors_multiply_yarns_own_as_in_llama_cpp() {
        let own = 0.1 * 4f32.ln() + 1.0;
        assert_eq!(attention_factor(&yarn_file(&[])), own);
        let halved = yarn_file(&[("qwen2.rope.scaling.yarn_attn_factor", Value::F32(0.5))]);
        assert!((attention_factor(&halved) - 0.5 * own).abs() < 1e-6);
        // A Hugging Face directory gives transformers' factor itself.
        let given = yarn_file(&[(keys::ROPE_ATTENTION_FACTOR, Value::F32(1.25))]);
        assert_eq!(attention_factor(&given), 1.25);
        let bad = yarn_file(&[("qwen2.rope.scaling.yarn_beta_fast", Value::F32(0.0))]);
        assert!(RopeScaling::read(&bad, "qwen2").is_err());
    }
}
