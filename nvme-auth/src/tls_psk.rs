//! NVMe/TCP secure channels: the pre-shared keys of TLS 1.3 (NVMe/TCP transport
//! specification section 3.6, TP 8011 and TP 8018), as the Linux host's tools make them.
//!
//! An admin configures a PSK in the interchange format `NVMeTLSkey-1:HH:<base64>:` (what
//! `nvme gen-tls-key` prints): 32 or 48 key bytes and their CRC-32, `HH` saying how the key is
//! turned into the *retained* PSK (`00`: used as it is; `01`: HKDF with SHA-256; `02`: with
//! SHA-384). From the retained PSK and the two NQNs both sides derive the *TLS PSK* that the
//! handshake uses, and the host names it with the *PSK identity* it sends in its ClientHello:
//!
//! - `NVMe0R<hh> <hostnqn> <subnqn>` (identity version 0, what the Linux host asks its
//!   keyring for by default; `nvme gen-tls-key --insert` makes it);
//! - `NVMe1R<hh> <hostnqn> <subnqn> <digest>` (version 1, TP 8018; `--identity=1`), the
//!   digest being base64(HMAC(retained PSK, hostnqn " " subnqn " NVMe-over-Fabrics")).
//!
//! `hh` is the hash of the cipher suite the PSK goes with: `01` SHA-256
//! (`TLS_AES_128_GCM_SHA256`), `02` SHA-384 (`TLS_AES_256_GCM_SHA384`).
//!
//! The derivations follow libnvme's `src/nvme/linux.c` (`derive_retained_key`,
//! `derive_psk_digest`, `derive_tls_key`, `gen_tls_identity`), since the keys the Linux host
//! uses are the ones nvme-cli puts into its `.nvme` keyring. libnvme computed
//! HKDF-Expand-Label without RFC 8446's length prefixes of label and context, and with the
//! output length in host (little-endian) byte order, until August 2025 (libnvme PR #1051,
//! "Fixup HKDF-Expand-Label algorithm"), which made the RFC 8446 form the default and kept
//! the old one as "compat". Hosts whose nvme-cli predates that fix (Debian trixie's among
//! them) therefore derive other keys from the same configured PSK; [`LabelEncoding`] picks
//! the form per host.
//!
//! Nothing here prints a key: `Debug` shows lengths and hashes only.

use base64::Engine;
use zeroize::Zeroizing;

use super::hash::HashFunction;
use super::secret::crc32;

const PREFIX: &str = "NVMeTLSkey-1:";
/// The seed both the PSK digest and DH-HMAC-CHAP's transformation append.
const NVME_OVER_FABRICS: &[u8] = b"NVMe-over-Fabrics";

/// Why a PSK or an identity was refused. Messages never contain key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PskError {
    #[error("does not start with {PREFIX}")]
    Prefix,
    #[error("hash indicator {0:?} is not 00, 01 or 02")]
    HashIndicator(String),
    #[error("the key is not valid base64")]
    Base64,
    #[error("the key decodes to {decoded} bytes; {expected} (the key and its CRC-32) expected")]
    Length {
        decoded: usize,
        expected: &'static str,
    },
    #[error("the key's CRC-32 does not match (mistyped or truncated?)")]
    Crc,
    #[error("not an NVMe/TCP PSK identity (NVMe<0|1>R<01|02> <hostnqn> <subnqn> [<digest>])")]
    Identity,
}

/// The hash a TLS PSK goes with, as PSK identities and interchange keys number it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PskHash {
    /// `01`: SHA-256, cipher suite `TLS_AES_128_GCM_SHA256`.
    Sha256,
    /// `02`: SHA-384, cipher suite `TLS_AES_256_GCM_SHA384`.
    Sha384,
}

impl PskHash {
    /// The two-digit number in identities and keys.
    pub fn id(self) -> u8 {
        match self {
            Self::Sha256 => 1,
            Self::Sha384 => 2,
        }
    }

    pub fn from_id(id: u8) -> Option<Self> {
        match id {
            1 => Some(Self::Sha256),
            2 => Some(Self::Sha384),
            _ => None,
        }
    }

    /// Key and digest length in bytes.
    pub fn key_len(self) -> usize {
        self.hash().digest_len()
    }

