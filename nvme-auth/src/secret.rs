//! DH-HMAC-CHAP secrets in the `DHHC-1:XX:<base64>:` representation that nvme-cli's
//! `gen-dhchap-key` prints and Linux reads (`drivers/nvme/common/auth.c`), and the
//! transformation each side applies before using one.

use base64::Engine;
use zeroize::Zeroizing;

use super::hash::HashFunction;

const PREFIX: &str = "DHHC-1:";
/// Appended to the NQN in the transformation (17 bytes, no NUL).
const TRANSFORM_SUFFIX: &[u8] = b"NVMe-over-Fabrics";
/// Secret lengths the representation allows (before the 4-byte CRC).
const KEY_LENGTHS: [usize; 3] = [32, 48, 64];

/// Why a secret string was refused. Messages never contain the secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("does not start with {PREFIX}")]
    Prefix,
    #[error("hash indicator {0:?} is not 00, 01, 02 or 03")]
    HashIndicator(String),
    #[error("the key is not valid base64")]
    Base64,
    #[error("the key decodes to {0} bytes; 36, 52 or 68 (a 32, 48 or 64-byte secret and its CRC) expected")]
    Length(usize),
    #[error("the key's CRC-32 does not match (mistyped or truncated?)")]
    Crc,
}

/// A configured secret: the host's (`dhchap_key`, proves the host) or the controller's
/// (`dhchap_ctrl_key`, proves the gateway when the host asks for bidirectional
/// authentication). `Debug` and `Display` never show the key.
#[derive(Clone, PartialEq, Eq)]
pub struct DhchapSecret {
    /// `XX`: the hash that transforms the secret before use, `None` for `00`.
    transform: Option<HashFunction>,
    key: Zeroizing<Vec<u8>>,
}

impl std::fmt::Debug for DhchapSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DhchapSecret({} bytes, {})",
            self.key.len(),
            self.indicator()
        )
    }
}

impl DhchapSecret {
    /// Parses `DHHC-1:XX:<base64 of the secret and its CRC-32>:` (the trailing colon may be
    /// left out, as Linux allows).
    pub fn parse(text: &str) -> Result<Self, SecretError> {
        let rest = text
            .trim()
            .strip_prefix(PREFIX)
            .ok_or(SecretError::Prefix)?;
        let (indicator, encoded) = rest
            .split_once(':')
            .ok_or_else(|| SecretError::HashIndicator(rest.chars().take(2).collect()))?;
        let transform = match indicator {
            "00" => None,
            "01" | "02" | "03" => HashFunction::from_id(indicator.as_bytes()[1] - b'0'),
            other => return Err(SecretError::HashIndicator(other.chars().take(8).collect())),
        };
        let encoded = encoded.strip_suffix(':').unwrap_or(encoded);
        let decoded = Zeroizing::new(
            base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .map_err(|_| SecretError::Base64)?,
        );
        let key_len = decoded.len().saturating_sub(4);
        if !KEY_LENGTHS.contains(&key_len) || decoded.len() != key_len + 4 {
            return Err(SecretError::Length(decoded.len()));
        }
        let (key, crc) = decoded.split_at(key_len);
        if crc32(key).to_le_bytes() != crc {
            return Err(SecretError::Crc);
        }
        Ok(Self {
            transform,
            key: Zeroizing::new(key.to_vec()),
        })
    }

    /// The `DHHC-1:XX:...:` text of a secret (what `nvme gen-dhchap-key` prints).
    pub fn to_representation(&self) -> Zeroizing<String> {
        let mut bytes = Zeroizing::new(self.key.to_vec());
        bytes.extend_from_slice(&crc32(&self.key).to_le_bytes());
        let encoded = base64::engine::general_purpose::STANDARD.encode(&bytes);
        Zeroizing::new(format!("{PREFIX}{}:{encoded}:", self.indicator()))
    }

    /// A secret from raw bytes (32, 48 or 64 of them), for tests and tools.
    pub fn from_bytes(key: &[u8], transform: Option<HashFunction>) -> Result<Self, SecretError> {
        if !KEY_LENGTHS.contains(&key.len()) {
            return Err(SecretError::Length(key.len() + 4));
        }
        Ok(Self {
            transform,
            key: Zeroizing::new(key.to_vec()),
        })
    }

