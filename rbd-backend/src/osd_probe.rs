//! Whether the cluster's OSDs answer this process: a `version` command to each OSD through
//! one of its connections (`rados_osd_command`, what `ceph tell osd.N version` sends).
//!
//! Why: the monitors answering says nothing of the OSDs. A gateway whose network reaches the
//! monitors but not an OSD host has its commands to that host wait in librados (no OSD op
//! timeout by default) while every monitor probe answers; the group agent asks this, once
//! the commands have waited a stall window with the monitors answering, to tell that case
//! (an OSD that does not answer this gateway) from an OSD that answers but is slow.
//!
//! Blocking, like all of librados' synchronous API: run it on a blocking thread. A command to
//! an OSD that does not answer blocks its thread until the OSD answers or its connection
//! fails; such an OSD is not asked again through that connection while it blocks, so a long
//! cut holds at most one thread per OSD and connection.

use std::collections::BTreeSet;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::rados::{usable_clients, Client, RadosError};

/// The most OSDs one probe asks (the lowest ids): a bound on the threads a probe starts.
pub const MAX_OSDS_ASKED: usize = 64;

const ENOENT: i32 = 2;
const ENXIO: i32 = 6;
const ETIMEDOUT: i32 = 110;

/// (Client instance, OSD) pairs a command of this process still waits on: the OSD did not
/// answer that client's probe yet. Per client, so a fresh connection (after a fence, whose
/// old clients' commands may wait until the network heals) asks again.
static WAITING_ON: Mutex<BTreeSet<(u64, i32)>> = Mutex::new(BTreeSet::new());

/// What one probe found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OsdProbe {
    /// OSDs asked (the cluster's, up to [`MAX_OSDS_ASKED`]).
    pub asked: usize,
    /// OSDs the osdmap has up that did not answer within the wait (or still owe the answer
    /// to an earlier probe), by id.
    pub unanswered: Vec<i32>,
}

/// How one OSD's command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// It answered (with any status: an error from the OSD, a refused capability, is an
    /// answer too).
    Answered,
    /// Not up in this client's osdmap, or no such OSD: nothing to ask.
    NotUp,
    /// librados gave up waiting (an OSD op timeout is configured).
    TimedOut,
}

fn classify(rc: i32) -> Answer {
    match -rc {
        ENXIO | ENOENT => Answer::NotUp,
        ETIMEDOUT => Answer::TimedOut,
        _ => Answer::Answered,
    }
}

/// The ids in `osd ls`'s JSON answer (`[0,1,2]`).
fn parse_osd_ids(json: &str) -> Option<Vec<i32>> {
    let inner = json.trim().strip_prefix('[')?.strip_suffix(']')?.trim();
    if inner.is_empty() {
        return Some(Vec::new());
    }
    inner.split(',').map(|s| s.trim().parse().ok()).collect()
}

