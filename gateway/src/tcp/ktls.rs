//! Kernel TLS (kTLS) for a secure NVMe/TCP connection: once OpenSSL has completed the TLS
//! 1.3 handshake, the application traffic keys go to the socket (`TLS_TX` / `TLS_RX`) and
//! the queue is served on the socket itself, as on a plain listener: the kernel encrypts
//! and decrypts, no relay task, no loopback pair, no extra copy.
//!
//! OpenSSL's own kTLS (`SSL_OP_ENABLE_KTLS`) needs a socket BIO; tokio-openssl gives it a
//! custom one, so the keys are taken from the key-log callback instead: OpenSSL hands it
//! `CLIENT_TRAFFIC_SECRET_0` and `SERVER_TRAFFIC_SECRET_0` with the connection's client
//! random. They are kept in the connection's `SSL` ex-data until the handshake returns,
//! taken out at once, turned into record keys (RFC 8446 7.3) and dropped (zeroized);
//! they are never logged.
//!
//! The kernel starts both directions at record sequence number 0, which is right only if no
//! record was sent or read under the application keys before the switch. The server sends
//! nothing after its Finished (no NewSessionTicket: `num_tickets` 0), and OpenSSL without
//! read-ahead reads a record's header and then exactly its body, so it stops at the
//! client's Finished; any byte it still holds (`SSL_has_pending`) makes this connection
//! fall back to the relay.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use openssl::ssl::SslRef;
use zeroize::Zeroizing;

use super::ktls_sys::{self, CryptoInfo, Direction, IV_SIZE, SALT_SIZE};

/// kTLS outcomes since start (exported as metrics).
#[derive(Debug, Default)]
pub struct KtlsStats {
    /// Secure connections served by kernel TLS.
    pub ktls: AtomicU64,
    /// Secure connections served through the user-space relay (kTLS not possible).
    pub relay: AtomicU64,
    /// Connections closed because the kernel took one direction's keys but refused the
    /// other's (neither OpenSSL nor the kernel could go on alone).
    pub aborted: AtomicU64,
}

static STATS: KtlsStats = KtlsStats {
    ktls: AtomicU64::new(0),
    relay: AtomicU64::new(0),
    aborted: AtomicU64::new(0),
};

pub fn stats() -> &'static KtlsStats {
    &STATS
}

/// The TLS 1.3 cipher suites the gateway allows, with what the kernel calls them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    /// TLS_AES_128_GCM_SHA256, {0x13,0x01} (RFC 8446 B.4).
    Aes128GcmSha256,
    /// TLS_AES_256_GCM_SHA384, {0x13,0x02}.
    Aes256GcmSha384,
}

impl Suite {
    pub fn from_id(id: [u8; 2]) -> Option<Self> {
        match id {
            [0x13, 0x01] => Some(Self::Aes128GcmSha256),
            [0x13, 0x02] => Some(Self::Aes256GcmSha384),
            _ => None,
        }
    }

    fn hkdf(self) -> ring::hkdf::Algorithm {
        match self {
            Self::Aes128GcmSha256 => ring::hkdf::HKDF_SHA256,
            Self::Aes256GcmSha384 => ring::hkdf::HKDF_SHA384,
        }
    }
}

/// The two application traffic secrets of one connection, as the key log gave them.
#[derive(Default)]
pub struct TrafficSecrets {
    client: Option<Zeroizing<Vec<u8>>>,
    server: Option<Zeroizing<Vec<u8>>>,
}

impl std::fmt::Debug for TrafficSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrafficSecrets")
            .field("client", &self.client.is_some())
            .field("server", &self.server.is_some())
            .finish()
    }
}

/// Where the key-log callback leaves a connection's secrets: the callback gets only a
/// shared reference to the `SSL`, hence the lock.
pub type SecretSlot = Mutex<TrafficSecrets>;

/// Takes the secrets out of `slot` (leaving nothing behind).
pub fn take(slot: &SecretSlot) -> TrafficSecrets {
    match slot.lock() {
        Ok(mut s) => std::mem::take(&mut *s),
        Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
    }
}

