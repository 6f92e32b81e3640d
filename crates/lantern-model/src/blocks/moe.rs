//! The mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE, gpt-oss): a router scores every
//! expert for each token, the `used` best run on it, and their outputs are summed weighted
//! by the router's softmax probabilities (divided by the chosen ones' sum where the model
//! says: then they are the softmax of the chosen logits, gpt-oss's routing). gpt-oss adds
//! biases to the router and to every expert's projections.

use super::{Activation, Loader, Mlp};
use crate::compute::Compute;
use crate::error::{ModelError, Result};
use crate::hparams::ExpertParams;

pub struct Moe<C: Compute> {
    /// `[experts, hidden]`: one logit per expert.
    router: C::Matrix,
    /// Added to the router's logits (gpt-oss).
    router_bias: Option<Vec<f32>>,
    experts: Vec<Mlp<C>>,
    used: usize,
    normalize_weights: bool,
    hidden: usize,
}

/// The tokens one expert runs on, ascending, and the weight of its output in each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExpertRows {
    pub rows: Vec<usize>,
    pub weights: Vec<f32>,
}

impl<C: Compute> Moe<C> {
    /// Layer `l`'s router `ffn_gate_inp` and experts `ffn_{gate,up,down}` (stacked or one
    /// tensor per expert, see [`Loader::experts`]).
    pub fn load(
        c: &C,
        loader: &mut Loader,
        l: usize,
        hidden: usize,
        params: ExpertParams,
        normalize_weights: bool,
        activation: Activation,
    ) -> Result<Self> {
        let name = |t: &str| format!("blk.{l}.{t}");
        let count = params.count;
        let router = loader.linear(c, &name("ffn_gate_inp.weight"), count, hidden)?;
        let router_bias = loader.opt_vector(&name("ffn_gate_inp.bias"), count)?;
        let ffn = params.ffn;
        let down_biases = loader.expert_biases(&name("ffn_down"), count, hidden)?;
        let downs = loader.experts(&name("ffn_down"), count, hidden, ffn)?;
        let (mut experts, gate_up_biases) = if loader.has(&name("ffn_gate_up_exps.weight")) {
            // Gate and up of each expert in one matrix, gate first.
            let gate_ups = loader.experts(&name("ffn_gate_up"), count, 2 * ffn, hidden)?;
            let biases = loader
                .expert_biases(&name("ffn_gate_up"), count, 2 * ffn)?
                .map(|all| {
                    let halves = |b: Vec<f32>| (b[..ffn].to_vec(), b[ffn..].to_vec());
                    all.into_iter().map(halves).collect::<Vec<_>>()
                });
            let experts = gate_ups
                .into_iter()
                .zip(downs)
                .map(|(gate_up, down)| {
                    Mlp::from_fused(c, loader.options, gate_up, ffn, down, activation)
                })
                .collect::<Result<Vec<_>>>()?;
            (experts, biases)
        } else {
            let gates = loader.experts(&name("ffn_gate"), count, ffn, hidden)?;
            let ups = loader.experts(&name("ffn_up"), count, ffn, hidden)?;
            let gate_biases = loader.expert_biases(&name("ffn_gate"), count, ffn)?;
            let up_biases = loader.expert_biases(&name("ffn_up"), count, ffn)?;
            let biases = match (gate_biases, up_biases) {
                (Some(g), Some(u)) => Some(g.into_iter().zip(u).collect()),
                (None, None) => None,
                _ => {
                    return Err(ModelError::InvalidConfig(format!(
                        "layer {l}'s experts have a bias on one of gate and up only"
                    )))
                }
            };
            let experts = gates
                .into_iter()
                .zip(ups)
                .zip(downs)
                .map(|((gate, up), down)| {
                    Mlp::from_parts(c, loader.options, gate, up, down, activation)
                })
                .collect::<Result<Vec<_>>>()?;
            (experts, biases)
        };
        if gate_up_biases.is_some() || down_biases.is_some() {
            let mut gate_up_biases = gate_up_biases.map(Vec::into_iter);
            let mut down_biases = down_biases.map(Vec::into_iter);
            for expert in &mut experts {
                let gate_up = gate_up_biases.as_mut().and_then(Iterator::next);
                let down = down_biases.as_mut().and_then(Iterator::next);
                expert.set_biases(c, &name("ffn_*_exps.bias"), gate_up, down)?;
            }
        }
        Ok(Self {
            router,
            router_bias,
            experts,
            used: params.used,
            normalize_weights,
            hidden,
        })
    }

    /// The layer's output for the `tokens` rows of `x` (normalized input).
    pub fn forward(&self, c: &C, x: &C::Act, tokens: usize) -> Result<C::Act> {
        let mut logits = c.to_host(c.matmul(&self.router, x, tokens)?)?;
        if let Some(bias) = &self.router_bias {
            for row in logits.chunks_exact_mut(bias.len()) {
                row.iter_mut().zip(bias).for_each(|(l, b)| *l += b);
            }
        }
        let routes = route(
            &logits,
            self.experts.len(),
            self.used,
            self.normalize_weights,
        )?;
        let mut out = c.zeros(tokens, self.hidden)?;
        for (expert, route) in self.experts.iter().zip(&routes) {
            let n = route.rows.len();
            if n == 0 {
                continue;
            }
            // Every token chose this expert: its input is `x` as it is.
            let picked;
            let input = if n == tokens {
                x
            } else {
                picked = c.select_rows(x, &route.rows, self.hidden)?;
                &picked
            };
            let y = expert.forward(c, input, n)?;
            c.add_rows_scaled(&mut out, &y, &route.rows, &route.weights, self.hidden)?;
        }
        Ok(out)
    }
}

