//! The daemon raises its soft open-file limit to the hard limit at start (see
//! `nvmeof_gateway::limits`): started with a soft limit of 256, the running process has
//! soft = hard, and says so in its log.

use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const STARTING_SOFT_LIMIT: u64 = 256;

/// (soft, hard) "Max open files" of a process, from /proc/PID/limits.
fn open_file_limits(pid: u32) -> (String, String) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("read limits");
    let line = text
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a 'Max open files' line");
    let fields: Vec<&str> = line["Max open files".len()..].split_whitespace().collect();
    (fields[0].to_string(), fields[1].to_string())
}

#[test]
fn the_gateway_raises_its_soft_open_file_limit_to_the_hard_limit() {
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    assert!(
        hard.is_none_or(|h| h > STARTING_SOFT_LIMIT),
        "this test needs a hard open-file limit above {STARTING_SOFT_LIMIT} (have {hard:?})"
    );
    let dir = std::env::temp_dir().join(format!("nvmeof-limits-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("test dir");
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            r#"[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {port}

[[subsystem]]
nqn = "nqn.2016-06.io.ceph-nvmeof-rs:limits"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "1MiB"
"#
        ),
    )
    .expect("write config");
    let log = dir.join("gateway.log");
    // The shell lowers the soft limit and then becomes the gateway (exec keeps the PID).
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -Sn {STARTING_SOFT_LIMIT} && exec \"$0\" --config \"$1\""
        ))
        .arg(env!("CARGO_BIN_EXE_nvmeof-gateway"))
        .arg(&config)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("start the gateway");
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "the gateway exited ({status}): {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        assert!(Instant::now() < deadline, "the gateway never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (soft, hard_seen) = open_file_limits(child.id());
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_ne!(
        soft,
        STARTING_SOFT_LIMIT.to_string(),
        "the soft limit was not raised"
    );
    assert_eq!(soft, hard_seen, "soft limit {soft}, hard limit {hard_seen}");
    assert!(
        log_text.contains("open-file limit raised to the hard limit"),
        "no log line about the raise: {log_text}"
    );
}
