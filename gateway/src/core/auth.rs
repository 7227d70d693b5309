//! In-band authentication on the controller side: DH-HMAC-CHAP over Authentication Send /
//! Receive, as Linux nvmet runs it (`drivers/nvme/target/fabrics-cmd-auth.c`).
//!
//! A host whose entry in the subsystem carries a DH-HMAC-CHAP key must authenticate every
//! queue it connects: Connect answers with ATR set, and until the queue's transaction
//! succeeds every other command gets Authentication Required. One transaction is four or
//! five commands, each answered before the host sends the next:
//!
//! | host sends                 | controller answers                                 |
//! | -------------------------- | -------------------------------------------------- |
//! | Auth Send: Negotiate       | success (the hash and DH group are chosen)         |
//! | Auth Receive               | Challenge: C1, S1, the controller's DH value       |
//! | Auth Send: Reply           | success (R1 checked; R2 computed if C2 came)       |
//! | Auth Receive               | Success1 (with R2), or Failure1                    |
//! | Auth Send: Success2        | success (only when the host asked for R2)          |
//!
//! A protocol error never fails the command carrying it: like nvmet, the controller answers
//! the next Auth Receive with Failure1 and its reason, then ends the controller. A Negotiate
//! starts over at any point; on an authenticated queue (the host re-authenticating, e.g.
//! after its key was changed in sysfs) commands keep flowing meanwhile. On the admin queue a
//! Negotiate takes the host's current keys, so a key changed in the configuration applies
//! from the host's next authentication on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rbd_backend::IoBuf;
use ring::rand::{SecureRandom, SystemRandom};
use zeroize::Zeroizing;

use super::command::{Command, Status};
use super::controller::TeardownReason;
use super::queue::{Action, Binding, Queue};
use super::refusals::RefusalReason;
use crate::auth::{
    augmented_challenge, controller_response, host_response, responses_match, Challenge, DhGroup,
    DhKeyPair, DhchapSecret, Failure, HashFunction, Message, Negotiate, Reply, ResponseInput,
    Success1,
};
use crate::spec::{auth as ids, fabrics, sc};

/// Byte offsets in an Authentication Send / Receive command.
const CMD_SPSP0: usize = 41;
const CMD_SPSP1: usize = 42;
const CMD_SECP: usize = 43;
/// Dword 11: the transfer length (Send) or allocation length (Receive).
const CMD_LENGTH_DWORD: usize = 11;

/// A host's DH-HMAC-CHAP secrets for one subsystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostKeys {
    /// Proves the host (`dhchap_key`; the host's `--dhchap-secret`).
    pub host: DhchapSecret,
    /// Proves the gateway when the host asks for it (`dhchap_ctrl_key`; the host's
    /// `--dhchap-ctrl-secret`).
    pub ctrl: Option<DhchapSecret>,
}

/// The hashes and DH groups this gateway accepts, in its order of preference: a transaction
/// uses the first of each list that the host offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthPolicy {
    pub hashes: Vec<HashFunction>,
    pub dhgroups: Vec<DhGroup>,
}

impl Default for AuthPolicy {
    /// The strongest hash, and the cheapest DH group (a transaction with ffdhe2048 costs the
    /// gateway ~1 ms of CPU, with ffdhe8192 ~31 ms; every queue of every host runs one);
    /// NULL last, for hosts that offer no group.
    fn default() -> Self {
        Self {
            hashes: HashFunction::ALL.to_vec(),
            dhgroups: vec![
                DhGroup::Ffdhe2048,
                DhGroup::Ffdhe3072,
                DhGroup::Ffdhe4096,
                DhGroup::Ffdhe6144,
                DhGroup::Ffdhe8192,
                DhGroup::Null,
            ],
        }
    }
}

/// Authentication outcomes since start, for the metrics.
#[derive(Debug, Default)]
pub struct AuthCounters {
    successes: AtomicU64,
    /// Indexed by the failure reason code (1..=7; 0 counts unknown ones).
    failures: [AtomicU64; 8],
}

impl AuthCounters {
    pub fn successes(&self) -> u64 {
        self.successes.load(Ordering::Relaxed)
    }

    /// (reason name, count) for every reason.
    pub fn failures(&self) -> Vec<(&'static str, u64)> {
        (1..self.failures.len() as u8)
            .map(|code| {
                (
                    reason_name(code),
                    self.failures[usize::from(code)].load(Ordering::Relaxed),
                )
            })
            .collect()
    }

