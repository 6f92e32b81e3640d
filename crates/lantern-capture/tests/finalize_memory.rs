//! Finalizing a capture holds, beside the maps it returns (what the admission estimate
//! counts), only one row of every head at a time: never `rows × heads × keys`.
//! Measured with a global allocator that tracks the peak of live bytes; one test in
//! this binary so that nothing else allocates meanwhile.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use lantern_attn::AttentionLayerSpec;
use lantern_capture::{
    CaptureSpec, HeadReduce, KeySnapshot, PendingCapture, QueryRowBuffer, TokenInfo,
};

struct PeakCounting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for PeakCounting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: PeakCounting = PeakCounting;

const TOKENS: usize = 1024;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 8;

/// A prompt-only capture of every row of one layer, with deterministic queries and keys.
fn pending(reduce: HeadReduce, top_k: Option<usize>) -> PendingCapture {
    let spec = CaptureSpec {
        reduce,
        top_k,
        ..CaptureSpec::everything(1, HEADS)
    };
    let wave = |i: usize| ((i as f32) * 0.37).sin();
    let mut buffer = QueryRowBuffer::new(spec, 1, HEADS, HEAD_DIM, TOKENS, 0);
    let q: Vec<f32> = (0..TOKENS * HEADS * HEAD_DIM).map(wave).collect();
    buffer.record(0, 0, &q, &[]);
    let keys = KeySnapshot {
        first_key: 0,
        num_keys: TOKENS,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        keys: (0..TOKENS * KV_HEADS * HEAD_DIM)
            .map(|i| wave(i + 7))
            .collect(),
        values: None,
    };
    PendingCapture {
        buffer,
        layers: vec![(AttentionLayerSpec::new(HEADS, KV_HEADS, HEAD_DIM), keys)],
        prompt_len: TOKENS,
        tokens: (0..TOKENS)
            .map(|i| TokenInfo {
                id: i as u32,
                text: String::new(),
            })
            .collect(),
        num_computed: TOKENS,
    }
}

#[test]
fn finalize_holds_one_row_of_heads_beside_the_maps() {
    let dense_bytes = TOKENS * HEADS * TOKENS * 4;
    // The capture's metadata (tokens, row and key positions) and one row of every head
    // (`HEADS × TOKENS` floats) fit well within this.
    let slack = 256 << 10;
    assert!(slack * 16 <= dense_bytes);
    for (reduce, top_k) in [
        (HeadReduce::MeanHeads, Some(1)),
        (HeadReduce::None, Some(2)),
        (HeadReduce::MaxHeads, None),
    ] {
        let capture = pending(reduce, top_k);
        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        let result = capture.finalize().unwrap();
        let peak = PEAK.load(Ordering::Relaxed) - before;

        let map = &result.layers[0];
        let width = top_k.unwrap_or(TOKENS);
        let heads = if reduce == HeadReduce::None { HEADS } else { 1 };
        assert_eq!(map.shape, [TOKENS, heads, width]);
        let map_bytes = (map.values.len() + map.indices.as_ref().map_or(0, Vec::len)) * 4;
        assert_eq!(
            map_bytes as u64,
            capture.buffer.spec().estimate_bytes(TOKENS, 0),
            "{reduce:?} top-k {top_k:?}: the maps are what the estimate counts"
        );
        assert!(
            peak <= map_bytes + slack,
            "{reduce:?} top-k {top_k:?}: finalizing peaked at {peak} bytes for {map_bytes} bytes of maps (a dense buffer would be {dense_bytes})"
        );
        // Each row is a distribution (or its top part).
        let row_sum: f32 = map.values[..heads * width].iter().sum();
        assert!(row_sum > 0.0 && row_sum <= heads as f32 + 1e-4, "{row_sum}");
    }
}
