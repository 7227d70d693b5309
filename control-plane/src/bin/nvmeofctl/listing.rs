//! How `nvmeofctl` prints what the control plane answers: the whole reply as JSON, or a table
//! of its rows (each row type knows its headers and cells).

use control_plane::ana::AnaState;
use control_plane::proto;

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

/// Called before anything is written to standard output: SIGPIPE back to its default action,
/// so `nvmeofctl ... | head` ends as Unix tools do (killed by SIGPIPE, nothing on standard
/// error) instead of panicking in `println!`. Not at start: until the reply is in, SIGPIPE
/// stays ignored (Rust's default), because a control plane that refuses the TLS client
/// (no or a wrong certificate) closes the connection while the client still writes to it,
/// and that write must fail with EPIPE (exit 4, the refusal said), not kill nvmeofctl.
pub fn to_stdout() {
    sigpipe::reset();
}

/// A row of a `list` table: its columns' headers and its cells.
pub trait Listing {
    const HEADERS: &'static [&'static str];
    fn row(&self) -> Vec<String>;
}

/// A `list` reply: as JSON, the whole `reply`; as a table, `rows` under their headers.
pub fn print_list<T: Listing>(output: Output, reply: &impl serde::Serialize, rows: &[T]) {
    match output {
        Output::Json => json(reply),
        Output::Table => print_rows(rows),
    }
}

/// `rows` under their headers.
pub fn print_rows<T: Listing>(rows: &[T]) {
    table(T::HEADERS, rows.iter().map(T::row).collect());
}

/// The reply to a change: its message and the state version it made, or the reply as JSON.
/// Lines of the message that start with "warning: " (a name outside the NVMe formats) go
/// to stderr.
pub fn done(output: Output, r: proto::Reply) {
    match output {
        Output::Json => json(&r),
        Output::Table => {
            to_stdout();
            let mut lines = r.message.lines();
            let first = lines.next().unwrap_or("");
            println!("{first} (state version {})", r.version);
            for line in lines {
                match line.strip_prefix("warning: ") {
                    Some(warning) => eprintln!("nvmeofctl: warning: {warning}"),
                    None => println!("{line}"),
                }
            }
        }
    }
}

pub fn json<T: serde::Serialize>(v: &T) {
    to_stdout();
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("nvmeofctl: cannot encode the reply: {e}"),
    }
}

/// Prints rows under headers, columns padded to their widest cell.
pub fn table(headers: &[&str], rows: Vec<Vec<String>>) {
    to_stdout();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(c.chars().count());
            }
        }
    }
    let line = |cells: Vec<String>| {
        let parts: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = widths.get(i).copied().unwrap_or(0)))
            .collect();
        println!("{}", parts.join("  ").trim_end());
    };
    line(headers.iter().map(|h| h.to_string()).collect());
    if rows.is_empty() {
        println!("(none)");
    }
    for r in rows {
        line(r);
    }
}

/// An ANA state's name, or its code in hex when it has none.
pub fn ana_name(code: u32) -> String {
    u8::try_from(code)
        .ok()
        .and_then(AnaState::from_code)
        .map(|s| s.name().to_string())
        .unwrap_or_else(|| format!("0x{code:02x}"))
}

impl Listing for proto::Subsystem {
    const HEADERS: &'static [&'static str] =
        &["NQN", "SERIAL", "ANY HOST", "HOSTS", "MAX NS", "TLS"];
    fn row(&self) -> Vec<String> {
        vec![
            self.nqn.clone(),
            self.serial.clone(),
            if self.allow_any_host { "yes" } else { "no" }.into(),
            // `host_entries` has every host (`hosts` only those without keys); an older
            // control plane sends `hosts` alone.
            self.host_entries.len().max(self.hosts.len()).to_string(),
            self.max_namespaces.to_string(),
            if self.require_tls { "required" } else { "no" }.into(),
        ]
    }
}

/// VISIBLE TO: "all" (every allowed host), or the hosts on the namespace's list
/// (comma-separated; "none" while it has none).
impl Listing for proto::Namespace {
    const HEADERS: &'static [&'static str] = &[
        "SUBSYSTEM",
        "NSID",
        "IMAGE",
        "BLOCK",
        "ANA GROUP",
        "NGUID",
        "UUID",
        "VISIBLE TO",
        "QOS",
        "SIZE",
    ];
    fn row(&self) -> Vec<String> {
        let image = if self.rados_namespace.is_empty() {
            format!("{}/{}", self.pool, self.image)
        } else {
            format!("{}/{}/{}", self.pool, self.rados_namespace, self.image)
        };
        vec![
            self.subsystem_nqn.clone(),
            self.nsid.to_string(),
            image,
            self.block_size.to_string(),
            self.ana_group.to_string(),
            self.nguid.clone(),
            self.uuid.clone(),
            match (self.no_auto_visible, self.hosts.is_empty()) {
                (false, _) => "all".into(),
                (true, true) => "none".into(),
                (true, false) => self.hosts.join(","),
            },
            control_plane::qos::QosLimits::from_proto(self.qos.as_ref()).to_string(),
            // Auto-resize off: the size every gateway reports; on: the image's, whatever it is.
            match self.frozen_size {
                0 => "image".into(),
                bytes => format!("{bytes} (auto-resize off)"),
            },
        ]
    }
}

impl Listing for proto::Listener {
    const HEADERS: &'static [&'static str] = &[
        "SUBSYSTEM",
        "GATEWAY",
        "TRANSPORT",
        "ADDRESS",
        "PORT",
        "SECURE",
    ];
    fn row(&self) -> Vec<String> {
        vec![
            self.subsystem_nqn.clone(),
            self.gateway.clone(),
            self.transport.clone(),
            self.address.clone(),
            self.port.to_string(),
            if self.secure { "yes" } else { "no" }.into(),
        ]
    }
}