    fn count_failure(&self, reason: u8) {
        let slot = if usize::from(reason) < self.failures.len() {
            usize::from(reason)
        } else {
            0
        };
        self.failures[slot].fetch_add(1, Ordering::Relaxed);
    }
}

/// The name of a failure reason (`rescode_exp`), for logs and metrics.
pub fn reason_name(reason: u8) -> &'static str {
    match reason {
        ids::FAILURE_FAILED => "failed",
        ids::FAILURE_NOT_USABLE => "not_usable",
        ids::FAILURE_CONCAT_MISMATCH => "concat_mismatch",
        ids::FAILURE_HASH_UNUSABLE => "hash_unusable",
        ids::FAILURE_DHGROUP_UNUSABLE => "dhgroup_unusable",
        ids::FAILURE_INCORRECT_PAYLOAD => "incorrect_payload",
        ids::FAILURE_INCORRECT_MESSAGE => "incorrect_message",
        _ => "unknown",
    }
}

/// Where a queue's transaction stands.
enum Step {
    /// Waiting for AUTH_Negotiate.
    Negotiate,
    /// Negotiated: the next Auth Receive gets the challenge.
    Challenge {
        t_id: u16,
        hash: HashFunction,
        dhgroup: DhGroup,
    },
    /// Challenge sent: waiting for the Reply.
    Reply(Box<Challenged>),
    /// The host's response was right: the next Auth Receive gets Success1, with R2 if the
    /// host sent a challenge of its own.
    Success1 {
        t_id: u16,
        hash: HashFunction,
        dhgroup: DhGroup,
        ctrl_response: Option<Zeroizing<Vec<u8>>>,
    },
    /// Success1 carried R2: waiting for the host's Success2.
    Success2 {
        t_id: u16,
        hash: HashFunction,
        dhgroup: DhGroup,
    },
    /// Failed: the next Auth Receive gets Failure1, and the controller ends.
    Failure1 { t_id: u16, reason: u8 },
}

struct Challenged {
    t_id: u16,
    hash: HashFunction,
    dh: Option<DhKeyPair>,
    c1: Zeroizing<Vec<u8>>,
    s1: u32,
}

/// One queue's authentication, present when the host must authenticate.
pub(crate) struct QueueAuth {
    keys: Arc<HostKeys>,
    authenticated: bool,
    step: Step,
    /// A refusal was counted for this queue already (it is counted once).
    refusal_counted: bool,
}

impl QueueAuth {
    pub(crate) fn new(keys: Arc<HostKeys>) -> Self {
        Self {
            keys,
            authenticated: false,
            step: Step::Negotiate,
            refusal_counted: false,
        }
    }

    pub(crate) fn is_authenticated(&self) -> bool {
        self.authenticated
    }

    /// True the first time: the caller counts this queue's refusal.
    pub(crate) fn first_refusal(&mut self) -> bool {
        !std::mem::replace(&mut self.refusal_counted, true)
    }
}

/// Whether a command may run on a queue that has not authenticated: the commands of the
/// transaction itself, and Disconnect.
pub(crate) fn allowed_before_authentication(cmd: &Command) -> bool {
    cmd.is_fabrics()
        && matches!(
            cmd.fctype(),
            fabrics::AUTH_SEND | fabrics::AUTH_RECEIVE | fabrics::DISCONNECT
        )
}

/// Checks SECP, SPSP0/1 and the length dword against the data the command carries.
fn check_fields(cmd: &Command, data_len: usize) -> Result<usize, Status> {
    let raw = cmd.as_bytes();
    if raw[CMD_SECP] != ids::SECP_DHCHAP
        || raw[CMD_SPSP0] != ids::SPSP0
        || raw[CMD_SPSP1] != ids::SPSP1
    {
        return Err(Status::error(sc::INVALID_FIELD));
    }
    let length = cmd.cdw(CMD_LENGTH_DWORD) as usize;
    if length == 0 {
        return Err(Status::error(sc::INVALID_FIELD));
    }
    if length != data_len {
        return Err(Status::error(sc::SGL_INVALID_DATA));
    }
    Ok(length)
}

fn random_bytes(len: usize) -> Option<Zeroizing<Vec<u8>>> {
    let mut bytes = Zeroizing::new(vec![0u8; len]);
    SystemRandom::new().fill(&mut bytes).ok()?;
    Some(bytes)
}

