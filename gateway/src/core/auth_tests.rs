//! In-band authentication through the core: Connect's ATR, the gate before authentication,
//! whole transactions driven by the host library's [`HostTransaction`], and each way one
//! fails.

use std::collections::BTreeMap;
use std::sync::Arc;

use rbd_backend::IoBuf;

use super::tests::{
    connect, connect_data, fixture, identify, one, property_set_cc, run, rw, set_cdw, set_data_len,
    sqe, Fixture, CC_ENABLED, HOSTNQN, OTHER_HOST, SUBNQN,
};
use super::*;
use crate::auth::{DhGroup, DhchapSecret, HashFunction, Message};
use crate::host::{AuthOutcome, HostOptions, HostTransaction, Refused};
use crate::spec::{self, admin_opcode, fabrics, io_opcode, sc};

const CLOSED: u16 = 0xffff; // the CID `settle` reports an Action::Close under

fn secret(byte: u8) -> DhchapSecret {
    DhchapSecret::from_bytes(&[byte; 32], Some(HashFunction::Sha256)).expect("32 bytes")
}

fn keys(host: u8, ctrl: Option<u8>) -> HostKeys {
    HostKeys {
        host: secret(host),
        ctrl: ctrl.map(secret),
    }
}

/// The fixture's subsystem with HOSTNQN needing `keys`, and the target's policy.
fn auth_fixture(keys: HostKeys, policy: Option<AuthPolicy>) -> Fixture {
    let mut f = fixture();
    if let Some(policy) = policy {
        let target = Arc::try_unwrap(f.target).expect("only the fixture holds the target");
        f.target = Arc::new(target.with_auth_policy(policy));
    }
    subsystem(&f).set_host_keys(BTreeMap::from([(HOSTNQN.to_string(), Arc::new(keys))]));
    f
}

fn subsystem(f: &Fixture) -> Arc<Subsystem> {
    f.target.subsystem(SUBNQN).expect("subsystem")
}

fn host_options(host: u8, ctrl: Option<u8>) -> HostOptions {
    let mut opts = HostOptions::new(HOSTNQN);
    opts.dhchap_secret = Some(secret(host));
    opts.dhchap_ctrl_secret = ctrl.map(secret);
    opts
}

fn auth_command(fctype: u8, cid: u16, len: u32) -> [u8; 64] {
    let mut raw = sqe(fabrics::OPCODE, cid, 0);
    raw[4] = fctype;
    raw[41] = spec::auth::SPSP0;
    raw[42] = spec::auth::SPSP1;
    raw[43] = spec::auth::SECP_DHCHAP;
    set_cdw(&mut raw, 11, len);
    set_data_len(&mut raw, len);
    raw
}

/// Authentication Send of `message`: the status it completed with, and whether the queue
/// closed after it.
fn auth_send(q: &mut Queue, message: &Message) -> (Status, bool) {
    let bytes = message.encode();
    let raw = auth_command(fabrics::AUTH_SEND, 40, bytes.len() as u32);
    let responses = run(q, Command::from_bytes(&raw), Some(IoBuf::from_vec(bytes)));
    let closed = responses.iter().any(|r| r.completion.cid == CLOSED);
    (responses[0].completion.status, closed)
}

/// Authentication Receive with Linux's 4 KiB buffer: the message, and whether the queue
/// closed after it.
fn auth_receive(q: &mut Queue) -> (Message, bool) {
    let raw = auth_command(fabrics::AUTH_RECEIVE, 41, 4096);
    let responses = run(q, Command::from_bytes(&raw), None);
    let closed = responses.iter().any(|r| r.completion.cid == CLOSED);
    let first = &responses[0];
    assert!(
        first.completion.status.is_success(),
        "{:?}",
        first.completion.status
    );
    let data = first.data.as_ref().expect("receive returns data");
    assert_eq!(data.len(), 4096, "the whole allocation comes back");
    (Message::decode(data.as_slice()).expect("decodes"), closed)
}

/// A whole transaction on `q` as the host with `opts` runs it.
fn authenticate(q: &mut Queue, opts: &HostOptions) -> Result<AuthOutcome, Refused> {
    let mut host = HostTransaction::new(opts, SUBNQN).expect("secret set");
    assert_eq!(auth_send(q, &host.negotiate()), (Status::SUCCESS, false));
    let (challenge, _) = auth_receive(q);
    let reply = host.reply(challenge)?;
    assert_eq!(auth_send(q, &reply).0, Status::SUCCESS);
    let (success1, _) = auth_receive(q);
    let (success2, outcome) = host.finish(success1)?;
    if let Some(success2) = success2 {
        assert_eq!(auth_send(q, &success2), (Status::SUCCESS, false));
    }
    Ok(outcome)
}

