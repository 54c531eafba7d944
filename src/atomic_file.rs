//! The one way tch-amp writes a file: into a temp file beside it, synced, renamed over it, the
//! folder synced. A leaf of the module graph (errors are `std::io::Error`s; callers wrap them).
//!
//! The temp file is named `.<file name>.<pid>-<n>.tch-amp-tmp` and holds an exclusive advisory
//! lock (flock) while it is written. A writer killed mid-save (SIGKILL, power loss) leaves it
//! behind, unlocked (the kernel drops the locks of a dead process): every save first removes
//! the temp files in its folder that it can lock, i.e. those of dead writers, whichever of
//! tch-amp's save functions wrote them; temp files of live writers (other processes or
//! threads) are locked and left alone.
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The suffix of tch-amp's temp files.
const TMP_SUFFIX: &str = ".tch-amp-tmp";

/// Distinguishes the temp files of one process's concurrent saves.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes `bytes` to `path` atomically (see the module doc).
pub(crate) fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_with(path, |w| w.write_all(bytes))
}

/// Writes what `fill` writes to `path` atomically (see the module doc): through a buffered
/// writer into the locked temp file, which is synced, renamed over `path` and the folder
/// synced. On any failure the temp file is removed and `path` is left as it was.
pub(crate) fn write_with(
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<&mut File>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let file_name = path.file_name().ok_or_else(|| std::io::Error::other("not a file path"))?;
    remove_stale_temps(dir);
    let (tmp, mut f) = create_locked_temp(dir, &file_name.to_string_lossy())?;
    let result = (|| {
        {
            let mut w = BufWriter::new(&mut f);
            fill(&mut w)?;
            w.flush()?;
        }
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // The rename is durable once the folder is synced.
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Creates a new temp file in `dir` and locks it. A cleaner in another save may have locked
/// and removed the file between its creation and our lock: then the path no longer names our
/// file, and we start again with a new name.
fn create_locked_temp(dir: &Path, file_name: &str) -> std::io::Result<(PathBuf, File)> {
    for _ in 0..16 {
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{file_name}.{}-{n}{TMP_SUFFIX}", std::process::id()));
        let f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        fs4::FileExt::lock(&f)?;
        if same_file(&f, &tmp) {
            return Ok((tmp, f));
        }
    }
    Err(std::io::Error::other("could not create a temp file: it was removed 16 times in a row"))
}

/// Whether `path` still names the open file `f`.
fn same_file(f: &File, path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (f.metadata(), std::fs::metadata(path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = f;
        path.exists()
    }
}

/// Removes tch-amp's temp files in `dir` whose writer is gone (those we can lock).
/// Best effort: errors leave the file for a later save.
fn remove_stale_temps(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        // Also the temp files of earlier tch-amp versions' torch_io::save.
        let ours = name.starts_with('.') && name.ends_with(TMP_SUFFIX);
        let legacy = name.starts_with(".tch-amp-save-") && name.ends_with(".tmp");
        if !(ours || legacy) {
            continue;
        }
        let Ok(f) = std::fs::OpenOptions::new().write(true).open(entry.path()) else { continue };
        if fs4::FileExt::try_lock(&f).is_ok() && same_file(&f, &entry.path()) {
            // Removed while we hold the lock, so no writer can have taken it meanwhile.
            let _ = std::fs::remove_file(entry.path());
        }
    }
}
