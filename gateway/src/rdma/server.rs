//! NVMe/RDMA listeners: an `rdma_cm` listening ID per configured address. Connect requests
//! are checked (private data, queue sizes), get a queue pair with its own completion channel
//! and CQ, pre-posted receives, and are accepted with `crqsize`, or rejected with the NVMe/RDMA
//! status code. CM events for accepted connections are routed to their tasks.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rdma_transport::{
    CmEvent, CmEventKind, CmId, CmIdRef, CompletionChannel, CompletionQueue, EventChannel,
    PoolConfig, QpCaps,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use super::connection::RdmaConnection;
use super::wire::{self, cm_status};
use super::{stats, Device};
use crate::core::queue::MAX_QUEUE_ENTRIES;
use crate::core::Target;

/// Inline data the queue pairs are asked for: a 16-byte CQE goes inline.
const MAX_INLINE_DATA: u32 = 64;

/// A bound NVMe/RDMA listener.
pub struct RdmaServer {
    channel: Arc<EventChannel>,
    listener: CmId,
    addr: SocketAddr,
    target: Arc<Target>,
    pool_config: PoolConfig,
    devices: HashMap<usize, Arc<Device>>,
    connections: HashMap<CmIdRef, mpsc::UnboundedSender<CmEventKind>>,
}

impl RdmaServer {
    /// Binds and listens on `addr` (the RDMA device's IP address).
    pub fn bind(addr: SocketAddr, target: Arc<Target>) -> Result<Self, String> {
        let channel = EventChannel::new().map_err(|e| e.to_string())?;
        let listener = CmId::listen(&channel, addr, 128).map_err(|e| e.to_string())?;
        let mut me = Self {
            channel,
            listener,
            addr,
            target,
            pool_config: super::pool_config_from_env(),
            devices: HashMap::new(),
            connections: HashMap::new(),
        };
        // Register the pool now when the address names one device (it does for a unicast
        // address), so the first connection does not pay for it.
        if let Some(ctx) = me.listener.context() {
            if let Err(e) = me.device(ctx) {
                return Err(format!("cannot set up the RDMA device: {e}"));
            }
        }
        Ok(me)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn device(&mut self, ctx: rdma_transport::DeviceContext) -> Result<Arc<Device>, String> {
        if let Some(d) = self.devices.get(&ctx.key()) {
            return Ok(d.clone());
        }
        let d = Device::open(ctx, &self.pool_config).map_err(|e| e.to_string())?;
        tracing::info!(pool = %super::pool_summary(&d.pool), limits = ?d.limits, "RDMA device ready");
        self.devices.insert(ctx.key(), d.clone());
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
        tracing::info!(%addr, "NVMe/RDMA listener ready");
        let mut tasks: JoinSet<CmIdRef> = JoinSet::new();
        loop {
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
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    if let Ok(id) = done {
                        self.connections.remove(&id);
                    }
                }
            }
        }
        // Connections close on the same shutdown signal; keep routing their CM events.
        while !tasks.is_empty() {
            tokio::select! {
                Some(done) = tasks.join_next() => {
                    if let Ok(id) = done {
                        self.connections.remove(&id);
                    }
                }
                ready = fd.readable() => {
                    if let Ok(mut guard) = ready {
                        guard.clear_ready();
                        self.drain_events(&mut tasks, &shutdown);
                    }
                }
            }
        }
        tracing::info!(%addr, rdma = %stats().summary(), "NVMe/RDMA listener stopped");
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
                kind => {
                    tracing::debug!(?kind, status = ev.status, "rdma_cm event");
                    if let Some(tx) = self.connections.get(&ev.id) {
                        let _ = tx.send(kind);
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
            id.create_qp(
                &device.pd,
                &cq,
                QpCaps {
                    max_send_wr: send_count,
                    max_recv_wr: recv_count,
                    max_inline_data: MAX_INLINE_DATA,
                },
            )
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
        if let Err(e) = RdmaConnection::post_receives(&mut id, &device, recv_count) {
            for (_, buf) in id.destroy_qp() {
                device.give_back(buf);
            }
            reject(id, cm_status::NO_RSC, &e);
            return;
        }
        let id_ref = id.as_ref();
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
        self.connections.insert(id_ref, tx);
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            conn.run(shutdown).await;
            id_ref
        });
    }
}