/// Connect of the admin queue: (status, dword 0).
fn connect_admin(q: &mut Queue) -> (Status, u32) {
    let r = one(run(
        q,
        connect(0, 31, 0),
        Some(connect_data(SUBNQN, HOSTNQN, 0xffff)),
    ));
    (r.completion.status, r.completion.result as u32)
}

fn is_auth_required(status: Status) -> bool {
    status == Status::error(sc::AUTH_REQUIRED)
}

fn read_status(q: &mut Queue) -> Status {
    one(run(q, rw(io_opcode::READ, 7, 0, 1), None))
        .completion
        .status
}

#[test]
fn a_host_with_a_key_authenticates_before_anything_else() {
    let f = auth_fixture(keys(1, None), None);
    let mut admin = f.queue();
    let (status, dw0) = connect_admin(&mut admin);
    assert!(status.is_success());
    assert_ne!(dw0 & spec::fabrics::CONNECT_AUTHREQ_ATR, 0, "ATR set");
    assert_eq!(dw0 & spec::fabrics::CONNECT_AUTHREQ_ASCR, 0, "never ASCR");
    let cntlid = dw0 as u16;
    let ctrl = admin.controller().expect("controller").clone();
    assert!(ctrl.take_keep_alive(), "fresh controllers start seen");

    // Nothing but the transaction runs, and a refused Keep Alive does not count.
    assert!(is_auth_required(property_set_cc(&mut admin, CC_ENABLED)));
    assert!(is_auth_required(
        identify(&mut admin, spec::cns::CTRL, 0).completion.status
    ));
    let keep_alive = Command::from_bytes(&sqe(admin_opcode::KEEP_ALIVE, 9, 0));
    assert!(is_auth_required(
        one(run(&mut admin, keep_alive, None)).completion.status
    ));
    assert!(
        !ctrl.take_keep_alive(),
        "a refused keep-alive keeps nothing alive"
    );
    assert!(admin.awaits_authentication());

    let outcome = authenticate(&mut admin, &host_options(1, None)).expect("right key");
    assert_eq!(
        outcome,
        AuthOutcome {
            hash: HashFunction::Sha512,
            dhgroup: DhGroup::Ffdhe2048,
            bidirectional: false
        },
        "the default policy: the strongest hash, the cheapest group"
    );
    assert!(!admin.awaits_authentication());
    assert!(ctrl.take_keep_alive(), "the transaction's commands count");
    assert!(property_set_cc(&mut admin, CC_ENABLED).is_success());

    // Its I/O queues authenticate too, each on its own.
    let mut io = f.queue();
    let r = one(run(
        &mut io,
        connect(1, 127, 0),
        Some(connect_data(SUBNQN, HOSTNQN, cntlid)),
    ));
    assert!(r.completion.status.is_success());
    assert_ne!(
        r.completion.result as u32 & spec::fabrics::CONNECT_AUTHREQ_ATR,
        0
    );
    assert!(is_auth_required(read_status(&mut io)));
    authenticate(&mut io, &host_options(1, None)).expect("io queue");
    assert!(read_status(&mut io).is_success());
    assert_eq!(f.target.auth_counters().successes(), 2);
}

#[test]
fn each_hash_and_group_of_the_policy_is_negotiated() {
    for hash in HashFunction::ALL {
        for dhgroup in [DhGroup::Null, DhGroup::Ffdhe2048, DhGroup::Ffdhe3072] {
            let policy = AuthPolicy {
                hashes: vec![hash],
                dhgroups: vec![dhgroup],
            };
            let f = auth_fixture(keys(1, Some(2)), Some(policy));
            let mut admin = f.queue();
            connect_admin(&mut admin);
            let outcome = authenticate(&mut admin, &host_options(1, Some(2))).expect("right keys");
            assert_eq!(
                outcome,
                AuthOutcome {
                    hash,
                    dhgroup,
                    bidirectional: true
                }
            );
            assert!(
                property_set_cc(&mut admin, CC_ENABLED).is_success(),
                "{hash} {dhgroup}"
            );
        }
    }
}

