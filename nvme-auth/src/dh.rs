//! The finite-field Diffie-Hellman groups of DH-HMAC-CHAP (RFC 7919 ffdhe2048 to ffdhe8192,
//! generator 2), with constant-time modular exponentiation.
//!
//! Each side sends g^x mod p, big-endian and padded to the prime's length, and derives the
//! session key g^xy mod p the same way (Linux `nvme_auth_gen_pubkey`,
//! `nvme_auth_gen_shared_secret`). Private exponents are fresh for every transaction and as
//! long as Linux draws them (`dh_safe_prime_gen_privkey`: 2 x the group's strength, rounded
//! up to a power of two).

use std::sync::OnceLock;

use crypto_bigint::modular::{BoxedMontyForm, BoxedMontyParams};
use crypto_bigint::{BoxedUint, Odd};
use ring::rand::{SecureRandom, SystemRandom};
use zeroize::Zeroizing;

use crate::ids;

/// A Diffie-Hellman group a transaction may use; `Null` runs DH-HMAC-CHAP without one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DhGroup {
    Null,
    Ffdhe2048,
    Ffdhe3072,
    Ffdhe4096,
    Ffdhe6144,
    Ffdhe8192,
}

/// Why a DH computation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DhError {
    #[error("the NULL group has no key exchange")]
    NullGroup,
    #[error("the peer's public value is {got} bytes, {expected} expected")]
    ValueLength { got: usize, expected: usize },
    #[error("the peer's public value is outside 2 ..= p - 2")]
    ValueRange,
    #[error("the system's random number generator failed")]
    Random,
}

impl DhGroup {
    pub const ALL: [DhGroup; 6] = [
        Self::Null,
        Self::Ffdhe2048,
        Self::Ffdhe3072,
        Self::Ffdhe4096,
        Self::Ffdhe6144,
        Self::Ffdhe8192,
    ];

    pub fn id(self) -> u8 {
        match self {
            Self::Null => ids::DHGROUP_NULL,
            Self::Ffdhe2048 => ids::DHGROUP_2048,
            Self::Ffdhe3072 => ids::DHGROUP_3072,
            Self::Ffdhe4096 => ids::DHGROUP_4096,
            Self::Ffdhe6144 => ids::DHGROUP_6144,
            Self::Ffdhe8192 => ids::DHGROUP_8192,
        }
    }

    pub fn from_id(id: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|g| g.id() == id)
    }

    /// The name in configuration files and logs: `null`, `ffdhe2048` ... `ffdhe8192`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Null => "null",
            Self::Ffdhe2048 => "ffdhe2048",
            Self::Ffdhe3072 => "ffdhe3072",
            Self::Ffdhe4096 => "ffdhe4096",
            Self::Ffdhe6144 => "ffdhe6144",
            Self::Ffdhe8192 => "ffdhe8192",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|g| g.name() == name)
    }

    /// Bits of the prime (0 for `Null`).
    fn bits(self) -> u32 {
        match self {
            Self::Null => 0,
            Self::Ffdhe2048 => 2048,
            Self::Ffdhe3072 => 3072,
            Self::Ffdhe4096 => 4096,
            Self::Ffdhe6144 => 6144,
            Self::Ffdhe8192 => 8192,
        }
    }

    /// Length of a public value and of the session key: the prime's (the messages'
    /// `dhvlen`); 0 for `Null`.
    pub fn value_len(self) -> usize {
        self.bits() as usize / 8
    }

    /// Bits of a private exponent: twice the group's security strength (RFC 7919 appendix
    /// A: 112, 128, 152, 176, 200 bits), rounded up to a power of two, as Linux draws them.
    fn private_bits(self) -> u32 {
        match self {
            Self::Null => 0,
            Self::Ffdhe2048 | Self::Ffdhe3072 => 256,
            Self::Ffdhe4096 | Self::Ffdhe6144 | Self::Ffdhe8192 => 512,
        }
    }

    fn prime_hex(self) -> &'static str {
        match self {
            Self::Null => "",
            Self::Ffdhe2048 => FFDHE2048_P,
            Self::Ffdhe3072 => FFDHE3072_P,
            Self::Ffdhe4096 => FFDHE4096_P,
            Self::Ffdhe6144 => FFDHE6144_P,
            Self::Ffdhe8192 => FFDHE8192_P,
        }
    }

    /// The prime, big-endian.
    fn prime_bytes(self) -> Vec<u8> {
        let hex = self.prime_hex().as_bytes();
        hex.chunks(2)
            .map(|pair| (hex_digit(pair[0]) << 4) | hex_digit(pair[1]))
            .collect()
    }

    /// Montgomery parameters of the prime, computed once per group.
    fn params(self) -> Option<&'static BoxedMontyParams> {
        static PARAMS: [OnceLock<Option<BoxedMontyParams>>; 6] = [const { OnceLock::new() }; 6];
        if self == Self::Null {
            return None;
        }
        PARAMS[self.id() as usize]
            .get_or_init(|| {
                let prime = BoxedUint::from_be_slice(&self.prime_bytes(), self.bits()).ok()?;
                Odd::new(prime).into_option().map(BoxedMontyParams::new)
            })
            .as_ref()
    }
}

