//! Per-namespace QoS limits as the group state stores them and every source of them checks
//! them (`nvmeofctl namespace set-qos`, `namespace add`, a standalone gateway's file).
//!
//! ceph-nvmeof's four limits and their meaning: 0 = no limit; a megabyte is 2^20 bytes
//! (SPDK's bdev QoS, which ceph-nvmeof drives, counts so). Pure: no I/O.

use serde::{Deserialize, Serialize};

use crate::proto;

/// The lowest IOPS limit taken: below it a host's queue (Linux: up to 1024 commands per
/// namespace) would wait longer than its I/O timeout (30 s) and abort.
pub const MIN_IOS_PER_SECOND: u64 = 10;
/// The highest IOPS limit taken (more than any gateway serves; a larger number is a typo).
pub const MAX_IOS_PER_SECOND: u64 = 100_000_000;
/// The highest bandwidth limit taken, MB/s (1 TiB/s).
pub const MAX_MEGABYTES_PER_SECOND: u64 = 1 << 20;

/// A namespace's limits; 0 = no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QosLimits {
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rw_ios_per_second: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rw_megabytes_per_second: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub r_megabytes_per_second: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub w_megabytes_per_second: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// Why limits were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid QoS limit {field} = {value}: {why}")]
pub struct QosError {
    pub field: &'static str,
    pub value: u64,
    pub why: String,
}

impl QosLimits {
    pub fn is_unlimited(&self) -> bool {
        *self == QosLimits::default()
    }

    /// Each limit is 0 (none) or within the bounds above.
    pub fn check(&self) -> Result<(), QosError> {
        let iops = self.rw_ios_per_second;
        if iops != 0 && !(MIN_IOS_PER_SECOND..=MAX_IOS_PER_SECOND).contains(&iops) {
            return Err(QosError {
                field: "rw_ios_per_second",
                value: iops,
                why: format!(
                    "0 (no limit) or {MIN_IOS_PER_SECOND}..={MAX_IOS_PER_SECOND} I/Os per second"
                ),
            });
        }
        for (field, value) in [
            ("rw_megabytes_per_second", self.rw_megabytes_per_second),
            ("r_megabytes_per_second", self.r_megabytes_per_second),
            ("w_megabytes_per_second", self.w_megabytes_per_second),
        ] {
            if value > MAX_MEGABYTES_PER_SECOND {
                return Err(QosError {
                    field,
                    value,
                    why: format!(
                        "0 (no limit) or 1..={MAX_MEGABYTES_PER_SECOND} MB (2^20 bytes) per second"
                    ),
                });
            }
        }
        Ok(())
    }

    /// These limits with the ones `change` sets (a field absent there stays as it is; 0
    /// clears it).
    pub fn changed_by(&self, change: &proto::QosLimits) -> QosLimits {
        QosLimits {
            rw_ios_per_second: change.rw_ios_per_second.unwrap_or(self.rw_ios_per_second),
            rw_megabytes_per_second: change
                .rw_megabytes_per_second
                .unwrap_or(self.rw_megabytes_per_second),
            r_megabytes_per_second: change
                .r_megabytes_per_second
                .unwrap_or(self.r_megabytes_per_second),
            w_megabytes_per_second: change
                .w_megabytes_per_second
                .unwrap_or(self.w_megabytes_per_second),
        }
    }

    /// The wire form: every limit present (0: none).
    pub fn to_proto(self) -> proto::QosLimits {
        proto::QosLimits {
            rw_ios_per_second: Some(self.rw_ios_per_second),
            rw_megabytes_per_second: Some(self.rw_megabytes_per_second),
            r_megabytes_per_second: Some(self.r_megabytes_per_second),
            w_megabytes_per_second: Some(self.w_megabytes_per_second),
        }
    }

    /// From the wire: an absent limit is none.
    pub fn from_proto(p: Option<&proto::QosLimits>) -> QosLimits {
        p.map_or_else(QosLimits::default, |p| QosLimits::default().changed_by(p))
    }
}

impl std::fmt::Display for QosLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_unlimited() {
            return f.write_str("-");
        }
        let mut parts = Vec::new();
        for (value, unit) in [
            (self.rw_ios_per_second, "IOPS"),
            (self.rw_megabytes_per_second, "MB/s"),
            (self.r_megabytes_per_second, "MB/s read"),
            (self.w_megabytes_per_second, "MB/s write"),
        ] {
            if value != 0 {
                parts.push(format!("{value} {unit}"));
            }
        }
        f.write_str(&parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_is_no_limit_and_absurd_values_are_refused() {
        assert!(QosLimits::default().check().is_ok());
        let ok = QosLimits {
            rw_ios_per_second: 1000,
            rw_megabytes_per_second: 100,
            r_megabytes_per_second: 1,
            w_megabytes_per_second: MAX_MEGABYTES_PER_SECOND,
        };
        assert!(ok.check().is_ok());
        for bad in [
            QosLimits {
                rw_ios_per_second: 5,
                ..ok
            },
            QosLimits {
                rw_ios_per_second: u64::MAX,
                ..ok
            },
            QosLimits {
                r_megabytes_per_second: MAX_MEGABYTES_PER_SECOND + 1,
                ..ok
            },
        ] {
            let e = bad.check().expect_err("refused");
            assert!(e.to_string().contains("0 (no limit)"), "{e}");
        }
    }

    #[test]
    fn a_change_sets_only_the_limits_it_names() {
        let now = QosLimits {
            rw_ios_per_second: 1000,
            w_megabytes_per_second: 10,
            ..QosLimits::default()
        };
        let change = proto::QosLimits {
            rw_ios_per_second: Some(0),
            r_megabytes_per_second: Some(5),
            ..Default::default()
        };
        assert_eq!(
            now.changed_by(&change),
            QosLimits {
                rw_ios_per_second: 0,
                r_megabytes_per_second: 5,
                w_megabytes_per_second: 10,
                ..QosLimits::default()
            }
        );
        assert_eq!(QosLimits::from_proto(Some(&now.to_proto())), now);
        assert_eq!(QosLimits::from_proto(None), QosLimits::default());
    }
}
