//! The beam search itself, apart from the engine: beams, their extension by one step's
//! most likely next tokens, how they end, and how they are ranked.
//!
//! As vLLM's: each step every live beam offers its `2 × width` most likely next tokens;
//! an extension that ends (an end-of-sequence or stop token, a stop string) is set aside
//! as a finished hypothesis, and the `width` most likely of the others live on. At the
//! end the `width` best of the finished and the live beams are the answer, ranked by
//! `cumulative logprob / length^length_penalty`, the length counting the prompt and not
//! counting a final stop token (vLLM's `get_beam_search_score`).
//!
//! Two things make it cheaper than vLLM's loop with the same answer: only the `width`
//! best finished hypotheses are kept (no other can be among the answer), and the search
//! ends once no live beam can outrank them whatever it generates (its logprob only
//! falls, and its length is bounded by `max_tokens`).

use crate::serving::stop::StopMatcher;
use crate::serving::{EndReason, StopReason};
use crate::TokenLogprobs;
use lantern_model::{IncrementalDecoder, ModelTokenizer};
use std::sync::Arc;

/// A request's beam search: how many beams, how their scores weigh length, and when
/// the search may end before `max_tokens`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BeamSearch {
    /// Beams kept per step, and sequences returned (the request's `n`).
    pub width: usize,
    /// vLLM's `length_penalty`: a score is divided by `length^length_penalty`.
    pub length_penalty: f32,
    pub early_stopping: EarlyStopping,
}

/// When a search ends before `max_tokens` (transformers' and vLLM 0.x's
/// `early_stopping`); every way ends it once no beam is live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EarlyStopping {
    /// Once no live beam could outrank the `width` best finished ones whatever it
    /// generates: the answer of running every step (`"never"`, the default).
    #[default]
    Exact,
    /// Once no live beam outranks the `width` best finished ones as it stands
    /// (`false`: transformers' heuristic; a longer beam could still have won).
    Heuristic,
    /// As soon as `width` beams have finished (`true`).
    Finished,
}

impl BeamSearch {
    /// A search that ends early only when that cannot change its answer.
    pub fn new(width: usize, length_penalty: f32) -> Self {
        Self {
            width,
            length_penalty,
            early_stopping: EarlyStopping::Exact,
        }
    }

    /// Next-token alternatives each beam offers per step (vLLM's `2 × beam_width`).
    pub fn alternatives_per_beam(&self) -> usize {
        2 * self.width
    }

    /// vLLM's `get_beam_search_score`: `length` counts the prompt's tokens and the
    /// beam's, less a final stop token.
    pub fn score(&self, cumulative_logprob: f32, length: usize) -> f32 {
        cumulative_logprob / (length.max(1) as f32).powf(self.length_penalty)
    }

    /// The best score a live beam of `cumulative_logprob` at `length` could still reach
    /// by `max_length`: its logprob can only fall, so with a positive penalty the
    /// longest length is the best, and otherwise the shortest.
    fn best_reachable(&self, cumulative_logprob: f32, length: usize, max_length: usize) -> f32 {
        let length = if self.length_penalty > 0.0 {
            max_length
        } else {
            length
        };
        self.score(cumulative_logprob, length)
    }
}

/// How a request's beams end and read: its settings, checked and settled.
#[derive(Debug, Clone)]
pub struct BeamRules {
    pub prompt_tokens: usize,
    /// Tokens a beam generates at most (settled against the context).
    pub max_tokens: usize,
    /// Stop tokens and stop strings end no beam shorter than this.
    pub min_tokens: usize,
    /// Tokens that end a beam: the model's end-of-sequence tokens (unless ignored) and
    /// the request's `stop_token_ids`.
    pub stop_ids: Vec<u32>,
    /// The request's own `stop_token_ids`: a beam they end names its token.
    pub stop_token_ids: Arc<[u32]>,
    pub stop: Arc<[String]>,
    /// vLLM's `include_stop_str_in_output`, for stop strings and stop tokens alike.
    pub include_stop: bool,
    pub skip_special_tokens: bool,
    /// Alternatives per token in the logprobs returned (`None`: no logprobs).
    pub logprobs: Option<usize>,
}

