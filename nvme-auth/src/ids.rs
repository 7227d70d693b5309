//! Constants of in-band authentication, DH-HMAC-CHAP (NVMe Base 2.0 section 8.13), named and
//! valued as in Linux's `include/linux/nvme.h` and `drivers/nvme/common/auth.c`.

/// Authentication Send / Receive SECP: the DH-HMAC-CHAP protocol
/// (`NVME_AUTH_DHCHAP_PROTOCOL_IDENTIFIER`).
pub const SECP_DHCHAP: u8 = 0xe9;
/// SPSP0 and SPSP1 of every DH-HMAC-CHAP Authentication Send / Receive.
pub const SPSP0: u8 = 0x01;
pub const SPSP1: u8 = 0x01;
/// Message `auth_type` (`NVME_AUTH_COMMON_MESSAGES`, `NVME_AUTH_DHCHAP_MESSAGES`).
pub const TYPE_COMMON: u8 = 0x00;
pub const TYPE_DHCHAP: u8 = 0x01;
/// Message `auth_id` (`NVME_AUTH_DHCHAP_MESSAGE_*`). NEGOTIATE, FAILURE1 and FAILURE2 go
/// with the common type, the others with the DH-HMAC-CHAP type.
pub const MSG_NEGOTIATE: u8 = 0x00;
pub const MSG_CHALLENGE: u8 = 0x01;
pub const MSG_REPLY: u8 = 0x02;
pub const MSG_SUCCESS1: u8 = 0x03;
pub const MSG_SUCCESS2: u8 = 0x04;
pub const MSG_FAILURE2: u8 = 0xf0;
pub const MSG_FAILURE1: u8 = 0xf1;
/// Protocol descriptor `authid` for DH-HMAC-CHAP (`NVME_AUTH_DHCHAP_AUTH_ID`).
pub const AUTH_ID_DHCHAP: u8 = 0x01;
/// `cvalid` / `rvalid`: the message carries a challenge / response
/// (`NVME_AUTH_DHCHAP_RESPONSE_VALID`).
pub const RESPONSE_VALID: u8 = 1 << 0;
/// Hash function identifiers (`NVME_AUTH_HASH_*`).
pub const HASH_SHA256: u8 = 0x01;
pub const HASH_SHA384: u8 = 0x02;
pub const HASH_SHA512: u8 = 0x03;
/// Diffie-Hellman group identifiers (`NVME_AUTH_DHGROUP_*`).
pub const DHGROUP_NULL: u8 = 0x00;
pub const DHGROUP_2048: u8 = 0x01;
pub const DHGROUP_3072: u8 = 0x02;
pub const DHGROUP_4096: u8 = 0x03;
pub const DHGROUP_6144: u8 = 0x04;
pub const DHGROUP_8192: u8 = 0x05;
/// Entries of each identifier list in a protocol descriptor: 30 hash IDs, then 30
/// DH group IDs (`struct nvmf_auth_dhchap_protocol_descriptor`).
pub const DESCRIPTOR_IDS: usize = 30;
/// Failure messages' `rescode` (`NVME_AUTH_DHCHAP_FAILURE_REASON_FAILED`).
pub const FAILURE_REASON_FAILED: u8 = 0x01;
/// Failure messages' `rescode_exp` (`NVME_AUTH_DHCHAP_FAILURE_*`).
pub const FAILURE_FAILED: u8 = 0x01;
pub const FAILURE_NOT_USABLE: u8 = 0x02;
pub const FAILURE_CONCAT_MISMATCH: u8 = 0x03;
pub const FAILURE_HASH_UNUSABLE: u8 = 0x04;
pub const FAILURE_DHGROUP_UNUSABLE: u8 = 0x05;
pub const FAILURE_INCORRECT_PAYLOAD: u8 = 0x06;
pub const FAILURE_INCORRECT_MESSAGE: u8 = 0x07;
