//! What the QoS check costs a 4K read when it never waits, without a socket: the data path's
//! submit for a namespace without limits (one relaxed load, then the device) against one
//! whose every limit is far above the rate (`nvmeof_gateway::qos::submit`: the clock, the
//! throttle's lock and its four buckets, then the device), on an in-memory device that
//! completes inline. Alternates the two over `--rounds` (default 5) and prints ns per op and
//! the difference; `tcp_loopback --qos` is the same comparison end to end.
//!
//!     cargo bench -p nvmeof-gateway --bench qos_check [-- --seconds 0.5 --rounds 5]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvmeof_gateway::core::qos::{NamespaceQos, QosLimits};
use rbd_backend::{BlockDevice, IoBuf, IoCompletion, IoDone, IoOp, MemoryDevice};

/// Keeps the finished op, so its buffer is used again.
#[derive(Default)]
struct Keep(Mutex<Option<IoOp>>);
impl IoCompletion for Keep {
    fn complete(&self, done: IoDone) {
        assert!(done.result.is_ok());
        *self.0.lock().unwrap() = Some(done.op);
    }
}

/// ns per op of `ops` 4K reads through `qos` (as the TCP connection submits them).
fn time(
    qos: &Arc<NamespaceQos>,
    device: &Arc<dyn BlockDevice>,
    keep: &Arc<Keep>,
    duration: Duration,
) -> f64 {
    let sink: Arc<dyn IoCompletion> = keep.clone();
    let begin = Instant::now();
    let mut n: u64 = 0;
    while begin.elapsed() < duration {
        for _ in 0..256 {
            let op = keep.0.lock().unwrap().take().expect("the op back");
            let device = device.clone();
            // What the core decides (`submit_action`) and the connection then runs.
            if qos.is_limited() {
                nvmeof_gateway::qos::submit(qos.clone(), device, n, op, &sink);
            } else {
                device.submit(n, op, &sink);
            }
            n += 1;
        }
    }
    assert_eq!(qos.waiting(), 0, "an op waited");
    begin.elapsed().as_nanos() as f64 / n as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
    };
    let seconds = value("--seconds")
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(0.5);
    // `cargo test --benches` runs benches with --bench absent: keep that quick.
    let duration = if args.iter().any(|a| a == "--bench") {
        Duration::from_secs_f64(seconds)
    } else {
        Duration::from_millis(20)
    };
    let rounds = value("--rounds")
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or(5)
        .max(1);

    // `qos::submit` reads tokio's clock (and would spawn the wait): run inside a runtime.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _guard = rt.enter();
    let device: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new("mem", 1 << 20));
    let keep = Arc::new(Keep::default());
    let sink: Arc<dyn IoCompletion> = keep.clone();
    // Written once, so the reads copy allocated memory.
    device.submit(
        0,
        IoOp::Write {
            offset: 0,
            buf: IoBuf::zeroed(4096),
            fua: false,
        },
        &sink,
    );
    *keep.0.lock().unwrap() = Some(IoOp::Read {
        offset: 0,
        buf: IoBuf::zeroed(4096),
    });
    let unlimited = Arc::new(NamespaceQos::default());
    // Every limit at its maximum (control_plane::qos): all four buckets are drawn from.
    let far_above = Arc::new(NamespaceQos::new(QosLimits {
        rw_ios_per_second: 100_000_000,
        rw_megabytes_per_second: 1 << 20,
        r_megabytes_per_second: 1 << 20,
        w_megabytes_per_second: 1 << 20,
    }));

    let (mut a, mut b) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        if round % 2 == 0 {
            a.push(time(&unlimited, &device, &keep, duration));
            b.push(time(&far_above, &device, &keep, duration));
        } else {
            b.push(time(&far_above, &device, &keep, duration));
            a.push(time(&unlimited, &device, &keep, duration));
        }
    }
    let (commands, _) = far_above.throttled();
    assert_eq!(commands, 0, "no op was held back");
    let diffs: Vec<f64> = a.iter().zip(&b).map(|(a, b)| b - a).collect();
    let lo = diffs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = diffs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    println!(
        "QoS check, 4K read on an in-memory device (inline), {:.2} s per run, {rounds} rounds",
        duration.as_secs_f64()
    );
    println!(
        "{:>22} {:>22} {:>26}",
        "no limit ns/op (a)", "limits far above (b)", "b - a ns/op [min-max]"
    );
    println!(
        "{:>22.1} {:>22.1} {:>10.1} [{:.1} to {:.1}]",
        median(a),
        median(b),
        median(diffs),
        lo,
        hi
    );
}
