//! RbdDevice against a real Ceph cluster (never a mock).
//!
//! Compiled only with `--features ceph-tests`; then every test needs a cluster and FAILS when
//! there is none. The wrapper starts a throwaway one and runs these:
//!
//! ```sh
//! bash rbd-backend/tests/ceph-tests.sh          # micro-ceph start, cargo test, stop
//! # or by hand:
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p rbd-backend --features ceph-tests --test ceph
//! ```
//!
//! Env: `CEPH_CONF` (required), `CEPH_KEYRING`, `MICRO_CEPH_POOL` (default `rbd`).
//! Each test works on its own fresh image, so they run in parallel.
#![cfg(feature = "ceph-tests")]

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rbd_backend::op_ages;
use rbd_backend::rbd::{CephSettings, ClusterPool, ImageSpec, PoolAdmin, RbdError};
use rbd_backend::{
    BlockDevice, DeviceEvent, DeviceEventSink, IoBuf, IoCompletion, IoDone, IoError, IoOp, OpKind,
    RbdDevice,
};

const MIB: u64 = 1 << 20;
const OBJ: u64 = 4 * MIB;

fn settings(max_connections: usize) -> CephSettings {
    let conf = std::env::var("CEPH_CONF").unwrap_or_default();
    assert!(
        !conf.is_empty() && std::path::Path::new(&conf).is_file(),
        "these tests need a Ceph cluster: CEPH_CONF ({conf:?}) must name its ceph.conf.\n\
         Start one with: eval \"$(scripts/micro-ceph.sh start)\"  (or run rbd-backend/tests/ceph-tests.sh)"
    );
    CephSettings {
        conf: Some(PathBuf::from(conf)),
        keyring: std::env::var("CEPH_KEYRING").ok().map(PathBuf::from),
        max_connections,
        ..CephSettings::default()
    }
}

fn pool_name() -> String {
    std::env::var("MICRO_CEPH_POOL").unwrap_or_else(|_| "rbd".into())
}

/// A cluster pool plus an image only this test uses, removed at the end.
struct Fixture {
    pool: Arc<ClusterPool>,
    admin: PoolAdmin,
    images: Vec<String>,
}

static NEXT: AtomicU64 = AtomicU64::new(0);

impl Fixture {
    fn new(max_connections: usize) -> Self {
        let pool = ClusterPool::new(settings(max_connections));
        let admin = pool
            .admin(&pool_name(), None)
            .unwrap_or_else(|e| panic!("cannot reach the cluster: {e}"));
        Fixture {
            pool,
            admin,
            images: Vec::new(),
        }
    }

    /// Creates a fresh image and returns its spec.
    fn image(&mut self, size: u64) -> ImageSpec {
        let name = format!(
            "t-{}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst),
            std::thread::current()
                .name()
                .unwrap_or("x")
                .rsplit("::")
                .next()
                .unwrap_or("x")
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
                .take(40)
                .collect::<String>()
        );
        self.admin.create_image(&name, size).expect("rbd_create");
        self.images.push(name.clone());
        ImageSpec {
            pool: pool_name(),
            namespace: None,
            image: name,
        }
    }

    fn open(&mut self, size: u64) -> RbdDevice {
        let spec = self.image(size);
        self.pool.open(&spec).expect("open image")
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        rbd_backend::rbd::wait_for_closes(Duration::from_secs(30));
        for name in &self.images {
            if let Err(e) = self.admin.remove_image(name) {
                eprintln!("cleanup: {e}");
            }
        }
    }
}

struct Waiter(Mutex<mpsc::Sender<IoDone>>);

impl IoCompletion for Waiter {
    fn complete(&self, done: IoDone) {
        let _ = self.0.lock().unwrap().send(done);
    }
}

/// Delivers completions only once released (blocking librbd's callback thread until then).
struct GatedWaiter {
    tx: Mutex<mpsc::Sender<IoDone>>,
    open: Mutex<bool>,
    opened: Condvar,
}

