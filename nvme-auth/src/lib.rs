//! NVMe in-band authentication with DH-HMAC-CHAP (NVMe Base 2.0 section 8.13, as Linux
//! implements it in `drivers/nvme/common/auth.c`, `drivers/nvme/host/auth.c` and
//! `drivers/nvme/target/fabrics-cmd-auth.c`): the secrets, hash functions, FFDHE groups,
//! messages and response computations that the gateway's controller side (`core::auth`),
//! its host library and the control plane (which checks the secrets an admin gives it)
//! share. No I/O: messages in and out, bytes in and out.
//!
//! One transaction: the host offers hashes and DH groups (AUTH_Negotiate); the controller
//! picks one of each and sends a random challenge C1 with its sequence number S1 and, with a
//! DH group, its public value (Challenge); the host answers R1 = HMAC(K_h, C1 ...) and its own
//! public value, and may send a challenge C2 of its own (Reply); the controller checks R1 and
//! answers R2 = HMAC(K_c, C2 ...) if asked (Success1); the host, having checked R2, confirms
//! (Success2). With a DH group both challenges are first augmented with the session key
//! (`HMAC(H(g^xy mod p), C)`), so the responses bind the key exchange.

pub mod dh;
pub mod hash;
pub mod ids;
pub mod message;
pub mod secret;
pub mod tls_psk;

use zeroize::Zeroizing;

pub use dh::{DhError, DhGroup, DhKeyPair};
pub use hash::HashFunction;
pub use message::{Challenge, DecodeError, Failure, Message, Negotiate, Reply, Success1};
pub use secret::{DhchapSecret, SecretError};

/// The challenge a response is computed over: C itself with the NULL group, else
/// HMAC(H(session key), C) (Linux `nvme_auth_augmented_challenge`).
pub fn augmented_challenge(
    hash: HashFunction,
    challenge: &[u8],
    session_key: Option<&[u8]>,
) -> Zeroizing<Vec<u8>> {
    match session_key {
        None => Zeroizing::new(challenge.to_vec()),
        Some(key) => hash.hmac(&hash.digest(key), &[challenge]),
    }
}

/// What both responses are computed over, apart from the key, the challenge and the
/// literal naming the side.
pub struct ResponseInput<'a> {
    pub hash: HashFunction,
    /// S1 for the host's response, S2 for the controller's.
    pub seqnum: u32,
    pub t_id: u16,
    pub hostnqn: &'a str,
    pub subnqn: &'a str,
}

/// R1 = HMAC(K_h, Ca1 || S1 || T || 0 || "HostHost" || host NQN || 0 || subsystem NQN),
/// K_h being the host secret transformed with the host NQN.
pub fn host_response(
    input: &ResponseInput<'_>,
    host_key: &[u8],
    augmented: &[u8],
) -> Zeroizing<Vec<u8>> {
    input.hash.hmac(
        host_key,
        &[
            augmented,
            &input.seqnum.to_le_bytes(),
            &input.t_id.to_le_bytes(),
            &[0], // secure channel concatenation: none
            b"HostHost",
            input.hostnqn.as_bytes(),
            &[0],
            input.subnqn.as_bytes(),
        ],
    )
}

/// R2 = HMAC(K_c, Ca2 || S2 || T || 0 || "Controller" || subsystem NQN || 0 || host NQN),
/// K_c being the controller secret transformed with the subsystem NQN.
pub fn controller_response(
    input: &ResponseInput<'_>,
    ctrl_key: &[u8],
    augmented: &[u8],
) -> Zeroizing<Vec<u8>> {
    input.hash.hmac(
        ctrl_key,
        &[
            augmented,
            &input.seqnum.to_le_bytes(),
            &input.t_id.to_le_bytes(),
            &[0],
            b"Controller",
            input.subnqn.as_bytes(),
            &[0],
            input.hostnqn.as_bytes(),
        ],
    )
}

/// Compares two responses in constant time.
pub fn responses_match(expected: &[u8], got: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(expected, got).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Known answers computed with Python's hmac and hashlib from the formulas above (as
    /// Linux's `nvme_auth_dhchap_setup_host_response` / `_ctrl_response` hash them): the
    /// NULL group, and a session key of 256 bytes 0x42 for the augmented challenge.
    #[test]
    fn responses_match_an_independent_computation() {
        let input = ResponseInput {
            hash: HashFunction::Sha256,
            seqnum: 0x0102_0304,
            t_id: 0x0506,
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:host",
            subnqn: "nqn.2016-06.io.example:sub",
        };
        let key = [0x33u8; 32];
        let c1 = [0xc1u8; 32];
        assert_eq!(
            hex(&host_response(
                &input,
                &key,
                &augmented_challenge(input.hash, &c1, None)
            )),
            HOST_NULL
        );
        let session = [0x42u8; 256];
        let augmented = augmented_challenge(input.hash, &c1, Some(&session));
        assert_eq!(hex(&augmented), AUGMENTED);
        assert_eq!(hex(&host_response(&input, &key, &augmented)), HOST_DH);
        let input = ResponseInput {
            hash: HashFunction::Sha512,
            ..input
        };
        let c2 = [0xc2u8; 64];
        assert_eq!(
            hex(&controller_response(&input, &[0x44; 64], &c2)),
            CTRL_NULL_SHA512
        );
    }

    const HOST_NULL: &str = "a96a145e71b1e8d8994b7a64623fe5ce2b929ba07de02b21b917dc44f5bff419";
    const AUGMENTED: &str = "d3b60617f3984a5d560aa4b3fc193907a9e772810d7b32bc0185b2e1189d2dda";
    const HOST_DH: &str = "6824f64847ad410a92a95f278cdeb248e1a968f1f902bdf666ee87d3dff228dd";
    const CTRL_NULL_SHA512: &str =
        "31dc706076d37b39cb6ccdacf940db64dc17be198d0c3b6b808d10fbdf9c28ff\
        e4e66c9964353b40e2ae81bfc2b4143a13b342027ac8c1471c801fa50b651786";
}