/// AUTH: "none", "host" (DH-HMAC-CHAP) or "bidirectional"; "-" from a control plane that
/// predates keys. TLS PSK: the derivation of the host's PSK, or "no". Never a key (the
/// control plane sends none in lists).
impl Listing for proto::Host {
    const HEADERS: &'static [&'static str] = &["SUBSYSTEM", "HOST", "AUTH", "TLS PSK"];
    fn row(&self) -> Vec<String> {
        vec![
            self.subsystem_nqn.clone(),
            self.host_nqn.clone(),
            if self.auth.is_empty() {
                "-".into()
            } else {
                self.auth.clone()
            },
            match &self.psk {
                Some(p) if !p.derivation.is_empty() => p.derivation.clone(),
                Some(_) => "yes".into(),
                None => "no".into(),
            },
        ]
    }
}

/// A gateway of `gateway list`: beacon times are known only to the leader.
pub struct GatewayRow<'a> {
    pub gateway: &'a proto::GatewayInfo,
    pub from_leader: bool,
}

impl Listing for GatewayRow<'_> {
    const HEADERS: &'static [&'static str] = &[
        "GATEWAY",
        "ANA GROUP",
        "STATE",
        "CEPH",
        "LAST BEACON",
        "CNTLID",
        "CLIENTS",
    ];
    fn row(&self) -> Vec<String> {
        let g = self.gateway;
        vec![
            g.name.clone(),
            g.ana_group.to_string(),
            g.availability.clone(),
            if self.from_leader {
                g.cluster.clone()
            } else {
                "-".into()
            },
            if self.from_leader {
                format!("{} ms ago", g.last_beacon_ms_ago)
            } else {
                "-".into()
            },
            format!("{}-{}", g.cntlid_min, g.cntlid_max),
            g.client_addrs.len().to_string(),
        ]
    }
}

impl Listing for proto::Connection {
    const HEADERS: &'static [&'static str] =
        &["GATEWAY", "SUBSYSTEM", "HOST", "CNTLID", "IO QUEUES", "TLS"];
    fn row(&self) -> Vec<String> {
        vec![
            self.gateway.clone(),
            self.subsystem_nqn.clone(),
            self.host_nqn.clone(),
            self.cntlid.to_string(),
            self.io_queues.to_string(),
            if self.secure { "yes" } else { "no" }.into(),
        ]
    }
}

impl Listing for proto::AnaGroupInfo {
    const HEADERS: &'static [&'static str] =
        &["ANA GROUP", "OWNER", "OPTIMIZED ON", "PHASE", "NAMESPACES"];
    fn row(&self) -> Vec<String> {
        vec![
            self.ana_group.to_string(),
            self.owner.clone(),
            self.holder.clone(),
            self.phase.clone(),
            self.namespaces.to_string(),
        ]
    }
}

impl Listing for proto::GatewayAnaState {
    const HEADERS: &'static [&'static str] = &["GATEWAY", "ANA GROUP", "STATE"];
    fn row(&self) -> Vec<String> {
        vec![
            self.gateway.clone(),
            self.ana_group.to_string(),
            ana_name(self.state),
        ]
    }
}

/// `namespace stats`: a row per gateway, then the total; or the reply as JSON.
pub fn print_io_stats(output: Output, r: &proto::NamespaceIoStatsReply) {
    if output == Output::Json {
        return json(r);
    }
    fn ms(nanos: u64) -> String {
        format!("{:.3}", nanos as f64 / 1e6)
    }
    fn mean_ms(o: Option<&proto::OpCounters>) -> String {
        match o {
            Some(o) if o.ops > 0 => ms(o.latency_ns / o.ops),
            _ => "-".into(),
        }
    }
    fn row(name: String, c: &proto::NamespaceIoCounters, ago: String) -> Vec<String> {
        let (r, w, u) = (c.read.as_ref(), c.write.as_ref(), c.unmap.as_ref());
        let ops = |o: Option<&proto::OpCounters>| o.map_or(0, |o| o.ops);
        let bytes = |o: Option<&proto::OpCounters>| o.map_or(0, |o| o.bytes);
        let failed = [r, w, u]
            .iter()
            .map(|o| o.map_or(0, |o| o.failed))
            .sum::<u64>();
        vec![
            name,
            ops(r).to_string(),
            bytes(r).to_string(),
            ops(w).to_string(),
            bytes(w).to_string(),
            ops(u).to_string(),
            c.other_ops.to_string(),
            failed.to_string(),
            mean_ms(r),
            r.map_or("-".into(), |o| ms(o.max_latency_ns)),
            mean_ms(w),
            w.map_or("-".into(), |o| ms(o.max_latency_ns)),
            c.in_flight.to_string(),
            ago,
        ]
    }
    let mut rows: Vec<Vec<String>> = r
        .gateways
        .iter()
        .map(|g| {
            row(
                g.gateway.clone(),
                &g.counters.clone().unwrap_or_default(),
                format!("{:.1}s ago", g.reported_ms_ago as f64 / 1000.0),
            )
        })
        .collect();
    rows.push(row(
        "(total)".into(),
        &r.total.clone().unwrap_or_default(),
        String::new(),
    ));
    table(
        &[
            "GATEWAY",
            "READS",
            "READ BYTES",
            "WRITES",
            "WRITE BYTES",
            "UNMAPS",
            "OTHER",
            "FAILED",
            "READ MS (MEAN)",
            "READ MS (MAX)",
            "WRITE MS (MEAN)",
            "WRITE MS (MAX)",
            "IN FLIGHT",
            "REPORTED",
        ],
        rows,
    );
}
