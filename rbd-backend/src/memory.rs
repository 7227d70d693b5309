//! A RAM-backed device for unit tests, benchmarks and demos.
//!
//! Storage is sparse: fixed-size chunks are allocated on first write, so a 1 GiB demo
//! namespace costs only what is written. Discarded chunks are freed and read back as zeroes,
//! like a thin-provisioned RBD image.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use crate::device::{
    BlockDevice, DeviceEvent, DeviceEventSink, IoCompletion, IoDone, IoError, IoOp,
};
use crate::stats::{IoStats, IoStatsSnapshot};

const CHUNK_SHIFT: u32 = 20; // 1 MiB chunks
const CHUNK_SIZE: u64 = 1 << CHUNK_SHIFT;

type Chunk = RwLock<Option<Box<[u8]>>>;

/// An in-memory block device.
pub struct MemoryDevice {
    name: String,
    size: AtomicU64,
    chunks: RwLock<Vec<Chunk>>,
    /// Writers take this shared and compare-and-write takes it exclusive, so a compare and
    /// its write see no interleaved write.
    atomicity: RwLock<()>,
    event_sink: Mutex<Option<Arc<dyn DeviceEventSink>>>,
    /// Every op's outcome, recorded just before its completion is delivered.
    stats: IoStats,
    /// Records stored with [`IoOp::StoreRecord`], by key.
    records: Mutex<BTreeMap<String, Vec<u8>>>,
}

impl MemoryDevice {
    pub fn new(name: impl Into<String>, size: u64) -> Self {
        Self {
            name: name.into(),
            size: AtomicU64::new(size),
            chunks: RwLock::new(Self::empty_chunks(size)),
            atomicity: RwLock::new(()),
            event_sink: Mutex::new(None),
            stats: IoStats::default(),
            records: Mutex::new(BTreeMap::new()),
        }
    }

    fn empty_chunks(size: u64) -> Vec<Chunk> {
        (0..size.div_ceil(CHUNK_SIZE))
            .map(|_| RwLock::new(None))
            .collect()
    }

