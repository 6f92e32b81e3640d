//! Random sequences of manager operations on a small pool, checking the bookkeeping
//! invariants after every step and the *content* of every prefix hit.
//!
//! The test keeps a shadow of what each (group, block) would hold if every computed
//! token's K/V were really written through the slot mapping: the salt and the token
//! prefix up to that slot. A prefix hit must hand out blocks whose shadow equals the new
//! prompt's prefix (so eviction and keying are right), and a write may only go to a block
//! that its writer holds alone (so sharing never lets one request overwrite another's).

use std::collections::{HashMap, HashSet};

use lantern_kv::{
    compute_slot_mapping, AttentionKind, BlockId, KvCacheConfig, KvCacheManager, KvCacheSpec,
    KvDtype, KvError, RequestId, NULL_BLOCK,
};
use proptest::prelude::*;
use proptest::sample::Index;

const BS: usize = 2;
const NUM_BLOCKS: usize = 14;

#[derive(Debug, Clone)]
enum Op {
    Add { prompt: Vec<u32>, salt: u8 },
    Repeat { which: Index, extra: Vec<u32> },
    Grow { who: Index, extra: Vec<u32> },
    Free { who: Index },
    Fork { who: Index },
    FreeUnknown,
}

fn tokens(max: usize) -> impl Strategy<Value = Vec<u32>> {
    // A tiny vocabulary makes shared prefixes (and so hits) common.
    prop::collection::vec(0u32..3, 1..=max)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (tokens(9), 0u8..2).prop_map(|(prompt, salt)| Op::Add { prompt, salt }),
        3 => (any::<Index>(), prop::collection::vec(0u32..3, 0..4))
            .prop_map(|(which, extra)| Op::Repeat { which, extra }),
        3 => (any::<Index>(), tokens(4)).prop_map(|(who, extra)| Op::Grow { who, extra }),
        2 => any::<Index>().prop_map(|who| Op::Free { who }),
        2 => any::<Index>().prop_map(|who| Op::Fork { who }),
        1 => Just(Op::FreeUnknown),
    ]
}

struct Live {
    id: RequestId,
    tokens: Vec<u32>,
    salt: u8,
}

struct World {
    m: KvCacheManager,
    live: Vec<Live>,
    history: Vec<(Vec<u32>, u8)>,
    shadow: HashMap<(usize, BlockId), (u8, Vec<u32>)>,
    next_id: RequestId,
}

impl World {
    fn new() -> Self {
        let full = KvCacheSpec::full_attention(BS, 1, 4, KvDtype::F16);
        let swa = KvCacheSpec::sliding_window(3, BS, 1, 4, KvDtype::F16);
        let cfg = KvCacheConfig::with_num_blocks(&[full, swa, full], NUM_BLOCKS).unwrap();
        Self {
            m: KvCacheManager::new(&cfg, true),
            live: Vec::new(),
            history: Vec::new(),
            shadow: HashMap::new(),
            next_id: 0,
        }
    }

    /// "Runs" positions `from..to` of a sequence: writes the shadow through the slot
    /// mapping of every group.
    fn compute(&mut self, id: RequestId, toks: &[u32], salt: u8, from: usize, to: usize) {
        for g in 0..self.m.num_groups() {
            let table = self.m.block_table(id, g);
            let slots = compute_slot_mapping(table, BS, from, to, None).unwrap();
            for (pos, slot) in (from..to).zip(slots) {
                let block = (slot as usize / BS) as BlockId;
                let offset = slot as usize % BS;
                assert_eq!(offset, pos % BS);
                assert_eq!(
                    self.m.pool().ref_count(block),
                    Some(1),
                    "write to shared block {block}"
                );
                let cell = self.shadow.entry((g, block)).or_default();
                if offset == 0 {
                    *cell = (salt, toks[..=pos].to_vec());
                } else {
                    assert_eq!(
                        *cell,
                        (salt, toks[..pos].to_vec()),
                        "block {block} pos {pos}"
                    );
                    cell.1.push(toks[pos]);
                }
            }
        }
    }

    fn check_hit(&self, id: RequestId, toks: &[u32], salt: u8, hit: usize) {
        assert_eq!(hit % BS, 0);
        assert!(hit < toks.len(), "the last token must be computed");
        for g in 0..self.m.num_groups() {
            let table = self.m.block_table(id, g);
            assert_eq!(table.len(), hit / BS);
            let out_of_reach = self
                .m
                .group_retention(g)
                .unwrap()
                .blocks_out_of_reach(hit, BS);
            for (i, &b) in table.iter().enumerate() {
                if b == NULL_BLOCK {
                    // Only a block the first computed query cannot see may be left out.
                    assert!(i < out_of_reach, "group {g} lacks reachable block {i}");
                    continue;
                }
                let want = (salt, toks[..(i + 1) * BS].to_vec());
                assert_eq!(self.shadow.get(&(g, b)), Some(&want), "hit block {b}");
            }
        }
    }

