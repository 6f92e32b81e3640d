//! A capture — its query rows buffered step by step, the keys copied out, finalizing —
//! holds at its peak no more than its admission figure
//! ([`CaptureSpec::admission_bytes`]) says, and finalizing holds one row of every head
//! at a time beside the maps: never `rows × heads × keys`.
//! Measured with a global allocator that tracks the peak of live bytes; one test in
//! this binary so that nothing else allocates meanwhile.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use lantern_attn::AttentionLayerSpec;
use lantern_capture::{
    CaptureDtype, CaptureGeometry, CaptureSpec, HeadReduce, KeySnapshot, PendingCapture,
    QueryRowBuffer, TokenInfo,
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
/// The last tokens are generated, one decode step each.
const GENERATED: usize = 8;
/// Prefill chunk: not a divisor of the prompt, so a doubling buffer would overshoot.
const CHUNK: usize = 300;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
/// A multiple of 16: finalizing scores rows two at a time over transposed keys.
const HEAD_DIM: usize = 16;
const GEOMETRY: CaptureGeometry = CaptureGeometry {
    num_kv_heads: KV_HEADS,
    head_dim: HEAD_DIM,
};

fn spec(reduce: HeadReduce, top_k: Option<usize>, dtype: CaptureDtype) -> CaptureSpec {
    CaptureSpec {
        reduce,
        top_k,
        dtype,
        ..CaptureSpec::everything(LAYERS, HEADS)
    }
}

/// A capture of every row of two layers as the engine builds it, with deterministic
/// queries and keys: the prompt's query rows recorded in prefill chunks and then one
/// per decode step, then the keys copied out for finalizing.
fn pending(spec: CaptureSpec) -> PendingCapture {
    let wave = |i: usize| ((i as f32) * 0.37).sin();
    let prompt_len = TOKENS - GENERATED;
    let mut buffer = QueryRowBuffer::new(spec, LAYERS, HEADS, HEAD_DIM, prompt_len, GENERATED);
    let token_len = HEADS * HEAD_DIM;
    let steps = (0..prompt_len)
        .step_by(CHUNK)
        .map(|s| s..(s + CHUNK).min(prompt_len))
        .chain((prompt_len..TOKENS).map(|p| p..p + 1));
    for step in steps {
        let q: Vec<f32> = (step.start * token_len..step.end * token_len)
            .map(wave)
            .collect();
        for layer in 0..LAYERS {
            buffer.record(layer, step.start, &q, &[]);
        }
    }
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
        computed_maps: Vec::new(),
        layers: (0..LAYERS)
            .map(|_| {
                let attention = AttentionLayerSpec::new(HEADS, KV_HEADS, HEAD_DIM);
                (attention, keys.clone())
            })
            .collect(),
        prompt_len,
        max_len: TOKENS,
        block_size: 16,
        tokens: (0..TOKENS)
            .map(|i| TokenInfo {
                id: i as u32,
                text: String::new(),
            })
            .collect(),
        num_computed: TOKENS,
        finalize_threads: 1,
    }
}

#[test]
fn a_capture_peaks_within_its_admission_figure() {
    let dense_bytes = TOKENS * HEADS * TOKENS * 4;
    // What the figure leaves out: the vectors of layers and maps, the buffer's layer
    // slots, the meta's small strings.
    let slack = 16 << 10;
    for (reduce, top_k, dtype) in [
        (HeadReduce::MeanHeads, Some(1), CaptureDtype::Float32),
        (HeadReduce::None, Some(2), CaptureDtype::Float16),
        (HeadReduce::MaxHeads, None, CaptureDtype::Float32),
        (HeadReduce::None, None, CaptureDtype::Float16),
    ] {
        let spec = spec(reduce, top_k, dtype);
        let case = format!("{reduce:?} top-k {top_k:?} {dtype:?}");
        let prompt_len = TOKENS - GENERATED;
        let delivered = spec.estimate_bytes(prompt_len, GENERATED);
        let figure = spec.admission_bytes(prompt_len, GENERATED, GEOMETRY) as usize;
        let working = spec.working_bytes(prompt_len, GENERATED, GEOMETRY) as usize;

        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        let capture = pending(spec);
        let result = capture.finalize().unwrap();
        let peak = PEAK.load(Ordering::Relaxed) - before;

        let map = &result.layers[0];
        let width = top_k.unwrap_or(TOKENS);
        let heads = if reduce == HeadReduce::None { HEADS } else { 1 };
        assert_eq!(map.shape, [TOKENS, heads, width]);
        let wire_value_bytes = dtype.size_bytes() as usize;
        let map_bytes: usize = result
            .layers
            .iter()
            .map(|m| m.values.len() * wire_value_bytes + m.indices.as_ref().map_or(0, Vec::len) * 4)
            .sum();
        assert_eq!(map_bytes as u64, delivered, "{case}: the delivered size");
        // The figure counts the encoded maps and the encoder's copy beside everything
        // finalizing holds; neither exists yet here.
        assert!(
            peak <= working + slack,
            "{case}: the capture peaked at {peak} bytes, over its working figure {working} (admission {figure}; a dense buffer would be {dense_bytes} more)"
        );
        // Nor loose: it is the queries, keys and f32 maps, and allowances for the rest.
        assert!(
            peak * 5 >= working * 4,
            "{case}: peak {peak}, working {working}"
        );
        // Encoding for reference or file delivery (safetensors) stays within the whole
        // admission figure. The server drops the pending capture (queries, keys) when
        // finalizing returns, before encoding, as here.
        drop(capture);
        PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
        let encoded = lantern_capture::wire::to_safetensors(&result, dtype).unwrap();
        let peak_encoding = PEAK.load(Ordering::Relaxed) - before;
        assert!(
            peak_encoding <= figure + slack,
            "{case}: encoding peaked at {peak_encoding} bytes, over the admission figure {figure}"
        );
        drop(encoded);
        eprintln!(
            "{case}: peak {peak} bytes (encoding {peak_encoding}), working figure {working}, \
             delivered {delivered}, admission {figure}"
        );
        // Each row is a distribution (or its top part).
        let row_sum: f32 = map.values[..heads * width].iter().sum();
        assert!(row_sum > 0.0 && row_sum <= heads as f32 + 1e-4, "{row_sum}");
        drop(result);
    }
}
