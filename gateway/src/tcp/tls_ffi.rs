//! The OpenSSL calls the `openssl` crate does not bind: TLS 1.3's external-PSK server
//! callback (`SSL_CTX_set_psk_find_session_callback`, OpenSSL 1.1.1+) and the `SSL_SESSION`
//! setters that build the session it returns; for the client side of tests and benches, its
//! counterpart `SSL_set_psk_use_session_callback`. The crate binds only the TLS 1.2 PSK
//! callback, which under TLS 1.3 fixes the PSK's hash to SHA-256 (no SHA-384 PSKs) and
//! identities to 256 bytes (an NVMe identity holds two NQNs of up to 223 bytes each);
//! rust-openssl PR #2687 would add these bindings. The only unsafe code of the TLS path.

use std::os::raw::{c_int, c_uchar};
use std::panic::AssertUnwindSafe;

use std::sync::OnceLock;

use foreign_types::ForeignTypeRef;
use nvme_auth::tls_psk::{PskHash, TlsPsk};
use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::ssl::{Ssl, SslContextBuilder, SslRef};
use openssl_sys::{SSL, SSL_CIPHER, SSL_CTX, SSL_SESSION};

/// `SSL_psk_find_session_cb_func` (openssl/ssl.h).
type FindSessionCallback = unsafe extern "C" fn(
    ssl: *mut SSL,
    identity: *const c_uchar,
    identity_len: usize,
    session: *mut *mut SSL_SESSION,
) -> c_int;

/// `SSL_psk_use_session_cb_func` (openssl/ssl.h).
type UseSessionCallback = unsafe extern "C" fn(
    ssl: *mut SSL,
    md: *const openssl_sys::EVP_MD,
    id: *mut *const c_uchar,
    idlen: *mut usize,
    session: *mut *mut SSL_SESSION,
) -> c_int;

extern "C" {
    fn SSL_set_psk_use_session_callback(ssl: *mut SSL, cb: Option<UseSessionCallback>);
    fn SSL_CTX_set_psk_find_session_callback(ctx: *mut SSL_CTX, cb: Option<FindSessionCallback>);
    fn SSL_SESSION_new() -> *mut SSL_SESSION;
    fn SSL_SESSION_free(session: *mut SSL_SESSION);
    fn SSL_SESSION_set1_master_key(
        session: *mut SSL_SESSION,
        key: *const c_uchar,
        len: usize,
    ) -> c_int;
    fn SSL_SESSION_set_cipher(session: *mut SSL_SESSION, cipher: *const SSL_CIPHER) -> c_int;
    fn SSL_SESSION_set_protocol_version(session: *mut SSL_SESSION, version: c_int) -> c_int;
    fn SSL_CIPHER_find(ssl: *mut SSL, id: *const c_uchar) -> *const SSL_CIPHER;
    fn SSL_has_pending(ssl: *const SSL) -> c_int;
}

/// Whether OpenSSL holds bytes it has read and not yet returned, decrypted or not
/// (`SSL_has_pending`, OpenSSL 1.1.0+; the crate binds only `SSL_pending`, which counts
/// decrypted application data alone). Kernel TLS must not take over a socket then.
pub fn has_pending(ssl: &SslRef) -> bool {
    // SAFETY: `ssl` is a live SSL; the call only reads its record layer's state.
    unsafe { SSL_has_pending(ssl.as_ptr()) == 1 }
}

/// The TLS 1.3 cipher suite a PSK's hash goes with (RFC 8446 B.4:
/// TLS_AES_128_GCM_SHA256 = {0x13,0x01}, TLS_AES_256_GCM_SHA384 = {0x13,0x02}).
fn cipher_suite_id(hash: PskHash) -> [u8; 2] {
    match hash {
        PskHash::Sha256 => [0x13, 0x01],
        PskHash::Sha384 => [0x13, 0x02],
    }
}

/// What the callback asks: the TLS PSK for an identity on this connection, or `None`.
pub type PskFinder = fn(&mut SslRef, &[u8]) -> Option<TlsPsk>;

/// Installs `finder` as the context's external-PSK lookup. A statically known function,
/// so the C callback needs no pointer to Rust state (the finder reads its state from the
/// `SSL`'s ex-data).
pub fn set_psk_finder(builder: &mut SslContextBuilder, finder: PskFinder) {
    FINDER.get_or_init(|| finder);
    // SAFETY: `builder` owns a live SSL_CTX; the callback has the C signature OpenSSL
    // declares and never unwinds.
    unsafe { SSL_CTX_set_psk_find_session_callback(builder.as_ptr(), Some(find_session)) }
}

static FINDER: std::sync::OnceLock<PskFinder> = std::sync::OnceLock::new();

