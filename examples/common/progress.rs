//! Progress bars (indicatif) on stderr, hidden when stdout is not a terminal or under CI, so
//! that logs and test output stay clean.
use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// Whether bars are drawn: stdout is a terminal and `CI` is not set to a true value.
pub fn bars_enabled() -> bool {
    let ci = std::env::var("CI").map(|v| !v.is_empty() && v != "false" && v != "0").unwrap_or(false);
    std::io::stdout().is_terminal() && !ci
}

/// A bar of `len` steps titled `prefix`, or a hidden one.
pub fn bar(len: u64, prefix: &str) -> ProgressBar {
    if !bars_enabled() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    let style = ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} {elapsed_precise} eta {eta} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    pb.set_style(style);
    pb.set_prefix(prefix.to_string());
    pb
}

/// Prints a line above the bar (or plainly when the bar is hidden).
pub fn println(pb: &ProgressBar, line: impl AsRef<str>) {
    if pb.is_hidden() {
        println!("{}", line.as_ref());
    } else {
        pb.println(line.as_ref());
    }
}
