//! Buffers a capture fills once and hands over (its maps, megabytes a layer): asked for
//! on transparent huge pages, so that filling them takes a page fault per 2 MiB instead
//! of per 4 KiB. The faults of fresh map buffers were a fifth of finalizing's time.

/// An empty vector with room for `capacity` values. On Linux its whole 2 MiB pages are
/// advised as huge pages (`madvise(MADV_HUGEPAGE)`: honoured where the kernel's
/// transparent huge pages are `always` or `madvise`, ignored otherwise); the vector is
/// an ordinary one either way.
pub(crate) fn vec_to_fill<T>(capacity: usize) -> Vec<T> {
    let v = Vec::with_capacity(capacity);
    #[cfg(target_os = "linux")]
    advise_huge_pages(v.as_ptr() as usize, v.capacity() * size_of::<T>());
    v
}

#[cfg(target_os = "linux")]
fn advise_huge_pages(start: usize, len: usize) {
    const HUGE_PAGE: usize = 2 << 20;
    let first = start.next_multiple_of(HUGE_PAGE);
    let end = start.saturating_add(len) / HUGE_PAGE * HUGE_PAGE;
    if end > first {
        // SAFETY: advice over whole pages inside this allocation; it changes no contents
        // and no mapping. A refusal (old kernel, THP off) leaves ordinary pages.
        unsafe {
            libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_ordinary_vectors_of_the_asked_capacity() {
        for capacity in [0, 1, 1000, 3 << 20] {
            let mut v: Vec<f32> = vec_to_fill(capacity);
            assert!(v.is_empty() && v.capacity() >= capacity);
            v.extend((0..capacity).map(|i| i as f32));
            assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32));
        }
    }
}
