//! The per-round table on stdout, with a progress bar on a terminal.

use std::io::{IsTerminal, Write};
use std::time::Instant;

use crate::results::RoundRow;

/// Prints the header, the progress bar and the rows.
pub(crate) struct Progress {
    rounds: u64,
    tty: bool,
    started: Instant,
}

impl Progress {
    pub(crate) fn new(rounds: u64) -> Self {
        let progress = Self { rounds, tty: std::io::stdout().is_terminal(), started: Instant::now() };
        println!(
            "{:>5}  {:>8}  {:>7}  {:>11}  {:>8}  {:>12}  {:>12}  {:>9}",
            "round", "accuracy", "loss", "client loss", "seconds", "up/client", "down/client", "survivors"
        );
        progress
    }

    pub(crate) fn row(&self, row: &RoundRow) {
        if self.tty {
            print!("\r\x1b[2K");
        }
        println!(
            "{:>5}  {:>7.2}%  {:>7.4}  {:>11}  {:>8.1}  {:>12}  {:>12}  {:>9}{}",
            row.round,
            row.accuracy * 100.0,
            row.loss,
            row.client_loss.map_or_else(|| "—".to_string(), |loss| format!("{loss:.4}")),
            row.seconds,
            human_bytes(row.bytes_up_per_client),
            human_bytes(row.bytes_down_per_client),
            row.survivors,
            row.epsilon.map_or_else(String::new, |epsilon| format!("  ε {epsilon:.3}"))
        );
        self.bar(row.round, "");
    }

    /// A progress bar on a terminal; nothing otherwise (rows suffice).
    pub(crate) fn bar(&self, done: u64, stage: &str) {
        if !self.tty {
            return;
        }
        let width = 30;
        let filled = (done * width / self.rounds.max(1)) as usize;
        print!(
            "\r\x1b[2K[{}{}] {done}/{} rounds  {:.0}s  {stage}",
            "#".repeat(filled),
            ".".repeat(width as usize - filled),
            self.rounds,
            self.started.elapsed().as_secs_f64()
        );
        let _ = std::io::stdout().flush();
    }

    pub(crate) fn finish(&self) {
        if self.tty {
            println!();
        }
    }
}

fn human_bytes(bytes: f64) -> String {
    match bytes {
        b if b >= 1e6 => format!("{:.2} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} kB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}
