//! NVMe/TCP: the PDU codec (pure) and the tokio binding that drives the protocol core.

pub mod connection;
pub mod digest;
pub mod pdu;
pub mod server;
