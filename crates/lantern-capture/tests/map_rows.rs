//! A map of every head's whole rows and a top-k map of all keys hold the same
//! probabilities: every value of the full map, bit for bit, is the one the top-k map
//! gives the same key, on every kind of layer (plain, sliding window, soft-capped, with
//! sinks), so that ranking keys neither drops nor changes one.

use lantern_capture::CaptureSpec;
mod common;

use common::*;

#[test]
fn a_top_k_map_of_every_key_holds_the_full_maps_values() {
    let seed: u64 = rand::random();
    let all = CaptureSpec::everything(4, HEADS);
    let full = pending(all.clone(), seed).finalize().unwrap();
    let ranked = pending(
        CaptureSpec {
            top_k: Some(TOKENS),
            ..all
        },
        seed,
    )
    .finalize()
    .unwrap();
    for (full, ranked) in full.layers.iter().zip(&ranked.layers) {
        let [rows, heads, keys] = full.shape;
        assert_eq!(ranked.shape, full.shape, "seed {seed}");
        let indices = ranked.indices.as_ref().unwrap();
        let mut scattered = vec![f32::NAN; rows * heads * keys];
        for (i, (&value, &key)) in ranked.values.iter().zip(indices).enumerate() {
            scattered[i / keys * keys + key as usize] = value;
        }
        let differ = full
            .values
            .iter()
            .zip(&scattered)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(differ, None, "layer {}, seed {seed}", full.layer_idx);
        // Nothing trivially equal: each row is a distribution (less a sink's share)
        // with masked keys at 0.
        let last_row: f32 = full.values[(rows * heads - 1) * keys..].iter().sum();
        assert!(last_row > 0.0 && last_row < 1.0 + 1e-5, "{last_row}");
        assert!(full.values.contains(&0.0));
    }
}
