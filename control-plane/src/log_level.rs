//! The process's log filter, changeable while it runs: the group's log level
//! ([`crate::state::GroupSettings::log_level`], set with `nvmeofctl log-level set` or
//! ceph-nvmeof's `set_gateway_log_level`) reaches every control-plane replica through its
//! cached state and every gateway through its assignment, and each calls [`follow`].
//!
//! A process starts with its own filter (`RUST_LOG`, else `info`); a group level replaces
//! it, and clearing the group level brings the process's own back.

use std::io::IsTerminal;
use std::sync::{Mutex, OnceLock};

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter, Registry};

/// The filter the process started with, and the handle that swaps it.
struct Live {
    handle: reload::Handle<EnvFilter, Registry>,
    own: String,
    /// The group level in force (None: the process's own filter).
    group: Mutex<Option<String>>,
}

static LIVE: OnceLock<Live> = OnceLock::new();

#[derive(Debug, thiserror::Error)]
pub enum LogLevelError {
    #[error("log level {0:?} is not one of trace, debug, info, warn, error")]
    Unknown(String),
    #[error("changing the log filter: {0}")]
    Reload(String),
}

/// Installs the process's subscriber (text to stderr, colour only on a terminal) with a
/// filter [`follow`] can replace. Call once, first thing in `main`.
pub fn init() {
    let own = std::env::var("RUST_LOG")
        .ok()
        .filter(|f| EnvFilter::try_new(f).is_ok())
        .unwrap_or_else(|| "info".to_string());
    let (filter, handle) = reload::Layer::new(EnvFilter::new(&own));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        // colour codes only for a terminal: journald and log files get plain text
        .with_ansi(std::io::stderr().is_terminal());
    tracing_subscriber::registry().with(filter).with(fmt).init();
    let _ = LIVE.set(Live {
        handle,
        own,
        group: Mutex::new(None),
    });
}

/// Puts the group's level in force (None: the process's own filter again). Nothing
/// happens when it already is, or when [`init`] was not called (tests). Returns whether
/// the filter changed.
pub fn follow(level: Option<&str>) -> Result<bool, LogLevelError> {
    if let Some(l) = level {
        if !crate::state::LOG_LEVELS.contains(&l) {
            return Err(LogLevelError::Unknown(l.to_string()));
        }
    }
    let Some(live) = LIVE.get() else {
        return Ok(false);
    };
    let mut group = live.group.lock().unwrap_or_else(|e| e.into_inner());
    if group.as_deref() == level {
        return Ok(false);
    }
    let filter = EnvFilter::new(level.unwrap_or(&live.own));
    live.handle
        .reload(filter)
        .map_err(|e| LogLevelError::Reload(e.to_string()))?;
    *group = level.map(str::to_string);
    drop(group);
    tracing::info!(
        level = level.unwrap_or(&live.own),
        group_wide = level.is_some(),
        "log level changed"
    );
    Ok(true)
}

/// The most verbose level this process logs at now ("trace" ... "error", "off").
pub fn current() -> String {
    tracing::level_filters::LevelFilter::current()
        .to_string()
        .to_ascii_lowercase()
}
