//! DH-HMAC-CHAP on the host side: the transaction a queue runs when its Connect response
//! asks for authentication (ATR), as Linux's `drivers/nvme/host/auth.c` runs it.
//!
//! [`HostTransaction`] is the transaction with no I/O (messages in, messages out), which the
//! core's tests drive directly; [`HostConnection::authenticate`] runs it over a queue. It
//! uses the gateway's [`crate::auth`] primitives (secrets, hashes, FFDHE, messages), which
//! known-answer tests pin to OpenSSL's and Python's results, but none of the controller's
//! state machine.

use std::sync::atomic::{AtomicU16, Ordering};

use bytes::Bytes;
use ring::rand::{SecureRandom, SystemRandom};
use zeroize::Zeroizing;

use super::cmd::Sqe;
use super::conn::{HostConnection, HostError, HostOptions, Xfer};
use crate::auth::{
    augmented_challenge, controller_response, host_response, responses_match, DhGroup, DhKeyPair,
    DhchapSecret, Failure, HashFunction, Message, Negotiate, Reply, ResponseInput,
};
use crate::spec::auth as ids;

/// The buffer Linux hosts give every Authentication Receive (`CHAP_BUF_SIZE`).
pub const RECEIVE_LEN: u32 = 4096;

/// What a queue's authentication settled on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuthOutcome {
    pub hash: HashFunction,
    pub dhgroup: DhGroup,
    /// The controller proved itself too (the host had a controller secret).
    pub bidirectional: bool,
}

/// Why a transaction stopped: what the host tells the controller (a Failure2 to send,
/// unless the controller ended it with Failure1) and what to report.
#[derive(Debug)]
pub struct Refused {
    pub failure2: Option<Message>,
    pub what: String,
}

/// Transaction IDs, one per transaction, as Linux counts them per controller.
static NEXT_TRANSACTION: AtomicU16 = AtomicU16::new(1);

fn random(len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    // Only fails where the OS has no random source; zeros then make a response that is
    // still correct, only predictable, and this is a test and benchmark host.
    let _ = SystemRandom::new().fill(&mut bytes);
    bytes
}

/// One DH-HMAC-CHAP transaction as the host runs it.
pub struct HostTransaction {
    t_id: u16,
    hostnqn: String,
    subnqn: String,
    secret: DhchapSecret,
    ctrl_secret: Option<DhchapSecret>,
    hashes: Vec<HashFunction>,
    dhgroups: Vec<DhGroup>,
    /// Set by the challenge: what Success1 is checked against.
    pending: Option<Pending>,
}

struct Pending {
    hash: HashFunction,
    dhgroup: DhGroup,
    /// C2 and S2, with the session key, when the controller must prove itself.
    ctrl_challenge: Option<(Vec<u8>, u32)>,
    session_key: Option<Zeroizing<Vec<u8>>>,
}

impl HostTransaction {
    /// A transaction with the options' secrets and offer; Err when the host has no secret.
    pub fn new(opts: &HostOptions, subnqn: &str) -> Result<Self, HostError> {
        let secret = opts.dhchap_secret.clone().ok_or_else(|| {
            HostError::Authentication(
                "the controller requires authentication and no secret is set".into(),
            )
        })?;
        Ok(Self {
            t_id: NEXT_TRANSACTION.fetch_add(1, Ordering::Relaxed),
            hostnqn: opts.hostnqn.clone(),
            subnqn: subnqn.to_string(),
            secret,
            ctrl_secret: opts.dhchap_ctrl_secret.clone(),
            hashes: opts.dhchap_hashes.clone(),
            dhgroups: opts.dhchap_dhgroups.clone(),
            pending: None,
        })
    }

    pub fn negotiate(&self) -> Message {
        Message::Negotiate(Negotiate {
            t_id: self.t_id,
            sc_c: 0,
            hash_ids: self.hashes.iter().map(|h| h.id()).collect(),
            dhgroup_ids: self.dhgroups.iter().map(|g| g.id()).collect(),
        })
    }

    fn refuse(&self, reason: u8, what: String) -> Refused {
        Refused {
            failure2: Some(Message::Failure2(Failure {
                t_id: self.t_id,
                reason,
            })),
            what,
        }
    }