/// The key-log callback's work: keeps the application traffic secrets of the connection
/// whose client random the line names (always `ssl`'s own; checked so a line can never be
/// matched to another connection), ignores every other line.
pub fn on_keylog_line(ssl: &SslRef, slot: &SecretSlot, line: &str) {
    let mut fields = line.split(' ');
    let (Some(label), Some(random), Some(secret), None) =
        (fields.next(), fields.next(), fields.next(), fields.next())
    else {
        return;
    };
    let client = match label {
        "CLIENT_TRAFFIC_SECRET_0" => true,
        "SERVER_TRAFFIC_SECRET_0" => false,
        _ => return,
    };
    let mut own_random = [0u8; 32];
    let n = ssl.client_random(&mut own_random);
    let Some(line_random) = decode_hex(random) else {
        return;
    };
    if own_random.get(..n) != Some(&line_random[..]) {
        return;
    }
    let Some(secret) = decode_hex(secret) else {
        return;
    };
    let mut slot = match slot.lock() {
        Ok(s) => s,
        Err(poisoned) => poisoned.into_inner(),
    };
    if client {
        slot.client = Some(secret);
    } else {
        slot.server = Some(secret);
    }
}

fn decode_hex(text: &str) -> Option<Zeroizing<Vec<u8>>> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(2) {
        return None;
    }
    let mut out = Zeroizing::new(Vec::with_capacity(bytes.len() / 2));
    for pair in bytes.chunks_exact(2) {
        out.push(nibble(pair[0])? << 4 | nibble(pair[1])?);
    }
    Some(out)
}

/// An output length for ring's HKDF.
struct Len(usize);

impl ring::hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// HKDF-Expand-Label(secret, label, "", length) (RFC 8446 7.1): `secret` is already a
/// pseudorandom key (a traffic secret), so there is no Extract step.
fn expand_label(
    suite: Suite,
    secret: &[u8],
    label: &[u8],
    out: &mut [u8],
) -> Result<(), KtlsError> {
    let length = u16::try_from(out.len()).map_err(|_| KtlsError::Derivation)?;
    let length = length.to_be_bytes();
    let full_label_len = [u8::try_from(6 + label.len()).map_err(|_| KtlsError::Derivation)?];
    // HkdfLabel: uint16 length, opaque label<7..255> = "tls13 " + label, opaque context<0..255>
    // = "" (one zero length byte).
    let info: [&[u8]; 5] = [&length, &full_label_len, b"tls13 ", label, &[0]];
    let prk = ring::hkdf::Prk::new_less_safe(suite.hkdf(), secret);
    prk.expand(&info, Len(out.len()))
        .and_then(|okm| okm.fill(out))
        .map_err(|_| KtlsError::Derivation)
}

/// The record key and the 12-byte write IV of one direction (RFC 8446 7.3), split the
/// way the kernel takes the IV: its first 4 bytes as the salt, the other 8 as the "iv".
pub fn record_protection(suite: Suite, secret: &[u8]) -> Result<CryptoInfo, KtlsError> {
    let mut write_iv = Zeroizing::new([0u8; SALT_SIZE + IV_SIZE]);
    expand_label(suite, secret, b"iv", &mut write_iv[..])?;
    let mut salt = [0u8; SALT_SIZE];
    let mut iv = [0u8; IV_SIZE];
    salt.copy_from_slice(&write_iv[..SALT_SIZE]);
    iv.copy_from_slice(&write_iv[SALT_SIZE..]);
    // Built in place so the key lives in the zeroize-on-drop CryptoInfo only.
    let mut info = match suite {
        Suite::Aes128GcmSha256 => CryptoInfo::Aes128Gcm {
            key: [0; 16],
            salt,
            iv,
        },
        Suite::Aes256GcmSha384 => CryptoInfo::Aes256Gcm {
            key: [0; 32],
            salt,
            iv,
        },
    };
    let key: &mut [u8] = match &mut info {
        CryptoInfo::Aes128Gcm { key, .. } => key,
        CryptoInfo::Aes256Gcm { key, .. } => key,
    };
    expand_label(suite, secret, b"key", key)?;
    Ok(info)
}

/// Why kTLS was not set up.
#[derive(Debug, thiserror::Error)]
pub enum KtlsError {
    #[error("the kernel has no TLS upper-layer protocol: {0}")]
    NoUlp(std::io::Error),
    #[error("the kernel refused the {0:?} keys: {1}")]
    Keys(Direction, std::io::Error),
    #[error("cipher suite {0:02x?} is not one kernel TLS is given")]
    Suite([u8; 2]),
    #[error("the key log did not give both application traffic secrets")]
    NoSecrets,
    #[error("OpenSSL holds bytes read past the handshake")]
    Buffered,
    #[error("key derivation failed")]
    Derivation,
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
}

/// What became of a connection's kTLS setup.
#[derive(Debug)]
pub enum Outcome {
    /// Both directions are the kernel's: serve the returned socket (a duplicate of the
    /// TLS stream's; drop the TLS stream without a shutdown).
    Kernel(OwnedFd),
    /// Nothing changed on the socket: go on with OpenSSL (the relay).
    Fallback(KtlsError),
    /// The kernel has one direction and not the other: the connection cannot go on.
    Abort(KtlsError),
}

