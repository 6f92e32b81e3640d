//! Finalizing on several threads (a GPU engine's idle host cores, or those `--threads`
//! leaves) gives what one thread gives, bit for bit, whatever a capture asks for: full
//! maps, a head reduction with top-k, key statistics and span masses over a row range,
//! statistics alone; the calling thread paces itself after its own layers only; and a
//! layer that cannot be finalized fails the capture with the same error.

use lantern_capture::{
    CaptureError, CaptureSpan, CaptureSpec, HeadReduce, KeyStat, RowSelection, StatHeads,
};
mod common;

use common::*;

fn specs() -> Vec<CaptureSpec> {
    let all = CaptureSpec::everything(4, HEADS);
    let spans = vec![
        CaptureSpan::tokens("doc a", 3..9),
        CaptureSpan::tokens("doc b", 9..14),
    ];
    vec![
        all.clone(),
        CaptureSpec {
            reduce: HeadReduce::MaxHeads,
            top_k: Some(5),
            ..all.clone()
        },
        CaptureSpec {
            rows: RowSelection::Range { start: 3, end: 12 },
            stats: KeyStat::ALL.to_vec(),
            stats_heads: StatHeads::Kv,
            spans,
            ..all.clone()
        },
        CaptureSpec {
            stats: KeyStat::ALL.to_vec(),
            maps: false,
            ..all
        },
    ]
}

#[test]
fn every_thread_count_finalizes_the_same_bits() {
    for (i, spec) in specs().into_iter().enumerate() {
        let seed = 40 + i as u64;
        let one = pending(spec.clone(), seed).finalize().unwrap();
        assert!(!one.layers.is_empty() || !one.stats.is_empty(), "spec {i}");
        for threads in [2, 3, 4, 9] {
            let mut capture = pending(spec.clone(), seed);
            capture.finalize_threads = threads;
            let mut paced = 0;
            let many = capture.finalize_with(|| paced += 1).unwrap();
            // Debug prints each f32 exactly (shortest round trip), so equal text is
            // equal bits.
            assert_eq!(
                format!("{many:?}"),
                format!("{one:?}"),
                "spec {i}, {threads} threads"
            );
            // Only after the layers the calling thread took (the helpers may take all).
            assert!(paced <= 4, "spec {i}: paced {paced} times");
        }
    }
}

#[test]
fn a_layer_without_keys_fails_the_capture_on_any_thread_count() {
    for threads in [1, 3] {
        let mut capture = pending(CaptureSpec::everything(4, HEADS), 7);
        capture.layers.truncate(3);
        capture.finalize_threads = threads;
        match capture.finalize() {
            Err(CaptureError::Incomplete(why)) => {
                assert!(why.contains("layer slot 3"), "{threads} threads: {why}")
            }
            other => panic!("{threads} threads: {other:?}"),
        }
    }
}