/// A sequence number: random, never 0 (which a host reads as "none").
fn random_seqnum() -> Option<u32> {
    let bytes = random_bytes(4)?;
    Some(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]).max(1))
}

fn failure(t_id: u16, reason: u8) -> Step {
    Step::Failure1 { t_id, reason }
}

impl Queue {
    /// Authentication Send and Receive (fabrics command types 05h and 06h).
    pub(crate) fn execute_auth(
        &mut self,
        binding: &Binding,
        cmd: Command,
        data: Option<IoBuf>,
        out: &mut Vec<Action>,
    ) {
        let Some(mut auth) = self.auth.take() else {
            // Nothing to authenticate: the host has no key here.
            if let Some(buf) = data {
                self.recycle(buf);
            }
            self.respond(out, cmd.cid(), Status::error(sc::INVALID_OPCODE));
            return;
        };
        if cmd.fctype() == fabrics::AUTH_SEND {
            self.auth_send(binding, &mut auth, &cmd, data, out);
        } else {
            if let Some(buf) = data {
                self.recycle(buf);
            }
            self.auth_receive(binding, &mut auth, &cmd, out);
        }
        self.auth = Some(auth);
    }

    fn auth_send(
        &mut self,
        binding: &Binding,
        auth: &mut QueueAuth,
        cmd: &Command,
        data: Option<IoBuf>,
        out: &mut Vec<Action>,
    ) {
        let data_len = data.as_ref().map_or(0, IoBuf::len);
        if let Err(status) = check_fields(cmd, data_len) {
            if let Some(buf) = data {
                self.recycle(buf);
            }
            self.respond(out, cmd.cid(), status);
            return;
        }
        let message = data.as_ref().map(|d| Message::decode(d.as_slice()));
        if let Some(buf) = data {
            self.recycle(buf);
        }
        let step = std::mem::replace(&mut auth.step, Step::Negotiate);
        auth.step = match message {
            Some(Ok(Message::Negotiate(negotiate))) => self.negotiate(binding, auth, &negotiate),
            Some(Ok(Message::Reply(reply))) => match step {
                Step::Reply(challenged) => self.check_reply(binding, auth, *challenged, &reply),
                _ => failure(reply.t_id, ids::FAILURE_INCORRECT_MESSAGE),
            },
            Some(Ok(Message::Success2 { t_id })) => match step {
                Step::Success2 {
                    t_id: expected,
                    hash,
                    dhgroup,
                } if t_id == expected => {
                    self.authenticated(binding, auth, hash, dhgroup, true);
                    Step::Negotiate
                }
                Step::Success2 { t_id, .. } => failure(t_id, ids::FAILURE_INCORRECT_PAYLOAD),
                _ => failure(t_id, ids::FAILURE_INCORRECT_MESSAGE),
            },
            Some(Ok(Message::Failure2(Failure { reason, .. }))) => {
                // The host gave up (it did not accept our response, or our challenge).
                self.respond(out, cmd.cid(), Status::SUCCESS);
                self.auth_failed(binding, auth, reason, "the host sent Failure2", out);
                return;
            }
            Some(Ok(other)) => failure(other.t_id(), ids::FAILURE_INCORRECT_MESSAGE),
            Some(Err(e)) => {
                tracing::debug!(error = %e, "undecodable authentication message");
                failure(0, e.reason)
            }
            None => failure(0, ids::FAILURE_INCORRECT_PAYLOAD),
        };
        self.respond(out, cmd.cid(), Status::SUCCESS);
    }

    /// AUTH_Negotiate: picks the hash and DH group. It first takes the host's current keys
    /// (the host may be re-authenticating after a key change): the admin queue from the
    /// subsystem, for the controller; an I/O queue the controller's, as the host
    /// re-authenticates its admin queue first.
    fn negotiate(&self, binding: &Binding, auth: &mut QueueAuth, negotiate: &Negotiate) -> Step {
        let t_id = negotiate.t_id;
        let ctrl = &binding.controller;
        let current = if binding.qid == 0 {
            let keys = ctrl.subsystem.host_keys(&ctrl.hostnqn);
            // Keys gone fail this transaction (and end the controller) below; they never
            // leave the controller without keys, which would let its next I/O queue in
            // unasked meanwhile.
            if keys.is_some() {
                ctrl.set_auth_keys(keys.clone());
            }
            keys
        } else {
            ctrl.auth_keys()
        };
        match current {
            Some(keys) => auth.keys = keys,
            None => return failure(t_id, ids::FAILURE_FAILED),
        }
        if negotiate.sc_c != 0 {
            return failure(t_id, ids::FAILURE_CONCAT_MISMATCH);
        }
        let policy = self.target.auth_policy();
        let hash = policy
            .hashes
            .iter()
            .copied()
            .find(|h| negotiate.hash_ids.contains(&h.id()));
        let Some(hash) = hash else {
            return failure(t_id, ids::FAILURE_HASH_UNUSABLE);
        };
        let dhgroup = policy
            .dhgroups
            .iter()
            .copied()
            .find(|g| negotiate.dhgroup_ids.contains(&g.id()));
        let Some(dhgroup) = dhgroup else {
            return failure(t_id, ids::FAILURE_DHGROUP_UNUSABLE);
        };
        Step::Challenge {
            t_id,
            hash,
            dhgroup,
        }
    }