/// Installs the keys of a completed handshake on `socket`. `buffered`: whether OpenSSL
/// still holds bytes it read (then the receive sequence number is not 0 and the bytes
/// would be lost).
pub fn install(
    socket: &impl AsFd,
    suite_id: [u8; 2],
    secrets: TrafficSecrets,
    buffered: bool,
) -> Outcome {
    if buffered {
        return Outcome::Fallback(KtlsError::Buffered);
    }
    let Some(suite) = Suite::from_id(suite_id) else {
        return Outcome::Fallback(KtlsError::Suite(suite_id));
    };
    let (Some(client), Some(server)) = (&secrets.client, &secrets.server) else {
        return Outcome::Fallback(KtlsError::NoSecrets);
    };
    let keys =
        record_protection(suite, server).and_then(|tx| Ok((tx, record_protection(suite, client)?)));
    drop(secrets);
    let (tx, rx) = match keys {
        Ok(keys) => keys,
        Err(e) => return Outcome::Fallback(e),
    };
    let fd = socket.as_fd();
    let owned = match fd.try_clone_to_owned() {
        Ok(owned) => owned,
        Err(e) => return Outcome::Fallback(e.into()),
    };
    if let Err(e) = ktls_sys::attach_tls_ulp(fd) {
        return Outcome::Fallback(KtlsError::NoUlp(e));
    }
    // With the ULP and no keys the socket still carries the bytes as they are, so a refusal
    // of the first direction leaves OpenSSL's path intact.
    if let Err(e) = ktls_sys::set_crypto(fd, Direction::Transmit, &tx, 0) {
        return Outcome::Fallback(KtlsError::Keys(Direction::Transmit, e));
    }
    if let Err(e) = ktls_sys::set_crypto(fd, Direction::Receive, &rx, 0) {
        return Outcome::Abort(KtlsError::Keys(Direction::Receive, e));
    }
    Outcome::Kernel(owned)
}

