//! `nvmeofctl`: the gateway group's admin CLI (gRPC to any `nvmeof-control` replica).
//!
//! Tables by default, `--output json` for scripts. Exit codes: 0 done, 1 refused by the
//! control plane (the message says why; the state is unchanged), 2 bad usage, 3 no control
//! plane reachable, 4 TLS refused (no certificate, one the control plane's CA did not sign,
//! or a control-plane certificate that --tls-ca does not trust).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use control_plane::proto::{self, admin_client::AdminClient};
use control_plane::tls::{self, TlsFiles};
use tonic::transport::{Channel, ClientTlsConfig};

#[path = "nvmeofctl/listing.rs"]
mod listing;

use listing::{ana_name, done, json, print_list, print_rows, table, to_stdout, GatewayRow, Output};

#[derive(Debug, Parser)]
#[command(version, about = "Manage an NVMe-oF gateway group")]
struct Cli {
    /// Control-plane replicas (comma-separated or repeated); the first that answers is used.
    #[arg(
        long,
        short,
        env = "NVMEOFCTL_SERVER",
        default_value = "127.0.0.1:5500",
        value_delimiter = ','
    )]
    server: Vec<String>,
    /// Output format.
    #[arg(long, short, value_enum, default_value_t = Output::Table)]
    output: Output,
    /// mTLS: the CA that signed the control plane's certificate (PEM). Given: the connection
    /// is TLS (https) and the server is verified against it.
    #[arg(long, env = "NVMEOFCTL_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// mTLS: this client's certificate (PEM), signed by the control plane's client CA.
    #[arg(long, env = "NVMEOFCTL_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// mTLS: the private key of --tls-cert (PEM).
    #[arg(long, env = "NVMEOFCTL_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// mTLS: the name to verify in the control plane's certificate (default: the host part of
    /// --server).
    #[arg(long, env = "NVMEOFCTL_TLS_SERVER_NAME")]
    tls_server_name: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Subsystems (NVM subsystems served by every gateway).
    #[command(subcommand)]
    Subsystem(SubsystemCmd),
    /// Namespaces (RBD images) of subsystems.
    #[command(subcommand)]
    Namespace(NamespaceCmd),
    /// Listeners: the addresses each gateway serves a subsystem on.
    #[command(subcommand)]
    Listener(ListenerCmd),
    /// Hosts allowed to connect to a subsystem.
    #[command(subcommand)]
    Host(HostCmd),
    /// Gateways of the group.
    #[command(subcommand)]
    Gateway(GatewayCmd),
    /// Host connections, as the gateways report them.
    #[command(subcommand)]
    Connection(ConnectionCmd),
    /// ANA groups and states.
    #[command(subcommand)]
    Ana(AnaCmd),
    /// The log level of every gateway and control-plane replica, changed live.
    #[command(subcommand)]
    LogLevel(LogLevelCmd),
}

#[derive(Debug, Subcommand)]
enum LogLevelCmd {
    /// The group's level (none: each process runs at its own, RUST_LOG or info) and the
    /// answering replica's.
    Get,
    /// Sets the level of every gateway and replica, live: trace, debug, info, warn or error.
    Set {
        #[arg(value_parser = ["trace", "debug", "info", "warn", "error"])]
        level: String,
    },
    /// Drops the group's level: each process runs at its own again.
    Reset,
}

#[derive(Debug, Subcommand)]
enum SubsystemCmd {
    Add {
        #[arg(long, short)]
        nqn: String,
        #[arg(long, default_value = "")]
        serial: String,
        #[arg(long)]
        allow_any_host: bool,
        #[arg(long, default_value_t = 0)]
        max_namespaces: u32,
        /// Hosts must connect through a secure listener (TLS 1.3 with their PSK).
        #[arg(long)]
        require_tls: bool,
    },
    /// Changes settings of an existing subsystem, live on every gateway; settings not given
    /// stay.
    Set {
        #[arg(long, short)]
        nqn: String,
        /// Hosts must connect through a secure listener (TLS 1.3 with their PSK): true or
        /// false. Turned on, the gateways close the connections of hosts connected without
        /// TLS (the reply names them); their reconnects are refused until they use TLS.
        #[arg(long, value_name = "true|false")]
        require_tls: Option<bool>,
    },
    Del {
        #[arg(long, short)]
        nqn: String,
        /// Also delete its namespaces, listeners and hosts.
        #[arg(long)]
        force: bool,
    },
    List,
    /// Sets, replaces or removes the subsystem's DH-HMAC-CHAP key: the key the gateways
    /// prove themselves with to hosts that have a key of their own but no controller key
    /// (bidirectional authentication). Refused while a host of the subsystem has no key.
    ChangeKey {
        #[arg(long, short)]
        nqn: String,
        #[command(flatten)]
        key: SubsystemKeyArgs,
        /// Removes the subsystem's key.
        #[arg(long, conflicts_with_all = ["dhchap_key", "dhchap_key_file"])]
        remove: bool,
    },
}

/// A subsystem's DH-HMAC-CHAP key.
#[derive(clap::Args)]
struct SubsystemKeyArgs {
    /// `DHHC-1:XX:<base64>:` as `nvme gen-dhchap-key` prints it. Prefer --dhchap-key-file
    /// (a key on the command line shows in the process list and the shell's history).
    #[arg(long, conflicts_with = "dhchap_key_file")]
    dhchap_key: Option<String>,
    /// Reads --dhchap-key from this file (`-`: standard input).
    #[arg(long)]
    dhchap_key_file: Option<PathBuf>,
}

/// Says whether the key is given, never what it is.
impl std::fmt::Debug for SubsystemKeyArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubsystemKeyArgs")
            .field("dhchap_key", &self.dhchap_key.as_ref().map(|_| "<set>"))
            .field("dhchap_key_file", &self.dhchap_key_file)
            .finish()
    }
}

