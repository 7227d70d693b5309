//! The entry of a secure NVMe/TCP listener: what a host sends before any NVMe/TCP PDU.
//!
//! The first input byte picks the path (its value modulo 4):
//! - 0 or 2: the rest is a PSK identity as a ClientHello carries it. `PskIdentity::parse`
//!   and the gateway's lookup (`tls_psk_for`) in a target whose subsystem has a SHA-256
//!   and a SHA-384 host key. Checks: a parsed identity prints back to the same bytes (what
//!   the host derived its key over), and a key is found only for a configured host of
//!   that subsystem (or of any subsystem, for the discovery NQN) with the identity's hash
//!   and that hash's length.
//! - 1: the rest is the first flight of a connection to the secure listener, sent over
//!   a loopback socket that then closes its sending side; `TlsAcceptor::handshake` must
//!   refuse it (no handshake completes without a key the input cannot know) and return,
//!   rather than panic or wait for its timeout.
//! - 3: the same with a real first flight: the ClientHello an OpenSSL TLS 1.3 client sends
//!   with a PSK identity of the configured SHA-256 host (recorded once at start; its key
//!   is not the host's, so its binder never verifies), the rest of the input XOR-ing bytes
//!   of it (3 bytes each: a 16-bit offset and the XOR value) and, with a final odd byte,
//!   cutting it there. Random bytes rarely make a TLS record; this reaches the PSK
//!   extension, the identity parse and the key lookup through OpenSSL.
#![no_main]

use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use nvmeof_gateway::auth::tls_psk::{ConfiguredPsk, PskHash, PskIdentity};
use nvmeof_gateway::config::Config;
use nvmeof_gateway::core::tls::tls_psk_for;
use nvmeof_gateway::core::Target;
use nvmeof_gateway::spec::DISCOVERY_NQN;
use nvmeof_gateway::tcp::tls::TlsAcceptor;
use openssl::ssl::{Ssl, SslContext, SslMethod, SslVersion};

const SUBNQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:fuzz-tls";
const HOST_SHA256: &str = "nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-4000-8000-000000000001";
const HOST_SHA384: &str = "nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-4000-8000-000000000002";

struct World {
    client_hello: Vec<u8>,
    runtime: tokio::runtime::Runtime,
    target: Arc<Target>,
    acceptor: TlsAcceptor,
    listener: TcpListener,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        // Keys as `nvme gen-tls-key --hmac=1 / --hmac=2` prints them (CRC-32 included).
        let config = format!(
            r#"
[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = 4420
secure = true

[[subsystem]]
nqn = "{SUBNQN}"
require_tls = true
allow_any_host = false
hosts = [
  {{ nqn = "{HOST_SHA256}", psk = "{}" }},
  {{ nqn = "{HOST_SHA384}", psk = "{}", psk_derivation = "libnvme-compat" }},
]

[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "1MiB"
"#,
            interchange(PskHash::Sha256, &[0x11; 32]),
            interchange(PskHash::Sha384, &[0x22; 48]),
        );
        let config = Config::from_toml_str(&config).expect("the fuzz target's config");
        let target = config.build_target().expect("the fuzz target's target");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let acceptor = TlsAcceptor::new(target.clone()).expect("the TLS acceptor");
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
        World {
            client_hello: recorded_client_hello(),
            runtime,
            target,
            acceptor,
            listener,
        }
    })
}

/// A configured PSK of `key`, as `nvme gen-tls-key --hmac=HASH` prints one.
fn interchange(hash: PskHash, key: &[u8]) -> String {
    let psk = ConfiguredPsk::from_bytes(key, Some(hash)).expect("a key of the hash's length");
    psk.to_interchange().to_string()
}