/// Turns a beam's tokens into text one token at a time (the model's tokenizer; tests
/// give a simpler one).
pub trait StepText {
    /// The text the last token of `ids` completes.
    fn piece(
        &self,
        decoder: &mut IncrementalDecoder,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String, String>;
}

impl StepText for ModelTokenizer {
    fn piece(
        &self,
        decoder: &mut IncrementalDecoder,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String, String> {
        decoder
            .step(self, ids, skip_special_tokens)
            .map_err(|e| e.to_string())
    }
}

/// One generated token of a beam, as it will be sent.
#[derive(Debug, Clone)]
pub struct BeamToken {
    pub id: u32,
    /// The text this token releases (stop strings held back and cut as the engine
    /// cuts them).
    pub text: Arc<str>,
    /// When the request asked for logprobs.
    pub logprobs: Option<Arc<TokenLogprobs>>,
}

/// A hypothesis: the tokens generated so far and how likely they are.
#[derive(Debug, Clone)]
pub struct Beam {
    pub tokens: Vec<BeamToken>,
    pub ids: Vec<u32>,
    pub cumulative_logprob: f32,
    /// Set once the beam has ended.
    pub end: Option<(EndReason, Option<StopReason>)>,
    decoder: IncrementalDecoder,
    stop: Option<StopMatcher>,
}

impl Beam {
    fn empty(rules: &BeamRules) -> Self {
        Self {
            tokens: Vec::new(),
            ids: Vec::new(),
            cumulative_logprob: 0.0,
            end: None,
            decoder: IncrementalDecoder::default(),
            stop: StopMatcher::new(&rules.stop, rules.include_stop),
        }
    }

    /// The beam's length as its score counts it.
    fn scored_length(&self, rules: &BeamRules) -> usize {
        let ended_by_token = matches!(
            (&self.end, self.ids.last()),
            (Some((EndReason::Stop, _)), Some(t)) if rules.stop_ids.contains(t)
        );
        rules.prompt_tokens + self.ids.len() - usize::from(ended_by_token)
    }
}

/// One possible next token of a live beam.
struct Extension {
    beam: usize,
    token: u32,
    logprob: f32,
    /// 1 + its place among the beam's alternatives.
    rank: usize,
    cumulative_logprob: f32,
}

/// The beams of one prompt.
pub struct BeamGroup {
    pub search: BeamSearch,
    pub rules: BeamRules,
    live: Vec<Beam>,
    /// The best finished hypotheses, at most `width`, best first.
    ended: Vec<Beam>,
}

impl BeamGroup {
    pub fn new(search: BeamSearch, rules: BeamRules) -> Self {
        let live = if rules.max_tokens == 0 {
            Vec::new()
        } else {
            vec![Beam::empty(&rules)]
        };
        Self {
            search,
            rules,
            live,
            ended: Vec::new(),
        }
    }

    /// The live beams, whose next tokens the next step asks for.
    pub fn live(&self) -> &[Beam] {
        &self.live
    }

    /// Whether the search is over: no live beam left, or (as `early_stopping` says)
    /// none that could outrank the `width` best finished hypotheses.
    pub fn is_done(&self) -> bool {
        if self.live.is_empty() {
            return true;
        }
        if self.ended.len() < self.search.width {
            return false;
        }
        let worst_kept = self.score(&self.ended[self.ended.len() - 1]);
        let max_length = self.rules.prompt_tokens + self.rules.max_tokens;
        self.live.iter().all(|beam| {
            let length = self.rules.prompt_tokens + beam.ids.len();
            let cumulative = beam.cumulative_logprob;
            match self.search.early_stopping {
                EarlyStopping::Exact => {
                    self.search.best_reachable(cumulative, length, max_length) < worst_kept
                }
                EarlyStopping::Heuristic => self.search.score(cumulative, length) <= worst_kept,
                EarlyStopping::Finished => true,
            }
        })
    }

