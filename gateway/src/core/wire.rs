//! Little-endian field writers for the data structures the core builds (Identify data, log
//! pages): every multi-byte NVMe field is little-endian.

pub(crate) fn put_u16(buf: &mut [u8], at: usize, v: u16) {
    buf[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_u32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_u64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Copies `s` into a `len`-byte field, truncated; the rest of the field stays as it was
/// (zero in freshly built pages, which makes NQN and address fields NUL-padded).
pub(crate) fn put_str(buf: &mut [u8], at: usize, len: usize, s: &str) {
    let n = s.len().min(len);
    buf[at..at + n].copy_from_slice(&s.as_bytes()[..n]);
}