/// The secrets' `XX` transformations: each key form the host and gateway agree on.
#[test]
fn every_secret_transformation_authenticates() {
    for transform in [
        None,
        Some(HashFunction::Sha256),
        Some(HashFunction::Sha384),
        Some(HashFunction::Sha512),
    ] {
        let secret = DhchapSecret::from_bytes(&[9; 48], transform).expect("48 bytes");
        let f = auth_fixture(
            HostKeys {
                host: secret.clone(),
                ctrl: None,
            },
            None,
        );
        let mut admin = f.queue();
        connect_admin(&mut admin);
        let mut opts = HostOptions::new(HOSTNQN);
        opts.dhchap_secret = Some(secret);
        authenticate(&mut admin, &opts).expect("same secret");
    }
}

#[test]
fn a_wrong_key_gets_failure1_and_ends_the_controller() {
    let f = auth_fixture(keys(1, None), None);
    let mut admin = f.queue();
    connect_admin(&mut admin);
    let ctrl = admin.controller().expect("controller").clone();
    let mut host = HostTransaction::new(&host_options(7, None), SUBNQN).expect("secret");
    auth_send(&mut admin, &host.negotiate());
    let (challenge, _) = auth_receive(&mut admin);
    let reply = host.reply(challenge).expect("reply");
    assert_eq!(
        auth_send(&mut admin, &reply),
        (Status::SUCCESS, false),
        "the send carrying a wrong response still succeeds, as with nvmet"
    );
    let (failure, closed) = auth_receive(&mut admin);
    assert_eq!(
        failure,
        Message::Failure1(crate::auth::Failure {
            t_id: reply.t_id(),
            reason: spec::auth::FAILURE_FAILED
        })
    );
    assert!(closed, "the queue closes after Failure1");
    assert!(ctrl.is_torn_down());
    assert!(subsystem(&f).controller(ctrl.cntlid).is_none());
    let failures: BTreeMap<_, _> = f.target.auth_counters().failures().into_iter().collect();
    assert_eq!(failures["failed"], 1);
    assert_eq!(f.target.auth_counters().successes(), 0);
    admin.close();
    let refusals = f.target.connect_refusals();
    assert_eq!(refusals.count(RefusalReason::AuthenticationFailed), 1);
    assert_eq!(
        refusals.count(RefusalReason::AuthenticationRequired),
        0,
        "a failed authentication is not also a missing one"
    );
}

/// A host that does not authenticate a queue that must is counted as refused once per
/// queue: when it sends another command first, or when it closes the queue (a Linux host
/// without a key gives up at Connect's ATR).
#[test]
fn a_queue_left_unauthenticated_counts_one_refusal() {
    let f = auth_fixture(keys(1, None), None);
    let refusals = || {
        f.target
            .connect_refusals()
            .count(RefusalReason::AuthenticationRequired)
    };
    let mut gives_up = f.queue();
    connect_admin(&mut gives_up);
    assert_eq!(refusals(), 0, "Connect itself succeeds, with ATR");
    gives_up.close();
    assert_eq!(refusals(), 1);

    let mut insists = f.queue();
    connect_admin(&mut insists);
    for _ in 0..3 {
        assert!(is_auth_required(property_set_cc(&mut insists, CC_ENABLED)));
    }
    insists.close();
    assert_eq!(refusals(), 2, "once for the queue, however many commands");

    let mut authenticates = f.queue();
    connect_admin(&mut authenticates);
    authenticate(&mut authenticates, &host_options(1, None)).expect("right key");
    authenticates.close();
    assert_eq!(
        refusals(),
        2,
        "an authenticated queue closing is no refusal"
    );
}

#[test]
fn a_host_asking_for_a_controller_key_the_gateway_lacks_is_refused() {
    let f = auth_fixture(keys(1, None), None);
    let mut admin = f.queue();
    connect_admin(&mut admin);
    let refused = authenticate(&mut admin, &host_options(1, Some(2))).expect_err("no ctrl key");
    assert!(refused.what.contains("refused: failed"), "{}", refused.what);
    assert!(admin.controller().expect("bound").is_torn_down());
}

#[test]
fn a_host_that_rejects_the_controller_response_sends_failure2_and_the_controller_ends() {
    let f = auth_fixture(keys(1, Some(2)), None);
    let mut admin = f.queue();
    connect_admin(&mut admin);
    // The host expects controller secret 3; the gateway proves itself with 2.
    let mut host = HostTransaction::new(&host_options(1, Some(3)), SUBNQN).expect("secret");
    auth_send(&mut admin, &host.negotiate());
    let reply = host.reply(auth_receive(&mut admin).0).expect("reply");
    auth_send(&mut admin, &reply);
    let refused = host
        .finish(auth_receive(&mut admin).0)
        .expect_err("wrong controller");
    let failure2 = refused.failure2.expect("the host tells the controller");
    assert_eq!(auth_send(&mut admin, &failure2), (Status::SUCCESS, true));
    assert!(admin.controller().expect("bound").is_torn_down());
    assert!(admin.awaits_authentication(), "not authenticated after all");
}

