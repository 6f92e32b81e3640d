//! The scheduler: which requests compute how many tokens in the next step.
//!
//! Each step fills a token budget: running requests first (decodes cost one token each,
//! a continuing chunked prefill takes what is left), then waiting requests are admitted
//! while blocks and budget allow. When the block pool runs dry, the most recently admitted
//! running request is preempted: its blocks go back and it is recomputed later.

use crate::request::{Request, RequestStatus};
use crate::scored_prefix::ScoredBlocks;
use lantern_kv::{BlockHash, KvCacheManager, RequestId};
use std::collections::{HashMap, VecDeque};

/// One request's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledRequest {
    pub id: RequestId,
    pub num_tokens: usize,
}

/// The plan of one step. Decodes (one token) come before prefills, as the attention
/// metadata's decode/prefill split requires.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SchedulerOutput {
    pub scheduled: Vec<ScheduledRequest>,
    pub preempted: Vec<RequestId>,
}

impl SchedulerOutput {
    pub fn num_tokens(&self) -> usize {
        self.scheduled.iter().map(|s| s.num_tokens).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
    }
}

pub struct Scheduler {
    max_num_batched_tokens: usize,
    max_num_seqs: usize,
    /// Waiting and preempted requests, oldest first (preempted ones go to the front).
    waiting: VecDeque<RequestId>,
    /// Running requests in admission order.
    running: Vec<RequestId>,
    pub num_preemptions: u64,
}

impl Scheduler {
    pub fn new(max_num_batched_tokens: usize, max_num_seqs: usize) -> Self {
        Self {
            max_num_batched_tokens,
            max_num_seqs,
            waiting: VecDeque::new(),
            running: Vec::new(),
            num_preemptions: 0,
        }
    }

    pub fn add(&mut self, id: RequestId) {
        self.waiting.push_back(id);
    }

    /// Forgets a request (finished or aborted); the caller frees its blocks.
    pub fn remove(&mut self, id: RequestId) {
        self.waiting.retain(|&r| r != id);
        self.running.retain(|&r| r != id);
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Plans the next step, allocating the blocks it needs.
    pub fn schedule(
        &mut self,
        requests: &mut HashMap<RequestId, Request>,
        kv: &mut KvCacheManager,
        scored: &ScoredBlocks,
    ) -> SchedulerOutput {
        let mut budget = self.max_num_batched_tokens;
        let mut out = SchedulerOutput::default();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(req) = requests.get(&id) else {
                // Not a request of the engine any more: nothing to run.
                self.running.remove(i);
                continue;
            };
            let num_tokens = req.num_tokens_next_step().min(budget);
            let total = req.num_computed_tokens + num_tokens;
            if kv.allocate_slots(id, total).is_ok() {
                out.scheduled.push(ScheduledRequest { id, num_tokens });
                budget -= num_tokens;
                i += 1;
                continue;
            }
            // Out of blocks: preempt the most recently admitted request and retry.
            let Some(&victim) = self.running.last() else {
                break;
            };
            self.preempt(victim, requests, kv);
            out.preempted.push(victim);
            out.scheduled.retain(|s| s.id != victim);
            if victim == id {
                break;
            }
        }
        // Prompts being computed, which waiting requests that share their first blocks
        // wait for (see `InFlight`).
        let mut in_flight = InFlight::of_running(&self.running, requests, kv);
        // Admit new requests only when nobody had to be preempted this step.
        let mut next = 0;
        while out.preempted.is_empty() && budget > 0 && self.running.len() < self.max_num_seqs {
            let Some(&id) = self.waiting.get(next) else {
                break;
            };
            if waits_for_leader(id, requests, kv) {
                next += 1;
                continue;
            }
            let Some(req) = requests.get_mut(&id) else {
                self.waiting.remove(next);
                continue;
            };
            if in_flight.computes_a_prefix_of(req) {
                next += 1;
                continue;
            }
            // Prompt logits and attention capture need every position computed by this
            // request (a capture's query rows exist only for what it computes itself):
            // no prefix-cache lookup for them.
            // Prompt logprobs can take a hit as far as their rows are kept.
            let mut scored_hit = false;
            if req.num_computed_tokens == 0 && !req.computes_every_position() {
                let cached = kv.get_computed_blocks(id, req.token_seq(), req.cache_keys());
                req.num_computed_tokens = cached;
                if req.status == RequestStatus::Waiting {
                    req.num_cached_prompt_tokens = cached;
                }
            } else if req.num_computed_tokens == 0
                && req.scores_prompt_only()
                && req.prompt_logprobs.is_empty()
                && kv.prefix_caching_enabled()
            {
                scored_hit = take_scored_hit(id, req, kv, scored);
            }
            let num_tokens = req.num_tokens_next_step().min(budget);
            if kv
                .allocate_slots(id, req.num_computed_tokens + num_tokens)
                .is_err()
            {
                // Leave it waiting, and give back the references its prefix hit took:
                // blocks held by waiting requests could starve the running ones.
                kv.free(id);
                req.num_computed_tokens = 0;
                if scored_hit {
                    req.prompt_logprobs.clear();
                }
                break;
            }
            self.waiting.remove(next);
            req.status = RequestStatus::Running;
            if req.times.first_scheduled.is_none() {
                req.times.first_scheduled = Some(std::time::Instant::now());
            }
            self.running.push(id);
            in_flight.add(req, kv);
            out.scheduled.push(ScheduledRequest { id, num_tokens });
            budget -= num_tokens;
        }
        // Decodes first, keeping admission order within each kind.
        out.scheduled.sort_by_key(|s| s.num_tokens > 1);
        out
    }

