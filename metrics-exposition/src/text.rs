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
    /// Starts family `name` of `kind` ("gauge" or "counter") described by `help` (one line).
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
        self.out.push_str(&self.name);
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
        assert_eq!(
            out,
            "# HELP x_total test\n# TYPE x_total counter\nx_total{device=\"a\\\"b\\\\c\\nd\"} 1\n\
             # HELP up plain\n# TYPE up gauge\nup 0.5\n"
        );
    }
}
