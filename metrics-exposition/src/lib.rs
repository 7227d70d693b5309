//! Prometheus' text exposition format (version 0.0.4) and a minimal HTTP endpoint serving
//! it: what `nvmeof-gateway` and `nvmeof-control` use for their `/metrics`.
//!
//! - [`text`]: writing metric families (HELP, TYPE, samples with escaped label values).
//! - [`http`]: `GET /metrics` answered with the text a render function returns at each
//!   scrape, and the probes `GET /healthz` and `GET /readyz` (200, or 503 with a one-line
//!   reason, from [`HealthChecks`]), one request per connection, bounded in size, time and
//!   connections.
//! - [`heartbeat`]: the liveness `/healthz` reports (the runtime makes progress).

pub mod heartbeat;
pub mod http;
pub mod text;

pub use heartbeat::Heartbeat;
pub use http::{Check, HealthChecks, MetricsServer};
pub use text::Family;
