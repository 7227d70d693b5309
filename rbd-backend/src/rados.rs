//! Safe RADOS object access for the gateway group's control plane: omap reads and atomic
//! compare-and-set writes, exclusive locks with a lease, watch/notify, mon commands
//! (OSD blocklist) and the client's own address and osdmap.
//!
//! Every call blocks (librados' synchronous API): run them on a blocking thread, never on an
//! async runtime's worker. All `unsafe` stays in the private `ffi` module.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

pub use crate::ffi::WatchEvent;
use crate::ffi::{self, FfiError};
use crate::rbd::{CephSettings, ClientHealth, RbdError};

const ENOENT: i32 = 2;
const EEXIST: i32 = 17;
const EBUSY: i32 = 16;
const ECANCELED: i32 = 125;

#[derive(Debug, Clone, thiserror::Error)]
pub enum RadosError {
    #[error(transparent)]
    Connect(#[from] RbdError),
    #[error("object {0} not found")]
    NotFound(String),
    #[error("object {0}: compare failed (changed concurrently)")]
    CompareFailed(String),
    #[error("lock {name} on {oid} is held by another client")]
    LockBusy { oid: String, name: String },
    #[error("mon command {cmd}: {status} (errno {errno})")]
    MonCommand {
        cmd: String,
        errno: i32,
        status: String,
    },
    #[error("{0}")]
    Ffi(#[from] FfiError),
}

/// One cluster connection for object work (separate from the image connections).
#[derive(Clone)]
pub struct Client {
    rados: Arc<ffi::Rados>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("instance", &self.rados.instance_id())
            .finish()
    }
}

impl Client {
    /// Connects with the same settings and precedence as the image connections.
    pub fn connect(settings: &CephSettings) -> Result<Client, RadosError> {
        let rados = Arc::new(crate::rbd::connect_rados(settings)?);
        register_client(&rados, None);
        Ok(Client { rados })
    }

    /// This client's addresses, as `osd blocklist add` takes them.
    pub fn addrs(&self) -> Result<String, RadosError> {
        Ok(self.rados.getaddrs()?)
    }

    pub fn instance_id(&self) -> u64 {
        self.rados.instance_id()
    }

    pub(crate) fn rados(&self) -> &Arc<ffi::Rados> {
        &self.rados
    }

    /// Fetches the latest osdmap from the monitors (after it, blocklists committed before
    /// the call are in force for this client).
    pub fn wait_for_latest_osdmap(&self) -> Result<(), RadosError> {
        Ok(self.rados.wait_for_latest_osdmap()?)
    }

    /// A JSON mon command; a negative return is an error carrying the monitor's message.
    pub fn mon_command(&self, cmd: &str) -> Result<(Vec<u8>, String), RadosError> {
        let reply = self.rados.mon_command(cmd, &[])?;
        if reply.rc < 0 {
            return Err(RadosError::MonCommand {
                cmd: cmd.to_string(),
                errno: reply.rc.saturating_neg(),
                status: reply.status,
            });
        }
        Ok((reply.out, reply.status))
    }