/// OpenSSL's contract: return 1 with `*session` set to a new session holding the PSK, 1 with
/// NULL for "no PSK for this identity" (the handshake then fails here: the gateway has no
/// certificate), 0 for a fatal error.
unsafe extern "C" fn find_session(
    ssl: *mut SSL,
    identity: *const c_uchar,
    identity_len: usize,
    session: *mut *mut SSL_SESSION,
) -> c_int {
    if session.is_null() || ssl.is_null() {
        return 0;
    }
    *session = std::ptr::null_mut();
    let identity = if identity.is_null() || identity_len == 0 {
        &[][..]
    } else {
        // SAFETY: OpenSSL passes the identity's bytes and their length.
        std::slice::from_raw_parts(identity, identity_len)
    };
    let Some(finder) = FINDER.get() else {
        return 1;
    };
    // SAFETY: `ssl` is the live connection OpenSSL is handshaking on.
    let ssl_ref = SslRef::from_ptr_mut(ssl);
    let found = std::panic::catch_unwind(AssertUnwindSafe(|| finder(ssl_ref, identity)));
    let psk = match found {
        Ok(Some(psk)) => psk,
        Ok(None) => return 1,
        Err(_) => return 0,
    };
    let new = psk_session(ssl, &psk);
    if new.is_null() {
        return 0;
    }
    *session = new;
    1
}

/// A new TLS 1.3 session holding `psk` with the cipher suite of its hash (the caller owns
/// it), or NULL.
///
/// # Safety
/// `ssl` must be a live SSL.
unsafe fn psk_session(ssl: *mut SSL, psk: &TlsPsk) -> *mut SSL_SESSION {
    let id = cipher_suite_id(psk.hash());
    let cipher = SSL_CIPHER_find(ssl, id.as_ptr());
    if cipher.is_null() {
        return std::ptr::null_mut();
    }
    let new = SSL_SESSION_new();
    if new.is_null() {
        return new;
    }
    let key = psk.key();
    if SSL_SESSION_set1_master_key(new, key.as_ptr(), key.len()) != 1
        || SSL_SESSION_set_cipher(new, cipher) != 1
        || SSL_SESSION_set_protocol_version(new, openssl_sys::TLS1_3_VERSION) != 1
    {
        SSL_SESSION_free(new);
        return std::ptr::null_mut();
    }
    new
}

/// What a client offers: an identity and its TLS PSK (kept in the `SSL`'s ex-data).
struct ClientPsk {
    identity: Vec<u8>,
    psk: TlsPsk,
}

fn client_psk_index() -> Result<Index<Ssl, ClientPsk>, ErrorStack> {
    static INDEX: OnceLock<Index<Ssl, ClientPsk>> = OnceLock::new();
    if let Some(index) = INDEX.get() {
        return Ok(*index);
    }
    let index = Ssl::new_ex_index()?;
    Ok(*INDEX.get_or_init(|| index))
}

/// Makes `ssl` (a client) offer `identity` with `psk` as a TLS 1.3 external PSK, with the
/// cipher suite of the PSK's hash: what the `openssl` crate's TLS 1.2-era client callback
/// cannot do for SHA-384 PSKs. For the client side of tests and benches.
pub fn offer_psk(ssl: &mut SslRef, identity: &[u8], psk: TlsPsk) -> Result<(), ErrorStack> {
    let index = client_psk_index()?;
    ssl.set_ex_data(
        index,
        ClientPsk {
            identity: identity.to_vec(),
            psk,
        },
    );
    // SAFETY: `ssl` is a live SSL; the callback has OpenSSL's C signature and never unwinds.
    unsafe { SSL_set_psk_use_session_callback(ssl.as_ptr(), Some(use_session)) };
    Ok(())
}

/// OpenSSL's contract: return 1 with `*id`/`*idlen` (copied by OpenSSL) and `*session` (owned
/// by OpenSSL from then on) set, or with `*session` NULL for no PSK; 0 for a fatal error.
unsafe extern "C" fn use_session(
    ssl: *mut SSL,
    _md: *const openssl_sys::EVP_MD,
    id: *mut *const c_uchar,
    idlen: *mut usize,
    session: *mut *mut SSL_SESSION,
) -> c_int {
    if ssl.is_null() || id.is_null() || idlen.is_null() || session.is_null() {
        return 0;
    }
    *session = std::ptr::null_mut();
    let Ok(index) = client_psk_index() else {
        return 0;
    };
    // SAFETY: `ssl` is the live connection OpenSSL is handshaking on.
    let ssl_ref = SslRef::from_ptr(ssl);
    let Some(offer) = ssl_ref.ex_data(index) else {
        return 1;
    };
    let new = psk_session(ssl, &offer.psk);
    if new.is_null() {
        return 0;
    }
    *id = offer.identity.as_ptr();
    *idlen = offer.identity.len();
    *session = new;
    1
}