    fn score(&self, beam: &Beam) -> f32 {
        self.search
            .score(beam.cumulative_logprob, beam.scored_length(&self.rules))
    }

    /// Extends the live beams by one token each way their alternatives offer
    /// (`alternatives[i]`: live beam `i`'s most likely next tokens, most likely first).
    pub fn advance(
        &mut self,
        alternatives: &[Vec<(u32, f32)>],
        text: &dyn StepText,
    ) -> Result<(), String> {
        debug_assert_eq!(alternatives.len(), self.live.len());
        let per_beam = self.search.alternatives_per_beam();
        let mut extensions: Vec<Extension> = Vec::new();
        for (i, (beam, alts)) in self.live.iter().zip(alternatives).enumerate() {
            // A stop token cannot be sampled below min_tokens: it extends nothing.
            let may_stop = beam.ids.len() >= self.rules.min_tokens;
            for (rank, &(token, logprob)) in alts.iter().take(per_beam).enumerate() {
                let stops = self.rules.stop_ids.contains(&token);
                if !logprob.is_finite() || (stops && !may_stop) {
                    continue;
                }
                extensions.push(Extension {
                    beam: i,
                    token,
                    logprob,
                    rank: rank + 1,
                    cumulative_logprob: beam.cumulative_logprob + logprob,
                });
            }
        }
        // Most likely first; a stable sort keeps beam order, then alternative order, on ties.
        extensions.sort_by(|a, b| b.cumulative_logprob.total_cmp(&a.cumulative_logprob));
        let mut next: Vec<Beam> = Vec::with_capacity(self.search.width);
        for ext in extensions {
            let parent = &self.live[ext.beam];
            let ends_by_token = self.rules.stop_ids.contains(&ext.token);
            // Past the live beams wanted, only an extension that ends may still count.
            if next.len() == self.search.width && !ends_by_token && self.rules.stop.is_empty() {
                continue;
            }
            let beam = self.extend(parent, &ext, &alternatives[ext.beam], text)?;
            if beam.end.is_some() {
                self.keep_ended(beam);
            } else if next.len() < self.search.width {
                next.push(beam);
            }
        }
        self.live = next;
        Ok(())
    }

    /// A finished hypothesis joins the best ones if it is among them.
    fn keep_ended(&mut self, beam: Beam) {
        let score = self.score(&beam);
        // After every one at least as good: ties keep the earlier.
        let at = self.ended.partition_point(|e| self.score(e) >= score);
        if at < self.search.width {
            self.ended.insert(at, beam);
            self.ended.truncate(self.search.width);
        }
    }

    /// `parent` with one more token: its text released as the engine releases it.
    fn extend(
        &self,
        parent: &Beam,
        ext: &Extension,
        alternatives: &[(u32, f32)],
        text: &dyn StepText,
    ) -> Result<Beam, String> {
        let rules = &self.rules;
        let mut beam = parent.clone();
        beam.ids.push(ext.token);
        beam.cumulative_logprob = ext.cumulative_logprob;
        let generated = beam.ids.len();
        let ends_by_token = rules.stop_ids.contains(&ext.token);
        // A stop token's text is part of the text only when asked for (as the engine).
        let piece = if ends_by_token && !rules.include_stop {
            String::new()
        } else {
            text.piece(&mut beam.decoder, &beam.ids, rules.skip_special_tokens)?
        };
        let (mut piece, matched) = match &mut beam.stop {
            Some(stop) if generated <= rules.min_tokens => (stop.pass(&piece), None),
            Some(stop) => {
                let out = stop.push(&piece);
                (out.text, out.matched)
            }
            None => (piece, None),
        };
        beam.end = if let Some(stop) = matched {
            Some((EndReason::Stop, Some(StopReason::Text(stop))))
        } else if ends_by_token {
            let named = rules.stop_token_ids.contains(&ext.token);
            Some((
                EndReason::Stop,
                named.then_some(StopReason::Token(ext.token)),
            ))
        } else if generated >= rules.max_tokens {
            Some((EndReason::Length, None))
        } else {
            None
        };
        if beam.end.is_some() {
            if let Some(stop) = &mut beam.stop {
                piece.push_str(&stop.flush());
            }
        }
        let logprobs = rules.logprobs.map(|k| {
            Arc::new(TokenLogprobs {
                token_id: ext.token,
                logprob: ext.logprob,
                rank: ext.rank,
                top: alternatives.iter().take(k).copied().collect(),
            })
        });
        beam.tokens.push(BeamToken {
            id: ext.token,
            text: piece.into(),
            logprobs,
        });
        Ok(beam)
    }

