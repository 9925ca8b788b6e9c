//! The shared mapping of the shared-memory transport: its layout, creation and opening.
//!
//! One file (in `/dev/shm`, unlinked as soon as every rank has mapped it) holds:
//!
//! | offset            | what                                                                |
//! |-------------------|---------------------------------------------------------------------|
//! | 0                 | header: magic, world size, nonce, piece size, total size            |
//! | 128               | abort record: state, failed rank, reporting rank, reason text       |
//! | 4096 + 512·r      | control block of rank r: three progress counters, each on its own   |
//! |                   | cache lines, then waiter count, departed flag, whom it waits on, pid |
//! | staging           | per rank, two halves (double buffering) of: a 64-byte round tag,    |
//! |                   | then `world_size` pieces of `piece_bytes`                           |
//!
//! Only rank `r` writes its control block's counters and its staging slot; everybody reads them.
//! Counters are 32-bit because futexes are; they count rounds and wrap, and are compared with
//! wrapping arithmetic.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};

/// Identifies the mapping (and its layout version).
const MAGIC: u64 = u64::from_le_bytes(*b"ACCSHM01");
/// Header and abort record.
const HEADER_BYTES: usize = 4096;
/// Per-rank control block.
const CONTROL_BYTES: usize = 512;
/// Distance between counters that different ranks poll: two cache lines, so that the adjacent
/// line prefetcher does not make unrelated counters share traffic.
const LINE: usize = 128;
/// Round tag at the start of each staging half.
pub(crate) const TAG_BYTES: usize = 64;
/// Alignment of pieces: a cache line, and a multiple of every element size.
pub(crate) const PIECE_ALIGN: usize = 64;
/// Longest abort reason kept.
pub(crate) const MAX_REASON_BYTES: usize = 2048;
const PAGE: usize = 4096;

// The abort record: four 32-bit words one after the other (state, failed rank, reporter, reason
// length), then the reason's bytes.
const ABORT_STATE: usize = 128;
const ABORT_FAILED: usize = ABORT_STATE + 4;
const ABORT_REPORTER: usize = ABORT_FAILED + 4;
const ABORT_LEN: usize = ABORT_REPORTER + 4;
const ABORT_REASON: usize = ABORT_LEN + 4;

// The abort record fits in the header page, the control words in a control block.
const _: () = assert!(ABORT_REASON + MAX_REASON_BYTES <= HEADER_BYTES);
const _: () = assert!(3 * LINE + 24 <= CONTROL_BYTES);

/// The abort record is free.
pub(crate) const ABORT_NONE: u32 = 0;
/// A rank is writing the abort record.
pub(crate) const ABORT_WRITING: u32 = 1;
/// The abort record is complete.
pub(crate) const ABORT_POSTED: u32 = 2;

/// The three progress counters of a rank; each counts the rounds (since the mapping was created)
/// for which the rank has done that step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counter {
    /// Its staging half for the round holds its data (and the round tag).
    Published,
    /// The reduced piece it owns is in its staging half (all-reduce).
    Reduced,
    /// It has finished reading the other ranks' staging halves of the round.
    Consumed,
}

impl Counter {
    fn offset(self) -> usize {
        match self {
            Counter::Published => 0,
            Counter::Reduced => LINE,
            Counter::Consumed => 2 * LINE,
        }
    }

    /// What a rank has done when this counter moves, for messages.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Counter::Published => "publish its data",
            Counter::Reduced => "publish its reduced piece",
            Counter::Consumed => "finish reading the staged data",
        }
    }

    /// All counters.
    pub(crate) const ALL: [Counter; 3] = [Counter::Published, Counter::Reduced, Counter::Consumed];
}

/// Sizes of the parts of a mapping, derived from the world size and the piece size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Number of ranks.
    pub world_size: usize,
    /// Bytes of one piece (a multiple of [`PIECE_ALIGN`]).
    pub piece_bytes: usize,
}

