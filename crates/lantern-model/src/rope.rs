//! Rotary position embeddings.
//!
//! Tables are built per step for the positions in the batch, never for the whole context
//! (a 131k-position table per layer is gigabytes for nothing).

/// How the rotated pairs are laid out inside a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopePairs {
    /// `(x[2i], x[2i+1])`: GGUF-converted Llama weights are permuted so that pairs sit next
    /// to each other (llama.cpp's "normal" rope mode).
    Adjacent,
    /// `(x[i], x[i + d/2])`: the Hugging Face "rotate_half" layout (GGUF NeoX mode, Gemma).
    Halves,
}

/// Inverse frequencies of one rotary embedding.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    rotary_dim: usize,
    pairs: RopePairs,
}

impl Rope {
    /// `freq_factors` (Llama 3 style `rope_freqs`) divide the frequencies; `linear_factor`
    /// divides positions.
    pub fn new(
        rotary_dim: usize,
        base: f32,
        pairs: RopePairs,
        freq_factors: Option<&[f32]>,
        linear_factor: f32,
    ) -> Self {
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| {
                let f = 1.0 / base.powf((2 * i) as f32 / rotary_dim as f32);
                let f = f / freq_factors
                    .and_then(|ff| ff.get(i))
                    .copied()
                    .unwrap_or(1.0);
                f / linear_factor
            })
            .collect();
        Self {
            inv_freq,
            rotary_dim,
            pairs,
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
                cos.push(angle.cos());
                sin.push(angle.sin());
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

/// cos/sin of the positions of one step.
pub struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    pairs: RopePairs,
}

impl RopeTable {
    /// Rotates `x`: `[tokens, heads, head_dim]`, in place.
    pub fn apply(&self, x: &mut [f32], heads: usize, head_dim: usize) {
        let half = self.half;
        for (t, token) in x.chunks_exact_mut(heads * head_dim).enumerate() {
            let cos = &self.cos[t * half..(t + 1) * half];
            let sin = &self.sin[t * half..(t + 1) * half];
            for head in token.chunks_exact_mut(head_dim) {
                for i in 0..half {
                    let (a, b) = match self.pairs {
                        RopePairs::Adjacent => (2 * i, 2 * i + 1),
                        RopePairs::Halves => (i, i + half),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos[i] - x1 * sin[i];
                    head[b] = x0 * sin[i] + x1 * cos[i];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity() {
        let rope = Rope::new(4, 10000.0, RopePairs::Adjacent, None, 1.0);
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        rope.table(&[0]).apply(&mut x, 1, 4);
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn rotation_preserves_dot_products_of_equal_offsets() {
        // RoPE makes q·k depend on the position difference only.
        let rope = Rope::new(8, 100.0, RopePairs::Halves, None, 1.0);
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
}
