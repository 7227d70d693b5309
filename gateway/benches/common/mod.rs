//! Shared by the benchmarks: the null responder, the baseline an NVMe/TCP target is measured
//! against (what the exchange over loopback costs with no target behind it).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use nvmeof_gateway::host::cmd as hcmd;
use nvmeof_gateway::tcp::pdu::{
    encode_icresp, DecoderConfig, IcResp, Pdu, PduDecoder, PduEncoder, Role,
};

/// Starts a null responder on a free port of 127.0.0.1 (a thread per connection) and
/// returns its address.
#[allow(dead_code)] // Not every bench that includes this module uses both kinds.
pub fn spawn_null_responder() -> SocketAddr {
    spawn(Wait::Sleep)
}

/// A null responder that never sleeps: each connection's thread spins on a non-blocking
/// socket, as SPDK's reactor polls its sockets, so no command waits for the target to wake
/// up. The baseline a low-latency target is held to; it keeps a CPU at 100% per connection
/// for as long as the connection is open, idle or not.
#[allow(dead_code)]
pub fn spawn_polling_null_responder() -> SocketAddr {
    spawn(Wait::Spin)
}

/// How a null responder's connection thread waits for the host's next bytes.
#[derive(Clone, Copy)]
enum Wait {
    /// In a blocking `read` (the thread sleeps, the next bytes wake it).
    Sleep,
    /// Asking a non-blocking socket again at once until it has bytes.
    Spin,
}

/// A polling responder with a RAM disk of `bytes` behind it, addressed in blocks of
/// `block_size`: SPDK's nvmf_tgt on a malloc bdev, as far as a read's cost goes. Its thread
/// spins on the socket as [`spawn_polling_null_responder`]'s does, and a read is copied from
/// RAM at the command's LBA into the PDU that carries it, as the malloc bdev copies from its
/// buffer (one copy, from memory a random read finds cold, where the null responder sends a
/// static buffer that stays in cache). Only reads use the disk, the one workload it serves
/// (the QD1 comparison): writes are answered as the null responder answers them. The disk
/// is written whole first, so no page is left unmapped (an unwritten page reads from the
/// kernel's one zero page, which stays in cache).
#[allow(dead_code)]
pub fn spawn_polling_ram_responder(bytes: usize, block_size: u64) -> SocketAddr {
    let ram = Arc::new(RamDisk {
        data: vec![0xa5; bytes],
        block_size,
    });
    spawn_with(Wait::Spin, Some(ram))
}

/// The RAM disk of [`spawn_polling_ram_responder`], shared by its connections.
struct RamDisk {
    data: Vec<u8>,
    block_size: u64,
}

impl RamDisk {
    /// The `len` bytes at the command's SLBA (CDW10-11), when they lie within the disk.
    fn at(&self, sqe: &[u8; 64], len: usize) -> Option<&[u8]> {
        let slba = u64::from_le_bytes(sqe[40..48].try_into().ok()?);
        let at = usize::try_from(slba.checked_mul(self.block_size)?).ok()?;
        self.data.get(at..at.checked_add(len)?)
    }
}

fn spawn(wait: Wait) -> SocketAddr {
    spawn_with(wait, None)
}

fn spawn_with(wait: Wait, ram: Option<Arc<RamDisk>>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the null responder");
    let addr = listener.local_addr().expect("the null responder's address");
    std::thread::spawn(move || null_responder(listener, wait, ram));
    addr
}

