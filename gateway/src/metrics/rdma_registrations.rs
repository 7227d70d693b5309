//! NVMe/RDMA memory registrations, from `rdma_transport`'s process-wide counters (every
//! device's data and receive pools): an admin sees that the data path registers nothing
//! (`..._while_serving_total` stays flat under I/O) and how well the registered-buffer pool
//! serves requests.

use metrics_exposition::Family;
use rdma_transport::RegistrationStats;

/// The families for `stats` (a snapshot of `rdma_transport::registrations()`).
pub(super) fn render_rdma_registrations(out: &mut String, stats: &RegistrationStats) {
    let counters: [(&str, &str, u64); 7] = [
        (
            "nvmeof_rdma_memory_registrations_total",
            "NVMe/RDMA memory registrations (ibv_reg_mr): pools created, receives for new \
             connections, and those made while serving I/O.",
            stats.registrations,
        ),
        (
            "nvmeof_rdma_memory_registrations_while_serving_total",
            "NVMe/RDMA memory registrations made while serving I/O (a registered-buffer pool \
             miss): 0 when the data path registers nothing.",
            stats.registrations_serving,
        ),
        (
            "nvmeof_rdma_memory_deregistrations_total",
            "NVMe/RDMA memory deregistrations (ibv_dereg_mr): pool evictions, devices released.",
            stats.deregistrations,
        ),
        (
            "nvmeof_rdma_memory_deregistrations_while_serving_total",
            "NVMe/RDMA memory deregistrations made while serving I/O (idle buffers evicted from \
             the registration cache to make room).",
            stats.deregistrations_serving,
        ),
        (
            "nvmeof_rdma_buffer_pool_hits_total",
            "Registered data buffers requested while serving I/O and found already registered.",
            stats.hits,
        ),
        (
            "nvmeof_rdma_buffer_pool_misses_total",
            "Registered data buffers requested while serving I/O that had to be registered.",
            stats.misses,
        ),
        (
            "nvmeof_rdma_buffer_pool_copies_total",
            "Payloads copied into a registered buffer because they were not in one.",
            stats.copies,
        ),
    ];
    for (name, help, value) in counters {
        Family::new(out, name, "counter", help).sample(&[], value);
    }
    Family::new(
        out,
        "nvmeof_rdma_registered_bytes",
        "gauge",
        "Bytes of memory registered for NVMe/RDMA now (data buffers and receives).",
    )
    .sample(&[], stats.registered_bytes);
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    use rdma_transport::{BufferPool, PoolConfig, Registrar, Registration, RegistrationCounters};

    use super::*;

    struct FakeRegistration(u32);
    impl Registration for FakeRegistration {
        fn lkey(&self) -> u32 {
            self.0
        }
    }
    struct FakeRegistrar(AtomicU32);
    impl Registrar for FakeRegistrar {
        fn register(
            &self,
            _mem: &mut [u8],
        ) -> Result<Box<dyn Registration>, rdma_transport::Error> {
            Ok(Box::new(FakeRegistration(
                self.0.fetch_add(1, Ordering::Relaxed),
            )))
        }
    }

    fn value(text: &str, name: &str) -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn a_scrape_shows_registrations_while_serving_apart_from_setup() {
        let counters: &'static RegistrationCounters =
            Box::leak(Box::new(RegistrationCounters::new()));
        let pool = Arc::new(
            BufferPool::with_counters(
                &PoolConfig {
                    classes: vec![(4096, 4)],
                    cache_bytes: 4 << 20,
                },
                Box::new(FakeRegistrar(AtomicU32::new(1))),
                counters,
            )
            .expect("pool"),
        );
        let (recv, _) = pool.take_for_setup(8192).expect("a receive");
        // Serving: 3 class hits, one 1 MiB miss then a hit, one copy (a hit too).
        for _ in 0..3 {
            let (b, _) = pool.take(4096).expect("class");
            pool.give_back(b).expect("ours");
        }
        for _ in 0..2 {
            let (b, _) = pool.take(1 << 20).expect("cache");
            pool.give_back(b).expect("ours");
        }
        let (c, _) = pool.take_copy_of(&[1u8; 512]).expect("copy");
        pool.give_back(c).expect("ours");
        pool.give_back(recv).expect("ours");

        let mut text = String::new();
        render_rdma_registrations(&mut text, &counters.snapshot());
        let want = [
            ("nvmeof_rdma_memory_registrations_total", 6),
            ("nvmeof_rdma_memory_registrations_while_serving_total", 1),
            ("nvmeof_rdma_memory_deregistrations_total", 0),
            ("nvmeof_rdma_memory_deregistrations_while_serving_total", 0),
            ("nvmeof_rdma_buffer_pool_hits_total", 5),
            ("nvmeof_rdma_buffer_pool_misses_total", 1),
            ("nvmeof_rdma_buffer_pool_copies_total", 1),
            ("nvmeof_rdma_registered_bytes", 4 * 4096 + 8192 + (1 << 20)),
        ];
        for (name, v) in want {
            assert_eq!(value(&text, name), Some(v), "{name} in\n{text}");
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} typed");
        }
        drop(pool);
        let mut text = String::new();
        render_rdma_registrations(&mut text, &counters.snapshot());
        assert_eq!(
            value(&text, "nvmeof_rdma_memory_deregistrations_total"),
            Some(6)
        );
        assert_eq!(value(&text, "nvmeof_rdma_registered_bytes"), Some(0));
    }

    #[test]
    fn the_gateway_scrape_includes_the_registration_families() {
        let f = crate::core::tests::fixture();
        let text = super::super::render(&f.target, "gw");
        for name in [
            "nvmeof_rdma_memory_registrations_total",
            "nvmeof_rdma_memory_registrations_while_serving_total",
            "nvmeof_rdma_memory_deregistrations_total",
            "nvmeof_rdma_memory_deregistrations_while_serving_total",
            "nvmeof_rdma_buffer_pool_hits_total",
            "nvmeof_rdma_buffer_pool_misses_total",
            "nvmeof_rdma_buffer_pool_copies_total",
            "nvmeof_rdma_registered_bytes",
        ] {
            assert!(value(&text, name).is_some(), "{name} in the scrape");
        }
    }
}
