//! How the daemon asks glibc's allocator to give memory back. The agent idles for hours
//! between bursts that handle a whole source at once: a 1,000-certificate ConfigMap is a
//! megabyte of JSON, parsed into a megabyte of certificates and rendered into a megabyte
//! bundle, with the file read and the replaced bundle beside them. Left to its defaults,
//! glibc keeps most of what such a burst freed. Measured after 20 rotations of a
//! 1,000-certificate ConfigMap and a scrape: 36 MiB resident by default, of which 8 MiB
//! is the program itself and about 6 MiB live data; 20.5 MiB with the fixed threshold
//! below; 15.9 MiB with the trim after each large pass too.

/// Allocations this large are given their own mapping, which is returned to the system
/// when freed. glibc's default starts here too, but raises the threshold to the size of
/// each large block freed (up to 32 MiB), after which every megabyte-sized buffer is
/// carved from the heaps and stays there once freed: a fixed threshold keeps the rule.
const MMAP_THRESHOLD: usize = 128 * 1024;

/// A pass that handled a bundle at least this large ends by returning free memory.
const TRIM_AFTER: usize = 256 * 1024;

/// Sets the allocator's parameters, before the runtime starts its threads.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt sets a parameter of the allocator; it is thread-safe and takes no
    // pointer.
    unsafe {
        nix::libc::mallopt(
            nix::libc::M_MMAP_THRESHOLD,
            MMAP_THRESHOLD as nix::libc::c_int,
        );
    }
}

/// After a pass that handled `bytes` of bundle: when that is large, returns the free
/// memory of every heap to the system (the small blocks that parsing and rendering left
/// free between live ones, which no threshold returns). Costs well under a millisecond.
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