    /// Grows or shrinks the device and reports it, as `rbd resize` would.
    pub fn resize(&self, new_size: u64) {
        {
            let mut chunks = self.chunks.write().unwrap_or_else(|e| e.into_inner());
            let wanted = new_size.div_ceil(CHUNK_SIZE) as usize;
            chunks.resize_with(wanted, || RwLock::new(None));
            self.size.store(new_size, Ordering::SeqCst);
        }
        let sink = self
            .event_sink
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(sink) = sink {
            sink.device_event(DeviceEvent::Resized { new_size });
        }
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), IoError> {
        let size = self.size.load(Ordering::SeqCst);
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(IoError::OutOfRange { offset, len, size }),
        }
    }

    /// Calls `visit(chunk_index, offset_in_chunk, range_in_caller)` for each chunk piece of
    /// the byte range `offset..offset+len`.
    fn for_each_piece(
        offset: u64,
        len: u64,
        mut visit: impl FnMut(usize, usize, std::ops::Range<usize>),
    ) {
        let mut done = 0u64;
        while done < len {
            let pos = offset + done;
            let in_chunk = (pos & (CHUNK_SIZE - 1)) as usize;
            let n = (CHUNK_SIZE - in_chunk as u64).min(len - done);
            visit(
                (pos >> CHUNK_SHIFT) as usize,
                in_chunk,
                done as usize..(done + n) as usize,
            );
            done += n;
        }
    }

    fn read_into(&self, offset: u64, out: &mut [u8]) {
        let chunks = self.chunks.read().unwrap_or_else(|e| e.into_inner());
        Self::for_each_piece(offset, out.len() as u64, |idx, at, range| {
            let dst = &mut out[range];
            match chunks[idx]
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .as_deref()
            {
                Some(data) => dst.copy_from_slice(&data[at..at + dst.len()]),
                None => dst.fill(0),
            }
        });
    }

    fn write_from(&self, offset: u64, src: &[u8]) {
        let chunks = self.chunks.read().unwrap_or_else(|e| e.into_inner());
        Self::for_each_piece(offset, src.len() as u64, |idx, at, range| {
            let piece = &src[range];
            let mut chunk = chunks[idx].write().unwrap_or_else(|e| e.into_inner());
            let data =
                chunk.get_or_insert_with(|| vec![0u8; CHUNK_SIZE as usize].into_boxed_slice());
            data[at..at + piece.len()].copy_from_slice(piece);
        });
    }

    /// Zeroes a range; whole chunks are freed instead of written.
    fn zero_range(&self, offset: u64, len: u64) {
        let chunks = self.chunks.read().unwrap_or_else(|e| e.into_inner());
        Self::for_each_piece(offset, len, |idx, at, range| {
            let mut chunk = chunks[idx].write().unwrap_or_else(|e| e.into_inner());
            if range.len() as u64 == CHUNK_SIZE {
                *chunk = None;
            } else if let Some(data) = chunk.as_deref_mut() {
                data[at..at + range.len()].fill(0);
            }
        });
    }

    fn compare(&self, offset: u64, expected: &[u8]) -> Result<(), IoError> {
        let chunks = self.chunks.read().unwrap_or_else(|e| e.into_inner());
        let mut mismatch = None;
        Self::for_each_piece(offset, expected.len() as u64, |idx, at, range| {
            if mismatch.is_some() {
                return;
            }
            let want = &expected[range.clone()];
            let guard = chunks[idx].read().unwrap_or_else(|e| e.into_inner());
            let first_diff = match guard.as_deref() {
                Some(data) => want.iter().zip(&data[at..]).position(|(a, b)| a != b),
                None => want.iter().position(|&b| b != 0),
            };
            if let Some(i) = first_diff {
                mismatch = Some((range.start + i) as u64);
            }
        });
        match mismatch {
            Some(offset_in_range) => Err(IoError::Miscompare { offset_in_range }),
            None => Ok(()),
        }
    }

    /// Runs `op` and counts it: every op completes on the calling thread.
    fn run(&self, tag: u64, mut op: IoOp) -> IoDone {
        let started = Instant::now();
        let result = self.execute(&mut op);
        self.stats.record(&op, started, &result);
        IoDone { tag, op, result }
    }

    fn execute(&self, op: &mut IoOp) -> Result<(), IoError> {
        match op {
            IoOp::Read { offset, buf } => {
                self.check_range(*offset, buf.len() as u64)?;
                self.read_into(*offset, buf.as_mut_slice());
            }
            IoOp::Write { offset, buf, .. } => {
                self.check_range(*offset, buf.len() as u64)?;
                let _shared = self.atomicity.read().unwrap_or_else(|e| e.into_inner());
                self.write_from(*offset, buf.as_slice());
            }
            IoOp::Flush => {}
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len } => {
                self.check_range(*offset, *len)?;
                let _shared = self.atomicity.read().unwrap_or_else(|e| e.into_inner());
                self.zero_range(*offset, *len);
            }
            IoOp::CompareAndWrite {
                offset,
                compare,
                write,
            } => {
                if compare.len() != write.len() {
                    return Err(IoError::Device(format!(
                        "compare ({}) and write ({}) lengths differ",
                        compare.len(),
                        write.len()
                    )));
                }
                self.check_range(*offset, write.len() as u64)?;
                let _exclusive = self.atomicity.write().unwrap_or_else(|e| e.into_inner());
                self.compare(*offset, compare.as_slice())?;
                self.write_from(*offset, write.as_slice());
            }
            IoOp::StoreRecord { key, value } => {
                self.records
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key.clone(), value.clone());
            }
        }
        Ok(())
    }
}

