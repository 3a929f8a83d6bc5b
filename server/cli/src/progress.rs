//! The per-round table on stdout, with a progress bar (indicatif) on a
//! terminal.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::results::RoundRow;

/// Prints the header, the progress bar and the rows.
pub(crate) struct Progress {
    bar: ProgressBar,
}

impl Progress {
    pub(crate) fn new(rounds: u64) -> Self {
        println!(
            "{:>5}  {:>8}  {:>7}  {:>11}  {:>8}  {:>12}  {:>8}  {:>12}  {:>9}",
            "round",
            "accuracy",
            "loss",
            "client loss",
            "seconds",
            "up/client",
            "of f32",
            "down/client",
            "survivors"
        );
        // Hidden where stdout is not a terminal: the rows alone are printed.
        let bar = ProgressBar::with_draw_target(Some(rounds), ProgressDrawTarget::stdout());
        bar.set_style(
            ProgressStyle::with_template("[{bar:30}] {pos}/{len} rounds  {elapsed}  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("#>."),
        );
        Self { bar }
    }

    pub(crate) fn row(&self, row: &RoundRow) {
        // Printed above the bar on a terminal, plainly otherwise.
        self.bar.suspend(|| println!("{}", format_row(row)));
        self.bar.set_position(row.round);
        self.bar.set_message("");
    }

    /// A line of its own between the rows.
    pub(crate) fn println(&self, line: &str) {
        self.bar.suspend(|| println!("{line}"));
    }

    /// Rounds done and what the current one is doing.
    pub(crate) fn bar(&self, done: u64, stage: &str) {
        self.bar.set_position(done);
        self.bar.set_message(stage.to_string());
    }

    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// A bar on stderr (hidden where it is not a terminal) counting `len`
/// things of a bench as they finish, ticking while none does.
pub(crate) fn counter(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{{spinner}} [{{bar:30}}] {{pos}}/{{len}} {what}  {{elapsed}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("#>."),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(250));
    bar
}

fn format_row(row: &RoundRow) -> String {
    format!(
        "{:>5}  {:>7.2}%  {:>7.4}  {:>11}  {:>8.1}  {:>12}  {:>7.1}%  {:>12}  {:>9}{}",
        row.round,
        row.accuracy * 100.0,
        row.loss,
        row.client_loss.map_or_else(|| "—".to_string(), |loss| format!("{loss:.4}")),
        row.seconds,
        human_bytes(row.bytes_up_per_client),
        row.compression_ratio * 100.0,
        human_bytes(row.bytes_down_per_client),
        row.survivors,
        row.epsilon.map_or_else(String::new, |epsilon| format!("  ε {epsilon:.3}"))
    )
}

fn human_bytes(bytes: f64) -> String {
    match bytes {
        b if b >= 1e6 => format!("{:.2} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} kB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_shows_the_upload_against_float32() {
        let row = RoundRow {
            round: 3,
            accuracy: 0.8688,
            loss: 0.41,
            client_loss: Some(0.3),
            seconds: 2.5,
            sim_seconds: None,
            bytes_up_per_client: 301_100.0,
            bytes_down_per_client: 796_800.0,
            survivors: 10,
            compression_ratio: 0.378,
            masked_input_ratio: None,
            epsilon: None,
            staleness: None,
            wrapped: None,
            ring_scale: None,
        };
        let text = format_row(&row);
        assert!(text.contains("86.88%"), "{text}");
        assert!(text.contains("301.1 kB"), "{text}");
        assert!(text.contains("37.8%"), "{text}");
        assert!(text.contains("796.8 kB"), "{text}");
    }
}
