//! The stable prefix-cache key of a block.
//!
//! The key must be the same in every release and on every machine so that an external,
//! prefix-aware router (and the engine's stored/evicted block events) can compute and
//! compare keys without running lantern. That rules out `std`'s `DefaultHasher`, whose
//! algorithm may change between Rust releases. The function is fixed here:
//!
//! ```text
//! hash(block) = XXH3-128, seed 0, over the bytes
//!     parent         16 bytes: the parent block's hash, or for the first block of a
//!                    sequence the ASCII bytes "LANTERN_KV_ROOT1" (ROOT_PARENT_HASH)
//!     token ids      4 bytes each, u32 little-endian, in sequence order
//!     extra keys     the caller's bytes verbatim (e.g. a cache salt), possibly empty
//! the 16 result bytes are the canonical (big-endian) XXH128 digest: the high 64 bits
//! first, each half big-endian; printed as 32 lowercase hex digits.
//! ```
//!
//! In Python, `xxhash.xxh3_128_digest(parent + struct.pack("<%dI" % n, *tokens) + extra)`
//! gives the same 16 bytes. The extra keys are hashed into *every* block of a request,
//! not only the first, so a block's key alone says which salt produced it.
//!
//! Nothing separates the token bytes from the extra bytes: the layout is unambiguous
//! because every cached block holds exactly `block_size` tokens. Keys from engines with
//! different block sizes are not comparable (they never need to be).

use std::fmt;
use std::str::FromStr;

use crate::error::KvError;
use crate::tokens::TokenSeq;

/// The 16-byte content hash of one full block, chained over its prefix.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 16]);

/// The "parent" of the first block of every sequence. Changing it changes every key, so
/// it names a version of the layout.
pub const ROOT_PARENT_HASH: BlockHash = BlockHash(*b"LANTERN_KV_ROOT1");

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({self})")
    }
}

impl FromStr for BlockHash {
    type Err = KvError;

    /// Parses the 32-hex-digit form that `Display` writes (either case).
    fn from_str(s: &str) -> Result<Self, KvError> {
        let bad = || KvError::InvalidHashHex(s.to_string());
        let bytes = s.as_bytes();
        if bytes.len() != 32 {
            return Err(bad());
        }
        let mut out = [0u8; 16];
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16).ok_or_else(bad)?;
            let lo = (pair[1] as char).to_digit(16).ok_or_else(bad)?;
            out[i] = (hi * 16 + lo) as u8;
        }
        Ok(BlockHash(out))
    }
}

