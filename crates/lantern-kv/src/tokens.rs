//! A request's token ids read as one sequence while held in two parts: the prompt,
//! shared by the samples of one request (`n > 1`), and the sample's own output. The
//! prefix cache hashes blocks of the whole sequence without copying the prompt.

use std::borrow::Cow;
use std::ops::Range;

/// Token ids `head` then `tail`, as one sequence.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokenSeq<'a> {
    head: &'a [u32],
    tail: &'a [u32],
}

impl<'a> TokenSeq<'a> {
    pub fn new(head: &'a [u32], tail: &'a [u32]) -> Self {
        Self { head, tail }
    }

    pub fn len(&self) -> usize {
        self.head.len() + self.tail.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `len` tokens (all of them when there are fewer).
    pub fn prefix(self, len: usize) -> Self {
        if len <= self.head.len() {
            Self::new(&self.head[..len], &[])
        } else {
            let tail_len = (len - self.head.len()).min(self.tail.len());
            Self::new(self.head, &self.tail[..tail_len])
        }
    }

    /// Tokens `range`, borrowed when they lie in one part (copied only for the one
    /// range that straddles both); `None` past the end.
    pub fn range(&self, range: Range<usize>) -> Option<Cow<'a, [u32]>> {
        let split = self.head.len();
        if range.start > range.end || range.end > self.len() {
            return None;
        }
        if range.end <= split {
            Some(Cow::Borrowed(&self.head[range]))
        } else if range.start >= split {
            Some(Cow::Borrowed(
                &self.tail[range.start - split..range.end - split],
            ))
        } else {
            let mut joined = self.head[range.start..].to_vec();
            joined.extend_from_slice(&self.tail[..range.end - split]);
            Some(Cow::Owned(joined))
        }
    }
}

impl<'a> From<&'a [u32]> for TokenSeq<'a> {
    fn from(ids: &'a [u32]) -> Self {
        Self::new(ids, &[])
    }
}

impl<'a> From<&'a Vec<u32>> for TokenSeq<'a> {
    fn from(ids: &'a Vec<u32>) -> Self {
        Self::new(ids, &[])
    }
}

impl<'a, const N: usize> From<&'a [u32; N]> for TokenSeq<'a> {
    fn from(ids: &'a [u32; N]) -> Self {
        Self::new(ids, &[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_read_across_the_split_as_one_sequence() {
        let whole: Vec<u32> = (0..10).collect();
        let seq = TokenSeq::new(&whole[..6], &whole[6..]);
        assert_eq!(seq.len(), 10);
        for start in 0..=10 {
            for end in start..=10 {
                assert_eq!(seq.range(start..end).unwrap().as_ref(), &whole[start..end]);
                let prefix = seq.prefix(end);
                assert_eq!(prefix.len(), end);
                assert_eq!(
                    prefix.range(start..end).unwrap().as_ref(),
                    &whole[start..end]
                );
            }
        }
        assert!(matches!(seq.range(0..6), Some(Cow::Borrowed(_))));
        assert!(matches!(seq.range(6..9), Some(Cow::Borrowed(_))));
        assert!(seq.range(3..11).is_none());
        assert_eq!(seq.prefix(50).len(), 10);
    }
}