#[derive(Debug, Subcommand)]
enum NamespaceCmd {
    /// Adds a namespace: an RBD image (made first with --create-image) under an NSID.
    // Without its own doc comment clap would take the flattened QosArgs' as its help.
    Add {
        #[arg(long, short = 'n')]
        subsystem: String,
        #[arg(long, default_value = "rbd")]
        pool: String,
        #[arg(long, default_value = "")]
        rados_namespace: String,
        #[arg(long)]
        image: String,
        /// 0: the lowest free.
        #[arg(long, default_value_t = 0)]
        nsid: u32,
        #[arg(long, default_value_t = 512)]
        block_size: u32,
        /// 0: the group with the fewest namespaces.
        #[arg(long, default_value_t = 0)]
        ana_group: u32,
        /// Visible to no host until `namespace add-host` names one (default: to every host
        /// allowed on the subsystem).
        #[arg(long)]
        no_auto_visible: bool,
        /// Create the RBD image (of --size) first; refused if it exists.
        #[arg(long, requires = "size")]
        create_image: bool,
        /// Size of the image --create-image makes: bytes or with a unit (512MiB, 2GiB).
        #[arg(long, value_parser = parse_size, requires = "create_image")]
        size: Option<u64>,
        /// The namespace's UUID (hosts see it, e.g. /dev/disk/by-id/nvme-uuid.UUID; its NGUID
        /// is made of the same bytes). Default: a random one. Refused when another namespace
        /// of the group has it.
        #[arg(long, default_value = "")]
        uuid: String,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// Adds many namespaces over one connection (a process per namespace costs ~50 ms, most
    /// of it start-up). FILE (`-`: stdin) has one namespace per line: `IMAGE [NSID
    /// [ANA_GROUP]]` (NSID 0 or none: the lowest free; ANA_GROUP none: --ana-group); blank
    /// lines and `#` comments are skipped. The whole file is checked before anything is sent,
    /// then sent as one `NamespaceAddMany` (one state update for up to 1024; one
    /// `NamespaceAdd` per line to a control plane without it). At the first refusal it
    /// stops: the ones before it stay added, and the message names the line.
    AddMany {
        #[arg(long, short = 'n')]
        subsystem: String,
        #[arg(long, default_value = "rbd")]
        pool: String,
        #[arg(long, default_value = "")]
        rados_namespace: String,
        #[arg(long, default_value_t = 512)]
        block_size: u32,
        /// For lines without one. 0: the group with the fewest namespaces.
        #[arg(long, default_value_t = 0)]
        ana_group: u32,
        #[arg(long)]
        file: PathBuf,
        /// Each visible to no host until `namespace add-host` names one.
        #[arg(long)]
        no_auto_visible: bool,
    },
    Del {
        #[arg(long, short = 'n')]
        subsystem: String,
        #[arg(long)]
        nsid: u32,
        /// Also remove the RBD image (refused while hosts are connected to the subsystem).
        #[arg(long)]
        delete_image: bool,
        /// With --delete-image: remove it even while hosts are connected.
        #[arg(long, requires = "delete_image")]
        force: bool,
    },
    /// Sets, changes or clears a namespace's QoS limits, live on every gateway. Limits not
    /// given stay as they are; 0 clears one (no limit). A megabyte is 2^20 bytes.
    SetQos {
        #[arg(long, short = 'n')]
        subsystem: String,
        #[arg(long)]
        nsid: u32,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// Moves a namespace to another ANA group (another gateway's optimized path).
    Move {
        #[arg(long, short = 'n')]
        subsystem: String,
        #[arg(long)]
        nsid: u32,
        #[arg(long)]
        ana_group: u32,
    },
    /// Grows the namespace's RBD image (hosts are told).
    Resize {
        #[arg(long, short = 'n')]
        subsystem: String,
        #[arg(long)]
        nsid: u32,
        /// New size: bytes or with a unit (512MiB, 2GiB, 1TiB).
        #[arg(long, value_parser = parse_size)]
        size: u64,
    },
    List {
        #[arg(long, short = 'n', default_value = "")]
        subsystem: String,
    },
    /// Makes a namespace added with --no-auto-visible visible to one more host (at most 1024
    /// per namespace). The host need not be allowed on the subsystem yet; it sees the
    /// namespace once it is. Connected controllers of that host see it at once (Namespace
    /// Attribute Changed), without reconnecting.
    AddHost {
        #[arg(long, short = 'n')]
        subsystem: String,
        #[arg(long)]
        nsid: u32,
        #[arg(long)]
        host: String,
    },
    /// Hides a namespace added with --no-auto-visible from a host on its list again; that
    /// host's connected controllers lose it at once (Namespace Attribute Changed).
    DelHost {
        #[arg(long, short = 'n')]
        subsystem: String,
        #[arg(long)]
        nsid: u32,
        #[arg(long)]
        host: String,
    },
    /// Changes settings of a namespace, live; settings not given stay.
    Set {
        #[arg(long, short = 'n')]
        subsystem: String,
        #[arg(long)]
        nsid: u32,
        /// true: every allowed host sees it; false: only the hosts add-host names (none at
        /// first). Connected hosts see the change without reconnecting.
        #[arg(long, value_name = "true|false")]
        auto_visible: Option<bool>,
        /// true: `namespace del` moves the image to the RBD trash (and then needs
        /// --delete-image); false: the image stays unless --delete-image removes it.
        #[arg(long, value_name = "true|false")]
        trash_image: Option<bool>,
        /// false: the namespace keeps the size it has now when its image grows (`rbd
        /// resize`), on every gateway; `namespace resize` still changes it. true: it follows
        /// its image again (hosts see the image's size).
        #[arg(long, value_name = "true|false")]
        auto_resize: Option<bool>,
        /// With --auto-visible true: drop the namespace's host list.
        #[arg(long)]
        force: bool,
    },
    /// A namespace's I/O counters, per gateway that served it and in total.
    ///
    /// As the gateways' beacons reported them to the answering replica (what ceph-nvmeof's
    /// namespace_get_io_stats answers): totals since each gateway first served the namespace,
    /// its restarts included, so they never go down while this replica runs. Latencies in
    /// milliseconds; REPORTED: when that gateway last sent them.
    Stats {
        /// The subsystem's NQN.
        #[arg(long, short = 'n')]
        subsystem: String,
        /// The namespace's NSID.
        #[arg(long)]
        nsid: u32,
    },
}

/// QoS limits (ceph-nvmeof's names); absent: unchanged (set-qos) or none (add).
#[derive(Debug, clap::Args)]
struct QosArgs {
    /// Read and write commands per second (0: no limit; else 10..=100000000).
    #[arg(long)]
    rw_ios_per_second: Option<u64>,
    /// Read plus write bandwidth, MB/s (0: no limit).
    #[arg(long)]
    rw_megabytes_per_second: Option<u64>,
    /// Read bandwidth, MB/s (0: no limit).
    #[arg(long)]
    r_megabytes_per_second: Option<u64>,
    /// Write bandwidth, MB/s (0: no limit).
    #[arg(long)]
    w_megabytes_per_second: Option<u64>,
}

impl QosArgs {
    fn proto(&self) -> proto::QosLimits {
        proto::QosLimits {
            rw_ios_per_second: self.rw_ios_per_second,
            rw_megabytes_per_second: self.rw_megabytes_per_second,
            r_megabytes_per_second: self.r_megabytes_per_second,
            w_megabytes_per_second: self.w_megabytes_per_second,
        }
    }

    fn any(&self) -> bool {
        self.rw_ios_per_second.is_some()
            || self.rw_megabytes_per_second.is_some()
            || self.r_megabytes_per_second.is_some()
            || self.w_megabytes_per_second.is_some()
    }
}

/// "4096", "512MiB", "2GiB", "1TiB" (also K/M/G/T and KB/MB/GB/TB as powers of two).
fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 2GiB)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("{text:?}: unknown unit (use KiB, MiB, GiB or TiB)")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

#[derive(Debug, Subcommand)]
enum ListenerCmd {
    Add(ListenerArgs),
    Del(ListenerArgs),
    List {
        #[arg(long, short = 'n', default_value = "")]
        subsystem: String,
    },
}

#[derive(Debug, clap::Args)]
struct ListenerArgs {
    #[arg(long, short = 'n')]
    subsystem: String,
    #[arg(long, short)]
    gateway: String,
    #[arg(long, short)]
    address: String,
    #[arg(long, short, default_value_t = 4420)]
    port: u32,
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// A secure listener (NVMe/TCP only): TLS 1.3 with the hosts' PSKs before anything else.
    /// Every subsystem's listener on one gateway address and port must agree. Ignored by
    /// `listener del`.
    #[arg(long)]
    secure: bool,
}

#[derive(Debug, Subcommand)]
enum HostCmd {
    /// Allows a host; with --dhchap-key it must authenticate (DH-HMAC-CHAP) every queue; with
    /// --psk it can connect through secure listeners (TLS).
    Add {
        #[arg(long, short = 'n')]
        subsystem: String,
        #[arg(long)]
        host: String,
        #[command(flatten)]
        keys: KeyArgs,
    },
    /// Sets, replaces or clears a host's DH-HMAC-CHAP keys and TLS PSK; the host stays allowed
    /// and its connections stay (the keys apply from its next authentication or TLS
    /// handshake). A key not given is cleared: with none, the host connects without
    /// authenticating (and no longer through a secure listener).
    ChangeKey {
        #[arg(long, short = 'n')]
        subsystem: String,
        #[arg(long)]
        host: String,
        #[command(flatten)]
        keys: KeyArgs,
    },
    Del {
        #[arg(long, short = 'n')]
        subsystem: String,
        #[arg(long)]
        host: String,
    },
    List {
        #[arg(long, short = 'n', default_value = "")]
        subsystem: String,
    },
}

/// A host's DH-HMAC-CHAP keys, `DHHC-1:XX:<base64>:` as `nvme gen-dhchap-key` prints them,
/// and its TLS PSK.
#[derive(clap::Args)]
struct KeyArgs {
    /// The host's secret (`nvme connect --dhchap-secret`): given, the host must authenticate.
    /// A key on the command line shows in the process list and the shell's history: prefer
    /// --dhchap-key-file.
    #[arg(long, conflicts_with = "dhchap_key_file")]
    dhchap_key: Option<String>,
    /// Reads --dhchap-key from this file (`-`: standard input).
    #[arg(long)]
    dhchap_key_file: Option<PathBuf>,
    /// The gateway's secret, proving it to a host that asks (`nvme connect
    /// --dhchap-ctrl-secret`; bidirectional). Needs a host key.
    #[arg(long, conflicts_with = "dhchap_ctrl_key_file")]
    dhchap_ctrl_key: Option<String>,
    /// Reads --dhchap-ctrl-key from this file (`-`: standard input).
    #[arg(long)]
    dhchap_ctrl_key_file: Option<PathBuf>,
    /// The host's TLS pre-shared key for secure listeners, `NVMeTLSkey-1:HH:<base64>:` as
    /// `nvme gen-tls-key` prints it. Prefer --psk-file.
    #[arg(long, conflicts_with = "psk_file")]
    psk: Option<String>,
    /// Reads --psk from this file (`-`: standard input).
    #[arg(long)]
    psk_file: Option<PathBuf>,
    /// How the host's nvme-cli derives its TLS key from the PSK: rfc8446 (default; libnvme
    /// since August 2025) or libnvme-compat (older libnvme, e.g. Debian trixie's).
    #[arg(long)]
    psk_derivation: Option<String>,
}

/// Says which keys are given, never what they are.
impl std::fmt::Debug for KeyArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |k: &Option<String>| if k.is_some() { "<set>" } else { "<none>" };
        f.debug_struct("KeyArgs")
            .field("dhchap_key", &set(&self.dhchap_key))
            .field("dhchap_key_file", &self.dhchap_key_file)
            .field("dhchap_ctrl_key", &set(&self.dhchap_ctrl_key))
            .field("dhchap_ctrl_key_file", &self.dhchap_ctrl_key_file)
            .field("psk", &set(&self.psk))
            .field("psk_file", &self.psk_file)
            .field("psk_derivation", &self.psk_derivation)
            .finish()
    }
}