/// The baseline target: answers Connect, reads (C2HData from a static buffer, or from `ram`)
/// and writes (in-capsule or by R2T) with the same PDU codec and no protocol core.
fn null_responder(listener: TcpListener, wait: Wait, ram: Option<Arc<RamDisk>>) {
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let ram = ram.clone();
        std::thread::spawn(move || {
            stream.set_nodelay(true).ok();
            if let Wait::Spin = wait {
                if stream.set_nonblocking(true).is_err() {
                    return;
                }
            }
            let zeros = vec![0u8; 1 << 20];
            let mut dec = PduDecoder::new(DecoderConfig::new(Role::Target));
            let mut enc = PduEncoder::new(false, false, 0);
            let mut rx: Vec<u8> = Vec::with_capacity(4 << 20);
            let mut tx: Vec<u8> = Vec::with_capacity(1 << 20);
            let mut chunk = vec![0u8; 256 * 1024];
            loop {
                let n = match stream.read(&mut chunk) {
                    Ok(0) => return,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::hint::spin_loop();
                        continue;
                    }
                    Err(_) => return,
                };
                rx.extend_from_slice(&chunk[..n]);
                let mut consumed = 0;
                while let Ok(Some((pdu, used))) = dec.decode(&rx[consumed..]) {
                    let respond = |tx: &mut Vec<u8>, enc: &PduEncoder, cid: u16| {
                        let mut cqe = [0u8; 16];
                        cqe[12..14].copy_from_slice(&cid.to_le_bytes());
                        enc.capsule_resp(tx, &cqe);
                    };
                    match pdu {
                        Pdu::IcReq(_) => {
                            encode_icresp(
                                &mut tx,
                                &IcResp {
                                    pfv: 0,
                                    cpda: 0,
                                    hdgst: false,
                                    ddgst: false,
                                    maxh2cdata: 1 << 20,
                                },
                            );
                            enc = PduEncoder::new(false, false, 0);
                        }
                        Pdu::CapsuleCmd(c) => {
                            let cid = c.cid();
                            let len =
                                u32::from_le_bytes([c.sqe[32], c.sqe[33], c.sqe[34], c.sqe[35]]);
                            match c.opcode() {
                                hcmd::io::READ => {
                                    let len = len as usize;
                                    let data = ram
                                        .as_ref()
                                        .and_then(|r| r.at(c.sqe, len))
                                        .unwrap_or(&zeros[..len]);
                                    enc.c2h_data(&mut tx, cid, 0, data, true, false);
                                    respond(&mut tx, &enc, cid);
                                }
                                _ if c.sqe[0] & 1 == 1 && c.data.is_empty() && len > 0 => {
                                    enc.r2t(&mut tx, cid, cid, 0, len)
                                }
                                _ => respond(&mut tx, &enc, cid),
                            }
                        }
                        Pdu::H2CData(d) => {
                            if d.last {
                                respond(&mut tx, &enc, d.cccid);
                            }
                        }
                        _ => return,
                    }
                    consumed += used;
                }
                rx.drain(..consumed);
                if !tx.is_empty() {
                    if write_all(&mut stream, &tx).is_err() {
                        return;
                    }
                    tx.clear();
                }
            }
        });
    }
}

/// `write_all` that also works on a non-blocking socket: a full send buffer (large reads at
/// depth) is waited out by spinning, as the polling responder waits for everything else.
fn write_all(stream: &mut std::net::TcpStream, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        match stream.write(bytes) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A busy-polling gateway's counters over one run: how often it polled and what it chose.
#[derive(Clone, Copy)]
pub struct Polling {
    /// Reads made while a polling window was open (no wake-up needed), per I/O: ~1 or more
    /// at QD1 when the queue always polls (a write's data can be a read of its own).
    pub polled_per_io: f64,
    /// Share of the epochs that ended with the queue choosing to poll (adaptive only; NaN:
    /// no epoch ended).
    pub chose_poll: f64,
}

impl Polling {
    const POLLED: &'static str = "nvmeof_tcp_busy_poll_reads_total";
    const CHOSE_POLL: &'static str = "nvmeof_tcp_busy_poll_chose_poll_total";
    const CHOSE_SLEEP: &'static str = "nvmeof_tcp_busy_poll_chose_sleep_total";

    /// The counters' values at `addr`; `None` when the endpoint did not answer.
    pub fn counters(addr: SocketAddr) -> Option<[f64; 3]> {
        let mut stream = TcpStream::connect(addr).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            .ok()?;
        let mut text = String::new();
        stream.read_to_string(&mut text).ok()?;
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        };
        Some([
            value(Self::POLLED)?,
            value(Self::CHOSE_POLL)?,
            value(Self::CHOSE_SLEEP)?,
        ])
    }

    /// From the counters before and after a run of `ios` I/Os.
    pub fn between(before: [f64; 3], after: [f64; 3], ios: u64) -> Polling {
        let [polled, poll, sleep] = [0, 1, 2].map(|i| after[i] - before[i]);
        Polling {
            polled_per_io: polled / ios.max(1) as f64,
            chose_poll: poll / (poll + sleep),
        }
    }
}
