//! The pool of KV cache blocks: who holds each block, which are free, and which free
//! blocks still hold reusable (prefix-cached) content.
//!
//! A block is either *held* (reference count > 0: some request's block table names it)
//! or *free* (count 0, linked into the free queue). A free block may still carry the
//! content key it was cached under; until it is handed out again, a prefix-cache hit can
//! take it straight out of the middle of the queue ([`BlockPool::touch`]). That is why
//! the free queue is a doubly-linked list threaded through the block array: push to the
//! tail, pop from the head and unlink from the middle are all O(1).
//!
//! Blocks are handed out from the head. A freed block that carries a key joins the
//! tail, so cached content is evicted least recently freed first (LRU); a freed block
//! with no key joins the head, so it is reused before any block that was never used
//! (which sit in between, in id order, from the start). A run therefore touches only as
//! many blocks as it holds at once plus what it caches, and the rest of the pool's
//! memory is never paged in. Handing out a block that carries a key evicts that key
//! from the cache map.
//!
//! Keys are per KV cache group ([`CacheKey`]): layers in different groups store
//! different tensors for the same tokens, so the same token hash maps to one block per
//! group.

use std::collections::HashMap;

use crate::error::KvError;
use crate::hash::BlockHash;
use crate::BlockId;

/// Most blocks a pool can have: `u32::MAX` itself marks "no block" in the queue links.
pub const MAX_BLOCKS: usize = u32::MAX as usize;

/// Link value meaning "no neighbour".
const NIL: u32 = u32::MAX;

/// What a cached block holds: the content hash of its tokens in one KV cache group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheKey {
    /// KV cache group index.
    pub group: usize,
    pub hash: BlockHash,
}

/// A change to the set of cached block keys, for publishing to a prefix-aware router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCacheEvent {
    /// `key` became reusable, stored in `block`.
    Stored { key: CacheKey, block: BlockId },
    /// `key` is no longer in the cache (its block was reused).
    Evicted { key: CacheKey },
    /// Every key was dropped ([`BlockPool::reset_prefix_cache`]).
    AllCleared,
}

/// Prefix-cache counters, in tokens (what a hit rate is usually quoted in), plus the
/// number of evicted keys.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens looked up.
    pub queries: u64,
    /// Prompt tokens served from the cache.
    pub hits: u64,
    /// Keys evicted because their block was handed out again.
    pub evictions: u64,
}

#[derive(Debug, Clone)]
struct BlockMeta {
    ref_cnt: usize,
    key: Option<CacheKey>,
    prev: u32,
    next: u32,
    /// Linked into the free queue. Kept explicitly (rather than inferred from the
    /// links) so membership tests are O(1) and checkable.
    queued: bool,
}