/// The keys as sent (empty: none).
#[derive(Default)]
struct Keys {
    host: String,
    ctrl: String,
    psk: String,
    psk_derivation: String,
}

impl KeyArgs {
    /// The keys given, each from its option or its file (trimmed). An empty one is bad usage
    /// (an unset shell variable must not add a host without authentication); so is reading
    /// both from standard input. Messages never contain a key.
    fn read(&self) -> Result<Keys, String> {
        let stdin = std::path::Path::new("-");
        let from_stdin = [
            &self.dhchap_key_file,
            &self.dhchap_ctrl_key_file,
            &self.psk_file,
        ]
        .iter()
        .filter(|f| f.as_deref() == Some(stdin))
        .count();
        if from_stdin > 1 {
            return Err(
                "--dhchap-key-file, --dhchap-ctrl-key-file and --psk-file: only one can be standard input".into(),
            );
        }
        let one = |option: &str, text: &Option<String>, file: &Option<PathBuf>| {
            let key = match (text, file) {
                (Some(t), _) => t.trim().to_string(),
                (None, Some(path)) => read_key_file(option, path)?,
                (None, None) => return Ok(String::new()),
            };
            if key.is_empty() {
                return Err(format!(
                    "--{option}: empty (leave the option out to give no key)"
                ));
            }
            Ok(key)
        };
        Ok(Keys {
            host: one("dhchap-key", &self.dhchap_key, &self.dhchap_key_file)?,
            ctrl: one(
                "dhchap-ctrl-key",
                &self.dhchap_ctrl_key,
                &self.dhchap_ctrl_key_file,
            )?,
            psk: one("psk", &self.psk, &self.psk_file)?,
            psk_derivation: self.psk_derivation.clone().unwrap_or_default(),
        })
    }
}

