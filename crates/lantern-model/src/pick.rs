//! Logits rows reduced to one token where the logits are ([`RowPick`]): a model on a
//! device then copies the token's id to the host instead of the vocabulary-wide row.

/// What the caller wants of one logits row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowPick {
    /// The whole row, on the host.
    Whole,
    /// Its argmax (the first on ties): greedy sampling.
    Argmax,
    /// The token a uniform draw picks from the row's softmax ([`SampleDraw`]).
    Sample(SampleDraw),
}

impl RowPick {
    /// Whether the row is reduced to a token where the logits are.
    pub fn is_picked(self) -> bool {
        self != RowPick::Whole
    }

    /// The draw of a sampled row (`None`: its argmax).
    pub fn draw(self) -> Option<SampleDraw> {
        match self {
            RowPick::Sample(d) => Some(d),
            _ => None,
        }
    }
}

/// Sampling from the whole softmax of a row at a temperature, by inverse transform: the
/// token where the running sum of `exp((logit - max) / temperature)`, in id order, first
/// passes `draw` times the row's total. The host sampler picks the same way from the same
/// draw of the request's random stream; only the order of a device's sums differs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleDraw {
    /// Uniform in [0, 1).
    pub draw: f32,
    /// 1 / temperature (> 0).
    pub inv_temperature: f32,
}

/// [`SampleDraw`]'s token of `row`, summed in id order (the reference a device's kernel
/// is held to). A row whose sums fall short of the threshold (rounding, or no finite
/// logit) gives its argmax, as the host sampler does.
pub fn sample_row(row: &[f32], d: SampleDraw) -> u32 {
    let max = row
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let weight = |v: f32| {
        let w = ((v - max) * d.inv_temperature).exp();
        if w.is_nan() {
            0.0
        } else {
            w
        }
    };
    let total: f32 = row.iter().map(|&v| weight(v)).sum();
    let mut threshold = d.draw * total;
    for (id, &v) in row.iter().enumerate() {
        let p = weight(v);
        if threshold < p {
            return id as u32;
        }
        threshold -= p;
    }
    first_max(row)
}

/// The first index of the largest value (NaN never wins).
pub fn first_max(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] || row[best].is_nan() && !v.is_nan() {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Draws spread over [0, 1) pick each token as often as its softmax probability
    /// says, at two temperatures; the lowest draw picks the first token of mass.
    #[test]
    fn draws_pick_tokens_in_proportion_to_the_softmax() {
        let row = [1.0f32, -2.0, 0.5, 3.0, f32::NEG_INFINITY, 0.0];
        for temperature in [1.0f32, 0.5] {
            let inv_temperature = 1.0 / temperature;
            let weights: Vec<f64> = row
                .iter()
                .map(|&v| (((v - 3.0) * inv_temperature) as f64).exp())
                .collect();
            let total: f64 = weights.iter().sum();
            let n = 100_000;
            let mut counts = [0usize; 6];
            for i in 0..n {
                let draw = (i as f32 + 0.5) / n as f32;
                counts[sample_row(
                    &row,
                    SampleDraw {
                        draw,
                        inv_temperature,
                    },
                ) as usize] += 1;
            }
            for (id, &c) in counts.iter().enumerate() {
                let want = weights[id] / total;
                let got = c as f64 / n as f64;
                assert!(
                    (got - want).abs() < 1e-3,
                    "token {id}: {got} against {want}"
                );
            }
            assert_eq!(counts[4], 0, "a token of -inf is never sampled");
            let first = SampleDraw {
                draw: 0.0,
                inv_temperature,
            };
            assert_eq!(sample_row(&row, first), 0);
        }
    }

    #[test]
    fn a_row_without_mass_gives_its_argmax() {
        let d = SampleDraw {
            draw: 0.5,
            inv_temperature: 1.0,
        };
        assert_eq!(sample_row(&[f32::NEG_INFINITY; 3], d), 0);
        assert_eq!(sample_row(&[f32::NAN, 2.0, f32::NAN], d), 1);
        assert_eq!(first_max(&[1.0, 3.0, 3.0]), 1);
    }
}
