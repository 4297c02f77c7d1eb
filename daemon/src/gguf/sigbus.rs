//! Model files truncated while mapped: a read of a page past the file's new end raises SIGBUS,
//! which would kill the daemon and every request it serves. Each memory-mapped model file
//! registers its map here ([`MapGuard`]); a SIGBUS inside a registered map replaces the map from
//! the faulting page to its end with zero pages (the read then goes on and gets zeros) and
//! marks the map as faulted, which [`MapGuard::faulted`] reports and
//! [`super::reader::GgufFile::intact`] turns into an error, so the request that read it fails
//! and nothing it computed from the zeros reaches anyone. A SIGBUS anywhere else goes to the
//! handler that was installed before (the standard library's, or the default action).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, Once, OnceLock};

/// Maps guarded at once; a process rarely holds more than a few model files.
const SLOTS: usize = 64;

struct Region {
    /// Start address and length; a length of 0 is a free slot.
    start: AtomicUsize,
    len: AtomicUsize,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Region = Region {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    faulted: AtomicBool::new(false),
};

static REGIONS: [Region; SLOTS] = [FREE; SLOTS];
/// Serialises claiming and freeing slots (never taken in the handler).
static CLAIM: Mutex<()> = Mutex::new(());
static INSTALL: Once = Once::new();
/// The action before ours, to pass faults outside the maps on to.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
static PAGE: AtomicUsize = AtomicUsize::new(4096);

/// A guarded map: its slot, freed when dropped (drop it before unmapping).
pub(crate) struct MapGuard {
    slot: Option<usize>,
}

impl MapGuard {
    /// Guards the `len` bytes mapped at `start`. Without a free slot the map is not guarded
    /// (a truncation then kills the process, as it would without this module).
    pub(crate) fn new(start: *const u8, len: usize) -> MapGuard {
        install();
        let _claim = CLAIM.lock().unwrap_or_else(|e| e.into_inner());
        let slot = REGIONS
            .iter()
            .position(|r| r.len.load(Ordering::Acquire) == 0);
        if let Some(i) = slot {
            let r = &REGIONS[i];
            r.faulted.store(false, Ordering::Release);
            r.start.store(start as usize, Ordering::Release);
            r.len.store(len, Ordering::Release);
        } else {
            tracing::warn!("more than {SLOTS} model files mapped: this one is not guarded");
        }
        MapGuard { slot }
    }

    /// Whether a read of the map found its file shorter than the map (the pages from there on
    /// now read as zeros).
    pub(crate) fn faulted(&self) -> bool {
        self.slot
            .is_some_and(|i| REGIONS[i].faulted.load(Ordering::Acquire))
    }
}

impl Drop for MapGuard {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            let _claim = CLAIM.lock().unwrap_or_else(|e| e.into_inner());
            REGIONS[i].len.store(0, Ordering::Release);
            REGIONS[i].start.store(0, Ordering::Release);
        }
    }
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page > 0 {
            PAGE.store(page as usize, Ordering::Relaxed);
        }
        // SAFETY: zeroed sigaction structs are valid; `sigaction` is given valid pointers and
        // the handler below only does async-signal-safe work (atomics, mmap, sigaction).
        unsafe {
            let mut previous: libc::sigaction = std::mem::zeroed();
            let mut ours: libc::sigaction = std::mem::zeroed();
            ours.sa_sigaction = on_sigbus as *const () as usize;
            ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut ours.sa_mask);
            if libc::sigaction(libc::SIGBUS, &ours, &mut previous) == 0 {
                let _ = PREVIOUS.set(previous);
            } else {
                tracing::warn!(
                    "no SIGBUS handler: a model file truncated while loaded kills the daemon"
                );
            }
        }
    });
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for a SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    let page = PAGE.load(Ordering::Relaxed);
    for r in &REGIONS {
        let (start, len) = (
            r.start.load(Ordering::Acquire),
            r.len.load(Ordering::Acquire),
        );
        if len == 0 || addr < start || addr >= start + len {
            continue;
        }
        let from = addr & !(page - 1);
        // SAFETY: [from, start + len) lies inside the registered map, which stays mapped while
        // registered; replacing it with private zero pages leaves it readable.
        let mapped = unsafe {
            libc::mmap(
                from as *mut libc::c_void,
                start + len - from,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if mapped != libc::MAP_FAILED {
            r.faulted.store(true, Ordering::Release);
            return;
        }
        break;
    }
    // Not ours (or the pages could not be replaced): the action before ours.
    match PREVIOUS.get() {
        Some(p) if p.sa_sigaction != libc::SIG_DFL && p.sa_sigaction != libc::SIG_IGN => {
            if p.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: a SA_SIGINFO handler installed before ours, called as the kernel would.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(p.sa_sigaction) };
                f(sig, info, ctx);
            } else {
                // SAFETY: as above, a plain handler.
                let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(p.sa_sigaction) };
                f(sig);
            }
        }
        _ => {
            // The default action: restore it; the faulting read runs again and ends the
            // process as it would have without us.
            // SAFETY: a zeroed sigaction with SIG_DFL is valid.
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            }
        }
    }
}
