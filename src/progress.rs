//! The progress bar of long checks (`--verify mount`).

use std::io;

/// A progress bar on stderr for [`crate::manifest::verify_all`] and the view's check at
/// mount, drawn only when stderr is a terminal (a daemon's log, a pipe or CI get nothing).
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    pub fn new(label: &str) -> Progress {
        use std::io::IsTerminal;
        if !io::stderr().is_terminal() {
            return Progress { bar: None };
        }
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} {wide_bar} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {eta}",
            )
            .expect("valid template"),
        );
        bar.set_message(label.to_owned());
        Progress { bar: Some(bar) }
    }

    /// Whether anything is drawn.
    pub fn visible(&self) -> bool {
        self.bar.is_some()
    }

    /// For `verify_all`'s `progress` argument.
    pub fn update(&self, done: u64, total: u64) {
        if let Some(bar) = &self.bar {
            bar.set_length(total);
            bar.set_position(done);
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}
