//! Key statistics equal the reductions of the full maps they come from, on layers of
//! every kind a kernel runs (plain causal, sliding window, soft-capped, with sinks), for
//! every grouping of heads; and the masses add up to the number of rows (less the
//! sinks' share). Random queries and keys, so nothing is special-cased by the values.

use lantern_capture::{
    CaptureResult, CaptureSpec, HeadReduce, KeyStat, LayerStat, RowSelection, StatHeads,
};
mod common;

use common::*;

fn spec(rows: RowSelection, stats_heads: StatHeads, maps: bool) -> CaptureSpec {
    CaptureSpec {
        rows,
        stats: KeyStat::ALL.to_vec(),
        stats_heads,
        maps,
        ..CaptureSpec::everything(4, HEADS)
    }
}

fn stat(result: &CaptureResult, layer: usize, which: KeyStat) -> &LayerStat {
    result
        .stats
        .iter()
        .find(|s| s.layer_idx == layer && s.stat == which)
        .unwrap_or_else(|| panic!("no {which:?} for layer {layer}"))
}

#[test]
fn statistics_equal_the_reductions_of_the_maps_bit_for_bit() {
    for by in [StatHeads::Kv, StatHeads::Query, StatHeads::Mean] {
        for rows in [
            RowSelection::All,
            RowSelection::Generated,
            RowSelection::Range { start: 3, end: 12 },
        ] {
            let result = pending(spec(rows, by, true), 7).finalize().unwrap();
            let keys = result.meta.key_positions.len();
            let num_rows = result.meta.row_positions.len();
            assert!(num_rows > 0);
            for (layer, groups) in result.meta.stats_groups.iter().enumerate() {
                // Groups name query heads; here every head is captured, so they are
                // also the indices the maps use.
                let expected_groups = match by {
                    StatHeads::Kv => 2,
                    StatHeads::Query => HEADS,
                    StatHeads::Mean => 1,
                };
                assert_eq!(groups.len(), expected_groups, "{by:?}");
                let per_row = group_rows(&result, layer, groups);
                let mut mass = vec![0f32; groups.len() * keys];
                let mut max = vec![0f32; groups.len() * keys];
                for row in &per_row {
                    for (i, &v) in row.iter().enumerate() {
                        mass[i] += v;
                        max[i] = max[i].max(v);
                    }
                }
                let case = format!("{by:?} {rows:?} layer {layer}");
                assert_eq!(
                    stat(&result, layer, KeyStat::KeyMass).values,
                    mass,
                    "{case}"
                );
                assert_eq!(stat(&result, layer, KeyStat::KeyMax).values, max, "{case}");
                let blocks = stat(&result, layer, KeyStat::BlockMass);
                assert_eq!(blocks.shape, [groups.len(), keys.div_ceil(BLOCK)]);
                for (g, group_mass) in mass.chunks(keys).enumerate() {
                    for (b, block) in group_mass.chunks(BLOCK).enumerate() {
                        let value = blocks.values[g * blocks.shape[1] + b];
                        assert_eq!(value, block.iter().sum::<f32>(), "{case} block {b}");
                    }
                    // Rows sum to 1 (less the sinks' share): so do the masses, to the
                    // number of rows.
                    let total: f32 = group_mass.iter().sum();
                    let has_sinks = result.meta.layer_attention[layer].has_sinks;
                    if has_sinks {
                        assert!(total < num_rows as f32 && total > 0.0, "{case}: {total}");
                    } else {
                        let err = (total - num_rows as f32).abs() / num_rows as f32;
                        assert!(err < 1e-5, "{case}: masses sum to {total}, rows {num_rows}");
                    }
                }
            }
        }
    }
}

#[test]
fn mean_statistics_are_the_sums_of_the_mean_heads_maps() {
    let mut with_reduced_maps = spec(RowSelection::All, StatHeads::Mean, true);
    with_reduced_maps.reduce = HeadReduce::MeanHeads;
    let result = pending(with_reduced_maps, 11).finalize().unwrap();
    for (layer, map) in result.layers.iter().enumerate() {
        let keys = map.shape[2];
        let mut mass = vec![0f32; keys];
        for row in map.values.chunks(keys) {
            for (m, &v) in mass.iter_mut().zip(row) {
                *m += v;
            }
        }
        assert_eq!(stat(&result, layer, KeyStat::KeyMass).values, mass);
    }
}

#[test]
fn statistics_alone_are_the_same_numbers_without_the_maps() {
    let both = pending(spec(RowSelection::All, StatHeads::Kv, true), 3)
        .finalize()
        .unwrap();
    let alone = pending(spec(RowSelection::All, StatHeads::Kv, false), 3)
        .finalize()
        .unwrap();
    assert!(alone.layers.is_empty() && !alone.meta.maps);
    assert_eq!(alone.stats, both.stats);
    assert_eq!(alone.meta.block_size, Some(BLOCK));
    assert_eq!(alone.meta.stats_heads.as_deref(), Some("kv"));
    // Kv groups: query heads 0-2 share kv head 0, 3-5 kv head 1.
    assert_eq!(
        alone.meta.stats_groups[0],
        vec![vec![0, 1, 2], vec![3, 4, 5]]
    );
    // What admission counts for them is kilobytes, not maps.
    let s = spec(RowSelection::All, StatHeads::Kv, false);
    let with_maps = spec(RowSelection::All, StatHeads::Kv, true);
    assert!(s.estimate_bytes(PROMPT, GENERATED) * 4 < with_maps.estimate_bytes(PROMPT, GENERATED));
}

/// The maps and statistics are the same bits at every exact kernel level this CPU runs
/// (the scores are the attention kernel's own, written per level), on every kind of
/// layer, and a map row is a probability distribution (less a sink's share).
#[test]
fn captures_are_the_same_bits_at_every_kernel_level() {
    use lantern_quant::{force_kernel, Kernel};
    let spec = spec(RowSelection::All, StatHeads::Query, true);
    let mut results = Vec::new();
    for level in Kernel::ALL
        .into_iter()
        .filter(|k| k.available() && k.is_exact())
    {
        force_kernel(Some(level));
        let result = pending(spec.clone(), 11).finalize().unwrap();
        force_kernel(None);
        results.push((level, result));
    }
    let (_, first) = &results[0];
    for (level, result) in &results[1..] {
        for (a, b) in first.layers.iter().zip(&result.layers) {
            let same = a
                .values
                .iter()
                .zip(&b.values)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "layer {}: {level}", a.layer_idx);
        }
        assert_eq!(first.stats, result.stats, "{level}");
    }
    for map in first.layers.iter().filter(|m| m.layer_idx != 3) {
        for row in map.values.chunks(map.shape[2]) {
            let sum: f32 = row.iter().sum();
            assert!(
                (sum - 1.0).abs() < 1e-5,
                "layer {}: a row sums to {sum}",
                map.layer_idx
            );
        }
    }
}
