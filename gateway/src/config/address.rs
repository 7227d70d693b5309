//! Listener and metrics addresses: numeric, with or without a port, and which listeners
//! could not both bind.

use std::net::{IpAddr, SocketAddr};

/// `[gateway] metrics_listen`: a numeric address with its port.
pub(super) fn metrics_socket_addr(text: &str) -> Result<SocketAddr, String> {
    match parse_listen_address(text)? {
        (_, Some(0)) => Err("the port must not be 0".into()),
        (ip, Some(port)) => Ok(SocketAddr::new(ip, port)),
        (ip, None) => Err(format!(
            "missing the port: {}",
            with_port_example(ip, text, 10008)
        )),
    }
}

/// How `ip` with `port` is written for `ip`'s family; `text` is how the address was given.
pub(super) fn with_port_example(ip: IpAddr, text: &str, port: u16) -> String {
    match ip {
        IpAddr::V4(_) => format!("\"{ip}:{port}\""),
        // "::1:4420" is itself a valid IPv6 address (::1:4420), hence the brackets.
        IpAddr::V6(_) if !text.starts_with('[') => format!(
            "\"[{ip}]:{port}\"; an IPv6 address takes its port after brackets: {text:?} is read \
             as the address {ip}"
        ),
        IpAddr::V6(_) => format!("\"[{ip}]:{port}\""),
    }
}

/// A listener address: a numeric IPv4/IPv6 address, an IPv6 address in brackets, or either
/// with a port ("192.0.2.10:4420", "[::1]:4420"). Host names are refused: a listener binds
/// one address, and the discovery log must give hosts an address they can dial.
pub(super) fn parse_listen_address(text: &str) -> Result<(IpAddr, Option<u16>), String> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok((ip, None));
    }
    if let Ok(sa) = text.parse::<SocketAddr>() {
        if let SocketAddr::V6(v6) = sa {
            if v6.scope_id() != 0 {
                return Err(format!(
                    "{text:?}: scoped (%zone) IPv6 addresses are not supported"
                ));
            }
        }
        return Ok((sa.ip(), Some(sa.port())));
    }
    if let Some(inner) = text.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
        if let Ok(ip) = inner.parse::<std::net::Ipv6Addr>() {
            return Ok((IpAddr::V6(ip), None));
        }
    }
    Err(format!(
        "{text:?} is not a numeric IPv4/IPv6 address (e.g. \"192.0.2.10\", \"::1\", \"[::]\", \
         or with the port \"192.0.2.10:4420\", \"[::1]:4420\")"
    ))
}

/// Whether two listeners of one transport cannot both bind: on Linux a wildcard address
/// takes its port on every address of its family, and `::` (dual-stack unless
/// net.ipv6.bindv6only=1) on IPv4 addresses as well.
pub(super) fn listeners_overlap(a: SocketAddr, b: SocketAddr) -> bool {
    if a.port() != b.port() {
        return false;
    }
    let (a, b) = (a.ip(), b.ip());
    let takes = |w: IpAddr, other: IpAddr| {
        w.is_unspecified() && (w.is_ipv6() || other.to_canonical().is_ipv4())
    };
    a.to_canonical() == b.to_canonical() || takes(a, b) || takes(b, a)
}
