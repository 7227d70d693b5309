//! The hash functions DH-HMAC-CHAP negotiates (SHA-256, SHA-384, SHA-512), by their
//! identifiers and configuration names, with HMAC and plain digests over ring.

use ring::{digest, hmac};
use zeroize::Zeroizing;

use crate::ids;

/// A hash function of the DH-HMAC-CHAP protocol. The negotiated one keys every response;
/// a secret's `DHHC-1:XX:` names the one that transforms it (see [`super::secret`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashFunction {
    Sha256,
    Sha384,
    Sha512,
}

impl HashFunction {
    /// Strongest first: the default order of preference when negotiating.
    pub const ALL: [HashFunction; 3] = [Self::Sha512, Self::Sha384, Self::Sha256];

    pub fn id(self) -> u8 {
        match self {
            Self::Sha256 => ids::HASH_SHA256,
            Self::Sha384 => ids::HASH_SHA384,
            Self::Sha512 => ids::HASH_SHA512,
        }
    }

    pub fn from_id(id: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|h| h.id() == id)
    }

    /// The name in configuration files and logs: `sha256`, `sha384`, `sha512`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sha256 => "sha256",
            Self::Sha384 => "sha384",
            Self::Sha512 => "sha512",
        }
    }

    /// Parses `sha256` (also Linux nvmet's `hmac(sha256)`), `sha384`, `sha512`.
    pub fn from_name(name: &str) -> Option<Self> {
        let name = name
            .strip_prefix("hmac(")
            .and_then(|n| n.strip_suffix(')'))
            .unwrap_or(name);
        Self::ALL.into_iter().find(|h| h.name() == name)
    }

    /// Digest length in bytes (the messages' `hl`).
    pub fn digest_len(self) -> usize {
        match self {
            Self::Sha256 => 32,
            Self::Sha384 => 48,
            Self::Sha512 => 64,
        }
    }

    fn hmac_algorithm(self) -> hmac::Algorithm {
        match self {
            Self::Sha256 => hmac::HMAC_SHA256,
            Self::Sha384 => hmac::HMAC_SHA384,
            Self::Sha512 => hmac::HMAC_SHA512,
        }
    }

    fn digest_algorithm(self) -> &'static digest::Algorithm {
        match self {
            Self::Sha256 => &digest::SHA256,
            Self::Sha384 => &digest::SHA384,
            Self::Sha512 => &digest::SHA512,
        }
    }

    /// HMAC over the concatenation of `parts`.
    pub fn hmac(self, key: &[u8], parts: &[&[u8]]) -> Zeroizing<Vec<u8>> {
        let key = hmac::Key::new(self.hmac_algorithm(), key);
        let mut context = hmac::Context::with_key(&key);
        for part in parts {
            context.update(part);
        }
        Zeroizing::new(context.sign().as_ref().to_vec())
    }

    pub fn digest(self, data: &[u8]) -> Zeroizing<Vec<u8>> {
        Zeroizing::new(
            digest::digest(self.digest_algorithm(), data)
                .as_ref()
                .to_vec(),
        )
    }
}

impl std::fmt::Display for HashFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn names_and_ids_round_trip() {
        for h in HashFunction::ALL {
            assert_eq!(HashFunction::from_id(h.id()), Some(h));
            assert_eq!(HashFunction::from_name(h.name()), Some(h));
            assert_eq!(HashFunction::from_name(&format!("hmac({h})")), Some(h));
        }
        assert_eq!(HashFunction::from_id(0), None);
        assert_eq!(HashFunction::from_id(4), None);
        assert_eq!(HashFunction::from_name("md5"), None);
    }

    /// RFC 4231 test case 2 ("Jefe"), which every HMAC-SHA-2 implementation reproduces.
    #[test]
    fn hmac_matches_rfc_4231() {
        let data: &[u8] = b"what do ya want for nothing?";
        let (a, b) = data.split_at(9);
        let mac = HashFunction::Sha256.hmac(b"Jefe", &[a, b]);
        assert_eq!(
            hex(&mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(HashFunction::Sha384.hmac(b"Jefe", &[data]).len(), 48);
        assert_eq!(
            hex(&HashFunction::Sha512.hmac(b"Jefe", &[data])),
            "164b7a7bfcf819e2e395fbe73b56e0a387bd64222e831fd610270cd7ea250554\
             9758bf75c05a994a6d034f65f8f0e6fdcaeab1a34d4a6b4b636e070a38bce737"
        );
    }
}
