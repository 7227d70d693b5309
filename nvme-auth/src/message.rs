//! The DH-HMAC-CHAP messages carried by Authentication Send / Receive, byte for byte as
//! `struct nvmf_auth_dhchap_*_data` in Linux's `include/linux/nvme.h` (all fields
//! little-endian).

use crate::ids;

use super::{DhGroup, HashFunction};

const HEADER_LEN: usize = 16;
const NEGOTIATE_HEADER_LEN: usize = 8;
const DESCRIPTOR_LEN: usize = 64;
const FAILURE_LEN: usize = 8;

/// A message that does not decode, with the failure reason to report for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}")]
pub struct DecodeError {
    /// `rescode_exp` for the FAILURE1 (`NVME_AUTH_DHCHAP_FAILURE_*`).
    pub reason: u8,
    pub what: &'static str,
}

fn payload(what: &'static str) -> DecodeError {
    DecodeError {
        reason: ids::FAILURE_INCORRECT_PAYLOAD,
        what,
    }
}

/// AUTH_Negotiate: the host's transaction ID and the hashes and DH groups it offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiate {
    pub t_id: u16,
    /// Secure channel concatenation the host asks for (0: none).
    pub sc_c: u8,
    /// Raw identifiers offered by the DH-HMAC-CHAP descriptor, in the host's order (unknown
    /// ones kept: the controller skips them).
    pub hash_ids: Vec<u8>,
    pub dhgroup_ids: Vec<u8>,
}

/// DH-HMAC-CHAP_Challenge (controller to host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub t_id: u16,
    pub hash: HashFunction,
    pub dhgroup: DhGroup,
    /// S1.
    pub seqnum: u32,
    /// C1, `hash.digest_len()` bytes.
    pub challenge: Vec<u8>,
    /// The controller's public value (empty with the NULL group).
    pub dh_value: Vec<u8>,
}

/// DH-HMAC-CHAP_Reply (host to controller).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub t_id: u16,
    /// R1, the host's response.
    pub response: Vec<u8>,
    /// C2 when the host asks the controller to authenticate itself (`cvalid`).
    pub ctrl_challenge: Option<Vec<u8>>,
    /// S2.
    pub seqnum: u32,
    /// The host's public value (empty with the NULL group).
    pub dh_value: Vec<u8>,
}

/// DH-HMAC-CHAP_Success1 (controller to host): R2 when the host sent C2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Success1 {
    pub t_id: u16,
    pub hash_len: u8,
    pub ctrl_response: Option<Vec<u8>>,
}

/// AUTH_Failure1 (controller to host) or AUTH_Failure2 (host to controller).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    pub t_id: u16,
    /// `rescode_exp`: why (`NVME_AUTH_DHCHAP_FAILURE_*`).
    pub reason: u8,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Negotiate(Negotiate),
    Challenge(Challenge),
    Reply(Reply),
    Success1(Success1),
    /// DH-HMAC-CHAP_Success2: the host accepted the controller's response.
    Success2 {
        t_id: u16,
    },
    Failure1(Failure),
    Failure2(Failure),
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The 16-byte header of the DH-HMAC-CHAP messages (type, id, t_id).
fn header(auth_id: u8, t_id: u16, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    out[0] = ids::TYPE_DHCHAP;
    out[1] = auth_id;
    out[4..6].copy_from_slice(&t_id.to_le_bytes());
    out
}

impl Message {
    pub fn t_id(&self) -> u16 {
        match self {
            Message::Negotiate(m) => m.t_id,
            Message::Challenge(m) => m.t_id,
            Message::Reply(m) => m.t_id,
            Message::Success1(m) => m.t_id,
            Message::Success2 { t_id } => *t_id,
            Message::Failure1(m) | Message::Failure2(m) => m.t_id,
        }
    }

