//! One large product output kept between steps. The logits of a step that scores a
//! prompt are `rows x vocabulary` (128 MiB for 128 rows of Gemma 3's 262,144), and a
//! fresh buffer that size costs its first touch: 32,768 page faults, about half the
//! time of the product that fills it on 2 cores. Whoever is done with such an output
//! gives it back ([`give_back`]) and the next product of about its size takes it.

use std::sync::Mutex;

/// Outputs below this many values (16 MiB) are left to the allocator.
const LARGE: usize = 4 << 20;
/// Nor is a buffer above this many values (512 MiB) kept while idle.
const KEPT_AT_MOST: usize = 128 << 20;

/// A slot for one buffer.
struct Spare(Mutex<Vec<f32>>);

static SPARE: Spare = Spare::new();

impl Spare {
    const fn new() -> Self {
        Self(Mutex::new(Vec::new()))
    }

    fn take(&self, len: usize) -> Vec<f32> {
        if len >= LARGE {
            if let Ok(mut spare) = self.0.lock() {
                let cap = spare.capacity();
                if cap >= len && cap / 2 <= len {
                    let mut buf = std::mem::take(&mut *spare);
                    buf.clear();
                    return buf;
                }
            }
        }
        Vec::with_capacity(len)
    }

    fn give_back(&self, buf: Vec<f32>) {
        if (LARGE..=KEPT_AT_MOST).contains(&buf.capacity()) {
            if let Ok(mut spare) = self.0.lock() {
                *spare = buf;
            }
        }
    }
}

/// An empty buffer with room for `len` values: the spare one when `len` is large and
/// the spare fits it without wasting more than half of itself.
pub(crate) fn take(len: usize) -> Vec<f32> {
    SPARE.take(len)
}

/// Keeps `buf` for the next large product (dropping the one kept before, if any);
/// small and oversized buffers are just dropped.
pub fn give_back(buf: Vec<f32>) {
    SPARE.give_back(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_buffer_given_back_is_taken_again_by_its_size_only() {
        let spare = Spare::new();
        let kept = |spare: &Spare| spare.0.lock().map(|s| s.capacity()).unwrap_or(0);
        let buf = vec![1f32; 2 * LARGE + 2];
        let ptr = buf.as_ptr();
        spare.give_back(buf);
        assert!(kept(&spare) >= 2 * LARGE + 2);
        // Too small, or less than half the spare's size: a fresh buffer, the spare kept.
        let small = spare.take(16);
        let half = spare.take(LARGE);
        assert!(small.capacity() >= 16 && half.capacity() >= LARGE);
        assert!(kept(&spare) >= 2 * LARGE + 2);
        let again = spare.take(2 * LARGE);
        assert_eq!(again.as_ptr(), ptr);
        assert!(again.is_empty() && again.capacity() >= 2 * LARGE);
        assert_eq!(kept(&spare), 0);
        // Small buffers are not kept.
        spare.give_back(small);
        assert_eq!(kept(&spare), 0);
    }
}