/// `subsystem change-key`'s key, from its option or its file (trimmed; empty: none given).
/// An empty key given is bad usage (an unset shell variable must not remove the key:
/// --remove does). Messages never contain the key.
fn subsystem_key(text: &Option<String>, file: &Option<PathBuf>) -> Result<String, String> {
    let key = match (text, file) {
        (Some(t), _) => t.trim().to_string(),
        (None, Some(path)) => read_key_file("dhchap-key", path)?,
        (None, None) => return Ok(String::new()),
    };
    if key.is_empty() {
        return Err("--dhchap-key: empty (use --remove to remove the key)".into());
    }
    Ok(key)
}

/// A key file's text, trimmed (`-`: standard input). Errors name the file, not its content.
fn read_key_file(option: &str, path: &std::path::Path) -> Result<String, String> {
    let text = if path.as_os_str() == "-" {
        let mut t = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut t)
            .map_err(|e| format!("--{option}-file: cannot read standard input: {e}"))?;
        t
    } else {
        std::fs::read_to_string(path)
            .map_err(|e| format!("--{option}-file: cannot read {}: {e}", path.display()))?
    };
    Ok(text.trim().to_string())
}

#[derive(Debug, Subcommand)]
enum GatewayCmd {
    List,
    /// One gateway: state, addresses and the ANA state it reports for every group.
    Info {
        #[arg(long)]
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum ConnectionCmd {
    List {
        #[arg(long, short = 'n', default_value = "")]
        subsystem: String,
    },
}

#[derive(Debug, Subcommand)]
enum AnaCmd {
    Show,
}

enum Failure {
    Refused(tonic::Status),
    Unreachable(String),
    Usage(String),
    Tls(String),
}

/// The exit code for a TLS refusal (see the module docs).
const EXIT_TLS: u8 = 4;

fn main() -> ExitCode {
    // SIGPIPE stays ignored until the output is written (`listing::to_stdout`).
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("nvmeofctl: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Refused(s)) => {
            eprintln!("nvmeofctl: {} ({:?})", s.message(), s.code());
            ExitCode::from(1)
        }
        Err(Failure::Usage(m)) => {
            eprintln!("nvmeofctl: {m}");
            ExitCode::from(2)
        }
        Err(Failure::Tls(m)) => {
            eprintln!("nvmeofctl: {m}");
            ExitCode::from(EXIT_TLS)
        }
        Err(Failure::Unreachable(m)) => {
            eprintln!("nvmeofctl: {m}");
            ExitCode::from(3)
        }
    }
}

/// A failed request: refused by the control plane (a status it sent), or the connection
/// failed under it (a status made here from a transport error, which has a source). With TLS
/// the latter is how a refused client certificate shows: in TLS 1.3 the client's side of the
/// handshake is complete before the server checks the client's certificate, so the server's
/// refusal arrives with (or, racing the first request, as a broken pipe instead of) the alert.
fn classify(status: tonic::Status, tls_on: bool) -> Failure {
    use std::error::Error as _;
    if let Some(cause) = tls::tls_failure(&status) {
        return Failure::Tls(tls_refused(&cause));
    }
    let Some(source) = status.source() else {
        return Failure::Refused(status);
    };
    let cause = tls::chain(source);
    if tls_on {
        Failure::Tls(tls_refused(&format!(
            "the control plane closed the connection after the TLS handshake ({cause})"
        )))
    } else {
        Failure::Unreachable(format!(
            "the connection to the control plane failed ({cause}); if it serves mTLS, give \
             --tls-ca, --tls-cert and --tls-key"
        ))
    }
}

fn tls_refused(cause: &str) -> String {
    if cause.contains("invalid peer certificate") {
        return format!(
            "TLS refused: {cause} (the control plane's certificate is not signed by the CA in \
             --tls-ca, or does not name the address in --server: see --tls-server-name)"
        );
    }
    format!(
        "TLS refused: {cause} (the control plane accepts only a client certificate signed by \
         its CA: check --tls-cert/--tls-key, and that --tls-ca signed its certificate)"
    )
}

async fn connect(
    servers: &[String],
    tls_config: Option<&ClientTlsConfig>,
) -> Result<AdminClient<Channel>, Failure> {
    let mut errors = Vec::new();
    let mut tls_errors = Vec::new();
    for s in servers {
        let endpoint = match tls::client_endpoint(s, tls_config) {
            Ok(e) => e
                .connect_timeout(Duration::from_secs(3))
                .timeout(Duration::from_secs(30)),
            Err(e) => return Err(Failure::Usage(e.to_string())),
        };
        match endpoint.connect().await {
            Ok(ch) => return Ok(AdminClient::new(ch)),
            Err(e) => match tls::tls_failure(&e) {
                Some(cause) => tls_errors.push(format!("{s}: {cause}")),
                None => errors.push(format!("{s}: {}", tls::chain(&e))),
            },
        }
    }
    if !tls_errors.is_empty() {
        return Err(Failure::Tls(tls_refused(&tls_errors.join("; "))));
    }
    Err(Failure::Unreachable(format!(
        "no control plane reachable ({})",
        errors.join("; ")
    )))
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let files = TlsFiles {
        ca: cli.tls_ca.clone(),
        cert: cli.tls_cert.clone(),
        key: cli.tls_key.clone(),
    };
    let tls_config = tls::client_tls_config(&files, cli.tls_server_name.as_deref())
        .map_err(|e| Failure::Usage(e.to_string()))?;
    // A file of namespaces is checked whole before anything is sent.
    let lines = match &cli.cmd {
        Cmd::Namespace(NamespaceCmd::AddMany { file, .. }) => {
            read_namespace_lines(file).map_err(Failure::Usage)?
        }
        _ => Vec::new(),
    };
    // So are the key files.
    let keys = match &cli.cmd {
        Cmd::Host(HostCmd::Add { keys, .. } | HostCmd::ChangeKey { keys, .. }) => {
            keys.read().map_err(Failure::Usage)?
        }
        _ => Keys::default(),
    };
    let subsystem_key = match &cli.cmd {
        Cmd::Subsystem(SubsystemCmd::ChangeKey { key, .. }) => {
            subsystem_key(&key.dhchap_key, &key.dhchap_key_file).map_err(Failure::Usage)?
        }
        _ => String::new(),
    };
    let mut c = connect(&cli.server, tls_config.as_ref()).await?;
    let out = cli.output;
    let tls_on = tls_config.is_some();
    let refused = move |status| classify(status, tls_on);
    match cli.cmd {
        Cmd::Subsystem(SubsystemCmd::Add {
            nqn,
            serial,
            allow_any_host,
            max_namespaces,
            require_tls,
        }) => {
            let request = proto::SubsystemAddRequest {
                nqn,
                serial,
                allow_any_host,
                max_namespaces,
                require_tls,
            };
            done(out, answer(c.subsystem_add(request), tls_on).await?)
        }
        Cmd::Subsystem(SubsystemCmd::Set { nqn, require_tls }) => {
            if require_tls.is_none() {
                return Err(Failure::Usage(
                    "subsystem set: give a setting to change (--require-tls true|false)".into(),
                ));
            }
            let request = proto::SubsystemSetRequest { nqn, require_tls };
            done(out, answer(c.subsystem_set(request), tls_on).await?)
        }
        Cmd::Subsystem(SubsystemCmd::Del { nqn, force }) => {
            let request = proto::SubsystemDelRequest { nqn, force };
            done(out, answer(c.subsystem_del(request), tls_on).await?)
        }
        Cmd::Subsystem(SubsystemCmd::List) => {
            let r = answer(c.subsystem_list(proto::Empty {}), tls_on).await?;
            print_list(out, &r, &r.subsystems);
        }
        Cmd::Subsystem(SubsystemCmd::ChangeKey { nqn, remove, .. }) => {
            if !remove && subsystem_key.is_empty() {
                return Err(Failure::Usage(
                    "subsystem change-key: give --dhchap-key or --dhchap-key-file, or --remove"
                        .into(),
                ));
            }
            let request = proto::SubsystemKeyRequest {
                nqn,
                dhchap_key: subsystem_key,
            };
            done(out, answer(c.subsystem_change_key(request), tls_on).await?)
        }
        Cmd::Namespace(NamespaceCmd::Set {
            subsystem,
            nsid,
            auto_visible,
            trash_image,
            auto_resize,
            force,
        }) => {
            if auto_visible.is_none() && trash_image.is_none() && auto_resize.is_none() {
                return Err(Failure::Usage(
                    "namespace set: give a setting to change (--auto-visible, --trash-image, \
                     --auto-resize)"
                        .into(),
                ));
            }
            let request = proto::NamespaceSetRequest {
                subsystem_nqn: subsystem,
                nsid,
                auto_visible,
                trash_image,
                auto_resize,
                force,
            };
            done(out, answer(c.namespace_set(request), tls_on).await?)
        }
        Cmd::LogLevel(LogLevelCmd::Get) => {
            let r = answer(c.log_level_get(proto::Empty {}), tls_on).await?;
            match out {
                Output::Json => json(&r),
                Output::Table => {
                    println!(
                        "group: {}",
                        if r.group.is_empty() {
                            "none (each process its own: RUST_LOG, else info)"
                        } else {
                            &r.group
                        }
                    );
                    println!("this replica: {}", r.replica);
                }
            }
        }
        Cmd::LogLevel(cmd @ (LogLevelCmd::Set { .. } | LogLevelCmd::Reset)) => {
            let level = match cmd {
                LogLevelCmd::Set { level } => level,
                _ => String::new(),
            };
            let request = proto::LogLevelRequest { level };
            done(out, answer(c.log_level_set(request), tls_on).await?)
        }
        Cmd::Namespace(NamespaceCmd::Add {
            subsystem,
            pool,
            rados_namespace,
            image,
            nsid,
            block_size,
            ana_group,
            no_auto_visible,
            create_image,
            size,
            uuid,
            qos,
        }) => {
            let request = proto::NamespaceAddRequest {
                subsystem_nqn: subsystem,
                nsid,
                pool,
                rados_namespace,
                image,
                block_size,
                ana_group,
                no_auto_visible,
                create_image,
                size_bytes: size.unwrap_or(0),
                qos: qos.any().then(|| qos.proto()),
                uuid,
            };
            done(out, answer(c.namespace_add(request), tls_on).await?)
        }
        Cmd::Namespace(NamespaceCmd::AddMany {
            subsystem,
            pool,
            rados_namespace,
            block_size,
            ana_group,
            file,
            no_auto_visible,
        }) => {
            let started = std::time::Instant::now();
            let request = |line: &NamespaceLine| proto::NamespaceAddRequest {
                subsystem_nqn: subsystem.clone(),
                nsid: line.nsid,
                pool: pool.clone(),
                rados_namespace: rados_namespace.clone(),
                image: line.image.clone(),
                block_size,
                ana_group: line.ana_group.unwrap_or(ana_group),
                no_auto_visible,
                ..Default::default()
            };
            let refused_line = |line: &NamespaceLine, before: usize, s: tonic::Status| {
                Failure::Refused(tonic::Status::new(
                    s.code(),
                    format!(
                        "{}:{} ({}): {}; the {before} namespaces before it were added",
                        file.display(),
                        line.number,
                        line.image,
                        s.message()
                    ),
                ))
            };
            // One NamespaceAddMany per chunk: one state update each. A control plane
            // without it (older) gets one NamespaceAdd per line.
            let mut added: Vec<proto::Namespace> = Vec::with_capacity(lines.len());
            let mut version = 0;
            let mut batched = true;
            for chunk in lines.chunks(ADD_MANY_CHUNK) {
                if !batched {
                    break;
                }
                let reply = match c
                    .namespace_add_many(proto::NamespaceAddManyRequest {
                        namespaces: chunk.iter().map(request).collect(),
                    })
                    .await
                {
                    Ok(r) => r.into_inner(),
                    Err(s) if s.code() == tonic::Code::Unimplemented && added.is_empty() => {
                        batched = false;
                        continue;
                    }
                    Err(s) => {
                        return Err(match refused(s) {
                            Failure::Refused(s) => refused_line(&chunk[0], added.len(), s),
                            other => other,
                        })
                    }
                };
                version = reply.version;
                added.extend(reply.added);
                if let Some(r) = reply.refused {
                    let i = usize::try_from(r.index).unwrap_or(usize::MAX);
                    let line = chunk.get(i).unwrap_or(&chunk[chunk.len() - 1]);
                    let status = tonic::Status::new(tonic::Code::from(r.code), r.message);
                    return Err(refused_line(line, added.len(), status));
                }
            }
            if !batched {
                for (i, line) in lines.iter().enumerate() {
                    let reply = c
                        .namespace_add(request(line))
                        .await
                        .map_err(|status| match refused(status) {
                            Failure::Refused(s) => refused_line(line, i, s),
                            other => other,
                        })?
                        .into_inner();
                    version = reply.version;
                }
            }
            match out {
                Output::Json => json(&proto::NamespaceAddManyReply {
                    version,
                    added,
                    refused: None,
                }),
                Output::Table => {
                    to_stdout();
                    println!(
                        "{} namespaces added to {subsystem} in {:.2} s (state version {version})",
                        lines.len(),
                        started.elapsed().as_secs_f64(),
                    );
                }
            }
        }
        Cmd::Namespace(NamespaceCmd::Del {
            subsystem,
            nsid,
            delete_image,
            force,
        }) => {
            let request = proto::NamespaceDelRequest {
                subsystem_nqn: subsystem,
                nsid,
                delete_image,
                force,
            };
            done(out, answer(c.namespace_del(request), tls_on).await?)
        }
        Cmd::Namespace(NamespaceCmd::SetQos {
            subsystem,
            nsid,
            qos,
        }) => {
            if !qos.any() {
                return Err(Failure::Usage(
                    "namespace set-qos: give at least one limit (--rw-ios-per-second, \
                     --rw-megabytes-per-second, --r-megabytes-per-second, \
                     --w-megabytes-per-second; 0 clears one)"
                        .into(),
                ));
            }
            let request = proto::NamespaceSetQosRequest {
                subsystem_nqn: subsystem,
                nsid,
                limits: Some(qos.proto()),
            };
            done(out, answer(c.namespace_set_qos(request), tls_on).await?)
        }
        Cmd::Namespace(NamespaceCmd::Move {
            subsystem,
            nsid,
            ana_group,
        }) => {
            let request = proto::NamespaceMoveRequest {
                subsystem_nqn: subsystem,
                nsid,
                ana_group,
            };
            done(out, answer(c.namespace_move(request), tls_on).await?)
        }
        Cmd::Namespace(NamespaceCmd::Resize {
            subsystem,
            nsid,
            size,
        }) => {
            let request = proto::NamespaceResizeRequest {
                subsystem_nqn: subsystem,
                nsid,
                size_bytes: size,
            };
            done(out, answer(c.namespace_resize(request), tls_on).await?)
        }
        Cmd::Namespace(NamespaceCmd::List { subsystem }) => {
            let request = proto::NamespaceListRequest {
                subsystem_nqn: subsystem,
            };
            let r = answer(c.namespace_list(request), tls_on).await?;
            print_list(out, &r, &r.namespaces);
        }
        Cmd::Namespace(NamespaceCmd::AddHost {
            subsystem,
            nsid,
            host,
        }) => {
            let request = proto::NamespaceHostRequest {
                subsystem_nqn: subsystem,
                nsid,
                host_nqn: host,
            };
            done(out, answer(c.namespace_add_host(request), tls_on).await?)
        }
        Cmd::Namespace(NamespaceCmd::DelHost {
            subsystem,
            nsid,
            host,
        }) => {
            let request = proto::NamespaceHostRequest {
                subsystem_nqn: subsystem,
                nsid,
                host_nqn: host,
            };
            done(out, answer(c.namespace_del_host(request), tls_on).await?)
        }
        Cmd::Namespace(NamespaceCmd::Stats { subsystem, nsid }) => {
            let request = proto::NamespaceIoStatsRequest {
                subsystem_nqn: subsystem,
                nsid,
            };
            let r = answer(c.namespace_io_stats(request), tls_on).await?;
            listing::print_io_stats(out, &r);
        }
        Cmd::Listener(ListenerCmd::Add(a)) => {
            done(out, answer(c.listener_add(listener(a)), tls_on).await?)
        }
        Cmd::Listener(ListenerCmd::Del(a)) => {
            done(out, answer(c.listener_del(listener(a)), tls_on).await?)
        }
        Cmd::Listener(ListenerCmd::List { subsystem }) => {
            let request = proto::ListenerListRequest {
                subsystem_nqn: subsystem,
            };
            let r = answer(c.listener_list(request), tls_on).await?;
            print_list(out, &r, &r.listeners);
        }
        Cmd::Host(HostCmd::Add {
            subsystem, host, ..
        }) => {
            let keyed = !keys.host.is_empty() || !keys.ctrl.is_empty();
            let with_psk = !keys.psk.is_empty();
            let request = keyed_host(subsystem.clone(), host.clone(), keys);
            let reply = answer(c.host_add(request), tls_on).await?;
            if keyed || with_psk {
                check_keys_taken(&mut c, &subsystem, &host, keyed, with_psk, tls_on).await?;
            }
            done(out, reply)
        }
        Cmd::Host(HostCmd::ChangeKey {
            subsystem, host, ..
        }) => {
            let request = keyed_host(subsystem, host, keys);
            match c.host_change_key(request).await {
                Err(s) if s.code() == tonic::Code::Unimplemented => {
                    return Err(Failure::Refused(tonic::Status::unimplemented(
                        "this control plane does not know DH-HMAC-CHAP keys (upgrade it)",
                    )))
                }
                r => done(
                    out,
                    r.map(tonic::Response::into_inner)
                        .map_err(|s| classify(s, tls_on))?,
                ),
            }
        }
        Cmd::Host(HostCmd::Del { subsystem, host }) => done(
            out,
            answer(c.host_del(host_of(subsystem, host)), tls_on).await?,
        ),
        Cmd::Host(HostCmd::List { subsystem }) => {
            let request = proto::HostListRequest {
                subsystem_nqn: subsystem,
            };
            let r = answer(c.host_list(request), tls_on).await?;
            print_list(out, &r, &r.hosts);
        }
        Cmd::Gateway(GatewayCmd::List) => {
            let r = answer(c.gateway_list(proto::Empty {}), tls_on).await?;
            let from_leader = !r.leader.is_empty();
            let rows: Vec<GatewayRow> = r
                .gateways
                .iter()
                .map(|gateway| GatewayRow {
                    gateway,
                    from_leader,
                })
                .collect();
            print_list(out, &r, &rows);
            if out == Output::Table && !from_leader {
                println!("(answered by a replica that does not lead: no beacon times)");
            }
        }
        Cmd::Gateway(GatewayCmd::Info { name }) => {
            let gws = answer(c.gateway_list(proto::Empty {}), tls_on).await?;
            let Some(g) = gws.gateways.into_iter().find(|g| g.name == name) else {
                return Err(Failure::Refused(tonic::Status::not_found(format!(
                    "gateway {name} not found"
                ))));
            };
            let ana = answer(c.ana_show(proto::Empty {}), tls_on).await?;
            let states: Vec<&proto::GatewayAnaState> =
                ana.states.iter().filter(|s| s.gateway == name).collect();
            match out {
                Output::Json => json(&serde_json::json!({ "gateway": g, "ana_states": states })),
                Output::Table => {
                    to_stdout();
                    println!("gateway      {}", g.name);
                    println!("ANA group    {}", g.ana_group);
                    println!("state        {}", g.availability);
                    println!("controllers  {}-{}", g.cntlid_min, g.cntlid_max);
                    if !gws.leader.is_empty() {
                        println!("ceph         {}", g.cluster);
                        println!("last beacon  {} ms ago", g.last_beacon_ms_ago);
                    }
                    println!("clients      {}", g.client_addrs.join(" "));
                    println!();
                    table(
                        &["ANA GROUP", "STATE"],
                        states
                            .iter()
                            .map(|s| vec![s.ana_group.to_string(), ana_name(s.state)])
                            .collect(),
                    );
                }
            }
        }
        Cmd::Connection(ConnectionCmd::List { subsystem }) => {
            let request = proto::ConnectionListRequest {
                subsystem_nqn: subsystem,
            };
            let r = answer(c.connection_list(request), tls_on).await?;
            print_list(out, &r, &r.connections);
        }
        Cmd::Ana(AnaCmd::Show) => {
            let r = answer(c.ana_show(proto::Empty {}), tls_on).await?;
            match out {
                Output::Json => json(&r),
                Output::Table => {
                    print_rows(&r.groups);
                    println!();
                    print_rows(&r.states);
                }
            }
        }
    }
    Ok(())
}

/// The reply to `request`, or why there is none (see [`classify`]).
async fn answer<T>(
    request: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    tls_on: bool,
) -> Result<T, Failure> {
    request
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| classify(status, tls_on))
}