    /// The message's name, for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Negotiate(_) => "negotiate",
            Message::Challenge(_) => "challenge",
            Message::Reply(_) => "reply",
            Message::Success1(_) => "success1",
            Message::Success2 { .. } => "success2",
            Message::Failure1(_) => "failure1",
            Message::Failure2(_) => "failure2",
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        match self {
            Message::Negotiate(m) => {
                let mut out = vec![0u8; NEGOTIATE_HEADER_LEN + DESCRIPTOR_LEN];
                out[0] = ids::TYPE_COMMON;
                out[1] = ids::MSG_NEGOTIATE;
                out[4..6].copy_from_slice(&m.t_id.to_le_bytes());
                out[6] = m.sc_c;
                out[7] = 1; // napd: one protocol descriptor
                let d = &mut out[NEGOTIATE_HEADER_LEN..];
                let hashes = &m.hash_ids[..m.hash_ids.len().min(ids::DESCRIPTOR_IDS)];
                let groups = &m.dhgroup_ids[..m.dhgroup_ids.len().min(ids::DESCRIPTOR_IDS)];
                d[0] = ids::AUTH_ID_DHCHAP;
                d[2] = hashes.len() as u8;
                d[3] = groups.len() as u8;
                d[4..4 + hashes.len()].copy_from_slice(hashes);
                let at = 4 + ids::DESCRIPTOR_IDS;
                d[at..at + groups.len()].copy_from_slice(groups);
                out
            }
            Message::Challenge(m) => {
                let hl = m.challenge.len();
                let mut out = header(ids::MSG_CHALLENGE, m.t_id, HEADER_LEN);
                out[6] = hl as u8;
                out[8] = m.hash.id();
                out[9] = m.dhgroup.id();
                out[10..12].copy_from_slice(&(m.dh_value.len() as u16).to_le_bytes());
                out[12..16].copy_from_slice(&m.seqnum.to_le_bytes());
                out.extend_from_slice(&m.challenge);
                out.extend_from_slice(&m.dh_value);
                out
            }
            Message::Reply(m) => {
                let hl = m.response.len();
                let mut out = header(ids::MSG_REPLY, m.t_id, HEADER_LEN);
                out[6] = hl as u8;
                out[8] = if m.ctrl_challenge.is_some() {
                    ids::RESPONSE_VALID
                } else {
                    0
                };
                out[10..12].copy_from_slice(&(m.dh_value.len() as u16).to_le_bytes());
                out[12..16].copy_from_slice(&m.seqnum.to_le_bytes());
                out.extend_from_slice(&m.response);
                // C2's place is there whether or not it is valid.
                match &m.ctrl_challenge {
                    Some(c2) => out.extend_from_slice(c2),
                    None => out.resize(out.len() + hl, 0),
                }
                out.extend_from_slice(&m.dh_value);
                out
            }
            Message::Success1(m) => {
                let hl = usize::from(m.hash_len);
                let mut out = header(ids::MSG_SUCCESS1, m.t_id, HEADER_LEN + hl);
                out[6] = m.hash_len;
                if let Some(r2) = &m.ctrl_response {
                    out[8] = ids::RESPONSE_VALID;
                    out[HEADER_LEN..HEADER_LEN + r2.len().min(hl)]
                        .copy_from_slice(&r2[..r2.len().min(hl)]);
                }
                out
            }
            Message::Success2 { t_id } => header(ids::MSG_SUCCESS2, *t_id, HEADER_LEN),
            Message::Failure1(m) | Message::Failure2(m) => {
                let mut out = vec![0u8; FAILURE_LEN];
                out[0] = ids::TYPE_COMMON;
                out[1] = if matches!(self, Message::Failure1(_)) {
                    ids::MSG_FAILURE1
                } else {
                    ids::MSG_FAILURE2
                };
                out[4..6].copy_from_slice(&m.t_id.to_le_bytes());
                out[6] = ids::FAILURE_REASON_FAILED;
                out[7] = m.reason;
                out
            }
        }
    }

    /// Decodes one message. Lengths are checked against the message's own fields, so a
    /// short or inconsistent message is an error, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
        if bytes.len() < FAILURE_LEN {
            return Err(payload("shorter than any message"));
        }
        let t_id = le16(bytes, 4);
        match (bytes[0], bytes[1]) {
            (ids::TYPE_COMMON, ids::MSG_NEGOTIATE) => decode_negotiate(bytes, t_id),
            (ids::TYPE_COMMON, id @ (ids::MSG_FAILURE1 | ids::MSG_FAILURE2)) => {
                let failure = Failure {
                    t_id,
                    reason: bytes[7],
                };
                Ok(if id == ids::MSG_FAILURE1 {
                    Message::Failure1(failure)
                } else {
                    Message::Failure2(failure)
                })
            }
            (ids::TYPE_DHCHAP, id) => {
                if bytes.len() < HEADER_LEN {
                    return Err(payload("DH-HMAC-CHAP message shorter than its header"));
                }
                match id {
                    ids::MSG_CHALLENGE => decode_challenge(bytes, t_id),
                    ids::MSG_REPLY => decode_reply(bytes, t_id),
                    ids::MSG_SUCCESS1 => decode_success1(bytes, t_id),
                    ids::MSG_SUCCESS2 => Ok(Message::Success2 { t_id }),
                    _ => Err(DecodeError {
                        reason: ids::FAILURE_INCORRECT_MESSAGE,
                        what: "unknown DH-HMAC-CHAP message",
                    }),
                }
            }
            _ => Err(DecodeError {
                reason: ids::FAILURE_INCORRECT_MESSAGE,
                what: "unknown message type",
            }),
        }
    }
}