impl BlockDevice for MemoryDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn size_bytes(&self) -> u64 {
        self.size.load(Ordering::SeqCst)
    }

    fn submit(&self, tag: u64, op: IoOp, completion: &Arc<dyn IoCompletion>) {
        completion.complete(self.run(tag, op));
    }

    fn complete_now(&self, tag: u64, op: IoOp) -> Result<IoDone, IoOp> {
        Ok(self.run(tag, op))
    }

    fn io_stats(&self) -> Option<IoStatsSnapshot> {
        Some(self.stats.snapshot())
    }

    fn set_event_sink(&self, sink: Arc<dyn DeviceEventSink>) {
        *self.event_sink.lock().unwrap_or_else(|e| e.into_inner()) = Some(sink);
    }

    fn load_record(&self, key: &str) -> Result<Option<Vec<u8>>, IoError> {
        Ok(self
            .records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IoBuf;

    #[derive(Default)]
    struct Collect(Mutex<Vec<IoDone>>);
    impl IoCompletion for Collect {
        fn complete(&self, done: IoDone) {
            self.0.lock().unwrap().push(done);
        }
    }

    fn run(dev: &MemoryDevice, op: IoOp) -> IoDone {
        let sink = Arc::new(Collect::default());
        let dyn_sink: Arc<dyn IoCompletion> = sink.clone();
        dev.submit(7, op, &dyn_sink);
        let mut done = sink.0.lock().unwrap();
        assert_eq!(done.len(), 1, "exactly one completion per op");
        done.pop().unwrap()
    }

    fn read(dev: &MemoryDevice, offset: u64, len: usize) -> Vec<u8> {
        let done = run(
            dev,
            IoOp::Read {
                offset,
                buf: IoBuf::zeroed(len),
            },
        );
        done.result.unwrap();
        match done.op {
            IoOp::Read { buf, .. } => buf.into_vec(),
            other => panic!("got back {other:?}"),
        }
    }

    #[test]
    fn write_then_read_across_a_chunk_boundary() {
        let dev = MemoryDevice::new("t", 4 * CHUNK_SIZE);
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
        let offset = CHUNK_SIZE - 4096;
        let done = run(
            &dev,
            IoOp::Write {
                offset,
                buf: IoBuf::from_vec(data.clone()),
                fua: false,
            },
        );
        assert_eq!(done.tag, 7);
        done.result.unwrap();
        assert_eq!(read(&dev, offset, 8192), data);
        assert_eq!(
            read(&dev, 0, 512),
            vec![0; 512],
            "unwritten blocks read as zero"
        );
    }

    #[test]
    fn out_of_range_is_refused() {
        let dev = MemoryDevice::new("t", 1 << 20);
        let done = run(
            &dev,
            IoOp::Read {
                offset: (1 << 20) - 512,
                buf: IoBuf::zeroed(1024),
            },
        );
        assert!(matches!(done.result, Err(IoError::OutOfRange { .. })));
        let done = run(
            &dev,
            IoOp::Discard {
                offset: u64::MAX,
                len: 2,
            },
        );
        assert!(matches!(done.result, Err(IoError::OutOfRange { .. })));
    }

    #[test]
    fn discard_and_write_zeroes_read_back_zero() {
        let dev = MemoryDevice::new("t", 3 * CHUNK_SIZE);
        run(
            &dev,
            IoOp::Write {
                offset: 0,
                buf: IoBuf::from_vec(vec![0xab; 3 * CHUNK_SIZE as usize]),
                fua: true,
            },
        )
        .result
        .unwrap();
        run(
            &dev,
            IoOp::Discard {
                offset: 512,
                len: 2 * CHUNK_SIZE,
            },
        )
        .result
        .unwrap();
        let all = read(&dev, 0, 3 * CHUNK_SIZE as usize);
        assert!(all[..512].iter().all(|&b| b == 0xab));
        assert!(all[512..512 + 2 * CHUNK_SIZE as usize]
            .iter()
            .all(|&b| b == 0));
        assert!(all[512 + 2 * CHUNK_SIZE as usize..]
            .iter()
            .all(|&b| b == 0xab));
        run(
            &dev,
            IoOp::WriteZeroes {
                offset: 0,
                len: 512,
            },
        )
        .result
        .unwrap();
        assert_eq!(read(&dev, 0, 512), vec![0; 512]);
    }

    #[test]
    fn compare_and_write_writes_only_on_match() {
        let dev = MemoryDevice::new("t", 1 << 20);
        run(
            &dev,
            IoOp::Write {
                offset: 4096,
                buf: IoBuf::from_vec(vec![1; 512]),
                fua: false,
            },
        )
        .result
        .unwrap();
        let miss = run(
            &dev,
            IoOp::CompareAndWrite {
                offset: 4096,
                compare: IoBuf::from_vec(vec![2; 512]),
                write: IoBuf::from_vec(vec![3; 512]),
            },
        );
        assert_eq!(miss.result, Err(IoError::Miscompare { offset_in_range: 0 }));
        assert_eq!(
            read(&dev, 4096, 512),
            vec![1; 512],
            "miscompare changes nothing"
        );
        let hit = run(
            &dev,
            IoOp::CompareAndWrite {
                offset: 4096,
                compare: IoBuf::from_vec(vec![1; 512]),
                write: IoBuf::from_vec(vec![3; 512]),
            },
        );
        hit.result.unwrap();
        assert_eq!(read(&dev, 4096, 512), vec![3; 512]);
    }

    #[test]
    fn resize_reports_an_event_and_extends_the_range() {
        struct Events(Mutex<Vec<DeviceEvent>>);
        impl DeviceEventSink for Events {
            fn device_event(&self, event: DeviceEvent) {
                self.0.lock().unwrap().push(event);
            }
        }
        let dev = MemoryDevice::new("t", 1 << 20);
        let events = Arc::new(Events(Mutex::new(Vec::new())));
        dev.set_event_sink(events.clone());
        dev.resize(2 << 20);
        assert_eq!(dev.size_bytes(), 2 << 20);
        assert_eq!(
            *events.0.lock().unwrap(),
            vec![DeviceEvent::Resized { new_size: 2 << 20 }]
        );
        assert_eq!(read(&dev, (2 << 20) - 512, 512), vec![0; 512]);
    }
}