impl Layout {
    fn staging_base(&self) -> usize {
        align_up(HEADER_BYTES + self.world_size * CONTROL_BYTES, PAGE)
    }

    /// Bytes of one staging half: the tag and one piece per rank, page-aligned.
    fn half_bytes(&self) -> usize {
        align_up(TAG_BYTES + self.world_size * self.piece_bytes, PAGE)
    }

    /// Size of the whole mapping.
    pub fn total_bytes(&self) -> usize {
        self.staging_base() + 2 * self.world_size * self.half_bytes()
    }

    /// [`Layout::total_bytes`], or `None` where it does not fit in a `usize` (a layout read from
    /// a file, not one this process made).
    fn checked_total_bytes(&self) -> Option<usize> {
        let base = (self.world_size.checked_mul(CONTROL_BYTES)?)
            .checked_add(HEADER_BYTES)?
            .checked_next_multiple_of(PAGE)?;
        let half = (self.world_size.checked_mul(self.piece_bytes)?)
            .checked_add(TAG_BYTES)?
            .checked_next_multiple_of(PAGE)?;
        half.checked_mul(2)?
            .checked_mul(self.world_size)?
            .checked_add(base)
    }

    fn half_offset(&self, rank: usize, half: usize) -> usize {
        self.staging_base() + (2 * rank + half) * self.half_bytes()
    }
}

/// The piece size for `chunk_bytes` in a world of `world_size`: aligned up to [`PIECE_ALIGN`],
/// and capped so that a rank's two staging halves stay within `max_slot_bytes`.
pub(crate) fn piece_bytes_for(
    chunk_bytes: usize,
    world_size: usize,
    max_slot_bytes: usize,
) -> usize {
    let wanted = align_up(chunk_bytes.max(1), PIECE_ALIGN);
    let cap = (max_slot_bytes / (2 * world_size.max(1))) / PIECE_ALIGN * PIECE_ALIGN;
    wanted.min(cap).max(PIECE_ALIGN)
}

fn align_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// Words of the header: magic, world size, nonce (two words), piece size, total size.
pub(crate) const HEADER_WORDS: usize = 6;

/// The header words of a mapping with `layout` for the job with `nonce` (see [`parse_header`]).
pub(crate) fn header_words(layout: Layout, nonce: u128) -> [u64; HEADER_WORDS] {
    [
        MAGIC,
        layout.world_size as u64,
        nonce as u64,
        (nonce >> 64) as u64,
        layout.piece_bytes as u64,
        layout.total_bytes() as u64,
    ]
}

/// Checks the header words of a mapping of `file_len` bytes against what this rank expects (the
/// job's `nonce`, its `world_size`) and returns the layout they describe. The words come from a
/// file another process wrote: every size is checked, with overflow-checked arithmetic, before
/// anything is addressed through it.
pub(crate) fn parse_header(
    header: &[u64; HEADER_WORDS],
    world_size: usize,
    nonce: u128,
    file_len: usize,
) -> Result<Layout, String> {
    let found_nonce = header[2] as u128 | ((header[3] as u128) << 64);
    if header[0] != MAGIC || found_nonce != nonce {
        return Err("not the shared memory of this job (wrong magic or nonce)".into());
    }
    if header[1] != world_size as u64 {
        return Err(format!(
            "created for {} ranks, this rank expects {world_size}",
            header[1]
        ));
    }
    let inconsistent = || {
        format!(
            "inconsistent layout (piece {} bytes, {} bytes recorded, {file_len} bytes in the \
             file)",
            header[4], header[5]
        )
    };
    let piece_bytes = usize::try_from(header[4]).map_err(|_| inconsistent())?;
    let layout = Layout {
        world_size,
        piece_bytes,
    };
    let sane = piece_bytes >= PIECE_ALIGN
        && piece_bytes % PIECE_ALIGN == 0
        && header[5] == file_len as u64
        && layout.checked_total_bytes() == Some(file_len);
    if !sane {
        return Err(inconsistent());
    }
    Ok(layout)
}

