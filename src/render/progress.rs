//! The progress bars the commands draw on standard error while an analysis runs.

use std::io::IsTerminal;

/// A progress bar on standard error when it is a terminal (hidden otherwise), drawn with
/// `template` (indicatif's syntax); its length is set by the caller as the work becomes known.
pub fn progress_bar(template: &str) -> indicatif::ProgressBar {
    let bar = if std::io::stderr().is_terminal() {
        indicatif::ProgressBar::new(1)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(template)
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

/// The progress callback the analyses take (`done` of `total` steps so far), drawn on `bar`.
pub fn on_bar(bar: &indicatif::ProgressBar) -> impl FnMut(usize, usize) + '_ {
    move |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    }
}
