//! The two socket options that turn kernel TLS on for a connected TCP socket: the "tls"
//! upper-layer protocol (`TCP_ULP`), then one direction's record keys (`TLS_TX` / `TLS_RX`
//! at level `SOL_TLS`). The only unsafe code of kernel TLS: the `setsockopt` calls. Every
//! constant and layout below is copied from the header named next to it (Debian bookworm's
//! linux-libc-dev and libc6-dev), not from memory.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use zeroize::Zeroize;

/// `SOL_TCP`, /usr/include/netinet/tcp.h: `# define SOL_TCP 6`.
const SOL_TCP: libc::c_int = 6;
/// `TCP_ULP`, /usr/include/linux/tcp.h: `#define TCP_ULP 31`.
const TCP_ULP: libc::c_int = 31;
/// `SOL_TLS`, /usr/include/x86_64-linux-gnu/bits/socket.h: `#define SOL_TLS 282`.
const SOL_TLS: libc::c_int = 282;
/// /usr/include/linux/tls.h: `#define TLS_TX 1`, `#define TLS_RX 2`.
const TLS_TX: libc::c_int = 1;
const TLS_RX: libc::c_int = 2;
/// /usr/include/linux/tls.h: `TLS_1_3_VERSION` = `TLS_VERSION_NUMBER(TLS_1_3)` =
/// (`TLS_1_3_VERSION_MAJOR` 0x3 << 8) | `TLS_1_3_VERSION_MINOR` 0x4.
const TLS_1_3_VERSION: u16 = (0x3 << 8) | 0x4;
/// /usr/include/linux/tls.h: `#define TLS_CIPHER_AES_GCM_128 51`, `... _256 52`.
const TLS_CIPHER_AES_GCM_128: u16 = 51;
const TLS_CIPHER_AES_GCM_256: u16 = 52;
/// /usr/include/linux/tls.h: `TLS_CIPHER_AES_GCM_{128,256}_IV_SIZE 8`, `_SALT_SIZE 4`,
/// `_REC_SEQ_SIZE 8`, `TLS_CIPHER_AES_GCM_128_KEY_SIZE 16`, `..._256_KEY_SIZE 32`.
pub const IV_SIZE: usize = 8;
pub const SALT_SIZE: usize = 4;
const REC_SEQ_SIZE: usize = 8;

/// `struct tls_crypto_info` (/usr/include/linux/tls.h).
#[repr(C)]
struct TlsCryptoInfo {
    version: u16,
    cipher_type: u16,
}

/// `struct tls12_crypto_info_aes_gcm_128` / `_256` (/usr/include/linux/tls.h): the same
/// layout but for the key's length (all fields are byte arrays after the two u16s, so
/// there is no padding).
#[repr(C)]
struct AesGcmCryptoInfo<const KEY: usize> {
    info: TlsCryptoInfo,
    iv: [u8; IV_SIZE],
    key: [u8; KEY],
    salt: [u8; SALT_SIZE],
    rec_seq: [u8; REC_SEQ_SIZE],
}

impl<const KEY: usize> Drop for AesGcmCryptoInfo<KEY> {
    fn drop(&mut self) {
        self.iv.zeroize();
        self.key.zeroize();
        self.salt.zeroize();
    }
}

/// Which way a key protects records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Transmit,
    Receive,
}

/// One direction's record protection: the AEAD key, the 4-byte salt and 8-byte explicit
/// part of TLS 1.3's 12-byte write IV, and the record sequence number to start at.
pub enum CryptoInfo {
    Aes128Gcm {
        key: [u8; 16],
        salt: [u8; SALT_SIZE],
        iv: [u8; IV_SIZE],
    },
    Aes256Gcm {
        key: [u8; 32],
        salt: [u8; SALT_SIZE],
        iv: [u8; IV_SIZE],
    },
}

impl Drop for CryptoInfo {
    fn drop(&mut self) {
        match self {
            Self::Aes128Gcm { key, salt, iv } => {
                key.zeroize();
                salt.zeroize();
                iv.zeroize();
            }
            Self::Aes256Gcm { key, salt, iv } => {
                key.zeroize();
                salt.zeroize();
                iv.zeroize();
            }
        }
    }
}

