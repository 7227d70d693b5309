//! Writing the text exposition format: one [`Family`] per metric name, its HELP and TYPE
//! lines first, then its samples.

use std::fmt::Write;

/// Label pairs of one sample; values are escaped when written.
pub type Labels<'a> = [(&'a str, &'a str)];

/// Appends one metric family (HELP, TYPE and its samples) to the exposition text.
pub struct Family<'a> {
    out: &'a mut String,
    name: String,
}

impl<'a> Family<'a> {
    /// Starts family `name` of `kind` ("gauge", "counter" or "histogram") described by
    /// `help` (one line).
    pub fn new(out: &'a mut String, name: &str, kind: &str, help: &str) -> Self {
        // Writing to a String cannot fail.
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        Family {
            out,
            name: name.to_string(),
        }
    }

    /// One sample of the family.
    pub fn sample(&mut self, labels: &Labels<'_>, value: impl std::fmt::Display) {
        self.sample_of("", labels, value);
    }

    /// One sample of a histogram's series `<name><suffix>` (`_bucket` with an `le` label,
    /// `_sum`, `_count`).
    pub fn sample_of(&mut self, suffix: &str, labels: &Labels<'_>, value: impl std::fmt::Display) {
        self.out.push_str(&self.name);
        self.out.push_str(suffix);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (key, value)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{key}=\"");
                escape_label_value(self.out, value);
                self.out.push('"');
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }
}

/// Label values are quoted: backslash, double quote and line feed are escaped (the text
/// format's only escapes), so an odd NQN or image name cannot break the exposition.
fn escape_label_value(out: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_and_escaped_label_values() {
        let mut out = String::new();
        Family::new(&mut out, "x_total", "counter", "test").sample(&[("device", "a\"b\\c\nd")], 1);
        Family::new(&mut out, "up", "gauge", "plain").sample(&[], 0.5);
        let mut h = Family::new(&mut out, "lat_seconds", "histogram", "h");
        h.sample_of("_bucket", &[("le", "+Inf")], 2);
        h.sample_of("_count", &[], 2);
        assert_eq!(
            out,
            "# HELP x_total test\n# TYPE x_total counter\nx_total{device=\"a\\\"b\\\\c\\nd\"} 1\n\
             # HELP up plain\n# TYPE up gauge\nup 0.5\n\
             # HELP lat_seconds h\n# TYPE lat_seconds histogram\n\
             lat_seconds_bucket{le=\"+Inf\"} 2\nlat_seconds_count 2\n"
        );
    }
}
