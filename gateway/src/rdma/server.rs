//! NVMe/RDMA listeners: an `rdma_cm` listening ID per configured address. Connect requests
//! are checked (private data, queue sizes), get a queue pair with its own completion channel
//! and CQ, pre-posted receives, and are accepted with `crqsize`, or rejected with the NVMe/RDMA
//! status code. CM events for accepted connections are routed to their tasks.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rdma_transport::{
    AsyncEvent, AsyncEventKind, CmEvent, CmEventKind, CmId, CmIdRef, CompletionChannel,
    CompletionQueue, DeviceContext, EventChannel, PoolConfig, QpCaps,
};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};

use super::connection::{ConnEvent, RdmaConnection};
use super::wire::{self, cm_status};
use super::{stats, Device};
use crate::core::queue::MAX_QUEUE_ENTRIES;
use crate::core::Target;

/// Inline data the queue pairs are asked for: a 16-byte CQE goes inline.
const MAX_INLINE_DATA: u32 = 64;
/// How often a listener whose device was removed tries to listen again (the address may
/// get an RDMA device back, e.g. `rdma link add`).
const RELISTEN_INTERVAL: Duration = Duration::from_secs(1);

/// A device in use, with the task forwarding its asynchronous events.
struct DeviceEntry {
    device: Arc<Device>,
    events: Option<JoinHandle<()>>,
    /// Removed (`RDMA_CM_EVENT_DEVICE_REMOVAL` or a fatal device event): released once its
    /// last queue pair is closed.
    removing: bool,
}

/// An accepted connection, as the listener routes events to it.
struct ConnEntry {
    tx: mpsc::UnboundedSender<ConnEvent>,
    device: usize,
    qp_num: Option<u32>,
}

/// A bound NVMe/RDMA listener.
pub struct RdmaServer {
    channel: Arc<EventChannel>,
    /// `None` after its device was removed, until listening works again.
    listener: Option<CmId>,
    addr: SocketAddr,
    target: Arc<Target>,
    pool_config: PoolConfig,
    srq_depth: u32,
    devices: HashMap<usize, DeviceEntry>,
    connections: HashMap<CmIdRef, ConnEntry>,
    async_tx: mpsc::UnboundedSender<(usize, AsyncEvent)>,
    async_rx: Option<mpsc::UnboundedReceiver<(usize, AsyncEvent)>>,
    /// Removed devices nothing uses any more, released after the current event.
    to_release: Vec<DeviceEntry>,
}

