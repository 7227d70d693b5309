//! How the gateway reaches Ceph ([`CephSettings`], the options it sets before the user's)
//! and which image a namespace serves ([`ImageSpec`]).

use std::path::{Path, PathBuf};

use super::RbdError;

/// How the gateway connects to Ceph: the settings Ceph users know from `rbd`/`ceph` CLIs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CephSettings {
    /// Cluster name (`ceph`): selects `/etc/ceph/$cluster.conf` when `conf` is unset.
    pub cluster: String,
    /// Entity name, `client.admin` or just `admin`.
    pub client_name: String,
    /// ceph.conf path; `None`: `$CEPH_CONF`, then Ceph's default search list.
    pub conf: Option<PathBuf>,
    /// Keyring path; `None`: whatever the conf file (or `$CEPH_KEYRING`) says.
    pub keyring: Option<PathBuf>,
    /// Whether to apply `$CEPH_ARGS` from the environment (after the conf file).
    pub use_ceph_args_env: bool,
    /// CEPH_ARGS-style options, applied after the environment: `["--rados_osd_op_timeout=30"]`.
    pub args: Vec<String>,
    /// `option = value` overrides, applied last (`rados_conf_set`).
    pub options: Vec<(String, String)>,
    /// Upper bound of cluster connections (`rados_t`) images are spread over; at least 1.
    pub max_connections: usize,
}

impl Default for CephSettings {
    fn default() -> Self {
        Self {
            cluster: "ceph".into(),
            client_name: "client.admin".into(),
            conf: None,
            keyring: None,
            use_ceph_args_env: true,
            args: Vec::new(),
            options: Vec::new(),
            max_connections: default_connections(),
        }
    }
}

/// One connection per core (the runtime runs one worker per core), at most 8.
pub fn default_connections() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 8)
}

/// Options the gateway sets before the user's `args`/`options`, which may override them.
/// - `rbd_cache=false`: the gateway acknowledges writes to hosts that expect them durable
///   after Flush/FUA; librbd's write-back cache would only add a copy (and with several
///   gateways in a group, stale reads).
/// - `client_mount_timeout=30`: a dead cluster fails start-up in 30 s, not 300 s.
/// - `rbd_non_blocking_aio=false`: librbd dispatches an op on the calling thread instead of
///   posting it to its `io_context_pool` thread first (librbd's QueueImageDispatch layer).
///   That post is one thread wake-up per I/O, which on a busy machine is a large part of the
///   latency the gateway adds; measured at 4K: context switches per I/O of the gateway
///   process 8.1 -> 7.2 (QD1 read), 8.2 -> 5.0 (QD1 write), 1.9 -> 1.4 (QD16 read). The
///   option exists for applications whose submitting thread must not wait; in librbd 16.2
///   every layer below it (exclusive lock, refresh, QoS, scheduler) queues and continues
///   asynchronously, so the one place the caller could still wait is the next option.
/// - `objecter_inflight_ops=0`, `objecter_inflight_op_bytes=0`: no Objecter throttle (0 =
///   unlimited). librados sets a balanced budget, so an op beyond 1024 ops / 100 MiB in
///   flight on one connection would make the submitting thread (with the option above: a
///   runtime worker) sleep until others complete. The gateway bounds the memory itself:
///   every op's buffer is allocated before it is submitted and counts against its data
///   budget (`[gateway] tcp_data_budget`), beyond which commands wait without a buffer, so
///   the throttle bounded nothing more, it only moved the wait into a thread that serves
///   other queues.
///
/// Left at librbd's default on purpose: `rbd_disable_zero_copy_writes` (true: `rbd_aio_write`
/// copies the caller's buffer). Turned off, librbd holds a completion back until it has let go
/// of the caller's buffer, and in 16.2 some completions then never come: with it,
/// `rbd-backend/tests/ceph.rs` `compare_and_write_match_and_mismatch` and
/// `a_fence_of_one_ana_group_leaves_the_other_working` wait forever for an op. The copy it
/// saves (4 KiB per write) was not measurable at QD16 (gateway CPU per write 35.0 vs 35.3 us).
pub const GATEWAY_DEFAULT_ARGS: &[&str] = &[
    "--rbd_cache=false",
    "--client_mount_timeout=30",
    "--rbd_non_blocking_aio=false",
    "--objecter_inflight_ops=0",
    "--objecter_inflight_op_bytes=0",
];

