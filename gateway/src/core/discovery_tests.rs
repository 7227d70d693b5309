//! The discovery log across secure and plain listeners: each subsystem is offered only on
//! the listeners a host can connect to it through (as Linux nvmet offers a subsystem only
//! on the ports it is linked to), with TREQ and TSAS saying what the listener requires.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use nvme_auth::tls_psk::{ConfiguredPsk, LabelEncoding};

use super::log_page::discovery_page;
use super::subsystem::{HostAccess, Subsystem, SubsystemKind, SubsystemSpec};
use super::target::{ListenerInfo, TransportType};
use super::tests::{discovery_ready, fixture, get_log, Fixture, HOSTNQN, OTHER_HOST, SUBNQN};
use super::tls::HostPsk;
use crate::spec::{self, disc};

const TLSNQN: &str = "nqn.2016-06.io.test:tls";
const PLAIN_PORT: u16 = 4420;
const SECURE_PORT: u16 = 4421;
const RDMA_PORT: u16 = 4422;

/// One discovery log record, as a host reads it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Record {
    subnqn: String,
    port: u16,
    subtype: u8,
    treq: u8,
    sectype: u8,
}

fn records(page: &[u8]) -> BTreeSet<Record> {
    let n = u64::from_le_bytes(page[8..16].try_into().expect("NUMREC")) as usize;
    (0..n)
        .map(|i| {
            let e = &page[disc::HEADER_LEN + i * disc::ENTRY_LEN..][..disc::ENTRY_LEN];
            let text = |r: std::ops::Range<usize>| {
                String::from_utf8_lossy(&e[r])
                    .trim_end_matches(['\0', ' '])
                    .to_string()
            };
            Record {
                subnqn: text(256..512),
                port: text(32..64).parse().expect("TRSVCID"),
                subtype: e[2],
                treq: e[3],
                sectype: if e[0] == disc::TRTYPE_TCP {
                    e[768]
                } else {
                    0xff
                },
            }
        })
        .collect()
}

fn plain(subnqn: &str, port: u16, subtype: u8) -> Record {
    Record {
        subnqn: subnqn.into(),
        port,
        subtype,
        treq: disc::TREQ_SECURE_CHANNEL_NOT_SPECIFIED | disc::TREQ_DISABLE_SQFLOW,
        sectype: if port == RDMA_PORT {
            0xff
        } else {
            disc::TCP_SECTYPE_NONE
        },
    }
}

fn secure(subnqn: &str, subtype: u8) -> Record {
    Record {
        subnqn: subnqn.into(),
        port: SECURE_PORT,
        subtype,
        treq: disc::TREQ_SECURE_CHANNEL_REQUIRED | disc::TREQ_DISABLE_SQFLOW,
        sectype: disc::TCP_SECTYPE_TLS13,
    }
}

fn psk(byte: u8) -> Arc<HostPsk> {
    Arc::new(HostPsk {
        psk: ConfiguredPsk::from_bytes(&[byte; 32], None).expect("32 bytes"),
        derivation: LabelEncoding::default(),
    })
}

/// The core fixture (SUBNQN for HOSTNQN on the plain 127.0.0.1:4420) plus a secure listener
/// :4421, an RDMA listener :4422, and TLSNQN requiring TLS for HOSTNQN (with a PSK) and
/// OTHER_HOST (without one).
fn tls_fixture() -> (Fixture, Arc<Subsystem>) {
    let f = fixture();
    let tls = Arc::new(Subsystem::new(
        SubsystemKind::Nvm,
        SubsystemSpec {
            nqn: TLSNQN.into(),
            serial: "SN-TLS".into(),
            model: "test model".into(),
            access: HostAccess::Only(BTreeSet::from([HOSTNQN.into(), OTHER_HOST.into()])),
            cntlid_min: 20,
            cntlid_max: 22,
        },
    ));
    tls.set_tls_required(true);
    tls.tls
        .set_psks(BTreeMap::from([(HOSTNQN.to_string(), psk(0x41))]));
    f.target.add_subsystem(tls.clone());
    f.target
        .secure_listeners
        .set("127.0.0.1", SECURE_PORT, true);
    for (transport, port, id) in [
        (TransportType::Tcp, SECURE_PORT, 2),
        (TransportType::Rdma, RDMA_PORT, 3),
    ] {
        f.target.add_listener(ListenerInfo {
            transport,
            address: "127.0.0.1".into(),
            port,
            port_id: id,
        });
    }
    (f, tls)
}