/// Decodes an abort record another rank wrote: the words (failed rank, reporting rank, reason
/// length) and the reason area. A length beyond the area is cut to it; the text is decoded
/// leniently (it may have been cut inside a character), since it is only shown.
pub(crate) fn parse_abort_record(
    words: [u32; 3],
    area: &[u8; MAX_REASON_BYTES],
) -> (usize, usize, String) {
    let [failed, reporter, len] = words.map(|w| w as usize);
    let text = String::from_utf8_lossy(&area[..len.min(MAX_REASON_BYTES)]).into_owned();
    (failed, reporter, text)
}

/// A mapped shared region.
#[derive(Debug)]
pub(crate) struct Region {
    map: MmapRaw,
    layout: Layout,
}

impl Region {
    /// Creates the file at `path` (which must not exist), sizes and maps it, and writes the header.
    pub fn create(path: &Path, layout: Layout, nonce: u128) -> std::io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        let total = layout.total_bytes();
        reserve(&file, total)?;
        let region = Self {
            map: map(&file, total)?,
            layout,
        };
        let header = header_words(layout, nonce);
        // The magic goes last: a rank that sees it sees the whole header.
        for (i, word) in header.iter().enumerate().skip(1) {
            region.word64(8 * i).store(*word, Ordering::Relaxed);
        }
        region.word64(0).store(header[0], Ordering::SeqCst);
        Ok(region)
    }

    /// Opens and maps the file at `path` created by [`Region::create`], checking that it is the
    /// mapping of this job (`nonce`) for `world_size` ranks. `Err` says what is wrong.
    pub fn open(path: &Path, world_size: usize, nonce: u128) -> Result<Self, String> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| format!("opening {}: {e}", path.display()))?;
        let len = file
            .metadata()
            .map_err(|e| format!("reading the size of {}: {e}", path.display()))?
            .len() as usize;
        if len < HEADER_BYTES {
            return Err(format!("{} holds only {len} bytes", path.display()));
        }
        let map = map(&file, len).map_err(|e| format!("mapping {}: {e}", path.display()))?;
        let provisional = Self {
            map,
            layout: Layout {
                world_size,
                piece_bytes: PIECE_ALIGN,
            },
        };
        let header: [u64; HEADER_WORDS] =
            std::array::from_fn(|i| provisional.word64(8 * i).load(Ordering::SeqCst));
        let layout = parse_header(&header, world_size, nonce, len)
            .map_err(|problem| format!("{}: {problem}", path.display()))?;
        Ok(Self {
            map: provisional.map,
            layout,
        })
    }

    /// The layout of this mapping.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    fn word32(&self, offset: usize) -> &AtomicU32 {
        assert!(offset % 4 == 0 && offset + 4 <= self.map.len());
        // SAFETY: in bounds and aligned (the mapping is page-aligned); the mapping lives as long
        // as `self`, and the word is only ever accessed atomically, by every process.
        unsafe { &*self.map.as_mut_ptr().add(offset).cast::<AtomicU32>() }
    }

    fn word64(&self, offset: usize) -> &AtomicU64 {
        assert!(offset % 8 == 0 && offset + 8 <= self.map.len());
        // SAFETY: as in `word32`.
        unsafe { &*self.map.as_mut_ptr().add(offset).cast::<AtomicU64>() }
    }

    fn control(&self, rank: usize) -> usize {
        assert!(rank < self.layout.world_size);
        HEADER_BYTES + rank * CONTROL_BYTES
    }

    /// A progress counter of `rank`.
    pub fn counter(&self, rank: usize, counter: Counter) -> &AtomicU32 {
        self.word32(self.control(rank) + counter.offset())
    }

    /// How many ranks are waiting (or about to wait) on a counter of `rank`.
    pub fn waiters(&self, rank: usize) -> &AtomicU32 {
        self.word32(self.control(rank) + 3 * LINE)
    }

    /// Set (to 1) when `rank` dropped its communicator.
    pub fn departed(&self, rank: usize) -> &AtomicU32 {
        self.word32(self.control(rank) + 3 * LINE + 4)
    }

    /// `1 + ` the rank that `rank` is currently blocked on, or 0.
    pub fn waiting_on(&self, rank: usize) -> &AtomicU32 {
        self.word32(self.control(rank) + 3 * LINE + 8)
    }

    /// The process id of `rank`.
    pub fn pid(&self, rank: usize) -> &AtomicU32 {
        self.word32(self.control(rank) + 3 * LINE + 12)
    }

    /// The start time of the process of `rank` (clock ticks since boot), to tell a reused pid.
    pub fn start_time(&self, rank: usize) -> &AtomicU64 {
        self.word64(self.control(rank) + 3 * LINE + 16)
    }

    /// State of the abort record ([`ABORT_NONE`], [`ABORT_WRITING`], [`ABORT_POSTED`]).
    pub fn abort_state(&self) -> &AtomicU32 {
        self.word32(ABORT_STATE)
    }

    /// Writes the abort record; the caller must have moved the state to [`ABORT_WRITING`], and
    /// moves it to [`ABORT_POSTED`] afterwards.
    pub fn write_abort(&self, failed: usize, reporter: usize, reason: &str) {
        let bytes = &reason.as_bytes()[..reason.len().min(MAX_REASON_BYTES)];
        self.word32(ABORT_FAILED)
            .store(failed as u32, Ordering::Relaxed);
        self.word32(ABORT_REPORTER)
            .store(reporter as u32, Ordering::Relaxed);
        self.word32(ABORT_LEN)
            .store(bytes.len() as u32, Ordering::Relaxed);
        // SAFETY: the reason area lies inside the header page; only the rank that won the
        // ABORT_NONE -> ABORT_WRITING exchange writes it, and readers wait for ABORT_POSTED.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.map.as_mut_ptr().add(ABORT_REASON),
                bytes.len(),
            );
        }
    }

    /// Reads a posted abort record: failed rank, reporting rank, reason.
    pub fn read_abort(&self) -> (usize, usize, String) {
        let words = [ABORT_FAILED, ABORT_REPORTER, ABORT_LEN]
            .map(|offset| self.word32(offset).load(Ordering::Relaxed));
        let mut area = [0u8; MAX_REASON_BYTES];
        // SAFETY: inside the header page; written once before ABORT_POSTED, which the caller
        // observed with acquire ordering.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(ABORT_REASON),
                area.as_mut_ptr(),
                MAX_REASON_BYTES,
            );
        }
        parse_abort_record(words, &area)
    }

    /// The round tag words of `rank`'s staging half `half`.
    pub fn tag(&self, rank: usize, half: usize) -> [&AtomicU64; TAG_BYTES / 8] {
        let base = self.layout.half_offset(rank, half);
        std::array::from_fn(|i| self.word64(base + 8 * i))
    }

    /// Pointer to the data area (after the tag) of `rank`'s staging half `half`, and its size in
    /// bytes (`world_size * piece_bytes`).
    pub fn data(&self, rank: usize, half: usize) -> (*mut u8, usize) {
        assert!(rank < self.layout.world_size && half < 2);
        let offset = self.layout.half_offset(rank, half) + TAG_BYTES;
        let bytes = self.layout.world_size * self.layout.piece_bytes;
        assert!(offset + bytes <= self.map.len());
        // SAFETY: in bounds, checked above.
        (unsafe { self.map.as_mut_ptr().add(offset) }, bytes)
    }
}

