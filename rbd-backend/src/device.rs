//! The block-device contract shared by every backend.

use std::sync::Arc;

/// An owned, reusable data buffer. Ops carry their buffers to the device and back, so the
/// transport can recycle them (later: slots of a registered RDMA buffer pool) and never
/// allocate per I/O once warm.
#[derive(Debug, Default)]
pub struct IoBuf {
    bytes: Vec<u8>,
    /// What the buffer counts against while it exists (see [`Charge`]).
    charge: Option<Charge>,
}

/// A limit that buffers count against while they exist: the gateway bounds the memory it
/// holds for hosts' data, wherever the buffer is (waiting for the host's data, at the
/// device, queued for the socket, or dropped with a late completion).
pub trait ByteBudget: Send + Sync {
    /// `bytes` charged earlier are free again.
    fn release(&self, bytes: usize);
}

/// `bytes` held against a [`ByteBudget`] until this is dropped. The budget lives for the
/// whole process (a reference count per buffer would be one more shared atomic per I/O).
pub struct Charge {
    bytes: usize,
    budget: &'static dyn ByteBudget,
}

impl Charge {
    /// Records `bytes` as held; the budget's caller has already counted them as in use.
    pub fn new(bytes: usize, budget: &'static dyn ByteBudget) -> Self {
        Self { bytes, budget }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.release(self.bytes);
    }
}

impl std::fmt::Debug for Charge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Charge({} bytes)", self.bytes)
    }
}

impl IoBuf {
    /// A zero-filled buffer of `len` bytes.
    pub fn zeroed(len: usize) -> Self {
        Self {
            bytes: vec![0; len],
            charge: None,
        }
    }

    /// Wraps existing bytes.
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        Self {
            bytes,
            charge: None,
        }
    }

    /// Makes the buffer hold `charge` until it is dropped or the charge is taken back
    /// (replacing, and so releasing, any earlier one).
    pub fn set_charge(&mut self, charge: Charge) {
        self.charge = Some(charge);
    }

    /// Releases the buffer's charge, if any (it goes back to a free list).
    pub fn release_charge(&mut self) {
        self.charge = None;
    }

    /// Resizes to `len` bytes, reusing the allocation when it is large enough. New bytes are
    /// zero; callers that overwrite the whole buffer pay only for growth.
    pub fn resize(&mut self, len: usize) {
        self.bytes.resize(len, 0);
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.bytes.capacity()
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.bytes
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.bytes
    }

    pub fn into_vec(self) -> Vec<u8> {
        self.bytes
    }
}

/// One request to a device. Offsets and lengths are in bytes; the core has already checked
/// them against the namespace size and block size.
#[derive(Debug)]
pub enum IoOp {
    /// Fill `buf` (its whole length) from `offset`.
    Read { offset: u64, buf: IoBuf },
    /// Write `buf` at `offset`; with `fua` the data is durable when the op completes.
    Write { offset: u64, buf: IoBuf, fua: bool },
    /// Make every completed write durable.
    Flush,
    /// Deallocate a range; later reads of it return zeroes.
    Discard { offset: u64, len: u64 },
    /// Write zeroes over a range.
    WriteZeroes { offset: u64, len: u64 },
    /// Atomically: if the range at `offset` equals `compare`, write `write` there; otherwise
    /// fail with [`IoError::Miscompare`] and change nothing. Both buffers have equal length.
    CompareAndWrite {
        offset: u64,
        compare: IoBuf,
        write: IoBuf,
    },
    /// Durably store a small named record with the device (the gateway's reservation state
    /// of the namespace it serves), replacing any earlier value of `key`. Completes once the
    /// record is on stable storage, or with the error; an RBD image stores it through the
    /// same cluster client as its I/O, so a fenced (blocklisted) client cannot store it.
    StoreRecord { key: String, value: Vec<u8> },
}