    /// DH-HMAC-CHAP_Reply: derives the session key, checks R1, and computes R2 if the host
    /// sent a challenge of its own.
    fn check_reply(
        &self,
        binding: &Binding,
        auth: &mut QueueAuth,
        challenged: Challenged,
        reply: &Reply,
    ) -> Step {
        let Challenged {
            t_id,
            hash,
            dh,
            c1,
            s1,
        } = challenged;
        if reply.t_id != t_id || reply.response.len() != hash.digest_len() {
            return failure(t_id, ids::FAILURE_INCORRECT_PAYLOAD);
        }
        let session_key = match &dh {
            None if !reply.dh_value.is_empty() => {
                return failure(t_id, ids::FAILURE_INCORRECT_PAYLOAD);
            }
            None => None,
            Some(pair) => match pair.shared_secret(&reply.dh_value) {
                Ok(key) => Some(key),
                Err(e) => {
                    tracing::debug!(error = %e, "host DH value refused");
                    return failure(t_id, ids::FAILURE_DHGROUP_UNUSABLE);
                }
            },
        };
        let dhgroup = dh.as_ref().map_or(DhGroup::Null, DhKeyPair::group);
        let ctrl = &binding.controller;
        let subnqn = ctrl.subsystem.nqn();
        let input = ResponseInput {
            hash,
            seqnum: s1,
            t_id,
            hostnqn: &ctrl.hostnqn,
            subnqn,
        };
        let host_key = auth.keys.host.transform(&ctrl.hostnqn);
        let ca1 = augmented_challenge(hash, &c1, session_key.as_deref().map(Vec::as_slice));
        let expected = host_response(&input, &host_key, &ca1);
        if !responses_match(&expected, &reply.response) {
            tracing::debug!(cntlid = ctrl.cntlid, "host response mismatch");
            return failure(t_id, ids::FAILURE_FAILED);
        }
        let ctrl_response = match &reply.ctrl_challenge {
            None => {
                self.authenticated(binding, auth, hash, dhgroup, false);
                None
            }
            Some(c2) => {
                let Some(ctrl_secret) = &auth.keys.ctrl else {
                    // The host wants the gateway to prove itself, and it has no key to.
                    return failure(t_id, ids::FAILURE_FAILED);
                };
                if c2.len() != hash.digest_len() {
                    return failure(t_id, ids::FAILURE_INCORRECT_PAYLOAD);
                }
                let ctrl_key = ctrl_secret.transform(subnqn);
                let ca2 = augmented_challenge(hash, c2, session_key.as_deref().map(Vec::as_slice));
                let input = ResponseInput {
                    seqnum: reply.seqnum,
                    ..input
                };
                Some(controller_response(&input, &ctrl_key, &ca2))
            }
        };
        Step::Success1 {
            t_id,
            hash,
            dhgroup,
            ctrl_response,
        }
    }