/// Namespaces per `NamespaceAddMany` request (the server's limit).
const ADD_MANY_CHUNK: usize = 1024;

/// One line of `namespace add-many`'s file.
#[derive(Debug, PartialEq, Eq)]
struct NamespaceLine {
    /// 1-based, for messages.
    number: usize,
    image: String,
    nsid: u32,
    ana_group: Option<u32>,
}

fn read_namespace_lines(file: &std::path::Path) -> Result<Vec<NamespaceLine>, String> {
    let text = if file.as_os_str() == "-" {
        let mut t = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut t)
            .map_err(|e| format!("cannot read stdin: {e}"))?;
        t
    } else {
        std::fs::read_to_string(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?
    };
    parse_namespace_lines(&text).map_err(|e| format!("{}:{e}", file.display()))
}

/// `IMAGE [NSID [ANA_GROUP]]` per line; errors are `LINE: why`.
fn parse_namespace_lines(text: &str) -> Result<Vec<NamespaceLine>, String> {
    let mut lines = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let number = i + 1;
        let content = raw.split('#').next().unwrap_or("").trim();
        if content.is_empty() {
            continue;
        }
        let fields: Vec<&str> = content.split_whitespace().collect();
        let number_field = |k: usize, what: &str| -> Result<Option<u32>, String> {
            fields
                .get(k)
                .map(|f| {
                    f.parse::<u32>()
                        .map_err(|_| format!("{number}: {what} {f:?} is not a number"))
                })
                .transpose()
        };
        if fields.len() > 3 {
            return Err(format!(
                "{number}: expected IMAGE [NSID [ANA_GROUP]], found {} fields",
                fields.len()
            ));
        }
        lines.push(NamespaceLine {
            number,
            image: fields[0].to_string(),
            nsid: number_field(1, "NSID")?.unwrap_or(0),
            ana_group: number_field(2, "ANA group")?,
        });
    }
    if lines.is_empty() {
        return Err(" no namespace in the file".into());
    }
    Ok(lines)
}

