//! Running the core's rare CPU-heavy work from a transport task without stalling the other
//! tasks of its runtime worker.

use tokio::runtime::{Handle, RuntimeFlavor};

/// Runs `work` where it may take milliseconds: in-band authentication's key exchange costs
/// ~1 ms of CPU with ffdhe2048 and ~31 ms with ffdhe8192, which would otherwise hold up the
/// I/O of every queue sharing the worker. On the multi-threaded runtime the worker hands
/// its other tasks over (`block_in_place`) first; elsewhere (a current-thread runtime in
/// tests, no runtime) the work just runs.
pub fn cpu_heavy<R>(work: impl FnOnce() -> R) -> R {
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}
