//! Refused Connects: each reason counted (the metric's source) and logged with the host,
//! the subsystem and, through the transport's span, the peer; an empty host NQN.

use std::collections::BTreeSet;
use std::io::Write;
use std::sync::{Arc, Mutex};

use rbd_backend::IoBuf;

use super::tests::{
    connect, connect_data, fixture, io_ready, one, property_set_cc, run, Fixture, CC_ENABLED,
    HOSTNQN, OTHER_HOST, SUBNQN,
};
use super::*;
use crate::spec::{self, sc};

/// Connect on a fresh queue of `f`: its status, and the queue.
fn connect_with(f: &Fixture, cmd: Command, data: Option<IoBuf>) -> (Status, Queue) {
    let mut q = f.queue();
    let status = one(run(&mut q, cmd, data)).completion.status;
    (status, q)
}

fn admin_connect_data(subnqn: &str, hostnqn: &str) -> Option<IoBuf> {
    Some(connect_data(subnqn, hostnqn, 0xffff))
}

/// Asserts that `reason` was counted once and nothing else was.
fn refused_once(f: &Fixture, reason: RefusalReason) {
    for (name, count) in f.target.connect_refusals().counts() {
        let expected = u64::from(name == reason.name());
        assert_eq!(count, expected, "{name} after a {} refusal", reason.name());
    }
}

/// An admin queue connected (not enabled): its controller ID.
fn admin_connected(f: &Fixture) -> (u16, Queue) {
    let mut q = f.queue();
    let r = one(run(
        &mut q,
        connect(0, 31, 0),
        admin_connect_data(SUBNQN, HOSTNQN),
    ));
    assert!(r.completion.status.is_success(), "{r:?}");
    (r.completion.result as u16, q)
}

#[test]
fn an_incompatible_record_format_is_counted() {
    let f = fixture();
    let mut raw = *connect(0, 31, 0).as_bytes();
    raw[40] = 1; // RECFMT
    let (status, _q) = connect_with(
        &f,
        Command::from_bytes(&raw),
        admin_connect_data(SUBNQN, HOSTNQN),
    );
    assert_eq!(status.code(), sc::CONNECT_FORMAT);
    refused_once(&f, RefusalReason::IncompatibleFormat);
}

#[test]
fn a_connect_without_data_is_counted() {
    let f = fixture();
    let (status, _q) = connect_with(&f, connect(0, 31, 0), None);
    assert_eq!(status.code(), sc::SGL_INVALID_DATA);
    refused_once(&f, RefusalReason::NoConnectData);
}

#[test]
fn an_empty_subsystem_nqn_is_counted() {
    let f = fixture();
    let (status, _q) = connect_with(&f, connect(0, 31, 0), admin_connect_data("", HOSTNQN));
    assert_eq!(status.code(), sc::CONNECT_INVALID_PARAM);
    refused_once(&f, RefusalReason::InvalidSubsystemNqn);
}

#[test]
fn a_host_nqn_longer_than_223_bytes_is_counted() {
    let f = fixture();
    let long = "h".repeat(spec::NQN_MAX_LEN + 1);
    let (status, _q) = connect_with(&f, connect(0, 31, 0), admin_connect_data(SUBNQN, &long));
    assert_eq!(status.code(), sc::CONNECT_INVALID_PARAM);
    refused_once(&f, RefusalReason::InvalidHostNqn);
}

#[test]
fn an_unknown_subsystem_is_counted() {
    let f = fixture();
    let (status, _q) = connect_with(
        &f,
        connect(0, 31, 0),
        admin_connect_data("nqn.2016-06.io.test:nope", HOSTNQN),
    );
    assert_eq!(status.code(), sc::CONNECT_INVALID_PARAM);
    refused_once(&f, RefusalReason::UnknownSubsystem);
}

#[test]
fn a_host_not_allowed_is_counted() {
    let f = fixture();
    let (status, _q) = connect_with(
        &f,
        connect(0, 31, 0),
        admin_connect_data(SUBNQN, OTHER_HOST),
    );
    assert_eq!(status.code(), sc::CONNECT_INVALID_HOST);
    refused_once(&f, RefusalReason::HostNotAllowed);
}