    /// `osd blocklist add ADDR [EXPIRE]`: every address of a client, e.g. both of
    /// `[v2:127.0.0.1:0/3021,v1:127.0.0.1:0/3021]`. Returns the monitor's status text.
    pub fn blocklist_add(
        &self,
        addr: &str,
        expire: Option<Duration>,
    ) -> Result<String, RadosError> {
        let mut last = String::new();
        for a in split_addrs(addr) {
            let cmd = match expire {
                Some(e) => format!(
                    r#"{{"prefix":"osd blocklist","blocklistop":"add","addr":"{a}","expire":{:.1}}}"#,
                    e.as_secs_f64()
                ),
                None => format!(r#"{{"prefix":"osd blocklist","blocklistop":"add","addr":"{a}"}}"#),
            };
            last = self.mon_command(&cmd)?.1;
        }
        Ok(last)
    }

    /// `osd blocklist add` of every address of every client in `clients` (each as
    /// [`Client::blocklist_add`] takes it), all at once: the monitor commits blocklist entries
    /// that arrive together in one osdmap proposal, where one after the other each waits for
    /// its own, and from the second on for the monitor's propose interval (1 s by default)
    /// too. Returns the monitor's status text per address; the first refusal is the error
    /// (the others were still asked).
    pub fn blocklist_add_all(
        &self,
        clients: &[String],
        expire: Option<Duration>,
    ) -> Result<Vec<String>, RadosError> {
        let addrs: std::collections::BTreeSet<String> =
            clients.iter().flat_map(|c| split_addrs(c)).collect();
        std::thread::scope(|scope| {
            let asked: Vec<_> = addrs
                .iter()
                .map(|a| scope.spawn(move || self.blocklist_add(a, expire)))
                .collect();
            asked
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(RadosError::MonCommand {
                            cmd: "osd blocklist add".into(),
                            errno: 5,
                            status: "the thread asking it panicked".into(),
                        })
                    })
                })
                .collect()
        })
    }

    /// `osd blocklist rm ADDR` for every address of a client.
    pub fn blocklist_rm(&self, addr: &str) -> Result<(), RadosError> {
        for a in split_addrs(addr) {
            let cmd = format!(r#"{{"prefix":"osd blocklist","blocklistop":"rm","addr":"{a}"}}"#);
            self.mon_command(&cmd)?;
        }
        Ok(())
    }

    /// The current osdmap epoch (`osd dump`).
    pub fn osdmap_epoch(&self) -> Result<u64, RadosError> {
        let (out, _) = self.mon_command(r#"{"prefix":"osd dump","format":"json"}"#)?;
        let text = String::from_utf8_lossy(&out);
        parse_epoch(&text).ok_or_else(|| RadosError::MonCommand {
            cmd: "osd dump".into(),
            errno: 5,
            status: "no epoch in the reply".into(),
        })
    }

    /// A context on `pool` (and RADOS namespace).
    pub fn pool(&self, pool: &str, namespace: Option<&str>) -> Result<Pool, RadosError> {
        let ctx = ffi::IoCtx::create(&self.rados, pool, namespace).map_err(|e| {
            if e.errno() == Some(ENOENT) {
                RadosError::Connect(RbdError::PoolNotFound {
                    pool: pool.to_string(),
                })
            } else {
                RadosError::Ffi(e)
            }
        })?;
        Ok(Pool { ctx: Arc::new(ctx) })
    }
}

/// `[v2:1.2.3.4:0/5,v1:1.2.3.4:0/5]` -> `v2:1.2.3.4:0/5`, `v1:1.2.3.4:0/5`; a plain address
/// stays as it is.
pub fn split_addrs(addrs: &str) -> Vec<String> {
    addrs
        .trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::to_string)
        .collect()
}

fn parse_epoch(json: &str) -> Option<u64> {
    let i = json.find("\"epoch\"")?;
    let rest = json[i + 7..].trim_start().strip_prefix(':')?.trim_start();
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// A pool context for object work.
#[derive(Clone)]
pub struct Pool {
    ctx: Arc<ffi::IoCtx>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pool")
    }
}

/// Keys and values of an omap.
pub type Omap = BTreeMap<String, Vec<u8>>;

impl Pool {
    /// The whole omap of `oid` (paged reads). [`RadosError::NotFound`] when it does not exist.
    pub fn omap_get_all(&self, oid: &str) -> Result<Omap, RadosError> {
        let mut all = Omap::new();
        let mut after = String::new();
        loop {
            let (page, more) = self.ctx.omap_get_vals(oid, &after, 512).map_err(|e| {
                if e.errno() == Some(ENOENT) {
                    RadosError::NotFound(oid.to_string())
                } else {
                    RadosError::Ffi(e)
                }
            })?;
            let last = page.last().map(|(k, _)| k.clone());
            all.extend(page);
            match last {
                Some(k) if more => after = k,
                _ => return Ok(all),
            }
        }
    }

    /// Atomically: create `oid` if missing, check that every `expect` key has exactly that
    /// value (a missing key equals the empty value), then set `set` and remove `remove`.
    /// [`RadosError::CompareFailed`] when a check fails (nothing written).
    pub fn omap_compare_and_set(
        &self,
        oid: &str,
        expect: &[(String, Vec<u8>)],
        set: &[(String, Vec<u8>)],
        remove: &[String],
    ) -> Result<(), RadosError> {
        self.ctx
            .omap_write(oid, Some(false), expect, set, remove)
            .map_err(|e| match e.errno() {
                Some(ECANCELED) => RadosError::CompareFailed(oid.to_string()),
                _ => RadosError::Ffi(e),
            })
    }

    pub fn remove(&self, oid: &str) -> Result<(), RadosError> {
        self.ctx.remove_object(oid).map_err(|e| {
            if e.errno() == Some(ENOENT) {
                RadosError::NotFound(oid.to_string())
            } else {
                RadosError::Ffi(e)
            }
        })
    }

    /// Takes (or, held by the same `cookie`, renews) the exclusive lock `name` on `oid` for
    /// `lease`; it lapses unless renewed. [`RadosError::LockBusy`]: another holder.
    pub fn lock_lease(
        &self,
        oid: &str,
        name: &str,
        cookie: &str,
        description: &str,
        lease: Duration,
    ) -> Result<(), RadosError> {
        let busy = |e: FfiError| match e.errno() {
            Some(EBUSY) | Some(EEXIST) => RadosError::LockBusy {
                oid: oid.to_string(),
                name: name.to_string(),
            },
            _ => RadosError::Ffi(e),
        };
        self.ctx
            .lock_exclusive(oid, name, cookie, description, Some(lease), true)
            .map_err(busy)
    }