    /// The answer: the `width` best of the finished and live beams, best first (fewer
    /// only when the vocabulary offered fewer). The group is empty after it.
    pub fn finish(&mut self) -> Vec<Beam> {
        for mut beam in std::mem::take(&mut self.live) {
            // A beam cut short by the search's end (or the context) ended by length.
            if let Some(stop) = &mut beam.stop {
                let held = stop.flush();
                if let Some(last) = beam.tokens.last_mut() {
                    last.text = format!("{}{held}", last.text).into();
                }
            }
            beam.end = Some((EndReason::Length, None));
            self.keep_ended(beam);
        }
        std::mem::take(&mut self.ended)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One character per token: token `t` reads as `(b'a' + t) as char`.
    struct Letters;

    impl StepText for Letters {
        fn piece(
            &self,
            _: &mut IncrementalDecoder,
            ids: &[u32],
            _: bool,
        ) -> Result<String, String> {
            let t = *ids.last().unwrap();
            Ok(char::from(b'a' + t as u8).to_string())
        }
    }

    /// A made-up model over a small vocabulary: the next-token logprobs after a
    /// sequence come from a hash of it, so that beams disagree.
    fn model(seq: &[u32], vocab: u32) -> Vec<(u32, f32)> {
        let mut h: u64 = 0xcbf29ce484222325;
        for &t in seq {
            h = (h ^ u64::from(t)).wrapping_mul(0x100000001b3);
        }
        let logits: Vec<f32> = (0..vocab)
            .map(|t| {
                let x = (h ^ u64::from(t).wrapping_mul(0x9e3779b97f4a7c15))
                    .wrapping_mul(0xff51afd7ed558ccd);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0
            })
            .collect();
        let max = logits.iter().copied().fold(f32::MIN, f32::max);
        let sum: f32 = logits.iter().map(|l| (l - max).exp()).sum();
        let mut row: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(t, l)| (t as u32, l - max - sum.ln()))
            .collect();
        row.sort_by(|a, b| b.1.total_cmp(&a.1));
        row
    }

    fn rules(prompt: usize, max_tokens: usize, stop_ids: Vec<u32>) -> BeamRules {
        BeamRules {
            prompt_tokens: prompt,
            max_tokens,
            min_tokens: 0,
            stop_ids,
            stop_token_ids: Arc::from([]),
            stop: Arc::from([]),
            include_stop: false,
            skip_special_tokens: true,
            logprobs: None,
        }
    }

    fn run(search: BeamSearch, rules: BeamRules, prompt: &[u32], vocab: u32) -> Vec<Beam> {
        run_counted(search, rules, prompt, vocab).0
    }

    /// The answer and the steps it took.
    fn run_counted(
        search: BeamSearch,
        rules: BeamRules,
        prompt: &[u32],
        vocab: u32,
    ) -> (Vec<Beam>, usize) {
        let mut group = BeamGroup::new(search, rules);
        let mut steps = 0;
        while !group.is_done() {
            steps += 1;
            let alts: Vec<Vec<(u32, f32)>> = group
                .live()
                .iter()
                .map(|b| {
                    let seq: Vec<u32> = prompt.iter().chain(&b.ids).copied().collect();
                    model(&seq, vocab)
                })
                .collect();
            group.advance(&alts, &Letters).unwrap();
        }
        (group.finish(), steps)
    }