#[test]
fn an_invalid_sqsize_is_counted() {
    let f = fixture();
    let (status, _q) = connect_with(&f, connect(0, 0, 0), admin_connect_data(SUBNQN, HOSTNQN));
    assert_eq!(status.code(), sc::CONNECT_INVALID_PARAM);
    refused_once(&f, RefusalReason::InvalidSqsize);
}

#[test]
fn an_admin_connect_for_a_given_controller_id_is_counted() {
    let f = fixture();
    let (status, _q) = connect_with(
        &f,
        connect(0, 31, 0),
        Some(connect_data(SUBNQN, HOSTNQN, 5)),
    );
    assert_eq!(status.code(), sc::CONNECT_INVALID_PARAM);
    refused_once(&f, RefusalReason::InvalidControllerId);
}

#[test]
fn running_out_of_controller_ids_is_counted() {
    let f = fixture();
    // The fixture's range is 10..=12.
    let held: Vec<_> = (0..3).map(|_| admin_connected(&f)).collect();
    let (status, _q) = connect_with(&f, connect(0, 31, 0), admin_connect_data(SUBNQN, HOSTNQN));
    assert_eq!(status.code(), sc::CONNECT_CTRL_BUSY);
    refused_once(&f, RefusalReason::ControllerIdsExhausted);
    drop(held);
}

#[test]
fn an_io_connect_to_an_unknown_controller_is_counted() {
    let f = fixture();
    let (status, _q) = connect_with(
        &f,
        connect(1, 31, 0),
        Some(connect_data(SUBNQN, HOSTNQN, 11)),
    );
    assert_eq!(status.code(), sc::CONNECT_INVALID_PARAM);
    refused_once(&f, RefusalReason::UnknownController);
}

#[test]
fn an_io_connect_by_another_host_is_counted() {
    let f = fixture();
    f.target
        .subsystem(SUBNQN)
        .expect("subsystem")
        .set_access(HostAccess::Only(BTreeSet::from([
            HOSTNQN.to_string(),
            OTHER_HOST.to_string(),
        ])));
    let (cntlid, mut admin) = admin_connected(&f);
    assert!(property_set_cc(&mut admin, CC_ENABLED).is_success());
    let (status, _q) = connect_with(
        &f,
        connect(1, 31, 0),
        Some(connect_data(SUBNQN, OTHER_HOST, cntlid)),
    );
    assert_eq!(status.code(), sc::CONNECT_INVALID_PARAM);
    refused_once(&f, RefusalReason::HostMismatch);
}

#[test]
fn an_io_connect_before_the_controller_is_enabled_is_counted() {
    let f = fixture();
    let (cntlid, _admin) = admin_connected(&f);
    let (status, _q) = connect_with(
        &f,
        connect(1, 31, 0),
        Some(connect_data(SUBNQN, HOSTNQN, cntlid)),
    );
    assert_eq!(status.code(), sc::CMD_SEQ_ERROR);
    refused_once(&f, RefusalReason::ControllerNotReady);
}

#[test]
fn an_io_queue_of_a_discovery_controller_is_counted() {
    let f = fixture();
    let (status, _q) = connect_with(
        &f,
        connect(1, 31, 0),
        Some(connect_data(spec::DISCOVERY_NQN, HOSTNQN, 1)),
    );
    assert_eq!(status.code(), sc::CONNECT_INVALID_PARAM);
    refused_once(&f, RefusalReason::InvalidQueueId);
}

#[test]
fn an_io_queue_connected_twice_is_counted() {
    let f = fixture();
    let (cntlid, mut admin) = admin_connected(&f);
    assert!(property_set_cc(&mut admin, CC_ENABLED).is_success());
    let _first = io_ready(&f, cntlid, 1);
    let (status, _q) = connect_with(
        &f,
        connect(1, 31, 0),
        Some(connect_data(SUBNQN, HOSTNQN, cntlid)),
    );
    assert_eq!(status.code(), sc::CMD_SEQ_ERROR);
    refused_once(&f, RefusalReason::QueueInUse);
}

#[test]
fn a_second_connect_on_a_connected_queue_is_counted() {
    let f = fixture();
    let (_cntlid, mut q) = admin_connected(&f);
    let r = one(run(
        &mut q,
        connect(0, 31, 0),
        admin_connect_data(SUBNQN, HOSTNQN),
    ));
    assert_eq!(r.completion.status.code(), sc::CMD_SEQ_ERROR);
    refused_once(&f, RefusalReason::AlreadyConnected);
}

