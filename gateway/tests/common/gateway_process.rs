//! `nvmeof-gateway` processes (the binary built with the tests), their configuration files
//! and logs, and the configuration pieces the Ceph tests share.

use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use super::ceph::{ceph_conf, pool, run};
use super::poll_until;

/// A gateway process, killed (SIGKILL) when dropped if it still runs.
pub struct GatewayProcess {
    pub child: Child,
    /// The port of its listener.
    pub port: u16,
    /// Its log (stderr, `RUST_LOG=info`).
    pub log: PathBuf,
    /// Its configuration file.
    config: PathBuf,
}

impl GatewayProcess {
    /// Writes `config` to `dir/<name>.toml` and starts a gateway with it, logging to
    /// `dir/<name>.log`. `port` is the listener port `config` names.
    pub fn spawn(dir: &Path, name: &str, port: u16, config: &str) -> GatewayProcess {
        Self::spawn_via(dir, name, port, config, &[])
    }

    /// The same, started through `launcher` (a command that runs its last arguments: the
    /// gateway binary and `--config PATH`), e.g. a shell that first changes a limit and then
    /// `exec`s the gateway, so the PID stays the gateway's.
    pub fn spawn_via(
        dir: &Path,
        name: &str,
        port: u16,
        config: &str,
        launcher: &[&str],
    ) -> GatewayProcess {
        // A gateway dropped before may have taken the directory with it (below).
        std::fs::create_dir_all(dir).expect("scratch directory");
        let path = dir.join(format!("{name}.toml"));
        std::fs::write(&path, config).expect("write config");
        let log = dir.join(format!("{name}.log"));
        let binary = env!("CARGO_BIN_EXE_nvmeof-gateway");
        let mut command = match launcher.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(binary);
                c
            }
            None => Command::new(binary),
        };
        let child = command
            .arg("--config")
            .arg(&path)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("start nvmeof-gateway");
        GatewayProcess {
            child,
            port,
            log,
            config: path,
        }
    }

    /// Sends `signal` ("-STOP", "-CONT", "-TERM", ...) with kill(1).
    pub fn signal(&self, signal: &str) {
        run("kill", &[signal, &self.child.id().to_string()]);
    }

    /// What it has logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until its log contains `line`; panics with `failure` after `within`.
    pub async fn wait_for_log(&self, line: &str, within: Duration, failure: &str) {
        poll_until(within, Duration::from_millis(100), async || {
            if self.log_text().contains(line) {
                Ok(())
            } else {
                Err(failure.to_string())
            }
        })
        .await
    }

    /// Waits until it has exited and returns how; panics with `failure` after `within`.
    /// Waits until the process says its NVMe/TCP listener on `self.port` is bound. A
    /// standalone gateway's metrics endpoint comes up before its listeners, so a test that
    /// connects must wait for this, not for the metrics.
    pub async fn wait_for_listener(&self) {
        let port = format!(":{}", self.port);
        poll_until(
            Duration::from_secs(20),
            Duration::from_millis(20),
            async || {
                let ready = self.log_text().lines().any(|l| {
                    l.contains("NVMe/TCP listener ready") && l.trim_end().ends_with(&port)
                });
                if ready {
                    Ok(())
                } else {
                    Err(format!("no NVMe/TCP listener on port {}", self.port))
                }
            },
        )
        .await
    }

    /// Waits until the process says its metrics endpoint on 127.0.0.1:`port` is up.
    pub async fn wait_for_metrics(&self, port: u16) {
        self.wait_for_log(
            &format!("metrics at http://127.0.0.1:{port}/metrics"),
            Duration::from_secs(20),
            "the metrics endpoint never came up",
        )
        .await;
    }

    /// A gateway serving `subnqn` with one 16 MiB in-memory namespace and a metrics
    /// endpoint, with `gateway_lines` added to its `[gateway]` section; returns once the
    /// endpoint is up, with the NVMe/TCP and the metrics ports.
    pub async fn spawn_memory_with_metrics(
        dir: &Path,
        subnqn: &str,
        gateway_lines: &str,
    ) -> (GatewayProcess, u16, u16) {
        let port = super::free_port();
        let metrics_port = super::free_port();
        let config = format!(
            "[gateway]\n{gateway_lines}metrics_listen = \"127.0.0.1:{metrics_port}\"\n{}",
            super::memory_gateway_toml(port, subnqn, "16MiB")
        );
        let gateway = GatewayProcess::spawn(dir, "gateway", port, &config);
        gateway.wait_for_metrics(metrics_port).await;
        gateway.wait_for_listener().await;
        (gateway, port, metrics_port)
    }

    pub async fn exit_within(&mut self, within: Duration, failure: &str) -> ExitStatus {
        poll_until(within, Duration::from_millis(50), async || {
            match self.child.try_wait().expect("wait") {
                Some(status) => Ok(status),
                None => Err(failure.to_string()),
            }
        })
        .await
    }

    /// SIGTERM, then waits for it to exit (however long it takes) and returns how.
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal("-TERM");
        self.child.wait().expect("wait for the gateway")
    }
}