fn log_of(f: &Fixture, host: &str) -> BTreeSet<Record> {
    records(&discovery_page(&f.target, host, None))
}

/// What the issue was about: a subsystem that requires TLS is offered on the secure listener
/// only (TREQ required, TSAS TLS 1.3), never on the plain TCP or the RDMA listener, where
/// its Connect is refused `tls_required`; a plain subsystem is not offered on the secure
/// listener to a host without a PSK there (the handshake would find no key).
#[test]
fn a_tls_required_subsystem_is_offered_on_secure_listeners_only() {
    let (f, _tls) = tls_fixture();
    let cur = disc::SUBTYPE_CURRENT_DISCOVERY;
    let nvm = disc::SUBTYPE_NVME;
    let disc_nqn = spec::DISCOVERY_NQN;
    assert_eq!(
        log_of(&f, HOSTNQN),
        BTreeSet::from([
            plain(disc_nqn, PLAIN_PORT, cur),
            plain(disc_nqn, RDMA_PORT, cur),
            // HOSTNQN has a PSK (in TLSNQN): it can discover over TLS
            secure(disc_nqn, cur),
            plain(SUBNQN, PLAIN_PORT, nvm),
            plain(SUBNQN, RDMA_PORT, nvm),
            secure(TLSNQN, nvm),
        ])
    );
    // OTHER_HOST is allowed into TLSNQN but has no PSK: no listener takes it, none is
    // offered; nor the discovery subsystem over TLS.
    assert_eq!(
        log_of(&f, OTHER_HOST),
        BTreeSet::from([
            plain(disc_nqn, PLAIN_PORT, cur),
            plain(disc_nqn, RDMA_PORT, cur),
        ])
    );
}

/// The log follows the settings: a PSK for HOSTNQN in SUBNQN offers SUBNQN on the secure
/// listener too; TLSNQN no longer requiring TLS is offered on the plain listeners again.
#[test]
fn the_offer_follows_psks_and_the_tls_requirement() {
    let (f, tls) = tls_fixture();
    let sub = f.target.subsystem(SUBNQN).expect("SUBNQN");
    sub.tls
        .set_psks(BTreeMap::from([(HOSTNQN.to_string(), psk(0x42))]));
    let log = log_of(&f, HOSTNQN);
    assert!(
        log.contains(&secure(SUBNQN, disc::SUBTYPE_NVME)),
        "{log:#?}"
    );
    assert!(log.contains(&plain(SUBNQN, PLAIN_PORT, disc::SUBTYPE_NVME)));

    tls.set_tls_required(false);
    let log = log_of(&f, HOSTNQN);
    for r in [
        plain(TLSNQN, PLAIN_PORT, disc::SUBTYPE_NVME),
        plain(TLSNQN, RDMA_PORT, disc::SUBTYPE_NVME),
        secure(TLSNQN, disc::SUBTYPE_NVME),
    ] {
        assert!(log.contains(&r), "{r:?} missing from {log:#?}");
    }
}

/// The same page through a discovery controller's Get Log Page 70h (the host's view), and
/// its NUMREC counts only the records offered.
#[test]
fn get_log_page_serves_the_filtered_log() {
    let (f, _tls) = tls_fixture();
    let mut q = f.queue();
    discovery_ready(&mut q, OTHER_HOST);
    let page = get_log(&mut q, spec::log::DISC, 4096, 0, false)
        .data
        .expect("log data")
        .into_vec();
    let got = records(&page);
    assert_eq!(got.len(), 2, "{got:#?}");
    assert!(got.iter().all(|r| r.subnqn == spec::DISCOVERY_NQN));
}
