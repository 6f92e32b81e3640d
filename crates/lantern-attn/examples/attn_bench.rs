//! Rough timings of the CPU backends on a few batch shapes.
//!
//! `cargo run -p lantern-attn --release --example attn_bench [reference]`

use std::sync::Arc;
use std::time::Instant;

use lantern_attn::{
    backend_by_name, tensor3, AttentionBackend, AttentionLayerSpec, CacheGeometry,
    CommonAttentionMetadata, ScheduledSeq,
};
use lantern_kv::{BlockId, KvDtype};
use rand::{Rng, SeedableRng};

struct Shape {
    name: &'static str,
    /// (num_computed, num_scheduled) per request.
    reqs: Vec<(usize, usize)>,
}

fn bench(backend: &dyn AttentionBackend, shape: &Shape, dtype: KvDtype) {
    let layer = AttentionLayerSpec::new(32, 8, 128);
    let block_size = 16;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let mut next_block = 0u32;
    let tables: Vec<Vec<BlockId>> = shape
        .reqs
        .iter()
        .map(|&(c, s)| {
            let n = (c + s).div_ceil(block_size) as u32;
            next_block += n;
            (next_block - n..next_block).collect()
        })
        .collect();
    let geom = CacheGeometry {
        num_blocks: next_block as usize,
        block_size,
        num_kv_heads: layer.num_kv_heads,
        head_dim: layer.head_dim,
    };
    let mut cache = backend.allocate_cache(geom, dtype).unwrap();
    let seqs: Vec<ScheduledSeq<'_>> = shape
        .reqs
        .iter()
        .zip(&tables)
        .map(|(&(c, s), t)| ScheduledSeq {
            num_computed_tokens: c,
            num_scheduled_tokens: s,
            block_table: t,
            slot_window: None,
        })
        .collect();
    let common = CommonAttentionMetadata::build(&seqs, block_size).unwrap();
    let tokens = common.num_actual_tokens;
    let meta = backend.build_metadata(Arc::new(common));
    let device = backend.device();
    let mut gen = |heads: usize| {
        let values = (0..tokens * heads * 128)
            .map(|_| rng.gen_range(-1.0..1.0))
            .collect();
        tensor3(values, [tokens, heads, 128], &device).unwrap()
    };
    let q = gen(32);
    let k = gen(8);
    let v = gen(8);
    let keys: usize = shape
        .reqs
        .iter()
        .map(|&(c, s)| (0..s).map(|i| c + i + 1).sum::<usize>())
        .sum();
    backend
        .forward(&layer, &meta, &q, &k, &v, cache.as_mut())
        .unwrap();
    let iters = 5;
    let start = Instant::now();
    for _ in 0..iters {
        backend
            .forward(&layer, &meta, &q, &k, &v, cache.as_mut())
            .unwrap();
    }
    let secs = start.elapsed().as_secs_f64() / iters as f64;
    let gflops = keys as f64 * 32.0 * 128.0 * 4.0 / secs / 1e9;
    println!(
        "{:14} {:24} {:?}: {:8.2} ms  {:6.1} GFLOP/s",
        backend.name(),
        shape.name,
        dtype,
        secs * 1e3,
        gflops
    );
}

fn main() {
    let with_reference = std::env::args().any(|a| a == "reference");
    // Optional filter on the shape name, e.g. `prefill`.
    let filter = std::env::args().nth(1).filter(|a| a != "reference");
    let shapes = [
        Shape {
            name: "decode 32 x 1024",
            reqs: vec![(1023, 1); 32],
        },
        Shape {
            name: "decode 1 x 16384",
            reqs: vec![(16383, 1)],
        },
        Shape {
            name: "prefill 1 x 2048",
            reqs: vec![(0, 2048)],
        },
        Shape {
            name: "mixed 16 dec + 512 chunk",
            reqs: [vec![(700, 1); 16], vec![(1024, 512)]].concat(),
        },
    ];
    let mut names = vec!["cpu-flash"];
    if with_reference {
        names.push("cpu-reference");
    }
    for name in names {
        let backend = backend_by_name(name).unwrap();
        for shape in shapes
            .iter()
            .filter(|s| filter.as_ref().is_none_or(|f| s.name.contains(f.as_str())))
        {
            for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16] {
                bench(backend.as_ref(), shape, dtype);
            }
        }
    }
}
