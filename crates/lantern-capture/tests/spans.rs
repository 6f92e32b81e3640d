//! Span masses equal the full maps summed over each span's keys (and over the keys
//! outside every span), bit for bit, on layers of every kind a kernel runs (plain
//! causal, sliding window, soft-capped, with sinks) and every grouping of heads; each
//! row's span masses and the rest add up to 1 (less the sinks' share). Random queries
//! and keys, so nothing is special-cased by the values.

use lantern_capture::{
    CaptureGeometry, CaptureSpan, CaptureSpec, HeadReduce, KeyStat, RowSelection, StatHeads,
};
mod common;

use common::*;

fn spans() -> Vec<CaptureSpan> {
    vec![
        CaptureSpan::tokens("first", 0..1),
        CaptureSpan::tokens("doc a", 3..9),
        CaptureSpan::tokens("doc b", 9..14),
        CaptureSpan::tokens("last", PROMPT - 2..PROMPT),
    ]
}

fn spec(rows: RowSelection, stats_heads: StatHeads, maps: bool) -> CaptureSpec {
    CaptureSpec {
        rows,
        stats_heads,
        maps,
        spans: spans(),
        ..CaptureSpec::everything(4, HEADS)
    }
}

#[test]
fn span_masses_equal_the_maps_summed_over_their_keys_bit_for_bit() {
    let spans = spans();
    for by in [StatHeads::Kv, StatHeads::Query, StatHeads::Mean] {
        for rows in [
            RowSelection::All,
            RowSelection::Generated,
            RowSelection::Range { start: 3, end: 12 },
        ] {
            let result = pending(spec(rows, by, true), 5).finalize().unwrap();
            let keys = result.meta.key_positions.len();
            let num_rows = result.meta.row_positions.len();
            assert!(num_rows > 0);
            assert_eq!(result.meta.spans.len(), spans.len());
            assert_eq!(result.span_mass.len(), 4);
            for (layer, groups) in result.meta.stats_groups.iter().enumerate() {
                let case = format!("{by:?} {rows:?} layer {layer}");
                let mass = &result.span_mass[layer];
                let width = spans.len() + 1;
                assert_eq!(mass.shape, [num_rows, groups.len(), width], "{case}");
                let per_row = group_rows(&result, layer, groups);
                let has_sinks = result.meta.layer_attention[layer].has_sinks;
                for (r, row) in per_row.iter().enumerate() {
                    for (g, probs) in row.chunks(keys).enumerate() {
                        let got = &mass.values[(r * groups.len() + g) * width..][..width];
                        let mut expected = vec![0f32; width];
                        for (k, &p) in probs.iter().enumerate() {
                            let s = spans
                                .iter()
                                .position(|s| s.tokens.as_ref().unwrap().contains(&k))
                                .unwrap_or(spans.len());
                            expected[s] += p;
                        }
                        assert_eq!(got, &expected[..], "{case} row {r} group {g}");
                        let total: f32 = got.iter().sum();
                        if has_sinks {
                            assert!(total < 1.0 && total > 0.0, "{case}: {total}");
                        } else {
                            assert!((total - 1.0).abs() < 1e-5, "{case}: row sums to {total}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn mean_span_masses_are_the_mean_heads_maps_summed_over_the_span() {
    let mut with_reduced_maps = spec(RowSelection::Generated, StatHeads::Mean, true);
    with_reduced_maps.reduce = HeadReduce::MeanHeads;
    let result = pending(with_reduced_maps, 13).finalize().unwrap();
    for (layer, map) in result.layers.iter().enumerate() {
        let keys = map.shape[2];
        for (r, row) in map.values.chunks(keys).enumerate() {
            let got = &result.span_mass[layer].values[r * 5..(r + 1) * 5];
            let doc_a: f32 = row[3..9].iter().sum();
            assert_eq!(got[1], doc_a);
            let outside = row[1..3]
                .iter()
                .chain(&row[14..PROMPT - 2])
                .chain(&row[PROMPT..]);
            assert_eq!(got[4], outside.sum::<f32>());
        }
    }
}

#[test]
fn spans_alone_are_the_same_numbers_without_the_maps_and_beside_statistics() {
    let both = pending(spec(RowSelection::All, StatHeads::Mean, true), 3)
        .finalize()
        .unwrap();
    let alone = pending(spec(RowSelection::All, StatHeads::Mean, false), 3)
        .finalize()
        .unwrap();
    assert!(alone.layers.is_empty() && !alone.meta.maps && alone.stats.is_empty());
    assert_eq!(alone.span_mass, both.span_mass);
    assert_eq!(alone.meta.stats_heads.as_deref(), Some("mean"));
    assert_eq!(alone.meta.stats_groups[0], vec![vec![0, 1, 2, 3, 4, 5]]);
    assert_eq!(alone.meta.block_size, None);
    assert_eq!(alone.meta.spans[1].label, "doc a");
    assert_eq!(alone.meta.spans[1].tokens, [3, 9]);
    let mut with_stats = spec(RowSelection::All, StatHeads::Mean, false);
    with_stats.stats = vec![KeyStat::KeyMass];
    let with_stats = pending(with_stats, 3).finalize().unwrap();
    assert_eq!(with_stats.span_mass, both.span_mass);
    assert_eq!(with_stats.stats.len(), 4);
    // Admission counts them: layers x rows x groups x (spans + 1) x 4 bytes.
    let s = spec(RowSelection::All, StatHeads::Mean, false);
    assert_eq!(
        s.estimate_bytes(PROMPT, GENERATED),
        4 * TOKENS as u64 * 5 * 4
    );
    let without = CaptureSpec {
        spans: Vec::new(),
        ..s.clone()
    };
    let geometry = CaptureGeometry {
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
    };
    assert!(
        s.admission_bytes(PROMPT, GENERATED, geometry)
            > without.admission_bytes(PROMPT, GENERATED, geometry)
    );
}

#[test]
fn an_unresolved_span_fails_finalizing_rather_than_guessing() {
    let mut s = spec(RowSelection::All, StatHeads::Mean, false);
    s.spans = vec![CaptureSpan::new(
        "chars",
        lantern_capture::SpanAt::Chars(0..4),
    )];
    let e = pending(s, 1).finalize().unwrap_err().to_string();
    assert!(e.contains("never resolved"), "{e}");
}