    fn indicator(&self) -> String {
        format!("{:02}", self.transform.map_or(0, HashFunction::id))
    }

    /// The key a side uses: the secret itself (`00`), or HMAC-`XX`(secret, NQN ||
    /// "NVMe-over-Fabrics"). The host's secret is transformed with the host NQN, the
    /// controller's with the subsystem NQN (Linux `nvme_auth_transform_key`).
    pub fn transform(&self, nqn: &str) -> Zeroizing<Vec<u8>> {
        match self.transform {
            None => self.key.clone(),
            Some(hash) => hash.hmac(&self.key, &[nqn.as_bytes(), TRANSFORM_SUFFIX]),
        }
    }
}

/// CRC-32 (the IEEE/zlib polynomial, reflected), as the representation's check value.
pub(crate) fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example secret of the NVMe Base specification (section 8.13.5.8), as Linux
    /// reads it: 32 bytes, no transformation.
    const SPEC_EXAMPLE: &str = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";

    #[test]
    fn crc32_check_value() {
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
    }

    #[test]
    fn parses_the_spec_example_and_prints_it_back() {
        let secret = DhchapSecret::parse(SPEC_EXAMPLE).expect("valid");
        assert_eq!(secret.key.len(), 32);
        assert_eq!(secret.transform, None);
        assert_eq!(secret.to_representation().as_str(), SPEC_EXAMPLE);
        // Without the trailing colon too, as Linux takes it.
        let bare = SPEC_EXAMPLE.strip_suffix(':').unwrap_or(SPEC_EXAMPLE);
        assert_eq!(DhchapSecret::parse(bare), Ok(secret.clone()));
        assert!(!format!("{secret:?}").contains("ia6z"));
    }

    #[test]
    fn refuses_what_linux_refuses() {
        assert_eq!(
            DhchapSecret::parse("DHHC-2:00:abcd:"),
            Err(SecretError::Prefix)
        );
        assert!(matches!(
            DhchapSecret::parse("DHHC-1:04:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:"),
            Err(SecretError::HashIndicator(_))
        ));
        assert_eq!(
            DhchapSecret::parse("DHHC-1:00:!!!!:"),
            Err(SecretError::Base64)
        );
        assert_eq!(
            DhchapSecret::parse("DHHC-1:00:AAAA:"),
            Err(SecretError::Length(3))
        );
        // One character changed: the CRC catches it.
        let typo = SPEC_EXAMPLE.replace("ia6z", "ia7z");
        assert_eq!(DhchapSecret::parse(&typo), Err(SecretError::Crc));
    }

    #[test]
    fn every_indicator_with_every_length_round_trips() {
        for transform in [None].into_iter().chain(HashFunction::ALL.map(Some)) {
            for len in KEY_LENGTHS {
                let secret = DhchapSecret::from_bytes(&vec![0x5a; len], transform).expect("len");
                let text = secret.to_representation();
                assert_eq!(DhchapSecret::parse(&text), Ok(secret), "{}", text.as_str());
            }
        }
    }

    /// Transformed as HMAC-SHA-256(secret, "nqn.host" "NVMe-over-Fabrics"), computed with
    /// Python's hmac module: the NQN and the suffix, no NUL between or after them.
    #[test]
    fn transform_is_hmac_over_nqn_and_suffix() {
        let secret = DhchapSecret::from_bytes(&[0x11; 32], Some(HashFunction::Sha256)).unwrap();
        let hex: String = secret
            .transform("nqn.host")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(hex, TRANSFORMED_KAT);
        let plain = DhchapSecret::from_bytes(&[0x11; 32], None).unwrap();
        assert_eq!(plain.transform("nqn.host").as_slice(), &[0x11; 32]);
    }

    const TRANSFORMED_KAT: &str =
        "a0da6024a8fc0760e9a0ddf22996176181b477755691505cc71047d668071559";
}
