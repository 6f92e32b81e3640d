//! Stop strings, matched on the text stream as it is produced.
//!
//! Text that could be the start of a stop string is held back until the next piece shows
//! whether it is one; a matched stop string (and everything after it) never reaches the
//! client, unless `include_stop_str_in_output` asks for the stop string itself.

use std::sync::Arc;

/// What a piece of new text turned into.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutput {
    /// Text safe to send now.
    pub text: String,
    /// The stop string that matched; the request is over.
    pub matched: Option<String>,
}

/// Matches a request's stop strings on its text as it grows.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    /// Shared with the other samples of the request.
    stops: Arc<[String]>,
    include_stop: bool,
    /// Text received but not yet sent: a suffix that may begin a stop string.
    pending: String,
    done: bool,
}

impl StopMatcher {
    /// `None` when there is nothing to match (no non-empty stop strings).
    pub fn new(stops: &Arc<[String]>, include_stop: bool) -> Option<Self> {
        let stops = if stops.iter().any(String::is_empty) {
            stops.iter().filter(|s| !s.is_empty()).cloned().collect()
        } else {
            stops.clone()
        };
        (!stops.is_empty()).then(|| Self {
            stops,
            include_stop,
            pending: String::new(),
            done: false,
        })
    }

    /// Feeds new text; returns what can be sent and whether a stop string matched.
    pub fn push(&mut self, new_text: &str) -> StopOutput {
        if self.done {
            return StopOutput::default();
        }
        self.pending.push_str(new_text);
        // The earliest match wins; at one position, the longest stop string.
        let mut best: Option<(usize, &str)> = None;
        for stop in self.stops.iter() {
            if let Some(pos) = self.pending.find(stop.as_str()) {
                let better = match best {
                    None => true,
                    Some((p, s)) => pos < p || (pos == p && stop.len() > s.len()),
                };
                if better {
                    best = Some((pos, stop));
                }
            }
        }
        if let Some((pos, stop)) = best {
            let end = if self.include_stop {
                pos + stop.len()
            } else {
                pos
            };
            let out = StopOutput {
                text: self.pending[..end].to_string(),
                matched: Some(stop.to_string()),
            };
            self.pending.clear();
            self.done = true;
            return out;
        }
        let keep = self.held_suffix_len();
        let send = self.pending.len() - keep;
        let text = self.pending[..send].to_string();
        self.pending.drain(..send);
        StopOutput {
            text,
            matched: None,
        }
    }

    /// Passes new text on without matching it (and with whatever was held back), as
    /// while a request is short of its `min_tokens`: a stop string can only match in
    /// text that comes later.
    pub fn pass(&mut self, new_text: &str) -> String {
        let mut text = std::mem::take(&mut self.pending);
        text.push_str(new_text);
        text
    }

    /// The text still held back, when the request ends without a match.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of a stop string.
    fn held_suffix_len(&self) -> usize {
        let longest_stop = self.stops.iter().map(String::len).max().unwrap_or(0);
        let min_start = self
            .pending
            .len()
            .saturating_sub(longest_stop.saturating_sub(1));
        for start in min_start..self.pending.len() {
            if !self.pending.is_char_boundary(start) {
                continue;
            }
            let suffix = &self.pending[start..];
            if self
                .stops
                .iter()
                .any(|s| s.len() > suffix.len() && s.starts_with(suffix))
            {
                return self.pending.len() - start;
            }
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], include: bool, pieces: &[&str]) -> (String, Option<String>) {
        let stops: Arc<[String]> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops, include).unwrap();
        let mut out = String::new();
        for p in pieces {
            let o = m.push(p);
            out.push_str(&o.text);
            if o.matched.is_some() {
                return (out, o.matched);
            }
        }
        out.push_str(&m.flush());
        (out, None)
    }

    #[test]
    fn stop_inside_one_piece_is_cut() {
        assert_eq!(
            run(&["\n"], false, &["one", " two\nthree"]),
            ("one two".to_string(), Some("\n".to_string()))
        );
    }

    #[test]
    fn stop_across_pieces_is_held_back_then_cut() {
        let stops: Arc<[String]> = Arc::new(["END".to_string()]);
        let mut m = StopMatcher::new(&stops, false).unwrap();
        assert_eq!(m.push("abc E").text, "abc ");
        assert_eq!(m.push("N").text, "");
        let o = m.push("D and more");
        assert_eq!(o.text, "");
        assert_eq!(o.matched.as_deref(), Some("END"));
    }

    #[test]
    fn false_start_is_released() {
        assert_eq!(
            run(&["END"], false, &["E", "N", "x", " tail"]),
            ("ENx tail".to_string(), None)
        );
    }

    #[test]
    fn include_stop_keeps_the_stop_string() {
        assert_eq!(
            run(&["."], true, &["Hi", ". Bye"]),
            ("Hi.".to_string(), Some(".".to_string()))
        );
    }

    #[test]
    fn earliest_match_wins() {
        assert_eq!(
            run(&["world", "o"], false, &["hello world"]),
            ("hell".to_string(), Some("o".to_string()))
        );
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        assert_eq!(
            run(&["éa"], false, &["ééé", "éb", "éa!"]),
            ("ééééb".to_string(), Some("éa".to_string()))
        );
    }

    #[test]
    fn empty_stops_mean_no_matcher() {
        assert!(StopMatcher::new(&Arc::from([String::new()]), false).is_none());
        assert!(StopMatcher::new(&Arc::from([]), false).is_none());
    }

    #[test]
    fn samples_share_one_stop_list() {
        let stops: Arc<[String]> = Arc::new(["END".to_string(), "STOP".to_string()]);
        let matchers: Vec<_> = (0..4).map(|_| StopMatcher::new(&stops, false)).collect();
        assert_eq!(Arc::strong_count(&stops), 1 + matchers.len());
    }
}