#[test]
fn nothing_in_common_with_the_host_is_refused_with_the_reason() {
    let policy = AuthPolicy {
        hashes: vec![HashFunction::Sha256],
        dhgroups: vec![DhGroup::Ffdhe8192],
    };
    let f = auth_fixture(keys(1, None), Some(policy));
    let mut admin = f.queue();
    connect_admin(&mut admin);
    let mut opts = host_options(1, None);
    opts.dhchap_dhgroups = vec![DhGroup::Null, DhGroup::Ffdhe2048];
    let refused = authenticate(&mut admin, &opts).expect_err("no common group");
    assert!(
        refused.what.contains("dhgroup_unusable"),
        "{}",
        refused.what
    );
}

#[test]
fn messages_out_of_order_end_the_transaction() {
    let f = auth_fixture(keys(1, None), None);
    let mut admin = f.queue();
    connect_admin(&mut admin);
    // Receive before any Negotiate.
    let (message, closed) = auth_receive(&mut admin);
    assert!(
        matches!(message, Message::Failure1(f) if f.reason == spec::auth::FAILURE_INCORRECT_MESSAGE)
    );
    assert!(closed);

    // A Success2 where the Reply belongs.
    let mut admin = f.queue();
    connect_admin(&mut admin);
    let host = HostTransaction::new(&host_options(1, None), SUBNQN).expect("secret");
    auth_send(&mut admin, &host.negotiate());
    auth_receive(&mut admin);
    let t_id = host.negotiate().t_id();
    assert_eq!(
        auth_send(&mut admin, &Message::Success2 { t_id }),
        (Status::SUCCESS, false)
    );
    let (message, closed) = auth_receive(&mut admin);
    assert!(
        matches!(message, Message::Failure1(f) if f.reason == spec::auth::FAILURE_INCORRECT_MESSAGE)
    );
    assert!(closed);
}

#[test]
fn malformed_commands_get_an_nvme_status_and_leave_the_transaction_alone() {
    let f = auth_fixture(keys(1, None), None);
    let mut admin = f.queue();
    connect_admin(&mut admin);
    let negotiate = HostTransaction::new(&host_options(1, None), SUBNQN)
        .expect("secret")
        .negotiate()
        .encode();
    let mut bad_secp = auth_command(fabrics::AUTH_SEND, 1, negotiate.len() as u32);
    bad_secp[43] = 0xea;
    let r = one(run(
        &mut admin,
        Command::from_bytes(&bad_secp),
        Some(IoBuf::from_vec(negotiate.clone())),
    ));
    assert_eq!(r.completion.status, Status::error(sc::INVALID_FIELD));
    // TL says 100 bytes, the SGL carries 72.
    let mut raw = auth_command(fabrics::AUTH_SEND, 2, negotiate.len() as u32);
    set_cdw(&mut raw, 11, 100);
    let r = one(run(
        &mut admin,
        Command::from_bytes(&raw),
        Some(IoBuf::from_vec(negotiate.clone())),
    ));
    assert_eq!(r.completion.status, Status::error(sc::SGL_INVALID_DATA));
    let zero_al = auth_command(fabrics::AUTH_RECEIVE, 3, 0);
    let r = one(run(&mut admin, Command::from_bytes(&zero_al), None));
    assert_eq!(r.completion.status, Status::error(sc::INVALID_FIELD));
    // Garbage: the send succeeds, the next receive reports why and ends it.
    assert_eq!(
        auth_send(
            &mut admin,
            &Message::Failure1(crate::auth::Failure { t_id: 1, reason: 1 })
        )
        .0,
        Status::SUCCESS
    );
    let (message, closed) = auth_receive(&mut admin);
    assert!(matches!(message, Message::Failure1(_)));
    assert!(closed);
}

