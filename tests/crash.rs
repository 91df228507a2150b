//! Crash consistency (SPEC 12): `sync` killed with SIGKILL at random instants across
//! hundreds of rotations, while a reader reads the file continuously. Every read must be a
//! complete old or new bundle, and after a final run no temporary file may be left.

mod common;

use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use common::{Node, pki, stderr};

const ROTATIONS: usize = 240;

/// xorshift64*: enough randomness for kill instants, and reproducible from the printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[test]
fn sigkill_at_random_instants_never_tears_the_file() {
    let node = Node::new();
    let bundle_a = pki::bundle_of(40, "generation-a");
    let bundle_b = pki::bundle_of(48, "generation-b");
    let source_a = node.source("a.pem", &bundle_a);
    let source_b = node.source("b.pem", &bundle_b);

    // The kill window spans a whole rotation: start-up, read, write, fsync, rename, fsync.
    let mut full_run = Duration::ZERO;
    for source in [&source_a, &source_b, &source_a] {
        let started = Instant::now();
        let out = node.sync(&[source], &[]);
        assert!(out.status.success(), "{}", stderr(&out));
        full_run = full_run.max(started.elapsed());
    }

    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (path, stop) = (node.bundle(), stop.clone());
        let (a, b) = (bundle_a.clone().into_bytes(), bundle_b.clone().into_bytes());
        thread::spawn(move || {
            let (mut reads, mut torn) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                match fs::read(&path) {
                    Ok(bytes) if bytes == a || bytes == b => reads += 1,
                    Ok(_) => torn += 1,
                    Err(e) => panic!("the bundle could not be read: {e}"),
                }
            }
            (reads, torn)
        })
    };

    let seed = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("seed {seed}, one full sync takes {full_run:?}");
    let mut rng = Rng(seed);
    let window = full_run.as_micros() as u64 * 2 + 1;
    let (mut killed, mut finished, mut changes) = (0, 0, 0);
    let mut last = fs::read(node.bundle()).unwrap();
    for _ in 0..ROTATIONS {
        // Always ask for the bundle that is not on disk, so every run is a rotation.
        let source = if last == bundle_a.as_bytes() {
            &source_b
        } else {
            &source_a
        };
        let mut child = node
            .command("sync")
            .arg("--source")
            .arg(source)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        thread::sleep(Duration::from_micros(rng.next() % window));
        let _ = child.kill();
        let status = child.wait().unwrap();
        if status.signal() == Some(9) {
            killed += 1;
        } else {
            assert!(
                status.success(),
                "a sync that was not killed failed: {status}"
            );
            finished += 1;
        }
        let now = fs::read(node.bundle()).unwrap();
        if now != last {
            changes += 1;
            last = now;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let (reads, torn) = reader.join().unwrap();
    eprintln!(
        "{ROTATIONS} runs: {killed} killed, {finished} finished, {changes} rotations seen; {reads} reads"
    );
    assert_eq!(torn, 0, "{torn} reads saw a torn or foreign bundle");
    assert!(reads > 0);
    assert!(
        killed > ROTATIONS / 10,
        "too few runs were killed to mean anything: {killed}"
    );
    assert!(
        changes > ROTATIONS / 10,
        "too few rotations happened to mean anything: {changes}"
    );

    // A final, complete run cleans up whatever killed runs left behind.
    let out = node.sync(&[&source_a], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(fs::read(node.bundle()).unwrap(), bundle_a.as_bytes());
    assert!(
        node.stray_files().is_empty(),
        "left behind: {:?}",
        node.stray_files()
    );
}