    /// The IANA name of the TLS 1.3 cipher suite this PSK is used with.
    pub fn cipher_suite(self) -> &'static str {
        match self {
            Self::Sha256 => "TLS_AES_128_GCM_SHA256",
            Self::Sha384 => "TLS_AES_256_GCM_SHA384",
        }
    }

    fn hash(self) -> HashFunction {
        match self {
            Self::Sha256 => HashFunction::Sha256,
            Self::Sha384 => HashFunction::Sha384,
        }
    }

    fn for_key_len(len: usize) -> Option<Self> {
        [Self::Sha256, Self::Sha384]
            .into_iter()
            .find(|h| h.key_len() == len)
    }
}

/// How HKDF-Expand-Label's info is laid out (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LabelEncoding {
    /// RFC 8446 section 7.1: big-endian length, then label and context each with a length
    /// byte. The NVMe/TCP specification's form; libnvme's since August 2025.
    #[default]
    Rfc8446,
    /// libnvme before August 2025: the length as two little-endian bytes, then "tls13 ",
    /// the label and the context with no length bytes.
    LibnvmeCompat,
}

impl LabelEncoding {
    /// The configuration name: `rfc8446` or `libnvme-compat`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Rfc8446 => "rfc8446",
            Self::LibnvmeCompat => "libnvme-compat",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Rfc8446, Self::LibnvmeCompat]
            .into_iter()
            .find(|e| e.name() == name)
    }

    fn info(self, length: usize, label: &str, context: &[u8]) -> Vec<u8> {
        let length = u16::try_from(length).unwrap_or(u16::MAX);
        let label = format!("tls13 {label}");
        let mut info = Vec::with_capacity(4 + label.len() + context.len());
        match self {
            Self::Rfc8446 => {
                info.extend_from_slice(&length.to_be_bytes());
                // Labels and contexts here are short (an NQN is at most 223 bytes).
                info.push(u8::try_from(label.len()).unwrap_or(u8::MAX));
                info.extend_from_slice(label.as_bytes());
                info.push(u8::try_from(context.len()).unwrap_or(u8::MAX));
            }
            Self::LibnvmeCompat => {
                info.extend_from_slice(&length.to_le_bytes());
                info.extend_from_slice(label.as_bytes());
            }
        }
        info.extend_from_slice(context);
        info
    }
}

/// HKDF-Extract with the zero salt, then HKDF-Expand-Label (RFC 5869, RFC 8446 7.1).
fn hkdf_expand_label(
    hash: HashFunction,
    encoding: LabelEncoding,
    input_key: &[u8],
    label: &str,
    context: &[u8],
    length: usize,
) -> Zeroizing<Vec<u8>> {
    let zero_salt = vec![0u8; hash.digest_len()];
    let prk = hash.hmac(&zero_salt, &[input_key]);
    let info = encoding.info(length, label, context);
    let mut out = Zeroizing::new(Vec::with_capacity(length));
    let mut block: Zeroizing<Vec<u8>> = Zeroizing::new(Vec::new());
    let mut counter = 1u8;
    while out.len() < length {
        block = hash.hmac(&prk, &[&block, &info, &[counter]]);
        let take = (length - out.len()).min(block.len());
        out.extend_from_slice(&block[..take]);
        counter = counter.wrapping_add(1);
    }
    out
}

/// A configured PSK (`NVMeTLSkey-1:HH:...:`). `Debug` never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct ConfiguredPsk {
    /// `HH`: the hash that turns it into the retained PSK, `None` for `00`.
    transform: Option<PskHash>,
    key: Zeroizing<Vec<u8>>,
}

impl std::fmt::Debug for ConfiguredPsk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ConfiguredPsk({} bytes, {:02})",
            self.key.len(),
            self.transform.map_or(0, PskHash::id)
        )
    }
}

