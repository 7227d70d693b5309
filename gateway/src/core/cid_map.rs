//! Maps keyed by command identifier (CID), on a hot path: a queue looks its in-flight
//! commands up by CID at least twice per I/O.
//!
//! The standard map's SipHash cost ~320 instructions per 4K read at QD1 (callgrind), about
//! 3% of all the gateway does per read. A CID is 16 bits the host chooses: a multiplication
//! by an odd constant spreads them over the whole word, so the table's bucket bits (low)
//! and tag bits (high) both vary, and distinct CIDs never share the bucket bits. A host
//! choosing CIDs to collide can only slow its own queue, which holds at most twice its
//! queue size of them.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A map from CID to `V` with [`CidHasher`].
pub type CidMap<V> = HashMap<u16, V, BuildHasherDefault<CidHasher>>;

/// Fibonacci hashing of a CID (see the module docs).
#[derive(Default)]
pub struct CidHasher(u64);

/// 2^64 / the golden ratio, odd.
const MULTIPLIER: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for CidHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u16(&mut self, cid: u16) {
        self.0 = (self.0 ^ u64::from(cid)).wrapping_mul(MULTIPLIER);
    }

    /// Only `u16` keys use this hasher; any other bytes are mixed in the same way.
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(MULTIPLIER);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn distinct_cids_differ_in_the_low_and_high_bits() {
        let build = BuildHasherDefault::<CidHasher>::default();
        let mut low = std::collections::HashSet::new();
        let mut high = std::collections::HashSet::new();
        for cid in 0..1024u16 {
            let h = build.hash_one(cid);
            low.insert(h & 0x3ff);
            high.insert(h >> 57);
        }
        assert_eq!(low.len(), 1024, "1024 CIDs fill 1024 buckets, one each");
        assert_eq!(high.len(), 128, "every 7-bit tag is used");
    }

    #[test]
    fn works_as_a_map() {
        let mut map: CidMap<u32> = CidMap::default();
        for cid in (0..=u16::MAX).step_by(7) {
            map.insert(cid, u32::from(cid) * 2);
        }
        assert_eq!(map.get(&700), Some(&1400));
        assert_eq!(map.remove(&7), Some(14));
        assert_eq!(map.get(&7), None);
        assert_eq!(map.get(&8), None);
    }
}
