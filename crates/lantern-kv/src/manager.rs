//! Per-request KV cache bookkeeping: which blocks each request holds in each KV cache
//! group, backed by one shared [`BlockPool`], with prefix caching and `n > 1` forks.
//!
//! Every group draws its blocks from the same pool (block `b` of group `g` is page `b`
//! of each of `g`'s layers' tensors), and a request always grows in every group at once,
//! all or nothing, so a step never runs with some layers lacking a page.
//!
//! Prefix caching keys a full block by its chained content hash ([`crate::hash`]) in
//! its group. A prompt hits a prefix only as far as *every* group has the block cached,
//! because every layer must find its keys — except that a sliding-window or
//! chunked-local group needs only the blocks the first computed query can still reach.
//!
//! [`KvCacheManager::release_out_of_reach`] gives back the leading blocks of such groups
//! that no future query of the request can see, leaving [`NULL_BLOCK`] in their place,
//! so a long request's sliding-window memory stays bounded by the window plus a block.
//!
//! [`KvCacheManager::free_keeping_tail`] keeps a finished request's partial last block
//! for one later request that continues its tokens (a beam search's next step, whose
//! prompt is the last step's plus one token): [`KvCacheManager::get_computed_blocks`]
//! hands it over whole after the full blocks it follows, so the continuation computes
//! only its new tokens. Kept tails count as free and go first when blocks run short.
//!
//! Do not combine prefix caching with sliding-window padding in the slot mapping
//! ([`crate::slot::compute_slot_mapping`] with a window): a padded position is never
//! written, so its block's content would not match the key it is cached under.

use std::collections::{HashMap, VecDeque};

use crate::block_pool::{BlockPool, KvCacheEvent, PrefixCacheStats};
use crate::config::KvCacheConfig;
use crate::error::KvError;
use crate::hash::{extend_block_hashes, BlockHash};
use crate::policy::BlockRetention;
use crate::spec::KvCacheSpec;
use crate::tokens::TokenSeq;
use crate::{BlockId, NULL_BLOCK};

/// The engine's request id.
pub type RequestId = u64;

/// What [`KvCacheManager::fork`] shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForkOutcome {
    /// Leading tokens whose K/V the child shares with the parent (whole blocks): the
    /// child's number of computed tokens.
    pub shared_tokens: usize,
    /// Computed tokens of the parent that the child must compute again (the parent's
    /// partial last block, which the parent keeps writing into).
    pub recompute_tokens: usize,
}

/// One request's blocks.
#[derive(Debug, Clone)]
struct RequestBlocks {
    /// Block table per group.
    tables: Vec<Vec<BlockId>>,
    /// Per group, leading blocks already offered to the prefix cache.
    num_cached: Vec<usize>,
    /// Chained keys of the request's full blocks hashed so far (one list for all
    /// groups: they share the block size and the tokens).
    hashes: Vec<BlockHash>,
}

impl RequestBlocks {
    fn new(num_groups: usize) -> Self {
        Self {
            tables: vec![Vec::new(); num_groups],
            num_cached: vec![0; num_groups],
            hashes: Vec::new(),
        }
    }

    fn holds_blocks(&self) -> bool {
        self.tables.iter().any(|t| !t.is_empty())
    }
}

/// A finished request's partial last block, kept for one request that continues its
/// tokens.
#[derive(Debug, Clone)]
struct Tail {
    /// Key of the full block it follows (`None`: it is the first block).
    after: Option<BlockHash>,
    /// The finished request's extra keys (its cache salt): only a request with the
    /// same ones may take it.
    extra_keys: Vec<u8>,
    /// The tokens whose K/V it holds.
    tokens: Vec<u32>,
    /// Its block in each group.
    blocks: Vec<BlockId>,
}

/// Most tails kept at once (the oldest go first): enough for the beams of many
/// searches, few enough that they cannot crowd out the prefix cache (and never more
/// than a quarter of the pool).
const MAX_TAILS: usize = 256;

/// Block tables of all running requests, over one shared block pool.
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    pool: BlockPool,
    specs: Vec<KvCacheSpec>,
    /// Per-group rule for dropping out-of-reach blocks (see [`crate::policy`]).
    retention: Vec<BlockRetention>,
    /// The block size shared by all groups (0 without groups).
    block_size: usize,
    prefix_caching: bool,
    requests: HashMap<RequestId, RequestBlocks>,
    /// Kept partial blocks, oldest first (see [`Self::free_keeping_tail`]).
    tails: VecDeque<Tail>,
}

impl KvCacheManager {
    /// A manager for `config`'s groups over a pool of `config.num_blocks` blocks.
    ///
    /// Prefix caching is only switched on when asked for and the config is usable for
    /// it (at least one group, one non-zero block size for all): a hand-built invalid
    /// config degrades to no caching instead of failing or panicking later.
    pub fn new(config: &KvCacheConfig, enable_prefix_caching: bool) -> Self {
        let specs: Vec<KvCacheSpec> = config.groups.iter().map(|g| g.spec).collect();
        let block_size = specs.first().map_or(0, |s| s.block_size);
        let uniform = block_size > 0 && specs.iter().all(|s| s.block_size == block_size);
        Self {
            pool: BlockPool::new(config.num_blocks),
            retention: specs.iter().map(BlockRetention::for_spec).collect(),
            specs,
            block_size,
            prefix_caching: enable_prefix_caching && uniform,
            requests: HashMap::new(),
            tails: VecDeque::new(),
        }
    }

