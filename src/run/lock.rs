//! One run per output directory: `OUT/.lock`, held with an exclusive OS file lock for as long as
//! the run lives and holding its pid. The OS releases the lock when the process exits, however
//! it exits (a crash or SIGKILL included), so a stale `.lock` file never blocks a later run.

use std::fs::{self, File, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The lock file of an output directory.
pub const LOCK_FILE: &str = ".lock";

/// An output directory held by this process; dropping it releases the lock.
#[derive(Debug)]
pub struct RunLock {
    /// The open, locked `.lock` file (the lock lives as long as this handle).
    _file: File,
    pub path: PathBuf,
}

impl RunLock {
    /// Lock `out_dir` (which must exist) for this run, or fail naming the directory and the pid
    /// of the run that holds it. Never blocks.
    pub fn acquire(out_dir: &Path) -> Result<RunLock> {
        let path = out_dir.join(LOCK_FILE);
        // Not truncated on open: the pid in it is the holder's until we hold the lock.
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| {
                format!(
                    "output.dir {}: cannot create {LOCK_FILE}\nhint: choose a writable output.dir",
                    out_dir.display()
                )
            })?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                let holder = match text.trim().parse::<u32>() {
                    Ok(pid) => format!("pid {pid}"),
                    Err(_) => "pid unknown".to_string(),
                };
                bail!(
                    "output.dir {} is in use by another horizon run ({holder})\nhint: wait for that run to finish or stop it, or give this run another output.dir (--set output.dir=...)",
                    out_dir.display()
                );
            }
            Err(TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("cannot lock {}", path.display()));
            }
        }
        let write_pid = |f: &mut File| -> std::io::Result<()> {
            f.set_len(0)?;
            f.rewind()?;
            writeln!(f, "{}", std::process::id())?;
            f.flush()
        };
        write_pid(&mut file).with_context(|| format!("cannot write {}", path.display()))?;
        Ok(RunLock { _file: file, path })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_directory_and_pid_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(dir.path()).unwrap();
        let pid = std::process::id();
        assert_eq!(fs::read_to_string(&first.path).unwrap().trim(), pid.to_string());
        // A lock is per open file: a second open in the same process conflicts like a second
        // process would.
        let e = format!("{:#}", RunLock::acquire(dir.path()).unwrap_err());
        let want = format!(
            "output.dir {} is in use by another horizon run (pid {pid})",
            dir.path().display()
        );
        assert!(e.contains(&want), "{e}");
        drop(first);
        let again = RunLock::acquire(dir.path()).unwrap();
        assert_eq!(fs::read_to_string(&again.path).unwrap().trim(), pid.to_string());
    }
}
