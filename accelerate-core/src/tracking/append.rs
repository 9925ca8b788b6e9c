//! An append-only file of whole records: each append is written and handed to the operating
//! system before it returns (a crash of the process loses nothing appended), and an append that
//! fails part-way is cut back off, so the file never ends in a partial record.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::io_error;
use crate::error::{Error, Result};
use crate::files::write_atomic;

/// A file that only grows by whole records.
#[derive(Debug)]
pub(super) struct AppendFile {
    path: PathBuf,
    /// `None` after a rewrite whose reopen failed: the next append reopens the new file (never
    /// the replaced one, whose inode the rename unlinked).
    file: Option<File>,
    /// Length of the file after the last whole record.
    len: u64,
}

#[cfg(test)]
thread_local! {
    /// Tests: how many of this thread's next opens fail (as a full inode table would).
    pub(super) static FAILING_OPENS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl AppendFile {
    /// Opens `path` for appending, creating it if missing (`create_new`: refusing an existing one).
    pub(super) fn open(path: &Path, create_new: bool) -> Result<Self> {
        #[cfg(test)]
        if FAILING_OPENS.with(|n| n.replace(n.get().saturating_sub(1))) > 0 {
            let e = std::io::Error::from_raw_os_error(libc::ENOSPC);
            return Err(io_error(path, "opening the file", e));
        }
        let mut options = OpenOptions::new();
        options.append(true);
        if create_new {
            options.create_new(true);
        } else {
            options.create(true);
        }
        let file = options
            .open(path)
            .map_err(|e| io_error(path, "opening the file", e))?;
        let len = file
            .metadata()
            .map_err(|e| io_error(path, "reading the file's length", e))?
            .len();
        Ok(Self {
            path: path.to_path_buf(),
            file: Some(file),
            len,
        })
    }

    /// The file's path.
    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// The file's length (the end of its last whole record).
    pub(super) fn len(&self) -> u64 {
        self.len
    }

    /// Replaces the whole file with `contents` atomically (temporary file, fsync, rename). `Ok`
    /// means the file now holds `contents`, even when reopening it for the next append failed:
    /// that append reopens it (and fails, naming the file, if it still cannot).
    pub(super) fn rewrite(&mut self, contents: &[u8]) -> Result<()> {
        write_atomic(&self.path, contents).map_err(|e| Error::Tracking {
            path: self.path.clone(),
            problem: format!(
                "rewriting the file failed ({e}); check that the logging directory is writable \
                 and has free space, or choose another `logging_dir`"
            ),
        })?;
        self.len = contents.len() as u64;
        self.file = Self::open(&self.path, false)
            .ok()
            .and_then(|reopened| reopened.file);
        Ok(())
    }

    /// Appends `record` whole, or not at all.
    pub(super) fn append(&mut self, record: &[u8]) -> Result<()> {
        let file = match &mut self.file {
            Some(file) => file,
            None => {
                let reopened = Self::open(&self.path, false)?;
                self.len = reopened.len;
                self.file.insert(reopened.file.expect("an open file"))
            }
        };
        // `File` is unbuffered: `write_all` issues the writes, `flush` is for form's sake.
        match file.write_all(record).and_then(|()| file.flush()) {
            Ok(()) => {
                self.len += record.len() as u64;
                Ok(())
            }
            Err(e) => {
                // A full disk can take part of the record; drop that part.
                let _ = file.set_len(self.len);
                Err(io_error(&self.path, "appending a record", e))
            }
        }
    }

    /// Makes the appended records durable.
    pub(super) fn sync(&mut self) -> Result<()> {
        let Some(file) = &self.file else {
            // Nothing appended since the rewrite, which synced its file.
            return Ok(());
        };
        file.sync_all()
            .map_err(|e| io_error(&self.path, "syncing the file to disk", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_append_names_the_file_and_the_fix() {
        // /dev/full accepts opening and fails every write with ENOSPC.
        let path = Path::new("/dev/full");
        if !path.exists() {
            eprintln!("skipped: no /dev/full on this system");
            return;
        }
        let mut file = AppendFile::open(path, false).unwrap();
        let err = file.append(b"record\n").unwrap_err().to_string();
        assert!(err.contains("/dev/full"), "{err}");
        assert!(
            err.contains("space") && err.contains("logging_dir"),
            "{err}"
        );
    }

    #[test]
    fn appends_accumulate_whole_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut file = AppendFile::open(&path, true).unwrap();
        file.append(b"ab").unwrap();
        file.append(b"cd").unwrap();
        assert_eq!(file.len(), 4);
        assert_eq!(std::fs::read(&path).unwrap(), b"abcd");
        assert!(
            AppendFile::open(&path, true).is_err(),
            "create_new refuses an existing file"
        );
        let reopened = AppendFile::open(&path, false).unwrap();
        assert_eq!(reopened.len(), 4);
    }
}
