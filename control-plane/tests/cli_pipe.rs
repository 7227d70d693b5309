//! `nvmeofctl ... | head` must not panic: when the reader of its standard output has gone, it
//! ends as Unix tools do (killed by SIGPIPE, nothing on standard error) instead of Rust's
//! "failed printing to stdout: Broken pipe" panic.

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::time::Duration;

use control_plane::store::Store;
use control_plane::test_support;

mod common;

/// SIGPIPE's number on Linux (signal(7)).
const SIGPIPE: i32 = 13;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_to_a_closed_pipe_ends_quietly() {
    let backend = test_support::memory_backend_with_images(Vec::<String>::new());
    let cp = test_support::start_replica(Store::new(backend), "test", Default::default()).await;
    test_support::wait_for_lease(&cp, Duration::from_secs(10)).await;
    let addr = test_support::serve_plain(cp).await;
    let (code, _, err) = common::ctl(
        &addr,
        &["subsystem", "add", "--nqn", "nqn.2016-06.io.test:pipe"],
    );
    assert_eq!(code, 0, "subsystem add: {err}");

    let mut child = common::nvmeofctl(&["--server", &addr, "subsystem", "list"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run nvmeofctl");
    // The reader goes away before nvmeofctl writes a byte: its first write meets a closed pipe.
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait for nvmeofctl");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "nvmeofctl panicked: {stderr}");
    assert_eq!(
        out.status.signal(),
        Some(SIGPIPE),
        "nvmeofctl should end by SIGPIPE, got {:?}; stderr: {stderr}",
        out.status
    );
}