impl CephSettings {
    /// Checks that the files named here (`conf`, `keyring`) exist, are readable and not
    /// empty, so a missing or unmounted file is reported by its path instead of as librados'
    /// authentication or "no monitors" failure. Files Ceph finds by itself are not checked.
    pub fn check_files(&self) -> Result<(), RbdError> {
        if let Some(conf) = &self.conf {
            check_file("conf", conf)?;
        }
        if let Some(keyring) = &self.keyring {
            // The keyring option may be a comma-separated search list; Ceph checks those.
            if !keyring.to_string_lossy().contains(',') {
                check_file("keyring", keyring)?;
            }
        }
        Ok(())
    }

    /// `client.X` for `X` or `client.X`.
    pub fn entity_name(&self) -> String {
        if self.client_name.contains('.') {
            self.client_name.clone()
        } else {
            format!("client.{}", self.client_name)
        }
    }
}

/// Which image a namespace serves.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImageSpec {
    pub pool: String,
    /// RADOS namespace inside the pool; `None` or empty: the default namespace.
    pub namespace: Option<String>,
    pub image: String,
}

impl std::fmt::Display for ImageSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.namespace.as_deref().filter(|n| !n.is_empty()) {
            Some(ns) => write!(f, "{}/{}/{}", self.pool, ns, self.image),
            None => write!(f, "{}/{}", self.pool, self.image),
        }
    }
}

/// `Ok` when `path` is a non-empty file this process can read.
fn check_file(what: &'static str, path: &Path) -> Result<(), RbdError> {
    let problem = match std::fs::File::open(path).and_then(|f| f.metadata()) {
        Ok(m) if m.is_dir() => "is a directory".to_string(),
        Ok(m) if m.len() == 0 => "is empty".to_string(),
        Ok(_) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            format!("missing ({e}); is the {what} file mounted?")
        }
        Err(e) => format!("cannot be read ({e})"),
    };
    Err(RbdError::File {
        what,
        path: path.display().to_string(),
        problem,
    })
}

#[cfg(test)]
mod file_checks {
    use super::*;

    fn with_files(conf: Option<PathBuf>, keyring: Option<PathBuf>) -> CephSettings {
        CephSettings {
            conf,
            keyring,
            ..CephSettings::default()
        }
    }

    #[test]
    fn missing_empty_and_unreadable_files_are_named() {
        let dir = std::env::temp_dir().join(format!("ceph-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let conf = dir.join("ceph.conf");
        std::fs::write(&conf, "[global]\nmon_host = 127.0.0.1\n").expect("conf");
        let keyring = dir.join("keyring");
        let missing = with_files(Some(conf.clone()), Some(keyring.clone()))
            .check_files()
            .expect_err("no keyring file")
            .to_string();
        assert_eq!(
            missing,
            format!(
                "ceph keyring {}: missing (No such file or directory (os error 2)); is the keyring file mounted?",
                keyring.display()
            )
        );
        std::fs::write(&keyring, "").expect("keyring");
        let empty = with_files(None, Some(keyring.clone()))
            .check_files()
            .expect_err("empty keyring");
        assert_eq!(
            empty.to_string(),
            format!("ceph keyring {}: is empty", keyring.display())
        );
        std::fs::write(&keyring, "[client.admin]\n\tkey = x\n").expect("keyring");
        with_files(Some(conf.clone()), Some(keyring.clone()))
            .check_files()
            .expect("both readable");
        let no_conf = with_files(Some(dir.join("nope.conf")), None)
            .check_files()
            .expect_err("no conf")
            .to_string();
        assert!(no_conf.starts_with("ceph conf "), "{no_conf}");
        assert!(no_conf.contains("is the conf file mounted?"), "{no_conf}");
        let directory = with_files(None, Some(dir.clone()))
            .check_files()
            .expect_err("a directory")
            .to_string();
        assert!(directory.ends_with("is a directory"), "{directory}");
        // Unset paths (Ceph's own search) and search lists are left to Ceph.
        with_files(None, None).check_files().expect("nothing named");
        with_files(None, Some(PathBuf::from("/nope/a,/nope/b")))
            .check_files()
            .expect("a search list");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