impl ConfiguredPsk {
    /// Parses `NVMeTLSkey-1:HH:<base64 of the key and its CRC-32>:` as libnvme's
    /// `nvme_import_tls_key_versioned` does: `01` needs a 32-byte key, `02` a 48-byte one,
    /// `00` either; the CRC-32 (zlib's) follows the key, little-endian.
    pub fn parse(text: &str) -> Result<Self, PskError> {
        let rest = text.trim().strip_prefix(PREFIX).ok_or(PskError::Prefix)?;
        let (indicator, encoded) = rest
            .split_once(':')
            .ok_or_else(|| PskError::HashIndicator(rest.chars().take(2).collect()))?;
        let (transform, expected): (Option<PskHash>, &[usize]) = match indicator {
            "00" => (None, &[32, 48]),
            "01" => (Some(PskHash::Sha256), &[32]),
            "02" => (Some(PskHash::Sha384), &[48]),
            other => return Err(PskError::HashIndicator(other.chars().take(8).collect())),
        };
        let encoded = encoded.strip_suffix(':').unwrap_or(encoded);
        let decoded = Zeroizing::new(
            base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .map_err(|_| PskError::Base64)?,
        );
        let key_len = decoded.len().saturating_sub(4);
        if decoded.len() < 4 || !expected.contains(&key_len) {
            return Err(PskError::Length {
                decoded: decoded.len(),
                expected: if expected.len() == 2 {
                    "36 or 52"
                } else if expected[0] == 32 {
                    "36"
                } else {
                    "52"
                },
            });
        }
        let (key, crc) = decoded.split_at(key_len);
        if crc32(key).to_le_bytes() != crc {
            return Err(PskError::Crc);
        }
        Ok(Self {
            transform,
            key: Zeroizing::new(key.to_vec()),
        })
    }

    /// A PSK from raw bytes (32 or 48), for tests and tools.
    pub fn from_bytes(key: &[u8], transform: Option<PskHash>) -> Result<Self, PskError> {
        let fits = match transform {
            None => PskHash::for_key_len(key.len()).is_some(),
            Some(hash) => hash.key_len() == key.len(),
        };
        if !fits {
            return Err(PskError::Length {
                decoded: key.len() + 4,
                expected: "36 or 52",
            });
        }
        Ok(Self {
            transform,
            key: Zeroizing::new(key.to_vec()),
        })
    }

    /// The interchange text (what `nvme gen-tls-key` prints).
    pub fn to_interchange(&self) -> Zeroizing<String> {
        let mut bytes = Zeroizing::new(self.key.to_vec());
        bytes.extend_from_slice(&crc32(&self.key).to_le_bytes());
        let encoded = base64::engine::general_purpose::STANDARD.encode(&*bytes);
        Zeroizing::new(format!(
            "{PREFIX}{:02}:{encoded}:",
            self.transform.map_or(0, PskHash::id)
        ))
    }

    /// The hash of the cipher suite this PSK goes with: the transform's, or for `00` the
    /// one whose length the key has (libnvme's `default_hmac`).
    pub fn hash(&self) -> PskHash {
        self.transform
            .or_else(|| PskHash::for_key_len(self.key.len()))
            .unwrap_or(PskHash::Sha256)
    }

    /// The retained PSK for `hostnqn`: the key itself for `00`, else
    /// HKDF-Expand-Label(HKDF-Extract(0, key), "HostNQN", hostnqn, key length).
    pub fn retained(&self, hostnqn: &str, encoding: LabelEncoding) -> RetainedPsk {
        let key = match self.transform {
            None => self.key.clone(),
            Some(hash) => hkdf_expand_label(
                hash.hash(),
                encoding,
                &self.key,
                "HostNQN",
                hostnqn.as_bytes(),
                self.key.len(),
            ),
        };
        RetainedPsk {
            hash: self.hash(),
            key,
        }
    }
}

/// A retained PSK (what a host or target keeps for one host NQN).
#[derive(Clone, PartialEq, Eq)]
pub struct RetainedPsk {
    hash: PskHash,
    key: Zeroizing<Vec<u8>>,
}

impl std::fmt::Debug for RetainedPsk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RetainedPsk({:?})", self.hash)
    }
}

impl RetainedPsk {
    pub fn hash(&self) -> PskHash {
        self.hash
    }

    /// The PSK digest of identity version 1: base64(HMAC(retained, hostnqn " " subnqn " "
    /// "NVMe-over-Fabrics")) with the PSK's hash.
    pub fn digest(&self, hostnqn: &str, subnqn: &str) -> String {
        let mac = self.hash.hash().hmac(
            &self.key,
            &[
                hostnqn.as_bytes(),
                b" ",
                subnqn.as_bytes(),
                b" ",
                NVME_OVER_FABRICS,
            ],
        );
        base64::engine::general_purpose::STANDARD.encode(&*mac)
    }