    /// vLLM's loop as it is written: every step to `max_tokens`, every finished
    /// hypothesis kept; the answer is the best `width` of them all.
    fn reference(
        search: BeamSearch,
        prompt: &[u32],
        max_tokens: usize,
        eos: u32,
        vocab: u32,
    ) -> Vec<(Vec<u32>, f32)> {
        let score = |tokens: &[u32], cum: f32| {
            let mut len = prompt.len() + tokens.len();
            if tokens.last() == Some(&eos) {
                len -= 1;
            }
            cum / (len as f32).powf(search.length_penalty)
        };
        let mut live: Vec<(Vec<u32>, f32)> = vec![(Vec::new(), 0.0)];
        let mut done: Vec<(Vec<u32>, f32)> = Vec::new();
        for _ in 0..max_tokens {
            let mut next = Vec::new();
            for (tokens, cum) in &live {
                let seq: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
                for &(t, lp) in model(&seq, vocab).iter().take(2 * search.width) {
                    let mut extended = tokens.clone();
                    extended.push(t);
                    if t == eos {
                        done.push((extended, cum + lp));
                    } else {
                        next.push((extended, cum + lp));
                    }
                }
            }
            next.sort_by(|a, b| b.1.total_cmp(&a.1));
            next.truncate(search.width);
            live = next;
            if live.is_empty() {
                break;
            }
        }
        done.extend(live);
        done.sort_by(|a, b| score(&b.0, b.1).total_cmp(&score(&a.0, a.1)));
        done.truncate(search.width);
        done
    }

    #[test]
    fn the_answer_is_vllms_loops_on_random_models() {
        // The cases must reach both ways of ending, and the early end.
        let (mut stopped, mut cut_short) = (0, 0);
        for (width, penalty, vocab, max_tokens) in [
            (1, 1.0, 7, 9),
            (2, 1.0, 6, 12),
            (3, 0.0, 9, 10),
            (4, 2.0, 5, 8),
            (4, -0.5, 11, 7),
            (6, 1.0, 8, 6),
        ] {
            for prompt_seed in 0..6u32 {
                let prompt: Vec<u32> = (0..3).map(|i| (prompt_seed * 7 + i * 3) % vocab).collect();
                let search = BeamSearch::new(width, penalty);
                let eos = 0;
                let (got, steps) = run_counted(
                    search,
                    rules(prompt.len(), max_tokens, vec![eos]),
                    &prompt,
                    vocab,
                );
                let want = reference(search, &prompt, max_tokens, eos, vocab);
                cut_short += usize::from(steps < max_tokens);
                stopped += got
                    .iter()
                    .filter(|b| b.end.as_ref().unwrap().0 == EndReason::Stop)
                    .count();
                let got: Vec<(Vec<u32>, f32)> = got
                    .iter()
                    .map(|b| (b.ids.clone(), b.cumulative_logprob))
                    .collect();
                assert_eq!(got.len(), want.len(), "width {width} prompt {prompt:?}");
                for ((g, gc), (w, wc)) in got.iter().zip(&want) {
                    assert_eq!(g, w, "width {width} penalty {penalty} prompt {prompt:?}");
                    assert!((gc - wc).abs() <= 1e-5 * wc.abs().max(1.0), "{gc} vs {wc}");
                }
            }
        }
        assert!(
            stopped > 10 && cut_short > 3,
            "{stopped} stopped, {cut_short} cut short"
        );
    }