fn host_of(subsystem: String, host: String) -> proto::Host {
    keyed_host(subsystem, host, Keys::default())
}

fn keyed_host(subsystem: String, host: String, keys: Keys) -> proto::Host {
    proto::Host {
        subsystem_nqn: subsystem,
        host_nqn: host,
        dhchap_key: keys.host,
        dhchap_ctrl_key: keys.ctrl,
        auth: String::new(),
        // A derivation without a key is sent too: the control plane refuses it.
        psk: (!keys.psk.is_empty() || !keys.psk_derivation.is_empty()).then_some(proto::TlsPsk {
            key: keys.psk,
            derivation: keys.psk_derivation,
        }),
    }
}

/// After adding a host with keys: a control plane that predates keys (DH-HMAC-CHAP keys, or
/// TLS PSKs) ignores them and adds the host without; said here (exit 1) rather than left
/// unnoticed.
async fn check_keys_taken(
    c: &mut AdminClient<Channel>,
    subsystem: &str,
    host: &str,
    dhchap: bool,
    psk: bool,
    tls_on: bool,
) -> Result<(), Failure> {
    let request = proto::HostListRequest {
        subsystem_nqn: subsystem.to_string(),
    };
    let hosts = answer(c.host_list(request), tls_on).await?.hosts;
    let listed = hosts.iter().find(|h| h.host_nqn == host);
    let dhchap_taken = listed.is_some_and(|h| matches!(h.auth.as_str(), "host" | "bidirectional"));
    let missing = if dhchap && !dhchap_taken {
        "DH-HMAC-CHAP keys"
    } else if psk && listed.is_none_or(|h| h.psk.is_none()) {
        "TLS PSKs"
    } else {
        return Ok(());
    };
    Err(Failure::Refused(tonic::Status::failed_precondition(
        format!(
            "host {host} was added to {subsystem} WITHOUT its keys: this control plane does not \
             know {missing} (upgrade it); remove the host with `host del` until then"
        ),
    )))
}