impl std::fmt::Debug for CryptoInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Aes128Gcm { .. } => "CryptoInfo(AES-128-GCM)",
            Self::Aes256Gcm { .. } => "CryptoInfo(AES-256-GCM)",
        })
    }
}

/// Attaches the "tls" upper-layer protocol. Until a direction's keys are set the socket
/// still carries plain bytes, so a failure here leaves it usable as it was. ENOENT: the
/// kernel has no `tls` module (and could not load one).
pub fn attach_tls_ulp(fd: BorrowedFd<'_>) -> io::Result<()> {
    const NAME: &[u8] = b"tls";
    // SAFETY: `fd` is an open socket for the call's duration; the value is NAME's bytes with
    // their length (the kernel copies at most that many, no terminator needed).
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            SOL_TCP,
            TCP_ULP,
            NAME.as_ptr().cast(),
            NAME.len() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Gives the kernel one direction's TLS 1.3 record keys, starting at record sequence
/// number `seq`. From then on the kernel encrypts what is written (Transmit) or decrypts
/// what is read (Receive).
pub fn set_crypto(
    fd: BorrowedFd<'_>,
    direction: Direction,
    info: &CryptoInfo,
    seq: u64,
) -> io::Result<()> {
    let name = match direction {
        Direction::Transmit => TLS_TX,
        Direction::Receive => TLS_RX,
    };
    match info {
        CryptoInfo::Aes128Gcm { key, salt, iv } => set(
            fd,
            name,
            &AesGcmCryptoInfo {
                info: TlsCryptoInfo {
                    version: TLS_1_3_VERSION,
                    cipher_type: TLS_CIPHER_AES_GCM_128,
                },
                iv: *iv,
                key: *key,
                salt: *salt,
                rec_seq: seq.to_be_bytes(),
            },
        ),
        CryptoInfo::Aes256Gcm { key, salt, iv } => set(
            fd,
            name,
            &AesGcmCryptoInfo {
                info: TlsCryptoInfo {
                    version: TLS_1_3_VERSION,
                    cipher_type: TLS_CIPHER_AES_GCM_256,
                },
                iv: *iv,
                key: *key,
                salt: *salt,
                rec_seq: seq.to_be_bytes(),
            },
        ),
    }
}

fn set<const KEY: usize>(
    fd: BorrowedFd<'_>,
    name: libc::c_int,
    value: &AesGcmCryptoInfo<KEY>,
) -> io::Result<()> {
    // SAFETY: `fd` is an open socket; `value` is a live #[repr(C)] struct with the kernel's
    // layout for its cipher, passed with its exact size.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            SOL_TLS,
            name,
            (value as *const AesGcmCryptoInfo<KEY>).cast(),
            std::mem::size_of::<AesGcmCryptoInfo<KEY>>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sizes the kernel checks `optlen` against (tls_main.c: `sizeof(struct
    /// tls12_crypto_info_aes_gcm_128)` etc.): 4 + 8 + 16 + 4 + 8 and 4 + 8 + 32 + 4 + 8.
    #[test]
    fn crypto_info_layouts_have_the_kernel_sizes() {
        assert_eq!(std::mem::size_of::<AesGcmCryptoInfo<16>>(), 40);
        assert_eq!(std::mem::size_of::<AesGcmCryptoInfo<32>>(), 56);
        assert_eq!(std::mem::offset_of!(AesGcmCryptoInfo<16>, iv), 4);
        assert_eq!(std::mem::offset_of!(AesGcmCryptoInfo<16>, key), 12);
        assert_eq!(std::mem::offset_of!(AesGcmCryptoInfo<16>, salt), 28);
        assert_eq!(std::mem::offset_of!(AesGcmCryptoInfo<16>, rec_seq), 32);
        assert_eq!(std::mem::offset_of!(AesGcmCryptoInfo<32>, salt), 44);
    }
}