#[test]
fn re_authentication_keeps_commands_flowing_and_takes_the_new_key() {
    let f = auth_fixture(keys(1, None), None);
    let mut admin = f.queue();
    let (_, dw0) = connect_admin(&mut admin);
    authenticate(&mut admin, &host_options(1, None)).expect("first");
    assert!(property_set_cc(&mut admin, CC_ENABLED).is_success());
    let mut io = f.queue();
    one(run(
        &mut io,
        connect(1, 127, 0),
        Some(connect_data(SUBNQN, HOSTNQN, dw0 as u16)),
    ));
    authenticate(&mut io, &host_options(1, None)).expect("io queue, first");

    // The key changes in the configuration; the host re-authenticates with the new one.
    subsystem(&f).set_host_keys(BTreeMap::from([(
        HOSTNQN.to_string(),
        Arc::new(keys(5, None)),
    )]));
    let mut host = HostTransaction::new(&host_options(5, None), SUBNQN).expect("secret");
    auth_send(&mut admin, &host.negotiate());
    assert!(
        identify(&mut admin, spec::cns::CTRL, 0)
            .completion
            .status
            .is_success(),
        "an authenticated queue keeps working while it re-authenticates"
    );
    let reply = host.reply(auth_receive(&mut admin).0).expect("reply");
    auth_send(&mut admin, &reply);
    host.finish(auth_receive(&mut admin).0)
        .expect("new key accepted");
    // Then its I/O queues, with the key the admin queue just took.
    authenticate(&mut io, &host_options(5, None)).expect("io queue, new key");
    assert!(read_status(&mut io).is_success());
    assert_eq!(f.target.auth_counters().successes(), 4);

    // The old key no longer does: the controller ends.
    let refused = authenticate(&mut admin, &host_options(1, None)).expect_err("old key");
    assert!(refused.what.contains("failed"), "{}", refused.what);
    assert!(admin.controller().expect("bound").is_torn_down());
}

#[test]
fn hosts_without_a_key_and_the_discovery_controller_do_not_authenticate() {
    let f = auth_fixture(keys(1, None), None);
    let sub = subsystem(&f);
    sub.set_access(HostAccess::Only(
        [HOSTNQN.to_string(), OTHER_HOST.to_string()].into(),
    ));
    let mut other = f.queue();
    let r = one(run(
        &mut other,
        connect(0, 31, 0),
        Some(connect_data(SUBNQN, OTHER_HOST, 0xffff)),
    ));
    assert!(r.completion.status.is_success());
    assert_eq!(
        r.completion.result as u32 & spec::fabrics::CONNECT_AUTHREQ_ATR,
        0
    );
    assert!(property_set_cc(&mut other, CC_ENABLED).is_success());
    // It may not start a transaction it was not asked for.
    let negotiate = HostTransaction::new(&host_options(1, None), SUBNQN)
        .expect("secret")
        .negotiate();
    assert_eq!(
        auth_send(&mut other, &negotiate).0,
        Status::error(sc::INVALID_OPCODE)
    );

    let mut discovery = f.queue();
    let r = one(run(
        &mut discovery,
        connect(0, 31, 0),
        Some(connect_data(spec::DISCOVERY_NQN, HOSTNQN, 0xffff)),
    ));
    assert!(r.completion.status.is_success());
    assert_eq!(
        r.completion.result as u32 & spec::fabrics::CONNECT_AUTHREQ_ATR,
        0
    );
}

/// A host's entry removed before its re-authentication: refused, not authenticated with
/// keys that are gone.
#[test]
fn re_authentication_after_the_key_was_removed_fails() {
    let f = auth_fixture(keys(1, None), None);
    let mut admin = f.queue();
    let (_, dw0) = connect_admin(&mut admin);
    authenticate(&mut admin, &host_options(1, None)).expect("first");
    assert!(property_set_cc(&mut admin, CC_ENABLED).is_success());
    subsystem(&f).set_host_keys(BTreeMap::new());
    let host = HostTransaction::new(&host_options(1, None), SUBNQN).expect("secret");
    assert_eq!(
        auth_send(&mut admin, &host.negotiate()),
        (Status::SUCCESS, false)
    );
    // Before the host hears of the failure, an I/O queue of the controller is still asked.
    let mut io = f.queue();
    let r = one(run(
        &mut io,
        connect(1, 127, 0),
        Some(connect_data(SUBNQN, HOSTNQN, dw0 as u16)),
    ));
    assert_ne!(
        r.completion.result as u32 & spec::fabrics::CONNECT_AUTHREQ_ATR,
        0
    );
    assert!(is_auth_required(read_status(&mut io)));
    let (failure, closed) = auth_receive(&mut admin);
    assert!(matches!(failure, Message::Failure1(f) if f.reason == spec::auth::FAILURE_FAILED));
    assert!(closed);
}