impl Drop for GatewayProcess {
    /// Kills the gateway. Unless the test is failing, also removes its configuration and
    /// log, and their directory once nothing else is in it (another gateway's files, a
    /// test's keys), so that passing runs leave nothing in `$TMPDIR`; a failing test keeps
    /// them for its reader.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            return;
        }
        let _ = std::fs::remove_file(&self.config);
        let _ = std::fs::remove_file(&self.log);
        if let Some(dir) = self.config.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A gateway of a group: `[gateway]` named `name` (one worker thread; `cntlids`, its
/// controller ID range, when it must be disjoint from another gateway's), `[group]` joining
/// the replica at `control_plane` as the owner of `ana_group` (beacons every 250 ms), a TCP
/// listener on `port` and `[ceph]` with one cluster connection. The subsystems come from the
/// control plane, or from sections appended to this text.
pub fn group_member_toml(
    name: &str,
    cntlids: Option<RangeInclusive<u16>>,
    control_plane: &str,
    ana_group: u32,
    port: u16,
) -> String {
    let cntlid_lines = cntlids
        .map(|r| format!("cntlid_min = {}\ncntlid_max = {}\n", r.start(), r.end()))
        .unwrap_or_default();
    format!(
        r#"
[gateway]
name = "{name}"
{cntlid_lines}worker_threads = 1

[group]
control_plane = ["{control_plane}"]
ana_group = {ana_group}
beacon_interval_ms = 250
{listener}
[ceph]
conf = "{conf}"
connections = 1
"#,
        listener = listener_toml(port),
        conf = ceph_conf(),
    )
}

/// Starts gw1, the owner of ANA group 1 in the group of the replica at `control_plane`,
/// listening on `port`, with no subsystem in its file: all it serves comes from the control
/// plane.
pub fn spawn_gw1_configured_by(dir: &Path, port: u16, control_plane: &str) -> GatewayProcess {
    let config = group_member_toml("gw1", None, control_plane, 1, port);
    GatewayProcess::spawn(dir, "gw1", port, &config)
}

/// A `[[listener]]` section: NVMe/TCP on 127.0.0.1:`port`.
pub fn listener_toml(port: u16) -> String {
    format!(
        r#"
[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {port}
"#
    )
}

/// A `[[subsystem]]` open to any host with one RBD namespace per `(image, ana_group)`, images
/// in the test pool, NSIDs from 1.
pub fn rbd_subsystem_toml(subnqn: &str, namespaces: &[(&str, u32)]) -> String {
    let mut toml = format!("\n[[subsystem]]\nnqn = \"{subnqn}\"\nallow_any_host = true\n");
    for (i, (image, ana_group)) in namespaces.iter().enumerate() {
        toml += &format!(
            r#"
[[subsystem.namespace]]
nsid = {nsid}
backend = "rbd"
pool = "{pool}"
image = "{image}"
ana_group = {ana_group}
"#,
            nsid = i + 1,
            pool = pool(),
        );
    }
    toml
}

/// A `[[subsystem]]` open to any host with namespace 1 on `images[0]` in ANA group 1 and
/// namespace 2 on `images[1]` in ANA group 2 (images in the test pool).
pub fn two_group_subsystem_toml(subnqn: &str, images: &[String; 2]) -> String {
    rbd_subsystem_toml(subnqn, &[(&images[0], 1), (&images[1], 2)])
}

/// gw1's and gw2's controller IDs in the two-gateway group tests: disjoint, as in any group.
pub const GW1_CNTLIDS: std::ops::RangeInclusive<u16> = 1..=2040;
pub const GW2_CNTLIDS: std::ops::RangeInclusive<u16> = 2041..=4080;

/// A gateway process of a two-gateway group (`name` owns ANA group `group`, with controller
/// IDs `cntlids`, the control plane at `cp`) serving `subnqn`'s two images, one per ANA group
/// ([`two_group_subsystem_toml`]).
pub fn spawn_group_gateway(
    dir: &std::path::Path,
    name: &str,
    group: u32,
    cntlids: std::ops::RangeInclusive<u16>,
    cp: &str,
    subnqn: &str,
    images: &[String; 2],
) -> GatewayProcess {
    let port = super::free_port();
    let config = group_member_toml(name, Some(cntlids), cp, group, port)
        + &two_group_subsystem_toml(subnqn, images);
    GatewayProcess::spawn(dir, name, port, &config)
}
