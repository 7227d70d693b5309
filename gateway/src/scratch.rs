//! Scratch directories for unit tests, so that passing runs leave nothing in `$TMPDIR`.
//!
//! Removed when dropped, unless the test is failing: its files are then kept for whoever
//! reads the failure. (`tempfile::TempDir` removes them either way.)

use std::path::{Path, PathBuf};

/// `$TMPDIR/<name>-<pid>`, empty when made; tests of one binary run at once, so each gives
/// its own `name`.
pub(crate) struct ScratchDir(PathBuf);

impl ScratchDir {
    pub(crate) fn new(name: &str) -> ScratchDir {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch directory");
        ScratchDir(dir)
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scratch_directory_is_gone_after_a_passing_test() {
        let dir = ScratchDir::new("scratch-unit");
        std::fs::write(dir.join("file"), b"x").expect("write");
        let path = dir.to_path_buf();
        assert!(path.join("file").exists());
        drop(dir);
        assert!(!path.exists());
    }

    #[test]
    fn a_failing_test_keeps_its_scratch_directory() {
        let path = std::thread::spawn(|| {
            let dir = ScratchDir::new("scratch-unit-failing");
            let path = dir.to_path_buf();
            // The test thread's panic, as a failing assertion would unwind it.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                let _dir = dir;
                panic!("a failing test");
            }));
            path
        })
        .join()
        .expect("thread");
        assert!(path.exists(), "kept while the test failed");
        let _ = std::fs::remove_dir_all(&path);
    }
}