    pub fn unlock(&self, oid: &str, name: &str, cookie: &str) -> Result<(), RadosError> {
        Ok(self.ctx.unlock(oid, name, cookie)?)
    }

    /// Watches `oid`; the callback runs on a librados thread (must not block). Dropping the
    /// returned handle unwatches.
    pub fn watch(
        &self,
        oid: &str,
        callback: impl Fn(WatchEvent) + Send + Sync + 'static,
    ) -> Result<ffi::Watch, RadosError> {
        self.ctx.watch(oid, Box::new(callback)).map_err(|e| {
            if e.errno() == Some(ENOENT) {
                RadosError::NotFound(oid.to_string())
            } else {
                RadosError::Ffi(e)
            }
        })
    }

    /// Notifies every watcher of `oid`, waiting for their acks up to `timeout`.
    pub fn notify(&self, oid: &str, data: &[u8], timeout: Duration) -> Result<(), RadosError> {
        Ok(self.ctx.notify(oid, data, timeout)?)
    }
}

/// A watch registration; dropping it unwatches.
pub type Watch = ffi::Watch;

// ------------------------------------------------------------------ this process's clients

/// Every cluster connection of this process; image connections carry their health (ANA
/// group, blocklisted, retired), [`Client`]s none.
static CLIENTS: Mutex<Vec<RegisteredClient>> = Mutex::new(Vec::new());

type RegisteredClient = (Weak<ffi::Rados>, Option<Arc<ClientHealth>>);

pub(crate) fn register_client(rados: &Arc<ffi::Rados>, health: Option<Arc<ClientHealth>>) {
    let mut all = CLIENTS.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|(w, _)| w.strong_count() > 0);
    all.push((Arc::downgrade(rados), health));
}

fn live_clients() -> Vec<(Arc<ffi::Rados>, Option<Arc<ClientHealth>>)> {
    CLIENTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(|(w, h)| Some((w.upgrade()?, h.clone())))
        .collect()
}

/// The addresses of every cluster connection this process has open (image connections and
/// [`Client`]s): what fencing this process means blocklisting.
pub fn process_client_addrs() -> Vec<String> {
    live_clients()
        .iter()
        .filter_map(|(r, _)| r.getaddrs().ok())
        .filter(|a| !a.is_empty())
        .collect()
}

/// The addresses of the image connections serving each ANA group (group 1 and up; retired
/// connections left out): what fencing one group on this gateway means blocklisting. A group
/// with no open image has no connection and is absent.
pub fn client_addrs_by_group() -> BTreeMap<u32, Vec<String>> {
    let mut out: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for (rados, health) in live_clients() {
        let Some(h) = health else { continue };
        if h.group() == 0 || h.is_retired() {
            continue;
        }
        if let Ok(a) = rados.getaddrs() {
            if !a.is_empty() {
                out.entry(h.group()).or_default().push(a);
            }
        }
    }
    out
}

/// The connections of this process that still serve: neither found blocklisted nor retired.
pub(crate) fn usable_clients() -> impl Iterator<Item = Arc<ffi::Rados>> {
    live_clients().into_iter().filter_map(|(c, h)| {
        h.as_ref()
            .is_none_or(|h| !h.is_blocklisted() && !h.is_retired())
            .then_some(c)
    })
}

/// Refreshes the osdmap of every usable connection of this process (blocking): afterwards,
/// every blocklist committed before the call is known to all of them. Connections found
/// blocklisted or retired are skipped: they serve nothing any more.
pub fn wait_for_latest_osdmap_all() -> Result<usize, RadosError> {
    let clients: Vec<_> = usable_clients().collect();
    for c in &clients {
        c.wait_for_latest_osdmap()?;
    }
    Ok(clients.len())
}

/// Asks the monitors for the latest osdmap through one usable connection of this process
/// (blocks while they do not answer): whether the cluster's monitors reach this process.
/// `Ok(false)`: no such connection to ask.
pub fn probe_monitors() -> Result<bool, RadosError> {
    match usable_clients().next() {
        Some(c) => Ok(c.wait_for_latest_osdmap().map(|()| true)?),
        None => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_split_like_ceph_prints_them() {
        assert_eq!(
            split_addrs("[v2:127.0.0.1:0/3021,v1:127.0.0.1:0/3021]"),
            vec!["v2:127.0.0.1:0/3021", "v1:127.0.0.1:0/3021"]
        );
        assert_eq!(split_addrs("127.0.0.1:0/7"), vec!["127.0.0.1:0/7"]);
        assert!(split_addrs("[]").is_empty());
    }

    #[test]
    fn epoch_is_read_from_osd_dump() {
        assert_eq!(parse_epoch(r#"{"epoch": 42,"fsid":"x"}"#), Some(42));
        assert_eq!(parse_epoch(r#"{"epoch":7}"#), Some(7));
        assert_eq!(parse_epoch("{}"), None);
    }
}
