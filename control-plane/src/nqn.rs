//! NQN syntax: one check for the gateway's configuration file and the control plane
//! (`nvmeofctl`), for subsystem and host NQNs.
//!
//! What is accepted is what Linux nvmet accepts, so configurations and test suites written
//! for it (names like `testnqn`) work here: nvmet takes any configfs directory name as a
//! subsystem or host NQN (`nvmet_subsys_make`, `nvmet_hosts_make_group` in
//! drivers/nvme/target/configfs.c) and keeps at most `NVMF_NQN_SIZE` (223) bytes of it
//! (`nvmet_subsys_alloc`); a host sends it in a 256-byte Connect field. Refused: empty,
//! longer than 223 bytes, whitespace or control characters (which no Connect field, log
//! line or table carries intact). A name outside the NVMe Base specification's formats
//! (section 4.7: `nqn.yyyy-mm.<reverse domain>[:<string>]`, or
//! `nqn.2014-08.org.nvmexpress:uuid:<UUID>`) is accepted with a warning, as other hosts or
//! tools may refuse it.

/// Longest NQN in bytes (`NVMF_NQN_SIZE` in include/linux/nvme.h).
pub const NQN_MAX_LEN: usize = 223;

/// The prefix of the NVMe Base specification's UUID-based NQN format.
const UUID_NQN_PREFIX: &str = "nqn.2014-08.org.nvmexpress:uuid:";

/// Why an NQN is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NqnError {
    #[error("empty")]
    Empty,
    #[error("{0} bytes long, more than the {NQN_MAX_LEN} an NQN may have")]
    TooLong(usize),
    #[error("contains whitespace or a control character ({0:?})")]
    Forbidden(char),
}

/// Checks `nqn` as Linux nvmet would take it. `Ok(Some(why))`: accepted, but outside the
/// specification's formats (worth a warning naming `why`).
pub fn check(nqn: &str) -> Result<Option<&'static str>, NqnError> {
    if nqn.is_empty() {
        return Err(NqnError::Empty);
    }
    if nqn.len() > NQN_MAX_LEN {
        return Err(NqnError::TooLong(nqn.len()));
    }
    if let Some(c) = nqn.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err(NqnError::Forbidden(c));
    }
    Ok(spec_format_problem(nqn))
}

/// What keeps `nqn` out of the specification's formats, if anything.
fn spec_format_problem(nqn: &str) -> Option<&'static str> {
    let Some(rest) = nqn.strip_prefix("nqn.") else {
        return Some("it does not start with \"nqn.\"");
    };
    if let Some(uuid) = nqn.strip_prefix(UUID_NQN_PREFIX) {
        return uuid::Uuid::parse_str(uuid)
            .is_err()
            .then_some("no UUID after \"nqn.2014-08.org.nvmexpress:uuid:\"");
    }
    let b = rest.as_bytes();
    let dated = b.len() > 8
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && b[5..7].iter().all(u8::is_ascii_digit)
        && b[7] == b'.';
    if !dated {
        return Some("no year and month (yyyy-mm.) after \"nqn.\"");
    }
    let domain = rest[8..].split(':').next().unwrap_or("");
    if domain.is_empty() || domain.starts_with('.') || domain.ends_with('.') {
        return Some("no reverse domain name after the date");
    }
    None
}

/// A log-ready warning for an NQN outside the specification's formats (`what`: "subsystem
/// NQN", "host NQN" or a configuration field), or None.
pub fn format_warning(what: &str, nqn: &str) -> Option<String> {
    let why = check(nqn).ok().flatten()?;
    Some(format!(
        "{what} {nqn:?} is not in the NVMe formats (nqn.yyyy-mm.<reverse domain>:<name> or \
         nqn.2014-08.org.nvmexpress:uuid:<UUID>): {why}; Linux nvmet takes it, some hosts \
         and tools may not"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_formats_pass_without_a_warning() {
        for good in [
            "nqn.2016-06.io.spdk:cnode1",
            "nqn.2020-01.com.example",
            "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000e4",
            "nqn.2014-08.org.nvmexpress.discovery",
        ] {
            assert_eq!(check(good), Ok(None), "{good}");
        }
        let longest = format!("nqn.2016-06.io.test:{}", "x".repeat(NQN_MAX_LEN - 20));
        assert_eq!(longest.len(), NQN_MAX_LEN);
        assert_eq!(check(&longest), Ok(None));
    }

    #[test]
    fn names_linux_nvmet_takes_pass_with_a_warning() {
        for other in [
            "testnqn",
            "iqn.2016-06.io.test:x",
            "nqn.16-06.io.test:x",
            "nqn.2016-06.:x",
            "nqn.2014-08.org.nvmexpress:uuid:not-a-uuid",
            "nqn.testnqn",
        ] {
            assert!(matches!(check(other), Ok(Some(_))), "{other}");
            let warning = format_warning("subsystem NQN", other).expect("a warning");
            assert!(warning.contains(other), "{warning}");
        }
        assert_eq!(
            format_warning("host NQN", "nqn.2020-01.com.example:h"),
            None
        );
    }

    #[test]
    fn empty_too_long_whitespace_and_control_characters_are_refused() {
        assert_eq!(check(""), Err(NqnError::Empty));
        let too_long = "n".repeat(NQN_MAX_LEN + 1);
        assert_eq!(check(&too_long), Err(NqnError::TooLong(224)));
        assert_eq!(check("test nqn"), Err(NqnError::Forbidden(' ')));
        assert_eq!(check("test\tnqn"), Err(NqnError::Forbidden('\t')));
        assert_eq!(check("test\u{1}nqn"), Err(NqnError::Forbidden('\u{1}')));
        assert_eq!(check("test\u{a0}nqn"), Err(NqnError::Forbidden('\u{a0}')));
    }
}