/// Asks the cluster's OSDs (the monitors' `osd ls`, up to [`MAX_OSDS_ASKED`]) for their
/// version through `client`, and waits at most `wait` for their answers. Blocks while the
/// monitors do not answer. The gateway keeps a connection for this, which no fence of an ANA
/// group retires (a gateway whose group was fenced may have no other until it gets the group
/// back, and must still find out when the OSDs answer it again).
pub fn probe_osds_through(client: &Client, wait: Duration) -> Result<OsdProbe, RadosError> {
    let (out, _) = client.mon_command(r#"{"prefix":"osd ls","format":"json"}"#)?;
    let text = String::from_utf8_lossy(&out);
    let mut ids = parse_osd_ids(&text).ok_or_else(|| RadosError::MonCommand {
        cmd: "osd ls".into(),
        errno: 5,
        status: format!("not a list of OSD ids: {text:.80}"),
    })?;
    ids.sort_unstable();
    Ok(ask(client.rados(), ids, wait))
}

/// Asks the OSDs `ids` (up to [`MAX_OSDS_ASKED`] of them) for their version, as
/// [`probe_osds_through`] does, through one usable connection of this process: what the
/// control plane's leader runs to check another process's report that these OSDs do not
/// answer it. `Ok(None)`: no connection to ask.
pub fn probe_these_osds(ids: &[i32], wait: Duration) -> Result<Option<OsdProbe>, RadosError> {
    let Some(client) = usable_clients().next() else {
        return Ok(None);
    };
    let mut ids = ids.to_vec();
    ids.sort_unstable();
    ids.dedup();
    Ok(Some(ask(&client, ids, wait)))
}

/// Asks the OSDs `ids` (up to [`MAX_OSDS_ASKED`] of them) for their version through
/// `client`, as [`probe_these_osds`] does: what a gateway runs when the control plane's leader
/// asks it to witness another gateway's report that these OSDs do not answer it.
pub fn probe_these_osds_through(client: &Client, ids: &[i32], wait: Duration) -> OsdProbe {
    let mut ids = ids.to_vec();
    ids.sort_unstable();
    ids.dedup();
    ask(client.rados(), ids, wait)
}

/// Sends `version` to each OSD of `ids` (sorted; the first [`MAX_OSDS_ASKED`]) on a thread of
/// its own and waits at most `wait` for the answers.
fn ask(client: &Arc<crate::ffi::Rados>, mut ids: Vec<i32>, wait: Duration) -> OsdProbe {
    ids.truncate(MAX_OSDS_ASKED);
    let instance = client.instance_id();
    let deadline = Instant::now() + wait;
    let (tx, rx) = mpsc::channel();
    let mut unanswered = BTreeSet::new();
    let mut pending = 0usize;
    for &id in &ids {
        // Still blocked on an earlier probe's command: it has not answered since.
        if !WAITING_ON
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((instance, id))
        {
            unanswered.insert(id);
            continue;
        }
        let (client, tx) = (Arc::clone(client), tx.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("osd-probe-{id}"))
            .spawn(move || {
                let answer = client
                    .osd_command(id, r#"{"prefix":"version"}"#)
                    .map(|r| classify(r.rc));
                WAITING_ON
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&(instance, id));
                let _ = tx.send((id, answer));
            });
        match spawned {
            Ok(_) => pending += 1,
            Err(e) => {
                WAITING_ON
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&(instance, id));
                tracing::warn!(osd = id, "cannot start an OSD probe thread: {e}");
            }
        }
    }
    drop(tx);
    let mut waiting: BTreeSet<i32> = ids
        .iter()
        .copied()
        .filter(|id| !unanswered.contains(id))
        .collect();
    while pending > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok((id, answer)) = rx.recv_timeout(left) else {
            break;
        };
        pending -= 1;
        waiting.remove(&id);
        match answer {
            Ok(Answer::Answered) | Ok(Answer::NotUp) => {}
            Ok(Answer::TimedOut) => {
                unanswered.insert(id);
            }
            // The command could not be sent (a bad command string cannot happen here).
            Err(e) => tracing::warn!(osd = id, "OSD probe: {e}"),
        }
    }
    unanswered.extend(waiting);
    OsdProbe {
        asked: ids.len(),
        unanswered: unanswered.into_iter().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn osd_ls_answers_are_parsed() {
        assert_eq!(parse_osd_ids("[0,1,2]\n"), Some(vec![0, 1, 2]));
        assert_eq!(parse_osd_ids("[ 7 , 12 ]"), Some(vec![7, 12]));
        assert_eq!(parse_osd_ids("[]"), Some(vec![]));
        assert_eq!(parse_osd_ids("{}"), None);
        assert_eq!(parse_osd_ids("[0,x]"), None);
    }

    #[test]
    fn only_a_missing_or_down_osd_and_a_timeout_are_not_answers() {
        assert_eq!(classify(0), Answer::Answered);
        assert_eq!(
            classify(-13),
            Answer::Answered,
            "EACCES: the OSD refused, so answered"
        );
        assert_eq!(classify(-22), Answer::Answered);
        assert_eq!(classify(-ENXIO), Answer::NotUp);
        assert_eq!(classify(-ENOENT), Answer::NotUp);
        assert_eq!(classify(-ETIMEDOUT), Answer::TimedOut);
    }
}