fn decode_negotiate(bytes: &[u8], t_id: u16) -> Result<Message, DecodeError> {
    let napd = usize::from(bytes[7]);
    if napd != 1 {
        // Linux nvmet answers any other count so: one protocol, one descriptor.
        return Err(DecodeError {
            reason: ids::FAILURE_HASH_UNUSABLE,
            what: "not exactly one protocol descriptor",
        });
    }
    let d = bytes
        .get(NEGOTIATE_HEADER_LEN..NEGOTIATE_HEADER_LEN + DESCRIPTOR_LEN)
        .ok_or_else(|| payload("negotiate shorter than its descriptor"))?;
    if d[0] != ids::AUTH_ID_DHCHAP {
        return Err(payload("the descriptor is not DH-HMAC-CHAP"));
    }
    let (halen, dhlen) = (usize::from(d[2]), usize::from(d[3]));
    if halen > ids::DESCRIPTOR_IDS || dhlen > ids::DESCRIPTOR_IDS {
        return Err(payload("more identifiers than a descriptor holds"));
    }
    let groups_at = 4 + ids::DESCRIPTOR_IDS;
    Ok(Message::Negotiate(Negotiate {
        t_id,
        sc_c: bytes[6],
        hash_ids: d[4..4 + halen].to_vec(),
        dhgroup_ids: d[groups_at..groups_at + dhlen].to_vec(),
    }))
}

fn decode_challenge(bytes: &[u8], t_id: u16) -> Result<Message, DecodeError> {
    let hl = usize::from(bytes[6]);
    let hash = HashFunction::from_id(bytes[8]).ok_or(DecodeError {
        reason: ids::FAILURE_HASH_UNUSABLE,
        what: "unknown hash function",
    })?;
    if hl != hash.digest_len() {
        return Err(DecodeError {
            reason: ids::FAILURE_HASH_UNUSABLE,
            what: "hash length does not match the hash function",
        });
    }
    let dhgroup = DhGroup::from_id(bytes[9]).ok_or(DecodeError {
        reason: ids::FAILURE_DHGROUP_UNUSABLE,
        what: "unknown DH group",
    })?;
    let dhvlen = usize::from(le16(bytes, 10));
    if dhvlen != dhgroup.value_len() {
        return Err(DecodeError {
            reason: ids::FAILURE_DHGROUP_UNUSABLE,
            what: "DH value length does not match the group",
        });
    }
    let body = bytes
        .get(HEADER_LEN..HEADER_LEN + hl + dhvlen)
        .ok_or_else(|| payload("challenge shorter than its fields"))?;
    Ok(Message::Challenge(Challenge {
        t_id,
        hash,
        dhgroup,
        seqnum: le32(bytes, 12),
        challenge: body[..hl].to_vec(),
        dh_value: body[hl..].to_vec(),
    }))
}

fn decode_reply(bytes: &[u8], t_id: u16) -> Result<Message, DecodeError> {
    let hl = usize::from(bytes[6]);
    let dhvlen = usize::from(le16(bytes, 10));
    let body = bytes
        .get(HEADER_LEN..HEADER_LEN + 2 * hl + dhvlen)
        .ok_or_else(|| payload("reply shorter than its fields"))?;
    let cvalid = bytes[8] & ids::RESPONSE_VALID != 0;
    Ok(Message::Reply(Reply {
        t_id,
        response: body[..hl].to_vec(),
        ctrl_challenge: cvalid.then(|| body[hl..2 * hl].to_vec()),
        seqnum: le32(bytes, 12),
        dh_value: body[2 * hl..].to_vec(),
    }))
}