    /// The controller's challenge in, the Reply out.
    pub fn reply(&mut self, received: Message) -> Result<Message, Refused> {
        let challenge = match received {
            Message::Challenge(c) if c.t_id == self.t_id => c,
            other => return Err(unexpected(&other, "challenge")),
        };
        let (hash, dhgroup) = (challenge.hash, challenge.dhgroup);
        if !self.hashes.contains(&hash) || !self.dhgroups.contains(&dhgroup) {
            return Err(self.refuse(
                ids::FAILURE_HASH_UNUSABLE,
                format!("the controller chose {hash} / {dhgroup}, which this host did not offer"),
            ));
        }
        let (dh_value, session_key) = match dhgroup {
            DhGroup::Null => (Vec::new(), None),
            group => {
                let pair = DhKeyPair::generate(group)
                    .map_err(|e| self.refuse(ids::FAILURE_DHGROUP_UNUSABLE, e.to_string()))?;
                let key = pair.shared_secret(&challenge.dh_value).map_err(|e| {
                    self.refuse(
                        ids::FAILURE_DHGROUP_UNUSABLE,
                        format!("controller DH value: {e}"),
                    )
                })?;
                (pair.public_value().to_vec(), Some(key))
            }
        };
        let input = ResponseInput {
            hash,
            seqnum: challenge.seqnum,
            t_id: self.t_id,
            hostnqn: &self.hostnqn,
            subnqn: &self.subnqn,
        };
        let host_key = self.secret.transform(&self.hostnqn);
        let ca1 = augmented_challenge(
            hash,
            &challenge.challenge,
            session_key.as_deref().map(Vec::as_slice),
        );
        let response = host_response(&input, &host_key, &ca1).to_vec();
        let ctrl_challenge = self.ctrl_secret.as_ref().map(|_| {
            let s2 = u32::from_le_bytes(random(4).try_into().unwrap_or([1; 4])).max(1);
            (random(hash.digest_len()), s2)
        });
        let reply = Message::Reply(Reply {
            t_id: self.t_id,
            response,
            ctrl_challenge: ctrl_challenge.as_ref().map(|(c2, _)| c2.clone()),
            // Linux 6.12 sends a fresh S2 even when it asks nothing of the controller.
            seqnum: ctrl_challenge.as_ref().map_or(1, |(_, s2)| *s2),
            dh_value,
        });
        self.pending = Some(Pending {
            hash,
            dhgroup,
            ctrl_challenge,
            session_key,
        });
        Ok(reply)
    }

    /// Success1 in; Success2 out when the controller proved itself, and the outcome.
    pub fn finish(&mut self, received: Message) -> Result<(Option<Message>, AuthOutcome), Refused> {
        let success1 = match received {
            Message::Success1(s) if s.t_id == self.t_id => s,
            other => return Err(unexpected(&other, "success1")),
        };
        let Some(pending) = self.pending.take() else {
            return Err(self.refuse(
                ids::FAILURE_INCORRECT_MESSAGE,
                "success1 before any challenge".into(),
            ));
        };
        let outcome = AuthOutcome {
            hash: pending.hash,
            dhgroup: pending.dhgroup,
            bidirectional: pending.ctrl_challenge.is_some(),
        };
        let (Some(ctrl_secret), Some((c2, s2))) = (&self.ctrl_secret, &pending.ctrl_challenge)
        else {
            return Ok((None, outcome));
        };
        let input = ResponseInput {
            hash: pending.hash,
            seqnum: *s2,
            t_id: self.t_id,
            hostnqn: &self.hostnqn,
            subnqn: &self.subnqn,
        };
        let ctrl_key = ctrl_secret.transform(&self.subnqn);
        let session_key = pending.session_key.as_deref().map(Vec::as_slice);
        let ca2 = augmented_challenge(pending.hash, c2, session_key);
        let expected = controller_response(&input, &ctrl_key, &ca2);
        let proven = success1
            .ctrl_response
            .as_deref()
            .is_some_and(|r2| responses_match(&expected, r2));
        if !proven {
            return Err(self.refuse(
                ids::FAILURE_FAILED,
                "the controller's response is wrong".into(),
            ));
        }
        Ok((Some(Message::Success2 { t_id: self.t_id }), outcome))
    }
}

fn unexpected(message: &Message, wanted: &str) -> Refused {
    let what = match message {
        Message::Failure1(f) => format!(
            "the controller refused: {}",
            crate::core::auth::reason_name(f.reason)
        ),
        other => format!(
            "expected {wanted}, got {} (transaction {})",
            other.name(),
            other.t_id()
        ),
    };
    Refused {
        // A controller that sent Failure1 has ended the transaction already.
        failure2: None,
        what,
    }
}

impl HostConnection {
    /// Runs one DH-HMAC-CHAP transaction on this queue (after a Connect that answered ATR,
    /// or again to re-authenticate).
    pub async fn authenticate(&self, subnqn: &str) -> Result<AuthOutcome, HostError> {
        let mut transaction = HostTransaction::new(self.options(), subnqn)?;
        self.auth_send(&transaction.negotiate()).await?;
        let challenge = self.auth_receive().await?;
        let reply = match transaction.reply(challenge) {
            Ok(reply) => reply,
            Err(refused) => return Err(self.give_up(refused).await),
        };
        self.auth_send(&reply).await?;
        let success1 = self.auth_receive().await?;
        match transaction.finish(success1) {
            Ok((success2, outcome)) => {
                if let Some(success2) = success2 {
                    self.auth_send(&success2).await?;
                }
                Ok(outcome)
            }
            Err(refused) => Err(self.give_up(refused).await),
        }
    }

    async fn give_up(&self, refused: Refused) -> HostError {
        if let Some(failure2) = &refused.failure2 {
            if let Err(e) = self.auth_send(failure2).await {
                return e;
            }
        }
        HostError::Authentication(refused.what)
    }

    async fn auth_send(&self, message: &Message) -> Result<(), HostError> {
        let bytes = message.encode();
        self.submit_ok(
            Sqe::auth_send(bytes.len() as u32),
            Xfer::Write(Bytes::from(bytes)),
        )
        .await
        .map(|_| ())
    }

    async fn auth_receive(&self) -> Result<Message, HostError> {
        let r = self
            .submit_ok(Sqe::auth_receive(RECEIVE_LEN), Xfer::Read(RECEIVE_LEN))
            .await?;
        Message::decode(&r.data)
            .map_err(|e| HostError::Authentication(format!("undecodable message: {e}")))
    }
}
