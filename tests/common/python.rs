//! The venv's python (torch 2.13.0) for tests whose expected values come from a PyTorch
//! reference script in scripts/reference/.
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `TCH_AMP_PYTHON` (written into .cargo/config.toml by `make setup`), at run or build time.
pub fn python() -> String {
    std::env::var("TCH_AMP_PYTHON").ok().or_else(|| option_env!("TCH_AMP_PYTHON").map(str::to_string)).expect(
        "TCH_AMP_PYTHON is not set: run `make setup` (it writes .cargo/config.toml) or point it at a \
         python with torch==2.13.0",
    )
}

/// Runs `scripts/reference/<script>` with `args` under the venv's python, killed after
/// `limit`; panics with its stderr when it fails or runs too long.
pub fn run_reference_script(script: &str, args: &[&str], limit: Duration) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/reference").join(script);
    let mut child = Command::new(python())
        .arg(path)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the venv's python");
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("waiting for python") {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().expect("piped stderr"), &mut err).ok();
            assert!(status.success(), "{script} {args:?} failed: {err}");
            return;
        }
        if start.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            panic!("{script} {args:?} ran past {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