    #[test]
    fn earlier_stops_take_fewer_steps() {
        let (mut heuristic_saves, mut finished_saves) = (0, 0);
        for prompt_seed in 0..12u32 {
            let prompt: Vec<u32> = (0..3).map(|i| (prompt_seed * 5 + i) % 7).collect();
            let steps = |early_stopping| {
                let search = BeamSearch {
                    early_stopping,
                    ..BeamSearch::new(3, 1.0)
                };
                let (beams, steps) = run_counted(search, rules(3, 30, vec![0]), &prompt, 7);
                assert_eq!(beams.len(), 3);
                steps
            };
            let exact = steps(EarlyStopping::Exact);
            let heuristic = steps(EarlyStopping::Heuristic);
            let finished = steps(EarlyStopping::Finished);
            assert!(
                finished <= heuristic && heuristic <= exact,
                "{finished} {heuristic} {exact}"
            );
            heuristic_saves += usize::from(heuristic < exact);
            finished_saves += usize::from(finished < heuristic);
        }
        assert!(heuristic_saves > 0 && finished_saves > 0);
    }

    #[test]
    fn width_one_is_greedy() {
        let prompt = [3, 1, 4];
        let beams = run(BeamSearch::new(1, 1.0), rules(3, 10, vec![]), &prompt, 9);
        let mut seq = prompt.to_vec();
        for _ in 0..10 {
            let next = model(&seq, 9)[0].0;
            seq.push(next);
        }
        assert_eq!(beams[0].ids, seq[3..]);
        assert_eq!(beams[0].end, Some((EndReason::Length, None)));
    }

    #[test]
    fn stop_strings_end_beams_with_the_text_cut() {
        let mut r = rules(2, 12, vec![]);
        // Letters: token 1 reads "b", 2 "c".
        r.stop = Arc::from(["bc".to_string()]);
        let search = BeamSearch::new(3, 1.0);
        let beams = run(search, r.clone(), &[5, 6], 4);
        for beam in &beams {
            let text: String = beam.tokens.iter().map(|t| &*t.text).collect();
            let letters: String = beam
                .ids
                .iter()
                .map(|&t| char::from(b'a' + t as u8))
                .collect();
            match &beam.end {
                Some((EndReason::Stop, Some(StopReason::Text(s)))) => {
                    assert_eq!(s, "bc");
                    assert!(letters.ends_with("bc"), "{letters}");
                    assert_eq!(text, letters[..letters.len() - 2], "the stop string is cut");
                }
                Some((EndReason::Length, None)) => {
                    assert!(!letters.contains("bc"));
                    assert_eq!(text, letters);
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn min_tokens_keeps_stop_tokens_out_of_short_beams() {
        let mut r = rules(2, 6, vec![0, 1]);
        r.min_tokens = 4;
        let beams = run(BeamSearch::new(3, 1.0), r, &[2, 3], 4);
        for beam in &beams {
            assert!(beam.ids.len() >= 4, "{:?}", beam.ids);
            let stops_early = beam.ids[..3].iter().any(|t| *t < 2);
            assert!(!stops_early, "{:?}", beam.ids);
        }
    }

    #[test]
    fn logprobs_name_each_token_with_its_alternatives() {
        let mut r = rules(1, 5, vec![]);
        r.logprobs = Some(2);
        let prompt = [1];
        let beams = run(BeamSearch::new(2, 1.0), r, &prompt, 6);
        for beam in &beams {
            let mut seq = prompt.to_vec();
            let mut sum = 0.0;
            for t in &beam.tokens {
                let lp = t.logprobs.as_ref().unwrap();
                let row = model(&seq, 6);
                assert_eq!(lp.top, row[..2]);
                let at = row.iter().position(|&(id, _)| id == t.id).unwrap();
                assert_eq!(
                    (lp.token_id, lp.logprob, lp.rank),
                    (t.id, row[at].1, at + 1)
                );
                sum += lp.logprob;
                seq.push(t.id);
            }
            assert!((sum - beam.cumulative_logprob).abs() < 1e-5);
        }
    }
}