    /// The identity this PSK is offered under, for `version` 0 or 1.
    pub fn identity(&self, version: u8, hostnqn: &str, subnqn: &str) -> PskIdentity {
        PskIdentity {
            version: u8::from(version != 0),
            hash: self.hash,
            hostnqn: hostnqn.to_string(),
            subnqn: subnqn.to_string(),
            digest: (version != 0).then(|| self.digest(hostnqn, subnqn)),
        }
    }

    /// The TLS PSK for `identity`: HKDF-Expand-Label(HKDF-Extract(0, retained),
    /// "nvme-tls-psk", context, L), the context being the whole identity for version 0 and
    /// `<hh> <digest>` for version 1. `None` when the identity names another hash than this
    /// PSK's, or (version 1) a digest that is not this PSK's.
    pub fn tls_psk(&self, identity: &PskIdentity, encoding: LabelEncoding) -> Option<TlsPsk> {
        if identity.hash != self.hash {
            return None;
        }
        let context = match &identity.digest {
            None => identity.to_string(),
            Some(digest) => {
                let expected = self.digest(&identity.hostnqn, &identity.subnqn);
                // Not secret (it is sent in clear), but compare whole strings anyway.
                if *digest != expected {
                    return None;
                }
                format!("{:02} {digest}", self.hash.id())
            }
        };
        let key = hkdf_expand_label(
            self.hash.hash(),
            encoding,
            &self.key,
            "nvme-tls-psk",
            context.as_bytes(),
            self.hash.key_len(),
        );
        Some(TlsPsk {
            hash: self.hash,
            key,
        })
    }
}

/// The key a TLS 1.3 handshake uses as its external PSK.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsPsk {
    hash: PskHash,
    key: Zeroizing<Vec<u8>>,
}

impl std::fmt::Debug for TlsPsk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TlsPsk({:?})", self.hash)
    }
}

impl TlsPsk {
    pub fn hash(&self) -> PskHash {
        self.hash
    }

    pub fn key(&self) -> &[u8] {
        &self.key
    }
}

/// A PSK identity as the host sends it in its ClientHello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PskIdentity {
    /// 0 or 1.
    pub version: u8,
    pub hash: PskHash,
    pub hostnqn: String,
    pub subnqn: String,
    /// Version 1's PSK digest.
    pub digest: Option<String>,
}

impl PskIdentity {
    /// Parses `NVMe0R0H <hostnqn> <subnqn>` or `NVMe1R0H <hostnqn> <subnqn> <digest>`.
    /// Generated PSKs (`G`, from DH-HMAC-CHAP's secure channel concatenation) are refused.
    pub fn parse(bytes: &[u8]) -> Result<Self, PskError> {
        let text = std::str::from_utf8(bytes).map_err(|_| PskError::Identity)?;
        let mut parts = text.split(' ');
        let head = parts.next().ok_or(PskError::Identity)?.as_bytes();
        let (version, hash) = match head {
            [b'N', b'V', b'M', b'e', v @ (b'0' | b'1'), b'R', b'0', h] => (
                v - b'0',
                PskHash::from_id(h.wrapping_sub(b'0')).ok_or(PskError::Identity)?,
            ),
            _ => return Err(PskError::Identity),
        };
        let hostnqn = parts.next().filter(|s| !s.is_empty());
        let subnqn = parts.next().filter(|s| !s.is_empty());
        let (Some(hostnqn), Some(subnqn)) = (hostnqn, subnqn) else {
            return Err(PskError::Identity);
        };
        let digest = match (version, parts.next()) {
            (0, None) => None,
            (1, Some(d)) if !d.is_empty() => Some(d.to_string()),
            _ => return Err(PskError::Identity),
        };
        if parts.next().is_some() {
            return Err(PskError::Identity);
        }
        Ok(Self {
            version,
            hash,
            hostnqn: hostnqn.to_string(),
            subnqn: subnqn.to_string(),
            digest,
        })
    }
}

impl std::fmt::Display for PskIdentity {
    /// libnvme's `gen_tls_identity`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NVMe{}R{:02} {} {}",
            self.version,
            self.hash.id(),
            self.hostnqn,
            self.subnqn
        )?;
        if let Some(digest) = &self.digest {
            write!(f, " {digest}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "tls_psk_tests.rs"]
mod tests;
