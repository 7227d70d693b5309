//! NVMe/TCP header and data digests.
//!
//! Both digests are CRC32C (Castagnoli polynomial, initial value all ones,
//! final XOR with all ones — the "standard" CRC32C), transmitted in
//! little-endian byte order right after the bytes they cover:
//!
//! * the header digest (HDGST) covers the PDU header, bytes `0..hlen`, and
//!   is placed at `hlen..hlen + 4`;
//! * the data digest (DDGST) covers the PDU data only (not the padding that
//!   precedes it) and is placed in the last four bytes of the PDU.
//!
//! This matches the Linux host (`~crc32c(~0, buf, len)` stored with
//! `cpu_to_le32`). The `crc32c` crate uses SSE4.2 / ARMv8 CRC instructions
//! when the CPU has them.

/// Length in bytes of either digest on the wire.
pub const DIGEST_LEN: usize = 4;

/// CRC32C of `bytes` (the value that goes on the wire, before `to_le_bytes`).
#[inline]
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Header digest of `header` (the `hlen` header bytes).
#[inline]
pub fn header_digest(header: &[u8]) -> u32 {
    crc32c(header)
}

/// Data digest of a contiguous data buffer.
#[inline]
pub fn data_digest(data: &[u8]) -> u32 {
    crc32c(data)
}

/// Data digest over several buffers, as if concatenated.
pub fn data_digest_vectored(parts: &[&[u8]]) -> u32 {
    let mut d = DataDigest::new();
    for p in parts {
        d.update(p);
    }
    d.finish()
}

/// Compare a digest received on the wire (4 little-endian bytes) with the
/// digest of `covered`. Returns `false` if `wire` is not exactly 4 bytes.
#[inline]
pub fn verify(covered: &[u8], wire: &[u8]) -> bool {
    match <[u8; DIGEST_LEN]>::try_from(wire) {
        Ok(w) => u32::from_le_bytes(w) == crc32c(covered),
        Err(_) => false,
    }
}

/// Incremental data digest, for data that is produced or received in
/// pieces (e.g. a C2HData payload gathered from several buffers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DataDigest {
    crc: u32,
}

impl DataDigest {
    /// A digest over zero bytes so far.
    #[inline]
    pub fn new() -> Self {
        Self { crc: 0 }
    }

    /// Feed more data.
    #[inline]
    pub fn update(&mut self, bytes: &[u8]) {
        self.crc = crc32c::crc32c_append(self.crc, bytes);
    }

    /// The digest value over everything fed so far.
    #[inline]
    pub fn finish(&self) -> u32 {
        self.crc
    }

    /// The digest as it appears on the wire.
    #[inline]
    pub fn to_wire(&self) -> [u8; DIGEST_LEN] {
        self.crc.to_le_bytes()
    }
}

/// Append the wire form of `digest` to `out`.
#[inline]
pub fn put_digest(out: &mut Vec<u8>, digest: u32) {
    out.extend_from_slice(&digest.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors() {
        // The CRC-32C check value (RFC 3720 / iSCSI and the usual CRC catalogue).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        // RFC 3720 B.4: 32 bytes of zeros -> aa 36 91 8a on the wire (LE).
        assert_eq!(crc32c(&[0u8; 32]).to_le_bytes(), [0xaa, 0x36, 0x91, 0x8a]);
        // 32 bytes of 0xff -> 43 ab a8 62.
        assert_eq!(
            crc32c(&[0xffu8; 32]).to_le_bytes(),
            [0x43, 0xab, 0xa8, 0x62]
        );
        // 32 incrementing bytes -> 4e 79 dd 46.
        let inc: Vec<u8> = (0u8..32).collect();
        assert_eq!(crc32c(&inc).to_le_bytes(), [0x4e, 0x79, 0xdd, 0x46]);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn incremental_matches_oneshot() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let whole = data_digest(&data);
        for split in [0, 1, 3, 4096, 9999, 10_000] {
            let mut d = DataDigest::new();
            d.update(&data[..split]);
            d.update(&data[split..]);
            assert_eq!(d.finish(), whole, "split at {split}");
        }
        assert_eq!(data_digest_vectored(&[&data[..10], &data[10..]]), whole);
        assert_eq!(DataDigest::new().finish(), 0);
    }

    #[test]
    fn verify_wire() {
        let hdr = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let mut wire = Vec::new();
        put_digest(&mut wire, header_digest(&hdr));
        assert!(verify(&hdr, &wire));
        wire[0] ^= 1;
        assert!(!verify(&hdr, &wire));
        assert!(!verify(&hdr, &wire[..3]));
    }
}