impl GatedWaiter {
    fn release(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

impl IoCompletion for GatedWaiter {
    fn complete(&self, done: IoDone) {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
        drop(open);
        let _ = self.tx.lock().unwrap().send(done);
    }
}

fn run(dev: &RbdDevice, op: IoOp) -> IoDone {
    let (tx, rx) = mpsc::channel();
    let c: Arc<dyn IoCompletion> = Arc::new(Waiter(Mutex::new(tx)));
    dev.submit(42, op, &c);
    let done = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("no completion within 60 s");
    assert_eq!(done.tag, 42);
    assert!(rx.try_recv().is_err(), "exactly one completion per op");
    done
}

fn write(dev: &RbdDevice, offset: u64, data: &[u8], fua: bool) {
    run(
        dev,
        IoOp::Write {
            offset,
            buf: IoBuf::from_vec(data.to_vec()),
            fua,
        },
    )
    .result
    .unwrap_or_else(|e| panic!("write at {offset}: {e}"));
}

fn read(dev: &RbdDevice, offset: u64, len: usize) -> Vec<u8> {
    let done = run(
        dev,
        IoOp::Read {
            offset,
            buf: IoBuf::zeroed(len),
        },
    );
    done.result
        .unwrap_or_else(|e| panic!("read at {offset}: {e}"));
    match done.op {
        IoOp::Read { buf, .. } => buf.into_vec(),
        other => panic!("got back {other:?}"),
    }
}

/// Waits (at most 1 s) for the device to count no op in flight. An op is counted down just
/// after its completion is delivered, on librbd's thread, so the last op may still be counted
/// when its completion reaches the test.
fn wait_until_nothing_in_flight(dev: &RbdDevice) {
    let started = Instant::now();
    while dev.in_flight() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "ops left counted in flight: {}",
            dev.in_flight()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

#[test]
fn write_read_round_trip_across_an_object_boundary() {
    let mut f = Fixture::new(1);
    let dev = f.open(16 * MIB);
    assert_eq!(dev.size_bytes(), 16 * MIB);
    assert_eq!(dev.object_size(), OBJ);
    let data = pattern(256 * 1024, 0x5a);
    let offset = OBJ - 128 * 1024;
    write(&dev, offset, &data, false);
    assert_eq!(read(&dev, offset, data.len()), data);
    // FUA write, then an explicit flush
    let data2 = pattern(4096, 0x33);
    write(&dev, 8192, &data2, true);
    run(&dev, IoOp::Flush).result.expect("flush");
    assert_eq!(read(&dev, 8192, 4096), data2);
    assert_eq!(
        read(&dev, 12 * MIB, 4096),
        vec![0; 4096],
        "never written: zeroes"
    );
    // a second handle (a fresh open, like `rbd export` would) sees the same bytes
    let spec = ImageSpec {
        pool: pool_name(),
        namespace: None,
        image: f.images[0].clone(),
    };
    drop(dev);
    let again = f.pool.open(&spec).expect("reopen");
    assert_eq!(read(&again, offset, data.len()), data);
}

/// Every op is counted once by kind, when its result is known: bytes for the ones that
/// succeeded, failures (out of range, a miscompare) apart, and time spent.
#[test]
fn io_statistics_count_every_op_by_kind() {
    let mut f = Fixture::new(1);
    let dev = f.open(8 * MIB);
    let fresh = dev.io_stats().expect("an RBD device counts its ops");
    assert!(
        fresh.iter().all(|(_, t)| t.completed == 0 && t.bytes == 0),
        "a fresh device: {fresh:?}"
    );
    write(&dev, 0, &pattern(8192, 1), false);
    write(&dev, OBJ, &pattern(4096, 2), true);
    for _ in 0..3 {
        read(&dev, 0, 4096);
    }
    let beyond = run(
        &dev,
        IoOp::Read {
            offset: 8 * MIB,
            buf: IoBuf::zeroed(4096),
        },
    );
    assert!(beyond.result.is_err());
    run(&dev, IoOp::Flush).result.expect("flush");
    run(
        &dev,
        IoOp::Discard {
            offset: 0,
            len: MIB,
        },
    )
    .result
    .expect("discard");
    run(
        &dev,
        IoOp::WriteZeroes {
            offset: MIB,
            len: 65536,
        },
    )
    .result
    .expect("write zeroes");
    // native (one sector) and emulated (4 KiB), each matching once and missing once
    for len in [512usize, 4096] {
        let old = read(&dev, 2 * MIB, len);
        caw(&dev, 2 * MIB, &old, &pattern(len, 3)).expect("matching compare-and-write");
        assert!(caw(&dev, 2 * MIB, &old, &pattern(len, 4)).is_err());
    }
    let s = dev.io_stats().expect("an RBD device counts its ops");
    let counts = |k: OpKind| {
        let t = s.get(k);
        (t.completed, t.failed, t.bytes)
    };
    // 3 reads above, 1 beyond the end, 2 more before the compare-and-writes
    assert_eq!(counts(OpKind::Read), (6, 1, 4 * 4096 + 512));
    assert_eq!(counts(OpKind::Write), (2, 0, 8192 + 4096));
    assert_eq!(counts(OpKind::Flush), (1, 0, 0));
    assert_eq!(counts(OpKind::Discard), (1, 0, MIB));
    assert_eq!(counts(OpKind::WriteZeroes), (1, 0, 65536));
    assert_eq!(counts(OpKind::CompareAndWrite), (4, 2, 512 + 4096));
    assert!(s.get(OpKind::Read).seconds > 0.0, "time is counted");
    let buckets = s
        .get(OpKind::Read)
        .latency_buckets
        .expect("reads have buckets");
    assert_eq!(
        buckets.iter().sum::<u64>(),
        6,
        "every read of a local cluster took under 5 s: {buckets:?}"
    );
}

/// Opening and closing other images on the same cluster connection does not hold up a
/// device's I/O: a reader keeps completing ops inside the time of every `rbd_open` and while
/// the closes run (librbd's opens and this crate's background closes share the connection's
/// messenger, but no lock or thread the I/O path needs).
#[test]
fn opening_and_closing_other_images_does_not_hold_up_io() {
    const OTHERS: usize = 8;
    let mut f = Fixture::new(1);
    let dev = f.open(16 * MIB);
    write(&dev, 0, &pattern(1 << 20, 9), false);
    let others: Vec<ImageSpec> = (0..OTHERS).map(|_| f.image(4 * MIB)).collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut completed = Vec::new();
            let mut offset = 0;
            while !stop.load(Ordering::SeqCst) {
                read(&dev, offset, 4096);
                completed.push(Instant::now());
                offset = (offset + 4096) % (1 << 20);
            }
            completed
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let mut opens = Vec::new();
    let mut opened = Vec::new();
    for spec in &others {
        let t0 = Instant::now();
        opened.push(f.pool.open(spec).expect("open another image"));
        opens.push((t0, Instant::now()));
    }
    let closing = Instant::now();
    drop(opened);
    assert!(
        rbd_backend::rbd::wait_for_closes(Duration::from_secs(60)),
        "the images close"
    );
    let closed = Instant::now();
    std::thread::sleep(Duration::from_millis(50));
    stop.store(true, Ordering::SeqCst);
    let completed = reader.join().expect("reader");
    let inside =
        |(a, b): (Instant, Instant)| completed.iter().filter(|t| **t > a && **t < b).count();
    let per_open: Vec<usize> = opens.iter().map(|w| inside(*w)).collect();
    let open_ms: Vec<u128> = opens.iter().map(|(a, b)| (*b - *a).as_millis()).collect();
    let during_closes = inside((closing, closed));
    eprintln!(
        "reads completed inside each open: {per_open:?} (opens took {open_ms:?} ms); \
         during the closes ({} ms): {during_closes}; {} reads in all",
        (closed - closing).as_millis(),
        completed.len()
    );
    assert!(
        per_open.iter().sum::<usize>() >= OTHERS,
        "reads stopped while other images opened: {per_open:?} in opens of {open_ms:?} ms"
    );
    assert!(
        per_open.iter().filter(|n| **n > 0).count() * 2 >= OTHERS,
        "no read completed inside most opens: {per_open:?} in opens of {open_ms:?} ms"
    );
    if closed - closing > Duration::from_millis(20) {
        assert!(during_closes > 0, "reads stopped while images closed");
    }
}

#[test]
fn out_of_range_and_empty_ops() {
    let mut f = Fixture::new(1);
    let dev = f.open(4 * MIB);
    let done = run(
        &dev,
        IoOp::Read {
            offset: 4 * MIB - 512,
            buf: IoBuf::zeroed(1024),
        },
    );
    assert!(
        matches!(done.result, Err(IoError::OutOfRange { .. })),
        "{:?}",
        done.result
    );
    let done = run(
        &dev,
        IoOp::WriteZeroes {
            offset: u64::MAX - 1,
            len: 4,
        },
    );
    assert!(matches!(done.result, Err(IoError::OutOfRange { .. })));
    let done = run(&dev, IoOp::Discard { offset: 0, len: 0 });
    done.result.expect("empty discard is a no-op");
}

#[test]
fn discard_and_write_zeroes_read_back_zero() {
    let mut f = Fixture::new(1);
    let dev = f.open(16 * MIB);
    let data = pattern(3 * OBJ as usize, 0x11);
    write(&dev, 0, &data, false);
    // a 4 KiB discard inside an object: plain rbd_aio_discard would keep the old data
    run(
        &dev,
        IoOp::Discard {
            offset: 4096,
            len: 4096,
        },
    )
    .result
    .expect("discard");
    assert_eq!(
        read(&dev, 4096, 4096),
        vec![0; 4096],
        "discarded 4 KiB reads zero"
    );
    assert_eq!(read(&dev, 0, 4096), data[..4096], "block before intact");
    assert_eq!(
        read(&dev, 8192, 4096),
        data[8192..12288],
        "block after intact"
    );
    // write zeroes of one 512-byte sector
    run(
        &dev,
        IoOp::WriteZeroes {
            offset: 3 * 512,
            len: 512,
        },
    )
    .result
    .expect("write zeroes");
    let head = read(&dev, 0, 4096);
    assert_eq!(head[..1536], data[..1536]);
    assert_eq!(head[1536..2048], [0u8; 512]);
    assert_eq!(head[2048..], data[2048..4096]);
    // a discard spanning a whole object plus parts of its neighbours
    let (off, len) = (OBJ - 65536, OBJ + 2 * 65536);
    run(&dev, IoOp::Discard { offset: off, len })
        .result
        .expect("big discard");
    let back = read(&dev, off - 4096, (len + 8192) as usize);
    assert_eq!(back[..4096], data[(off - 4096) as usize..off as usize]);
    assert!(
        back[4096..4096 + len as usize].iter().all(|&b| b == 0),
        "discarded range reads zero"
    );
    assert_eq!(
        back[4096 + len as usize..],
        data[(off + len) as usize..(off + len + 4096) as usize]
    );
}

fn caw(dev: &RbdDevice, offset: u64, compare: &[u8], write: &[u8]) -> Result<(), IoError> {
    let done = run(
        dev,
        IoOp::CompareAndWrite {
            offset,
            compare: IoBuf::from_vec(compare.to_vec()),
            write: IoBuf::from_vec(write.to_vec()),
        },
    );
    match &done.op {
        IoOp::CompareAndWrite {
            compare: c,
            write: w,
            ..
        } => {
            assert_eq!(c.as_slice(), compare, "compare buffer comes back");
            assert_eq!(w.as_slice(), write, "write buffer comes back");
        }
        other => panic!("got back {other:?}"),
    }
    done.result
}

/// 512 bytes in one sector: librbd's own rbd_aio_compare_and_write. 4 KiB, and a range across
/// an object boundary: the gateway's read-compare-write under the exclusive lock.
#[test]
fn compare_and_write_match_and_mismatch() {
    let mut f = Fixture::new(1);
    let dev = f.open(8 * MIB);
    for (len, offset, diff_at) in [
        (512usize, 65536u64, 100usize),
        (4096, 131072, 1000),
        (8192, OBJ - 4096, 5000),
    ] {
        let old = pattern(len, 1);
        let new = pattern(len, 2);
        write(&dev, offset, &old, false);
        let mut wrong = old.clone();
        wrong[diff_at] ^= 0xff;
        assert_eq!(
            caw(&dev, offset, &wrong, &new),
            Err(IoError::Miscompare {
                offset_in_range: diff_at as u64
            }),
            "{len} bytes at {offset}"
        );
        assert_eq!(read(&dev, offset, len), old, "a miscompare writes nothing");
        caw(&dev, offset, &old, &new).expect("compare-and-write with matching data");
        assert_eq!(
            read(&dev, offset, len),
            new,
            "{len} bytes at {offset} written"
        );
    }
    // the device now holds the exclusive lock in exclusive mode: another client's write is
    // refused rather than interleaved with a later compare-and-write
    let other_pool = ClusterPool::new(settings(1));
    let spec = ImageSpec {
        pool: pool_name(),
        namespace: None,
        image: f.images[0].clone(),
    };
    let other = other_pool.open(&spec).expect("second client opens");
    let t = Instant::now();
    let done = run(
        &other,
        IoOp::Write {
            offset: 0,
            buf: IoBuf::zeroed(4096),
            fua: false,
        },
    );
    eprintln!(
        "second client's write: {:?} after {:?}",
        done.result,
        t.elapsed()
    );
    assert_eq!(done.result, Err(IoError::ReadOnly));
    assert_eq!(
        read(&other, 65536, 512),
        pattern(512, 2),
        "reads still work"
    );
}

/// Compare-and-write as an atomic increment from several threads at once, mixed with plain
/// writes to the neighbouring block: no increment may be lost.
#[test]
fn compare_and_write_is_atomic_under_concurrency() {
    let mut f = Fixture::new(1);
    let dev = Arc::new(f.open(8 * MIB));
    const BLOCK: u64 = 1 << 20;
    write(&dev, BLOCK, &[0u8; 4096], false);
    let per_thread = 15u64;
    let threads: Vec<_> = (0..3)
        .map(|t| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                let mut done = 0;
                let mut attempts = 0;
                while done < per_thread {
                    attempts += 1;
                    assert!(attempts < 10_000, "no progress");
                    // unrelated writes right next to the counter block
                    write(&dev, BLOCK + 4096, &pattern(4096, t), false);
                    let cur = read(&dev, BLOCK, 4096);
                    let n = u64::from_le_bytes(cur[..8].try_into().unwrap());
                    let mut next = cur.clone();
                    next[..8].copy_from_slice(&(n + 1).to_le_bytes());
                    match caw(&dev, BLOCK, &cur, &next) {
                        Ok(()) => done += 1,
                        Err(IoError::Miscompare { .. }) => {}
                        Err(e) => panic!("compare-and-write: {e}"),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let cur = read(&dev, BLOCK, 4096);
    assert_eq!(
        u64::from_le_bytes(cur[..8].try_into().unwrap()),
        3 * per_thread
    );
}

struct Events(Mutex<Vec<DeviceEvent>>);

impl DeviceEventSink for Events {
    fn device_event(&self, event: DeviceEvent) {
        self.0.lock().unwrap().push(event);
    }
}

#[test]
fn resize_from_another_client_is_reported() {
    let mut f = Fixture::new(1);
    let dev = f.open(8 * MIB);
    let events = Arc::new(Events(Mutex::new(Vec::new())));
    dev.set_event_sink(events.clone());
    let name = f.images[0].clone();
    // a multi-sector compare-and-write first: the device then holds the exclusive lock in
    // exclusive mode; a resize from elsewhere must still work (librbd forwards it to the owner)
    caw(&dev, 0, &[0u8; 4096], &[1u8; 4096]).expect("compare-and-write");
    f.admin.resize_image(&name, 24 * MIB).expect("resize");
    let deadline = Instant::now() + Duration::from_secs(20);
    while events.0.lock().unwrap().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        events.0.lock().unwrap().first(),
        Some(&DeviceEvent::Resized { new_size: 24 * MIB }),
        "a Resized event within 20 s"
    );
    assert_eq!(dev.size_bytes(), 24 * MIB);
    let data = pattern(4096, 7);
    write(&dev, 20 * MIB, &data, false);
    assert_eq!(read(&dev, 20 * MIB, 4096), data, "the new space is usable");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        events.0.lock().unwrap().len(),
        1,
        "one event per size change"
    );
}

#[test]
fn missing_image_and_pool_are_reported_by_name() {
    let f = Fixture::new(1);
    let spec = ImageSpec {
        pool: pool_name(),
        namespace: None,
        image: "no-such-image".into(),
    };
    let err = f.pool.open(&spec).expect_err("missing image");
    assert!(matches!(err, RbdError::ImageNotFound { .. }), "{err:?}");
    assert!(err.to_string().contains("rbd/no-such-image"), "{err}");
    let spec = ImageSpec {
        pool: "no-such-pool".into(),
        namespace: None,
        image: "img".into(),
    };
    let err = f.pool.open(&spec).expect_err("missing pool");
    assert!(matches!(err, RbdError::PoolNotFound { .. }), "{err:?}");
    assert!(err.to_string().contains("no-such-pool"), "{err}");
}

#[test]
fn bad_ceph_options_are_refused() {
    let mut s = settings(1);
    s.args = vec!["--no-such-ceph-option=1".into()];
    let err = ClusterPool::new(s)
        .admin(&pool_name(), None)
        .expect_err("unknown arg");
    assert!(err.to_string().contains("no-such-ceph-option"), "{err}");
    let mut s = settings(1);
    s.options = vec![("no_such_option".into(), "1".into())];
    let err = ClusterPool::new(s)
        .admin(&pool_name(), None)
        .expect_err("unknown option");
    assert!(err.to_string().contains("no_such_option"), "{err}");
    // the gateway's defaults hold unless overridden
    let pool = ClusterPool::new(settings(1));
    assert_eq!(pool.conf_get("rbd_cache").unwrap(), "false");
    assert_eq!(pool.conf_get("rbd_non_blocking_aio").unwrap(), "false");
    assert_eq!(pool.conf_get("objecter_inflight_ops").unwrap(), "0");
    assert_eq!(pool.conf_get("objecter_inflight_op_bytes").unwrap(), "0");
    let mut s = settings(1);
    s.args = vec!["--rbd_cache=true".into()];
    assert_eq!(ClusterPool::new(s).conf_get("rbd_cache").unwrap(), "true");
}

#[test]
fn images_are_spread_over_a_bounded_number_of_connections() {
    let mut f = Fixture::new(2);
    let a = f.open(4 * MIB);
    let b = f.open(4 * MIB);
    let c = f.open(4 * MIB);
    assert_eq!(f.pool.connected(), 2, "two shards connected");
    let mut per = f.pool.images_per_connection();
    per.sort();
    assert_eq!(per, vec![1, 2]);
    for (i, dev) in [&a, &b, &c].into_iter().enumerate() {
        let data = pattern(4096, i as u8);
        write(dev, 0, &data, false);
        assert_eq!(read(dev, 0, 4096), data);
    }
    drop(c);
    let mut per = f.pool.images_per_connection();
    per.sort();
    assert_eq!(per, vec![1, 1], "closing gives the slot back");
}

/// QD32 random 4 KiB writes then verified reads from several submitting threads: every
/// completion arrives once, with its own buffer.
#[test]
fn many_concurrent_ops_complete_once_with_their_buffers() {
    let mut f = Fixture::new(1);
    let dev = Arc::new(f.open(64 * MIB));
    let (tx, rx) = mpsc::channel::<IoDone>();
    let c: Arc<dyn IoCompletion> = Arc::new(Waiter(Mutex::new(tx)));
    let blocks = 1024u64; // distinct 4 KiB blocks, spread over the image
    let at = |i: u64| (i * 61 % (64 * MIB / 4096)) * 4096;
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let dev = dev.clone();
            let c = c.clone();
            std::thread::spawn(move || {
                for i in (t..blocks).step_by(4) {
                    let mut data = pattern(4096, i as u8);
                    data[..8].copy_from_slice(&i.to_le_bytes());
                    dev.submit(
                        i,
                        IoOp::Write {
                            offset: at(i),
                            buf: IoBuf::from_vec(data),
                            fua: false,
                        },
                        &c,
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut seen = vec![false; blocks as usize];
    for _ in 0..blocks {
        let done = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("write completion");
        done.result.expect("write");
        assert!(!seen[done.tag as usize], "tag {} completed twice", done.tag);
        seen[done.tag as usize] = true;
    }
    for i in 0..blocks {
        dev.submit(
            i,
            IoOp::Read {
                offset: at(i),
                buf: IoBuf::zeroed(4096),
            },
            &c,
        );
    }
    for _ in 0..blocks {
        let done = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("read completion");
        done.result.expect("read");
        let IoOp::Read { buf, .. } = done.op else {
            panic!("not a read")
        };
        let mut want = pattern(4096, done.tag as u8);
        want[..8].copy_from_slice(&done.tag.to_le_bytes());
        assert_eq!(buf.as_slice(), &want[..], "block {}", done.tag);
    }
}

/// Not a check: 4 KiB random write/read IOPS and latency straight through RbdDevice (the
/// baseline the gateway is compared with). Run with
/// `cargo test --release -p rbd-backend --features ceph-tests --test ceph -- --ignored --nocapture bench`
/// (env BENCH_SECS, default 5; BENCH_QDS, default "1,16"; BENCH_IMAGE: an existing image to
/// use instead of a fresh 1 GiB one, which is prefilled first so reads hit written objects).
#[test]
#[ignore]
fn bench_4k_random_through_rbd_device() {
    let secs: f64 = std::env::var("BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    let qds: Vec<usize> = std::env::var("BENCH_QDS")
        .unwrap_or_else(|_| "1,16".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let mut f = Fixture::new(1);
    let dev = match std::env::var("BENCH_IMAGE") {
        Ok(image) => f
            .pool
            .open(&ImageSpec {
                pool: pool_name(),
                namespace: None,
                image,
            })
            .expect("open BENCH_IMAGE"),
        Err(_) => {
            let dev = f.open(1 << 30);
            let chunk = pattern(4 * MIB as usize, 0x77);
            for i in 0..256u64 {
                write(&dev, i * 4 * MIB, &chunk, false);
            }
            dev
        }
    };
    let dev = Arc::new(dev);
    let blocks = dev.size_bytes() / 4096;
    for write_op in [true, false] {
        for &qd in &qds {
            let (tx, rx) = mpsc::channel::<IoDone>();
            let c: Arc<dyn IoCompletion> = Arc::new(Waiter(Mutex::new(tx)));
            let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ qd as u64;
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng % blocks) * 4096
            };
            let mut started = vec![Instant::now(); qd];
            let mk = |off: u64, buf: IoBuf| {
                if write_op {
                    IoOp::Write {
                        offset: off,
                        buf,
                        fua: false,
                    }
                } else {
                    IoOp::Read { offset: off, buf }
                }
            };
            let t0 = Instant::now();
            let deadline = t0 + Duration::from_secs_f64(secs);
            for (i, s) in started.iter_mut().enumerate() {
                *s = Instant::now();
                dev.submit(
                    i as u64,
                    mk(next(), IoBuf::from_vec(pattern(4096, i as u8))),
                    &c,
                );
            }
            let mut lat = Vec::new();
            let mut inflight = qd;
            while inflight > 0 {
                let done = rx
                    .recv_timeout(Duration::from_secs(60))
                    .expect("completion");
                done.result.expect("bench op");
                let i = done.tag as usize;
                lat.push(started[i].elapsed().as_micros() as u64);
                if Instant::now() < deadline {
                    let buf = match done.op {
                        IoOp::Write { buf, .. } | IoOp::Read { buf, .. } => buf,
                        _ => IoBuf::zeroed(4096),
                    };
                    started[i] = Instant::now();
                    dev.submit(done.tag, mk(next(), buf), &c);
                } else {
                    inflight -= 1;
                }
            }
            let el = t0.elapsed().as_secs_f64();
            lat.sort_unstable();
            let p = |x: f64| lat[((lat.len() - 1) as f64 * x) as usize];
            let mean = lat.iter().sum::<u64>() as f64 / lat.len() as f64;
            println!(
                "rbd-device {} qd={qd}: {:.0} IOPS, lat mean {mean:.0} p50 {} p99 {} us",
                if write_op { "randwrite" } else { "randread" },
                lat.len() as f64 / el,
                p(0.5),
                p(0.99)
            );
        }
    }
}

/// Held by each test that stops the OSD, so that one test's SIGCONT does not end another's
/// stop early.
static OSD_STOPS: Mutex<()> = Mutex::new(());

/// Resumes the OSD (SIGCONT) when dropped, however the test that stopped it ends.
struct Resume;

impl Drop for Resume {
    fn drop(&mut self) {
        signal_osd("CONT");
    }
}

/// Sends `signal` to the micro cluster's OSD (PIDs from `$MICRO_CEPH_DIR/pids`).
fn signal_osd(signal: &str) {
    let dir = std::env::var("MICRO_CEPH_DIR")
        .expect("MICRO_CEPH_DIR (set by scripts/micro-ceph.sh env) names the cluster to stop");
    let pids = std::fs::read_to_string(format!("{dir}/pids")).expect("read $MICRO_CEPH_DIR/pids");
    let pid = pids
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            let pid = f.next()?;
            (f.next()? == "osd.0").then(|| pid.to_string())
        })
        .expect("osd.0 in pids");
    let ok = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(&pid)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill -{signal} {pid}");
}

/// A stopped OSD: I/O waits (librbd retries; no rados_osd_op_timeout is set) and completes
/// without an error once the OSD runs again. Opt-in (`MICRO_CEPH_FAULT_TESTS=1`, which
/// tests/ceph-tests.sh sets): it pauses every other test's I/O too.
#[test]
fn a_stopped_osd_is_a_pause_not_an_error() {
    if std::env::var("MICRO_CEPH_FAULT_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set MICRO_CEPH_FAULT_TESTS=1 (stops the cluster's OSD for 4 s)");
        return;
    }
    let _serial = OSD_STOPS.lock().unwrap_or_else(|e| e.into_inner());
    let mut f = Fixture::new(1);
    let dev = Arc::new(f.open(16 * MIB));
    let (tx, rx) = mpsc::channel::<IoDone>();
    let c: Arc<dyn IoCompletion> = Arc::new(Waiter(Mutex::new(tx)));
    let qd = 4u64;
    let mut started = vec![Instant::now(); qd as usize];
    let mut seq = 0u64;
    let mut submit = |dev: &RbdDevice, slot: u64, started: &mut Vec<Instant>| {
        seq += 1;
        started[slot as usize] = Instant::now();
        let data = pattern(4096, seq as u8);
        dev.submit(
            slot,
            IoOp::Write {
                offset: (seq % 4096) * 4096,
                buf: IoBuf::from_vec(data),
                fua: false,
            },
            &c,
        );
    };
    for slot in 0..qd {
        submit(&dev, slot, &mut started);
    }
    let t0 = Instant::now();
    let mut resume = None;
    let mut stopped_at = None;
    let mut longest = Duration::ZERO;
    let mut ops = 0u64;
    let mut inflight = qd;
    // The device's op ages (what the stall watch asks): none old before the stop, an op
    // older than 2 s while the OSD is stopped, none at all once everything completed.
    let (mut young_before, mut old_while_stopped) = (None, None);
    while inflight > 0 {
        let el = t0.elapsed();
        if young_before.is_none() && el > Duration::from_millis(900) {
            young_before = Some(!dev.has_op_older_than(Instant::now(), Duration::from_secs(1)));
        }
        if stopped_at.is_none() && el > Duration::from_secs(1) {
            signal_osd("STOP");
            resume = Some(Resume);
            stopped_at = Some(Instant::now());
        }
        if let Some(at) = stopped_at {
            if old_while_stopped.is_none() && at.elapsed() > Duration::from_millis(2500) {
                old_while_stopped =
                    Some(dev.has_op_older_than(Instant::now(), Duration::from_secs(2)));
            }
            if resume.is_some() && at.elapsed() > Duration::from_secs(4) {
                resume = None; // SIGCONT
            }
        }
        let done = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(d) => d,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                assert!(el < Duration::from_secs(90), "I/O did not resume");
                continue;
            }
            Err(e) => panic!("{e}"),
        };
        done.result.expect("no error while the OSD is stopped");
        ops += 1;
        longest = longest.max(started[done.tag as usize].elapsed());
        if el < Duration::from_secs(7) {
            submit(&dev, done.tag, &mut started);
        } else {
            inflight -= 1;
        }
    }
    drop(resume);
    eprintln!("{ops} writes, longest {longest:?}");
    assert!(
        longest >= Duration::from_secs(3),
        "the pause was seen ({longest:?})"
    );
    assert!(ops > 100, "I/O before and after the pause");
    assert_eq!(
        young_before,
        Some(true),
        "no op older than 1 s before the stop"
    );
    assert_eq!(
        old_while_stopped,
        Some(true),
        "an op older than 2 s while stopped"
    );
    wait_until_nothing_in_flight(&dev);
    assert!(
        !dev.has_op_older_than(Instant::now(), op_ages::SLICE),
        "no op counted once all completed"
    );
}

/// The OSD probe (`rbd_backend::osd_probe`) tells an OSD that does not answer from one that
/// does, while the monitors keep answering: with the OSD stopped, a probe that waits 2 s
/// names it; a second probe while the first one's command still waits names it at once,
/// without asking again; once the OSD runs, it answers again. Opt-in like the tests above.
#[test]
fn the_osd_probe_names_a_stopped_osd_while_the_monitors_answer() {
    if std::env::var("MICRO_CEPH_FAULT_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set MICRO_CEPH_FAULT_TESTS=1 (stops the cluster's OSD)");
        return;
    }
    use rbd_backend::osd_probe::probe_osds_through;
    use rbd_backend::rados::Client;
    let _serial = OSD_STOPS.lock().unwrap_or_else(|e| e.into_inner());
    let mut f = Fixture::new(1);
    // An open image: a usable connection of this process, for probe_these_osds below.
    let _dev = f.open(MIB);
    let wait = Duration::from_secs(2);
    let client = Client::connect(&settings(1)).expect("connect");
    let probe_osds = |wait| probe_osds_through(&client, wait).expect("probe");
    let running = probe_osds(wait);
    assert_eq!(
        running.asked, 1,
        "the micro cluster has one OSD: {running:?}"
    );
    assert!(running.unanswered.is_empty(), "{running:?}");

    signal_osd("STOP");
    let resume = Resume;
    let t = Instant::now();
    let stopped = probe_osds(wait);
    assert_eq!(stopped.unanswered, vec![0], "{stopped:?}");
    assert!(t.elapsed() >= wait, "it waited for the answer");
    assert_eq!(
        rbd_backend::rados::probe_monitors().ok(),
        Some(true),
        "the monitors still answer"
    );
    // What the control plane's leader asks to check another process's report: the same.
    let these = rbd_backend::osd_probe::probe_these_osds(&[0], wait)
        .expect("probe")
        .expect("a connection");
    assert_eq!(these.unanswered, vec![0], "{these:?}");
    let t = Instant::now();
    let again = probe_osds(wait);
    assert_eq!(again.unanswered, vec![0], "{again:?}");
    assert!(
        t.elapsed() < wait,
        "an OSD still owing an answer is not asked again ({:?})",
        t.elapsed()
    );

    drop(resume);
    let t = Instant::now();
    loop {
        let p = probe_osds(wait);
        if p.unanswered.is_empty() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the OSD answers again once it runs: {p:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("the OSD answered again {:?} after SIGCONT", t.elapsed());
}

/// librbd dispatches ops on the submitting thread (the gateway's default), so nothing on
/// that path may wait for the cluster: with the OSD stopped, submitting more ops and bytes
/// than the Objecter's default budget (1024 ops, 100 MiB) on one connection returns at once
/// (with the throttle, the 1025th submit would sleep until the OSD answered), and every op
/// completes without an error once the OSD runs again. Opt-in like the test above.
#[test]
fn submitting_never_waits_for_a_stopped_osd() {
    if std::env::var("MICRO_CEPH_FAULT_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set MICRO_CEPH_FAULT_TESTS=1 (stops the cluster's OSD)");
        return;
    }
    let _serial = OSD_STOPS.lock().unwrap_or_else(|e| e.into_inner());
    let mut f = Fixture::new(1);
    let size = 4 * OBJ;
    let dev = Arc::new(f.open(size));
    // Written in full, so every read below is a read of an existing object on the OSD.
    let contents: Vec<Vec<u8>> = (0..4).map(|o| pattern(OBJ as usize, o as u8)).collect();
    for (object, data) in contents.iter().enumerate() {
        write(&dev, object as u64 * OBJ, data, false);
    }
    let small_reads = 1500u64;
    let big_reads = 30u64; // 30 x 4 MiB: over the 100 MiB byte budget on their own
    let (tx, rx) = mpsc::channel::<IoDone>();
    let c: Arc<dyn IoCompletion> = Arc::new(Waiter(Mutex::new(tx)));
    signal_osd("STOP");
    let resume = Resume;
    let (submitted_tx, submitted_rx) = mpsc::channel();
    let submitter = {
        let dev = dev.clone();
        std::thread::spawn(move || {
            for i in 0..small_reads {
                let offset = (i * 7919 * 4096) % size;
                let buf = IoBuf::zeroed(4096);
                dev.submit(i, IoOp::Read { offset, buf }, &c);
            }
            for i in 0..big_reads {
                let offset = (i % 4) * OBJ;
                let buf = IoBuf::zeroed(OBJ as usize);
                dev.submit(small_reads + i, IoOp::Read { offset, buf }, &c);
            }
            let _ = submitted_tx.send(());
        })
    };
    // A hang detector, not a timing: submitting 1530 ops takes milliseconds.
    let submitted = submitted_rx.recv_timeout(Duration::from_secs(30));
    drop(resume); // SIGCONT
    submitted.expect("submitting waited for the stopped OSD");
    submitter.join().expect("submitter thread");
    let mut seen = vec![false; (small_reads + big_reads) as usize];
    for _ in 0..seen.len() {
        let done = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("every op completes after the OSD resumes");
        done.result.expect("no error after a pause");
        let slot = &mut seen[done.tag as usize];
        assert!(!*slot, "one completion per op");
        *slot = true;
        if let IoOp::Read { offset, buf } = &done.op {
            let expected = &contents[(offset / OBJ) as usize];
            let start = (offset % OBJ) as usize;
            assert!(
                buf.as_slice() == &expected[start..start + buf.len()],
                "read at {offset} returned the data written"
            );
        }
    }
}

fn rss_kib_and_threads() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("Threads:"))
}

/// Not a check: memory and threads per idle cluster connection and per open image, and 4 KiB
/// random-read IOPS (total QD 16, spread over the images) for 1..32 images. Run with
/// `cargo test --release -p rbd-backend --features ceph-tests --test ceph -- --ignored --nocapture --test-threads=1 measure`
#[test]
#[ignore]
fn measure_memory_and_image_scaling() {
    let conns: usize = std::env::var("BENCH_CONNECTIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let secs: f64 = std::env::var("BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    // idle connections
    let (rss0, th0) = rss_kib_and_threads();
    let pools: Vec<_> = (0..4)
        .map(|_| {
            let p = ClusterPool::new(settings(1));
            p.conf_get("rbd_cache").expect("connect");
            p
        })
        .collect();
    let (rss1, th1) = rss_kib_and_threads();
    println!(
        "idle connection: {} KiB RSS, {} threads each (4 connections)",
        (rss1 - rss0) / 4,
        (th1 - th0) / 4
    );
    drop(pools);
    // images
    let mut f = Fixture::new(conns);
    let specs: Vec<ImageSpec> = (0..32).map(|_| f.image(8 * MIB)).collect();
    f.pool.conf_get("rbd_cache").expect("connect");
    let (rss2, th2) = rss_kib_and_threads();
    let devs: Vec<Arc<RbdDevice>> = specs
        .iter()
        .map(|s| Arc::new(f.pool.open(s).expect("open")))
        .collect();
    let (rss3, th3) = rss_kib_and_threads();
    println!(
        "open image: {} KiB RSS, {:.1} threads each (32 images on {} connections; before I/O)",
        (rss3 - rss2) / 32,
        (th3 - th2) as f64 / 32.0,
        f.pool.connected()
    );
    // fill every object: reads of never-written objects are answered from the object map
    // without an OSD round trip
    let fill = pattern(4 * MIB as usize, 1);
    for d in &devs {
        write(d, 0, &fill, false);
        write(d, 4 * MIB, &fill, false);
    }
    let (rss4, th4) = rss_kib_and_threads();
    println!(
        "after first I/O: {} KiB RSS, {:.1} threads per image",
        (rss4 - rss2) / 32,
        (th4 - th2) as f64 / 32.0
    );
    for n in [1usize, 4, 16, 32] {
        let (tx, rx) = mpsc::channel::<IoDone>();
        let c: Arc<dyn IoCompletion> = Arc::new(Waiter(Mutex::new(tx)));
        let qd = 16usize;
        let mut rng = 0x1234_5678_9abc_def1u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs_f64(secs);
        for slot in 0..qd {
            let d = &devs[slot % n];
            let off = (next() % (8 * MIB / 4096)) * 4096;
            d.submit(
                slot as u64,
                IoOp::Read {
                    offset: off,
                    buf: IoBuf::zeroed(4096),
                },
                &c,
            );
        }
        let mut ops = 0u64;
        let mut inflight = qd;
        while inflight > 0 {
            let done = rx
                .recv_timeout(Duration::from_secs(60))
                .expect("completion");
            done.result.expect("read");
            ops += 1;
            if Instant::now() < deadline {
                let slot = done.tag as usize;
                let buf = match done.op {
                    IoOp::Read { buf, .. } => buf,
                    _ => IoBuf::zeroed(4096),
                };
                let off = (next() % (8 * MIB / 4096)) * 4096;
                devs[(slot + ops as usize) % n].submit(
                    done.tag,
                    IoOp::Read { offset: off, buf },
                    &c,
                );
            } else {
                inflight -= 1;
            }
        }
        println!(
            "{n:>2} images, QD16 total, {conns} connections: {:.0} IOPS (4 KiB random read)",
            ops as f64 / t0.elapsed().as_secs_f64()
        );
    }
}

/// An image in a RADOS namespace of the pool (`rbd namespace create`): found only there.
#[test]
fn images_in_a_rados_namespace() {
    let f = Fixture::new(1);
    let ns = format!("ns{}", std::process::id());
    let out = std::process::Command::new("rbd")
        .args([
            "namespace",
            "create",
            "--pool",
            &pool_name(),
            "--namespace",
            &ns,
        ])
        .output()
        .expect("run rbd (apt-get install ceph-common)");
    assert!(
        out.status.success(),
        "rbd namespace create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let admin = f
        .pool
        .admin(&pool_name(), Some(&ns))
        .expect("namespace context");
    admin
        .create_image("in-ns", 4 * MIB)
        .expect("create in namespace");
    let spec = ImageSpec {
        pool: pool_name(),
        namespace: Some(ns.clone()),
        image: "in-ns".into(),
    };
    assert_eq!(spec.to_string(), format!("{}/{ns}/in-ns", pool_name()));
    {
        let dev = f.pool.open(&spec).expect("open in namespace");
        assert_eq!(dev.name(), spec.to_string());
        let data = pattern(4096, 5);
        write(&dev, 0, &data, false);
        assert_eq!(read(&dev, 0, 4096), data);
    }
    let outside = ImageSpec {
        namespace: None,
        ..spec.clone()
    };
    assert!(matches!(
        f.pool.open(&outside),
        Err(RbdError::ImageNotFound { .. })
    ));
    rbd_backend::rbd::wait_for_closes(Duration::from_secs(30));
    admin.remove_image("in-ns").expect("remove");
    let _ = std::process::Command::new("rbd")
        .args([
            "namespace",
            "remove",
            "--pool",
            &pool_name(),
            "--namespace",
            &ns,
        ])
        .output();
}

/// Dropping a device with I/O in flight: every op still completes (the requests keep the
/// image open), then the image is closed in the background.
#[test]
fn dropping_a_device_with_io_in_flight_is_safe() {
    let mut f = Fixture::new(1);
    for round in 0..5u8 {
        let dev = f.open(8 * MIB);
        let (tx, rx) = mpsc::channel::<IoDone>();
        let c: Arc<dyn IoCompletion> = Arc::new(Waiter(Mutex::new(tx)));
        for i in 0..64u64 {
            let op = match i % 4 {
                0 => IoOp::Read {
                    offset: i * 4096,
                    buf: IoBuf::zeroed(4096),
                },
                1 => IoOp::Write {
                    offset: i * 4096,
                    buf: IoBuf::from_vec(pattern(4096, round)),
                    fua: true,
                },
                2 => IoOp::WriteZeroes {
                    offset: i * 4096,
                    len: 4096,
                },
                _ => IoOp::CompareAndWrite {
                    offset: i * 4096,
                    compare: IoBuf::zeroed(4096),
                    write: IoBuf::from_vec(pattern(4096, round)),
                },
            };
            dev.submit(i, op, &c);
        }
        drop(dev);
        drop(c);
        let mut n = 0;
        while let Ok(done) = rx.recv_timeout(Duration::from_secs(60)) {
            match (done.tag % 4, done.result) {
                (3, Err(IoError::Miscompare { .. })) | (_, Ok(())) => {}
                (_, Err(e)) => panic!("op {}: {e}", done.tag),
            }
            n += 1;
        }
        assert_eq!(n, 64, "every op completes once");
        assert!(
            rbd_backend::rbd::wait_for_closes(Duration::from_secs(30)),
            "image closed"
        );
    }
}

/// Collects device events.
#[derive(Default)]
struct SeenEvents(Mutex<Vec<DeviceEvent>>);

impl DeviceEventSink for SeenEvents {
    fn device_event(&self, event: DeviceEvent) {
        self.0.lock().unwrap().push(event);
    }
}

/// Connections are sharded per ANA group: blocklisting one group's client addresses (what
/// the gateway group's control plane does to fence that group on a gateway) stops exactly that
/// group's I/O, with [`IoError::Fenced`] and a [`DeviceEvent::Fenced`], never a silent success;
/// nothing more goes through the fenced client; the other group keeps working on the same
/// pool; and the fenced group works again once it gets fresh clients (data as the last
/// successful write left it).
#[test]
fn a_fence_of_one_ana_group_leaves_the_other_working() {
    let mut f = Fixture::new(1);
    let pool = ClusterPool::new(settings(2));
    let (spec_a, spec_b) = (f.image(8 * MIB), f.image(8 * MIB));
    let dev_a = pool.open_in_group(&spec_a, 1).expect("open in group 1");
    let dev_b = pool.open_in_group(&spec_b, 2).expect("open in group 2");
    let events = Arc::new(SeenEvents::default());
    dev_a.set_event_sink(events.clone());
    write(&dev_a, 0, &pattern(4096, 1), false);
    write(&dev_b, 0, &pattern(4096, 2), false);

    // Each group has its own client, and the process reports them per group.
    let by_group = rbd_backend::rados::client_addrs_by_group();
    let addrs_a = pool.group_addrs(1);
    let addrs_b = pool.group_addrs(2);
    assert_eq!(addrs_a.len(), 1, "{addrs_a:?}");
    assert_eq!(addrs_b.len(), 1, "{addrs_b:?}");
    assert_ne!(addrs_a, addrs_b, "groups 1 and 2 share a client");
    assert!(by_group.get(&1).is_some_and(|a| a.contains(&addrs_a[0])));
    assert!(by_group.get(&2).is_some_and(|a| a.contains(&addrs_b[0])));

    // Ops in flight are counted until their completion is delivered (what a drain waits for).
    // The sink holds every delivery until released, so the count cannot have dropped to zero
    // before it is read (a fast OSD may finish 32 writes while they are being submitted).
    let (tx, rx) = mpsc::channel();
    let gated = Arc::new(GatedWaiter {
        tx: Mutex::new(tx),
        open: Mutex::new(false),
        opened: Condvar::new(),
    });
    let waiter: Arc<dyn IoCompletion> = gated.clone();
    for i in 0..32u64 {
        dev_b.submit(
            i,
            IoOp::Write {
                offset: 8192 + i * 4096,
                buf: IoBuf::from_vec(pattern(4096, 7)),
                fua: false,
            },
            &waiter,
        );
    }
    assert!(dev_b.in_flight() > 0, "nothing counted in flight");
    gated.release();
    for _ in 0..32 {
        let done = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("completion");
        done.result.expect("write");
    }
    wait_until_nothing_in_flight(&dev_b);

    // Fence group 1 as the control plane does: blocklist its client, then the osdmap.
    let admin = rbd_backend::rados::Client::connect(&settings(1)).expect("admin client");
    admin
        .blocklist_add(&addrs_a[0], Some(Duration::from_secs(600)))
        .expect("blocklist group 1");
    rbd_backend::rados::wait_for_latest_osdmap_all().expect("osdmap");

    // Group 1: its write fails as fenced (retried until the OSDs have the new map) ...
    let started = Instant::now();
    let mut expected_at_0 = pattern(4096, 1);
    let first = loop {
        let done = run(
            &dev_a,
            IoOp::Write {
                offset: 0,
                buf: IoBuf::from_vec(pattern(4096, 3)),
                fua: false,
            },
        );
        match done.result {
            Err(e) => break e,
            Ok(()) => {
                // An OSD that has not seen the blocklist yet may still take one.
                expected_at_0 = pattern(4096, 3);
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "writes through a blocklisted client kept succeeding"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    assert!(matches!(first, IoError::Fenced(_)), "{first:?}");
    assert!(dev_a.client().is_blocklisted());
    assert!(pool.group_blocklisted(1));
    assert!(!pool.group_blocklisted(2));
    assert_eq!(events.0.lock().unwrap().as_slice(), &[DeviceEvent::Fenced]);
    // ... and every later op fails at once, without librbd (reads too).
    let fast = Instant::now();
    for _ in 0..100 {
        let done = run(
            &dev_a,
            IoOp::Write {
                offset: 4096,
                buf: IoBuf::from_vec(pattern(4096, 4)),
                fua: true,
            },
        );
        assert!(matches!(done.result, Err(IoError::Fenced(_))));
    }
    assert!(
        fast.elapsed() < Duration::from_millis(500),
        "fenced ops went to the cluster: {:?}",
        fast.elapsed()
    );
    let done = run(
        &dev_a,
        IoOp::Read {
            offset: 0,
            buf: IoBuf::zeroed(4096),
        },
    );
    assert!(matches!(done.result, Err(IoError::Fenced(_))));
    assert_eq!(
        events.0.lock().unwrap().len(),
        1,
        "the fence is reported once"
    );
    wait_until_nothing_in_flight(&dev_a);

    // Group 2, same pool and process: unaffected.
    write(&dev_b, 4096, &pattern(4096, 5), true);
    assert_eq!(read(&dev_b, 0, 4096), pattern(4096, 2));
    assert_eq!(read(&dev_b, 4096, 4096), pattern(4096, 5));

    // Group 1 given back: fresh clients (not blocklisted), image reopened. The fenced writes
    // did not land.
    assert_eq!(pool.retire_group(1), 1);
    assert!(
        rbd_backend::rados::client_addrs_by_group()
            .get(&1)
            .is_none_or(|a| !a.contains(&addrs_a[0])),
        "a retired client is still reported for its group"
    );
    let counted = dev_a.io_stats().expect("an RBD device counts its ops");
    let fresh = dev_a.reopen_in_group(1).expect("reopen on a fresh client");
    assert_ne!(pool.group_addrs(1), addrs_a, "the same client again");
    assert!(!fresh.client().is_blocklisted());
    drop(dev_a);
    assert_eq!(
        read(&fresh, 0, 4096),
        expected_at_0,
        "a fenced write landed"
    );
    assert_eq!(
        read(&fresh, 4096, 4096),
        vec![0; 4096],
        "a fenced write landed"
    );
    write(&fresh, 0, &pattern(4096, 6), true);
    assert_eq!(read(&fresh, 0, 4096), pattern(4096, 6));
    // The reopened device counts on from the old one's totals (a namespace's counters do
    // not go back to 0 when a failback gives its group fresh clients).
    let writes = |s: rbd_backend::IoStatsSnapshot| s.get(OpKind::Write).completed;
    assert_eq!(
        writes(fresh.io_stats().expect("counts")),
        writes(counted) + 1,
        "the reopened device started counting from 0"
    );

    let _ = admin.blocklist_rm(&addrs_a[0]);
    drop(fresh);
    drop(dev_b);
}

fn store_record(dev: &RbdDevice, key: &str, value: &[u8]) -> Result<(), IoError> {
    run(
        dev,
        IoOp::StoreRecord {
            key: key.into(),
            value: value.to_vec(),
        },
    )
    .result
}

/// What a gateway group's reservations rest on: a record stored with an image
/// ([`IoOp::StoreRecord`]) is read back by another client (the next ANA owner), replaces the
/// earlier value, stays apart per key and per image; and a client blocklisted by the
/// cluster (a fenced gateway) cannot store one, so what the next owner loads is the last
/// record stored before the fence. Also prints the store latency (the cost a reservation
/// change pays in a group).
#[test]
fn records_are_stored_with_the_image_and_a_fenced_client_cannot_store_them() {
    let mut f = Fixture::new(1);
    let pool = ClusterPool::new(settings(2));
    let (spec, other_spec) = (f.image(8 * MIB), f.image(8 * MIB));
    let owner = pool.open_in_group(&spec, 1).expect("open in group 1");
    let next_owner_pool = ClusterPool::new(settings(1));
    let next_owner = next_owner_pool
        .open_in_group(&spec, 2)
        .expect("open on another client");
    let other_image = pool.open_in_group(&other_spec, 1).expect("other image");

    assert_eq!(owner.load_record("resv").expect("load"), None, "none yet");
    store_record(&owner, "resv", b"first").expect("store");
    store_record(&owner, "resv", b"second").expect("store again");
    store_record(&owner, "other-key", b"x").expect("another key");
    assert_eq!(
        next_owner.load_record("resv").expect("load"),
        Some(b"second".to_vec()),
        "another client reads the last value"
    );
    assert_eq!(
        other_image.load_record("resv").expect("load"),
        None,
        "records belong to their image"
    );
    // The records thread counts a store down just after delivering its completion (so a
    // drain never sees a device idle before its completion is out): wait for that moment.
    let counted_down = Instant::now();
    while RbdDevice::in_flight(&owner) != 0 && counted_down.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        RbdDevice::in_flight(&owner),
        0,
        "a finished store is not counted in flight"
    );

    // Latency of one store (a round trip to the OSD through the records thread).
    let mut times = Vec::new();
    for i in 0..50u32 {
        let started = Instant::now();
        store_record(&owner, "resv", &i.to_le_bytes()).expect("store");
        times.push(started.elapsed());
    }
    times.sort();
    println!(
        "record store latency over {} stores: p50 {:?}, p99 {:?}, max {:?}",
        times.len(),
        times[times.len() / 2],
        times[times.len() * 99 / 100],
        times[times.len() - 1]
    );
    store_record(&owner, "resv", b"before the fence").expect("store");

    // Fence the owner's client as the control plane does.
    let addrs = pool.group_addrs(1);
    let admin = rbd_backend::rados::Client::connect(&settings(1)).expect("admin client");
    admin
        .blocklist_add(&addrs[0], Some(Duration::from_secs(600)))
        .expect("blocklist");
    rbd_backend::rados::wait_for_latest_osdmap_all().expect("osdmap");
    let started = Instant::now();
    let mut last_stored = b"before the fence".to_vec();
    let error = loop {
        let value = format!("after the fence {}", started.elapsed().as_micros()).into_bytes();
        match store_record(&owner, "resv", &value) {
            Err(e) => break e,
            Ok(()) => {
                // An OSD that has not seen the new map yet may still take one.
                last_stored = value;
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "stores through a blocklisted client kept succeeding"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    assert!(matches!(error, IoError::Fenced(_)), "{error:?}");
    assert!(owner.client().is_blocklisted());
    assert!(matches!(
        store_record(&owner, "resv", b"refused"),
        Err(IoError::Fenced(_))
    ));
    assert!(matches!(owner.load_record("resv"), Err(IoError::Fenced(_))));
    assert_eq!(
        next_owner.load_record("resv").expect("load"),
        Some(last_stored),
        "the next owner reads the last record stored before the fence"
    );

    let _ = admin.blocklist_rm(&addrs[0]);
    drop((owner, next_owner, other_image));
    if let Ok(p) = admin.pool(&pool_name(), None) {
        for s in [&spec, &other_spec] {
            let _ = p.remove(&rbd_backend::rbd::record_object(&s.image));
        }
    }
}