    fn preempt(
        &mut self,
        id: RequestId,
        requests: &mut HashMap<RequestId, Request>,
        kv: &mut KvCacheManager,
    ) {
        self.running.retain(|&r| r != id);
        kv.free(id);
        let Some(req) = requests.get_mut(&id) else {
            return;
        };
        req.status = RequestStatus::Preempted;
        req.num_computed_tokens = 0;
        if !req.prompt_logits_complete {
            req.prompt_logits.clear();
        }
        if !req.prompt_logprobs_complete() {
            req.prompt_logprobs.clear();
        }
        req.num_preemptions += 1;
        self.num_preemptions += 1;
        self.waiting.push_front(id);
    }
}

/// What a computing prompt leaves in the prefix cache, for a waiting request to take.
struct PrefixSource {
    /// The keys of the prompt's full blocks.
    hashes: Vec<BlockHash>,
    /// Tokens computed (and so cached) so far.
    computed: usize,
    /// The number of alternatives its prompt logprobs are kept with, when it keeps them.
    scored: Option<usize>,
}

/// Prompts being computed by running requests. A waiting request whose prompt starts
/// with full blocks that one of them has still to compute waits for it: admitted in the
/// same step, both would compute those blocks; a step after they are computed, it takes
/// them from the prefix cache. Requests that arrive together with a shared prefix (the
/// choices of one question an evaluation harness scores, chats with one long system
/// prompt) compute it once. Only where prefix caching is on.
struct InFlight {
    block_size: usize,
    sources: Vec<PrefixSource>,
}

impl InFlight {
    fn of_running(
        running: &[RequestId],
        requests: &HashMap<RequestId, Request>,
        kv: &KvCacheManager,
    ) -> Self {
        let mut in_flight = Self {
            block_size: kv.block_size(),
            sources: Vec::new(),
        };
        for req in running.iter().filter_map(|id| requests.get(id)) {
            in_flight.add(req, kv);
        }
        in_flight
    }

    /// Counts `req` in if it is computing its prompt's full blocks.
    fn add(&mut self, req: &Request, kv: &KvCacheManager) {
        let full = req.prompt_len() / self.block_size.max(1);
        if !kv.prefix_caching_enabled() || req.num_computed_tokens >= full * self.block_size {
            return;
        }
        self.sources.push(PrefixSource {
            hashes: req.prompt_block_hashes(self.block_size).to_vec(),
            computed: req.num_computed_tokens,
            scored: req
                .params
                .prompt_logprobs
                .filter(|_| req.scores_prompt_only()),
        });
    }

    /// Whether `req`, not started yet, would take more of its prompt from the cache
    /// once a running request has computed it.
    fn computes_a_prefix_of(&self, req: &Request) -> bool {
        if self.sources.is_empty() || req.num_computed_tokens > 0 {
            return false;
        }
        // What a hit serves it: its KV (it computes no prompt rows), or its KV and
        // prompt logprobs (then only a source keeping them with as many alternatives or more).
        let wants_scores = if !req.computes_every_position() {
            None
        } else if req.scores_prompt_only() && req.prompt_logprobs.is_empty() {
            req.params.prompt_logprobs
        } else {
            return false;
        };
        // A hit leaves at least the prompt's last token to compute.
        let usable = req.prompt_len().saturating_sub(1) / self.block_size.max(1);
        let mine = &req.prompt_block_hashes(self.block_size)[..usable];
        self.sources.iter().any(|source| {
            if wants_scores.is_some_and(|k| source.scored.is_none_or(|kept| kept < k)) {
                return false;
            }
            let shared = mine
                .iter()
                .zip(&source.hashes)
                .take_while(|(a, b)| a == b)
                .count();
            shared > 0 && source.computed < shared * self.block_size
        })
    }
}

/// Takes the prefix-cache hit of a request that wants prompt logprobs, as far as the
/// records hold its prompt's rows: each cached token then has its row from them, and the
/// first token computed is scored by the first row computed. Whether it took any.
fn take_scored_hit(
    id: RequestId,
    req: &mut Request,
    kv: &mut KvCacheManager,
    scored: &ScoredBlocks,
) -> bool {
    let Some(top) = req.params.prompt_logprobs else {
        return false;
    };
    let mut known = scored.known(req.prompt(), top, req.cache_keys());
    if known.is_empty() {
        return false;
    }
    // A hit of n tokens needs the rows of tokens 1..=n (token n is scored by the row of
    // position n - 1, which the hit does not compute): at most `known.len()` tokens,
    // which a lookup over one token more allows.
    let lookup = req.token_seq().prefix(known.len() + 1);
    let cached = kv.get_computed_blocks(id, lookup, req.cache_keys());
    if cached == 0 {
        return false;
    }
    known.truncate(cached);
    req.prompt_logprobs = known;
    req.num_computed_tokens = cached;
    if req.status == RequestStatus::Waiting {
        req.num_cached_prompt_tokens = cached;
    }
    true
}

/// Whether a waiting sibling should keep waiting for its leader: the leader is running
/// and has not finished computing the prompt yet. Once the leader's prompt is in (or the
/// leader is gone or preempted), the sibling is admitted and finds the prompt's full
/// blocks in the prefix cache.
fn waits_for_leader(
    id: RequestId,
    requests: &mut HashMap<RequestId, Request>,
    kv: &KvCacheManager,
) -> bool {
    let Some(leader) = requests
        .get(&id)
        .filter(|r| !r.computes_every_position())
        .and_then(|r| r.prompt_leader)
    else {
        return false;
    };
    let waiting = kv.prefix_caching_enabled()
        && requests.get(&leader).is_some_and(|l| {
            matches!(l.status, RequestStatus::Running | RequestStatus::Waiting)
                && l.num_computed_tokens < l.prompt_len()
        });
    if !waiting {
        if let Some(r) = requests.get_mut(&id) {
            r.prompt_leader = None;
        }
    }
    waiting
}