    fn auth_receive(
        &mut self,
        binding: &Binding,
        auth: &mut QueueAuth,
        cmd: &Command,
        out: &mut Vec<Action>,
    ) {
        let allocation = match check_fields(cmd, cmd.data_len() as usize) {
            Ok(len) => len,
            Err(status) => {
                self.respond(out, cmd.cid(), status);
                return;
            }
        };
        let step = std::mem::replace(&mut auth.step, Step::Negotiate);
        let (message, next) = match step {
            Step::Challenge {
                t_id,
                hash,
                dhgroup,
            } => match challenge(t_id, hash, dhgroup) {
                Ok((message, challenged)) => (message, Step::Reply(Box::new(challenged))),
                Err(reason) => fail_now(t_id, reason),
            },
            Step::Success1 {
                t_id,
                hash,
                dhgroup,
                ctrl_response,
            } => {
                let bidirectional = ctrl_response.is_some();
                let message = Message::Success1(Success1 {
                    t_id,
                    hash_len: hash.digest_len() as u8,
                    ctrl_response: ctrl_response.map(|r| r.to_vec()),
                });
                let next = if bidirectional {
                    Step::Success2 {
                        t_id,
                        hash,
                        dhgroup,
                    }
                } else {
                    Step::Negotiate
                };
                (message, next)
            }
            Step::Failure1 { t_id, reason } => fail_now(t_id, reason),
            Step::Negotiate | Step::Reply(_) | Step::Success2 { .. } => {
                fail_now(0, ids::FAILURE_INCORRECT_MESSAGE)
            }
        };
        let bytes = message.encode();
        if bytes.len() > allocation {
            // Linux hosts allocate 4 KiB, more than any message takes.
            auth.step = failure(message.t_id(), ids::FAILURE_INCORRECT_PAYLOAD);
            self.respond(out, cmd.cid(), Status::error(sc::INVALID_FIELD));
            return;
        }
        let mut buf = self.take_buffer(allocation);
        buf.as_mut_slice()[..bytes.len()].copy_from_slice(&bytes);
        buf.as_mut_slice()[bytes.len()..].fill(0);
        let completion = self.completion(cmd.cid(), Status::SUCCESS);
        self.respond_with(out, completion, Some(buf));
        match (message, next) {
            (Message::Failure1(f), _) => {
                self.auth_failed(binding, auth, f.reason, "failure1 sent", out)
            }
            (_, next) => auth.step = next,
        }
    }

    fn authenticated(
        &self,
        binding: &Binding,
        auth: &mut QueueAuth,
        hash: HashFunction,
        dhgroup: DhGroup,
        bidirectional: bool,
    ) {
        auth.authenticated = true;
        self.target
            .auth_counters()
            .successes
            .fetch_add(1, Ordering::Relaxed);
        let ctrl = &binding.controller;
        tracing::info!(cntlid = ctrl.cntlid, qid = binding.qid, host = %ctrl.hostnqn, %hash, %dhgroup, bidirectional, "queue authenticated");
    }

    /// Ends the transaction and the controller: a queue that failed to authenticate (or to
    /// re-authenticate) serves nothing more, as with Linux nvmet.
    fn auth_failed(
        &self,
        binding: &Binding,
        auth: &mut QueueAuth,
        reason: u8,
        what: &str,
        out: &mut Vec<Action>,
    ) {
        auth.authenticated = false;
        auth.step = Step::Negotiate;
        self.target.auth_counters().count_failure(reason);
        // Logged below, with the authentication's own details.
        auth.first_refusal();
        self.target
            .connect_refusals()
            .tally(RefusalReason::AuthenticationFailed);
        let ctrl = &binding.controller;
        tracing::warn!(cntlid = ctrl.cntlid, qid = binding.qid, host = %ctrl.hostnqn, subsystem = ctrl.subsystem.nqn(), reason = reason_name(reason), what, "authentication failed");
        ctrl.teardown(TeardownReason::AuthenticationFailed);
        out.push(Action::Close);
    }
}

/// A Failure1 to send now.
fn fail_now(t_id: u16, reason: u8) -> (Message, Step) {
    (Message::Failure1(Failure { t_id, reason }), Step::Negotiate)
}

/// The challenge: C1 and S1 at random and, with a DH group, a fresh key pair.
fn challenge(t_id: u16, hash: HashFunction, dhgroup: DhGroup) -> Result<(Message, Challenged), u8> {
    let c1 = random_bytes(hash.digest_len()).ok_or(ids::FAILURE_FAILED)?;
    let s1 = random_seqnum().ok_or(ids::FAILURE_FAILED)?;
    let dh = match dhgroup {
        DhGroup::Null => None,
        group => Some(DhKeyPair::generate(group).map_err(|_| ids::FAILURE_DHGROUP_UNUSABLE)?),
    };
    let message = Message::Challenge(Challenge {
        t_id,
        hash,
        dhgroup,
        seqnum: s1,
        challenge: c1.to_vec(),
        dh_value: dh
            .as_ref()
            .map_or_else(Vec::new, |d| d.public_value().to_vec()),
    });
    Ok((
        message,
        Challenged {
            t_id,
            hash,
            dh,
            c1,
            s1,
        },
    ))
}
