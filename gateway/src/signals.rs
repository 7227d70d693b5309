//! What reaches a transport's queue task from outside it: device completions (from any
//! thread: librbd's callback threads, or inline from the in-memory device) and controller
//! wake-ups (asynchronous events, teardown). Used by the NVMe/RDMA binding. The NVMe/TCP
//! binding has its own sink (`tcp::connection`), which completes on the completing thread
//! when the connection is free and falls back to a list and a `Notify` like this one.

use std::sync::{Arc, Mutex, Weak};

use rbd_backend::{IoCompletion, IoDone};
use tokio::sync::Notify;

use crate::core::QueueNotifier;

#[derive(Default)]
pub struct QueueSignals {
    completed: Mutex<Vec<IoDone>>,
    /// Woken for every completion and every controller notice.
    pub notify: Notify,
}

impl QueueSignals {
    /// The signals, as the completion sink devices call and the notifier the controller holds.
    pub fn new() -> (Arc<Self>, Arc<dyn IoCompletion>, Weak<dyn QueueNotifier>) {
        let signals = Arc::new(Self::default());
        let sink: Arc<dyn IoCompletion> = signals.clone();
        let notifier: Arc<dyn QueueNotifier> = signals.clone();
        let notifier = Arc::downgrade(&notifier);
        (signals, sink, notifier)
    }

    /// Moves the completions that arrived into `out` (which must be empty). The two vectors
    /// trade places, so both keep their capacity and a busy queue does not allocate here.
    pub fn take_completed(&self, out: &mut Vec<IoDone>) {
        debug_assert!(out.is_empty());
        let mut completed = self.completed.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::swap(&mut *completed, out);
    }
}

impl IoCompletion for QueueSignals {
    fn complete(&self, done: IoDone) {
        self.completed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(done);
        self.notify.notify_one();
    }
}

impl QueueNotifier for QueueSignals {
    fn wake(&self) {
        self.notify.notify_one();
    }
}