/// Counts an outcome, and says once per process (at info) which path secure connections
/// take, with the reason when it is the relay.
pub fn note(outcome: &Outcome) {
    static SAID_KERNEL: AtomicBool = AtomicBool::new(false);
    static SAID_RELAY: AtomicBool = AtomicBool::new(false);
    match outcome {
        Outcome::Kernel(_) => {
            STATS.ktls.fetch_add(1, Ordering::Relaxed);
            if !SAID_KERNEL.swap(true, Ordering::Relaxed) {
                tracing::info!("TLS: secure NVMe/TCP connections use kernel TLS");
            }
        }
        Outcome::Fallback(e) => {
            STATS.relay.fetch_add(1, Ordering::Relaxed);
            if !SAID_RELAY.swap(true, Ordering::Relaxed) {
                tracing::info!(reason = %e, "TLS: kernel TLS not used, secure NVMe/TCP connections go through the user-space relay (said once; nvmeof_tls_relay_connections_total counts them)");
            } else {
                tracing::debug!(reason = %e, "TLS: kernel TLS not used for this connection");
            }
        }
        Outcome::Abort(e) => {
            STATS.aborted.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "TLS connection closed: kernel TLS half set up");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(text: &str) -> Vec<u8> {
        decode_hex(text).expect("hex").to_vec()
    }

    fn parts(info: &CryptoInfo) -> (Vec<u8>, Vec<u8>) {
        match info {
            CryptoInfo::Aes128Gcm { key, salt, iv } => {
                (key.to_vec(), [&salt[..], &iv[..]].concat())
            }
            CryptoInfo::Aes256Gcm { key, salt, iv } => {
                (key.to_vec(), [&salt[..], &iv[..]].concat())
            }
        }
    }

    /// RFC 8448 section 3 (Simple 1-RTT Handshake, TLS_AES_128_GCM_SHA256): the published
    /// client and server application traffic secrets ("tls13 c ap traffic", "tls13 s ap
    /// traffic") and the write keys and IVs derived from them ("derive write traffic keys
    /// for application data": key expanded, iv expanded).
    #[test]
    fn record_keys_match_rfc_8448() {
        let server = hex("a11af9f05531f856ad47116b45a950328204b4f44bfb6b3a4b4f1f3fcb631643");
        let client = hex("9e40646ce79a7f9dc05af8889bce6552875afa0b06df0087f792ebb7c17504a5");
        let suite = Suite::from_id([0x13, 0x01]).expect("suite");
        let (key, iv) = parts(&record_protection(suite, &server).expect("derive"));
        assert_eq!(key, hex("9f02283b6c9c07efc26bb9f2ac92e356"));
        assert_eq!(iv, hex("cf782b88dd83549aadf1e984"));
        let (key, iv) = parts(&record_protection(suite, &client).expect("derive"));
        assert_eq!(key, hex("17422dda596ed5d9acd890e3c63f5051"));
        assert_eq!(iv, hex("5b78923dee08579033e523d9"));
    }

    /// TLS_AES_256_GCM_SHA384 takes a 32-byte key from a 48-byte secret (no published
    /// vector in RFC 8448; the VM test proves it against OpenSSL on the wire).
    #[test]
    fn sha384_suite_gives_a_256_bit_key() {
        let suite = Suite::from_id([0x13, 0x02]).expect("suite");
        let info = record_protection(suite, &[7u8; 48]).expect("derive");
        assert!(matches!(info, CryptoInfo::Aes256Gcm { .. }));
        let (key, iv) = parts(&info);
        assert_eq!((key.len(), iv.len()), (32, 12));
        assert_ne!(key, vec![0u8; 32]);
        assert_eq!(
            Suite::from_id([0x13, 0x03]),
            None,
            "ChaCha20 is not allowed"
        );
    }

    /// Only the two application traffic secrets of the line's own connection (its client
    /// random) are kept; other labels, other connections and malformed lines are not.
    #[test]
    fn key_log_keeps_this_connections_application_secrets_only() {
        let ctx = openssl::ssl::SslContext::builder(openssl::ssl::SslMethod::tls_server())
            .expect("context")
            .build();
        let ssl = openssl::ssl::Ssl::new(&ctx).expect("ssl");
        let mut random = [0u8; 32];
        let n = ssl.client_random(&mut random);
        let own: String = random[..n].iter().map(|b| format!("{b:02x}")).collect();
        let other = "ff".repeat(32);
        let slot = SecretSlot::default();
        for line in [
            format!("CLIENT_HANDSHAKE_TRAFFIC_SECRET {own} {}", "11".repeat(32)),
            format!("CLIENT_TRAFFIC_SECRET_0 {other} {}", "22".repeat(32)),
            format!("SERVER_TRAFFIC_SECRET_0 {own} 3x"),
            format!("SERVER_TRAFFIC_SECRET_0 {own} 33 extra"),
            "CLIENT_TRAFFIC_SECRET_0".to_string(),
        ] {
            on_keylog_line(&ssl, &slot, &line);
        }
        let none = take(&slot);
        assert!(none.client.is_none() && none.server.is_none(), "{none:?}");
        on_keylog_line(
            &ssl,
            &slot,
            &format!("CLIENT_TRAFFIC_SECRET_0 {own} {}", "44".repeat(32)),
        );
        on_keylog_line(
            &ssl,
            &slot,
            &format!("SERVER_TRAFFIC_SECRET_0 {own} {}", "55".repeat(48)),
        );
        let got = take(&slot);
        assert_eq!(
            got.client.as_deref().map(Vec::as_slice),
            Some(&[0x44u8; 32][..])
        );
        assert_eq!(
            got.server.as_deref().map(Vec::as_slice),
            Some(&[0x55u8; 48][..])
        );
        let again = take(&slot);
        assert!(
            again.client.is_none() && again.server.is_none(),
            "taken, not copied"
        );
    }

    #[test]
    fn hex_decoding_refuses_what_is_not_hex() {
        assert_eq!(decode_hex("00fF").expect("hex").to_vec(), vec![0, 255]);
        assert!(decode_hex("0").is_none());
        assert!(decode_hex("zz").is_none());
    }

    /// Buffered bytes, an unknown suite or a missing secret leave the socket untouched.
    #[test]
    fn install_falls_back_before_touching_the_socket() {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("socket");
        let full = || TrafficSecrets {
            client: Some(Zeroizing::new(vec![1; 32])),
            server: Some(Zeroizing::new(vec![2; 32])),
        };
        assert!(matches!(
            install(&socket, [0x13, 0x01], full(), true),
            Outcome::Fallback(KtlsError::Buffered)
        ));
        assert!(matches!(
            install(&socket, [0x13, 0x03], full(), false),
            Outcome::Fallback(KtlsError::Suite(_))
        ));
        assert!(matches!(
            install(&socket, [0x13, 0x01], TrafficSecrets::default(), false),
            Outcome::Fallback(KtlsError::NoSecrets)
        ));
    }
}
