//! Liveness and readiness of the gateway, answered on the metrics endpoint (`/healthz`,
//! `/readyz`; see `metrics_exposition::HealthChecks`) for Kubernetes' probes.
//!
//! - Alive: the runtime makes progress (`metrics_exposition::heartbeat`: a task beats every
//!   second; no beat for 5 s means the runtime's workers are stuck, which only a restart
//!   cures).
//! - Ready: this gateway serves what it was configured with. Standalone: the target is built
//!   and every configured listener is bound. In a gateway group also: the agent has applied
//!   its first assignment from the control plane and the listeners the control plane holds
//!   for this gateway are bound. Never while shutting down (a terminating pod must leave the
//!   endpoints at once), nor while the Ceph files `[ceph]` names cannot be read or namespaces
//!   wait for a cluster connection that fails (a missing keyring, an unreachable cluster);
//!   a namespace whose image alone is missing does not hold the gateway back.
//!
//! Every change of the readiness reason is logged once (error level for Ceph access), so a
//! pod that stays not ready says why in its log as well as in the probe's answer.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use metrics_exposition::{HealthChecks, Heartbeat};
use rbd_backend::rbd::CephSettings;

use crate::core::Target;

/// What the gateway has reached so far.
#[derive(Default)]
struct Progress {
    /// The target is built and the configured listeners are bound.
    serving: bool,
    /// In a gateway group: set by the agent once its first assignment is applied.
    group_applied: Option<Arc<AtomicBool>>,
    /// In a gateway group: the control plane's listeners for this gateway were followed once.
    pushed_listeners_followed: bool,
    /// Listeners that could not be bound, by address, with why.
    unbound: BTreeMap<String, String>,
}

/// The gateway's health, shared by the daemon's tasks and the probe handlers.
pub struct Health {
    heartbeat: Heartbeat,
    shutting_down: AtomicBool,
    progress: Mutex<Progress>,
    /// The files `[ceph]` names are checked at every probe.
    ceph: CephSettings,
    /// Its unopened namespaces (weak: the probes must not keep the images open at exit).
    target: Mutex<Weak<Target>>,
}

impl Health {
    pub fn new(ceph: CephSettings) -> Arc<Self> {
        Arc::new(Health {
            heartbeat: Heartbeat::default(),
            shutting_down: AtomicBool::new(false),
            progress: Mutex::new(Progress::default()),
            ceph,
            target: Mutex::new(Weak::new()),
        })
    }

    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The target is built and every configured listener is bound.
    pub fn serving(&self, target: &Arc<Target>) {
        *self.target.lock().unwrap_or_else(|e| e.into_inner()) = Arc::downgrade(target);
        self.progress().serving = true;
    }

    /// This gateway is in a group: not ready until `applied` turns true (the agent's first
    /// assignment applied) and the control plane's listeners were followed.
    pub fn joining_group(&self, applied: Arc<AtomicBool>) {
        self.progress().group_applied = Some(applied);
    }

    /// The control plane's listeners for this gateway were applied; `failed` lists the ones
    /// that could not be bound (address, why): the gateway is not ready while any is.
    pub fn listeners_followed(&self, failed: Vec<(String, String)>) {
        let mut p = self.progress();
        p.pushed_listeners_followed = true;
        p.unbound = failed.into_iter().collect();
    }

    /// SIGTERM or SIGINT: not ready from now on.
    pub fn shutting_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// `/healthz`: Ok while the heartbeat is recent.
    pub fn live(&self) -> Result<(), String> {
        self.heartbeat.live()
    }