/// What an OpenSSL TLS 1.3 client offering the SHA-256 host's identity (with another key)
/// sends first, recorded on a loopback socket.
fn recorded_client_hello() -> Vec<u8> {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
    let addr = listener.local_addr().expect("its address");
    let recorder = std::thread::spawn(move || {
        let (mut peer, _) = listener.accept().expect("the client's connection");
        peer.set_read_timeout(Some(Duration::from_millis(300))).ok();
        let mut flight = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = std::io::Read::read(&mut peer, &mut buf) {
            flight.extend_from_slice(&buf[..n]);
        }
        flight
    });
    let mut ctx = SslContext::builder(SslMethod::tls_client()).expect("a TLS client context");
    ctx.set_min_proto_version(Some(SslVersion::TLS1_3))
        .expect("TLS 1.3");
    ctx.set_ciphersuites("TLS_AES_128_GCM_SHA256")
        .expect("the suite");
    let identity = format!("NVMe0R01 {HOST_SHA256} {SUBNQN}");
    ctx.set_psk_client_callback(move |_, _, id_out, key_out| {
        let id = identity.as_bytes();
        id_out[..id.len()].copy_from_slice(id);
        id_out[id.len()] = 0;
        key_out[..32].copy_from_slice(&[0x33; 32]);
        Ok(32)
    });
    let ssl = Ssl::new(&ctx.build()).expect("a TLS client");
    let stream = TcpStream::connect(addr).expect("connect to the recorder");
    stream
        .set_read_timeout(Some(Duration::from_millis(500)))
        .ok();
    // No server answers: the client gives up after its ClientHello.
    let _ = ssl.connect(stream);
    let flight = recorder.join().expect("the recorder");
    assert!(
        flight.len() > 100,
        "no ClientHello recorded ({} bytes)",
        flight.len()
    );
    flight
}

/// The recorded ClientHello with the input's XORs, cut where an odd last byte says.
fn mutated_client_hello(world: &World, edits: &[u8]) -> Vec<u8> {
    let mut hello = world.client_hello.clone();
    let mut chunks = edits.chunks_exact(3);
    for edit in &mut chunks {
        let at = usize::from(u16::from_le_bytes([edit[0], edit[1]])) % hello.len();
        hello[at] ^= edit[2];
    }
    if let [cut] = chunks.remainder() {
        hello.truncate(usize::from(*cut) * hello.len() / 256);
    }
    hello
}

fn identity(world: &World, bytes: &[u8]) {
    let Ok(identity) = PskIdentity::parse(bytes) else {
        return;
    };
    assert_eq!(
        identity.to_string().as_bytes(),
        bytes,
        "an identity prints back as sent"
    );
    let Some(psk) = tls_psk_for(&world.target, &identity) else {
        return;
    };
    let known = [HOST_SHA256, HOST_SHA384].contains(&identity.hostnqn.as_str());
    let subsystem = identity.subnqn == SUBNQN || identity.subnqn == DISCOVERY_NQN;
    assert!(
        known && subsystem,
        "a key for an unknown host or subsystem: {identity}"
    );
    assert_eq!(psk.hash(), identity.hash);
    assert_eq!(psk.key().len(), identity.hash.key_len());
}

fn handshake(world: &World, bytes: &[u8]) {
    let Ok(addr) = world.listener.local_addr() else {
        return;
    };
    let Ok(mut client) = TcpStream::connect(addr) else {
        return;
    };
    let Ok((server, _)) = world.listener.accept() else {
        return;
    };
    // The whole flight, then EOF: the server reads what there is and must decide.
    let _ = client.write_all(bytes);
    let _ = client.shutdown(Shutdown::Write);
    let _ = server.set_nonblocking(true);
    let refused = world.runtime.block_on(async {
        let server = tokio::net::TcpStream::from_std(server).expect("register the socket");
        tokio::time::timeout(Duration::from_secs(5), world.acceptor.handshake(server)).await
    });
    match refused {
        Err(_) => panic!("the handshake neither completed nor failed within 5 s of EOF"),
        Ok(result) => assert!(result.is_err(), "a handshake completed without the key"),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let world = world();
    match mode % 4 {
        1 => handshake(world, rest),
        3 => handshake(world, &mutated_client_hello(world, rest)),
        _ => identity(world, rest),
    }
});