/// Reference-counted blocks, an LRU free queue and the content-key map.
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<BlockMeta>,
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashMap<CacheKey, BlockId>,
    record_events: bool,
    events: Vec<KvCacheEvent>,
    stats: PrefixCacheStats,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks, handed out in id order at first.
    /// Counts above [`MAX_BLOCKS`] are clamped to it.
    pub fn new(num_blocks: usize) -> Self {
        let n = num_blocks.min(MAX_BLOCKS);
        let blocks = (0..n)
            .map(|i| BlockMeta {
                ref_cnt: 0,
                key: None,
                prev: if i == 0 { NIL } else { (i - 1) as u32 },
                next: if i + 1 == n { NIL } else { (i + 1) as u32 },
                queued: true,
            })
            .collect();
        Self {
            blocks,
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { (n - 1) as u32 },
            num_free: n,
            cached: HashMap::new(),
            record_events: false,
            events: Vec::new(),
            stats: PrefixCacheStats::default(),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.num_free
    }

    /// Fraction of blocks held, in `[0, 1]` (0 for an empty pool).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            0.0
        } else {
            (self.blocks.len() - self.num_free) as f64 / self.blocks.len() as f64
        }
    }

    /// Reference count of `id`, `None` when out of range.
    pub fn ref_count(&self, id: BlockId) -> Option<usize> {
        self.blocks.get(id as usize).map(|b| b.ref_cnt)
    }

    /// The content hash `id` is cached under, if any.
    pub fn block_hash(&self, id: BlockId) -> Option<BlockHash> {
        self.blocks
            .get(id as usize)
            .and_then(|b| b.key)
            .map(|k| k.hash)
    }

    /// Takes `n` free blocks (reference count 1 each), least recently freed first; all or
    /// nothing. A handed-out block's cached key is evicted.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, KvError> {
        if n > self.num_free {
            return Err(KvError::OutOfBlocks {
                needed: n,
                free: self.num_free,
            });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            self.evict_key(id);
            self.blocks[id as usize].ref_cnt = 1;
            out.push(id);
        }
        Ok(out)
    }

    /// Adds a holder to blocks that are already held (e.g. a forked sequence sharing
    /// its parent's blocks). All or nothing; a free block is an error (use
    /// [`Self::touch`] to take a cached free block).
    pub fn incr_ref(&mut self, ids: &[BlockId]) -> Result<(), KvError> {
        for &id in ids {
            if self.meta(id)?.ref_cnt == 0 {
                return Err(KvError::BlockNotAllocated { block: id });
            }
        }
        for &id in ids {
            self.blocks[id as usize].ref_cnt += 1;
        }
        Ok(())
    }

    /// Takes prefix-cache hits: each block gains a holder, and a free one leaves the
    /// free queue (keeping its content). All or nothing on out-of-range ids.
    pub fn touch(&mut self, ids: &[BlockId]) -> Result<(), KvError> {
        for &id in ids {
            self.meta(id)?;
        }
        for &id in ids {
            if self.blocks[id as usize].ref_cnt == 0 {
                self.unlink(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
        }
        Ok(())
    }

    /// Drops one holder from each block, in order; a block reaching 0 goes to the tail
    /// of the free queue if it holds cached content (so of the blocks freed here, the
    /// first is reused first — free a sequence's blocks last-to-first to keep its prefix
    /// cached longest), else to the head (reused before never-used blocks).
    ///
    /// All or nothing: a block that is already free (counting repeats in `ids`) or out
    /// of range is an error and nothing changes.
    pub fn free(&mut self, ids: &[BlockId]) -> Result<(), KvError> {
        for &id in ids {
            self.meta(id)?;
        }
        for (i, &id) in ids.iter().enumerate() {
            let b = &mut self.blocks[id as usize];
            if b.ref_cnt == 0 {
                // Roll back so a rejected call leaves no trace.
                for &done in &ids[..i] {
                    self.blocks[done as usize].ref_cnt += 1;
                }
                return Err(KvError::DoubleFree { block: id });
            }
            b.ref_cnt -= 1;
        }
        for &id in ids {
            let b = &self.blocks[id as usize];
            if b.ref_cnt == 0 && !b.queued {
                if b.key.is_some() {
                    self.push_tail(id);
                } else {
                    self.push_head(id);
                }
            }
        }
        Ok(())
    }

    /// Registers a held, full block under `hash` in group 0 (see
    /// [`Self::cache_full_block_in_group`]).
    pub fn cache_full_block(&mut self, id: BlockId, hash: BlockHash) -> Result<bool, KvError> {
        self.cache_full_block_in_group(id, 0, hash)
    }

    /// Registers a held, full block as holding `hash` in `group`, so later requests can
    /// reuse it. Returns whether the block now carries the key: `false` when another
    /// block already holds the same content (the map keeps one block per key; this one
    /// simply stays unkeyed). Re-registering the same key is a no-op; a block already
    /// keyed differently is [`KvError::HashConflict`].
    pub fn cache_full_block_in_group(
        &mut self,
        id: BlockId,
        group: usize,
        hash: BlockHash,
    ) -> Result<bool, KvError> {
        let key = CacheKey { group, hash };
        let meta = self.meta(id)?;
        if meta.ref_cnt == 0 {
            return Err(KvError::BlockNotAllocated { block: id });
        }
        match meta.key {
            Some(k) if k == key => return Ok(true),
            Some(k) => {
                return Err(KvError::HashConflict {
                    block: id,
                    existing: k.hash,
                    new: hash,
                })
            }
            None => {}
        }
        if self.cached.contains_key(&key) {
            return Ok(false);
        }
        self.cached.insert(key, id);
        self.blocks[id as usize].key = Some(key);
        if self.record_events {
            self.events.push(KvCacheEvent::Stored { key, block: id });
        }
        Ok(true)
    }

    /// The block cached under `hash` in group 0.
    pub fn lookup(&self, hash: &BlockHash) -> Option<BlockId> {
        self.lookup_in_group(0, hash)
    }

    /// The block cached under `hash` in `group`, held or free.
    pub fn lookup_in_group(&self, group: usize, hash: &BlockHash) -> Option<BlockId> {
        self.cached.get(&CacheKey { group, hash: *hash }).copied()
    }

    /// Number of keys currently cached.
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Drops every cached key, if no block is held (a held block may be written to by
    /// a running request that expects its key to stay). Returns whether it did.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free != self.blocks.len() {
            return false;
        }
        self.cached.clear();
        for b in &mut self.blocks {
            b.key = None;
        }
        if self.record_events {
            self.events.push(KvCacheEvent::AllCleared);
        }
        true
    }

    /// Adds one prefix lookup to the counters (in tokens).
    pub fn record_prefix_query(&mut self, queried_tokens: usize, hit_tokens: usize) {
        self.stats.queries += queried_tokens as u64;
        self.stats.hits += hit_tokens as u64;
    }

    /// Prompt tokens looked up in the prefix cache so far.
    pub fn prefix_queries(&self) -> u64 {
        self.stats.queries
    }

    /// Prompt tokens served from the prefix cache so far.
    pub fn prefix_hits(&self) -> u64 {
        self.stats.hits
    }

    /// Cached keys evicted so far.
    pub fn num_evictions(&self) -> u64 {
        self.stats.evictions
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Turns the event log on or off. Off by default so that a pool nobody drains does
    /// not grow without bound; turn it on when events are published, and drain every
    /// step.
    pub fn set_record_events(&mut self, on: bool) {
        self.record_events = on;
        if !on {
            self.events.clear();
        }
    }

    /// Takes the stored/evicted events logged since the last drain, in order.
    pub fn drain_events(&mut self) -> Vec<KvCacheEvent> {
        std::mem::take(&mut self.events)
    }

    /// Checks the pool's own invariants (O(num_blocks); for tests and debugging):
    /// exactly the blocks with count 0 are queued, each once, links agree both ways,
    /// and the key map and the block keys mirror each other.
    pub fn check_invariants(&self) -> Result<(), KvError> {
        let fail = |m: String| Err(KvError::InvariantViolated(m));
        let mut seen = vec![false; self.blocks.len()];
        let mut count = 0usize;
        let mut prev = NIL;
        let mut cur = self.head;
        while cur != NIL {
            let Some(b) = self.blocks.get(cur as usize) else {
                return fail(format!("queue link to out-of-range block {cur}"));
            };
            if seen[cur as usize] {
                return fail(format!("block {cur} appears twice in the free queue"));
            }
            seen[cur as usize] = true;
            if !b.queued || b.ref_cnt != 0 {
                return fail(format!(
                    "queued block {cur} has queued={} ref={}",
                    b.queued, b.ref_cnt
                ));
            }
            if b.prev != prev {
                return fail(format!("block {cur} prev link {} != {prev}", b.prev));
            }
            count += 1;
            prev = cur;
            cur = b.next;
        }
        if prev != self.tail {
            return fail(format!("tail {} but queue ends at {prev}", self.tail));
        }
        if count != self.num_free {
            return fail(format!(
                "queue length {count} != num_free {}",
                self.num_free
            ));
        }
        for (i, b) in self.blocks.iter().enumerate() {
            if (b.ref_cnt == 0) != seen[i] || b.queued != seen[i] {
                return fail(format!(
                    "block {i}: ref={} queued={} in queue={}",
                    b.ref_cnt, b.queued, seen[i]
                ));
            }
            if let Some(k) = b.key {
                if self.cached.get(&k) != Some(&(i as BlockId)) {
                    return fail(format!("block {i} keyed {k:?} but the map disagrees"));
                }
            }
        }
        for (k, &id) in &self.cached {
            if self.blocks.get(id as usize).and_then(|b| b.key) != Some(*k) {
                return fail(format!("map key {k:?} -> block {id} not mirrored"));
            }
        }
        Ok(())
    }

    fn meta(&self, id: BlockId) -> Result<&BlockMeta, KvError> {
        self.blocks
            .get(id as usize)
            .ok_or(KvError::BlockOutOfRange {
                block: id,
                num_blocks: self.blocks.len(),
            })
    }

    fn evict_key(&mut self, id: BlockId) {
        if let Some(key) = self.blocks[id as usize].key.take() {
            self.cached.remove(&key);
            self.stats.evictions += 1;
            if self.record_events {
                self.events.push(KvCacheEvent::Evicted { key });
            }
        }
    }

    /// Removes a queued block from the free queue. Callers guarantee `queued`.
    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &mut self.blocks[id as usize];
            b.queued = false;
            let links = (b.prev, b.next);
            b.prev = NIL;
            b.next = NIL;
            links
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        self.num_free -= 1;
    }

    /// Puts an unqueued block at the head of the free queue.
    fn push_head(&mut self, id: BlockId) {
        let old_head = self.head;
        {
            let b = &mut self.blocks[id as usize];
            b.queued = true;
            b.prev = NIL;
            b.next = old_head;
        }
        if old_head == NIL {
            self.tail = id;
        } else {
            self.blocks[old_head as usize].prev = id;
        }
        self.head = id;
        self.num_free += 1;
    }

    /// Appends an unqueued block to the tail of the free queue.
    fn push_tail(&mut self, id: BlockId) {
        let old_tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.queued = true;
            b.prev = old_tail;
            b.next = NIL;
        }
        if old_tail == NIL {
            self.head = id;
        } else {
            self.blocks[old_tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::hash_block;

    fn h(x: u32) -> BlockHash {
        hash_block(None, &[x], b"")
    }

    #[test]
    fn fresh_pool_hands_out_in_order() {
        let mut p = BlockPool::new(4);
        assert_eq!(p.num_blocks(), 4);
        assert_eq!(p.num_free_blocks(), 4);
        assert_eq!(p.usage(), 0.0);
        assert_eq!(p.allocate(3).unwrap(), vec![0, 1, 2]);
        assert_eq!(p.num_free_blocks(), 1);
        assert_eq!(p.usage(), 0.75);
        assert_eq!(p.ref_count(0), Some(1));
        assert_eq!(p.ref_count(3), Some(0));
        assert_eq!(p.ref_count(4), None);
        p.check_invariants().unwrap();
    }

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut p = BlockPool::new(2);
        assert_eq!(
            p.allocate(3),
            Err(KvError::OutOfBlocks { needed: 3, free: 2 })
        );
        assert_eq!(p.num_free_blocks(), 2);
        assert_eq!(p.allocate(0).unwrap(), Vec::<BlockId>::new());
        p.check_invariants().unwrap();
    }

    #[test]
    fn least_recently_freed_cached_block_is_reused_first() {
        let mut p = BlockPool::new(4);
        let ids = p.allocate(4).unwrap();
        for &id in &ids {
            p.cache_full_block(id, h(id)).unwrap();
        }
        p.free(&[2]).unwrap();
        p.free(&[0]).unwrap();
        p.free(&[3, 1]).unwrap();
        assert_eq!(p.allocate(4).unwrap(), vec![2, 0, 3, 1]);
        assert_eq!(ids.len(), 4);
        p.check_invariants().unwrap();
    }

    #[test]
    fn uncached_freed_blocks_come_before_never_used_ones_and_cached_ones_after() {
        let mut p = BlockPool::new(6);
        let ids = p.allocate(3).unwrap();
        p.cache_full_block(ids[0], h(7)).unwrap();
        p.free(&ids).unwrap();
        // Blocks 1 and 2 (no content) first, most recently freed first; then the blocks
        // never used (3, 4, 5); the cached block 0 last.
        assert_eq!(p.allocate(6).unwrap(), vec![2, 1, 3, 4, 5, 0]);
        p.check_invariants().unwrap();
        // A short run reuses the same few blocks: the rest is never touched.
        let mut q = BlockPool::new(100);
        for _ in 0..50 {
            let ids = q.allocate(2).unwrap();
            q.free(&ids).unwrap();
        }
        assert!(q.allocate(2).unwrap().iter().all(|&id| id < 2));
    }

    #[test]
    fn double_free_is_an_error_and_changes_nothing() {
        let mut p = BlockPool::new(3);
        let ids = p.allocate(2).unwrap();
        p.free(&[ids[0]]).unwrap();
        assert_eq!(
            p.free(&[ids[1], ids[0]]),
            Err(KvError::DoubleFree { block: 0 })
        );
        assert_eq!(p.ref_count(ids[1]), Some(1));
        assert_eq!(p.num_free_blocks(), 2);
        // Repeats count: one holder cannot be dropped twice.
        assert_eq!(p.free(&[1, 1]), Err(KvError::DoubleFree { block: 1 }));
        assert_eq!(p.ref_count(1), Some(1));
        assert!(matches!(p.free(&[9]), Err(KvError::BlockOutOfRange { .. })));
        p.check_invariants().unwrap();
    }

    #[test]
    fn repeated_ids_in_one_free_queue_the_block_once() {
        let mut p = BlockPool::new(2);
        let ids = p.allocate(1).unwrap();
        p.incr_ref(&ids).unwrap();
        p.free(&[ids[0], ids[0]]).unwrap();
        assert_eq!(p.num_free_blocks(), 2);
        p.check_invariants().unwrap();
    }

    #[test]
    fn shared_blocks_free_at_last_holder() {
        let mut p = BlockPool::new(2);
        let ids = p.allocate(1).unwrap();
        p.incr_ref(&ids).unwrap();
        assert_eq!(p.ref_count(ids[0]), Some(2));
        p.free(&ids).unwrap();
        assert_eq!(p.num_free_blocks(), 1);
        p.free(&ids).unwrap();
        assert_eq!(p.num_free_blocks(), 2);
        assert_eq!(
            p.incr_ref(&ids),
            Err(KvError::BlockNotAllocated { block: 0 })
        );
        p.check_invariants().unwrap();
    }

    #[test]
    fn cached_free_block_is_hit_from_the_middle_of_the_queue() {
        let mut p = BlockPool::new(4);
        let ids = p.allocate(4).unwrap();
        assert_eq!(p.cache_full_block(ids[1], h(1)), Ok(true));
        p.free(&[3, 2, 1, 0]).unwrap();
        assert_eq!(p.lookup(&h(1)), Some(1));
        p.touch(&[1]).unwrap();
        assert_eq!(p.ref_count(1), Some(1));
        assert_eq!(p.num_free_blocks(), 3);
        p.check_invariants().unwrap();
        // The rest of the queue is untouched: the blocks without content (each freed to
        // the head, so 0, 2, 3).
        assert_eq!(p.allocate(3).unwrap(), vec![0, 2, 3]);
        assert_eq!(p.lookup(&h(1)), Some(1));
        assert_eq!(p.num_evictions(), 0);
    }

    #[test]
    fn reuse_evicts_the_key_and_logs_it() {
        let mut p = BlockPool::new(2);
        p.set_record_events(true);
        let ids = p.allocate(2).unwrap();
        p.cache_full_block(ids[0], h(7)).unwrap();
        p.free(&ids).unwrap();
        // Block 1 (no content) first, then the cached block 0, evicting its key.
        let again = p.allocate(2).unwrap();
        assert_eq!(again, vec![1, 0]);
        assert_eq!(p.lookup(&h(7)), None);
        assert_eq!(p.block_hash(0), None);
        assert_eq!(p.num_evictions(), 1);
        let key = CacheKey {
            group: 0,
            hash: h(7),
        };
        assert_eq!(
            p.drain_events(),
            vec![
                KvCacheEvent::Stored { key, block: 0 },
                KvCacheEvent::Evicted { key }
            ]
        );
        assert!(p.drain_events().is_empty());
        p.check_invariants().unwrap();
    }

    #[test]
    fn events_are_off_by_default() {
        let mut p = BlockPool::new(1);
        let ids = p.allocate(1).unwrap();
        p.cache_full_block(ids[0], h(1)).unwrap();
        assert!(p.drain_events().is_empty());
    }

    #[test]
    fn cache_rules() {
        let mut p = BlockPool::new(3);
        let ids = p.allocate(2).unwrap();
        assert_eq!(
            p.cache_full_block(2, h(1)),
            Err(KvError::BlockNotAllocated { block: 2 })
        );
        assert_eq!(p.cache_full_block(ids[0], h(1)), Ok(true));
        assert_eq!(p.cache_full_block(ids[0], h(1)), Ok(true));
        assert!(matches!(
            p.cache_full_block(ids[0], h(2)),
            Err(KvError::HashConflict { block: 0, .. })
        ));
        // Same content in a second block: the first keeps the key.
        assert_eq!(p.cache_full_block(ids[1], h(1)), Ok(false));
        assert_eq!(p.lookup(&h(1)), Some(0));
        // Groups are separate key spaces.
        assert_eq!(p.cache_full_block_in_group(ids[1], 1, h(1)), Ok(true));
        assert_eq!(p.lookup_in_group(1, &h(1)), Some(1));
        assert_eq!(p.num_cached_blocks(), 2);
        p.check_invariants().unwrap();
    }

    #[test]
    fn touch_counts_and_rejects_out_of_range() {
        let mut p = BlockPool::new(2);
        assert!(matches!(
            p.touch(&[0, 5]),
            Err(KvError::BlockOutOfRange { .. })
        ));
        assert_eq!(p.num_free_blocks(), 2);
        p.touch(&[0]).unwrap();
        p.touch(&[0]).unwrap();
        assert_eq!(p.ref_count(0), Some(2));
        assert_eq!(p.num_free_blocks(), 1);
        p.check_invariants().unwrap();
    }

    #[test]
    fn reset_only_when_idle() {
        let mut p = BlockPool::new(2);
        let ids = p.allocate(1).unwrap();
        p.cache_full_block(ids[0], h(3)).unwrap();
        assert!(!p.reset_prefix_cache());
        p.free(&ids).unwrap();
        assert!(p.reset_prefix_cache());
        assert_eq!(p.lookup(&h(3)), None);
        p.check_invariants().unwrap();
    }

    #[test]
    fn stats_count_tokens() {
        let mut p = BlockPool::new(1);
        p.record_prefix_query(10, 8);
        p.record_prefix_query(5, 0);
        assert_eq!(p.prefix_queries(), 15);
        assert_eq!(p.prefix_hits(), 8);
    }

    #[test]
    fn empty_pool() {
        let mut p = BlockPool::new(0);
        assert_eq!(p.usage(), 0.0);
        assert!(p.allocate(1).is_err());
        p.check_invariants().unwrap();
    }
}