/// The key of one block: XXH3-128 over the parent key (or [`ROOT_PARENT_HASH`]), the
/// token ids as little-endian u32, then `extra_keys` (see the module docs).
pub fn hash_block(parent: Option<&BlockHash>, token_ids: &[u32], extra_keys: &[u8]) -> BlockHash {
    let parent = parent.unwrap_or(&ROOT_PARENT_HASH);
    let mut buf = Vec::with_capacity(16 + 4 * token_ids.len() + extra_keys.len());
    buf.extend_from_slice(&parent.0);
    for t in token_ids {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    buf.extend_from_slice(extra_keys);
    BlockHash(xxhash_rust::xxh3::xxh3_128(&buf).to_be_bytes())
}

/// Chained keys of every *full* block of `token_ids` (a trailing partial block has no
/// key: its content is still changing). A zero block size yields no keys.
pub fn hash_request_blocks(
    token_ids: &[u32],
    block_size: usize,
    extra_keys: &[u8],
) -> Vec<BlockHash> {
    let mut out = Vec::new();
    extend_block_hashes(&mut out, token_ids, block_size, extra_keys);
    out
}

/// Appends the keys of the full blocks of `token_ids` that `hashes` does not cover yet,
/// chaining from its last key, so a growing sequence is hashed once per block.
pub fn extend_block_hashes<'a>(
    hashes: &mut Vec<BlockHash>,
    token_ids: impl Into<TokenSeq<'a>>,
    block_size: usize,
    extra_keys: &[u8],
) {
    if block_size == 0 {
        return;
    }
    let token_ids = token_ids.into();
    let full = token_ids.len() / block_size;
    for i in hashes.len()..full {
        let parent = hashes.last().copied();
        let Some(block) = token_ids.range(i * block_size..(i + 1) * block_size) else {
            break;
        };
        hashes.push(hash_block(parent.as_ref(), &block, extra_keys));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_parent_is_documented_ascii() {
        assert_eq!(&ROOT_PARENT_HASH.0, b"LANTERN_KV_ROOT1");
    }

    /// Pinned values: if this test fails, the key function changed and every external
    /// router and stored event consumer breaks. Do not "fix" the constants.
    #[test]
    fn known_values_are_stable() {
        let first = hash_block(None, &[1, 2, 3, 4], b"");
        assert_eq!(first.to_string(), PINNED_FIRST);
        let second = hash_block(Some(&first), &[5, 6, 7, 8], b"salt");
        assert_eq!(second.to_string(), PINNED_SECOND);
        assert_eq!(
            hash_request_blocks(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, b"")[0],
            first
        );
    }

    // Cross-checked against Python's `xxhash` package with the recipe in the module docs:
    // xxh3_128_digest(b"LANTERN_KV_ROOT1" + struct.pack("<4I", 1, 2, 3, 4)).hex()
    const PINNED_FIRST: &str = "b0619e6eb728679ffc0972599a4e9ef7";
    // xxh3_128_digest(first + struct.pack("<4I", 5, 6, 7, 8) + b"salt").hex()
    const PINNED_SECOND: &str = "28a6ae508b122385e1467ab8fcf8524c";

    #[test]
    fn every_input_changes_the_key() {
        let base = hash_block(None, &[10, 20, 30, 40], b"salt");
        let other_parent = hash_block(Some(&base), &[10, 20, 30, 40], b"salt");
        assert_ne!(base, other_parent);
        assert_ne!(
            base,
            hash_block(Some(&ROOT_PARENT_HASH), &[10, 20, 30, 40], b"x")
        );
        for i in 0..4 {
            let mut t = [10, 20, 30, 40];
            t[i] += 1;
            assert_ne!(base, hash_block(None, &t, b"salt"), "token {i}");
        }
        assert_ne!(base, hash_block(None, &[10, 20, 30, 40], b"salu"));
        assert_ne!(base, hash_block(None, &[10, 20, 30, 40], b""));
        // An explicit root parent is the same as none.
        assert_eq!(
            base,
            hash_block(Some(&ROOT_PARENT_HASH), &[10, 20, 30, 40], b"salt")
        );
    }

    #[test]
    fn request_blocks_chain_and_skip_partial() {
        let tokens: Vec<u32> = (0..10).collect();
        let hs = hash_request_blocks(&tokens, 4, b"s");
        assert_eq!(hs.len(), 2);
        assert_eq!(hs[0], hash_block(None, &tokens[0..4], b"s"));
        assert_eq!(hs[1], hash_block(Some(&hs[0]), &tokens[4..8], b"s"));
        assert!(hash_request_blocks(&tokens, 0, b"").is_empty());
        assert!(hash_request_blocks(&tokens[..3], 4, b"").is_empty());
        // A change in an earlier block changes every later key.
        let mut t2 = tokens.clone();
        t2[0] = 99;
        let hs2 = hash_request_blocks(&t2, 4, b"s");
        assert_ne!(hs[1], hs2[1]);
    }

    #[test]
    fn extend_hashes_incrementally() {
        let tokens: Vec<u32> = (0..13).collect();
        let mut hs = Vec::new();
        extend_block_hashes(&mut hs, &tokens[..5], 4, b"");
        assert_eq!(hs.len(), 1);
        extend_block_hashes(&mut hs, &tokens, 4, b"");
        assert_eq!(hs, hash_request_blocks(&tokens, 4, b""));
    }

    #[test]
    fn hex_round_trips() {
        let h = hash_block(None, &[7], b"");
        let s = h.to_string();
        assert_eq!(s.len(), 32);
        assert_eq!(s.parse::<BlockHash>().unwrap(), h);
        assert_eq!(s.to_uppercase().parse::<BlockHash>().unwrap(), h);
        assert!("xyz".parse::<BlockHash>().is_err());
        assert!("zz".repeat(16).parse::<BlockHash>().is_err());
        assert!(format!("{h:?}").starts_with("BlockHash("));
    }
}