/// Why an op failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IoError {
    #[error("compare failed at byte {offset_in_range} of the range")]
    Miscompare { offset_in_range: u64 },
    #[error("range {offset}+{len} is beyond the device size {size}")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("device is read-only")]
    ReadOnly,
    #[error("device I/O error: {0}")]
    Device(String),
    /// The cluster client serving this device was blocklisted (fenced by the gateway group's
    /// control plane, librbd's -EBLOCKLISTED/-ESHUTDOWN): nothing was or will be written
    /// through it. Another gateway serves the data now; the host must use another path.
    #[error("fenced: {0}")]
    Fenced(String),
}

/// A finished op, handed back with its buffers.
#[derive(Debug)]
pub struct IoDone {
    /// The caller's tag, returned unchanged.
    pub tag: u64,
    pub op: IoOp,
    pub result: Result<(), IoError>,
}

/// Where a device reports finished ops. Called from any thread, possibly before `submit`
/// returns (a synchronous device), so implementations must not block or take locks the
/// submitter holds.
pub trait IoCompletion: Send + Sync {
    fn complete(&self, done: IoDone);
}

/// Something that changed on the device without the host asking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceEvent {
    /// The device now has `new_size` bytes (for RBD: `rbd resize` from anywhere).
    Resized { new_size: u64 },
    /// The device's cluster client was blocklisted (fenced): every further op fails with
    /// [`IoError::Fenced`] until the device is replaced by one on a fresh client.
    Fenced,
}

/// Receives device events; the core turns them into NVMe asynchronous events.
pub trait DeviceEventSink: Send + Sync {
    fn device_event(&self, event: DeviceEvent);
}

/// A block device: the core's only view of storage.
pub trait BlockDevice: Send + Sync {
    /// Human-readable identity for logs (`pool/image`, `memory:demo`).
    fn name(&self) -> &str;

    /// Current size in bytes.
    fn size_bytes(&self) -> u64;

    /// Starts `op`; its result reaches `completion` exactly once, tagged with `tag`.
    fn submit(&self, tag: u64, op: IoOp, completion: &Arc<dyn IoCompletion>);

    /// Runs `op` to its end on the calling thread, when the device can do so without
    /// waiting (the in-memory device always can), and returns it done; otherwise hands it
    /// back untouched, for [`Self::submit`]. A caller that completes inline this way skips
    /// the completion sink's hand-over, which is most of what a 4 KiB in-memory read costs
    /// besides its copy. Devices that wait for anything (RBD) keep the default.
    fn complete_now(&self, tag: u64, op: IoOp) -> Result<IoDone, IoOp> {
        let _ = tag;
        Err(op)
    }

    /// Registers the sink for [`DeviceEvent`]s, replacing any earlier one.
    fn set_event_sink(&self, sink: Arc<dyn DeviceEventSink>);

    /// Ops submitted and not completed yet (a drain waits for 0). Devices that complete
    /// inside `submit` have none.
    fn in_flight(&self) -> usize {
        0
    }

    /// Whether an op submitted at least `age` before `now` is still in flight (ages up to
    /// [`crate::op_ages::SPAN`]). Devices that complete inside `submit` have none.
    fn has_op_older_than(&self, now: std::time::Instant, age: std::time::Duration) -> bool {
        let _ = (now, age);
        false
    }

    /// What the device has completed so far (ops, bytes, time per kind of op); `None` for a
    /// device that does not count.
    fn io_stats(&self) -> Option<crate::stats::IoStatsSnapshot> {
        None
    }

    /// The concrete device, for callers that manage a backend's own features (reopening an
    /// RBD image on a fresh cluster client). `None`: nothing beyond this trait.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// The record [`IoOp::StoreRecord`] last stored under `key` (blocking: call it from a
    /// blocking thread, never a runtime worker). `Ok(None)`: none stored. A device that keeps
    /// no records has none.
    fn load_record(&self, key: &str) -> Result<Option<Vec<u8>>, IoError> {
        let _ = key;
        Ok(None)
    }
}