fn listener(a: ListenerArgs) -> proto::Listener {
    proto::Listener {
        subsystem_nqn: a.subsystem,
        gateway: a.gateway,
        transport: a.transport,
        address: a.address,
        port: a.port,
        secure: a.secure,
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_namespace_lines, parse_size, NamespaceLine};

    #[test]
    fn namespace_lines() {
        let text = "# images\nimg-a\n\nimg-b 7   # fixed NSID\n  img-c 0 2\n";
        let line = |number, image: &str, nsid, ana_group| NamespaceLine {
            number,
            image: image.into(),
            nsid,
            ana_group,
        };
        assert_eq!(
            parse_namespace_lines(text),
            Ok(vec![
                line(2, "img-a", 0, None),
                line(4, "img-b", 7, None),
                line(5, "img-c", 0, Some(2)),
            ])
        );
        assert_eq!(
            parse_namespace_lines("a\nb x\n"),
            Err("2: NSID \"x\" is not a number".into())
        );
        assert!(parse_namespace_lines("a 1 2 3").is_err());
        assert!(parse_namespace_lines("a 1 -2").is_err());
        assert!(parse_namespace_lines("# nothing\n\n").is_err());
    }

    #[test]
    fn sizes_with_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("1 TiB"), Ok(1 << 40));
        assert!(parse_size("2GB?").is_err());
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999TiB").is_err());
    }
}
