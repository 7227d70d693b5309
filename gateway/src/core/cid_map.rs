//! Maps keyed by command identifier (CID), on a hot path: a queue looks its in-flight
//! commands up by CID at least twice per I/O.
//!
//! The standard map's SipHash cost ~320 instructions per 4K read at QD1 (callgrind), about
//! 3% of all the gateway does per read. A CID is 16 bits the host chooses, so the DoS
//! resistance SipHash buys is not needed: a host choosing CIDs to collide can only slow its
//! own queue, which holds at most twice its queue size of them. rustc-hash's FxHash (one
//! multiplication; already built here for bindgen) does the job.

/// A map from CID to `V`.
pub type CidMap<V> = rustc_hash::FxHashMap<u16, V>;
