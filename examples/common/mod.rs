//! Helpers shared by the examples (`mod common;` in each) and by `tests/examples.rs`:
//! the IDX data loader, the JSON-lines step log, a small ResNet-style CNN, the memory count,
//! the plot, progress bars and the training-loop plumbing (batches, schedules, evaluation).
//! Each example uses a part of it.
#![allow(dead_code)]

pub mod cli;
pub mod data;
pub mod log;
pub mod memory;
pub mod model;
pub mod plot;
pub mod progress;
pub mod train;

/// The examples' `main`: a logger for tch-amp's messages (overflows, at `warn` by default;
/// `RUST_LOG` changes it) on stderr, the opt-in to keeping freed CPU memory for reuse (a
/// program's choice, `tch_amp::cast::keep_freed_cpu_memory`), then `body`; an error is printed
/// as one line (with its causes), without a backtrace, exiting with status 1.
pub fn main(body: impl FnOnce() -> anyhow::Result<()>) -> std::process::ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let _ = tch_amp::cast::keep_freed_cpu_memory();
    match body() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