    fn start(&mut self, toks: Vec<u32>, salt: u8) {
        let id = self.next_id;
        self.next_id += 1;
        let hit = self.m.get_computed_blocks(id, &toks, &[salt]);
        self.check_hit(id, &toks, salt, hit);
        match self.m.allocate_slots(id, toks.len()) {
            Ok(()) => {
                self.compute(id, &toks, salt, hit, toks.len());
                self.m.cache_blocks(id, &toks, &[salt]).unwrap();
                self.m.release_out_of_reach(id, toks.len());
                self.history.push((toks.clone(), salt));
                self.live.push(Live {
                    id,
                    tokens: toks,
                    salt,
                });
            }
            Err(KvError::OutOfBlocks { .. }) => {
                self.m.free(id);
                assert!(!self.m.contains(id));
            }
            Err(e) => panic!("unexpected error {e}"),
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Add { prompt, salt } => self.start(prompt, salt),
            Op::Repeat { which, mut extra } => {
                if self.history.is_empty() {
                    return;
                }
                let (mut toks, salt) = self.history[which.index(self.history.len())].clone();
                toks.append(&mut extra);
                self.start(toks, salt);
            }
            Op::Grow { who, extra } => {
                if self.live.is_empty() {
                    return;
                }
                let i = who.index(self.live.len());
                let (id, salt, from) = (
                    self.live[i].id,
                    self.live[i].salt,
                    self.live[i].tokens.len(),
                );
                let mut toks = self.live[i].tokens.clone();
                toks.extend(extra);
                let before: Vec<usize> = self.m.block_tables(id).iter().map(|t| t.len()).collect();
                match self.m.allocate_slots(id, toks.len()) {
                    Ok(()) => {
                        self.compute(id, &toks, salt, from, toks.len());
                        self.m.cache_blocks(id, &toks, &[salt]).unwrap();
                        self.m.release_out_of_reach(id, toks.len());
                        self.live[i].tokens = toks;
                    }
                    Err(KvError::OutOfBlocks { .. }) => {
                        let after: Vec<usize> =
                            self.m.block_tables(id).iter().map(|t| t.len()).collect();
                        assert_eq!(before, after, "failed allocation changed the tables");
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            Op::Free { who } => {
                if self.live.is_empty() {
                    return;
                }
                let l = self.live.swap_remove(who.index(self.live.len()));
                self.m.free(l.id);
                assert!(!self.m.contains(l.id));
            }
            Op::Fork { who } => {
                if self.live.is_empty() {
                    return;
                }
                let p = &self.live[who.index(self.live.len())];
                let (pid, toks, salt) = (p.id, p.tokens.clone(), p.salt);
                let child = self.next_id;
                self.next_id += 1;
                let out = self.m.fork(pid, child, toks.len()).unwrap();
                assert_eq!(out.shared_tokens, toks.len() / BS * BS);
                assert_eq!(out.shared_tokens + out.recompute_tokens, toks.len());
                match self.m.allocate_slots(child, toks.len()) {
                    Ok(()) => {
                        self.compute(child, &toks, salt, out.shared_tokens, toks.len());
                        self.m.cache_blocks(child, &toks, &[salt]).unwrap();
                        self.live.push(Live {
                            id: child,
                            tokens: toks,
                            salt,
                        });
                    }
                    Err(KvError::OutOfBlocks { .. }) => self.m.free(child),
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            Op::FreeUnknown => {
                let before = self.m.num_free_blocks();
                self.m.free(RequestId::MAX);
                assert_eq!(self.m.num_free_blocks(), before);
            }
        }
    }

    fn check(&self) {
        self.m.check_invariants().unwrap();
        assert_eq!(self.m.num_requests(), self.live.len());
        let mut distinct = HashSet::new();
        for l in &self.live {
            for (g, t) in self.m.block_tables(l.id).iter().enumerate() {
                let spec = self.m.group_spec(g).unwrap();
                assert_eq!(t.len(), spec.blocks_for_tokens(l.tokens.len()));
                distinct.extend(t.iter().copied().filter(|&b| b != NULL_BLOCK));
                if let AttentionKind::SlidingWindow { window } = spec.kind {
                    // Released blocks keep the window's memory bounded.
                    let held = self.m.num_held_blocks(l.id, g);
                    assert!(held <= window.div_ceil(BS) + 1, "{held} blocks: {t:?}");
                }
            }
        }
        assert_eq!(distinct.len() + self.m.num_free_blocks(), NUM_BLOCKS);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_ops_keep_the_books(ops in prop::collection::vec(op(), 1..60)) {
        let mut w = World::new();
        for op in ops {
            w.apply(op);
            w.check();
        }
        for l in std::mem::take(&mut w.live) {
            w.m.free(l.id);
        }
        w.m.check_invariants().unwrap();
        prop_assert_eq!(w.m.num_free_blocks(), NUM_BLOCKS);
        prop_assert_eq!(w.m.num_requests(), 0);
        prop_assert_eq!(w.m.usage(), 0.0);
    }
}

/// The prefix cache really serves repeated prompts in this setup (so the property test
/// exercises hits, not just misses).
#[test]
fn repeated_prompt_hits() {
    let mut w = World::new();
    w.start(vec![0, 1, 2, 0, 1], 0);
    w.start(vec![0, 1, 2, 0, 1], 0);
    assert_eq!(w.m.prefix_cache_stats().hits, 4);
    w.check();
}