fn decode_success1(bytes: &[u8], t_id: u16) -> Result<Message, DecodeError> {
    let hl = bytes[6];
    let rvalid = bytes[8] & ids::RESPONSE_VALID != 0;
    let ctrl_response = if rvalid {
        let r2 = bytes
            .get(HEADER_LEN..HEADER_LEN + usize::from(hl))
            .ok_or_else(|| payload("success1 shorter than its response"))?;
        Some(r2.to_vec())
    } else {
        None
    };
    Ok(Message::Success1(Success1 {
        t_id,
        hash_len: hl,
        ctrl_response,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_kind() -> Vec<Message> {
        vec![
            Message::Negotiate(Negotiate {
                t_id: 7,
                sc_c: 0,
                hash_ids: vec![1, 2, 3],
                dhgroup_ids: vec![0, 1, 2, 3, 4, 5],
            }),
            Message::Challenge(Challenge {
                t_id: 7,
                hash: HashFunction::Sha384,
                dhgroup: DhGroup::Ffdhe2048,
                seqnum: 0xdead_beef,
                challenge: vec![0xc1; 48],
                dh_value: vec![0xd1; 256],
            }),
            Message::Reply(Reply {
                t_id: 7,
                response: vec![0xa1; 32],
                ctrl_challenge: Some(vec![0xc2; 32]),
                seqnum: 9,
                dh_value: vec![],
            }),
            Message::Reply(Reply {
                t_id: 8,
                response: vec![0xa1; 64],
                ctrl_challenge: None,
                seqnum: 1,
                dh_value: vec![0xd2; 1024],
            }),
            Message::Success1(Success1 {
                t_id: 7,
                hash_len: 32,
                ctrl_response: Some(vec![0xb2; 32]),
            }),
            Message::Success1(Success1 {
                t_id: 7,
                hash_len: 64,
                ctrl_response: None,
            }),
            Message::Success2 { t_id: 7 },
            Message::Failure1(Failure { t_id: 7, reason: 4 }),
            Message::Failure2(Failure { t_id: 7, reason: 1 }),
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for message in every_kind() {
            assert_eq!(Message::decode(&message.encode()), Ok(message.clone()));
        }
    }

    /// The negotiate a Linux 6.12 host sends (`nvme_auth_set_dhchap_negotiate_data`): 72
    /// bytes, every hash and every group offered.
    #[test]
    fn negotiate_layout_is_linuxs() {
        let bytes = every_kind()[0].encode();
        assert_eq!(bytes.len(), 72);
        assert_eq!(&bytes[..8], &[0x00, 0x00, 0, 0, 7, 0, 0, 1]);
        assert_eq!(&bytes[8..12], &[0x01, 0, 3, 6]);
        assert_eq!(&bytes[12..15], &[1, 2, 3]);
        assert_eq!(&bytes[42..48], &[0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn reply_without_c2_keeps_its_place() {
        let Message::Reply(reply) = &every_kind()[3] else {
            unreachable!()
        };
        let bytes = Message::Reply(reply.clone()).encode();
        assert_eq!(bytes.len(), 16 + 64 + 64 + 1024);
        assert_eq!(bytes[8], 0, "cvalid");
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        for message in every_kind() {
            let bytes = message.encode();
            for len in 0..bytes.len() {
                // Success2 and the failures are all header: only shorter ones fail.
                let _ = Message::decode(&bytes[..len]);
            }
            let cut = &bytes[..bytes.len() - 1];
            // A Success1 without R2 ends at its header; its unused R2 space may be cut.
            let trailing_space = matches!(
                message,
                Message::Success1(Success1 {
                    ctrl_response: None,
                    ..
                })
            );
            if !trailing_space {
                assert!(
                    Message::decode(cut).is_err(),
                    "{} cut by one",
                    message.name()
                );
            }
        }
    }

    #[test]
    fn inconsistent_fields_are_refused_with_their_reason() {
        let mut challenge = every_kind()[1].encode();
        challenge[8] = 9; // unknown hash
        assert_eq!(
            Message::decode(&challenge).map_err(|e| e.reason),
            Err(ids::FAILURE_HASH_UNUSABLE)
        );
        let mut negotiate = every_kind()[0].encode();
        negotiate[7] = 2; // napd
        assert_eq!(
            Message::decode(&negotiate).map_err(|e| e.reason),
            Err(ids::FAILURE_HASH_UNUSABLE)
        );
        negotiate[7] = 1;
        negotiate[10] = 31; // halen beyond the list
        assert_eq!(
            Message::decode(&negotiate).map_err(|e| e.reason),
            Err(ids::FAILURE_INCORRECT_PAYLOAD)
        );
        let mut unknown = every_kind()[6].encode();
        unknown[1] = 0x09;
        assert_eq!(
            Message::decode(&unknown).map_err(|e| e.reason),
            Err(ids::FAILURE_INCORRECT_MESSAGE)
        );
    }
}
