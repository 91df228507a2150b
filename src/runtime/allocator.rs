//! How the daemon gives memory back to the system. The agent idles for hours between
//! bursts that handle a whole source at once: a 1,000-certificate ConfigMap is a megabyte
//! of JSON, parsed into a megabyte of certificates and rendered into a megabyte bundle,
//! with the file read and the replaced bundle beside them. glibc keeps most of what such a
//! burst frees: after the first large block is freed it raises its mmap threshold to that
//! size, so later megabyte buffers are carved from the heaps (one per thread that
//! allocates), and free memory below the top of a heap is never returned by itself.
//!
//! Measured after 20 rotations of a 1,000-certificate ConfigMap and a scrape (the steps
//! of the daemon benchmark): 36 MiB resident with glibc's defaults, of which 8 MiB is the
//! program itself and about 6 MiB live data; 22 MiB with [`after_pass`]. A fixed mmap
//! threshold (128 KiB) brought it to 16 MiB, but made each scrape of 1,000 certificates
//! about 1.3 ms slower (its large buffers mapped and faulted in anew every time), so it is
//! not used; limiting the number of arenas made no difference.

/// A pass that handled a bundle at least this large ends by returning free memory.
const TRIM_AFTER: usize = 256 * 1024;

/// After a pass that handled `bytes` of bundle: when that is large, returns the free
/// memory of every heap to the system (`malloc_trim` releases the free pages inside the
/// heaps too, not only at their top). Well under a millisecond, and only after a pass
/// that parsed, rendered or compared a megabyte.
pub fn after_pass(bytes: usize) {
    if bytes < TRIM_AFTER {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory; it is thread-safe.
    unsafe {
        nix::libc::malloc_trim(0);
    }
}