impl std::fmt::Display for DhGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn hex_digit(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        _ => 0,
    }
}

/// One side's ephemeral key pair for one transaction.
pub struct DhKeyPair {
    group: DhGroup,
    private: BoxedUint,
    public: Vec<u8>,
}

impl std::fmt::Debug for DhKeyPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DhKeyPair")
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl Drop for DhKeyPair {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.private);
    }
}

impl DhKeyPair {
    /// A fresh private exponent from the system's random source, and its public value.
    pub fn generate(group: DhGroup) -> Result<Self, DhError> {
        let bits = group.private_bits();
        if bits == 0 {
            return Err(DhError::NullGroup);
        }
        let mut random = Zeroizing::new(vec![0u8; bits as usize / 8]);
        loop {
            SystemRandom::new()
                .fill(&mut random)
                .map_err(|_| DhError::Random)?;
            // 0 and 1 give public values an eavesdropper knows.
            if random[..random.len() - 1].iter().any(|&b| b != 0) || random[random.len() - 1] > 1 {
                break;
            }
        }
        Self::from_private(group, &random)
    }

    /// The key pair of a given private exponent (big-endian), for known-answer tests.
    pub fn from_private(group: DhGroup, private_be: &[u8]) -> Result<Self, DhError> {
        let params = group.params().ok_or(DhError::NullGroup)?;
        // Whole 64-bit limbs, the precision BoxedUint works in.
        let limbs = private_be.len().div_ceil(8).max(1);
        let mut padded = Zeroizing::new(vec![0u8; limbs * 8]);
        padded[limbs * 8 - private_be.len()..].copy_from_slice(private_be);
        let private = BoxedUint::from_be_slice(&padded, limbs as u32 * 64)
            .map_err(|_| DhError::ValueRange)?;
        let generator =
            BoxedUint::from_be_slice(&[2], group.bits()).map_err(|_| DhError::ValueRange)?;
        let public = BoxedMontyForm::new(generator, params.clone())
            .pow(&private)
            .retrieve()
            .to_be_bytes()
            .to_vec();
        Ok(Self {
            group,
            private,
            public,
        })
    }

    pub fn group(&self) -> DhGroup {
        self.group
    }

    /// g^x mod p, big-endian, as long as the prime.
    pub fn public_value(&self) -> &[u8] {
        &self.public
    }

    /// The session key from the peer's public value: peer^x mod p, big-endian, as long as
    /// the prime. The value must be as long as the prime and in 2 ..= p - 2: 0, 1 and p - 1
    /// would force a key an attacker knows.
    pub fn shared_secret(&self, peer: &[u8]) -> Result<Zeroizing<Vec<u8>>, DhError> {
        let expected = self.group.value_len();
        if peer.len() != expected {
            return Err(DhError::ValueLength {
                got: peer.len(),
                expected,
            });
        }
        let prime = self.group.prime_bytes();
        let mut p_minus_1 = prime.clone();
        if let Some(last) = p_minus_1.last_mut() {
            *last -= 1; // RFC 7919 primes end in FF
        }
        let mut two = vec![0u8; expected];
        two[expected - 1] = 2;
        // Big-endian byte strings of one length compare as the numbers do.
        if peer < two.as_slice() || peer >= p_minus_1.as_slice() {
            return Err(DhError::ValueRange);
        }
        let params = self.group.params().ok_or(DhError::NullGroup)?;
        let value =
            BoxedUint::from_be_slice(peer, self.group.bits()).map_err(|_| DhError::ValueRange)?;
        let shared = BoxedMontyForm::new(value, params.clone())
            .pow(&self.private)
            .retrieve();
        Ok(Zeroizing::new(shared.to_be_bytes().to_vec()))
    }
}