impl RdmaServer {
    /// Binds and listens on `addr` (the RDMA device's IP address).
    pub fn bind(addr: SocketAddr, target: Arc<Target>) -> Result<Self, String> {
        let channel = EventChannel::new().map_err(|e| e.to_string())?;
        let listener = CmId::listen(&channel, addr, 128).map_err(|e| e.to_string())?;
        let (async_tx, async_rx) = mpsc::unbounded_channel();
        let mut me = Self {
            channel,
            listener: Some(listener),
            addr,
            target,
            pool_config: super::pool_config_from_env(),
            srq_depth: super::srq_depth_from_env(),
            devices: HashMap::new(),
            connections: HashMap::new(),
            async_tx,
            async_rx: Some(async_rx),
            to_release: Vec::new(),
        };
        // Register the pool now when the address names one device (it does for a unicast
        // address), so the first connection does not pay for it.
        if let Some(ctx) = me.listener.as_ref().and_then(|l| l.context()) {
            if let Err(e) = me.device(ctx) {
                return Err(format!("cannot set up the RDMA device: {e}"));
            }
        }
        Ok(me)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn device(&mut self, ctx: DeviceContext) -> Result<Arc<Device>, String> {
        if let Some(d) = self.devices.get(&ctx.key()) {
            if d.removing {
                return Err("the RDMA device is being removed".into());
            }
            return Ok(d.device.clone());
        }
        let d = Device::open(ctx, &self.pool_config, self.srq_depth).map_err(|e| e.to_string())?;
        tracing::info!(
            pool = %super::pool_summary(&d.pool),
            recv = %super::recv_summary(&d),
            limits = ?d.limits,
            "RDMA device ready"
        );
        let events = spawn_async_events(ctx, self.async_tx.clone());
        self.devices.insert(
            ctx.key(),
            DeviceEntry {
                device: d.clone(),
                events,
                removing: false,
            },
        );
        Ok(d)
    }

    /// Accepts until `shutdown` turns true, then waits for every connection to close.
    pub async fn serve(mut self, mut shutdown: watch::Receiver<bool>) {
        let addr = self.addr;
        let fd = match self.channel.async_fd() {
            Ok(fd) => fd,
            Err(e) => {
                tracing::error!(%addr, error = %e, "cannot register the rdma_cm channel");
                return;
            }
        };
        let Some(mut async_rx) = self.async_rx.take() else {
            return;
        };
        tracing::info!(%addr, "NVMe/RDMA listener ready");
        let mut tasks: JoinSet<CmIdRef> = JoinSet::new();
        let mut relisten = tokio::time::interval(RELISTEN_INTERVAL);
        relisten.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let listening = self.listener.is_some();
            tokio::select! {
                _ = shutdown.changed() => break,
                ready = fd.readable() => match ready {
                    Ok(mut guard) => {
                        guard.clear_ready();
                        self.drain_events(&mut tasks, &shutdown);
                    }
                    Err(e) => {
                        tracing::error!(%addr, error = %e, "rdma_cm channel failed");
                        break;
                    }
                },
                Some((key, ev)) = async_rx.recv() => self.on_async_event(key, ev),
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    if let Ok(id) = done {
                        self.connection_closed(id);
                    }
                }
                _ = relisten.tick(), if !listening => self.try_relisten(),
            }
            self.finish_releases().await;
        }
        // Connections close on the same shutdown signal; keep routing their CM events.
        while !tasks.is_empty() {
            tokio::select! {
                Some(done) = tasks.join_next() => {
                    if let Ok(id) = done {
                        self.connection_closed(id);
                    }
                }
                ready = fd.readable() => {
                    if let Ok(mut guard) = ready {
                        guard.clear_ready();
                        self.drain_events(&mut tasks, &shutdown);
                    }
                }
            }
            self.finish_releases().await;
        }
        let devices: Vec<DeviceEntry> = self.devices.drain().map(|(_, d)| d).collect();
        for entry in devices {
            release_device(entry).await;
        }
        tracing::info!(%addr, rdma = %stats().summary(), "NVMe/RDMA listener stopped");
    }

    fn connection_closed(&mut self, id: CmIdRef) {
        if let Some(c) = self.connections.remove(&id) {
            self.release_if_idle(c.device);
        }
    }

    /// A removed device is released once no queue pair and no listener uses it.
    fn release_if_idle(&mut self, key: usize) {
        let idle = self.devices.get(&key).is_some_and(|d| d.removing)
            && !self.connections.values().any(|c| c.device == key)
            && self
                .listener
                .as_ref()
                .and_then(|l| l.context())
                .is_none_or(|c| c.key() != key);
        if !idle {
            return;
        }
        if let Some(entry) = self.devices.remove(&key) {
            self.to_release.push(entry);
        }
    }

    /// Releases the devices queued by [`RdmaServer::release_if_idle`].
    async fn finish_releases(&mut self) {
        while let Some(entry) = self.to_release.pop() {
            release_device(entry).await;
            // librdmacm closes the device context only when it re-reads the device list and
            // nothing uses the device any more; the kernel finishes the removal after that.
            match rdma_transport::release_removed_devices() {
                Ok(n) => tracing::info!(
                    devices_left = n,
                    "removed RDMA device handed back to librdmacm"
                ),
                Err(e) => tracing::warn!(error = %e, "cannot re-read the RDMA device list"),
            }
            tracing::info!(live = %rdma_transport::live_objects(), "verbs objects after the removal");
        }
    }

    /// The device `key` is going away: close every queue pair on it, stop listening on it.
    fn on_device_removed(&mut self, key: usize, why: &str) {
        let Some(entry) = self.devices.get_mut(&key) else {
            return;
        };
        if !entry.removing {
            entry.removing = true;
            tracing::warn!(addr = %self.addr, why, "RDMA device removed: releasing its queue pairs and memory; TCP listeners are unaffected");
        }
        for c in self.connections.values().filter(|c| c.device == key) {
            let _ = c.tx.send(ConnEvent::DeviceRemoved);
        }
        if self
            .listener
            .as_ref()
            .and_then(|l| l.context())
            .is_some_and(|c| c.key() == key)
        {
            // Destroying the listening ID drops librdmacm's reference on the device.
            self.listener = None;
            tracing::info!(addr = %self.addr, "NVMe/RDMA listener closed; listening again when the address has an RDMA device");
        }
        self.release_if_idle(key);
    }

    fn on_async_event(&mut self, key: usize, ev: AsyncEvent) {
        match ev.kind {
            AsyncEventKind::DeviceFatal => self.on_device_removed(key, "fatal device event"),
            AsyncEventKind::QpFatal
            | AsyncEventKind::QpRequestError
            | AsyncEventKind::QpAccessError => {
                tracing::warn!(kind = ?ev.kind, qp_num = ?ev.qp_num, "queue pair error event");
                stats().qp_fatal_events.fetch_add(1, Ordering::Relaxed);
                if let Some(c) = self
                    .connections
                    .values()
                    .find(|c| c.device == key && c.qp_num.is_some() && c.qp_num == ev.qp_num)
                {
                    let _ = c.tx.send(ConnEvent::QpFatal);
                }
            }
            kind => tracing::debug!(?kind, qp_num = ?ev.qp_num, "asynchronous device event"),
        }
    }

    fn try_relisten(&mut self) {
        match CmId::listen(&self.channel, self.addr, 128) {
            Ok(listener) => {
                if let Some(ctx) = listener.context() {
                    if let Err(e) = self.device(ctx) {
                        tracing::debug!(error = %e, "device not ready yet");
                        return;
                    }
                }
                self.listener = Some(listener);
                tracing::info!(addr = %self.addr, "NVMe/RDMA listener back");
            }
            Err(e) => tracing::debug!(addr = %self.addr, error = %e, "cannot listen yet"),
        }
    }

    fn drain_events(&mut self, tasks: &mut JoinSet<CmIdRef>, shutdown: &watch::Receiver<bool>) {
        loop {
            let ev = match self.channel.next_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "rdma_get_cm_event failed");
                    return;
                }
            };
            match ev.kind {
                CmEventKind::ConnectRequest => {
                    if *shutdown.borrow() {
                        if let Some(id) = ev.new_id {
                            let _ = id.reject(&wire::encode_reject(cm_status::NO_RSC));
                        }
                        continue;
                    }
                    self.on_connect_request(ev, tasks, shutdown);
                }
                CmEventKind::DeviceRemoval => {
                    let listener = self.listener.as_ref().filter(|l| l.as_ref() == ev.id);
                    let key = match listener {
                        Some(l) => l.context().map(|c| c.key()),
                        None => self.connections.get(&ev.id).map(|c| c.device),
                    };
                    match key {
                        Some(key) => self.on_device_removed(key, "RDMA_CM_EVENT_DEVICE_REMOVAL"),
                        None => tracing::debug!("device removal for an unknown ID"),
                    }
                }
                kind => {
                    tracing::debug!(?kind, status = ev.status, "rdma_cm event");
                    if let Some(c) = self.connections.get(&ev.id) {
                        let _ = c.tx.send(ConnEvent::Cm(kind));
                    }
                }
            }
        }
    }

    fn on_connect_request(
        &mut self,
        ev: CmEvent,
        tasks: &mut JoinSet<CmIdRef>,
        shutdown: &watch::Receiver<bool>,
    ) {
        stats().connect_requests.fetch_add(1, Ordering::Relaxed);
        let Some(id) = ev.new_id else {
            return;
        };
        let peer = id.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let reject = |id: CmId, status: u16, why: &str| {
            stats().rejected.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, status, why, "NVMe/RDMA connect request rejected");
            if let Err(e) = id.reject(&wire::encode_reject(status)) {
                tracing::warn!(error = %e, "rdma_reject failed");
            }
        };
        let req = match wire::parse_connect_request(&ev.params.private_data, MAX_QUEUE_ENTRIES) {
            Ok(r) => r,
            Err(status) => {
                reject(id, status, "invalid private data");
                return;
            }
        };
        // From our side, the event's initiator depth is the host's responder resources (its
        // IRD): with none we could never RDMA READ a write's data.
        if ev.params.initiator_depth == 0 {
            reject(
                id,
                cm_status::INVALID_IRD,
                "the host offers no RDMA READ resources",
            );
            return;
        }
        let Some(ctx) = id.context() else {
            reject(id, cm_status::NO_RSC, "no device");
            return;
        };
        let device = match self.device(ctx) {
            Ok(d) => d,
            Err(e) => {
                reject(id, cm_status::NO_RSC, &e);
                return;
            }
        };
        let recv_count = req.recv_queue_size();
        // Per command: an RDMA READ, or an RDMA WRITE and a SEND.
        let send_count =
            (2 * u32::from(req.hrqsize).max(recv_count) + 2).min(device.limits.max_qp_wr.max(1));
        let recv_count_qp = recv_count.min(device.limits.max_qp_wr.max(1));
        if recv_count_qp < recv_count {
            reject(
                id,
                cm_status::INVALID_HSQSIZE,
                "queue larger than the device allows",
            );
            return;
        }
        let mut id = id;
        let setup = (|| -> Result<_, String> {
            let channel = CompletionChannel::new(ctx).map_err(|e| e.to_string())?;
            let cq = CompletionQueue::new(ctx, recv_count + send_count, &channel)
                .map_err(|e| e.to_string())?;
            let caps = QpCaps {
                max_send_wr: send_count,
                max_recv_wr: recv_count,
                max_inline_data: MAX_INLINE_DATA,
            };
            match &device.srq {
                Some(srq) => id.create_qp_with_srq(&device.pd, &cq, caps, srq),
                None => id.create_qp(&device.pd, &cq, caps),
            }
            .map_err(|e| e.to_string())?;
            cq.arm().map_err(|e| e.to_string())?;
            Ok((channel, cq))
        })();
        let (channel, cq) = match setup {
            Ok(x) => x,
            Err(e) => {
                reject(id, cm_status::NO_RSC, &e);
                return;
            }
        };
        let own_receives = device.srq.is_none();
        if own_receives {
            if let Err(e) = RdmaConnection::post_receives(&mut id, &device, recv_count) {
                for (_, buf) in id.destroy_qp() {
                    device.give_back(buf);
                }
                reject(id, cm_status::NO_RSC, &e);
                return;
            }
        }
        let id_ref = id.as_ref();
        let qp_num = id.qp().and_then(|qp| qp.qp_num());
        let (tx, rx) = mpsc::unbounded_channel();
        stats().live_qps.fetch_add(1, Ordering::Relaxed);
        let mut conn =
            RdmaConnection::new(id, cq, channel, device.clone(), self.target.clone(), rx);
        let responder_resources = ev
            .params
            .responder_resources
            .min(device.limits.max_qp_rd_atom);
        let initiator_depth = ev
            .params
            .initiator_depth
            .min(device.limits.max_qp_init_rd_atom);
        let crqsize = u16::try_from(recv_count).unwrap_or(u16::MAX);
        if let Err(e) = conn.accept(
            &wire::encode_reply(crqsize),
            responder_resources,
            initiator_depth,
        ) {
            tracing::warn!(%peer, error = %e, "rdma_accept failed");
        }
        stats().accepted.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%peer, qid = req.qid, hsqsize = req.hsqsize, hrqsize = req.hrqsize, "NVMe/RDMA queue pair accepted");
        self.connections.insert(
            id_ref,
            ConnEntry {
                tx,
                device: ctx.key(),
                qp_num,
            },
        );
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            conn.run(shutdown).await;
            id_ref
        });
    }
}