    /// Makes every group of `req` hold enough blocks for `num_tokens_total` tokens,
    /// allocating the missing ones from the pool; all or nothing across groups. Never
    /// shrinks a table. A new request id is registered on success.
    pub fn allocate_slots(
        &mut self,
        req: RequestId,
        num_tokens_total: usize,
    ) -> Result<(), KvError> {
        let existing = self.requests.get(&req);
        let missing: Vec<usize> = self
            .specs
            .iter()
            .enumerate()
            .map(|(g, spec)| {
                let have = existing.map_or(0, |r| r.tables[g].len());
                spec.blocks_for_tokens(num_tokens_total)
                    .saturating_sub(have)
            })
            .collect();
        let needed = missing.iter().fold(0usize, |a, &m| a.saturating_add(m));
        let free = self.num_free_blocks();
        if needed > free {
            return Err(KvError::OutOfBlocks { needed, free });
        }
        while self.pool.num_free_blocks() < needed && !self.tails.is_empty() {
            self.drop_oldest_tail();
        }
        let mut fresh = self.pool.allocate(needed)?.into_iter();
        let num_groups = self.specs.len();
        let entry = self
            .requests
            .entry(req)
            .or_insert_with(|| RequestBlocks::new(num_groups));
        for (table, &m) in entry.tables.iter_mut().zip(&missing) {
            table.extend(fresh.by_ref().take(m));
        }
        Ok(())
    }

    /// Block table of `req` in `group` (empty when either is unknown).
    pub fn block_table(&self, req: RequestId, group: usize) -> &[BlockId] {
        self.requests
            .get(&req)
            .and_then(|r| r.tables.get(group))
            .map_or(&[], Vec::as_slice)
    }

    /// Block tables of `req`, one per group (empty slices when unknown).
    pub fn block_tables(&self, req: RequestId) -> Vec<&[BlockId]> {
        (0..self.specs.len())
            .map(|g| self.block_table(req, g))
            .collect()
    }

    /// Gives back every block of `req` in every group. Unknown requests are a no-op.
    ///
    /// Blocks go back last position first (all groups of one position together), so
    /// the tail of a sequence is evicted before its prefix, which other requests are
    /// more likely to share.
    pub fn free(&mut self, req: RequestId) {
        let Some(r) = self.requests.remove(&req) else {
            return;
        };
        let longest = r.tables.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(r.tables.iter().map(Vec::len).sum());
        for i in (0..longest).rev() {
            ids.extend(
                r.tables
                    .iter()
                    .filter_map(|t| t.get(i).copied())
                    .filter(|&b| b != NULL_BLOCK),
            );
        }
        // Only fails if the manager's own books are wrong, which the invariant tests
        // rule out; the pool rejects such a call whole, so state stays consistent.
        let freed = self.pool.free(&ids);
        debug_assert!(
            freed.is_ok(),
            "KV manager freed blocks it did not hold: {freed:?}"
        );
    }