    /// `/readyz`: Ok, or the first reason this gateway is not ready.
    pub fn ready(&self) -> Result<(), String> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err("shutting down".into());
        }
        {
            let p = self.progress();
            if !p.serving {
                return Err("starting: building the target and binding the listeners".into());
            }
            // Before the group's progress: a missing keyring is what the admin must fix, and
            // it also keeps the control plane's replicas (same Secret) from ever sending the
            // first assignment, which would otherwise be the only reason shown.
            self.ceph.check_files().map_err(|e| e.to_string())?;
            if let Some(applied) = &p.group_applied {
                if !applied.load(Ordering::SeqCst) || !p.pushed_listeners_followed {
                    return Err("waiting for the first assignment from the control plane".into());
                }
            }
            if let Some((addr, why)) = p.unbound.iter().next() {
                return Err(format!("listener {addr} not bound: {why}"));
            }
        }
        let target = self
            .target
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .upgrade();
        if let Some(target) = target {
            let waiting = target.unavailable_namespaces().len();
            if waiting > 0 {
                if let Some(e) = rbd_backend::rbd::last_connect_failure() {
                    return Err(format!("{waiting} namespace(s) not opened: {e} (retrying)"));
                }
            }
        }
        Ok(())
    }

    /// The probes' checks for the metrics endpoint.
    pub fn checks(self: &Arc<Self>) -> HealthChecks {
        let (live, ready) = (self.clone(), self.clone());
        HealthChecks {
            live: Arc::new(move || live.live()),
            ready: Arc::new(move || ready.ready()),
        }
    }

    /// Starts the heartbeat task (on the current runtime); it also logs every change of the
    /// readiness reason. It ends when the last other holder of the health drops it.
    pub fn spawn_heartbeat(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        self.heartbeat.beat();
        let health = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = Heartbeat::ticker();
            let mut logged: Option<Result<(), String>> = None;
            loop {
                tick.tick().await;
                let Some(health) = health.upgrade() else {
                    return;
                };
                health.heartbeat.beat();
                let now = health.ready();
                if logged.as_ref() != Some(&now) {
                    log_readiness(&now);
                    logged = Some(now);
                }
            }
        })
    }
}

fn log_readiness(now: &Result<(), String>) {
    match now {
        Ok(()) => tracing::info!("ready"),
        // Ceph access is what an operator must fix (mount the keyring, reach the monitors).
        Err(why) if why.starts_with("ceph ") || why.contains("namespace(s) not opened") => {
            tracing::error!("not ready: {why}")
        }
        Err(why) => tracing::info!("not ready: {why}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::TargetIdentity;

    #[test]
    fn readiness_follows_the_gateway_s_progress() {
        let dir = std::env::temp_dir().join(format!("gw-health-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let keyring = dir.join("keyring");
        let health = Health::new(CephSettings {
            keyring: Some(keyring.clone()),
            ..CephSettings::default()
        });
        let target = Arc::new(Target::new(TargetIdentity::default()));
        assert!(health
            .ready()
            .expect_err("not built")
            .starts_with("starting"));
        health.serving(&target);
        let applied = Arc::new(AtomicBool::new(false));
        health.joining_group(applied.clone());
        let why = health.ready().expect_err("no keyring file");
        assert!(
            why.starts_with(&format!("ceph keyring {}: missing", keyring.display())),
            "a missing keyring comes before the group's progress: {why}"
        );
        // Kubernetes updates a Secret volume in place: the file appears later.
        std::fs::write(&keyring, "[client.admin]\n\tkey = x\n").expect("keyring");
        assert_eq!(
            health.ready(),
            Err("waiting for the first assignment from the control plane".into())
        );
        applied.store(true, Ordering::SeqCst);
        // Applied, but its listeners not followed yet.
        assert!(health.ready().is_err());
        health.listeners_followed(vec![(
            "10.0.0.1:4420".into(),
            "Cannot assign requested address".into(),
        )]);
        assert_eq!(
            health.ready(),
            Err("listener 10.0.0.1:4420 not bound: Cannot assign requested address".into())
        );
        health.listeners_followed(Vec::new());
        assert_eq!(health.ready(), Ok(()));
        health.shutting_down();
        assert_eq!(health.ready(), Err("shutting down".into()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