/// Forwards the device's asynchronous events (QP fatal, device fatal) to the listener.
fn spawn_async_events(
    ctx: DeviceContext,
    tx: mpsc::UnboundedSender<(usize, AsyncEvent)>,
) -> Option<JoinHandle<()>> {
    tokio::runtime::Handle::try_current().ok()?;
    let fd = match ctx.async_fd() {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch the device's asynchronous events");
            return None;
        }
    };
    Some(tokio::spawn(async move {
        loop {
            let Ok(mut guard) = fd.readable().await else {
                return;
            };
            guard.clear_ready();
            loop {
                match ctx.next_async_event() {
                    Ok(Some(ev)) => {
                        let fatal = ev.kind == AsyncEventKind::DeviceFatal;
                        if tx.send((ctx.key(), ev)).is_err() || fatal {
                            return;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "ibv_get_async_event failed");
                        return;
                    }
                }
            }
        }
    }))
}

/// Releases a device nothing uses any more: its event watcher, its shared receive queue, the
/// pools' registrations and its protection domain. Logs what was returned.
async fn release_device(mut entry: DeviceEntry) {
    if let Some(task) = entry.events.take() {
        // Ended (and its async fd deregistered) before the context may close.
        task.abort();
        let _ = task.await;
    }
    let d = &entry.device;
    let srq_released = d.release_srq();
    tracing::info!(
        srq_released,
        pool = %super::pool_summary(&d.pool),
        recv = %super::recv_summary(d),
        device_refs = Arc::strong_count(d),
        "RDMA device released"
    );
}