/// Sizes `file` to `len` bytes with its memory reserved. A tmpfs file is otherwise sparse: a
/// full `/dev/shm` (Docker's default is 64 MiB) would then kill the process with SIGBUS in the
/// middle of a collective instead of failing here, where the job can still choose TCP.
fn reserve(file: &File, len: usize) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open file descriptor; posix_fallocate only changes the file.
        let code = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
        if code != 0 {
            return Err(std::io::Error::from_raw_os_error(code));
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    file.set_len(len as u64)
}

fn map(file: &File, len: usize) -> std::io::Result<MmapRaw> {
    // Populate: fault the pages in now rather than inside the first collectives.
    MmapOptions::new().len(len).populate().map_raw(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_aligned_and_capped_by_the_slot() {
        assert_eq!(piece_bytes_for(16, 2, 8 << 20), 64);
        assert_eq!(piece_bytes_for(100, 2, 8 << 20), 128);
        assert_eq!(piece_bytes_for(512 << 10, 2, 8 << 20), 512 << 10);
        // 64 ranks: 8 MiB / (2 * 64) = 64 KiB at most.
        assert_eq!(piece_bytes_for(512 << 10, 64, 8 << 20), 64 << 10);
        // Never below one aligned unit, whatever the world.
        assert_eq!(piece_bytes_for(512 << 10, 1 << 20, 8 << 20), 64);
    }

    #[test]
    fn parts_of_the_layout_do_not_overlap() {
        let layout = Layout {
            world_size: 3,
            piece_bytes: 192,
        };
        // Control blocks end before the staging area, halves are page-aligned and disjoint.
        assert!(HEADER_BYTES + 3 * CONTROL_BYTES <= layout.staging_base());
        assert_eq!(layout.half_bytes(), PAGE); // 64 + 3 * 192 = 640 bytes, one page
        assert_eq!(layout.half_offset(1, 1) - layout.half_offset(1, 0), PAGE);
        assert_eq!(layout.total_bytes(), layout.staging_base() + 6 * PAGE);
    }

    #[test]
    fn a_region_opens_only_with_its_nonce_and_world_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        let layout = Layout {
            world_size: 2,
            piece_bytes: 128,
        };
        let created = Region::create(&path, layout, 42).unwrap();
        // The memory is reserved, not sparse.
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.len() as usize, layout.total_bytes());
        assert!(
            meta.blocks() * 512 >= meta.len(),
            "{} blocks",
            meta.blocks()
        );
        assert!(
            Region::create(&path, layout, 43).is_err(),
            "must not reuse a file"
        );
        let opened = Region::open(&path, 2, 42).unwrap();
        assert_eq!(opened.layout(), layout);
        // Both mappings see the same memory.
        created
            .counter(1, Counter::Reduced)
            .store(7, Ordering::SeqCst);
        assert_eq!(
            opened.counter(1, Counter::Reduced).load(Ordering::SeqCst),
            7
        );
        assert_eq!(
            opened.counter(1, Counter::Published).load(Ordering::SeqCst),
            0
        );
        assert!(Region::open(&path, 2, 41).unwrap_err().contains("nonce"));
        assert!(Region::open(&path, 3, 42).unwrap_err().contains("2 ranks"));
        created.write_abort(1, 0, "why");
        assert_eq!(opened.read_abort(), (1, 0, "why".to_string()));
    }

    #[test]
    fn a_header_whose_sizes_overflow_is_refused() {
        // Regression (found while writing the shm_region_header fuzz target): a piece size near
        // 2^63 made the layout arithmetic overflow, which panics in debug builds and, wrapped in
        // release builds, could match a real file size and let offsets point outside the mapping.
        let real = Layout {
            world_size: 2,
            piece_bytes: 64,
        };
        let len = real.total_bytes();
        let mut header = header_words(real, 5);
        assert_eq!(parse_header(&header, 2, 5, len), Ok(real));
        header[4] = 1 << 63; // 2 * 2^63 wraps to 0: the same total as one 64-byte piece
        let e = parse_header(&header, 2, 5, len).unwrap_err();
        assert!(e.contains("inconsistent layout"), "{e}");
        header[4] = u64::MAX - 63;
        assert!(parse_header(&header, 2, 5, len).is_err());
    }
}