/// SPDK's initiator tools send an empty HOSTNQN unless given one. Linux nvmet
/// (`nvmet_host_allowed`: any host, or a name in the list) and SPDK's target
/// (`spdk_nvmf_subsystem_host_allowed`) let it into a subsystem that allows any host and
/// refuse it where hosts are listed; so does the gateway, and says which.
#[test]
fn an_empty_host_nqn_gets_into_an_allow_any_host_subsystem_only() {
    let f = fixture();
    let (status, _q) = connect_with(&f, connect(0, 31, 0), admin_connect_data(SUBNQN, ""));
    assert_eq!(status.code(), sc::CONNECT_INVALID_HOST);
    refused_once(&f, RefusalReason::NoHostNqn);

    f.target
        .subsystem(SUBNQN)
        .expect("subsystem")
        .set_access(HostAccess::AnyHost);
    let (status, mut admin) = connect_with(&f, connect(0, 31, 0), admin_connect_data(SUBNQN, ""));
    assert!(status.is_success(), "{status:?}");
    assert!(property_set_cc(&mut admin, CC_ENABLED).is_success());
    let cntlid = admin.controller().expect("controller").cntlid;
    let (status, _io) = connect_with(
        &f,
        connect(1, 31, 0),
        Some(connect_data(SUBNQN, "", cntlid)),
    );
    assert!(status.is_success(), "its I/O queue: {status:?}");
    refused_once(&f, RefusalReason::NoHostNqn);

    let (status, _disc) = connect_with(
        &f,
        connect(0, 31, 0),
        admin_connect_data(spec::DISCOVERY_NQN, ""),
    );
    assert!(status.is_success(), "discovery: {status:?}");
}

/// What a `tracing` subscriber writes, for tests of log lines.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// Runs `f` with this capturing the `info` log, formatted as the daemon formats it.
    fn during<T>(&self, f: impl FnOnce() -> T) -> T {
        let writer = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        tracing::subscriber::with_default(subscriber, f)
    }
}

/// The refusal's log line names the reason, the host, the subsystem and, through the span
/// the transports open per connection, the peer.
#[test]
fn a_refusal_is_logged_with_host_subsystem_peer_and_reason() {
    let f = fixture();
    let log = Captured::default();
    log.during(|| {
        let peer = "192.0.2.7:53211";
        let span = tracing::info_span!("nvme-tcp", peer = %peer);
        let _entered = span.enter();
        connect_with(
            &f,
            connect(0, 31, 0),
            admin_connect_data(SUBNQN, OTHER_HOST),
        );
    });
    let text = log.text();
    let line = text
        .lines()
        .find(|l| l.contains("connect refused"))
        .unwrap_or_else(|| panic!("no refusal line in {text:?}"));
    for part in [
        "WARN",
        "peer=192.0.2.7:53211",
        "host_not_allowed",
        OTHER_HOST,
        SUBNQN,
        "qid=0",
    ] {
        assert!(line.contains(part), "{part:?} missing from {line:?}");
    }
}

/// A host refused in a loop costs a log line per doubling, not one per attempt; every
/// attempt is counted.
#[test]
fn a_host_refused_in_a_loop_does_not_flood_the_log() {
    let f = fixture();
    let log = Captured::default();
    log.during(|| {
        for _ in 0..100 {
            connect_with(
                &f,
                connect(0, 31, 0),
                admin_connect_data(SUBNQN, OTHER_HOST),
            );
        }
    });
    let lines = log
        .text()
        .lines()
        .filter(|l| l.contains("connect refused"))
        .count();
    assert_eq!(lines, 7, "1, 2, 4, ..., 64");
    assert_eq!(
        f.target
            .connect_refusals()
            .count(RefusalReason::HostNotAllowed),
        100
    );
}

/// An empty host NQN let in is said so at info.
#[test]
fn a_host_without_a_host_nqn_is_logged_when_let_in() {
    let f = fixture();
    f.target
        .subsystem(SUBNQN)
        .expect("subsystem")
        .set_access(HostAccess::AnyHost);
    let log = Captured::default();
    log.during(|| connect_with(&f, connect(0, 31, 0), admin_connect_data(SUBNQN, "")));
    assert!(
        log.text()
            .lines()
            .any(|l| l.contains("INFO") && l.contains("host connected without a host NQN")),
        "{}",
        log.text()
    );
}
