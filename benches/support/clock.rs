//! CPU clocks, to the nanosecond, where /proc counts 10 ms ticks.

use std::time::Duration;

#[repr(C)]
struct Timespec {
    tv_sec: i64,
    tv_nsec: i64,
}

unsafe extern "C" {
    fn clock_gettime(clock: i32, time: *mut Timespec) -> i32;
}

fn read(clock: i32) -> Option<Duration> {
    let mut time = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `time` is a valid, writable timespec (64-bit time_t and long on the 64-bit
    // Linux targets these benchmarks run on); the call only writes it.
    (unsafe { clock_gettime(clock, &mut time) } == 0)
        .then(|| Duration::new(time.tv_sec as u64, time.tv_nsec as u32))
}

/// CPU time of process `pid`, every thread, exited ones included: its process CPU clock,
/// whose id is what clock_getcpuclockid(3) returns on Linux, `(~pid << 3) | CPUCLOCK_SCHED`.
#[allow(dead_code)] // not every benchmark uses it
pub fn process(pid: u32) -> Option<Duration> {
    const CPUCLOCK_SCHED: i32 = 2;
    read((!(pid as i32) << 3) | CPUCLOCK_SCHED)
}

/// CPU time of the calling thread (CLOCK_THREAD_CPUTIME_ID).
#[allow(dead_code)] // not every benchmark uses it
pub fn thread() -> Duration {
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    read(CLOCK_THREAD_CPUTIME_ID).unwrap_or_default()
}