// The RFC 7919 primes, as OpenSSL 3.0 holds them for its named groups ffdhe2048 to ffdhe8192
// (tests check them against key pairs OpenSSL generated).
const FFDHE2048_P: &str = concat!(
    "ffffffffffffffffadf85458a2bb4a9aafdc5620273d3cf1d8b9c583ce2d3695",
    "a9e13641146433fbcc939dce249b3ef97d2fe363630c75d8f681b202aec4617a",
    "d3df1ed5d5fd65612433f51f5f066ed0856365553ded1af3b557135e7f57c935",
    "984f0c70e0e68b77e2a689daf3efe8721df158a136ade73530acca4f483a797a",
    "bc0ab182b324fb61d108a94bb2c8e3fbb96adab760d7f4681d4f42a3de394df4",
    "ae56ede76372bb190b07a7c8ee0a6d709e02fce1cdf7e2ecc03404cd28342f61",
    "9172fe9ce98583ff8e4f1232eef28183c3fe3b1b4c6fad733bb5fcbc2ec22005",
    "c58ef1837d1683b2c6f34a26c1b2effa886b423861285c97ffffffffffffffff",
);
const FFDHE3072_P: &str = concat!(
    "ffffffffffffffffadf85458a2bb4a9aafdc5620273d3cf1d8b9c583ce2d3695",
    "a9e13641146433fbcc939dce249b3ef97d2fe363630c75d8f681b202aec4617a",
    "d3df1ed5d5fd65612433f51f5f066ed0856365553ded1af3b557135e7f57c935",
    "984f0c70e0e68b77e2a689daf3efe8721df158a136ade73530acca4f483a797a",
    "bc0ab182b324fb61d108a94bb2c8e3fbb96adab760d7f4681d4f42a3de394df4",
    "ae56ede76372bb190b07a7c8ee0a6d709e02fce1cdf7e2ecc03404cd28342f61",
    "9172fe9ce98583ff8e4f1232eef28183c3fe3b1b4c6fad733bb5fcbc2ec22005",
    "c58ef1837d1683b2c6f34a26c1b2effa886b4238611fcfdcde355b3b6519035b",
    "bc34f4def99c023861b46fc9d6e6c9077ad91d2691f7f7ee598cb0fac186d91c",
    "aefe130985139270b4130c93bc437944f4fd4452e2d74dd364f2e21e71f54bff",
    "5cae82ab9c9df69ee86d2bc522363a0dabc521979b0deada1dbf9a42d5c4484e",
    "0abcd06bfa53ddef3c1b20ee3fd59d7c25e41d2b66c62e37ffffffffffffffff",
);
const FFDHE4096_P: &str = concat!(
    "ffffffffffffffffadf85458a2bb4a9aafdc5620273d3cf1d8b9c583ce2d3695",
    "a9e13641146433fbcc939dce249b3ef97d2fe363630c75d8f681b202aec4617a",
    "d3df1ed5d5fd65612433f51f5f066ed0856365553ded1af3b557135e7f57c935",
    "984f0c70e0e68b77e2a689daf3efe8721df158a136ade73530acca4f483a797a",
    "bc0ab182b324fb61d108a94bb2c8e3fbb96adab760d7f4681d4f42a3de394df4",
    "ae56ede76372bb190b07a7c8ee0a6d709e02fce1cdf7e2ecc03404cd28342f61",
    "9172fe9ce98583ff8e4f1232eef28183c3fe3b1b4c6fad733bb5fcbc2ec22005",
    "c58ef1837d1683b2c6f34a26c1b2effa886b4238611fcfdcde355b3b6519035b",
    "bc34f4def99c023861b46fc9d6e6c9077ad91d2691f7f7ee598cb0fac186d91c",
    "aefe130985139270b4130c93bc437944f4fd4452e2d74dd364f2e21e71f54bff",
    "5cae82ab9c9df69ee86d2bc522363a0dabc521979b0deada1dbf9a42d5c4484e",
    "0abcd06bfa53ddef3c1b20ee3fd59d7c25e41d2b669e1ef16e6f52c3164df4fb",
    "7930e9e4e58857b6ac7d5f42d69f6d187763cf1d5503400487f55ba57e31cc7a",
    "7135c886efb4318aed6a1e012d9e6832a907600a918130c46dc778f971ad0038",
    "092999a333cb8b7a1a1db93d7140003c2a4ecea9f98d0acc0a8291cdcec97dcf",
    "8ec9b55a7f88a46b4db5a851f44182e1c68a007e5e655f6affffffffffffffff",
);
const FFDHE6144_P: &str = concat!(
    "ffffffffffffffffadf85458a2bb4a9aafdc5620273d3cf1d8b9c583ce2d3695",
    "a9e13641146433fbcc939dce249b3ef97d2fe363630c75d8f681b202aec4617a",
    "d3df1ed5d5fd65612433f51f5f066ed0856365553ded1af3b557135e7f57c935",
    "984f0c70e0e68b77e2a689daf3efe8721df158a136ade73530acca4f483a797a",
    "bc0ab182b324fb61d108a94bb2c8e3fbb96adab760d7f4681d4f42a3de394df4",
    "ae56ede76372bb190b07a7c8ee0a6d709e02fce1cdf7e2ecc03404cd28342f61",
    "9172fe9ce98583ff8e4f1232eef28183c3fe3b1b4c6fad733bb5fcbc2ec22005",
    "c58ef1837d1683b2c6f34a26c1b2effa886b4238611fcfdcde355b3b6519035b",
    "bc34f4def99c023861b46fc9d6e6c9077ad91d2691f7f7ee598cb0fac186d91c",
    "aefe130985139270b4130c93bc437944f4fd4452e2d74dd364f2e21e71f54bff",
    "5cae82ab9c9df69ee86d2bc522363a0dabc521979b0deada1dbf9a42d5c4484e",
    "0abcd06bfa53ddef3c1b20ee3fd59d7c25e41d2b669e1ef16e6f52c3164df4fb",
    "7930e9e4e58857b6ac7d5f42d69f6d187763cf1d5503400487f55ba57e31cc7a",
    "7135c886efb4318aed6a1e012d9e6832a907600a918130c46dc778f971ad0038",
    "092999a333cb8b7a1a1db93d7140003c2a4ecea9f98d0acc0a8291cdcec97dcf",
    "8ec9b55a7f88a46b4db5a851f44182e1c68a007e5e0dd9020bfd64b645036c7a",
    "4e677d2c38532a3a23ba4442caf53ea63bb454329b7624c8917bdd64b1c0fd4c",
    "b38e8c334c701c3acdad0657fccfec719b1f5c3e4e46041f388147fb4cfdb477",
    "a52471f7a9a96910b855322edb6340d8a00ef092350511e30abec1fff9e3a26e",
    "7fb29f8c183023c3587e38da0077d9b4763e4e4b94b2bbc194c6651e77caf992",
    "eeaac0232a281bf6b3a739c1226116820ae8db5847a67cbef9c9091b462d538c",
    "d72b03746ae77f5e62292c311562a846505dc82db854338ae49f5235c95b9117",
    "8ccf2dd5cacef403ec9d1810c6272b045b3b71f9dc6b80d63fdd4a8e9adb1e69",
    "62a69526d43161c1a41d570d7938dad4a40e329cd0e40e65ffffffffffffffff",
);
const FFDHE8192_P: &str = concat!(
    "ffffffffffffffffadf85458a2bb4a9aafdc5620273d3cf1d8b9c583ce2d3695",
    "a9e13641146433fbcc939dce249b3ef97d2fe363630c75d8f681b202aec4617a",
    "d3df1ed5d5fd65612433f51f5f066ed0856365553ded1af3b557135e7f57c935",
    "984f0c70e0e68b77e2a689daf3efe8721df158a136ade73530acca4f483a797a",
    "bc0ab182b324fb61d108a94bb2c8e3fbb96adab760d7f4681d4f42a3de394df4",
    "ae56ede76372bb190b07a7c8ee0a6d709e02fce1cdf7e2ecc03404cd28342f61",
    "9172fe9ce98583ff8e4f1232eef28183c3fe3b1b4c6fad733bb5fcbc2ec22005",
    "c58ef1837d1683b2c6f34a26c1b2effa886b4238611fcfdcde355b3b6519035b",
    "bc34f4def99c023861b46fc9d6e6c9077ad91d2691f7f7ee598cb0fac186d91c",
    "aefe130985139270b4130c93bc437944f4fd4452e2d74dd364f2e21e71f54bff",
    "5cae82ab9c9df69ee86d2bc522363a0dabc521979b0deada1dbf9a42d5c4484e",
    "0abcd06bfa53ddef3c1b20ee3fd59d7c25e41d2b669e1ef16e6f52c3164df4fb",
    "7930e9e4e58857b6ac7d5f42d69f6d187763cf1d5503400487f55ba57e31cc7a",
    "7135c886efb4318aed6a1e012d9e6832a907600a918130c46dc778f971ad0038",
    "092999a333cb8b7a1a1db93d7140003c2a4ecea9f98d0acc0a8291cdcec97dcf",
    "8ec9b55a7f88a46b4db5a851f44182e1c68a007e5e0dd9020bfd64b645036c7a",
    "4e677d2c38532a3a23ba4442caf53ea63bb454329b7624c8917bdd64b1c0fd4c",
    "b38e8c334c701c3acdad0657fccfec719b1f5c3e4e46041f388147fb4cfdb477",
    "a52471f7a9a96910b855322edb6340d8a00ef092350511e30abec1fff9e3a26e",
    "7fb29f8c183023c3587e38da0077d9b4763e4e4b94b2bbc194c6651e77caf992",
    "eeaac0232a281bf6b3a739c1226116820ae8db5847a67cbef9c9091b462d538c",
    "d72b03746ae77f5e62292c311562a846505dc82db854338ae49f5235c95b9117",
    "8ccf2dd5cacef403ec9d1810c6272b045b3b71f9dc6b80d63fdd4a8e9adb1e69",
    "62a69526d43161c1a41d570d7938dad4a40e329ccff46aaa36ad004cf600c838",
    "1e425a31d951ae64fdb23fcec9509d43687feb69edd1cc5e0b8cc3bdf64b10ef",
    "86b63142a3ab8829555b2f747c932665cb2c0f1cc01bd70229388839d2af05e4",
    "54504ac78b7582822846c0ba35c35f5c59160cc046fd8251541fc68c9c86b022",
    "bb7099876a460e7451a8a93109703fee1c217e6c3826e52c51aa691e0e423cfc",
    "99e9e31650c1217b624816cdad9a95f9d5b8019488d9c0a0a1fe3075a577e231",
    "83f81d4a3f2fa4571efc8ce0ba8a4fe8b6855dfe72b0a66eded2fbabfbe58a30",
    "fafabe1c5d71a87e2f741ef8c1fe86fea6bbfde530677f0d97d11d49f7a8443d",
    "0822e506a9f4614e011e2a94838ff88cd68c8bb7c5c6424cffffffffffffffff",
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HashFunction;

    fn unhex(hex: &str) -> Vec<u8> {
        let hex = if hex.len() % 2 == 1 {
            format!("0{hex}")
        } else {
            hex.to_string()
        };
        hex.as_bytes()
            .chunks(2)
            .map(|pair| (hex_digit(pair[0]) << 4) | hex_digit(pair[1]))
            .collect()
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Key pairs OpenSSL 3.0 generated for its named groups (`openssl genpkey -algorithm DH
    /// -pkeyopt group:ffdheN`): the private exponent, and SHA-256 of the public value padded
    /// to the prime's length. A wrong prime digit gives another public value.
    const OPENSSL_KEY_PAIRS: [(DhGroup, &str, &str); 5] = [
        (
            DhGroup::Ffdhe2048,
            "1f757dd913af15880be5a97b6b83b52aa4177bff5310a603bd81b5baf",
            "8d304b17af048d3252b5eb277b4df33e6016d61e0ed390e5c8c3bd372da3f7dd",
        ),
        (
            DhGroup::Ffdhe3072,
            "18e4e40343cdc39adc9abfdbfe8c62d00eb0f1c9cfe063a054cec7a712c1a98c8214",
            "f87ecb411cedeb801a830b5f329ba89a6db4f6729af7a312602d2e78743059a7",
        ),
        (
            DhGroup::Ffdhe4096,
            "150eff778b47b1c8b65e10de76f5148c7c8273ee9807534020a3070891df048fbf107341e9942a783a",
            "4d15f4d8d0d58e47ab97adbaf2fcc962fd75037637f4fb2023e3d1494a7166c8",
        ),
        (
            DhGroup::Ffdhe6144,
            "472bd0b141767e4b939821be0141eccc67b93f4f37a97399fc61193a44a65d1ff8db3ffa6f39b82ca8f1966f8610ff",
            "8dd144e6a3ad80e699cd819896bbdebb06719c2320fd503b3e3c1b5716216785",
        ),
        (
            DhGroup::Ffdhe8192,
            "e585212097eef8646518ac845923bc7b67cb56235ae8e913d067d8bdeb74bb06fbc149dc1bd5dd3aac99cb28e95805ebcfd6",
            "3b110c663a400eef5900a50142329e026dcaad02fbef858492d6887e8289f7b7",
        ),
    ];

    #[test]
    fn public_values_match_openssl() {
        for (group, private, public_sha256) in OPENSSL_KEY_PAIRS {
            let pair = DhKeyPair::from_private(group, &unhex(private)).expect("key pair");
            assert_eq!(pair.public_value().len(), group.value_len(), "{group}");
            assert_eq!(
                hex(&HashFunction::Sha256.digest(pair.public_value())),
                public_sha256,
                "{group}"
            );
        }
    }

    /// The ffdhe2048 pair above with another OpenSSL key's public value: the session key
    /// OpenSSL derived (`DHPrivateKey.exchange`, padded to 256 bytes), by its SHA-256.
    #[test]
    fn shared_secret_matches_openssl() {
        let (group, private, _) = OPENSSL_KEY_PAIRS[0];
        let pair = DhKeyPair::from_private(group, &unhex(private)).expect("key pair");
        let mut peer = unhex(PEER_2048);
        while peer.len() < 256 {
            peer.insert(0, 0);
        }
        let shared = pair.shared_secret(&peer).expect("valid peer value");
        assert_eq!(shared.len(), 256);
        assert_eq!(
            hex(&HashFunction::Sha256.digest(&shared)),
            "7ecde9eb678fe4006d72cfec5c8a0e824dab5f698b1413fa8fcd22d5e5d81833"
        );
    }

    const PEER_2048: &str = "e4db99c96fcc1c16c11a58766cf1551390f631cc53899f212c727207136a9d17\
        3f45a8e8f0096334d9f43532e8e61efd84c9ddb24e79faeea0db37be9e55a08845d825295ef8d54222303621\
        703096d8158cd6db7e0b50cbfd0530e8d6e62c7a49db6379a90cbd5a069af074d9a3289707a9484fb8139ff1\
        e7b861bf43575c07c1d44da72925aa168542d9f0954ca8f93977e95f4c44f4cc9a6042e1ec823d5a6cefebd8\
        e5d46482365839a9c4b2b3963c00bb379e5577061c6c135f8becac9461425613621de9aa5553f999ab4c8270\
        08287bfb1cce29c1e59b6fd680645f972fdf45bf072faea9f409772de3d9e520bc96848fb5fe9fa93d0b0884\
        2bb5e36f";

    #[test]
    fn two_fresh_pairs_agree() {
        for group in [DhGroup::Ffdhe2048, DhGroup::Ffdhe3072] {
            let a = DhKeyPair::generate(group).expect("a");
            let b = DhKeyPair::generate(group).expect("b");
            assert_ne!(a.public_value(), b.public_value());
            assert_eq!(
                a.shared_secret(b.public_value()).expect("b's value"),
                b.shared_secret(a.public_value()).expect("a's value")
            );
        }
    }

    #[test]
    fn refuses_degenerate_and_misshapen_peer_values() {
        let pair = DhKeyPair::generate(DhGroup::Ffdhe2048).expect("pair");
        let len = DhGroup::Ffdhe2048.value_len();
        let mut one = vec![0u8; len];
        one[len - 1] = 1;
        let mut p_minus_1 = DhGroup::Ffdhe2048.prime_bytes();
        p_minus_1[len - 1] -= 1;
        for bad in [vec![0u8; len], one, p_minus_1, vec![0xff; len]] {
            assert_eq!(pair.shared_secret(&bad), Err(DhError::ValueRange));
        }
        assert_eq!(
            pair.shared_secret(&[2; 255]),
            Err(DhError::ValueLength {
                got: 255,
                expected: 256
            })
        );
        assert_eq!(
            DhKeyPair::generate(DhGroup::Null).err(),
            Some(DhError::NullGroup)
        );
    }

    #[test]
    fn names_and_ids_round_trip() {
        for g in DhGroup::ALL {
            assert_eq!(DhGroup::from_id(g.id()), Some(g));
            assert_eq!(DhGroup::from_name(g.name()), Some(g));
        }
        assert_eq!(DhGroup::from_id(6), None);
    }
}
