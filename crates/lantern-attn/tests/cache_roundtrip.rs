//! Cache write/read round trips through every layout and element type; padding slots
//! are skipped; out-of-range slots are errors that leave the cache unchanged.

mod common;

use common::*;
use lantern_attn::{
    backend_by_name, round_to_dtype, AttnError, CacheGeometry, KvCacheLayout, KvCacheShape,
    PagedKvCache, BACKEND_NAMES,
};
use lantern_kv::{KvDtype, PAD_SLOT_ID};
use rand::seq::SliceRandom;
use rand::Rng;

const DTYPES: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::BF16];

fn all_layouts() -> Vec<KvCacheLayout> {
    layouts(&[[4, 3, 2, 1, 0], [2, 0, 4, 1, 3], [0, 4, 1, 3, 2]])
}

fn values(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-4.0f32..4.0)).collect()
}

#[test]
fn round_trip_every_layout_and_dtype() {
    // num_blocks == 2 is the case where guessing the layout from the shape goes wrong.
    for (seed, geom) in [
        (1u64, (2, 4, 2, 8)),
        (2, (5, 3, 1, 17)),
        (3, (3, 16, 4, 64)),
        (4, (1, 1, 1, 1)),
    ] {
        let geom = CacheGeometry {
            num_blocks: geom.0,
            block_size: geom.1,
            num_kv_heads: geom.2,
            head_dim: geom.3,
        };
        let n_slots = geom.num_blocks * geom.block_size;
        let row = geom.num_kv_heads * geom.head_dim;
        for layout in all_layouts() {
            for dtype in DTYPES {
                let mut r = rng(seed);
                let mut cache = PagedKvCache::new(geom, layout, dtype).unwrap();
                assert_eq!(cache.size_bytes(), 2 * n_slots * row * dtype.size_bytes());
                // Fill every slot with a sentinel first.
                let all: Vec<i64> = (0..n_slots as i64).collect();
                let sentinel_k = values(&mut r, n_slots * row);
                let sentinel_v = values(&mut r, n_slots * row);
                cache.write(&sentinel_k, &sentinel_v, &all).unwrap();
                // Then write half of the slots in shuffled order, with padding mixed in.
                let mut slots: Vec<i64> = all.clone();
                slots.shuffle(&mut r);
                slots.truncate(n_slots.div_ceil(2));
                slots.insert(slots.len() / 2, PAD_SLOT_ID);
                slots.push(PAD_SLOT_ID);
                let k = values(&mut r, slots.len() * row);
                let v = values(&mut r, slots.len() * row);
                cache.write(&k, &v, &slots).unwrap();

                let mut expected_k = sentinel_k.clone();
                let mut expected_v = sentinel_v.clone();
                for (t, &s) in slots.iter().enumerate() {
                    if s >= 0 {
                        let s = s as usize;
                        expected_k[s * row..(s + 1) * row]
                            .copy_from_slice(&k[t * row..(t + 1) * row]);
                        expected_v[s * row..(s + 1) * row]
                            .copy_from_slice(&v[t * row..(t + 1) * row]);
                    }
                }
                round_to_dtype(&mut expected_k, dtype);
                round_to_dtype(&mut expected_v, dtype);
                let d = geom.head_dim;
                let mut out = vec![0.0; d];
                for s in 0..n_slots {
                    for h in 0..geom.num_kv_heads {
                        cache.read_key(s, h, &mut out).unwrap();
                        assert_eq!(
                            out,
                            expected_k[(s * geom.num_kv_heads + h) * d..][..d],
                            "{layout:?} {dtype:?}"
                        );
                        cache.read_value(s, h, &mut out).unwrap();
                        assert_eq!(
                            out,
                            expected_v[(s * geom.num_kv_heads + h) * d..][..d],
                            "{layout:?} {dtype:?}"
                        );
                    }
                }
                // Whole-tile loads agree with per-token reads (and with the zero-copy view).
                let mut tile = vec![0.0; geom.block_size * d];
                for b in 0..geom.num_blocks {
                    for h in 0..geom.num_kv_heads {
                        cache
                            .load_tile(0, b, h, 0..geom.block_size, &mut tile)
                            .unwrap();
                        for p in 0..geom.block_size {
                            let s = b * geom.block_size + p;
                            assert_eq!(
                                tile[p * d..(p + 1) * d],
                                expected_k[(s * geom.num_kv_heads + h) * d..][..d]
                            );
                        }
                        if let Some(view) = cache.tile_f32(0, b, h, 0..geom.block_size) {
                            assert_eq!(view, &tile[..]);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn hnd_f32_tiles_are_zero_copy() {
    let geom = CacheGeometry {
        num_blocks: 3,
        block_size: 4,
        num_kv_heads: 2,
        head_dim: 8,
    };
    let cache = PagedKvCache::new(
        geom,
        KvCacheLayout::hnd(KvCacheShape::BlocksFirst),
        KvDtype::F32,
    )
    .unwrap();
    assert!(cache.tile_f32(1, 2, 1, 1..4).is_some());
    let nhd = PagedKvCache::new(
        geom,
        KvCacheLayout::contiguous(KvCacheShape::BlocksFirst),
        KvDtype::F32,
    )
    .unwrap();
    assert!(nhd.tile_f32(1, 2, 1, 1..4).is_none());
}

#[test]
fn out_of_range_slot_is_an_error_and_writes_nothing() {
    let geom = CacheGeometry {
        num_blocks: 2,
        block_size: 4,
        num_kv_heads: 1,
        head_dim: 2,
    };
    for layout in all_layouts() {
        for dtype in DTYPES {
            let mut cache = PagedKvCache::new(geom, layout, dtype).unwrap();
            let before = cache.clone();
            let k = [1.0, 2.0, 3.0, 4.0];
            let err = cache.write(&k, &k, &[0, 8]).unwrap_err();
            assert_eq!(
                err,
                AttnError::SlotOutOfRange {
                    slot: 8,
                    num_slots: 8
                }
            );
            assert_eq!(
                cache, before,
                "a failed write must not write its valid slots"
            );
            assert!(cache.write(&k, &k, &[0]).is_err(), "length mismatch");
            let mut out = [0.0; 2];
            assert!(cache.read_key(8, 0, &mut out).is_err());
            assert!(cache.read_value(0, 1, &mut out).is_err());
        }
    }
}

#[test]
fn bad_layout_and_geometry_are_errors() {
    let geom = CacheGeometry {
        num_blocks: 2,
        block_size: 4,
        num_kv_heads: 1,
        head_dim: 2,
    };
    let bad = KvCacheLayout {
        shape: KvCacheShape::KvFirst,
        stride_order: [0, 1, 1, 3, 4],
    };
    assert!(PagedKvCache::new(geom, bad, KvDtype::F32).is_err());
    let zero = CacheGeometry {
        head_dim: 0,
        ..geom
    };
    assert!(PagedKvCache::new(
        zero,
        KvCacheLayout::contiguous(KvCacheShape::KvFirst),
        KvDtype::F32
    )
    .is_err());
    let huge = CacheGeometry {
        num_blocks: usize::MAX / 2,
        ..geom
    };
    assert!(PagedKvCache::new(
        huge,
        KvCacheLayout::contiguous(KvCacheShape::KvFirst),
        KvDtype::F32
    )
    .is_err());
}

#[test]
fn backends_by_name() {
    for name in BACKEND_NAMES {
        assert_eq!(backend_by_name(name).unwrap().name(), *name);
    }
    assert!(matches!(
        backend_by_name("cuda-magic"),
        Err(AttnError::UnknownBackend { .. })
    ));
}

/// Key reads through a backend (what capture uses) return, for every slot asked, what
/// the cache's own per-token reads return, in `[slots, kv_heads, head_dim]` order, at
/// every element type; a slot outside the cache or a short buffer is an error.
#[test]
fn backend_slot_reads_match_the_cache() {
    let mut rng = rng(11);
    let geom = CacheGeometry {
        num_blocks: 5,
        block_size: 4,
        num_kv_heads: 3,
        head_dim: 8,
    };
    let row = geom.num_kv_heads * geom.head_dim;
    for name in BACKEND_NAMES {
        let backend = backend_by_name(name).unwrap();
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16] {
            let mut cache = backend.allocate_cache(geom, dtype).unwrap();
            assert_eq!(cache.layout(), &backend.kv_cache_layout());
            let written: Vec<i64> = (0..20).collect();
            let k: Vec<f32> = (0..20 * row).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let v: Vec<f32> = (0..20 * row).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let host: &mut PagedKvCache = cache.as_any_mut().downcast_mut().unwrap();
            host.write(&k, &v, &written).unwrap();
            let host = host.clone();

            let slots = [17usize, 0, 5, 5, 19];
            let mut keys = vec![f32::NAN; slots.len() * row];
            let mut values = vec![f32::NAN; slots.len() * row];
            backend
                .read_slots(cache.as_ref(), &slots, &mut keys, Some(&mut values))
                .unwrap();
            let mut one = vec![0.0; geom.head_dim];
            for (i, &slot) in slots.iter().enumerate() {
                for h in 0..geom.num_kv_heads {
                    let at = i * row + h * geom.head_dim..i * row + (h + 1) * geom.head_dim;
                    host.read_key(slot, h, &mut one).unwrap();
                    assert_eq!(keys[at.clone()], one[..], "{name} {dtype:?} slot {slot}");
                    host.read_value(slot, h, &mut one).unwrap();
                    assert_eq!(values[at], one[..], "{name} {dtype:?} slot {slot}");
                }
            }
            let mut keys_only = vec![f32::NAN; slots.len() * row];
            backend
                .read_slots(cache.as_ref(), &slots, &mut keys_only, None)
                .unwrap();
            assert_eq!(keys_only, keys);

            assert!(matches!(
                backend.read_slots(cache.as_ref(), &[20], &mut keys[..row], None),
                Err(AttnError::SlotOutOfRange { .. })
            ));
            assert!(matches!(
                backend.read_slots(cache.as_ref(), &slots, &mut keys[..row], None),
                Err(AttnError::LengthMismatch { .. })
            ));
        }
    }
}