    /// [`Self::free`], keeping `req`'s partial last block (when prefix caching is on and
    /// its `num_computed` computed tokens end inside a block) for one later request
    /// whose prompt continues `token_ids` (see [`Self::get_computed_blocks`]).
    /// `token_ids` must start with the request's computed tokens, `extra_keys` be those
    /// of [`Self::cache_blocks`].
    pub fn free_keeping_tail<'a>(
        &mut self,
        req: RequestId,
        token_ids: impl Into<TokenSeq<'a>>,
        num_computed: usize,
        extra_keys: &[u8],
    ) {
        let token_ids = token_ids.into();
        let bs = self.block_size;
        let at = num_computed.checked_div(bs).unwrap_or(0);
        let tokens = token_ids.range(at * bs..num_computed);
        let r = self.requests.get_mut(&req);
        let (Some(r), Some(tokens)) = (r, tokens) else {
            return self.free(req);
        };
        // A released block cannot be kept (the last one never is: it is within reach).
        let missing = |t: &Vec<BlockId>| t.get(at).is_none_or(|&b| b == NULL_BLOCK);
        if !self.prefix_caching || num_computed.is_multiple_of(bs) || r.tables.iter().any(missing) {
            return self.free(req);
        }
        let computed = token_ids.prefix(num_computed);
        extend_block_hashes(&mut r.hashes, computed, bs, extra_keys);
        let after = match at {
            0 => None,
            n => match r.hashes.get(n - 1) {
                Some(&h) => Some(h),
                None => return self.free(req),
            },
        };
        // The tail leaves the tables, so that freeing the rest leaves it held.
        let blocks: Vec<BlockId> = r
            .tables
            .iter_mut()
            .map(|t| std::mem::replace(&mut t[at], NULL_BLOCK))
            .collect();
        self.free(req);
        let most = (self.pool.num_blocks() / 4).clamp(2, MAX_TAILS);
        while self.tails.len() >= most {
            self.drop_oldest_tail();
        }
        self.tails.push_back(Tail {
            after,
            extra_keys: extra_keys.to_vec(),
            tokens: tokens.into_owned(),
            blocks,
        });
    }

    /// Gives the oldest kept tail's blocks back to the pool.
    fn drop_oldest_tail(&mut self) {
        if let Some(tail) = self.tails.pop_front() {
            let freed = self.pool.free(&tail.blocks);
            debug_assert!(freed.is_ok(), "a tail's blocks were not held: {freed:?}");
        }
    }

    /// Takes the kept tail that continues `token_ids` after its first `hit_blocks` full
    /// blocks (keyed `hashes`), if one does and leaves at least the last token to
    /// compute: its tokens and its blocks, one per group.
    fn take_tail(
        &mut self,
        token_ids: TokenSeq<'_>,
        hashes: &[BlockHash],
        hit_blocks: usize,
        extra_keys: &[u8],
    ) -> Option<(usize, Vec<BlockId>)> {
        let after = match hit_blocks {
            0 => None,
            n => Some(*hashes.get(n - 1)?),
        };
        let start = hit_blocks * self.block_size;
        let room = token_ids.len().saturating_sub(1).saturating_sub(start);
        let at = self.tails.iter().position(|t| {
            t.after == after
                && t.extra_keys == extra_keys
                && t.tokens.len() <= room
                && token_ids
                    .range(start..start + t.tokens.len())
                    .is_some_and(|ids| *ids == t.tokens[..])
        })?;
        let tail = self.tails.remove(at)?;
        Some((tail.tokens.len(), tail.blocks))
    }

    /// Gives back the leading blocks of `req`'s sliding-window and chunked-local groups
    /// that no query from position `num_computed_tokens` on can see, leaving
    /// [`NULL_BLOCK`] in their place. Call after the step's [`Self::cache_blocks`], so
    /// a released full block stays in the prefix cache until it is evicted. Returns the
    /// number of blocks given back. A request whose keys must stay readable after it
    /// runs (attention capture) should not call this.
    pub fn release_out_of_reach(&mut self, req: RequestId, num_computed_tokens: usize) -> usize {
        // Full attention only (most models): nothing can ever be released.
        if self.retention.iter().all(|r| *r == BlockRetention::KeepAll) {
            return 0;
        }
        let Some(r) = self.requests.get_mut(&req) else {
            return 0;
        };
        let mut released = Vec::new();
        for (table, retention) in r.tables.iter_mut().zip(&self.retention) {
            let out = retention.blocks_out_of_reach(num_computed_tokens, self.block_size);
            for b in table.iter_mut().take(out) {
                if *b != NULL_BLOCK {
                    released.push(*b);
                    *b = NULL_BLOCK;
                }
            }
        }
        let freed = self.pool.free(&released);
        debug_assert!(freed.is_ok(), "released blocks it did not hold: {freed:?}");
        released.len()
    }

    /// Blocks `req` holds in `group` (released ones not counted).
    pub fn num_held_blocks(&self, req: RequestId, group: usize) -> usize {
        self.block_table(req, group)
            .iter()
            .filter(|&&b| b != NULL_BLOCK)
            .count()
    }

    /// Looks up the longest cached prefix of a new request's prompt and takes it: the
    /// hit blocks gain a reference and become the start of the request's block tables.
    /// Returns the number of leading tokens served from the cache.
    ///
    /// Only full blocks hit, and never the whole prompt: at least the last token is
    /// computed so the step has logits to sample from (as in vLLM). Returns 0 when
    /// prefix caching is off or `req` already holds blocks. `extra_keys` (e.g. a cache
    /// salt) must be the same bytes later passed to [`Self::cache_blocks`].
    ///
    /// The request now holds blocks even if the following [`Self::allocate_slots`]
    /// fails; call [`Self::free`] if it will not run now (its blocks stay cached).
    pub fn get_computed_blocks<'a>(
        &mut self,
        req: RequestId,
        token_ids: impl Into<TokenSeq<'a>>,
        extra_keys: &[u8],
    ) -> usize {
        let token_ids = token_ids.into();
        if !self.prefix_caching {
            return 0;
        }
        if self
            .requests
            .get(&req)
            .is_some_and(RequestBlocks::holds_blocks)
        {
            return 0;
        }
        let bs = self.block_size;
        let mut hashes = Vec::new();
        extend_block_hashes(&mut hashes, token_ids, bs, extra_keys);
        let max_hit_blocks = token_ids.len().saturating_sub(1) / bs;

        let num_groups = self.specs.len();
        // found[g][i]: group g has block i of the prompt cached.
        let found: Vec<Vec<Option<BlockId>>> = (0..num_groups)
            .map(|g| {
                hashes
                    .iter()
                    .take(max_hit_blocks)
                    .map(|h| self.pool.lookup_in_group(g, h))
                    .collect()
            })
            .collect();
        // The longest hit of `n` blocks for which every group has every block the first
        // computed query (at position n * bs) can reach.
        let valid = |n: usize| {
            (0..num_groups).all(|g| {
                let first = self.retention[g].blocks_out_of_reach(n * bs, bs).min(n);
                found[g][first..n].iter().all(Option::is_some)
            })
        };
        let hit_blocks = (0..=max_hit_blocks.min(hashes.len()))
            .rev()
            .find(|&n| valid(n))
            .unwrap_or(0);
        let hit_tables: Vec<Vec<BlockId>> = (0..num_groups)
            .map(|g| {
                let first = self.retention[g].blocks_out_of_reach(hit_blocks * bs, bs);
                (0..hit_blocks)
                    .map(|i| match found[g][i] {
                        Some(b) if i >= first => b,
                        _ => NULL_BLOCK,
                    })
                    .collect()
            })
            .collect();
        let all_hits: Vec<BlockId> = hit_tables
            .iter()
            .flatten()
            .copied()
            .filter(|&b| b != NULL_BLOCK)
            .collect();
        if self.pool.touch(&all_hits).is_err() {
            // Unreachable: the map only names blocks of this pool. Serve nothing.
            return 0;
        }
        let mut hit_tables = hit_tables;
        let mut hit_tokens = hit_blocks * bs;
        // Only a hit of every full block a tail follows reaches it.
        if hit_blocks == max_hit_blocks.min(hashes.len()) {
            if let Some((tokens, blocks)) =
                self.take_tail(token_ids, &hashes, hit_blocks, extra_keys)
            {
                for (table, block) in hit_tables.iter_mut().zip(blocks) {
                    table.push(block);
                }
                hit_tokens += tokens;
            }
        }
        self.pool.record_prefix_query(token_ids.len(), hit_tokens);

        let entry = self
            .requests
            .entry(req)
            .or_insert_with(|| RequestBlocks::new(num_groups));
        entry.tables = hit_tables;
        entry.num_cached = vec![hit_blocks; num_groups];
        entry.hashes = hashes;
        hit_tokens
    }

    /// Registers the blocks of `req` that `token_ids_so_far` (every token whose K/V is
    /// now in the cache) fills completely, under their chained keys, so later requests
    /// can reuse them. Each block is hashed and registered once; call after every step.
    /// A no-op when prefix caching is off; an unknown request is an error.
    pub fn cache_blocks<'a>(
        &mut self,
        req: RequestId,
        token_ids_so_far: impl Into<TokenSeq<'a>>,
        extra_keys: &[u8],
    ) -> Result<(), KvError> {
        let token_ids_so_far = token_ids_so_far.into();
        if !self.prefix_caching {
            return Ok(());
        }
        let r = self
            .requests
            .get_mut(&req)
            .ok_or(KvError::UnknownRequest(req))?;
        let full = token_ids_so_far.len() / self.block_size;
        extend_block_hashes(&mut r.hashes, token_ids_so_far, self.block_size, extra_keys);
        for (g, table) in r.tables.iter().enumerate() {
            let upto = full.min(table.len());
            while r.num_cached[g] < upto {
                let i = r.num_cached[g];
                if table[i] != NULL_BLOCK {
                    self.pool
                        .cache_full_block_in_group(table[i], g, r.hashes[i])?;
                }
                r.num_cached[g] = i + 1;
            }
        }
        Ok(())
    }

    /// Starts `child` (e.g. another sample of an `n > 1` request) on the parent's
    /// blocks: the child's tables reference the parent's leading *full* blocks among
    /// the first `num_computed_tokens` tokens, shared by reference count.
    ///
    /// The parent's partial last block is not shared (both would write into it); the
    /// outcome says how many tokens the child must compute again. Follow with
    /// [`Self::allocate_slots`] for the child. If the child needs its own logits for the
    /// last prompt token, pass `num_computed_tokens - 1`.
    pub fn fork(
        &mut self,
        parent: RequestId,
        child: RequestId,
        num_computed_tokens: usize,
    ) -> Result<ForkOutcome, KvError> {
        if parent == child || self.requests.contains_key(&child) {
            return Err(KvError::RequestExists(child));
        }
        let p = self
            .requests
            .get(&parent)
            .ok_or(KvError::UnknownRequest(parent))?;
        let by_tokens = num_computed_tokens
            .checked_div(self.block_size)
            .unwrap_or(0);
        let k = p
            .tables
            .iter()
            .map(Vec::len)
            .min()
            .unwrap_or(0)
            .min(by_tokens);
        let shared: Vec<BlockId> = p
            .tables
            .iter()
            .flat_map(|t| t[..k].iter().copied())
            .filter(|&b| b != NULL_BLOCK)
            .collect();
        let child_blocks = RequestBlocks {
            tables: p.tables.iter().map(|t| t[..k].to_vec()).collect(),
            num_cached: p.num_cached.iter().map(|&c| c.min(k)).collect(),
            hashes: p.hashes[..k.min(p.hashes.len())].to_vec(),
        };
        self.pool.incr_ref(&shared)?;
        self.requests.insert(child, child_blocks);
        let shared_tokens = k * self.block_size;
        Ok(ForkOutcome {
            shared_tokens,
            recompute_tokens: num_computed_tokens.saturating_sub(shared_tokens),
        })
    }

    /// Whether a request of `num_tokens` tokens could fit if it had the whole pool (a
    /// request that cannot should be rejected rather than wait forever). Counts every
    /// group's blocks, since none are dropped yet.
    pub fn can_fit_ever(&self, num_tokens: usize) -> bool {
        let needed = self
            .specs
            .iter()
            .map(|s| s.blocks_for_tokens(num_tokens))
            .fold(0usize, usize::saturating_add);
        needed <= self.pool.num_blocks()
    }

    /// The most tokens one request could ever hold, up to `limit` (see
    /// [`Self::can_fit_ever`]).
    pub fn longest_sequence(&self, limit: usize) -> usize {
        let (mut lo, mut hi) = (0usize, limit);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.can_fit_ever(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// Blocks free to allocate: the pool's, and the kept tails' (given back first when
    /// blocks run short).
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks() + self.tail_blocks()
    }

    fn tail_blocks(&self) -> usize {
        self.tails.iter().map(|t| t.blocks.len()).sum()
    }

    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Fraction of blocks held by requests, in `[0, 1]` (kept tails count as free).
    pub fn usage(&self) -> f64 {
        match self.pool.num_blocks() {
            0 => 0.0,
            total => (total - self.num_free_blocks()) as f64 / total as f64,
        }
    }

    /// Requests that hold (or held, since their last free) blocks here.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    pub fn contains(&self, req: RequestId) -> bool {
        self.requests.contains_key(&req)
    }

    pub fn num_groups(&self) -> usize {
        self.specs.len()
    }

    pub fn group_spec(&self, group: usize) -> Option<&KvCacheSpec> {
        self.specs.get(group)
    }

    /// The group's rule for out-of-reach blocks.
    pub fn group_retention(&self, group: usize) -> Option<BlockRetention> {
        self.retention.get(group).copied()
    }

    /// The block size shared by all groups (0 without groups).
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn prefix_caching_enabled(&self) -> bool {
        self.prefix_caching
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.pool.prefix_cache_stats()
    }

    /// Read access to the pool (reference counts, hashes, counters).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// See [`BlockPool::set_record_events`].
    pub fn set_record_events(&mut self, on: bool) {
        self.pool.set_record_events(on);
    }

    /// See [`BlockPool::drain_events`].
    pub fn drain_events(&mut self) -> Vec<KvCacheEvent> {
        self.pool.drain_events()
    }

    /// Drops every cached key if no request holds blocks; returns whether it did.
    pub fn reset_prefix_cache(&mut self) -> bool {
        while !self.tails.is_empty() {
            self.drop_oldest_tail();
        }
        self.pool.reset_prefix_cache()
    }

    /// Checks that the pool is consistent and that every block's reference count equals
    /// the number of block-table entries naming it (so held blocks plus free blocks make
    /// up the pool). O(blocks + table entries); for tests and debugging.
    pub fn check_invariants(&self) -> Result<(), KvError> {
        self.pool.check_invariants()?;
        let fail = |m: String| Err(KvError::InvariantViolated(m));
        let mut holders = vec![0usize; self.pool.num_blocks()];
        for (req, r) in &self.requests {
            if r.tables.len() != self.specs.len() || r.num_cached.len() != self.specs.len() {
                return fail(format!(
                    "request {req} has tables for the wrong group count"
                ));
            }
            for (g, table) in r.tables.iter().enumerate() {
                if r.num_cached[g] > table.len() {
                    return fail(format!("request {req} group {g} cached past its table"));
                }
                for &b in table.iter().filter(|&&b| b != NULL_BLOCK) {
                    match holders.get_mut(b as usize) {
                        Some(h) => *h += 1,
                        None => return fail(format!("request {req} holds unknown block {b}")),
                    }
                }
            }
        }
        for tail in &self.tails {
            for &b in &tail.blocks {
                match holders.get_mut(b as usize) {
                    Some(h) => *h += 1,
                    None => return fail(format!("a tail holds unknown block {b}")),
                }
            }
        }
        let mut held = 0;
        for (b, &h) in holders.iter().enumerate() {
            let rc = self.pool.ref_count(b as BlockId).unwrap_or(0);
            if rc != h {
                return fail(format!("block {b}: ref count {rc} but {h} table entries"));
            }
            held += usize::from(h > 0);
        }
        if held + self.pool.num_free_blocks() != self.pool.num_blocks() {
            return fail(format!(
                "{held} held + {} free != {} blocks",
                self.pool.num_free_blocks(),
                self.pool.num_blocks()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvDtype;

    const BS: usize = 4;

    fn full() -> KvCacheSpec {
        KvCacheSpec::full_attention(BS, 1, 8, KvDtype::F32)
    }

    fn manager(num_blocks: usize, caching: bool) -> KvCacheManager {
        let cfg = KvCacheConfig::with_num_blocks(&[full(), full()], num_blocks).unwrap();
        KvCacheManager::new(&cfg, caching)
    }

    fn hybrid(num_blocks: usize) -> KvCacheManager {
        let swa = KvCacheSpec::sliding_window(8, BS, 1, 8, KvDtype::F32);
        let cfg = KvCacheConfig::with_num_blocks(&[full(), swa, full()], num_blocks).unwrap();
        KvCacheManager::new(&cfg, true)
    }

    #[test]
    fn allocate_grows_and_never_shrinks() {
        let mut m = manager(8, false);
        m.allocate_slots(1, 5).unwrap();
        assert_eq!(m.block_table(1, 0), &[0, 1]);
        assert_eq!(m.num_free_blocks(), 6);
        m.allocate_slots(1, 8).unwrap();
        assert_eq!(m.block_table(1, 0).len(), 2);
        m.allocate_slots(1, 9).unwrap();
        assert_eq!(m.block_table(1, 0), &[0, 1, 2]);
        m.allocate_slots(1, 1).unwrap();
        assert_eq!(m.block_table(1, 0).len(), 3);
        assert_eq!(m.block_tables(1).len(), 1);
        assert_eq!(m.num_requests(), 1);
        m.check_invariants().unwrap();
    }

    #[test]
    fn groups_allocate_together_all_or_nothing() {
        let mut m = hybrid(5);
        assert_eq!(m.num_groups(), 2);
        m.allocate_slots(1, 8).unwrap(); // 2 blocks per group
        assert_eq!(m.block_tables(1), vec![&[0, 1][..], &[2, 3][..]]);
        assert_eq!(
            m.allocate_slots(1, 9),
            Err(KvError::OutOfBlocks { needed: 2, free: 1 })
        );
        assert_eq!(m.block_table(1, 0).len(), 2);
        assert_eq!(m.block_table(1, 1).len(), 2);
        assert_eq!(
            m.allocate_slots(2, 1),
            Err(KvError::OutOfBlocks { needed: 2, free: 1 })
        );
        assert!(!m.contains(2));
        m.check_invariants().unwrap();
    }

    #[test]
    fn free_returns_everything_and_unknown_is_noop() {
        let mut m = hybrid(8);
        m.allocate_slots(1, 7).unwrap();
        m.allocate_slots(2, 3).unwrap();
        m.free(1);
        m.free(1);
        m.free(42);
        assert_eq!(m.num_free_blocks(), 6);
        assert!(m.block_table(1, 0).is_empty());
        assert_eq!(m.block_tables(1), vec![&[][..], &[][..]]);
        m.free(2);
        assert_eq!(m.num_free_blocks(), 8);
        assert_eq!(m.usage(), 0.0);
        m.check_invariants().unwrap();
    }

    #[test]
    fn freed_blocks_without_content_come_back_before_never_used_ones() {
        let mut m = manager(4, false);
        m.allocate_slots(1, 12).unwrap(); // blocks 0, 1, 2
        m.free(1);
        // Prefix caching is off, so nothing is cached: freed as 2, 1, 0, each to the head
        // of the queue, before the never-used 3.
        m.allocate_slots(2, 16).unwrap();
        assert_eq!(m.block_table(2, 0), &[0, 1, 2, 3]);
    }

    #[test]
    fn can_fit_ever_counts_all_groups() {
        let m = hybrid(6);
        assert!(m.can_fit_ever(12)); // 3 blocks x 2 groups
        assert!(!m.can_fit_ever(13));
        assert!(m.can_fit_ever(0));
        assert_eq!(m.longest_sequence(100), 12);
        assert_eq!(m.longest_sequence(5), 5);
    }

    #[test]
    fn prefix_hit_reuses_full_blocks_but_not_the_last_token() {
        let mut m = manager(8, true);
        let prompt: Vec<u32> = (0..10).collect();
        assert_eq!(m.get_computed_blocks(1, &prompt, b""), 0);
        m.allocate_slots(1, prompt.len()).unwrap();
        m.cache_blocks(1, &prompt, b"").unwrap();
        let first_two = m.block_table(1, 0)[..2].to_vec();

        // Same prompt: two full blocks hit (8 tokens), the partial third does not.
        assert_eq!(m.get_computed_blocks(2, &prompt, b""), 8);
        assert_eq!(m.block_table(2, 0), &first_two[..]);
        assert_eq!(m.pool().ref_count(first_two[0]), Some(2));
        m.allocate_slots(2, prompt.len()).unwrap();
        assert_eq!(m.block_table(2, 0).len(), 3);
        assert_ne!(m.block_table(2, 0)[2], m.block_table(1, 0)[2]);

        // A prompt of exactly two blocks hits only one: the last token is recomputed.
        assert_eq!(m.get_computed_blocks(3, &prompt[..8], b""), 4);
        // Another salt shares nothing.
        assert_eq!(m.get_computed_blocks(4, &prompt, b"other"), 0);
        let stats = m.prefix_cache_stats();
        assert_eq!(stats.queries, 10 + 10 + 8 + 10);
        assert_eq!(stats.hits, 8 + 4);
        m.check_invariants().unwrap();
    }

    /// A request that ran `prompt` (all of it computed) and finished, keeping its tail.
    fn run_and_keep_tail(m: &mut KvCacheManager, req: RequestId, prompt: &[u32], salt: &[u8]) {
        let hit = m.get_computed_blocks(req, prompt, salt);
        assert!(hit < prompt.len());
        m.allocate_slots(req, prompt.len()).unwrap();
        m.cache_blocks(req, prompt, salt).unwrap();
        m.free_keeping_tail(req, prompt, prompt.len(), salt);
        m.check_invariants().unwrap();
    }

    #[test]
    fn a_kept_tail_goes_whole_to_one_continuation() {
        let mut m = manager(8, true);
        let prompt: Vec<u32> = (0..10).collect();
        run_and_keep_tail(&mut m, 1, &prompt, b"");
        // Two full blocks cached, the partial third kept: all of them count as free.
        assert_eq!(m.num_free_blocks(), 8);
        assert_eq!(m.usage(), 0.0);
        let mut next = prompt.clone();
        next.push(42);
        // Another salt, or other tokens in the tail, find only the full blocks.
        assert_eq!(m.get_computed_blocks(2, &next, b"salt"), 0);
        let mut other = prompt.clone();
        other[9] = 7;
        other.push(42);
        assert_eq!(m.get_computed_blocks(3, &other, b""), 8);
        // The continuation gets the tail: only its new token is left to compute.
        assert_eq!(m.get_computed_blocks(4, &next, b""), 10);
        m.allocate_slots(4, next.len()).unwrap();
        assert_eq!(m.block_table(4, 0).len(), 3);
        // Taken once: a second continuation computes the tail's tokens again.
        assert_eq!(m.get_computed_blocks(5, &next, b""), 8);
        // The prompt itself cannot take it (its last token must be computed).
        for id in [2, 3, 4, 5] {
            m.free(id);
        }
        run_and_keep_tail(&mut m, 6, &prompt, b"");
        assert_eq!(m.get_computed_blocks(7, &prompt, b""), 8);
        m.check_invariants().unwrap();
    }

    #[test]
    fn kept_tails_go_first_when_blocks_run_short() {
        let mut m = manager(4, true);
        let a: Vec<u32> = (0..5).collect();
        run_and_keep_tail(&mut m, 1, &a, b"");
        let b: Vec<u32> = (50..53).collect();
        run_and_keep_tail(&mut m, 2, &b, b"");
        assert_eq!(m.num_free_blocks(), 4);
        // Four blocks for a new request: both tails are given back.
        m.get_computed_blocks(3, &(100..116).collect::<Vec<u32>>(), b"");
        m.allocate_slots(3, 16).unwrap();
        m.check_invariants().unwrap();
        m.free(3);
        let mut b_next = b.clone();
        b_next.push(1);
        assert_eq!(m.get_computed_blocks(4, &b_next, b""), 0);
        m.check_invariants().unwrap();
    }

    #[test]
    fn at_most_a_quarter_of_the_pool_is_kept_in_tails() {
        let mut m = manager(8, true);
        for (req, first) in [(1, 0u32), (2, 10), (3, 20)] {
            run_and_keep_tail(&mut m, req, &[first, first + 1], b"");
        }
        // Two tails of one block each: the oldest went.
        assert_eq!(m.pool().num_free_blocks(), 6);
        assert_eq!(m.get_computed_blocks(4, &[0, 1, 2], b""), 0);
        assert_eq!(m.get_computed_blocks(5, &[20, 21, 22], b""), 2);
        m.check_invariants().unwrap();
    }

    #[test]
    fn every_group_keeps_its_tail() {
        let mut m = hybrid(16);
        let prompt: Vec<u32> = (0..13).collect();
        run_and_keep_tail(&mut m, 1, &prompt, b"");
        let mut next = prompt.clone();
        next.push(99);
        assert_eq!(m.get_computed_blocks(2, &next, b""), 13);
        assert_eq!(m.num_groups(), 2);
        for g in 0..m.num_groups() {
            assert_eq!(
                m.block_table(2, g).len(),
                4,
                "group {g}: {:?}",
                m.block_tables(2)
            );
        }
        m.allocate_slots(2, 14).unwrap();
        m.check_invariants().unwrap();
        // Without prefix caching nothing is kept.
        let mut off = manager(4, false);
        off.allocate_slots(1, 5).unwrap();
        off.free_keeping_tail(1, &prompt[..5], 5, b"");
        assert_eq!(off.pool().num_free_blocks(), 4);
    }

    #[test]
    fn freed_cached_blocks_are_hit_until_evicted() {
        let mut m = manager(4, true);
        m.set_record_events(true);
        let prompt: Vec<u32> = (100..109).collect();
        m.get_computed_blocks(1, &prompt, b"");
        m.allocate_slots(1, 9).unwrap();
        m.cache_blocks(1, &prompt, b"").unwrap();
        m.free(1);
        assert_eq!(m.num_free_blocks(), 4);
        assert_eq!(m.get_computed_blocks(2, &prompt, b""), 8);
        assert_eq!(m.num_free_blocks(), 2);
        m.free(2);
        // Use the whole pool elsewhere: the cached blocks are evicted.
        m.allocate_slots(3, 16).unwrap();
        assert_eq!(m.pool().num_evictions(), 2);
        m.free(3);
        assert_eq!(m.get_computed_blocks(4, &prompt, b""), 0);
        let events = m.drain_events();
        let stored = events
            .iter()
            .filter(|e| matches!(e, KvCacheEvent::Stored { .. }))
            .count();
        let evicted = events
            .iter()
            .filter(|e| matches!(e, KvCacheEvent::Evicted { .. }))
            .count();
        assert_eq!((stored, evicted), (2, 2));
        m.check_invariants().unwrap();
    }

    #[test]
    fn hybrid_hits_need_every_group() {
        let mut m = hybrid(16);
        let prompt: Vec<u32> = (0..13).collect();
        m.get_computed_blocks(1, &prompt, b"");
        m.allocate_slots(1, 13).unwrap();
        m.cache_blocks(1, &prompt, b"").unwrap();
        assert_eq!(m.get_computed_blocks(2, &prompt, b""), 12);
        assert_eq!(m.block_table(2, 0), &m.block_table(1, 0)[..3]);
        // The window group (window 8) needs only what the query at 12 sees: 5..=12.
        assert_eq!(m.block_table(2, 1)[0], NULL_BLOCK);
        assert_eq!(&m.block_table(2, 1)[1..], &m.block_table(1, 1)[1..3]);
        m.check_invariants().unwrap();
    }

    #[test]
    fn released_window_blocks_bound_a_long_request() {
        let mut m = hybrid(64);
        let tokens: Vec<u32> = (0..200).collect();
        for n in 1..=tokens.len() {
            m.allocate_slots(1, n).unwrap();
            m.cache_blocks(1, &tokens[..n], b"").unwrap();
            m.release_out_of_reach(1, n);
            // Window 8 over blocks of 4: the next query's 8 keys span at most 3 blocks.
            assert!(
                m.num_held_blocks(1, 1) <= 8 / BS + 1,
                "{n}: {:?}",
                m.block_table(1, 1)
            );
            assert_eq!(m.num_held_blocks(1, 0), n.div_ceil(BS));
            assert_eq!(m.block_table(1, 1).len(), n.div_ceil(BS));
            m.check_invariants().unwrap();
        }
        m.free(1);
        assert_eq!(m.num_free_blocks(), m.num_blocks());
        m.check_invariants().unwrap();
    }

    #[test]
    fn a_released_prefix_still_hits_where_the_window_reaches() {
        let mut m = hybrid(64);
        let prompt: Vec<u32> = (0..40).collect();
        m.allocate_slots(1, 40).unwrap();
        m.cache_blocks(1, &prompt, b"").unwrap();
        m.release_out_of_reach(1, 40);
        m.free(1);
        // Blocks of a finished request stay cached until evicted: the full group has
        // them all, the window group needs only those the query at 36 reaches (29..).
        assert_eq!(m.get_computed_blocks(2, &prompt, b""), 36);
        let window = m.block_table(2, 1);
        assert!(window[..7].iter().all(|&b| b == NULL_BLOCK), "{window:?}");
        assert!(window[7..].iter().all(|&b| b != NULL_BLOCK), "{window:?}");
        m.check_invariants().unwrap();
        m.free(2);
        assert_eq!(m.num_free_blocks(), m.num_blocks());
    }

    #[test]
    fn cache_blocks_is_incremental_and_checks_the_request() {
        let mut m = manager(8, true);
        let tokens: Vec<u32> = (0..12).collect();
        assert_eq!(
            m.cache_blocks(7, &tokens, b""),
            Err(KvError::UnknownRequest(7))
        );
        m.allocate_slots(1, 6).unwrap();
        m.cache_blocks(1, &tokens[..6], b"").unwrap();
        assert_eq!(m.pool().num_cached_blocks(), 1);
        m.allocate_slots(1, 12).unwrap();
        m.cache_blocks(1, &tokens, b"").unwrap();
        assert_eq!(m.pool().num_cached_blocks(), 3);
        m.cache_blocks(1, &tokens, b"").unwrap();
        assert_eq!(m.pool().num_cached_blocks(), 3);
        // Without caching it is a no-op, even for unknown requests.
        let mut off = manager(8, false);
        assert_eq!(off.cache_blocks(7, &tokens, b""), Ok(()));
        assert_eq!(off.get_computed_blocks(7, &tokens, b""), 0);
    }

    #[test]
    fn fork_shares_full_blocks_only() {
        let mut m = hybrid(16);
        m.allocate_slots(1, 10).unwrap();
        let out = m.fork(1, 2, 10).unwrap();
        assert_eq!(
            out,
            ForkOutcome {
                shared_tokens: 8,
                recompute_tokens: 2
            }
        );
        assert_eq!(m.block_table(2, 0), &m.block_table(1, 0)[..2]);
        assert_eq!(m.block_table(2, 1), &m.block_table(1, 1)[..2]);
        assert_eq!(m.pool().ref_count(m.block_table(1, 0)[0]), Some(2));
        assert_eq!(m.pool().ref_count(m.block_table(1, 0)[2]), Some(1));
        m.allocate_slots(2, 10).unwrap();
        assert_ne!(m.block_table(2, 0)[2], m.block_table(1, 0)[2]);
        m.check_invariants().unwrap();

        assert_eq!(m.fork(1, 2, 10), Err(KvError::RequestExists(2)));
        assert_eq!(m.fork(1, 1, 10), Err(KvError::RequestExists(1)));
        assert_eq!(m.fork(9, 3, 10), Err(KvError::UnknownRequest(9)));
        // Computed tokens beyond the table are capped by the table.
        let out = m.fork(1, 3, 1000).unwrap();
        assert_eq!(out.shared_tokens, 12);

        m.free(1);
        m.free(2);
        m.free(3);
        assert_eq!(m.num_free_blocks(), 16);
        m.check_invariants().unwrap();
    }

    #[test]
    fn retention_policies_follow_the_specs() {
        let m = hybrid(4);
        assert_eq!(m.group_retention(0), Some(BlockRetention::KeepAll));
        assert_eq!(
            m.group_retention(1),
            Some(BlockRetention::Window { window: 8 })
        );
        assert_eq!(m.group_retention(2), None);
        assert_eq!(m.block_size(), BS);
        assert!(m.prefix_caching_enabled());
    }

    #[test]
    fn invalid_hand_built_config_does_not_panic() {
        let mut spec = full();
        spec.block_size = 0;
        let cfg = KvCacheConfig {
            num_blocks: 4,
            groups: vec![crate::config::KvCacheGroup {
                spec,
                layer_ids: vec![0],
            }],
            tensors: vec![],
        };
        let mut m = KvCacheManager::new(&cfg, true);
        assert!(!m.prefix_caching_enabled());
        assert!(m.allocate_slots(1, 3).is_err());
        assert_eq!(m.get_computed_blocks(1, &[1, 2, 3], b""), 0);
        assert_eq!(m.fork(1, 2, 3), Err(KvError::UnknownRequest(1)));
        m.allocate_slots(1, 0).unwrap();
        assert_eq!(m.fork(1, 2, 3).unwrap().shared_tokens, 0);
        assert!(!m.can_fit_ever(1));
    }
}
