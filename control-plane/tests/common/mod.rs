//! What the tests that run the `nvmeofctl` binary share. Each test crate uses part of it.
#![allow(dead_code)]

use std::process::Command;

/// `nvmeofctl ARGS` with nothing taken from the environment: no `NVMEOFCTL_*` server or TLS
/// files of whoever runs the tests.
pub fn nvmeofctl(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvmeofctl"));
    cmd.args(args)
        .env_remove("NVMEOFCTL_TLS_CA")
        .env_remove("NVMEOFCTL_TLS_CERT")
        .env_remove("NVMEOFCTL_TLS_KEY")
        .env_remove("NVMEOFCTL_SERVER");
    cmd
}

/// Runs `nvmeofctl --server ADDR ARGS`: its exit code (-1: killed by a signal), standard
/// output and standard error.
pub fn ctl(addr: &str, args: &[&str]) -> (i32, String, String) {
    let out = nvmeofctl(&["--server", addr])
        .args(args)
        .output()
        .expect("run nvmeofctl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