/// Each expert's tokens and weights from the router's `logits` (`[tokens, experts]`):
/// per token the softmax over every expert, the `used` most probable (the lower index
/// first among equals), their probabilities divided by their sum when `normalize`.
pub fn route(
    logits: &[f32],
    experts: usize,
    used: usize,
    normalize: bool,
) -> Result<Vec<ExpertRows>> {
    if experts == 0 || used == 0 || used > experts || !logits.len().is_multiple_of(experts) {
        return Err(ModelError::Compute(format!(
            "{} router logits cannot choose {used} of {experts} experts per token",
            logits.len()
        )));
    }
    let mut routes = vec![ExpertRows::default(); experts];
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    let mut probs = vec![0f32; experts];
    for (token, row) in logits.chunks_exact(experts).enumerate() {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for (p, &l) in probs.iter_mut().zip(row) {
            *p = (l - max).exp();
        }
        let sum: f32 = probs.iter().sum();
        for p in probs.iter_mut() {
            *p /= sum;
        }
        order.clear();
        order.extend(0..experts);
        // Stable: equal probabilities keep the lower index first. A total order, so
        // NaN (a broken model) gives some choice rather than a panic.
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let chosen = &order[..used];
        let total: f32 = chosen.iter().map(|&e| probs[e]).sum();
        for &e in chosen {
            let weight = if normalize {
                probs[e] / total
            } else {
                probs[e]
            };
            routes[e].rows.push(token);
            routes[e].weights.push(weight);
        }
    }
    Ok(routes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same routing written the plain way: for each token, the experts by
    /// descending probability.
    fn reference(
        logits: &[f32],
        experts: usize,
        used: usize,
        normalize: bool,
    ) -> Vec<Vec<(usize, f64)>> {
        logits
            .chunks(experts)
            .map(|row| {
                let max = row.iter().fold(f64::MIN, |m, &l| m.max(l as f64));
                let e: Vec<f64> = row.iter().map(|&l| (l as f64 - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                let mut idx: Vec<usize> = (0..experts).collect();
                idx.sort_by(|&a, &b| e[b].partial_cmp(&e[a]).unwrap());
                let chosen: Vec<usize> = idx[..used].to_vec();
                let total: f64 = chosen.iter().map(|&i| e[i] / sum).sum();
                chosen
                    .into_iter()
                    .map(|i| {
                        (
                            i,
                            if normalize {
                                e[i] / sum / total
                            } else {
                                e[i] / sum
                            },
                        )
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn routes_match_the_plain_computation_on_random_logits() {
        let mut state = 0x2545_f491_u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f32 / (1u64 << 53) as f32 * 8.0 - 4.0
        };
        for (experts, used, normalize) in [(8, 2, true), (8, 2, false), (64, 8, true), (4, 4, true)]
        {
            let tokens = 13;
            let logits: Vec<f32> = (0..tokens * experts).map(|_| next()).collect();
            let routes = route(&logits, experts, used, normalize).unwrap();
            let want = reference(&logits, experts, used, normalize);
            for (t, chosen) in want.iter().enumerate() {
                for &(e, w) in chosen {
                    let r = &routes[e];
                    let i = r
                        .rows
                        .iter()
                        .position(|&row| row == t)
                        .expect("expert chosen");
                    let rel = ((r.weights[i] as f64 - w) / w).abs();
                    assert!(rel < 1e-5, "token {t} expert {e}: {} vs {w}", r.weights[i]);
                }
            }
            let per_token: usize = routes.iter().map(|r| r.rows.len()).sum();
            assert_eq!(per_token, tokens * used);
            for r in &routes {
                assert!(r.rows.windows(2).all(|w| w[0] < w[1]), "rows ascending");
            }
        }
    }

    #[test]
    fn ties_go_to_the_lower_index_and_normalized_weights_sum_to_one() {
        let routes = route(&[1.0, 3.0, 3.0, 0.0], 4, 2, true).unwrap();
        assert_eq!(routes[1].rows, [0]);
        assert_eq!(routes[2].rows, [0]);
        assert!((routes[1].weights[0] - 0.5).abs() < 1e-6);
        let routes = route(&[1.0, 3.0, 3.0, 0.0], 4, 1, true).unwrap();
        assert_eq!(routes[1].weights, [1.0]);
        assert!(routes[2].rows.is_empty());
    }

    #[test]
    fn malformed_router_outputs_are_errors_not_panics() {
        assert!(route(&[0.0; 7], 4, 2, true).is_err());
        assert!(route(&[0.0; 8], 4, 5, true).is_err());
        assert!(route(&[f32::NAN; 8], 4, 2, true).is_ok());
    }
}
